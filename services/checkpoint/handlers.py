"""The checkpoint service: on every drain, every session on the node is committed before anyone evicts a pod.

It decides, orders, verifies and records; the bytes go from each pod's KV agent straight to the store.

A drain: take the drain's lease (one runner per drain; a crashed runner's lease expires and the redelivered
request resumes it), find the node's sessions in the registry, command each pod's agent to save everything it
holds with a deadline shorter than the pods' grace period (bounded parallelism), verify each committed manifest
in the store, record it, and only then publish ``drain.completed`` (all committed) or ``drain.failed`` (which
sessions, why). A drain that already has a verdict is not run again.

A GPU that fails (``device.health.changed``, unhealthy, naming the pods that hold it) has those pods' agents save
everything they hold at once, before the pods are restarted or moved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import defaultdict

from prometheus_client import Counter, Gauge, Histogram

from shared.contract.base import is_token
from shared.contract.checkpoint import (
    AgentSessions,
    CheckpointFailed,
    CheckpointLocation,
    CheckpointSaved,
    LocateCheckpoint,
    SaveSessions,
    SaveSessionsReport,
    SessionRestored,
)
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.deadletter import DeadLetter
from shared.contract.device import DeviceHealthChanged
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested, SessionFailure
from shared.kv.store import CheckpointStore, StoreError
from shared.plumbing.bus import ConsumerSpec
from shared.plumbing.configsync import redis_client
from shared.plumbing.errors import PermanentError, TemporaryError
from shared.plumbing.runner import ServiceContext

from .config import CheckpointSettings, load
from .registry import SessionRegistry
from .retention import CheckpointRecord, RetentionPolicy, expired, unreferenced_packs

log = logging.getLogger(__name__)

GPU_FAILURE_SAVE_S = 20.0
"""The deadline a pod on a failing GPU gets for its save."""


class CheckpointService:
    name = "checkpoint"
    config_names: tuple[str, ...] = ("checkpoint", "models")

    def __init__(self, settings: CheckpointSettings | None = None, store: CheckpointStore | None = None) -> None:
        self.settings = settings or load()
        self.store = store
        self.drains: dict[str, str] = {}
        self.owner = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._manifest_cache: dict[str, CheckpointRecord] = {}

    # -- wiring ---------------------------------------------------------------------------------------------------
    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        if self.store is None:
            from shared.kv.stores import open_store

            self.store = open_store(self.settings.store, ctx.bus.nc)
        self.registry = SessionRegistry(redis_client(ctx.settings.redis), ctx.subjects)
        r = ctx.telemetry.registry
        self.m_bytes = Counter(
            "gpuwarden_checkpoint_bytes_total", "Bytes committed to checkpoints", ["kind"], registry=r
        )
        self.m_sessions = Counter(
            "gpuwarden_checkpoint_sessions_total", "Sessions saved, by outcome", ["outcome"], registry=r
        )
        self.m_drain = Histogram(
            "gpuwarden_drain_seconds",
            "Time from taking a drain to its verdict",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
            registry=r,
        )
        self.m_gbps = Gauge("gpuwarden_checkpoint_last_drain_gbps", "GB/s of the last drain", registry=r)
        s = ctx.subjects
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("checkpoint", "drains"),
                filter_subjects=(s.pattern("node.drain.requested"),),
                accepts=(DrainRequested,),
                stream=s.events_stream,
                ack_wait=30.0,
                concurrency=4,
                max_deliver=10,
            ),
            self.on_drain_requested,
        )
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("checkpoint", "gpu-failures"),
                filter_subjects=(s.pattern("device.health.changed"),),
                accepts=(DeviceHealthChanged,),
                stream=s.events_stream,
                ack_wait=GPU_FAILURE_SAVE_S * 3,
                concurrency=4,
                max_deliver=3,
            ),
            self.on_gpu_health,
        )
        await ctx.bus.subscribe(
            s.pattern("checkpoint.agent.sessions"), self.on_announcement, (AgentSessions,), queue="checkpoint"
        )
        await ctx.bus.serve(s.command("checkpoint", "locate"), self.on_locate, (LocateCheckpoint,), queue="checkpoint")
        await ctx.bus.serve(
            s.command("checkpoint", "restored"), self.on_restored, (SessionRestored,), queue="checkpoint"
        )
        await ctx.bus.serve(
            s.command("checkpoint", "record"), self.on_record, (SaveSessionsReport,), queue="checkpoint"
        )
        ctx.status["drains"] = self.drains
        ctx.status["store"] = self.store.url
        if self.settings.gc_interval_s > 0:
            ctx.spawn(self._gc_loop, "checkpoint-gc")

    def policy(self) -> CheckpointPolicy:
        current = self.ctx.config.current("checkpoint")
        return current.doc if current and isinstance(current.doc, CheckpointPolicy) else CheckpointPolicy()

    # -- the registry -----------------------------------------------------------------------------------------------
    async def on_announcement(self, event: AgentSessions) -> None:
        """Idempotent: the announcement replaces what the pod held before."""
        await self.registry.apply_announcement(event)

    # -- failing GPUs -----------------------------------------------------------------------------------------------
    async def on_gpu_health(self, event: DeviceHealthChanged) -> None:
        """Each pod on a GPU that failed saves all it holds; its agent records what it committed (as after a
        periodic save). Idempotent: saving unchanged sessions again writes no new bytes. A pod whose agent does
        not answer is logged; its sessions' last checkpoints stand."""
        if event.healthy or not event.pods:
            return
        limit = asyncio.Semaphore(self.policy().drain_parallelism)

        async def save(pod: str) -> None:
            name = pod.rpartition("/")[2]
            if not is_token(name):
                log.warning("pod on a failing GPU has a name no agent answers to", extra={"pod": pod})
                return
            command = SaveSessions(pod=name, deadline_s=GPU_FAILURE_SAVE_S, reason="gpu-unhealthy")
            async with limit:
                try:
                    reply = await self.ctx.bus.request(
                        self.ctx.subjects.for_event(command), command, timeout=GPU_FAILURE_SAVE_S + 5
                    )
                except TimeoutError as exc:
                    log.warning("pod on a failing GPU did not save", extra={"pod": pod, "error": str(exc)})
                    return
            if isinstance(reply, SaveSessionsReport):
                log.info(
                    "pod on a failing GPU saved",
                    extra={"pod": pod, "gpu": event.gpu_uuid, "committed": len(reply.committed)},
                )
            else:
                log.warning("pod on a failing GPU refused the save", extra={"pod": pod, "reply": reply.kind})

        await asyncio.gather(*(save(pod) for pod in sorted(set(event.pods))))

    # -- drains -----------------------------------------------------------------------------------------------------
    async def on_drain_requested(self, event: DrainRequested) -> None:
        """Idempotent on ``drain_id``: a drain with a verdict is not run again; a drain being run elsewhere is
        retried later (and resumed if its runner died)."""
        if event.deadline_s <= 0 or event.deadline_s > event.grace_period_s:
            raise PermanentError(
                f"drain {event.drain_id}: deadline_s={event.deadline_s} must be positive and shorter than "
                f"grace_period_s={event.grace_period_s}"
            )
        if await self.registry.drain_verdict(event.drain_id) is not None:
            log.info("drain already decided; nothing to do", extra={"drain_id": event.drain_id})
            return
        if not await self.registry.take_drain(event.drain_id, event.node, self.owner, event.deadline_s + 15):
            raise TemporaryError(f"drain {event.drain_id} is being run by another replica", delay=2.0)
        self.drains[event.drain_id] = "running"
        started = time.monotonic()
        try:
            verdict = await self._drain(event, started)
        except Exception:
            self.drains[event.drain_id] = "interrupted"
            raise
        duration = time.monotonic() - started
        self.m_drain.observe(duration)
        await self.ctx.publish(verdict)
        await self.registry.finish_drain(
            event.drain_id,
            {
                "state": "completed" if isinstance(verdict, DrainCompleted) else "failed",
                "duration_s": duration,
                "event_id": verdict.event_id,
            },
        )
        self.drains[event.drain_id] = "completed" if isinstance(verdict, DrainCompleted) else "failed"

    async def _drain(self, event: DrainRequested, started: float) -> DrainCompleted | DrainFailed:
        sessions = await self.registry.sessions_on_node(event.node)
        by_pod: dict[str, set[str]] = defaultdict(set)
        for location in sessions:
            by_pod[location.pod].add(location.session_id)
        agent_deadline = max(0.1, event.deadline_s * 0.8)
        limit = asyncio.Semaphore(self.policy().drain_parallelism)

        async def save(pod: str) -> tuple[str, SaveSessionsReport | str]:
            async with limit:
                remaining = event.deadline_s - (time.monotonic() - started)
                command = SaveSessions(
                    pod=pod, drain_id=event.drain_id, deadline_s=min(agent_deadline, remaining * 0.9)
                )
                subject = self.ctx.subjects.for_event(command)
                try:
                    reply = await self.ctx.bus.request(subject, command, timeout=max(0.05, remaining))
                except TimeoutError as exc:
                    return pod, f"pod {pod}'s KV agent did not answer within the drain deadline ({exc})"
                if isinstance(reply, DeadLetter):
                    return pod, f"pod {pod}'s KV agent refused the save: {reply.reason}"
                if not isinstance(reply, SaveSessionsReport):
                    return pod, f"pod {pod}'s KV agent answered {reply.kind}, not a save report"
                return pod, reply

        results = await asyncio.gather(*(save(pod) for pod in sorted(by_pod)))
        failed: list[SessionFailure] = []
        committed: set[str] = set()
        total = 0
        for pod, outcome in results:
            if isinstance(outcome, str):
                failed += [SessionFailure(session_id=s, pod=pod, reason=outcome) for s in sorted(by_pod[pod])]
                continue
            ok, bad, nbytes = await self._record_report(outcome, event.drain_id)
            committed |= ok
            total += nbytes
            failed += bad
            for sid in sorted(by_pod[pod] - ok - {f.session_id for f in bad}):
                failed.append(SessionFailure(session_id=sid, pod=pod, reason=f"pod {pod} did not report it"))
        for failure in failed:
            self.m_sessions.labels("failed").inc()
            await self.ctx.publish(
                CheckpointFailed(
                    session_id=failure.session_id,
                    reason=failure.reason,
                    node=event.node,
                    pod=failure.pod,
                    drain_id=event.drain_id,
                )
            )
        duration = time.monotonic() - started
        if duration > 0 and total:
            self.m_gbps.set(total / duration / 1e9)
        log.info(
            "drain decided",
            extra={
                "drain_id": event.drain_id,
                "node": event.node,
                "committed": len(committed),
                "failed": len(failed),
                "bytes": total,
                "seconds": round(duration, 3),
            },
        )
        if failed:
            return DrainFailed(
                node=event.node,
                drain_id=event.drain_id,
                reason=f"{len(failed)} session(s) not checkpointed",
                failed_sessions=failed,
                sessions_committed=len(committed),
            )
        return DrainCompleted(
            node=event.node,
            drain_id=event.drain_id,
            sessions_committed=len(committed),
            bytes_saved=total,
            duration_s=duration,
        )

    async def _record_report(
        self, report: SaveSessionsReport, drain_id: str
    ) -> tuple[set[str], list[SessionFailure], int]:
        """Verify each committed checkpoint in the store (manifest present and as reported, every pack it
        references present), record it, and publish ``checkpoint.saved``. Idempotent: recording the same
        checkpoint twice writes the same records."""
        assert self.store is not None
        ok: set[str] = set()
        failed = list(report.failed)
        total = 0
        try:
            packs = {p.pack_id: p.size for p in await self.store.packs()}
        except StoreError as exc:
            return (
                set(),
                failed
                + [
                    SessionFailure(session_id=c.session_id, pod=report.pod, reason=f"store unreadable: {exc}")
                    for c in report.committed
                ],
                0,
            )
        for c in report.committed:
            try:
                manifest = await self.store.manifest(c.session_id, c.checkpoint_id)
            except StoreError as exc:
                failed.append(SessionFailure(session_id=c.session_id, pod=report.pod, reason=f"not in store: {exc}"))
                continue
            problem = ""
            if manifest.bytes_total != c.bytes_total or len(manifest.blocks) != c.chunks:
                problem = "manifest differs from the agent's report"
            for ref in manifest.blocks:
                if ref.pack not in packs or packs[ref.pack] < ref.offset + ref.length:
                    problem = f"pack {ref.pack} missing or short"
                    break
            if problem:
                failed.append(SessionFailure(session_id=c.session_id, pod=report.pod, reason=problem))
                continue
            await self.registry.record_checkpoint(c, report.store, report.pod, report.node)
            self.m_bytes.labels("logical").inc(c.bytes_total)
            self.m_bytes.labels("written").inc(c.bytes_written)
            self.m_sessions.labels("committed").inc()
            await self.ctx.publish(
                CheckpointSaved(
                    session_id=c.session_id,
                    checkpoint_id=c.checkpoint_id,
                    node=report.node,
                    pod=report.pod,
                    deployment=manifest.deployment,
                    bytes_total=c.bytes_total,
                    bytes_written=c.bytes_written,
                    chunks=c.chunks,
                    drain_id=drain_id,
                )
            )
            ok.add(c.session_id)
            total += c.bytes_total
        return ok, failed, total

    async def on_record(self, report: SaveSessionsReport) -> SaveSessionsReport:
        """Periodic and preStop saves reported by agents: verified and recorded like a drain's."""
        ok, failed, _ = await self._record_report(report, "")
        return SaveSessionsReport(
            pod=report.pod,
            node=report.node,
            store=report.store,
            committed=[c for c in report.committed if c.session_id in ok],
            failed=failed,
        )

    # -- restores ---------------------------------------------------------------------------------------------------
    async def on_locate(self, event: LocateCheckpoint) -> CheckpointLocation:
        """Read-only, except for the restore record: answering twice is harmless."""
        assert self.store is not None
        newest = await self.registry.newest_checkpoint(event.session_id)
        if newest is None:
            ids = await self.store.checkpoints(event.session_id)
            if not ids:
                return CheckpointLocation(session_id=event.session_id, found=False, store=self.store.url)
            manifest = await self.store.manifest(event.session_id, ids[0])
            newest = {"checkpoint_id": ids[0], "bytes_total": manifest.bytes_total}
        checkpoint_id = str(newest["checkpoint_id"])
        await self.registry.record_restore(event.session_id, checkpoint_id, event.pod, event.node)
        return CheckpointLocation(
            session_id=event.session_id,
            found=True,
            checkpoint_id=checkpoint_id,
            store=self.store.url,
            bytes_total=int(newest.get("bytes_total", 0)),  # type: ignore[call-overload]
        )

    async def on_restored(self, event: SessionRestored) -> SessionRestored:
        await self.ctx.publish(event)
        return event

    # -- retention --------------------------------------------------------------------------------------------------
    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gc_interval_s)
            await self.collect_garbage()

    async def collect_garbage(self, now: float | None = None) -> tuple[int, int]:
        """Apply the retention policy, then delete packs nothing references. Returns (checkpoints, packs)."""
        assert self.store is not None
        now = time.time() if now is None else now
        policy = self.policy()
        records: list[CheckpointRecord] = []
        for sid in await self.store.sessions():
            for cid in await self.store.checkpoints(sid):
                record = self._manifest_cache.get(cid)
                if record is None:
                    try:
                        m = await self.store.manifest(sid, cid)
                    except StoreError:
                        continue
                    record = CheckpointRecord(sid, cid, m.created_at.timestamp(), frozenset(m.packs))
                    self._manifest_cache[cid] = record
                records.append(record)
        packs = await self.store.packs()
        doomed = expired(
            records,
            RetentionPolicy(policy.keep_per_session, policy.max_age_s, policy.max_total_bytes),
            {p.pack_id: p.size for p in packs},
            now,
        )
        for record in doomed:
            await self.store.delete_checkpoint(record.session_id, record.checkpoint_id)
            await self.registry.forget_checkpoint(record.session_id, record.checkpoint_id)
            self._manifest_cache.pop(record.checkpoint_id, None)
        gone = {r.checkpoint_id for r in doomed}
        kept = [r for r in records if r.checkpoint_id not in gone]
        garbage = unreferenced_packs({p.pack_id: p.modified for p in packs}, kept, now, self.settings.gc_grace_s)
        for pack_id in garbage:
            await self.store.delete_pack(pack_id)
        sweep = getattr(self.store, "sweep_orphans", None)  # object store: chunks an aborted save left behind
        if sweep is not None:
            await sweep(self.settings.gc_grace_s)
        if doomed or garbage:
            log.info("retention", extra={"checkpoints_deleted": len(doomed), "packs_deleted": len(garbage)})
        return len(doomed), len(garbage)
