"""Stubs of the two kubelet gRPC contracts the device service speaks: the device plugin API (v1beta1, from
``proto/deviceplugin.proto``), which it serves, and the PodResources API (v1, from ``proto/podresources.proto``),
which it asks which pods hold which GPUs.

``python -m services.device.protogen [--check]`` writes (or checks) both into ``services/device/gen/``; the
generator is ``shared.contract.protogen``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.contract.protogen import ProtoStubs

_GEN = Path(__file__).resolve().parent / "gen"
_COMMAND = "python -m services.device.protogen"
DEVICE_PLUGIN = ProtoStubs("deviceplugin", _GEN, _COMMAND)
POD_RESOURCES = ProtoStubs("podresources", _GEN, _COMMAND)
STUBS = (DEVICE_PLUGIN, POD_RESOURCES)


def drift() -> list[str]:
    return [name for stubs in STUBS for name in stubs.drift()]


def main(argv: list[str] | None = None) -> int:
    return max(stubs.main(argv) for stubs in STUBS)


if __name__ == "__main__":
    sys.exit(main())
