"""What a person meets at the terminal: the mesh started and stopped (``up``/``down``), read (``status``, ``events``)
and acted on (``drain``, ``upgrade-driver``), as any other client of the bus, Redis and the cluster port would.

``shared.cli`` parses the command line and calls the commands here, one module per role (``process``, ``observe``,
``nodes``, ``messages``, ``configdocs``, ``metrics``, ``sim``, ``agent``, ``natsauth``, ``rollout``) over the
modules that do the work (``operations``, ``snapshot``, ``events``, ``render``, ``client``, ``state``); nothing here
imports a service. The mesh's data is read from where the mesh keeps it: the cluster (through the cluster port),
the sessions through the checkpoint service's queries on the bus, the lifecycle events in the JetStream stream,
and the telemetry on core NATS.
"""
