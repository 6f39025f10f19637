"""The KV agent on the mesh: answers save commands (the checkpoint service's for drains, periodic checkpoints and
failing GPUs; the pod's preStop hook's for its last save), announces its sessions with the generation it holds of
each, and takes sessions (restored or fresh) by asking the checkpoint service, which hands out generations.

A save's report has one road, whoever asked: it is the reply, and the asker has the checkpoint service record it
(the service records what it asked for; the hook hands it on with ``record_report``).

The endpoint speaks only core NATS request/reply (the agent lives in an inference pod with a narrow NATS user);
lifecycle events about checkpoints are published by the checkpoint service, which records what agents report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from shared.contract.checkpoint import (
    PERIODIC_REASON,
    AgentSessions,
    AnnouncementAck,
    CheckpointLocation,
    LocateCheckpoint,
    SaveProgress,
    SaveSessions,
    SaveSessionsReport,
    SessionRestored,
)
from shared.contract.models import ModelPrepared, PrepareModel, RolloutState, ServingQuery
from shared.contract.sessions import PrefetchSessions, SessionsPrefetched
from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent, RestoredSession, SaveReport
from shared.kv.journal import DEFAULT_SPILL_S, JOURNAL_REASON, KvJournal, journal_covers
from shared.kv.manifest import KvLayout
from shared.kv.nodetier import NodeTier
from shared.kv.reports import final_save_command, record_report, report_event, report_parts
from shared.kv.store import CheckpointNotFound, ChunkCorrupt
from shared.plumbing.bus import Bus, Subscription
from shared.plumbing.errors import PermanentError
from shared.plumbing.settings import load_settings

log = logging.getLogger(__name__)

ANNOUNCE_PART = 2000
"""Sessions named in one announcement message (placed, dropped and ended together): far below the bus's payload
limit whatever the ids (at most 128 characters each)."""


class SessionHeld(RuntimeError):
    """The checkpoint service refused this pod the session: another pod that is alive holds it (``holder``: send
    the session's requests there), or it belongs to another deployment. Nothing was taken."""

    def __init__(self, session_id: str, reason: str, holder: str = "") -> None:
        super().__init__(f"session {session_id!r}: {reason}")
        self.session_id = session_id
        self.holder = holder


class LocateRefused(RuntimeError):
    """The checkpoint service answered the pod's locate command with a refusal (a dead letter naming why: a command
    it cannot take, or one this pod may not send) or with something else than a location. It did answer: this is
    not a timeout (``TimeoutError``: nobody answered), nor ``SessionHeld`` (the session is another pod's). Nothing
    was taken."""

    def __init__(self, session_id: str, reason: str) -> None:
        super().__init__(f"the checkpoint service refused to locate session {session_id!r}: {reason}")
        self.session_id = session_id
        self.reason = reason


async def connect_bus(source: str, env: Mapping[str, str] | None = None) -> Bus:
    """The bus an inference pod's agent talks on, from gpuwarden's own settings read from ``env`` (default: the
    process's environment; ``load_settings``: the NATS servers, credentials and TLS files, the subject root).
    ``source`` names the connection (``<server>/<pod>``). No stream is looked up: the agent's NATS user may not."""
    settings = load_settings(env)
    return await Bus.connect(settings.nats, Subjects(settings.root), source)


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


class SessionHost(Protocol):
    """The inference engine's side of a prefetch (the router's ``kv.session.prefetch.command``), as the pod's
    endpoint drives it."""

    async def prefetch(self, session_id: str) -> bool:
        """Bring ``session_id`` onto this pod ahead of its next request, through the pod's own restore path
        (``AgentEndpoint.restore`` with ``prefetch=True``: never taken from a holder the cluster still lists).
        True when it was brought (restored, or started where there is no checkpoint), False when the pod held it
        already. ``SessionHeld`` when another pod still holds it; anything else raised: failed, with its message."""
        ...


PREFETCH_WINDOW = 8
"""Sessions one prefetch command restores at once."""


class AgentEndpoint:
    """``start`` answers save commands and announces the pod's sessions; ``stop`` ends both: a stopped agent
    never saves again (its pod is gone; what it still holds may have moved on elsewhere).

    With a ``models`` host the endpoint also takes part in model rollouts: it answers prepare commands, and
    follows the deployment's serving version, heard from ``kv.rollout.state`` and asked for again at start and
    with every announcement, so a pod that missed the switch (disconnected, or started later) switches anyway."""

    def __init__(
        self,
        agent: KvAgent,
        bus: Bus,
        announce_s: float = 5.0,
        models: ModelHost | None = None,
        journal_s: float = 0.0,
        sessions: SessionHost | None = None,
        node_tier: NodeTier | None = None,
        spill_s: float = DEFAULT_SPILL_S,
    ) -> None:
        self.agent = agent
        self.bus = bus
        self.announce_s = announce_s
        self.models = models
        self.sessions_host = sessions
        """Where the router's prefetch commands restore sessions; None: the pod answers none."""
        self._prefetching: Subscription | None = None
        self.rollout: RolloutState | None = None
        """The newest rollout state this pod heard of its deployment."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._serving: Subscription | None = None
        self._model_subs: list[Subscription] = []
        self._switch_lock = asyncio.Lock()
        self._stopped = False
        self._leaving = False
        """``stop`` is under way: every announcement says the pod is leaving (a full one after a resync too, the
        announcing loop's until it is cancelled)."""
        self._ended: set[str] = set()
        self._changed = asyncio.Event()
        self._incarnation = uuid.uuid4().hex[:16]
        self._seq = 0
        """The last announcement the registry applied (its answer said so)."""
        self._sent_seq = 0
        """The highest number this incarnation sent: a full announcement takes the next (``monotonic``)."""
        self._full = True
        """The next announcement names every session (at start, and when the registry asks for a resync)."""
        self._pending: dict[str, int | None] = {}
        """Changes not yet applied by the registry: session -> generation held now, or None when dropped."""
        self._announce_lock = asyncio.Lock()
        agent.track_changes()
        self.node_tier = node_tier
        """The node's tier of the journal (``GPUWARDEN_KV_NODE_DIR``, ``shared.kv.nodetier``): where this pod's
        journal logs full blocks first, and where a restore looks for the blocks of the pod a session came from."""
        self.journal: KvJournal | None = (
            KvJournal(agent, journal_s, self._record_journal, node=node_tier, spill_s=spill_s)
            if journal_s > 0
            else None
        )
        """The pod's KV journal (``GPUWARDEN_KV_JOURNAL_S``, ``shared.kv.journal``): each full block written soon
        after it fills and recorded like any save; None when off."""

    async def start(self) -> None:
        subjects = self.bus.subjects
        self._stopped = self._leaving = False
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
        if self.sessions_host is not None:
            self._prefetching = await self.bus.serve(
                subjects.for_event(PrefetchSessions(pod=self.agent.pod, session_ids=[])),
                self.on_prefetch,
                (PrefetchSessions,),
            )
        await self.announce()
        self._tasks.append(asyncio.create_task(self._announce_loop(), name=f"kv-announce-{self.agent.pod}"))
        if self.journal is not None:
            self.journal.start()

    async def _record_journal(self, report: SaveReport) -> set[str] | None:
        """A journal flush's entries, recorded by the checkpoint service (fenced like every save: an entry of a
        generation this pod no longer holds is refused). Returns the ids it recorded (None: no answer)."""
        recorded = await record_report(
            self.bus, self.agent.pod, report_event(self.agent, report, reason=JOURNAL_REASON)
        )
        return None if recorded is None else {c.checkpoint_id for c in recorded.committed}

    async def stop(self) -> None:
        """Stop answering and announcing; the registry hears the pod is leaving (its sessions may be taken by
        other pods at once, rather than when its lease lapses). The journal stops first (a flush under way ends)."""
        if self.journal is not None:
            await self.journal.stop()
        if not self._stopped and self._tasks:
            self._leaving = True  # whatever is announced from now on says so, the announcing loop's too
            with contextlib.suppress(Exception):
                await self.announce(timeout=1.0)
                if self._full:  # answered resync (a registry that lost writes): the full announcement, leaving
                    await self.announce(timeout=1.0)
        self._stopped = True
        if self._serving is not None:
            await self._serving.unsubscribe()
            self._serving = None
        if self._prefetching is not None:
            with contextlib.suppress(Exception):
                await self._prefetching.unsubscribe()
            self._prefetching = None
        for sub in self._model_subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._model_subs = []
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()
        self._leaving = False  # the loop is gone; an announcement asked for explicitly from now on says what it says

    def end_session(self, session_id: str) -> None:
        """The conversation is over: the engine drops it, and the next announcement retires its checkpoints."""
        self.agent.forget_session(session_id)
        if self.node_tier is not None:
            self.node_tier.forget(session_id)
        self._ended.add(session_id)
        self._changed.set()

    def sessions_changed(self) -> None:
        """Tell the endpoint the engine added or ended sessions; the registry hears of it promptly."""
        self._changed.set()

    async def on_save(self, command: SaveSessions) -> SaveSessionsReport:
        """Idempotent: a repeated save of unchanged sessions commits checkpoints that write no new bytes (none at
        all with ``changed_only``). Sessions held under another generation than the command names are refused;
        sessions it names in ``rewrite`` write every block again.

        One road for every report, whoever asks: the reply is the report, and the asker records it (the
        checkpoint service, or the pod's preStop hook, which hands it to the service: ``record_report``). Only
        the earlier parts of a long report are recorded here, before the reply."""
        if self._stopped:
            raise PermanentError(f"pod {self.agent.pod}'s KV agent is stopped")
        *earlier, last = report_parts(await self._save(command))
        for part in earlier:  # recorded by the service now; the reply is the last part
            if await record_report(self.bus, self.agent.pod, part) is None:
                raise PermanentError(
                    f"pod {self.agent.pod}: a part of its save report ({len(part.committed)} checkpoints) was not "
                    "recorded: the checkpoint service did not answer"
                )
        return last

    async def _save(self, command: SaveSessions) -> SaveSessionsReport:
        """The save ``command`` asks for, its progress published after each round (``checkpoint.save.progress``:
        what a drain's caller shows), and its whole report."""
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
        # a periodic save leaves the tail blocks to the journal's bound while the journal keeps up (journal.py)
        tails_out = command.reason == PERIODIC_REASON and not command.rewrite and journal_covers(self.journal)
        report = await self.agent.save(
            ids,
            command.deadline_s,
            command.reason,
            progress,
            generations=command.generations or None,
            changed_only=command.changed_only,
            rewrite=command.rewrite,
            full_blocks_only=tails_out,
        )
        log.info(
            "saved",
            extra={
                "pod": self.agent.pod,
                "drain_id": command.drain_id,
                "reason": command.reason,
                "committed": len(report.committed),
                "unchanged": report.unchanged,
                "failed": len(report.failed),
                "bytes": report.bytes_total,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return report_event(self.agent, report, command.changed_only and command.confirm_unchanged)

    # -- prefetch -----------------------------------------------------------------------------------------------
    async def on_prefetch(self, command: PrefetchSessions) -> SessionsPrefetched:
        """The router's prefetch: each session brought here through ``SessionHost.prefetch``, a few at once, within
        the command's deadline. Idempotent: a session held already is answered held."""
        host = self.sessions_host
        if self._stopped or host is None:
            raise PermanentError(f"pod {self.agent.pod}'s KV agent takes no prefetch")
        restored: list[str] = []
        held: list[str] = []
        elsewhere: list[str] = []
        failed: dict[str, str] = {}
        window = asyncio.Semaphore(PREFETCH_WINDOW)

        async def one(session_id: str) -> None:
            async with window:
                try:
                    brought = await host.prefetch(session_id)
                except SessionHeld:
                    elsewhere.append(session_id)
                    return
                except Exception as exc:
                    failed[session_id] = (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]
                    return
                (restored if brought else held).append(session_id)

        ids = list(dict.fromkeys(command.session_ids))
        tasks = [asyncio.ensure_future(one(sid)) for sid in ids]
        _, late = await asyncio.wait(tasks, timeout=command.deadline_s) if tasks else (set(), set())
        for task in late:
            task.cancel()
        done = set(restored) | set(held) | set(elsewhere) | set(failed)
        for sid in ids:
            if sid not in done:
                failed[sid] = f"not brought within the deadline ({command.deadline_s:g} s)"
        log.info(
            "sessions prefetched",
            extra={"pod": self.agent.pod, "restored": len(restored), "held": len(held), "failed": len(failed)},
        )
        return SessionsPrefetched(
            pod=self.agent.pod, restored=restored, held=held, held_elsewhere=elsewhere, failed=failed
        )

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

    async def announce(self, leaving: bool = False, timeout: float = 2.0) -> None:
        """Tell the registry what changed since the last announcement it applied (a delta; every session only at
        start or when the registry asks for it), or that nothing did (a heartbeat renewing the pod's lease: the
        same cost whatever the pod holds). Changes the registry did not confirm are sent again with the next."""
        leaving = leaving or self._leaving
        async with self._announce_lock:
            for change, generation in self.agent.take_changes().items():
                self._pending[change] = generation
            ended = sorted(self._ended)
            messages = self._full_messages(ended, leaving) if self._full else self._delta_messages(ended, leaving)
            for message in messages:
                self._sent_seq = max(self._sent_seq, message.seq)
                try:
                    answer = await self.bus.request(self.bus.subjects.for_event(message), message, timeout)
                except TimeoutError:
                    return  # nothing confirmed: sent again, with what changes meanwhile, next time
                if not isinstance(answer, AnnouncementAck):
                    why = getattr(answer, "reason", "") or answer.kind
                    log.warning(f"announcement not applied: {why}", extra={"pod": self.agent.pod})
                    return
                if answer.stale:
                    log.warning(
                        "the registry says other pods took sessions this pod holds",
                        extra={"pod": self.agent.pod, "sessions": answer.stale[:20], "count": len(answer.stale)},
                    )
                if answer.resync:
                    self._full = True
                    self._changed.set()  # the full announcement goes out at once
                    return
            last = messages[-1]
            self._seq = last.seq
            self._sent_seq = max(self._sent_seq, last.seq)
            if last.full:
                self._full = False
                self._pending.clear()
            else:
                for message in messages:
                    for sid in (*message.sessions, *message.dropped):
                        self._pending.pop(sid, None)
            self._ended.difference_update(ended)

    def _common(self, leaving: bool) -> dict[str, Any]:
        return {
            "pod": self.agent.pod,
            "node": self.agent.node,
            "namespace": self.agent.namespace,
            "deployment": self.agent.deployment,
            "bytes_held": self.agent.bytes_held,
            "ttl_s": max(1.0, 3 * self.announce_s),
            "incarnation": self._incarnation,
            "leaving": leaving,
            "monotonic": True,
        }

    def _full_messages(self, ended: list[str], leaving: bool) -> list[AgentSessions]:
        """Every session the pod holds, in parts of ``ANNOUNCE_PART`` (the ended ones with the first)."""
        sessions = sorted(self.agent.sessions())
        parts = [sessions[i : i + ANNOUNCE_PART] for i in range(0, len(sessions), ANNOUNCE_PART)] or [[]]
        seq = max(self._seq, self._sent_seq) + 1  # above all it sent: the registry may have applied an unanswered one
        return [
            AgentSessions(
                **self._common(leaving),
                sessions=part,
                generations=[self.agent.generation(s) for s in part],
                ended=ended if i == 0 else [],
                full=True,
                seq=seq,
                part=i,
                parts=len(parts),
            )
            for i, part in enumerate(parts)
        ]

    def _delta_messages(self, ended: list[str], leaving: bool) -> list[AgentSessions]:
        """What changed, in messages of at most ``ANNOUNCE_PART`` sessions, numbered one after the other; a
        heartbeat (nothing changed) repeats the number the registry applied last."""
        changes: list[tuple[str, str, int]] = [("ended", sid, 0) for sid in ended]
        for sid, generation in sorted(self._pending.items()):
            changes.append(("dropped", sid, 0) if generation is None else ("placed", sid, generation))
        if not changes:
            return [AgentSessions(**self._common(leaving), full=False, seq=self._seq)]
        messages = []
        for n, i in enumerate(range(0, len(changes), ANNOUNCE_PART), start=1):
            chunk = changes[i : i + ANNOUNCE_PART]
            messages.append(
                AgentSessions(
                    **self._common(leaving),
                    sessions=[sid for what, sid, _ in chunk if what == "placed"],
                    generations=[gen for what, _, gen in chunk if what == "placed"],
                    dropped=[sid for what, sid, _ in chunk if what == "dropped"],
                    ended=[sid for what, sid, _ in chunk if what == "ended"],
                    full=False,
                    seq=self._seq + n,
                )
            )
        return messages

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
        """The preStop hook's save run inside the pod's process (``final_save_command``), recorded by the checkpoint
        service (which refuses sessions this pod no longer owns): what the service recorded, or the agent's own
        report when the service did not answer. A session committed by a drain and unchanged since is not saved
        again: its checkpoint is confirmed (``kept``)."""
        report = await self._save(final_save_command(self.agent.pod, deadline_s))
        recorded = await record_report(self.bus, self.agent.pod, report)
        if recorded is not None and self.node_tier is not None:  # the store holds them now: the node's logs go
            for sid in {c.session_id for c in recorded.committed} | {k.session_id for k in recorded.kept}:
                self.node_tier.forget(sid)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.node_tier.note_usage)
        return recorded if recorded is not None else report

    async def _continue_from_node(
        self, session_id: str, answer: CheckpointLocation, restored: RestoredSession, into: Sequence[Any] | None
    ) -> RestoredSession:
        """The blocks after the restored checkpoint that the session's previous pod journaled to this node's tier
        (``shared.kv.nodetier``: only that pod's log of that generation, only on top of blocks it agrees with,
        each verified), appended to the session: what a pod killed on this node costs then is its last block.
        Not into an engine's preallocated blocks (``into``): those restore the checkpoint only."""
        tier = self.node_tier
        if tier is None:
            return restored
        came_from = answer.taken_from if into is None else ""
        try:
            tail = await tier.continue_session(
                self.agent, session_id, restored.manifest, answer.generation, came_from, answer.taken_from_generation
            )
        except Exception as exc:  # the tier is an optimisation: the checkpoint restored stands
            log.warning("node tier unreadable", extra={"session": session_id, "error": str(exc)})
            return restored
        if tail.why_not:
            log.warning("node tier log passed over", extra={"session": session_id, "reason": tail.why_not})
        if not tail.blocks:
            return restored
        return RestoredSession(
            restored.manifest,
            self.agent.blocks(session_id),
            restored.fell_back_from,
            node_blocks=len(tail.blocks),
            node_tokens=self.agent.tokens(session_id),
        )

    async def _locate(self, session_id: str, timeout: float, prefetch: bool = False) -> CheckpointLocation:
        """Take the session: its location and the generation handed out to this pod. ``TimeoutError`` when the
        checkpoint service does not answer within ``timeout``, ``LocateRefused`` when it refuses the command,
        ``SessionHeld`` when the session is another pod's."""
        answer = await self.bus.request(
            self.bus.subjects.agent_command("locate", self.agent.pod),
            LocateCheckpoint(
                session_id=session_id,
                pod=self.agent.pod,
                node=self.agent.node,
                take_session=True,
                namespace=self.agent.namespace,
                deployment=self.agent.deployment,
                take_id=uuid.uuid4().hex,
                prefetch=prefetch,
            ),
            timeout,
        )
        if not isinstance(answer, CheckpointLocation):
            reason = getattr(answer, "reason", "") or answer.kind
            raise LocateRefused(session_id, reason)
        if answer.refused:
            raise SessionHeld(session_id, answer.refused, answer.holder)
        return answer

    async def start_session(self, session_id: str, timeout: float = 10.0, layout: KvLayout | None = None) -> int:
        """Take a new session: the checkpoint service gives this pod its next generation. Returns it. ``layout``:
        the model version it runs on (default: the one the pod serves now)."""
        answer = await self._locate(session_id, timeout)
        self.agent.register_session(session_id, generation=answer.generation, layout=layout)
        self.sessions_changed()
        return answer.generation

    async def restore(
        self,
        session_id: str,
        into: Sequence[Any] | None = None,
        timeout: float = 10.0,
        tokens_known: int | None = None,
        prefetch: bool = False,
    ) -> RestoredSession:
        """Take the session (its next generation) and restore its newest good checkpoint, verified, then report
        it. ``tokens_known``: how many tokens the conversation holds, where the caller knows it (the engine kept
        its tokens, the request carries them): the report then says how many of them the engine recomputes after
        the checkpoint (``tokens_recomputed``; unknown otherwise). When there is no checkpoint
        (``CheckpointNotFound``) or none is usable (``ChunkCorrupt``), the session is held fresh under the new
        generation before the error is raised, so the caller may go on. ``prefetch``: the router's prefetch, which
        takes the session only from a holder the cluster no longer lists (``LocateCheckpoint.prefetch``: a holder
        still terminating may be saving it); ``SessionHeld`` until then."""
        started = time.monotonic()
        answer = await self._locate(session_id, timeout, prefetch)
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
        restored = await self._continue_from_node(session_id, answer, restored, into)
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
                    tokens_recomputed=(None if tokens_known is None else max(0, tokens_known - restored.tokens)),
                ),
                5.0,
            )
        return restored
