"""`python -m services.router`: run the endpoint picker until SIGTERM (bad settings: one line, exit 2)."""

from shared.host.entry import exit_now, main
from shared.wiring import Wiring

from .service import RouterService

if __name__ == "__main__":
    exit_now(main("router", RouterService, Wiring))
