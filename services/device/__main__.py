"""`python -m services.device`: run the device service until SIGTERM (bad settings: one line, exit 2); with
``GPUWARDEN_HOLLOW_NODES``, once per node named there, all in this process (``shared.plumbing.hollow``)."""

from shared.plumbing.hollow import HollowPlan
from shared.plumbing.runner import main
from shared.wiring import HollowWiring, Wiring

from .service import DeviceService


def hollow_instance(first: bool) -> DeviceService:
    """One node's device service in a hollow host: every node's is the same."""
    return DeviceService()


if __name__ == "__main__":
    raise SystemExit(main("device", DeviceService, Wiring, HollowPlan(hollow_instance, HollowWiring)))
