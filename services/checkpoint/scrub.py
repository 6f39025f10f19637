"""The scrub: the registry reconciled with the store, at a bounded pace. Each turn (one replica a turn, like
retention's) takes the next slice of the sessions with recorded checkpoints (SCAN over ``kv:checkpoints:*``, its
cursor kept in Redis between turns and replicas) and checks each recorded checkpoint in the store: its manifest
readable, every pack it references present and long enough (``lost_pack``), and a bounded sample of its blocks read
back against their digests (rot). A record whose files are gone or damaged is forgotten, with a
``checkpoint.forgotten`` event and a metric, and the session's holder is marked so that its next save writes every
block again (``SaveSessions.rewrite``): the blocks it would reuse are what the store lost.

Invariants: the scrub never deletes a file (retention alone deletes); a session's newest checkpoint is forgotten only
when its files are gone (a rotten block marks the session but keeps its newest record: a restore verifies every
digest and falls back on its own); a record retention forgot meanwhile is left alone (the check and the forgetting
are one step in Redis). A turn costs ``scrub_sessions`` sessions (their records, their manifests, one look at their
packs) and ``scrub_sample_bytes`` read back, whatever the registry holds. A walk starts again from the beginning at
the first turn after Redis' run id changed (a promotion, or a restart): what a failover brought back is found
within one walk.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.contract.base import Event
from shared.contract.checkpoint import CheckpointForgotten
from shared.kv.manifest import CheckpointManifest, ChunkRef, digest, lost_pack
from shared.kv.store import CheckpointNotFound, ManifestCorrupt, StoreError
from shared.plumbing.errors import TemporaryError

from .replica import Replica

log = logging.getLogger(__name__)

SCAN_STEPS = 16
"""SCAN steps one turn takes at most (each looks at about ``scrub_sessions`` keys of the keyspace), however few
sessions they find: a keyspace mostly of other keys slows the walk down, never a turn."""
CHECKPOINTS_PER_SESSION = 64
"""Recorded checkpoints of a session one turn checks (retention keeps far fewer)."""
MANIFEST_READS = 16
"""Manifests read from the store at once."""


@dataclass(frozen=True)
class Finding:
    """A recorded checkpoint whose files are gone or damaged (``reason``: manifest, pack or rot)."""

    session_id: str
    checkpoint_id: str
    reason: str
    detail: str


@dataclass
class ScrubTurn:
    """What one turn did."""

    sessions: int = 0
    checked: int = 0
    forgotten: int = 0
    marked: int = 0
    sampled_bytes: int = 0
    unreadable: int = 0
    """Manifests the store could not read for a reason that may pass: neither forgotten nor checked."""
    restarted: bool = False
    """The walk started again from the beginning (Redis' run id changed, or no walk was kept)."""
    went_round: bool = False
    """This turn ended a walk round the registry."""
    findings: list[Finding] = field(default_factory=list)


class Scrub:
    def __init__(self, replica: Replica, rng: random.Random | None = None) -> None:
        self.replica = replica
        self._rng = rng or random.Random()

    async def loop(self) -> None:
        """One replica a turn (the turn is taken in Redis) scrubs the next slice, every ``scrub_interval_s``."""
        replica = self.replica
        while True:
            interval_s = replica.settings.scrub_interval_s
            await asyncio.sleep(interval_s)
            try:
                if await replica.leases.take_turn("scrub", "store", replica.owner, interval_s * 0.9):
                    await self.turn()
            except (TemporaryError, StoreError) as exc:
                log.warning("scrub skipped this turn", extra={"error": str(exc)})

    async def turn(self, sessions: int | None = None, sample_bytes: int | None = None) -> ScrubTurn:
        """The next ``sessions`` (default ``scrub_sessions``) of the walk, checked; from the beginning when Redis
        is another than the walk's (its run id changed)."""
        registry = self.replica.registry
        settings = self.replica.settings
        want = settings.scrub_sessions if sessions is None else sessions
        run_id = await registry.run_id()
        cursor, walked_on = await registry.scrub_position()
        restarted = walked_on != run_id
        if restarted:
            cursor = 0
            if walked_on:
                self.replica.metrics.scrub_restarts.inc()
                log.info("Redis changed (its run id): the scrub walks the registry again from the beginning")
        found: list[str] = []
        for _ in range(SCAN_STEPS):
            cursor, sids = await registry.scan_checkpointed(cursor, max(10, want))
            found += sids
            if cursor == 0 or len(found) >= want:
                break
        done = await self.check(
            list(dict.fromkeys(found)), settings.scrub_sample_bytes if sample_bytes is None else sample_bytes
        )
        await registry.keep_scrub_position(cursor, run_id)
        done.restarted, done.went_round = restarted, cursor == 0
        if done.forgotten or done.marked:
            log.info(
                "scrub",
                extra={"sessions": done.sessions, "forgotten": done.forgotten, "marked_for_rewrite": done.marked},
            )
        return done

    async def walk(self, sessions: int | None = None, sample_bytes: int | None = None) -> ScrubTurn:
        """Turns until the walk has gone round the registry once (a one-off run, tests); their sum."""
        total = ScrubTurn()
        while True:
            done = await self.turn(sessions, sample_bytes)
            total.sessions += done.sessions
            total.checked += done.checked
            total.forgotten += done.forgotten
            total.marked += done.marked
            total.sampled_bytes += done.sampled_bytes
            total.unreadable += done.unreadable
            total.restarted |= done.restarted
            total.findings += done.findings
            if done.went_round:
                total.went_round = True
                return total

    async def check(self, session_ids: Sequence[str], sample_bytes: int) -> ScrubTurn:
        """Check the recorded checkpoints of these sessions in the store; forget those whose files are gone or
        damaged and mark their sessions for a full next save. Reads the registry before the store: a checkpoint
        recorded is committed first, so one the store lacks was lost, or retired by retention meanwhile (which
        ``forget_lost`` then leaves alone)."""
        done = ScrubTurn(sessions=len(session_ids))
        recorded = await self.replica.registry.recorded_checkpoints(session_ids, CHECKPOINTS_PER_SESSION)
        pairs = [(sid, cid) for sid, cids in recorded.items() for cid in cids]
        slots = asyncio.Semaphore(MANIFEST_READS)

        async def read(sid: str, cid: str) -> CheckpointManifest | Finding | None:
            async with slots:
                try:
                    return await self.replica.store.manifest(sid, cid)
                except CheckpointNotFound:
                    return Finding(sid, cid, "manifest", "manifest missing from the store")
                except ManifestCorrupt as exc:
                    return Finding(sid, cid, "manifest", f"manifest unreadable: {exc}")
                except StoreError as exc:
                    log.warning(
                        "manifest not read; checked on the next walk", extra={"session": sid, "error": str(exc)}
                    )
                    return None

        manifests: list[CheckpointManifest] = []
        for outcome in await asyncio.gather(*(read(sid, cid) for sid, cid in pairs)):
            if isinstance(outcome, Finding):
                done.findings.append(outcome)
            elif outcome is None:
                done.unreadable += 1
            else:
                manifests.append(outcome)
        sizes = (
            await self.replica.store.pack_sizes({ref.pack for m in manifests for ref in m.blocks}) if manifests else {}
        )
        whole: list[CheckpointManifest] = []
        for m in manifests:
            problem = lost_pack(m, sizes)
            if problem:
                done.findings.append(Finding(m.session_id, m.checkpoint_id, "pack", problem))
            else:
                whole.append(m)
        rotten, done.sampled_bytes = await self._sample(whole, sample_bytes)
        done.findings += rotten
        done.checked = len(pairs) - done.unreadable
        self.replica.metrics.scrub_checked.inc(done.checked)
        await self._forget(done)
        return done

    async def _sample(self, manifests: Iterable[CheckpointManifest], budget: int) -> tuple[list[Finding], int]:
        """Read back blocks picked at random, up to ``budget`` bytes, and compare each with its digest (blocks of
        encrypted checkpoints are left out: their digest is of the plaintext). Returns the checkpoints holding a
        block that does not match, and the bytes read."""
        holders: dict[tuple[str, int], list[CheckpointManifest]] = {}
        refs: dict[tuple[str, int], ChunkRef] = {}
        for m in manifests:
            if m.key_id:
                continue
            for ref in m.blocks:
                refs.setdefault((ref.pack, ref.offset), ref)
                holders.setdefault((ref.pack, ref.offset), []).append(m)
        picked: list[ChunkRef] = []
        spent = 0
        for where in self._rng.sample(sorted(refs), len(refs)) if budget > 0 else []:
            ref = refs[where]
            if spent + ref.length > budget:
                continue
            picked.append(ref)
            spent += ref.length
        if not picked:
            return [], 0
        buffers = [memoryview(bytearray(ref.length)) for ref in picked]
        try:
            await self.replica.store.read_chunks(picked, buffers)
        except StoreError as exc:
            log.warning("scrub's sample not read", extra={"error": str(exc)})
            return [], 0
        findings: dict[str, Finding] = {}
        for ref, data in zip(picked, buffers, strict=True):
            if digest(data) != ref.digest:
                detail = f"block at {ref.pack}+{ref.offset} does not match its digest"
                for m in holders[(ref.pack, ref.offset)]:
                    findings.setdefault(m.checkpoint_id, Finding(m.session_id, m.checkpoint_id, "rot", detail))
        return list(findings.values()), spent

    async def _forget(self, done: ScrubTurn) -> None:
        """Each finding forgotten in the registry (a rotten newest kept), its holder marked, its event published."""
        registry = self.replica.registry
        metrics = self.replica.metrics
        events: list[Event] = []
        marked: set[str] = set()
        for f in done.findings:
            outcome = await registry.forget_lost(f.session_id, f.checkpoint_id, keep_newest=f.reason == "rot")
            if outcome.holder and f.session_id not in marked and (outcome.forgotten or outcome.newest):
                marked.add(f.session_id)
            if not outcome.forgotten:
                continue
            done.forgotten += 1
            metrics.scrub_forgotten.labels(f.reason).inc()
            log.warning(
                "recorded checkpoint's files gone or damaged in the store; forgotten",
                extra={"session": f.session_id, "checkpoint": f.checkpoint_id, "reason": f.detail},
            )
            events.append(
                CheckpointForgotten(
                    session_id=f.session_id,
                    checkpoint_id=f.checkpoint_id,
                    reason=f.reason,
                    detail=f.detail,
                    newest=outcome.newest,
                    pod=outcome.holder,
                )
            )
        done.marked = len(marked)
        metrics.rewrites.labels("scrub").inc(len(marked))
        if events:
            try:
                await self.replica.ctx.bus.publish_many(events)
            except Exception as exc:  # what the registry forgot stays forgotten; the log and the metric say it
                log.warning(
                    "checkpoint.forgotten events not published", extra={"events": len(events), "error": str(exc)}
                )
