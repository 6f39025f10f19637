"""The real adapters of the ports in ``shared.ports``: NVML (``nvml``, which installs drivers through
``driverinstall``), the Kubernetes API (``kube``, over ``kubeapi``, which reads and watches it) and the metrics
sources (``metrics``, over the exposition parser ``exposition`` and the HTTP client ``httpclient``). The simulated
adapters live with the simulation (``shared.sim``); which adapter a service gets is decided in one place,
``shared.wiring``."""
