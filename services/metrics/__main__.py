"""`python -m services.metrics`: run the metrics service until SIGTERM (bad settings: one line, exit 2); with
``GPUWARDEN_HOLLOW_NODES``, once per node named there, all in this process (``shared.host.hollow``)."""

from dataclasses import replace

from shared.host.entry import exit_now, main
from shared.host.hollow import HollowPlan
from shared.wiring import HollowWiring, Wiring

from .config import load
from .service import MetricsService


def hollow_instance(first: bool) -> MetricsService:
    """One node's metrics service in a hollow host. Aggregating over the bus takes every node's samples: the
    host's first node does it for the host, the others do not (a thousand instances of one process each summing
    the whole fleet would be a thousand times the same work)."""
    settings = load()
    if settings.aggregate == "bus" and not first:
        settings = replace(settings, aggregate="off")
    return MetricsService(settings)


if __name__ == "__main__":
    exit_now(main("metrics", MetricsService, Wiring, HollowPlan(hollow_instance, HollowWiring)))
