"""`python -m services.checkpoint`: run the checkpoint service until SIGTERM (bad settings: one line, exit 2)."""

from shared.host.entry import exit_now, main
from shared.wiring import Wiring

from .service import CheckpointService

if __name__ == "__main__":
    exit_now(main("checkpoint", CheckpointService, Wiring))
