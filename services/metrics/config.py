from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.plumbing.errors import SettingsError

SOURCES = ("nvml", "dcgm", "prometheus")


@dataclass(frozen=True)
class MetricsSettings:
    source: str = "nvml"


def load(env: Mapping[str, str] | None = None) -> MetricsSettings:
    env = os.environ if env is None else env
    source = env.get("GPUWARDEN_METRICS_SOURCE", "nvml")
    if source not in SOURCES:
        raise SettingsError(f"GPUWARDEN_METRICS_SOURCE={source!r}: expected one of {', '.join(SOURCES)}")
    return MetricsSettings(source=source)
