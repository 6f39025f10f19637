"""The checkpoint service: on every drain, every session on the node is committed before anyone evicts a pod.

It decides, orders, verifies and records; the bytes go from each pod's KV agent straight to the store.

A drain: take the drain's lease (one runner per drain, renewed while it works; a runner that dies loses it within
``drain_lease_s`` and the redelivered request resumes the drain), refuse a node the cluster does not have, forget
pods that are gone, find the node's sessions in the registry, command each pod's agent to save the sessions it
holds, naming the generation of each (bounded parallelism, a deadline shorter than the pods' grace period),
verify each committed manifest in the store, record it if the pod still owns the session, and only then record
and publish one verdict: ``drain.completed`` (all committed) or ``drain.failed`` (which sessions, why; a long
list summarised, the whole of it in Redis). A drain id that already has a verdict is answered with it again.

Sessions are owned: a pod takes one by claiming it (``locate`` with ``claim``), which hands out the session's
next generation. Saves of an older generation are refused, so a pod that lost a session never rolls it back,
and restores use the checkpoints newest (generation, sequence) first. The store is the last word on what was
committed: a restore considers every checkpoint of the session the store holds, and records again the newer
ones a Redis failover made the registry lose; no generation is handed out at or below one a stored checkpoint
carries.

Periodic checkpoints: every ``periodic_interval_s`` of the ``checkpoint`` document each live pod is asked to
save what it holds (incremental: only new blocks are written), so a pod that dies without its preStop loses at
most one interval.

A GPU that fails (``device.health.changed``, unhealthy, naming the pods that hold it) has those pods' agents save
everything they hold at once, before the pods are restarted or moved.

Routers: every change of where a session's KV is (a pod claimed it, restored it, saved it, dropped it, ended
it, or is gone) is published once as ``kv.session.location``, from what the registry's script returned for the
change; ``kv.session.where`` over the bus and ``GET /sessions/<id>`` on the HTTP endpoint answer where it is now.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from shared.contract.base import DrainId, Event, id_problem, is_token
from shared.contract.checkpoint import (
    AgentSessions,
    AnnouncementAck,
    CheckpointFailed,
    CheckpointLocation,
    CheckpointSaved,
    CommittedCheckpoint,
    LocateCheckpoint,
    SaveSessions,
    SaveSessionsReport,
    SessionRestored,
)
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.deadletter import DeadLetter
from shared.contract.device import DeviceHealthChanged
from shared.contract.models import ServingQuery
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested, SessionFailure, deadline_problem
from shared.contract.registry import codec
from shared.contract.sessions import (
    FleetQuery,
    FleetSummary,
    SessionLocation,
    SessionRecord,
    SessionsPage,
    SessionsQuery,
    WhereIsSession,
)
from shared.kv.manifest import CheckpointManifest, checkpoint_order, newest_first
from shared.kv.store import CheckpointNotFound, CheckpointStore, StoreError
from shared.plumbing.bus import ConsumerSpec
from shared.plumbing.configsync import ConfigStore, redis_client
from shared.plumbing.errors import PermanentError, TemporaryError
from shared.plumbing.http import Response
from shared.plumbing.runner import ServiceContext
from shared.ports.cluster import ClusterPort

from .config import CheckpointSettings, load
from .registry import Claim, SessionRegistry
from .retention import CheckpointRecord, RetentionPolicy, expired, unreferenced_packs
from .rollout import RolloutCoordinator

log = logging.getLogger(__name__)

GPU_FAILURE_SAVE_S = 20.0
"""The deadline a pod on a failing GPU gets for its save."""

REPLICA_LEASE_S = 5.0
"""How long a replica counts as alive without renewing (it renews every tick, at most a second apart): a replica
that dies hands its share of periodic saves to the others within about this long."""

SAVE_BATCH = 1000
"""Sessions named in one save command of a drain: the command and its report stay far below the bus's payload
limit (about 200 bytes a session in a report)."""


def share_of(pod: str, replicas: Sequence[str]) -> str:
    """The replica that saves ``pod`` periodically: the highest hash of (pod, replica) wins (rendezvous hashing),
    so when a replica joins or leaves only the pods it wins or held move."""
    return max(replicas, key=lambda replica: hashlib.blake2b(f"{replica}|{pod}".encode(), digest_size=8).digest())


REASON_CHARS = 500
"""A failure's reason as far as a verdict repeats it."""

VERDICT_TTL_S = 7 * 24 * 3600.0

RESTORE_CANDIDATES = 16
"""Checkpoints a restore is offered, newest first."""


def periodic_slot(pod: str, interval_s: float, after: float) -> float:
    """The first of the pod's periodic save times (wall clock, seconds) after ``after``. Each pod's saves fall at a
    fixed point of every interval, taken from its name: the same on every replica (a pod that moves to another
    keeps its times) and spread evenly over the interval (a fleet's pods are not all due at once)."""
    digest = hashlib.blake2b(pod.encode(), digest_size=8).digest()
    phase = int.from_bytes(digest, "big") / 2**64 * interval_s
    return phase + (math.floor((after - phase) / interval_s) + 1) * interval_s


@dataclass(frozen=True)
class RestoreCandidates:
    """What a restore of one session may use: ``ids`` newest (generation, sequence) first; ``floor`` the newest
    generation any checkpoint of the session carries (the next one handed out is above it); ``from_store`` the
    ids the registry had lost and got back from the store; ``bytes_total`` of the first."""

    ids: list[str]
    floor: int
    from_store: list[str]
    bytes_total: int


