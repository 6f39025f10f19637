"""A node's drain, from its request to its one verdict: ``drain.completed`` when every session on the node is
committed, ``drain.failed`` naming which sessions were not and why.

Take the drain's lease (one runner per drain, renewed while it works; a runner that dies loses it within
``drain_lease_s`` and the redelivered request resumes the drain), refuse a node the cluster does not have, forget
pods that are gone, find the node's sessions in the registry, command each pod's agent to save the sessions it
holds, naming the generation of each (bounded parallelism, a deadline shorter than the pods' grace period), have
each report verified and recorded (``saves.py``), and only then record and publish the verdict (a long list of
failures summarised, the whole of it in Redis). A drain id that already has a verdict is answered with it again;
a request that cannot be run still gets its verdict when it names a drain."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from datetime import datetime
from typing import TYPE_CHECKING, Literal

import msgspec

from shared.contract.base import DrainId, is_token
from shared.contract.checkpoint import CheckpointFailed, SaveSessionsReport
from shared.contract.node import (
    DrainCompleted,
    DrainFailed,
    DrainQuery,
    DrainRecord,
    DrainRequested,
    DrainVerdict,
    SessionFailure,
    deadline_problem,
)
from shared.contract.registry import codec
from shared.plumbing.errors import PermanentError, TemporaryError

from .pods import forget_gone_pods
from .replica import Replica
from .saves import NoSaveReport, Saves

if TYPE_CHECKING:
    from shared.plumbing.bus import Bus

log = logging.getLogger(__name__)

SAVE_BATCH = 1000
"""Sessions named in one save command of a drain: the command and its report stay far below the bus's payload
limit (about 200 bytes a session in a report)."""

REASON_CHARS = 500
"""A failure's reason as far as a verdict repeats it."""

VERDICT_TTL_S = 7 * 24 * 3600.0

DRAINS_SHOWN = 1000
"""Drains this replica lists in its health (their state), newest last."""

DrainRun = Literal["running", "interrupted", "completed", "failed"]
"""Where a drain this replica ran stands: running, interrupted (its runner stopped: the redelivered request resumes
it), or decided (its verdict's ``DrainOutcome``)."""


