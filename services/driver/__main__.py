"""`python -m services.driver`: run the driver service until SIGTERM (bad settings: one line, exit 2)."""

from shared.plumbing.runner import main
from shared.wiring import Wiring

from .service import DriverService

if __name__ == "__main__":
    raise SystemExit(main("driver", DriverService, Wiring))
