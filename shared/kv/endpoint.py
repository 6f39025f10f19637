"""The KV agent on the mesh: answers the checkpoint service's save commands (drains, periodic checkpoints, failing
GPUs), announces its sessions with the generation it holds of each, and takes sessions (restored or fresh) by
asking the checkpoint service, which hands out generations.

The endpoint speaks only core NATS request/reply (the agent lives in an inference pod with a narrow NATS user);
lifecycle events about checkpoints are published by the checkpoint service, which records what agents report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from shared.contract.checkpoint import (
    AgentSessions,
    CheckpointLocation,
    CommittedCheckpoint,
    LocateCheckpoint,
    SaveProgress,
    SaveSessions,
    SaveSessionsReport,
    SessionRestored,
)
from shared.contract.models import ModelPrepared, PrepareModel, RolloutState, ServingQuery
from shared.contract.node import SessionFailure
from shared.kv.agent import KvAgent, RestoredSession, SaveReport
from shared.kv.manifest import KvLayout
from shared.kv.store import CheckpointNotFound, ChunkCorrupt
from shared.plumbing.bus import Bus, Subscription
from shared.plumbing.errors import PermanentError

log = logging.getLogger(__name__)


def report_event(agent: KvAgent, report: SaveReport) -> SaveSessionsReport:
    return SaveSessionsReport(
        pod=agent.pod,
        node=agent.node,
        store=agent.store.url,
        committed=[
            CommittedCheckpoint(
                session_id=m.session_id,
                checkpoint_id=m.checkpoint_id,
                bytes_total=m.bytes_total,
                bytes_written=m.bytes_written,
                chunks=len(m.blocks),
                token_count=m.token_count,
                generation=m.generation,
                sequence=m.sequence,
            )
            for m in report.committed
        ],
        failed=[SessionFailure(session_id=f.session_id, pod=agent.pod, reason=f.reason) for f in report.failed],
        not_held=report.not_held,
    )


class ModelHost(Protocol):
    """The inference engine's side of a model rollout, as the pod's endpoint drives it."""

    async def prepare(self, version: str) -> KvLayout:
        """Make ``version`` ready (load its weights) beside the version being served, and return the layout its
        KV caches have. Raise to say it cannot (the message is the reason). Idempotent."""
        ...

    def switched(self, state: RolloutState, previous: str) -> None:
        """The pod now starts new sessions on ``state.serving_version`` (it served ``previous``): sessions of
        ``previous`` finish on it, or are ended with ``state.end_reason`` when ``state.pinned_sessions`` says
        ``end``."""
        ...


class AgentEndpoint:
    """``start`` answers save commands and announces the pod's sessions; ``stop`` ends both: a stopped agent
    never saves again (its pod is gone; what it still holds may have moved on elsewhere).

    With a ``models`` host the endpoint also takes part in model rollouts: it answers prepare commands, and
    follows the deployment's serving version, heard from ``kv.rollout.state`` and asked for again at start and
    with every announcement, so a pod that missed the switch (disconnected, or started later) switches anyway."""

    def __init__(self, agent: KvAgent, bus: Bus, announce_s: float = 5.0, models: ModelHost | None = None) -> None:
        self.agent = agent
        self.bus = bus
        self.announce_s = announce_s
        self.models = models
        self.rollout: RolloutState | None = None
        """The newest rollout state this pod heard of its deployment."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._serving: Subscription | None = None
        self._model_subs: list[Subscription] = []
        self._switch_lock = asyncio.Lock()
        self._stopped = False
        self._ended: set[str] = set()
        self._changed = asyncio.Event()

    async def start(self) -> None:
        subjects = self.bus.subjects
        self._stopped = False
        self._serving = await self.bus.serve(
            subjects.for_event(SaveSessions(pod=self.agent.pod)), self.on_save, (SaveSessions,)
        )
        if self.models is not None:
            self._model_subs = [
                await self.bus.serve(
                    subjects.for_event(PrepareModel(pod=self.agent.pod, version="-")), self.on_prepare, (PrepareModel,)
                ),
                await self.bus.subscribe(
                    subjects.pattern(
                        "kv.rollout.state", namespace=self.agent.namespace, deployment=self.agent.deployment
                    ),
                    self.on_rollout_state,
                    (RolloutState,),
                ),
            ]
            await self.follow_serving_version()
        await self.announce()
        self._tasks.append(asyncio.create_task(self._announce_loop(), name=f"kv-announce-{self.agent.pod}"))

    async def stop(self) -> None:
        self._stopped = True
        if self._serving is not None:
            await self._serving.unsubscribe()
            self._serving = None
        for sub in self._model_subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._model_subs = []
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()

    def end_session(self, session_id: str) -> None:
        """The conversation is over: the engine drops it, and the next announcement retires its checkpoints."""
        self.agent.forget_session(session_id)
        self._ended.add(session_id)
        self._changed.set()

    def sessions_changed(self) -> None:
        """Tell the endpoint the engine added or ended sessions; the registry hears of it promptly."""
        self._changed.set()

    async def on_save(self, command: SaveSessions) -> SaveSessionsReport:
        """Idempotent: a repeated save of unchanged sessions commits checkpoints that write no new bytes. The
        service that asked records what it answers; sessions held under another generation than the command
        names are refused. A ``prestop`` save (the pod's own hook) is recorded by the agent itself."""
        if self._stopped:
            raise PermanentError(f"pod {self.agent.pod}'s KV agent is stopped")
        if command.reason == "prestop":  # the pod's own hook (`gpuwarden agent final-save`), not the service
            return await self.final_save(command.deadline_s)
        started = time.monotonic()

        async def progress(so_far: SaveReport, total: int) -> None:
            with contextlib.suppress(Exception):
                await self.bus.publish(
                    SaveProgress(
                        pod=self.agent.pod,
                        drain_id=command.drain_id,
                        sessions_done=len(so_far.committed),
                        sessions_failed=len(so_far.failed),
                        sessions_total=total,
                        bytes_done=so_far.bytes_total,
                    )
                )

        ids = list(command.generations) if command.generations else (command.session_ids or None)
        report = await self.agent.save(
            ids,
            command.deadline_s,
            command.reason,
            progress,
            generations=command.generations or None,
        )
        log.info(
            "saved",
            extra={
                "pod": self.agent.pod,
                "drain_id": command.drain_id,
                "reason": command.reason,
                "committed": len(report.committed),
                "failed": len(report.failed),
                "bytes": report.bytes_total,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return report_event(self.agent, report)

    # -- model rollouts -----------------------------------------------------------------------------------------
    async def on_prepare(self, command: PrepareModel) -> ModelPrepared:
        """Idempotent: a version already held is ready at once. The pod keeps serving its current version."""
        if self._stopped or self.models is None:
            raise PermanentError(f"pod {self.agent.pod}'s KV agent takes no model rollouts")
        layout = self.agent.layouts.get(command.version)
        try:
            if layout is None:
                layout = await asyncio.wait_for(self.models.prepare(command.version), command.deadline_s)
                if layout.model_version != command.version:
                    raise ValueError(f"the engine prepared version {layout.model_version!r}")
                self.agent.hold(layout)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("model version not prepared", extra={"pod": self.agent.pod, "version": command.version})
            return ModelPrepared(
                pod=self.agent.pod, rollout_id=command.rollout_id, version=command.version, reason=reason
            )
        log.info("model version prepared", extra={"pod": self.agent.pod, "version": command.version})
        return ModelPrepared(
            pod=self.agent.pod,
            rollout_id=command.rollout_id,
            version=command.version,
            ready=True,
            weights_digest=layout.weights_digest,
        )

    async def on_rollout_state(self, state: RolloutState) -> None:
        await self.apply_rollout(state)

    async def follow_serving_version(self, timeout: float = 2.0) -> None:
        """Ask the checkpoint service which version the deployment serves now, and switch to it if this pod
        has not (it missed the announcement). Quiet when nobody answers: the next announcement asks again."""
        try:
            answer = await self.bus.request(
                self.bus.subjects.agent_command("serving", self.agent.pod),
                ServingQuery(namespace=self.agent.namespace, deployment=self.agent.deployment, pod=self.agent.pod),
                timeout,
            )
        except Exception as exc:
            log.debug("serving version not read", extra={"pod": self.agent.pod, "error": str(exc)})
            return
        if isinstance(answer, RolloutState):
            await self.apply_rollout(answer)

    async def apply_rollout(self, state: RolloutState) -> bool:
        """Serve ``state.serving_version`` for new sessions, preparing it first when this pod never did (it
        started or reconnected after the prepare). Idempotent; says whether the pod switched now."""
        if self.models is None or state.namespace != self.agent.namespace or state.deployment != self.agent.deployment:
            return False
        async with self._switch_lock:
            if self.rollout is not None and state.config_version < self.rollout.config_version:
                return False  # read before what this pod already follows
            self.rollout = state
            version = state.serving_version
            previous = self.agent.layout.model_version
            if not version or version == previous or self._stopped:
                return False
            if version not in self.agent.layouts:
                try:
                    self.agent.hold(await self.models.prepare(version))
                except Exception as exc:
                    log.error(
                        "cannot switch to the serving model version",
                        extra={"pod": self.agent.pod, "version": version, "error": str(exc)},
                    )
                    return False
            self.agent.serve(version)
            log.info(
                "serving a new model version",
                extra={"pod": self.agent.pod, "version": version, "previous": previous, "rollout": state.rollout_id},
            )
            self.models.switched(state, previous)
            self._changed.set()
            return True

    async def _record(self, event: SaveSessionsReport) -> SaveSessionsReport | None:
        with contextlib.suppress(Exception):
            answer = await self.bus.request(self.bus.subjects.agent_command("record", self.agent.pod), event, 5.0)
            return answer if isinstance(answer, SaveSessionsReport) else None
        return None

    async def announce(self) -> None:
        sessions = sorted(self.agent.sessions())
        ended = sorted(self._ended)
        await self.bus.publish(
            AgentSessions(
                pod=self.agent.pod,
                node=self.agent.node,
                namespace=self.agent.namespace,
                deployment=self.agent.deployment,
                sessions=sessions,
                bytes_held=sum(self.agent.session_bytes(s) for s in sessions),
                generations=[self.agent.generation(s) for s in sessions],
                ttl_s=max(1.0, 3 * self.announce_s),
                ended=ended,
            )
        )
        self._ended.difference_update(ended)
        with contextlib.suppress(Exception):
            await self.bus.nc.flush(timeout=2)

    async def _announce_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.announce_s)
            self._changed.clear()
            if self.models is not None:
                await self.follow_serving_version()
            try:
                await self.announce()
            except Exception as exc:
                log.warning("session announcement failed", extra={"error": str(exc)})
            await asyncio.sleep(0.05)  # coalesce bursts of session changes

    async def final_save(self, deadline_s: float) -> SaveSessionsReport:
        """The preStop hook's save: everything the pod holds, recorded by the checkpoint service (which refuses
        sessions this pod no longer owns). Returns what the service recorded, or the agent's own report when
        the service did not answer."""
        report = report_event(self.agent, await self.agent.save(deadline_s=deadline_s, reason="prestop"))
        recorded = await self._record(report)
        return recorded if recorded is not None else report

    async def _locate(self, session_id: str, timeout: float) -> CheckpointLocation:
        answer = await self.bus.request(
            self.bus.subjects.agent_command("locate", self.agent.pod),
            LocateCheckpoint(
                session_id=session_id,
                pod=self.agent.pod,
                node=self.agent.node,
                claim=True,
                namespace=self.agent.namespace,
                deployment=self.agent.deployment,
            ),
            timeout,
        )
        if not isinstance(answer, CheckpointLocation):
            reason = getattr(answer, "reason", "") or answer.kind
            raise TimeoutError(f"the checkpoint service could not locate session {session_id!r}: {reason}")
        return answer

    async def start_session(self, session_id: str, timeout: float = 10.0, layout: KvLayout | None = None) -> int:
        """Take a new session: the checkpoint service gives this pod its next generation. Returns it. ``layout``:
        the model version it runs on (default: the one the pod serves now)."""
        answer = await self._locate(session_id, timeout)
        self.agent.register_session(session_id, generation=answer.generation, layout=layout)
        self.sessions_changed()
        return answer.generation

    async def restore(
        self, session_id: str, into: Sequence[Any] | None = None, timeout: float = 10.0
    ) -> RestoredSession:
        """Take the session (its next generation) and restore its newest good checkpoint, verified, then report
        it. When there is no checkpoint (``CheckpointNotFound``) or none is usable (``ChunkCorrupt``), the
        session is held fresh under the new generation before the error is raised, so the caller may go on."""
        started = time.monotonic()
        answer = await self._locate(session_id, timeout)
        try:
            if not answer.found:
                raise CheckpointNotFound(f"session {session_id!r}: no committed checkpoint")
            restored = await self.agent.restore(
                session_id,
                answer.checkpoint_id,
                into,
                candidates=answer.candidates or None,
                generation=answer.generation,
            )
        except (CheckpointNotFound, ChunkCorrupt):
            self.agent.register_session(session_id, generation=answer.generation)
            self.sessions_changed()
            raise
        self.sessions_changed()
        with contextlib.suppress(Exception):
            await self.bus.request(
                self.bus.subjects.agent_command("restored", self.agent.pod),
                SessionRestored(
                    session_id=session_id,
                    checkpoint_id=restored.manifest.checkpoint_id,
                    node=self.agent.node,
                    pod=self.agent.pod,
                    bytes_total=restored.manifest.bytes_total,
                    duration_s=time.monotonic() - started,
                    generation=answer.generation,
                    fell_back_from=restored.fell_back_from[:16],
                    from_store=answer.from_store[:16],
                ),
                5.0,
            )
        return restored
