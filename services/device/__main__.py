"""`python -m services.device`: run the device service until SIGTERM."""

from shared.plumbing.runner import run

from .handlers import DeviceService

if __name__ == "__main__":
    raise SystemExit(run(DeviceService()))
