"""The ports that hardware and the cluster sit behind. Each has a real adapter (NVML, the Kubernetes API) and a
simulated one (``shared.sim``); services depend on the Protocols only."""
