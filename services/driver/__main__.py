"""`python -m services.driver`: run the driver service until SIGTERM (bad settings: one line, exit 2); with
``GPUWARDEN_HOLLOW_NODES``, once per node named there, all in this process (``shared.host.hollow``)."""

from dataclasses import replace

from shared.host.entry import exit_now, main
from shared.host.hollow import HollowPlan
from shared.wiring import HollowWiring, Wiring

from .config import load
from .service import DriverService


def hollow_instance(first: bool) -> DriverService:
    """One node's driver service in a hollow host: only the host's first node takes part in electing the upgrade
    coordinator (one candidate per host is enough: it reaches every node's agent over the bus)."""
    settings = load()
    return DriverService(replace(settings, coordinate=settings.coordinate and first))


if __name__ == "__main__":
    exit_now(main("driver", DriverService, Wiring, HollowPlan(hollow_instance, HollowWiring)))