class CheckpointService:
    name = "checkpoint"
    config_names: tuple[str, ...] = ("checkpoint", "models")

    def __init__(
        self,
        settings: CheckpointSettings | None = None,
        store: CheckpointStore | None = None,
        cluster: ClusterPort | None = None,
    ) -> None:
        self.settings = settings or load()
        self.store = store
        self.cluster = cluster
        self.drains: dict[str, str] = {}
        self.owner = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._manifest_cache: dict[str, CheckpointRecord] = {}
        self._periodic_due: dict[str, float] = {}
        self._periodic_running: set[str] = set()
        self._periodic_tasks: set[asyncio.Task[bool]] = set()
        self._periodic_share = 0

    # -- wiring ---------------------------------------------------------------------------------------------------
    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        if self.store is None:
            from shared.kv.stores import open_store

            self.store = store = open_store(self.settings.store, ctx.bus.nc)
            ctx.on_stop(store.close)  # only what the service opened itself is closed
        self.registry = SessionRegistry(redis_client(ctx.settings.redis), ctx.subjects)
        ctx.on_stop(self.registry.client.aclose)
        if self.cluster is None:
            self.cluster = await ctx.backends.cluster()
            ctx.on_stop(self.cluster.close)
        r = ctx.telemetry.registry
        self.m_bytes = Counter(
            "gpuwarden_checkpoint_bytes_total", "Bytes committed to checkpoints", ["kind"], registry=r
        )
        self.m_sessions = Counter(
            "gpuwarden_checkpoint_sessions_total", "Sessions saved, by outcome", ["outcome"], registry=r
        )
        self.m_refused = Counter(
            "gpuwarden_checkpoint_stale_refused_total",
            "Saves and announcements of sessions by pods that no longer own them, refused",
            ["what"],
            registry=r,
        )
        self.m_fallbacks = Counter(
            "gpuwarden_checkpoint_restore_fallbacks_total",
            "Newer checkpoints passed over by restores (missing, unreadable, corrupt)",
            registry=r,
        )
        self.m_drain = Histogram(
            "gpuwarden_drain_seconds",
            "Time from taking a drain to its verdict",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
            registry=r,
        )
        self.m_drain_rate = Gauge(
            "gpuwarden_checkpoint_last_drain_bytes_per_second", "Bytes per second the last drain saved", registry=r
        )
        self.m_periodic = Histogram(
            "gpuwarden_checkpoint_periodic_save_seconds",
            "Time a pod's periodic save took (command to report)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        Gauge(
            "gpuwarden_checkpoint_periodic_pods",
            "Live pods this replica saves periodically (its share)",
            registry=r,
        ).set_function(lambda: self._periodic_share)
        self._save_slots = asyncio.Semaphore(self.settings.periodic_parallelism)
        self.m_repaired = Counter(
            "gpuwarden_checkpoint_registry_repaired_total",
            "Checkpoints the registry had lost (a Redis failover) that restores found in the store and recorded again",
            registry=r,
        )
        self.m_locations = Counter(
            "gpuwarden_kv_session_locations_total",
            "kv.session.location events, by outcome (published, or lost: routers then ask where)",
            ["outcome"],
            registry=r,
        )
        self.m_verdicts = Counter(
            "gpuwarden_drain_verdicts_total",
            "Drains decided here, by verdict (completed, failed)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("completed", "failed"):  # both series exist from the start, at 0: the first one counts
            self.m_verdicts.labels(outcome)
        self.m_restores = Counter(
            "gpuwarden_checkpoint_restores_total",
            "Sessions restored by a pod from a checkpoint whose every chunk digest it verified",
            registry=r,
        )
        self.m_periodic_missed = Counter(
            "gpuwarden_checkpoint_periodic_missed_total",
            "Periodic checkpoints a pod was due that it did not take (its agent did not answer, or refused)",
            registry=r,
        )
        self.m_periodic_late = Counter(
            "gpuwarden_checkpoint_periodic_late_total",
            "Periodic saves started more than 5 s after they were due (the pod's last save was still running)",
            registry=r,
        )
        self.m_periodic_tick = Gauge(
            "gpuwarden_checkpoint_periodic_tick_timestamp_seconds",
            "When the periodic loop last looked for pods due a save (seconds since the epoch; 0: not yet)",
            registry=r,
        )
        Gauge(
            "gpuwarden_checkpoint_periodic_interval_seconds",
            "The checkpoint document's periodic_interval_s (0: periodic checkpoints off)",
            registry=r,
        ).set_function(lambda: self.policy().periodic_interval_s)
        s = ctx.subjects
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("checkpoint", "drains"),
                filter_subjects=(s.pattern("node.drain.requested"),),
                accepts=(DrainRequested,),
                stream=s.events_stream,
                ack_wait=max(5.0, self.settings.drain_lease_s),
                concurrency=4,
                max_deliver=20,
                backoff=(1.0, 2.0, 4.0),
                on_refused=self.on_drain_refused,
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
        # announcements arrive on the pod's own subject; the bus refuses a body naming another pod
        await ctx.bus.serve(
            s.pattern("checkpoint.agent.sessions"), self.on_announcement, (AgentSessions,), queue="checkpoint"
        )
        # What a pod's KV agent asks, on subjects naming the pod: the body must name the same pod.
        for verb, responder, accepts in (
            ("locate", self.on_locate, (LocateCheckpoint,)),
            ("restored", self.on_restored, (SessionRestored,)),
            ("record", self.on_record, (SaveSessionsReport,)),
        ):
            await ctx.bus.serve(s.agent_commands(verb), responder, accepts, queue="checkpoint", scope_field="pod")
        await ctx.bus.serve(s.command("checkpoint", "where"), self.on_where, (WhereIsSession,), queue="checkpoint")
        await ctx.bus.serve(
            s.command("checkpoint", "sessions"), self.on_sessions_query, (SessionsQuery,), queue="checkpoint"
        )
        await ctx.bus.serve(s.command("checkpoint", "fleet"), self.on_fleet_query, (FleetQuery,), queue="checkpoint")
        self.rollouts = RolloutCoordinator(
            ctx, ConfigStore(self.registry.client, ctx.subjects), self.registry, self.cluster, self.owner
        )
        await ctx.bus.serve(
            s.agent_commands("serving"),
            self.rollouts.on_serving_query,
            (ServingQuery,),
            queue="checkpoint",
            scope_field="pod",
        )
        ctx.config.on_change(self.rollouts.wake)
        ctx.spawn(self.rollouts.loop, "checkpoint-rollouts")
        ctx.status["rollouts"] = self.rollouts.running
        ctx.add_route("/sessions/", self.on_http_session)
        ctx.status["drains"] = self.drains
        ctx.status["store"] = self.store.url
        if self.settings.gc_interval_s > 0:
            ctx.spawn(self._gc_loop, "checkpoint-gc")
        ctx.spawn(self._periodic_loop, "checkpoint-periodic")

    def policy(self) -> CheckpointPolicy:
        current = self.ctx.config.current("checkpoint")
        return current.doc if current and isinstance(current.doc, CheckpointPolicy) else CheckpointPolicy()

    # -- the registry -----------------------------------------------------------------------------------------------
    async def on_announcement(self, event: AgentSessions) -> AnnouncementAck:
        """Idempotent: a full announcement replaces what the pod held before; a delta applies what it names (a
        repeat of the last one applied changes nothing). Sessions held under a generation that moved on are
        stale copies: ignored, and named in the answer so the pod drops them. ``resync`` when the registry does
        not have what a delta builds on."""
        applied = await self.registry.apply_announcement(event)
        await self._publish_locations(applied.changes)
        for sid in applied.retired:
            await self.retire_session(sid)
        if applied.stale:
            self.m_refused.labels("announcement").inc(len(applied.stale))
            log.warning(
                "pod announced sessions it no longer owns; ignored",
                extra={
                    "pod": event.pod,
                    "node": event.node,
                    "sessions": applied.stale[:20],
                    "count": len(applied.stale),
                },
            )
        if applied.resync:
            log.info("pod's announcements to be resent in full", extra={"pod": event.pod, "seq": event.seq})
        return AnnouncementAck(pod=event.pod, seq=event.seq, resync=applied.resync, stale=applied.stale[:1000])

    async def retire_session(self, session_id: str) -> None:
        """A finished conversation: its checkpoints go (their packs become garbage for the collector), those only
        the store still knows (a Redis failover lost their records) included. The registry forgets each one before
        its file goes, so a Redis that fails meanwhile leaves no recorded checkpoint without its file."""
        assert self.store is not None
        ids = {str(r["checkpoint_id"]) for r in await self.registry.checkpoints(session_id, limit=10_000)}
        try:
            ids |= set(await self.store.checkpoints(session_id))
        except StoreError as exc:
            log.warning("ended session's checkpoints not listed", extra={"session": session_id, "error": str(exc)})
        for cid in sorted(ids, key=checkpoint_order):
            await self.registry.forget_checkpoint(session_id, cid)
            try:
                await self.store.delete_checkpoint(session_id, cid)
            except StoreError as exc:
                log.warning("ended session's checkpoint not deleted", extra={"session": session_id, "error": str(exc)})
                continue
            self._manifest_cache.pop(cid, None)

    async def _gone_pods(self, node: str | None = None) -> set[str]:
        """Pods the registry knows that stopped announcing and that the cluster no longer has. Empty when the
        cluster cannot say: a silent pod that may still exist keeps its sessions (a drain then fails for them
        rather than forgetting them)."""
        silent = await self.registry.silent_pods()
        if node is not None:
            silent = {p: n for p, n in silent.items() if n == node}
        if not silent:
            return set()
        assert self.cluster is not None
        try:
            present = {p.name for p in await self.cluster.pods(node=node)}
        except Exception as exc:
            log.warning("cluster unreadable; silent pods kept", extra={"error": str(exc), "pods": sorted(silent)})
            return set()
        gone = set(silent) - present
        for pod in sorted(gone):
            await self._publish_locations(await self.registry.forget_pod(pod))
            log.info("pod gone: its sessions left the registry", extra={"pod": pod, "node": silent[pod]})
        return gone

    # -- failing GPUs -----------------------------------------------------------------------------------------------
    async def on_gpu_health(self, event: DeviceHealthChanged) -> None:
        """Each pod on a GPU that failed saves all it owns, and what it committed is recorded. Idempotent:
        saving unchanged sessions again writes no new bytes. A pod whose agent does not answer is logged; its
        sessions' last checkpoints stand."""
        if event.healthy or not event.pods:
            return
        limit = asyncio.Semaphore(self.policy().drain_parallelism)

        async def save(pod: str) -> None:
            name = pod.rpartition("/")[2]
            if not is_token(name):
                log.warning("pod on a failing GPU has a name no agent answers to", extra={"pod": pod})
                return
            async with limit:
                outcome = await self._command_save(name, GPU_FAILURE_SAVE_S, "gpu-unhealthy")
            if isinstance(outcome, str):
                log.warning("pod on a failing GPU did not save", extra={"pod": pod, "error": outcome})
                return
            ok, failed, _ = await self._record_report(outcome, "")
            log.info(
                "pod on a failing GPU saved",
                extra={"pod": pod, "gpu": event.gpu_uuid, "committed": len(ok), "failed": len(failed)},
            )

        await asyncio.gather(*(save(pod) for pod in sorted(set(event.pods))))

    async def _command_save(
        self,
        pod: str,
        deadline_s: float,
        reason: str,
        drain_id: str = "",
        generations: dict[str, int] | None = None,
        timeout: float | None = None,
        changed_only: bool = False,
    ) -> SaveSessionsReport | str:
        """Have one pod's agent save; its report, or why there is none. With ``generations`` the pod saves those
        sessions, each only under the generation named (a session it holds under another is refused); without,
        all it holds (what it no longer owns is then refused when recorded). ``changed_only``: sessions with
        nothing new since their last checkpoint write nothing."""
        command = SaveSessions(
            pod=pod,
            drain_id=drain_id,
            deadline_s=deadline_s,
            reason=reason,
            generations=generations or {},
            changed_only=changed_only,
        )
        try:
            reply = await self.ctx.bus.request(
                self.ctx.subjects.for_event(command), command, timeout=timeout or deadline_s + 5
            )
        except TimeoutError as exc:
            within = "within the drain deadline" if drain_id else "in time"
            return f"pod {pod}'s KV agent did not answer {within} ({exc})"
        if isinstance(reply, DeadLetter):
            return f"pod {pod}'s KV agent refused the save: {reply.reason}"
        if not isinstance(reply, SaveSessionsReport):
            return f"pod {pod}'s KV agent answered {reply.kind}, not a save report"
        return reply

    # -- periodic checkpoints ---------------------------------------------------------------------------------------
    async def _periodic_loop(self) -> None:
        """Every pod of this replica's share is asked to save what changed once per ``periodic_interval_s``, on
        time: at its own point of every interval (``periodic_slot``), checked every twentieth of the interval (at
        most a second), and never more than one save of a pod runs at once."""
        while True:
            interval = self.policy().periodic_interval_s
            await asyncio.sleep(min(1.0, max(0.05, interval / 20)) if interval > 0 else 1.0)
            interval = self.policy().periodic_interval_s  # the document may have changed meanwhile
            try:
                if interval <= 0:  # still a member: shares are settled before periodic saves begin
                    await self.registry.replicas(self.owner, REPLICA_LEASE_S)
                    continue
                await self._periodic_tick(interval)
                self.m_periodic_tick.set_to_current_time()
            except TemporaryError as exc:
                log.warning("periodic checkpoints skipped this turn", extra={"error": str(exc)})

    async def _my_pods(self, lease_s: float) -> list[str]:
        """The live pods this replica saves periodically: each pod goes to one replica of those alive, by
        rendezvous hashing, so a replica that dies hands its share to the others when its lease lapses, and
        only the pods whose owner changed move."""
        replicas = await self.registry.replicas(self.owner, lease_s)
        known = await self.registry.pods()
        silent = await self.registry.silent_pods(known)
        live = sorted(set(known) - set(silent))
        if len(replicas) <= 1:
            return live
        return [pod for pod in live if share_of(pod, replicas) == self.owner]

    async def _periodic_tick(self, interval_s: float) -> None:
        now = time.time()
        mine = await self._my_pods(REPLICA_LEASE_S)
        self._periodic_share = len(mine)
        for pod in mine:
            if pod not in self._periodic_due:  # new to this replica: its first save at its own time
                self._periodic_due[pod] = periodic_slot(pod, interval_s, now)
            if pod in self._periodic_running or self._periodic_due[pod] > now:
                continue
            self.m_periodic_late.inc(1 if now - self._periodic_due[pod] > 5.0 else 0)
            self._periodic_due[pod] = now + interval_s  # until the save starts and sets its next time
            self._periodic_running.add(pod)
            task = asyncio.create_task(self._periodic_save(pod, interval_s), name=f"periodic-{pod}")
            self._periodic_tasks.add(task)
            task.add_done_callback(self._periodic_tasks.discard)
        for pod in [p for p in self._periodic_due if p not in mine]:
            del self._periodic_due[pod]

    async def periodic_saves(self, interval_s: float) -> int:
        """One pass now over every live pod of this replica's share whose turn can be taken (tests and tools):
        returns how many pods saved something."""
        mine = await self._my_pods(REPLICA_LEASE_S)
        saved = await asyncio.gather(*(self._periodic_save(pod, interval_s) for pod in mine))
        return sum(saved)

    async def _periodic_save(self, pod: str, interval_s: float) -> bool:
        """The pod's periodic save, if this replica takes its turn (one per interval and pod across replicas
        and restarts): only sessions with something new are written. Says whether anything was saved."""
        try:
            # the turn is taken, and the next save made due, when this save can start (a slot free), not when it
            # was queued: with many pods due at once, a save that waited for its slot would otherwise be followed
            # by the next one less than an interval later
            async with self._save_slots:
                held_ms = await self.registry.take_turn_or_wait("periodic", pod, self.owner, interval_s * 0.95)
                if held_ms:  # another replica saved it this interval: due when its turn lapses, not an interval on
                    self._periodic_due[pod] = time.time() + held_ms / 1000
                    return False
                started = time.monotonic()
                # the next save at the pod's next own time, one interval after this one's (however late this one
                # started): a delay is not carried into the next interval
                self._periodic_due[pod] = periodic_slot(pod, interval_s, time.time() + interval_s / 2)
                outcome = await self._command_save(
                    pod, max(1.0, min(interval_s, 60.0) * 0.8), "periodic", changed_only=True
                )
        except TemporaryError as exc:
            log.warning("periodic checkpoint not taken", extra={"pod": pod, "error": str(exc)})
            self._retry_soon(pod, interval_s)
            return False
        finally:
            self._periodic_running.discard(pod)
        if isinstance(outcome, str):
            self.m_periodic_missed.inc()
            log.warning("periodic checkpoint not taken", extra={"pod": pod, "error": outcome})
            with contextlib.suppress(TemporaryError):  # the turn goes back: the pod is asked again soon
                await self.registry.release_turn("periodic", pod, self.owner)
            self._retry_soon(pod, interval_s)
            return False
        self.m_periodic.observe(time.monotonic() - started)
        if outcome.committed or outcome.failed:
            await self._record_report(outcome, "")
            return True
        return False

    def _retry_soon(self, pod: str, interval_s: float) -> None:
        """A periodic save that did not happen is tried again within a tenth of the interval (5 s at most), not
        an interval later."""
        self._periodic_due[pod] = time.time() + min(5.0, interval_s / 10)

    # -- drains -----------------------------------------------------------------------------------------------------
    async def on_drain_requested(self, event: DrainRequested) -> None:
        """Idempotent on ``drain_id``: a drain with a verdict is answered with it again (the recorded event,
        under a new event id) and not run again; a drain being run elsewhere is retried later, and resumed by
        the next delivery if its runner died (its lease lapses within ``drain_lease_s``)."""
        problem = deadline_problem(event.deadline_s, event.grace_period_s)
        if problem:
            raise PermanentError(f"drain {event.drain_id}: {problem}")
        if await self._answer_again(event.drain_id):
            return
        lease_s = self.settings.drain_lease_s
        if not await self.registry.take_drain(event.drain_id, event.node, self.owner, lease_s):
            raise TemporaryError(f"drain {event.drain_id} is being run by another replica", delay=lease_s / 2)
        self.drains[event.drain_id] = "running"
        started = time.monotonic()
        keeper = asyncio.create_task(self._keep_lease(event.drain_id), name=f"drain-lease-{event.drain_id}")
        try:
            verdict = await self._drain(event, started)
        except BaseException:
            self.drains[event.drain_id] = "interrupted"
            raise
        finally:
            keeper.cancel()
        duration = time.monotonic() - started
        self.m_drain.observe(duration)
        state = "completed" if isinstance(verdict, DrainCompleted) else "failed"
        self.m_verdicts.labels(state).inc()
        if await self.registry.finish_drain(event.drain_id, state, codec.encode(verdict), duration):
            await self.ctx.publish(verdict)
        else:  # another runner decided it first (this one lost its lease): that verdict stands
            await self._answer_again(event.drain_id)
        self.drains[event.drain_id] = state
        while len(self.drains) > 1000:
            self.drains.pop(next(iter(self.drains)))

    async def on_drain_refused(self, subject: str, data: bytes, reason: str) -> None:
        """A drain request that cannot be run (bad fields, a body naming another node than its subject, or out
        of deliveries) still gets its one verdict when it names a drain: ``drain.failed`` with the reason, on the
        node its subject names (the one its sender was allowed to publish on). A drain id already recorded for
        another node is left alone: a forged copy never decides someone else's drain."""
        node = self.ctx.subjects.node_of(subject, "node.drain.requested")
        drain_id = _lax_drain_id(data)
        if not node or not drain_id:
            return
        verdict = DrainFailed(node=node, drain_id=drain_id, reason=f"drain request refused: {reason}"[:REASON_CHARS])
        try:
            recorded = await self.registry.drain_node(drain_id)
            if recorded not in (None, node):
                log.warning("refused drain request names another node's drain", extra={"drain_id": drain_id})
                return
            if not await self.registry.finish_drain(drain_id, "failed", codec.encode(verdict), 0.0):
                await self._answer_again(drain_id)
                return
        except TemporaryError as exc:  # Redis away: the verdict is still sent, not recorded
            log.warning("refused drain's verdict not recorded", extra={"drain_id": drain_id, "error": str(exc)})
        self.drains[drain_id] = "failed"
        await self.ctx.publish(verdict)

    async def _answer_again(self, drain_id: str) -> bool:
        recorded = await self.registry.drain_verdict(drain_id)
        if recorded is None:
            return False
        verdict = codec.decode(recorded)
        log.info("drain already decided; its verdict is sent again", extra={"drain_id": drain_id})
        await self.ctx.publish(msgspec.structs.replace(verdict, event_id=uuid.uuid4().hex, source=""))
        return True

    async def _keep_lease(self, drain_id: str) -> None:
        lease_s = self.settings.drain_lease_s
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                if not await self.registry.renew_drain(drain_id, self.owner, lease_s):
                    log.warning("drain lease lost while running", extra={"drain_id": drain_id})
                    return
            except Exception as exc:
                log.warning("drain lease not renewed", extra={"drain_id": drain_id, "error": str(exc)})

    async def _node_missing(self, node: str) -> bool:
        assert self.cluster is not None
        try:
            return await self.cluster.node(node) is None
        except Exception as exc:
            log.warning("cluster unreadable; drain goes on", extra={"node": node, "error": str(exc)})
            return False

    async def _drain(self, event: DrainRequested, started: float) -> DrainCompleted | DrainFailed:
        if await self._node_missing(event.node):
            return DrainFailed(
                node=event.node,
                drain_id=event.drain_id,
                reason=f"node {event.node} is not in the cluster: nothing to drain",
            )
        await self._gone_pods(event.node)
        sessions = await self.registry.sessions_on_node(event.node)
        by_pod: dict[str, dict[str, int]] = defaultdict(dict)
        for location in sessions:
            by_pod[location.pod][location.session_id] = location.generation
        agent_deadline = max(0.1, event.deadline_s * 0.8)
        limit = asyncio.Semaphore(self.policy().drain_parallelism)

        async def save(pod: str, batch: dict[str, int]) -> tuple[str, SaveSessionsReport | str]:
            async with limit:
                remaining = event.deadline_s - (time.monotonic() - started)
                outcome = await self._command_save(
                    pod,
                    min(agent_deadline, remaining * 0.9),
                    "drain",
                    drain_id=event.drain_id,
                    generations=batch,
                    timeout=max(0.05, remaining),
                )
                return pod, outcome

        async def save_pod(pod: str) -> list[tuple[str, SaveSessionsReport | str]]:
            """A pod's sessions in batches of ``SAVE_BATCH``, one after the other: no command or report passes
            the bus's payload limit, however many sessions the pod holds."""
            sids = sorted(by_pod[pod])
            return [
                await save(pod, {sid: by_pod[pod][sid] for sid in sids[i : i + SAVE_BATCH]})
                for i in range(0, len(sids), SAVE_BATCH)
            ]

        results = [r for rs in await asyncio.gather(*(save_pod(pod) for pod in sorted(by_pod))) for r in rs]
        failed: list[SessionFailure] = []
        committed: set[str] = set()
        total = 0
        reported: dict[str, set[str]] = defaultdict(set)
        pods_failed: set[str] = set()
        for pod, outcome in results:
            if isinstance(outcome, str):
                if pod not in pods_failed:
                    pods_failed.add(pod)
                    failed += [SessionFailure(session_id=s, pod=pod, reason=outcome) for s in sorted(by_pod[pod])]
                continue
            ok, bad, nbytes = await self._record_report(outcome, event.drain_id)
            committed |= ok
            total += nbytes
            failed += bad
            if outcome.not_held:
                log.info(
                    "sessions no longer held by their pod: nothing of them to save",
                    extra={"pod": pod, "sessions": outcome.not_held[:20], "count": len(outcome.not_held)},
                )
            reported[pod] |= ok | {f.session_id for f in bad} | set(outcome.not_held)
        for pod, sids in by_pod.items():
            if pod in pods_failed:
                continue
            for sid in sorted(set(sids) - reported[pod]):
                failed.append(SessionFailure(session_id=sid, pod=pod, reason=f"pod {pod} did not report it"))
        failed = await self._still_here(event.node, failed)
        await self.ctx.bus.publish_many(
            [
                CheckpointFailed(
                    session_id=f.session_id,
                    reason=f.reason[:REASON_CHARS],
                    node=event.node,
                    pod=f.pod,
                    drain_id=event.drain_id,
                )
                for f in failed
                if is_token(f.session_id)
            ]
        )
        self.m_sessions.labels("failed").inc(len(failed))
        duration = time.monotonic() - started
        if duration > 0 and total:
            self.m_drain_rate.set(total / duration)
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
            return await self._failed_verdict(event, failed, len(committed))
        return DrainCompleted(
            node=event.node,
            drain_id=event.drain_id,
            sessions_committed=len(committed),
            bytes_saved=total,
            duration_s=duration,
        )

    async def _still_here(self, node: str, failed: list[SessionFailure]) -> list[SessionFailure]:
        """Failures of sessions that have meanwhile moved off the node (another pod took them) are not this
        drain's to report: the pod that owns them now holds them elsewhere."""
        if not failed:
            return failed
        here = {s.session_id for s in await self.registry.sessions_on_node(node)}
        moved = [f for f in failed if f.session_id not in here]
        if moved:
            log.info(
                "sessions moved off the draining node; not its failures",
                extra={"node": node, "sessions": [f.session_id for f in moved[:20]], "count": len(moved)},
            )
        return [f for f in failed if f.session_id in here]

    async def _failed_verdict(self, event: DrainRequested, failed: list[SessionFailure], committed: int) -> DrainFailed:
        """A verdict that always fits one event: the first ``verdict_sessions_max`` failures by name, every one
        counted, and the whole list kept in Redis when there are more."""
        named = [msgspec.structs.replace(f, reason=f.reason[:REASON_CHARS]) for f in failed]
        limit = self.settings.verdict_sessions_max
        ref = ""
        if len(named) > limit:
            ref = await self.registry.keep_failures(
                event.drain_id, [msgspec.json.encode(f) for f in named], VERDICT_TTL_S
            )
        return DrainFailed(
            node=event.node,
            drain_id=event.drain_id,
            reason=f"{len(failed)} session(s) not checkpointed",
            failed_sessions=named[:limit],
            sessions_committed=committed,
            failed_total=len(failed),
            failed_ref=ref,
        )

    async def _record_report(
        self, report: SaveSessionsReport, drain_id: str
    ) -> tuple[set[str], list[SessionFailure], int]:
        """Verify each committed checkpoint in the store (manifest present, verified and as reported, every pack
        it references present and long enough), record it if the pod still owns the session's generation, and
        publish ``checkpoint.saved``. A checkpoint of a pod that no longer owns the session is refused: not
        recorded, its manifest removed, reported as failed. What it reads and writes follows the report, never
        the store. Idempotent: recording the same checkpoint twice writes the same records.

        Drains and preStop hooks both save a pod's sessions, often one right after the other: each report is
        recorded on its own, and the newer checkpoint (by generation, sequence) is the one restores take."""
        assert self.store is not None
        ok: set[str] = set()
        failed = list(report.failed)
        total = 0
        manifests: list[tuple[CommittedCheckpoint, CheckpointManifest]] = []
        read = await asyncio.gather(
            *(self.store.manifest(c.session_id, c.checkpoint_id) for c in report.committed), return_exceptions=True
        )
        for c, manifest in zip(report.committed, read, strict=True):
            if isinstance(manifest, StoreError):
                reason = f"not in store: {manifest}"
                failed.append(SessionFailure(session_id=c.session_id, pod=report.pod, reason=reason))
            elif isinstance(manifest, BaseException):
                raise manifest
            else:
                manifests.append((c, manifest))
        try:
            packs = await self.store.pack_sizes({ref.pack for _, m in manifests for ref in m.blocks})
        except StoreError as exc:
            reason = f"store unreadable: {exc}"
            return (
                set(),
                failed + [SessionFailure(session_id=c.session_id, pod=report.pod, reason=reason) for c, _ in manifests],
                0,
            )
        problems: dict[str, str] = {}
        for c, manifest in manifests:
            if manifest.bytes_total != c.bytes_total or len(manifest.blocks) != c.chunks:
                problems[c.checkpoint_id] = "manifest differs from the agent's report"
            elif (manifest.generation, manifest.sequence, manifest.pod) != (c.generation, c.sequence, report.pod):
                problems[c.checkpoint_id] = "manifest's generation, sequence or pod differs from the agent's report"
            for ref in manifest.blocks:
                if ref.pack not in packs or packs[ref.pack] < ref.offset + ref.length:
                    problems[c.checkpoint_id] = f"pack {ref.pack} missing or short"
                    break
        sound = [c for c, _ in manifests if c.checkpoint_id not in problems]
        recorded = dict(
            zip(
                (c.checkpoint_id for c in sound),
                await self.registry.record_checkpoints(sound, report.store, report.pod, report.node),
                strict=True,
            )
        )
        events: list[Event] = []
        for c, manifest in manifests:
            problem = problems.get(c.checkpoint_id, "")
            if not problem:
                refused, location = recorded[c.checkpoint_id]
                if refused:
                    self.m_refused.labels("save").inc()
                    problem = f"refused: pod {report.pod} saved generation {c.generation}, but {refused}"
                    try:
                        await self.store.delete_checkpoint(c.session_id, c.checkpoint_id)
                    except StoreError as exc:
                        log.warning("refused checkpoint not removed", extra={"error": str(exc)})
                    log.warning("stale save refused", extra={"session": c.session_id, "reason": problem})
            if problem:
                failed.append(SessionFailure(session_id=c.session_id, pod=report.pod, reason=problem))
                continue
            self.m_bytes.labels("logical").inc(c.bytes_total)
            self.m_bytes.labels("written").inc(c.bytes_written)
            self.m_sessions.labels("committed").inc()
            events.append(
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
            if location is not None:
                events.append(location)
            ok.add(c.session_id)
            total += c.bytes_total
        await self._publish_recorded(events)
        return ok, failed, total

    async def _publish_recorded(self, events: Sequence[Event]) -> None:
        """``checkpoint.saved`` and the locations that changed, in one batch of acknowledgements. What is
        recorded stands even when the events cannot be published now (counted and logged)."""
        if not events:
            return
        try:
            await self.ctx.bus.publish_many(events)
        except Exception as exc:
            lost = sum(1 for e in events if isinstance(e, SessionLocation))
            self.m_locations.labels("lost").inc(lost)
            log.warning("recorded checkpoints' events not published", extra={"events": len(events), "error": str(exc)})
            return
        self.m_locations.labels("published").inc(sum(1 for e in events if isinstance(e, SessionLocation)))

    async def on_record(self, report: SaveSessionsReport) -> SaveSessionsReport:
        """PreStop saves reported by agents: verified, fenced and recorded like a drain's."""
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
        """The session's checkpoints, newest (generation, sequence) first: those the store holds and those the
        registry recorded (``_restore_candidates``). With ``claim``, the asking pod takes the session under its
        next generation, above every generation the checkpoints carry. Not idempotent with ``claim`` (each claim
        is a new generation), which is what makes a stale holder's saves refusable."""
        assert self.store is not None
        found = await self._restore_candidates(event.session_id)
        candidates = found.ids
        generation = 0
        if event.claim:
            claim = await self._claim(event, found.floor)
            if claim.refused:
                return CheckpointLocation(
                    session_id=event.session_id,
                    found=False,
                    store=self.store.url,
                    refused=claim.refused,
                    holder=claim.holder if claim.refused.startswith("held") else "",
                )
            generation = claim.generation
        if not candidates:
            return CheckpointLocation(
                session_id=event.session_id, found=False, store=self.store.url, generation=generation
            )
        await self.registry.record_restore(event.session_id, candidates[0], event.pod, event.node)
        return CheckpointLocation(
            session_id=event.session_id,
            found=True,
            checkpoint_id=candidates[0],
            store=self.store.url,
            bytes_total=found.bytes_total,
            generation=generation,
            candidates=candidates,
            from_store=found.from_store,
        )

    async def _claim(self, event: LocateCheckpoint, floor: int) -> Claim:
        """The asking pod takes the session, unless another pod that is alive holds it: then the cluster is asked
        whether that pod still runs (a pod being evicted keeps its lease until its agent stops), and only a pod
        that does not run any more gives the session up. Refusals name why; nothing changes."""
        args = (event.session_id, event.pod, event.node, event.namespace, event.deployment, floor)
        claim = await self.registry.claim(*args)
        if claim.refused == "held" and not await self._runs(claim.holder, claim.holder_node):
            claim = await self.registry.claim(*args, force=True)
        if claim.location is not None:
            await self._publish_locations([claim.location])
        if claim.refused == "held":
            self.m_refused.labels("claim").inc()
            return Claim(0, None, f"held by pod {claim.holder}, which is alive: its requests go there", claim.holder)
        if claim.refused == "deployment":
            self.m_refused.labels("claim").inc()
            return Claim(0, None, f"the session belongs to deployment {claim.holder}", claim.holder)
        return claim

    async def _runs(self, pod: str, node: str) -> bool:
        """Whether the cluster has ``pod`` running (not terminating, not gone). When the cluster cannot say, the
        pod is taken to run: a session is never taken from a pod that may still serve it."""
        assert self.cluster is not None
        try:
            pods = await self.cluster.pods(node=node or None)
        except Exception as exc:
            log.warning("cluster unreadable; the holder is taken to run", extra={"pod": pod, "error": str(exc)})
            return True
        return any(p.name == pod and p.phase == "Running" for p in pods)

    async def _restore_candidates(self, session_id: str) -> RestoreCandidates:
        """What a restore of the session may use. The store is the last word on what was committed (Redis
        replicates asynchronously: a failover loses its last writes), so every checkpoint of the session the
        store holds is a candidate, with those the registry recorded. One the registry lacks that is newer than
        all it recorded is verified (its manifest) and recorded again; one the registry recorded whose manifest
        the store no longer has is forgotten (and still offered, so that the restore says it passed over it). The
        floor for the next generation is the newest generation of any of them. When the store cannot be listed,
        the registry's stand alone.

        Costs one listing of the session in the store (a per-session index in every store), plus one manifest
        read per checkpoint the two disagree on (none while they agree)."""
        assert self.store is not None
        found = await self.registry.checkpoints(session_id, RESTORE_CANDIDATES)
        recorded = {str(r["checkpoint_id"]): r for r in found}
        try:
            stored = await self.store.checkpoints(session_id)
        except StoreError as exc:
            log.warning(
                "store not listed; restore candidates from the registry alone",
                extra={"session": session_id, "error": str(exc)},
            )
            ids = newest_first(list(recorded))
            first = recorded.get(ids[0], {}) if ids else {}
            return RestoreCandidates(
                ids, max((checkpoint_order(c)[0] for c in ids), default=0), [], int(first.get("bytes_total", 0))
            )
        listed = set(stored)
        gone = set()
        for cid in [c for c in recorded if c not in listed]:
            try:
                await self.store.manifest(session_id, cid)
            except CheckpointNotFound:
                await self.registry.forget_checkpoint(session_id, cid)
                gone.add(cid)
                log.warning(
                    "recorded checkpoint gone from the store; forgotten",
                    extra={"session": session_id, "checkpoint": cid},
                )
            except StoreError:
                pass  # there but unreadable: the restore passes over it and says why
        newest = max((checkpoint_order(c) for c in recorded if c not in gone), default=None)
        bytes_total = {cid: int(r.get("bytes_total", 0)) for cid, r in recorded.items()}
        verified = []
        for cid in stored[:RESTORE_CANDIDATES]:
            if cid in recorded or (newest is not None and checkpoint_order(cid) < newest):
                continue
            try:
                manifest = await self.store.manifest(session_id, cid)
            except StoreError as exc:  # still a candidate: the restore passes over it and says why
                log.warning("unrecorded checkpoint unreadable", extra={"session": session_id, "error": str(exc)})
                continue
            verified.append(manifest)
            bytes_total[cid] = manifest.bytes_total
        from_store: list[str] = []
        if verified:
            await self.registry.repair_checkpoints(session_id, verified, self.store.url)
            from_store = [m.checkpoint_id for m in verified]
            self.m_repaired.inc(len(from_store))
            log.warning(
                "the registry lacked the newest checkpoints of a session: taken from the store and recorded again",
                extra={"session": session_id, "checkpoints": from_store, "newest_recorded": newest and newest[2]},
            )
        ids = newest_first(list(listed | set(recorded)))
        floor = max((checkpoint_order(c)[0] for c in ids), default=0)
        ids = ids[:RESTORE_CANDIDATES]
        return RestoreCandidates(ids, floor, from_store, bytes_total.get(ids[0], 0) if ids else 0)

    async def on_restored(self, event: SessionRestored) -> SessionRestored:
        """Idempotent: a repeated report publishes ``checkpoint.restored`` again (deduplicated by its event id)
        but no second location; a report of a pod that no longer holds the generation publishes no location."""
        if event.fell_back_from:
            self.m_fallbacks.inc(len(event.fell_back_from))
            log.warning(
                "restore passed over newer checkpoints",
                extra={"session": event.session_id, "used": event.checkpoint_id, "why": event.fell_back_from},
            )
        self.m_restores.inc()
        await self.ctx.publish(event)
        location = await self.registry.note_restored(event.session_id, event.pod, event.generation, event.checkpoint_id)
        if location is not None:
            await self._publish_locations([location])
        return event

    # -- locations, for routers -------------------------------------------------------------------------------------
    async def _publish_locations(self, locations: Sequence[SessionLocation]) -> None:
        """Publish what the registry changed. Never fails the change itself (it is recorded): a location not
        published is counted and logged, and ``where`` still answers it."""
        if not locations:
            return
        try:
            await self.ctx.bus.publish_many(locations)
        except Exception as exc:
            self.m_locations.labels("lost").inc(len(locations))
            log.warning(
                "session locations not published; routers must ask where",
                extra={"sessions": [loc.session_id for loc in locations[:20]], "error": str(exc)},
            )
            return
        self.m_locations.labels("published").inc(len(locations))

    async def on_where(self, event: WhereIsSession) -> SessionLocation:
        """Read-only: where the session's KV is now, from the registry."""
        return await self.registry.where(event.session_id)

    async def on_sessions_query(self, query: SessionsQuery) -> SessionsPage:
        """Read-only: a page of the sessions of a node or a pod (their indexes), or of all; a deployment's through
        its pods. What it reads follows the page."""
        if query.deployment and not (query.node or query.pod):
            return await self._deployment_page(query)
        records, cursor, total = await self.registry.sessions_page(
            node=query.node, pod=query.pod, cursor=query.cursor, limit=query.limit
        )
        if query.deployment:
            records = [r for r in records if (r.namespace, r.deployment) == (query.namespace, query.deployment)]
        return SessionsPage(sessions=records, next_cursor=cursor, total=total)

    async def _deployment_page(self, query: SessionsQuery) -> SessionsPage:
        """A deployment's sessions, pod by pod: the cursor is ``<pod index>:<cursor within the pod>``."""
        counts = await self.registry.summary()
        wanted = f"{query.namespace}/{query.deployment}"
        pods = sorted(p for p, d in counts.deployments.items() if d == wanted)
        index, _, inner = query.cursor.partition(":")
        at = int(index) if index.isdigit() else 0
        records: list[SessionRecord] = []
        while at < len(pods) and len(records) < query.limit:
            page, inner, _ = await self.registry.sessions_page(
                pod=pods[at], cursor=inner, limit=query.limit - len(records)
            )
            records += page
            if not inner:
                at += 1
        cursor = f"{at}:{inner}" if at < len(pods) else ""
        return SessionsPage(sessions=records, next_cursor=cursor, total=sum(counts.by_pod[p] for p in pods))

    async def on_fleet_query(self, query: FleetQuery) -> FleetSummary:
        """Read-only: session counts per node, pod and deployment, from the pods' indexes (never per session)."""
        counts = await self.registry.summary()
        by_node: dict[str, int] = defaultdict(int)
        by_deployment: dict[str, int] = defaultdict(int)
        for pod, count in counts.by_pod.items():
            by_node[counts.nodes.get(pod, "")] += count
            by_deployment[counts.deployments.get(pod, "/")] += count
        return FleetSummary(
            sessions_total=sum(counts.by_pod.values()),
            by_node=dict(by_node),
            by_pod=counts.by_pod,
            by_deployment=dict(by_deployment),
            pods=counts.nodes,
            alive=counts.alive,
        )

    async def on_http_session(self, method: str, path: str) -> Response:
        """``GET /sessions/<id>``: the ``kv.session.location`` JSON of the session; 200 while a pod holds it,
        404 when none does (ended, dropped, its pod gone, or never seen: the body says which), 400 for a bad
        id, 503 while Redis is unreachable."""
        sid = unquote(path.removeprefix("/sessions/"))
        problem = id_problem("session", sid)
        if problem:
            return _json_error(
                "400 Bad Request", f"{problem} (GET /sessions/<id>)" if sid else "no session id: GET /sessions/<id>"
            )
        try:
            location = await self.registry.where(sid)
        except TemporaryError as exc:
            return _json_error("503 Service Unavailable", str(exc))
        status = "200 OK" if location.held else "404 Not Found"
        return status, "application/json", codec.encode(location)

    # -- retention --------------------------------------------------------------------------------------------------
    async def _gc_loop(self) -> None:
        """One replica a turn applies retention and forgets gone pods (the turn is taken in Redis): replicas share
        the work instead of each walking the store."""
        while True:
            await asyncio.sleep(self.settings.gc_interval_s)
            try:
                if not await self.registry.take_turn("gc", "store", self.owner, self.settings.gc_interval_s * 0.9):
                    continue
                await self.collect_garbage()
                await self._gone_pods()
            except (TemporaryError, StoreError) as exc:
                log.warning("retention skipped this turn", extra={"error": str(exc)})

    async def collect_garbage(self, now: float | None = None) -> tuple[int, int]:
        """Apply the retention policy, then delete packs nothing references. Returns (checkpoints, packs). Each
        doomed checkpoint leaves the registry before its file goes: when Redis fails in between, a checkpoint the
        registry no longer names stays in the store until the next turn, never the other way round."""
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
        for record in doomed:  # the registry forgets first: a Redis failure here deletes nothing
            await self.registry.forget_checkpoint(record.session_id, record.checkpoint_id)
            await self.store.delete_checkpoint(record.session_id, record.checkpoint_id)
            self._manifest_cache.pop(record.checkpoint_id, None)
        gone = {r.checkpoint_id for r in doomed}
        kept = [r for r in records if r.checkpoint_id not in gone]
        garbage = unreferenced_packs({p.pack_id: p.modified for p in packs}, kept, now, self.settings.gc_grace_s)
        for pack_id in garbage:
            await self.store.delete_pack(pack_id)
        orphans = await self.store.sweep_orphans(self.settings.gc_grace_s)  # what killed or failed writers left
        if doomed or garbage or orphans:
            log.info(
                "retention",
                extra={"checkpoints_deleted": len(doomed), "packs_deleted": len(garbage), "orphans_deleted": orphans},
            )
        return len(doomed), len(garbage)


class _DrainHeader(msgspec.Struct):
    drain_id: DrainId


def _lax_drain_id(data: bytes) -> str:
    """The drain id of a request that is otherwise invalid, when it has a valid one ('' when not)."""
    try:
        return msgspec.json.decode(data, type=_DrainHeader).drain_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""


def _json_error(status: str, message: str) -> Response:
    return status, "application/json", json.dumps({"error": message}).encode()
