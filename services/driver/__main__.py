"""`python -m services.driver`: run the driver service until SIGTERM."""

from shared.plumbing.runner import run
from shared.wiring import Wiring

from .service import DriverService

if __name__ == "__main__":
    raise SystemExit(run(DriverService(), Wiring))
