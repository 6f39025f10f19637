"""Simulated GPUs, a simulated cluster and a simulated inference workload. Everything here says it is simulated
(``simulated = True`` on adapters, in logs, health and status); NATS, Redis, gRPC and files are never simulated."""
