"""`python -m services.checkpoint`: run the checkpoint service until SIGTERM (bad settings: one line, exit 2)."""

from shared.host.entry import main
from shared.wiring import Wiring

from .service import CheckpointService

if __name__ == "__main__":
    raise SystemExit(main("checkpoint", CheckpointService, Wiring))
