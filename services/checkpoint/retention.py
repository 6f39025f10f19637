"""Which checkpoints to delete and which packs are garbage: pure functions of the records and the time
(``expired``, ``unreferenced_packs``), and ``Retention``, which applies them to the store and the registry (one
replica a turn) and deletes the checkpoints of sessions that ended.

Invariants: a session's newest checkpoint is never deleted, whatever the age or the budget (it is what a
restore needs). A pack is deleted only when no kept checkpoint references it and it is older than a grace
period, so a pack whose manifest is being committed right now is never collected. The registry forgets a
checkpoint before its file goes: a Redis that fails in between leaves no recorded checkpoint without its file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.kv.manifest import checkpoint_order
from shared.kv.store import StoreError
from shared.plumbing.errors import TemporaryError

from .pods import forget_gone_pods
from .replica import Replica

log = logging.getLogger(__name__)


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


class Retention:
    """Applies the ``checkpoint`` document's retention to the store, and retires ended sessions' checkpoints.
    Caches each checkpoint's record (its manifest's packs and age: a manifest never changes) across turns."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._manifest_cache: dict[str, CheckpointRecord] = {}

    async def loop(self) -> None:
        """One replica a turn applies retention and forgets gone pods (the turn is taken in Redis): replicas share
        the work instead of each walking the store."""
        replica = self.replica
        while True:
            await asyncio.sleep(replica.settings.gc_interval_s)
            try:
                interval_s = replica.settings.gc_interval_s
                if not await replica.registry.take_turn("gc", "store", replica.owner, interval_s * 0.9):
                    continue
                await self.collect_garbage()
                await forget_gone_pods(replica)
            except (TemporaryError, StoreError) as exc:
                log.warning("retention skipped this turn", extra={"error": str(exc)})

    async def collect_garbage(self, now: float | None = None) -> tuple[int, int]:
        """Apply the retention policy, then delete packs nothing references. Returns (checkpoints, packs). Each
        doomed checkpoint leaves the registry before its file goes: when Redis fails in between, a checkpoint the
        registry no longer names stays in the store until the next turn, never the other way round."""
        store = self.replica.store
        settings = self.replica.settings
        now = time.time() if now is None else now
        policy = self.replica.policy()
        records: list[CheckpointRecord] = []
        for sid in await store.sessions():
            for cid in await store.checkpoints(sid):
                record = self._manifest_cache.get(cid)
                if record is None:
                    try:
                        m = await store.manifest(sid, cid)
                    except StoreError:
                        continue
                    record = CheckpointRecord(sid, cid, m.created_at.timestamp(), frozenset(m.packs))
                    self._manifest_cache[cid] = record
                records.append(record)
        packs = await store.packs()
        doomed = expired(
            records,
            RetentionPolicy(policy.keep_per_session, policy.max_age_s, policy.max_total_bytes),
            {p.pack_id: p.size for p in packs},
            now,
        )
        for record in doomed:  # the registry forgets first: a Redis failure here deletes nothing
            await self.replica.registry.forget_checkpoint(record.session_id, record.checkpoint_id)
            await store.delete_checkpoint(record.session_id, record.checkpoint_id)
            self._manifest_cache.pop(record.checkpoint_id, None)
        gone = {r.checkpoint_id for r in doomed}
        kept = [r for r in records if r.checkpoint_id not in gone]
        garbage = unreferenced_packs({p.pack_id: p.modified for p in packs}, kept, now, settings.gc_grace_s)
        for pack_id in garbage:
            await store.delete_pack(pack_id)
        orphans = await store.sweep_orphans(settings.gc_grace_s)  # what killed or failed writers left
        if doomed or garbage or orphans:
            log.info(
                "retention",
                extra={"checkpoints_deleted": len(doomed), "packs_deleted": len(garbage), "orphans_deleted": orphans},
            )
        return len(doomed), len(garbage)

    async def retire_session(self, session_id: str) -> None:
        """A finished conversation: its checkpoints go (their packs become garbage for the collector), those only
        the store still knows (a Redis failover lost their records) included. The registry forgets each one before
        its file goes, so a Redis that fails meanwhile leaves no recorded checkpoint without its file."""
        store = self.replica.store
        registry = self.replica.registry
        ids = {str(r["checkpoint_id"]) for r in await registry.checkpoints(session_id, limit=10_000)}
        try:
            ids |= set(await store.checkpoints(session_id))
        except StoreError as exc:
            log.warning("ended session's checkpoints not listed", extra={"session": session_id, "error": str(exc)})
        for cid in sorted(ids, key=checkpoint_order):
            await registry.forget_checkpoint(session_id, cid)
            try:
                await store.delete_checkpoint(session_id, cid)
            except StoreError as exc:
                log.warning("ended session's checkpoint not deleted", extra={"session": session_id, "error": str(exc)})
                continue
            self._manifest_cache.pop(cid, None)
