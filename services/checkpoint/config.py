from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.kv.stores import parse_store_url
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import env_count, env_seconds

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_CHECKPOINT_GC_S": "checkpoint: seconds between retention passes (default 60; 0 disables)",
    "GPUWARDEN_CHECKPOINT_GC_GRACE_S": (
        "checkpoint: a pack or a temporary file is collected only when older than this (default 600)"
    ),
    "GPUWARDEN_CHECKPOINT_PERIODIC_PARALLELISM": (
        "checkpoint: pods one replica asks for their periodic save at once (default 16)"
    ),
    "GPUWARDEN_CHECKPOINT_DRAIN_LEASE_S": (
        "checkpoint: how long a drain's runner holds it unrenewed (default 10; renewed every third of it)"
    ),
}
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


@dataclass(frozen=True)
class CheckpointSettings:
    store: str = "file:///var/lib/gpuwarden/checkpoints"
    gc_interval_s: float = 60.0
    gc_grace_s: float = 600.0
    drain_lease_s: float = 10.0
    """How long a drain's runner holds it without renewing (renewed every third of it while it works): a runner
    that dies hands the drain to the next delivery within about this long, whatever the drain's deadline."""
    periodic_parallelism: int = 16
    """Pods one replica has saving periodically at once: what one replica's share of the fleet can keep up with
    (the bytes go from each pod to the store; the replica waits, verifies and records)."""
    verdict_sessions_max: int = 100
    """Failed sessions named in one verdict event; the rest are counted and kept in Redis (``failed_ref``)."""


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
        drain_lease_s=env_seconds(env, "GPUWARDEN_CHECKPOINT_DRAIN_LEASE_S", 10.0),
        periodic_parallelism=env_count(env, "GPUWARDEN_CHECKPOINT_PERIODIC_PARALLELISM", 16),
    )
