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
from dataclasses import dataclass, field

from shared.kv.manifest import checkpoint_order
from shared.kv.store import CheckpointNotFound, ManifestCorrupt, StoreError
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


@dataclass
class StoreWalk:
    """One walk round the store, a slice of sessions a turn: the sessions still to walk, the checkpoints kept so
    far (their packs are the marks), and the cutoff: only packs modified before it can be garbage at the end.

    Why marks gathered over many turns are enough: a checkpoint made after the walk began references packs of
    its own (younger than the cutoff) or blocks of its session's previous checkpoint (an agent reuses nothing
    else), which the walk saw when it walked that session, or which was made after the walk began itself. The
    cutoff lies ``gc_grace_s`` before the walk began, so a store clock that differs by less than that changes
    nothing."""

    cutoff: float
    left: list[str]
    kept: list[CheckpointRecord] = field(default_factory=list)
    unreadable: int = 0
    """Manifests the store could not read for a reason that may pass: their packs are unknown, so this walk
    deletes no pack."""


class Retention:
    """Applies the ``checkpoint`` document's retention to the store, and retires ended sessions' checkpoints.

    A turn costs what changed, not what the store holds: the sessions that recorded a checkpoint since the last
    turn (the registry hands each out once) are held to ``keep_per_session``, the registry's aging index yields
    the checkpoints past ``max_age_s``, and a slice of ``gc_walk_sessions`` sessions of the store is walked. The
    walk is what finds checkpoints only the store knows (the registry lost them in a failover, or an agent
    saved without a service) and, each time it has gone round the whole store, the packs nothing references
    and the byte budget. Caches each checkpoint's record (its manifest's packs and age: a manifest never
    changes) across turns."""

    CHANGES_PER_TURN = 10_000
    """Changed sessions and aged checkpoints taken per turn, each; the rest wait for the next turn."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._manifest_cache: dict[str, CheckpointRecord] = {}
        self._walk: StoreWalk | None = None

    async def loop(self) -> None:
        """One replica a turn applies retention and forgets gone pods (the turn is taken in Redis): replicas share
        the work instead of each walking the store."""
        replica = self.replica
        while True:
            await asyncio.sleep(replica.settings.gc_interval_s)
            try:
                interval_s = replica.settings.gc_interval_s
                if not await replica.leases.take_turn("gc", "store", replica.owner, interval_s * 0.9):
                    continue
                await self.turn()
                await forget_gone_pods(replica)
            except (TemporaryError, StoreError) as exc:
                log.warning("retention skipped this turn", extra={"error": str(exc)})

    def _policy(self) -> RetentionPolicy:
        policy = self.replica.policy()
        return RetentionPolicy(policy.keep_per_session, policy.max_age_s, policy.max_total_bytes)

    async def turn(self, now: float | None = None, walk_sessions: int | None = None) -> tuple[int, int]:
        """One turn: the changes, then ``walk_sessions`` (default ``gc_walk_sessions``) more sessions of the
        store walk, and the packs when that walk has gone round. Returns (checkpoints, packs) deleted."""
        now = time.time() if now is None else now
        policy = self._policy()
        deleted = await self._apply_changes(policy, now)
        if self._walk is None:
            self._walk = StoreWalk(time.time() - self.replica.settings.gc_grace_s, await self.replica.store.sessions())
        walk = self._walk
        step = self.replica.settings.gc_walk_sessions if walk_sessions is None else walk_sessions
        part, walk.left = walk.left[:step], walk.left[step:]
        for session_id in part:
            deleted += await self._walk_session(walk, session_id, policy, now)
        packs = 0
        if not walk.left:
            self._walk = None
            more, packs = await self._sweep(walk, policy, now)
            deleted += more
        if deleted or packs:
            log.info("retention", extra={"checkpoints_deleted": deleted, "packs_deleted": packs})
        return deleted, packs

    async def collect_garbage(self, now: float | None = None) -> tuple[int, int]:
        """A whole pass at once (a one-off run, tests): the changes, then a walk round the whole store from its
        beginning, and its packs. Returns (checkpoints, packs) deleted."""
        self._walk = None
        return await self.turn(now, walk_sessions=10_000_000)

    async def _apply_changes(self, policy: RetentionPolicy, now: float) -> int:
        """Sessions that recorded a checkpoint since the last turn keep ``keep_per_session``; the others that
        stay go to the aging index. Then the indexed checkpoints past ``max_age_s`` go."""
        registry = self.replica.registry
        deleted = 0
        changed = await registry.take_retention_changes(self.CHANGES_PER_TURN)
        aging: dict[tuple[str, str], float] = {}
        for session_id in changed:
            rows = await registry.checkpoints(session_id, limit=max(policy.keep_per_session, 1) + 64)
            for rank, row in enumerate(rows[1:], start=1):  # newest first: the newest always stays
                cid, made = str(row["checkpoint_id"]), float(row.get("recorded_at", now))
                if rank >= policy.keep_per_session or now - made > policy.max_age_s:
                    deleted += await self._retire(session_id, cid)
                else:
                    aging[(session_id, cid)] = made
        await registry.note_aging(aging)
        for session_id, cid in await registry.aged(now - policy.max_age_s, self.CHANGES_PER_TURN):
            deleted += await self._retire(session_id, cid)
        return deleted

    async def _retire(self, session_id: str, checkpoint_id: str) -> int:
        """Delete one doomed checkpoint: the registry forgets it first (unless it became the session's newest
        meanwhile), then its file goes. 1 when it went."""
        if not await self.replica.registry.retire_older(session_id, checkpoint_id):
            return 0
        await self.replica.store.delete_checkpoint(session_id, checkpoint_id)
        self._manifest_cache.pop(checkpoint_id, None)
        return 1

    async def _walk_session(self, walk: StoreWalk, session_id: str, policy: RetentionPolicy, now: float) -> int:
        """The session's checkpoints as the store holds them, held to the policy (the store's newest always
        stays); the ones kept mark their packs."""
        store = self.replica.store
        records: list[CheckpointRecord] = []
        for cid in await store.checkpoints(session_id):
            record = self._manifest_cache.get(cid)
            if record is None:
                try:
                    m = await store.manifest(session_id, cid)
                except (ManifestCorrupt, CheckpointNotFound):
                    continue  # gone, or never readable: it references nothing a restore could use
                except StoreError as exc:
                    walk.unreadable += 1
                    log.warning("manifest unreadable; no pack deleted this walk", extra={"error": str(exc)})
                    continue
                record = CheckpointRecord(session_id, cid, m.created_at.timestamp(), frozenset(m.packs))
                self._manifest_cache[cid] = record
            records.append(record)
        deleted = 0
        doomed = expired(records, RetentionPolicy(policy.keep_per_session, policy.max_age_s, 0), {}, now)
        gone: set[str] = set()
        for record in doomed:
            if await self._retire(session_id, record.checkpoint_id):
                gone.add(record.checkpoint_id)
                deleted += 1
        walk.kept.extend(r for r in records if r.checkpoint_id not in gone)
        return deleted

    async def _sweep(self, walk: StoreWalk, policy: RetentionPolicy, now: float) -> tuple[int, int]:
        """The end of a walk: the byte budget over what it kept, then the packs no kept checkpoint references
        that were modified before the walk's cutoff, then what killed writers left."""
        store = self.replica.store
        settings = self.replica.settings
        packs = await store.packs()
        deleted = 0
        kept = walk.kept
        if policy.max_total_bytes > 0:
            doomed = expired(kept, policy, {p.pack_id: p.size for p in packs}, now)
            gone = set()
            for record in doomed:
                if await self._retire(record.session_id, record.checkpoint_id):
                    gone.add(record.checkpoint_id)
                    deleted += 1
            kept = [r for r in kept if r.checkpoint_id not in gone]
        garbage: list[str] = []
        if walk.unreadable:
            log.warning("packs not collected: manifests were unreadable", extra={"manifests": walk.unreadable})
        else:
            ages = {p.pack_id: p.modified for p in packs if p.modified < walk.cutoff}
            garbage = unreferenced_packs(ages, kept, now, settings.gc_grace_s)
        for pack_id in garbage:
            await store.delete_pack(pack_id)
        orphans = await store.sweep_orphans(settings.gc_grace_s)  # what killed or failed writers left
        if orphans:
            log.info("retention", extra={"orphans_deleted": orphans})
        return deleted, len(garbage)

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
