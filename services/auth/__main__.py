"""`python -m services.auth`: run the auth callout until SIGTERM (bad settings: one line, exit 2)."""

from shared.host.entry import main
from shared.wiring import Wiring

from .service import AuthService

if __name__ == "__main__":
    raise SystemExit(main("auth", AuthService, Wiring))
