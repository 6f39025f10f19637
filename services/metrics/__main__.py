"""`python -m services.metrics`: run the metrics service until SIGTERM."""

from shared.plumbing.runner import run
from shared.wiring import Wiring

from .service import MetricsService

if __name__ == "__main__":
    raise SystemExit(run(MetricsService(), Wiring))
