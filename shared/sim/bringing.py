"""How the simulated workload brings a session onto a pod (``SessionBringing``, a part of ``SimWorkload``): the
router's prefetch, and a request's session that the pod does not hold, restored from its newest checkpoint and
checked against the reference run, started fresh (recomputed from its tokens where the engine knows them), or, after a
preemption, recomputed; and the pool's preemptions that making room for it causes."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable

from shared.kv.agent import RestoredSession
from shared.kv.endpoint import LocateRefused, SessionHeld
from shared.kv.manifest import IncompatibleCheckpoint
from shared.kv.store import CheckpointNotFound, ChunkCorrupt
from shared.plumbing.errors import PermanentError, TemporaryError
from shared.sim.blockpool import PoolTooSmall
from shared.sim.pods import PodRuntime
from shared.sim.sessions import Preempted, SessionLocks, WorkloadStats

log = logging.getLogger("shared.sim.workload")  # the workload's log, as before the split


class SessionBringing:
    """Bringing sessions onto pods, for ``SimWorkload`` (which sets these attributes and methods)."""

    runtimes: dict[str, PodRuntime]
    home: dict[str, str]
    versions: dict[str, str]
    preempted: dict[str, Preempted]
    killed: dict[str, str]
    retired: OrderedDict[str, str]
    stats: WorkloadStats
    _locks: SessionLocks
    retire: Callable[[str, str], None]
    end_session: Callable[[str], bool]

    def _preempt(self, runtime: PodRuntime, victims: list[str]) -> None:
        """The pool took these sessions' blocks (recompute preemption): the engine drops their KV and keeps their
        tokens, to recompute them when they are next scheduled."""
        for sid in victims:
            version = runtime.agent.session_layout(sid).model_version
            self.preempted[sid] = Preempted(runtime.agent.tokens(sid), runtime.info.name, version)
            runtime.release(sid)
            runtime.agent.forget_session(sid)
            self.stats.preemptions += 1
            log.info(
                "session preempted: its KV blocks went to another session",
                extra={"session": sid, "pod": runtime.info.name, "tokens": self.preempted[sid].tokens},
            )
        if victims:
            runtime.endpoint.sessions_changed()

    async def prefetch(self, pod: str, session_id: str) -> bool:
        """The router's prefetch on pod ``pod`` (``shared.kv.endpoint.SessionHost``): the session brought there as
        its next request would bring it, never taken from a holder the cluster still lists. False when the pod holds
        it already; ``SessionHeld`` when another pod still does; ``PermanentError`` when this pod cannot take it."""
        async with self._locks.hold(session_id):
            runtime = self.runtimes.get(pod)
            if runtime is None or runtime.stopping or runtime.gone:
                raise PermanentError(f"pod {pod} is not serving")
            if session_id in self.retired:
                raise PermanentError(f"session {session_id} was ended")
            pinned = self.versions.get(session_id)
            if pinned is not None and pinned not in runtime.agent.layouts:
                raise PermanentError(f"pod {pod} does not hold the session's model version {pinned!r}")
            async with runtime.lock:
                if runtime.gone:
                    raise PermanentError(f"pod {pod} is gone")
                if session_id in runtime.agent.sessions():
                    self.home[session_id] = pod
                    return False
                await self._bring_session(runtime, session_id, prefetch=True)
                if session_id not in runtime.agent.sessions():
                    raise PermanentError(f"session {session_id} was not brought onto pod {pod}")
                self.home[session_id] = pod
                self.stats.prefetched += 1
                return True

    async def _bring_session(self, runtime: PodRuntime, session_id: str, prefetch: bool = False) -> None:
        """Make the session run on ``runtime``: recompute it when it was preempted, else restore its newest
        checkpoint (checked against the reference), else start it (recomputed from its tokens where the engine
        knows them, else empty). Its blocks are then reserved in the pool, preempting others."""
        preempted = self.preempted.pop(session_id, None)
        if preempted is not None:
            try:  # this pod takes it: a new generation, on the version that built it
                await runtime.endpoint.start_session(session_id, layout=runtime.agent.layouts[preempted.version])
            except SessionHeld as exc:
                self.preempted[session_id] = preempted
                raise self._held_elsewhere(session_id, exc) from exc
            except TimeoutError as exc:
                self.preempted[session_id] = preempted
                raise TemporaryError(f"checkpoint service not answering: {exc}", delay=1.0) from exc
            except LocateRefused as exc:
                self.preempted[session_id] = preempted
                raise TemporaryError(str(exc), delay=1.0) from exc
            await self._recompute(runtime, session_id, preempted.tokens)
            return
        after_kill = session_id in self.killed
        engine = runtime.engines.get(self.versions.get(session_id, runtime.agent.layout.model_version))
        known = engine.tokens_known(session_id) if engine is not None else None
        try:
            restored = await runtime.endpoint.restore(session_id, tokens_known=known, prefetch=prefetch)
        except CheckpointNotFound:
            await self._start(runtime, session_id, context_lost=after_kill and bool(known))
            return
        except ChunkCorrupt as exc:
            log.error("no good checkpoint of the session", extra={"session": session_id, "error": str(exc)})
            await self._start(runtime, session_id, context_lost=True)
            return
        except IncompatibleCheckpoint as exc:  # built by a model version this pod does not hold: never restored
            self.stats.restore_refused_version += 1
            runtime.agent.forget_session(session_id)
            runtime.endpoint.end_session(session_id)
            self.retire(session_id, f"its checkpoint cannot be restored here: {exc}")
            return
        except SessionHeld as exc:
            if prefetch:
                raise
            raise self._held_elsewhere(session_id, exc) from exc
        except TimeoutError as exc:
            raise TemporaryError(f"checkpoint service not answering: {exc}", delay=1.0) from exc
        except LocateRefused as exc:
            raise TemporaryError(str(exc), delay=1.0) from exc
        self.stats.restored += 1
        if not await self._adopt(runtime, session_id, restored):
            return
        self.stats.node_tier_blocks += restored.node_blocks
        if self.killed.pop(session_id, None) is not None:
            self.stats.continued_after_kill += 1
            self.stats.tokens_recomputed_after_kill += max(0, (known or 0) - restored.tokens)
        try:
            self._preempt(runtime, runtime.pool.reserve(session_id, len(runtime.agent.blocks(session_id))))
        except PoolTooSmall as exc:
            log.error("restored session does not fit in the pod's KV pool", extra={"error": str(exc)})
            self.end_session(session_id)
            self.stats.ended_at_max_len += 1

    def _held_elsewhere(self, session_id: str, exc: SessionHeld) -> TemporaryError:
        """Another pod that is alive holds the session (as a router would learn from ``where``): its request goes
        there when delivered again."""
        if exc.holder in self.runtimes:
            self.home[session_id] = exc.holder
        return TemporaryError(str(exc), delay=0.2)

    async def _adopt(self, runtime: PodRuntime, session_id: str, restored: RestoredSession) -> bool:
        """The engine takes the restored session and checks it against the reference run; a session that cannot
        go on (a wrong cache and no tokens to recompute it from) starts again, its context lost."""
        try:
            check = await runtime.engine_of(session_id).adopt(session_id, restored)
        except ValueError as exc:
            log.error("restored session cannot go on", extra={"session": session_id, "error": str(exc)})
            await self._start(runtime, session_id, context_lost=True)
            return False
        self.stats.count_check(session_id, check, restored.manifest.checkpoint_id)
        return True

    async def _start(self, runtime: PodRuntime, session_id: str, *, context_lost: bool) -> None:
        """The agent holds the session, empty (``restore`` registered it): the engine starts it, recomputing its
        context from its tokens when it knows them. Without them a session that had a context has lost it."""
        pinned = self.versions.get(session_id)
        if pinned is not None and runtime.agent.session_layout(session_id).model_version != pinned:
            generation = runtime.agent.generation(session_id)  # registered on the serving version: re-pin it
            runtime.agent.forget_session(session_id)
            runtime.agent.register_session(session_id, generation=generation, layout=runtime.agent.layouts[pinned])
        runtime.release(session_id)
        engine = runtime.engine_of(session_id)
        known = engine.tokens_known(session_id)
        killed = self.killed.pop(session_id, None) is not None
        if await engine.start(session_id):
            self.stats.recomputed += 1
            if killed:  # nothing restorable: the whole conversation computed again
                self.stats.continued_after_kill += 1
                self.stats.tokens_recomputed_after_kill += known or 0
        elif context_lost:
            self.stats.lost += 1
            self.stats.lost_sessions.append(session_id)
        else:
            self.stats.started_fresh += 1
        self._preempt(runtime, runtime.pool.reserve(session_id, len(runtime.agent.blocks(session_id))))

    async def _recompute(self, runtime: PodRuntime, session_id: str, tokens: int) -> None:
        """Prefill a preempted session again from its tokens: the same blocks, computed again."""
        need = math.ceil(tokens / runtime.agent.layout.block_tokens)
        self._preempt(runtime, runtime.pool.reserve(session_id, need))
        try:
            await runtime.engine_of(session_id).recompute(session_id, tokens)
        except ValueError as exc:
            log.error("preempted session cannot be recomputed", extra={"session": session_id, "error": str(exc)})
            runtime.pool.release(session_id)
            await self._start(runtime, session_id, context_lost=True)
            return
        self.stats.recomputed += 1
