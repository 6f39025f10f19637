"""Scaler service: a KEDA external scaler that turns queue depth and GPU utilisation into replicas and knows
about drains before they happen."""
