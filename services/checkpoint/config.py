from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.kv.stores import parse_store_url
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import env_seconds


@dataclass(frozen=True)
class CheckpointSettings:
    store: str = "file:///var/lib/gpuwarden/checkpoints"
    gc_interval_s: float = 60.0
    gc_grace_s: float = 600.0


def load(env: Mapping[str, str] | None = None) -> CheckpointSettings:
    env = os.environ if env is None else env
    store = env.get("GPUWARDEN_CHECKPOINT_STORE", "file:///var/lib/gpuwarden/checkpoints")
    try:
        parse_store_url(store)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    return CheckpointSettings(
        store=store,
        gc_interval_s=env_seconds(env, "GPUWARDEN_CHECKPOINT_GC_S", 60.0, allow_zero=True),
        gc_grace_s=env_seconds(env, "GPUWARDEN_CHECKPOINT_GC_GRACE_S", 600.0, allow_zero=True),
    )
