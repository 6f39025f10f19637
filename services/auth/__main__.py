"""`python -m services.auth`: run the auth callout until SIGTERM (bad settings: one line, exit 2)."""

from shared.host.entry import exit_now, main
from shared.wiring import Wiring

from .service import AuthService

if __name__ == "__main__":
    exit_now(main("auth", AuthService, Wiring))
