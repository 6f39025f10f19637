from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.plumbing.errors import SettingsError


@dataclass(frozen=True)
class DeviceSettings:
    """``inventory_s``: how often the inventory is read again and re-published if it changed (MIG changes made by
    anyone, GPUs that vanished); health events re-publish it at once."""

    plugin_dir: Path = Path("/var/lib/kubelet/device-plugins/")
    inventory_s: float = 10.0


def _seconds(env: Mapping[str, str], name: str, default: str) -> float:
    raw = env.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected seconds") from None
    if value <= 0:
        raise SettingsError(f"{name}={raw!r}: must be positive")
    return value


def load(env: Mapping[str, str] | None = None) -> DeviceSettings:
    env = os.environ if env is None else env
    return DeviceSettings(
        plugin_dir=Path(env.get("GPUWARDEN_DEVICE_PLUGIN_DIR", "/var/lib/kubelet/device-plugins/")),
        inventory_s=_seconds(env, "GPUWARDEN_DEVICE_INVENTORY_S", "10"),
    )
