"""`python -m services.scaler`: run the scaler service (the KEDA external scaler) until SIGTERM."""

import sys

from shared.plumbing.errors import SettingsError
from shared.plumbing.runner import run
from shared.wiring import Wiring

from .config import load
from .service import ScalerService

if __name__ == "__main__":
    try:
        settings = load()
    except SettingsError as exc:
        print(f"scaler: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(run(ScalerService(settings), Wiring))
