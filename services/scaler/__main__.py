"""`python -m services.scaler`: run the KEDA external scaler until SIGTERM (bad settings: one line, exit 2)."""

from shared.host.entry import exit_now, main
from shared.wiring import Wiring

from .service import ScalerService

if __name__ == "__main__":
    exit_now(main("scaler", ScalerService, Wiring))
