"""`python -m services.checkpoint`: run the checkpoint service until SIGTERM."""

from shared.plumbing.runner import run
from shared.wiring import Wiring

from .service import CheckpointService

if __name__ == "__main__":
    raise SystemExit(run(CheckpointService(), Wiring))
