"""The checkpoint service's settings, each declared once: variable, default, documentation and parsing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.kv.stores import DEFAULT_URL, parse_store_url
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Parse, count, documented, seconds, setting, settings_from_env


def _store_url(name: str, raw: str) -> str:
    try:
        parse_store_url(raw)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    return raw


@dataclass(frozen=True)
class CheckpointSettings:
    store: str = setting("GPUWARDEN_CHECKPOINT_STORE", DEFAULT_URL, None, parse=Parse(_store_url))
    """Documented with the stores (``shared.kv.stores``): the KV agents read the same variable."""
    gc_interval_s: float = setting(
        "GPUWARDEN_CHECKPOINT_GC_S",
        60.0,
        "checkpoint: seconds between retention passes; 0 disables them",
        parse=seconds(allow_zero=True),
    )
    gc_grace_s: float = setting(
        "GPUWARDEN_CHECKPOINT_GC_GRACE_S",
        600.0,
        "checkpoint: a pack or a temporary file is collected only when older than this",
        parse=seconds(allow_zero=True),
    )
    gc_walk_sessions: int = setting(
        "GPUWARDEN_CHECKPOINT_GC_WALK_SESSIONS",
        2000,
        "checkpoint: sessions of the store one retention turn walks (the walk finds what the registry does not "
        "know, and the packs nothing references, once it has gone round the whole store)",
        parse=count(maximum=10_000_000),
    )
    """Sessions of the store one retention turn walks: a turn costs what changed plus this many, whatever the
    store holds; one walk round the store takes ``sessions / gc_walk_sessions`` turns."""
    scrub_interval_s: float = setting(
        "GPUWARDEN_CHECKPOINT_SCRUB_S",
        10.0,
        "checkpoint: seconds between scrub turns (recorded checkpoints checked against the store); 0 disables them",
        parse=seconds(allow_zero=True),
    )
    scrub_sessions: int = setting(
        "GPUWARDEN_CHECKPOINT_SCRUB_SESSIONS",
        500,
        "checkpoint: sessions (with their recorded checkpoints) one scrub turn checks",
        parse=count(),
    )
    """About this many sessions a turn (a SCAN step may give up to one step more): a turn costs this, whatever the
    registry holds; one walk round the registry takes ``sessions / scrub_sessions`` turns."""
    scrub_sample_bytes: int = setting(
        "GPUWARDEN_CHECKPOINT_SCRUB_SAMPLE_BYTES",
        16 * 1024 * 1024,
        "checkpoint: bytes of chunks one scrub turn reads back to verify their digests (rot); 0: none read",
        parse=count(minimum=0, maximum=1 << 40),
    )
    drain_lease_s: float = setting(
        "GPUWARDEN_CHECKPOINT_DRAIN_LEASE_S",
        10.0,
        "checkpoint: how long a drain's runner holds it unrenewed; it renews it every third of that",
        parse=seconds(),
    )
    """How long a drain's runner holds it without renewing (renewed every third of it while it works): a runner
    that dies hands the drain to the next delivery within about this long, whatever the drain's deadline."""
    periodic_parallelism: int = setting(
        "GPUWARDEN_CHECKPOINT_PERIODIC_PARALLELISM",
        16,
        "checkpoint: pods one replica asks for their periodic save at once",
        parse=count(),
    )
    """Pods one replica has saving periodically at once: what one replica's share of the fleet can keep up with
    (the bytes go from each pod to the store; the replica waits, verifies and records)."""
    verdict_sessions_max: int = 100
    """Failed sessions named in one verdict event; the rest are counted and kept in Redis (``failed_ref``)."""


DOCUMENTED = documented(CheckpointSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def load(env: Mapping[str, str] | None = None) -> CheckpointSettings:
    return settings_from_env(CheckpointSettings, env)
