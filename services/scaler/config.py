from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.plumbing.settings import parse_host_port


@dataclass(frozen=True)
class ScalerSettings:
    host: str = "0.0.0.0"
    port: int = 9090


def load(env: Mapping[str, str] | None = None) -> ScalerSettings:
    env = os.environ if env is None else env
    host, port = parse_host_port("GPUWARDEN_SCALER_ADDR", env.get("GPUWARDEN_SCALER_ADDR", "0.0.0.0:9090"))
    return ScalerSettings(host=host, port=port)
