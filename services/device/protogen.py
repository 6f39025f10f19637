"""Stubs of the kubelet device plugin API (v1beta1), from ``proto/deviceplugin.proto``.

``python -m services.device.protogen [--check]`` writes (or checks) ``services/device/gen/``; the generator is
``shared.contract.protogen``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.contract.protogen import ProtoStubs

STUBS = ProtoStubs("deviceplugin", Path(__file__).resolve().parent / "gen", "python -m services.device.protogen")


def drift() -> list[str]:
    return STUBS.drift()


if __name__ == "__main__":
    sys.exit(STUBS.main())
