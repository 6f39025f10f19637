from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.plumbing.errors import SettingsError


@dataclass(frozen=True)
class DriverSettings:
    reconcile_s: float = 10.0


def load(env: Mapping[str, str] | None = None) -> DriverSettings:
    env = os.environ if env is None else env
    raw = env.get("GPUWARDEN_DRIVER_RECONCILE_S", "10")
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"GPUWARDEN_DRIVER_RECONCILE_S={raw!r}: expected seconds") from None
    if value <= 0:
        raise SettingsError(f"GPUWARDEN_DRIVER_RECONCILE_S={raw!r}: must be positive")
    return DriverSettings(reconcile_s=value)
