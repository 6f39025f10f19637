from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.plumbing.errors import SettingsError


@dataclass(frozen=True)
class CheckpointSettings:
    store: str = "file:///var/lib/gpuwarden/checkpoints"


def load(env: Mapping[str, str] | None = None) -> CheckpointSettings:
    env = os.environ if env is None else env
    store = env.get("GPUWARDEN_CHECKPOINT_STORE", "file:///var/lib/gpuwarden/checkpoints")
    if not (store.startswith("file://") or store.startswith("nats://")):
        raise SettingsError(f"GPUWARDEN_CHECKPOINT_STORE={store!r}: expected file:///path or nats://<bucket>")
    return CheckpointSettings(store=store)
