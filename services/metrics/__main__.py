"""`python -m services.metrics`: run the metrics service until SIGTERM (bad settings: one line, exit 2)."""

from shared.plumbing.runner import main
from shared.wiring import Wiring

from .service import MetricsService

if __name__ == "__main__":
    raise SystemExit(main("metrics", MetricsService, Wiring))
