"""Stubs of KEDA's external scaler API, from ``proto/externalscaler.proto``.

``python -m services.scaler.protogen [--check]`` writes (or checks) ``services/scaler/gen/``; the generator is
``shared.contract.protogen``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.contract.protogen import ProtoStubs

STUBS = ProtoStubs("externalscaler", Path(__file__).resolve().parent / "gen", "python -m services.scaler.protogen")


def drift() -> list[str]:
    return STUBS.drift()


if __name__ == "__main__":
    sys.exit(STUBS.main())
