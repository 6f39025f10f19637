"""`python -m services.device`: run the device service until SIGTERM (bad settings: one line, exit 2); with
``GPUWARDEN_HOLLOW_NODES``, once per node named there, all in this process (``shared.host.hollow``)."""

from dataclasses import replace

from shared.host.entry import exit_now, main
from shared.host.hollow import HollowPlan
from shared.plumbing.errors import SettingsError
from shared.wiring import HollowWiring, Wiring

from .config import load
from .service import DeviceService


def hollow_instance(first: bool) -> DeviceService:
    """One node's device service in a hollow host. Hollow nodes have no kubelet: the device plugin, a gRPC server
    registered on each node's own kubelet socket folder, is off (``auto``), and asking for it is an error."""
    settings = load()
    if settings.plugin == "on":
        raise SettingsError("GPUWARDEN_DEVICE_PLUGIN=on: hollow nodes have no kubelet to register a device plugin with")
    return DeviceService(replace(settings, plugin="off"))


if __name__ == "__main__":
    exit_now(main("device", DeviceService, Wiring, HollowPlan(hollow_instance, HollowWiring)))
