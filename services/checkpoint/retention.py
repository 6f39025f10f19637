"""Which checkpoints to delete and which packs are garbage: pure functions of the records and the time.

Invariants: a session's newest checkpoint is never deleted, whatever the age or the budget (it is what a
restore needs). A pack is deleted only when no kept checkpoint references it and it is older than a grace
period, so a pack whose manifest is being committed right now is never collected.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointRecord:
    session_id: str
    checkpoint_id: str
    created_at: float
    packs: frozenset[str]


@dataclass(frozen=True)
class RetentionPolicy:
    keep_per_session: int = 2
    max_age_s: float = 7 * 24 * 3600.0
    max_total_bytes: int = 0  # 0: no budget


def expired(
    records: Iterable[CheckpointRecord], policy: RetentionPolicy, pack_sizes: Mapping[str, int], now: float
) -> list[CheckpointRecord]:
    by_session: dict[str, list[CheckpointRecord]] = defaultdict(list)
    for record in records:
        by_session[record.session_id].append(record)
    kept: list[CheckpointRecord] = []
    doomed: list[CheckpointRecord] = []
    for session_records in by_session.values():
        session_records.sort(key=lambda r: r.checkpoint_id, reverse=True)
        newest, older = session_records[0], session_records[1:]
        kept.append(newest)
        for rank, record in enumerate(older, start=1):
            if rank >= policy.keep_per_session or now - record.created_at > policy.max_age_s:
                doomed.append(record)
            else:
                kept.append(record)
    if policy.max_total_bytes > 0:
        newest_ids = {max(rs, key=lambda r: r.checkpoint_id).checkpoint_id for rs in by_session.values()}
        candidates = sorted((r for r in kept if r.checkpoint_id not in newest_ids), key=lambda r: r.created_at)
        while candidates and _stored_bytes(kept, pack_sizes) > policy.max_total_bytes:
            victim = candidates.pop(0)
            kept.remove(victim)
            doomed.append(victim)
    return doomed


def _stored_bytes(records: Iterable[CheckpointRecord], pack_sizes: Mapping[str, int]) -> int:
    packs: set[str] = set()
    for record in records:
        packs |= record.packs
    return sum(pack_sizes.get(p, 0) for p in packs)


def unreferenced_packs(
    pack_ages: Mapping[str, float], kept: Iterable[CheckpointRecord], now: float, grace_s: float
) -> list[str]:
    """Packs no kept checkpoint references and that were last modified more than ``grace_s`` ago."""
    referenced: set[str] = set()
    for record in kept:
        referenced |= record.packs
    return sorted(p for p, modified in pack_ages.items() if p not in referenced and now - modified > grace_s)
