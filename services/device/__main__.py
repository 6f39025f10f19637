"""`python -m services.device`: run the device service until SIGTERM (bad settings: one line, exit 2)."""

from shared.plumbing.runner import main
from shared.wiring import Wiring

from .service import DeviceService

if __name__ == "__main__":
    raise SystemExit(main("device", DeviceService, Wiring))
