"""The Prometheus metrics every service exposes, on a registry of its own (several services may share a process
in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Telemetry:
    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "gpuwarden_messages_total",
            "Messages taken by consumer loops, by outcome (ack, nak, term)",
            ["consumer", "outcome"],
            registry=r,
        )
        self.handler_seconds = Histogram(
            "gpuwarden_handler_seconds",
            "Time handlers took per message",
            ["consumer"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.dead_letters = Counter(
            "gpuwarden_dead_letters_total", "Messages dead-lettered, by consumer", ["consumer"], registry=r
        )
        self.published = Counter("gpuwarden_published_total", "Events published, by delivery", ["delivery"], registry=r)
        self.config_version = Gauge(
            "gpuwarden_config_version", "Version of each configuration document in use", ["name"], registry=r
        )
        self.connection_up = Gauge(
            "gpuwarden_connection_up", "1 while the connection to a dependency is up", ["dependency"], registry=r
        )
