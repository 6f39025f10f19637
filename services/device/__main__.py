"""`python -m services.device`: run the device service until SIGTERM."""

import sys

from shared.plumbing.errors import SettingsError
from shared.plumbing.runner import run
from shared.wiring import Wiring

from .config import load
from .service import DeviceService

if __name__ == "__main__":
    try:
        settings = load()
    except SettingsError as exc:
        print(f"device: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(run(DeviceService(settings), Wiring))
