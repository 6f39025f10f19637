"""What a person meets at the terminal: the mesh started and stopped (``up``/``down``), read (``status``, ``events``)
and acted on (``drain``, ``upgrade-driver``), as any other client of the bus, Redis and the cluster port would.

``shared.cli`` parses the command line and calls these; nothing here imports a service. The mesh's data is read
from where the mesh keeps it: the cluster (through the cluster port), the session registry in Redis (its key
layout is documented in ``services/checkpoint/registry.py`` and read here, never written), the lifecycle events
in the JetStream stream, and the telemetry on core NATS.
"""