class DrainRunner:
    """Runs the drains this replica takes (one runner per drain id across the replicas) and keeps each drain's
    record: the one verdict every caller asks for (``on_drain_query``)."""

    def __init__(self, replica: Replica, saves: Saves) -> None:
        self.replica = replica
        self.saves = saves
        self.states: dict[str, DrainRun] = {}
        """drain id -> where it stands: the drains this replica ran (health)."""

    async def on_drain_requested(self, event: DrainRequested) -> None:
        """Idempotent on ``drain_id``: a drain with a verdict is answered with it again (the recorded event,
        under a new event id) and not run again; a drain being run elsewhere is retried later, and resumed by
        the next delivery if its runner died (its lease lapses within ``drain_lease_s``)."""
        replica = self.replica
        problem = deadline_problem(event.deadline_s, event.grace_period_s)
        if problem:
            raise PermanentError(f"drain {event.drain_id}: {problem}")
        if await self._answer_again(event.drain_id) or (
            await self._recover(event.drain_id, event.node, before=event.occurred_at)
            and await self._answer_again(event.drain_id)
        ):
            return
        lease_s = replica.settings.drain_lease_s
        if not await replica.leases.take_drain(event.drain_id, event.node, replica.owner, lease_s):
            raise TemporaryError(f"drain {event.drain_id} is being run by another replica", delay=lease_s / 2)
        self.states[event.drain_id] = "running"
        started = time.monotonic()
        keeper = asyncio.create_task(self._keep_lease(event.drain_id), name=f"drain-lease-{event.drain_id}")
        try:
            verdict = await self._drain(event, started)
        except BaseException:
            self.states[event.drain_id] = "interrupted"
            raise
        finally:
            keeper.cancel()
        duration = time.monotonic() - started
        replica.metrics.drain.observe(duration)
        state = verdict.outcome
        replica.metrics.verdicts.labels(state).inc()
        if await replica.leases.finish_drain(event.drain_id, state, codec.encode(verdict), duration):
            await replica.ctx.publish(verdict)
        else:  # another runner decided it first (this one lost its lease): that verdict stands
            await self._answer_again(event.drain_id)
        self.states[event.drain_id] = state
        while len(self.states) > DRAINS_SHOWN:
            self.states.pop(next(iter(self.states)))

    async def on_drain_refused(self, subject: str, data: bytes, reason: str) -> None:
        """A drain request that cannot be run (bad fields, a body naming another node than its subject, or out
        of deliveries) still gets its one verdict when it names a drain: ``drain.failed`` with the reason, on the
        node its subject names (the one its sender was allowed to publish on). A drain id already recorded for
        another node is left alone: a forged copy never decides someone else's drain."""
        replica = self.replica
        node = replica.ctx.subjects.node_of(subject, "node.drain.requested")
        drain_id = _lax_drain_id(data)
        if not node or not drain_id:
            return
        verdict = DrainFailed(node=node, drain_id=drain_id, reason=f"drain request refused: {reason}"[:REASON_CHARS])
        try:
            recorded = await replica.leases.drain_node(drain_id)
            if recorded not in (None, node):
                log.warning("refused drain request names another node's drain", extra={"drain_id": drain_id})
                return
            if not await replica.leases.finish_drain(drain_id, "failed", codec.encode(verdict), 0.0):
                await self._answer_again(drain_id)
                return
        except TemporaryError as exc:  # Redis away: the verdict is still sent, not recorded
            log.warning("refused drain's verdict not recorded", extra={"drain_id": drain_id, "error": str(exc)})
        self.states[drain_id] = "failed"
        await replica.ctx.publish(verdict)

    async def on_drain_query(self, query: DrainQuery) -> DrainRecord:
        """The drain's recorded verdict (the one stored copy), None while it has none; with the query's ``node``, a
        verdict Redis lost and the events stream kept is recorded again first. Redis away: no answer
        (``TemporaryError``), which the asker reads as "not known now", never as "no verdict"."""
        recorded = await self.replica.leases.drain_verdict(query.drain_id)
        unknown = recorded is None and query.node and await self.replica.leases.drain_node(query.drain_id) is None
        if unknown and await self._recover(query.drain_id, query.node):
            recorded = await self.replica.leases.drain_verdict(query.drain_id)
        verdict = codec.decode(recorded) if recorded is not None else None
        if not isinstance(verdict, DrainCompleted | DrainFailed):
            verdict = None
        return DrainRecord(drain_id=query.drain_id, verdict=verdict)

    async def _answer_again(self, drain_id: str) -> bool:
        recorded = await self.replica.leases.drain_verdict(drain_id)
        if recorded is None:
            return False
        verdict = codec.decode(recorded)
        log.info("drain already decided; its verdict is sent again", extra={"drain_id": drain_id})
        await self.replica.ctx.publish(msgspec.structs.replace(verdict, event_id=uuid.uuid4().hex, source=""))
        return True

    async def _recover(self, drain_id: str, node: str, before: datetime | None = None) -> bool:
        """A drain whose verdict Redis lost (a failover after it was decided) and the events stream kept, as the
        node's newest: recorded again (True), so that it is answered again and not run a second time (its pods may
        be gone by now, and a second verdict could contradict the first). ``before``: for a request, the
        verdict must be older than it (a request sent again after the verdict; a redelivery of the first request,
        older than its verdict, runs again). Two stream reads."""
        stored = await _newest_stored_verdict(self.replica.ctx.bus, node)
        if stored is None or stored.drain_id != drain_id or stored.node != node:
            return False
        if before is not None and stored.occurred_at >= before:
            return False
        log.warning(
            "drain verdict lost by Redis, kept by the events stream: recorded again", extra={"drain_id": drain_id}
        )
        await self.replica.leases.recover_drain(drain_id, node, stored.outcome, codec.encode(stored))
        return True

    async def _keep_lease(self, drain_id: str) -> None:
        replica = self.replica
        lease_s = replica.settings.drain_lease_s
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                if not await replica.leases.renew_drain(drain_id, replica.owner, lease_s):
                    log.warning("drain lease lost while running", extra={"drain_id": drain_id})
                    return
            except Exception as exc:
                log.warning("drain lease not renewed", extra={"drain_id": drain_id, "error": str(exc)})

    async def _node_missing(self, node: str) -> bool:
        try:
            return await self.replica.cluster.node(node) is None
        except Exception as exc:
            log.warning("cluster unreadable; drain goes on", extra={"node": node, "error": str(exc)})
            return False

    async def _drain(self, event: DrainRequested, started: float) -> DrainVerdict:
        replica = self.replica
        if await self._node_missing(event.node):
            return DrainFailed(
                node=event.node,
                drain_id=event.drain_id,
                reason=f"node {event.node} is not in the cluster: nothing to drain",
            )
        await forget_gone_pods(replica, event.node)
        sessions = await replica.registry.sessions_on_node(event.node)
        by_pod: dict[str, dict[str, int]] = defaultdict(dict)
        for location in sessions:
            by_pod[location.pod][location.session_id] = location.generation
        agent_deadline = max(0.1, event.deadline_s * 0.8)
        limit = asyncio.Semaphore(replica.policy().drain_parallelism)

        async def save(pod: str, batch: dict[str, int]) -> tuple[str, SaveSessionsReport | NoSaveReport]:
            async with limit:
                remaining = event.deadline_s - (time.monotonic() - started)
                outcome = await self.saves.command(
                    pod,
                    min(agent_deadline, remaining * 0.9),
                    "drain",
                    drain_id=event.drain_id,
                    generations=batch,
                    timeout=max(0.05, remaining),
                )
                return pod, outcome

        async def save_pod(pod: str) -> list[tuple[str, SaveSessionsReport | NoSaveReport]]:
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
            if isinstance(outcome, NoSaveReport):
                if pod not in pods_failed:
                    pods_failed.add(pod)
                    failed += [
                        SessionFailure(session_id=s, pod=pod, reason=outcome.reason) for s in sorted(by_pod[pod])
                    ]
                continue
            recorded = await self.saves.record(outcome, event.drain_id)
            committed |= recorded.committed
            total += recorded.bytes_total
            failed += recorded.failed
            if outcome.not_held:
                log.info(
                    "sessions no longer held by their pod: nothing of them to save",
                    extra={"pod": pod, "sessions": outcome.not_held[:20], "count": len(outcome.not_held)},
                )
            reported[pod] |= recorded.committed | {f.session_id for f in recorded.failed} | set(outcome.not_held)
        for pod, sids in by_pod.items():
            if pod in pods_failed:
                continue
            for sid in sorted(set(sids) - reported[pod]):
                failed.append(SessionFailure(session_id=sid, pod=pod, reason=f"pod {pod} did not report it"))
        failed = await self._still_here(event.node, failed)
        await replica.ctx.bus.publish_many(
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
        replica.metrics.sessions.labels("failed").inc(len(failed))
        duration = time.monotonic() - started
        if duration > 0 and total:
            replica.metrics.drain_rate.set(total / duration)
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
        here = {s.session_id for s in await self.replica.registry.sessions_on_node(node)}
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
        limit = self.replica.settings.verdict_sessions_max
        ref = ""
        if len(named) > limit:
            ref = await self.replica.leases.keep_failures(
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


async def _newest_stored_verdict(bus: Bus, node: str) -> DrainVerdict | None:
    """The newest verdict the events stream holds for ``node`` (completed or failed, whichever came last), None
    when there is none or the stream cannot be read now: what answers for a record Redis lost. Two reads,
    whatever the fleet holds."""
    stream = bus.subjects.events_stream.name
    newest: tuple[int, DrainVerdict] | None = None
    for kind in ("node.drain.completed", "node.drain.failed"):
        try:
            raw = await bus.js.get_last_msg(stream, bus.subjects.pattern(kind, node=node))
            event = codec.decode(raw.data or b"")
        except Exception:  # none stored, undecodable, or the stream not answering
            continue
        if isinstance(event, DrainCompleted | DrainFailed) and (newest is None or (raw.seq or 0) > newest[0]):
            newest = (raw.seq or 0, event)
    return newest[1] if newest else None


class _DrainHeader(msgspec.Struct):
    drain_id: DrainId


def _lax_drain_id(data: bytes) -> str:
    """The drain id of a request that is otherwise invalid, when it has a valid one ('' when not)."""
    try:
        return msgspec.json.decode(data, type=_DrainHeader).drain_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
