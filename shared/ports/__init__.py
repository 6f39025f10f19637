"""The ports that hardware and the cluster sit behind: Protocols and their data only. Each has a real adapter
(``shared.adapters``: NVML, the Kubernetes API, the metrics sources) and a simulated one (``shared.sim``); which
one a service gets is decided in ``shared.wiring`` alone, and handed to the service as ``ctx.backends``
(``backends.Backends``). Services depend on the Protocols only."""
