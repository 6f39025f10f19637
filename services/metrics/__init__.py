"""Metrics service: DCGM-exporter, Prometheus or NVML data turned into per-GPU, per-pod and per-deployment
utilisation."""
