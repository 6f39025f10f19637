from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceSettings:
    plugin_dir: Path = Path("/var/lib/kubelet/device-plugins/")


def load(env: Mapping[str, str] | None = None) -> DeviceSettings:
    env = os.environ if env is None else env
    return DeviceSettings(plugin_dir=Path(env.get("GPUWARDEN_DEVICE_PLUGIN_DIR", "/var/lib/kubelet/device-plugins/")))
