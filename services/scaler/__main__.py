"""`python -m services.scaler`: run the scaler service until SIGTERM."""

from shared.plumbing.runner import run

from .handlers import ScalerService

if __name__ == "__main__":
    raise SystemExit(run(ScalerService()))
