"""Checkpoint service: on every drain, each KV cache leaves the GPU, is stored verified, and is restored on
another node."""
