"""The worker side: step plans executed against the paged cache and the agent (``WorkerBook``), and sessions taken
and restored through the checkpoint service or the agent alone (``SessionPort``), ahead of their request when the
router asks (``SessionPort.prefetch``: the engine's ``SessionHost``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.kv.agent import KvAgent
from shared.kv.engines.vllm_core.loop import AgentLoop
from shared.kv.engines.vllm_core.paged import PagedCache
from shared.kv.engines.vllm_core.plan import FinishSpec, LoadSpec, StepPlan
from shared.kv.store import CheckpointNotFound, StoreError

log = logging.getLogger("vllm.gpuwarden.worker")  # under vLLM's logger: its handlers print it


class SessionPort:
    """How a worker takes and restores sessions: through the checkpoint service (``AgentEndpoint``, which hands
    out generations) or, without one, the agent alone (generation 0).

    It is also the engine's ``SessionHost`` (``shared.kv.endpoint``): the router's prefetch restores a session into
    the agent (host memory: fetched from the store, verified, claimed under a new generation) before its request
    comes; the request's load then takes the blocks from that copy (``restore``), so only the host-to-device copy
    is left on its way to the first token. The two never run at once for one session (a lock each)."""

    def __init__(self, agent: KvAgent, endpoint: Any = None, claim_timeout_s: float = 10.0) -> None:
        self.agent = agent
        self.endpoint = endpoint
        self.claim_timeout_s = claim_timeout_s
        self.prefetched: set[str] = set()
        """Sessions a prefetch brought whose request has not loaded them yet."""
        self.loaded_from_prefetch = 0
        self._locks: dict[str, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, session: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(session, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._locks.get(session) is lock:
                del self._locks[session]

    async def prefetch(self, session_id: str) -> bool:
        """``SessionHost.prefetch``: restore the session's newest good checkpoint into the agent now, through the
        checkpoint service as a prefetch (never taken from a holder the cluster still lists: ``SessionHeld`` until
        then). True when brought (restored, or held fresh where there is no checkpoint: vLLM computes it); False
        when the agent held it already."""
        if self.endpoint is None:
            raise RuntimeError("this worker has no checkpoint service to take sessions from")
        async with self._one_at_a_time(session_id):
            if session_id in self.agent.sessions():
                return False
            try:
                restored = await self.endpoint.restore(session_id, timeout=self.claim_timeout_s, prefetch=True)
            except CheckpointNotFound:  # held fresh under its new generation: its request computes it
                return True
            self.prefetched.add(session_id)
            log.info("session %s prefetched: %d tokens ready in host memory", session_id, restored.manifest.token_count)
            return True

    async def claim(self, session: str) -> None:
        self.prefetched.discard(session)
        if session in self.agent.sessions():
            return
        if self.endpoint is not None:
            from shared.kv.endpoint import LocateRefused  # the endpoint's module, loaded with it

            try:
                await self.endpoint.start_session(session, self.claim_timeout_s)
                return
            except (TimeoutError, LocateRefused, StoreError, OSError) as exc:
                log.warning("could not claim session %s; held under generation 0: %s", session, exc)
        self.agent.register_session(session)

    async def restore(self, session: str) -> int:
        """Restore the session's newest good checkpoint into the agent; its token count (0: none usable, the
        session is then held fresh). A session a prefetch brought is taken from that copy, once."""
        async with self._one_at_a_time(session):
            if session in self.prefetched and session in self.agent.sessions():
                self.prefetched.discard(session)
                self.loaded_from_prefetch += 1
                log.info("session %s: loaded from its prefetched copy", session)
                return self.agent.tokens(session)
            self.prefetched.discard(session)
            return await self._restore(session)

    async def _restore(self, session: str) -> int:
        try:
            if self.endpoint is not None:
                restored = await self.endpoint.restore(session, timeout=self.claim_timeout_s)
            else:
                restored = await self.agent.restore(session)
        except StoreError as exc:  # CheckpointNotFound, ChunkCorrupt, ManifestCorrupt: nothing usable
            log.warning("restore of session %s found nothing usable: %s", session, exc)
            if session not in self.agent.sessions():
                self.agent.register_session(session)
            return 0
        if restored.fell_back_from:
            log.warning("session %s: restored an older checkpoint, skipping %s", session, restored.fell_back_from)
        return restored.manifest.token_count

    def end(self, session: str) -> None:
        self.prefetched.discard(session)
        if self.endpoint is not None:
            self.endpoint.end_session(session)
        else:
            self.agent.forget_session(session)


@dataclass
class StepReport:
    """What a worker step did, for the connector's hooks and for tests."""

    loaded_blocks: int = 0
    copied_blocks: int = 0
    load_errors: set[int] = field(default_factory=set)


class WorkerBook:
    """The worker side: executes step plans against the paged cache and the agent (through ``loop``, in order).

    ``held_full[s]``: how many full blocks of session ``s`` the agent has (or will have, once the ordered work
    queued so far ran); copies fill it up one block at a time and never leave a gap."""

    def __init__(
        self,
        agent: KvAgent,
        loop: AgentLoop,
        port: SessionPort,
        save_on_finish: bool = False,
        load_timeout_s: float = 120.0,
    ) -> None:
        self.agent = agent
        self.loop = loop
        self.port = port
        self.save_on_finish = save_on_finish
        self.load_timeout_s = load_timeout_s
        self.cache: PagedCache | None = None
        self.held_full: dict[str, int] = {}
        self._tainted: dict[str, int] = {}  # req_id -> first block whose load failed in this step
        self._done: set[str] = set()  # finished requests whose blocks are copied
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()
        self._saves: list[concurrent.futures.Future[Any]] = []

    @property
    def bs(self) -> int:
        return self.agent.layout.block_tokens

    def register(self, cache: PagedCache) -> None:
        if cache.layout != self.agent.layout:
            raise ValueError("the paged cache and the agent disagree on the layout")
        self.cache = cache

    def _paged(self) -> PagedCache:
        if self.cache is None:
            raise RuntimeError("register_kv_caches was not called before the first step")
        return self.cache

    # before the forward pass
    def before_forward(self, plan: StepPlan) -> StepReport:
        report = StepReport()
        self._tainted.clear()
        for claim in plan.claims:
            if claim.session not in self.held_full:
                self.held_full[claim.session] = 0
                self.loop.ordered(lambda s=claim.session: self.port.claim(s))  # type: ignore[misc]
        for cut in plan.truncates:
            self.held_full[cut.session] = min(self.held_full.get(cut.session, 0), cut.blocks)
            self.loop.ordered(lambda c=cut: self._truncate(c.session, c.blocks))  # type: ignore[misc]
        for load in plan.loads:
            self._load(load, report)
        self._load_errors |= report.load_errors
        return report

    async def _truncate(self, session: str, blocks: int) -> None:
        if session in self.agent.sessions():
            self.agent.truncate(session, blocks)

    def _load(self, load: LoadSpec, report: StepReport) -> None:
        cache = self._paged()
        want = len(load.block_ids)

        async def fetch() -> list[Any]:
            if load.from_store:
                tokens = await self.port.restore(load.session)
            else:
                tokens = self.agent.tokens(load.session) if load.session in self.agent.sessions() else 0
            full = tokens // self.bs
            self.held_full[load.session] = full
            blocks = self.agent.blocks(load.session) if load.session in self.agent.sessions() else []
            return list(blocks[load.first : min(full, load.first + want)])

        try:
            blocks = self.loop.ordered(fetch).result(self.load_timeout_s)
        except Exception as exc:  # a failed load is recomputed by vLLM, never a crash
            log.warning("loading session %s failed: %s", load.session, exc)
            blocks = []
        try:
            cache.scatter(load.block_ids[: len(blocks)], blocks)
        except (TypeError, ValueError, RuntimeError) as exc:
            log.warning("session %s: restored blocks do not fit the paged cache: %s", load.session, exc)
            blocks = []
        report.loaded_blocks += len(blocks)
        if len(blocks) < want:
            failed = load.block_ids[len(blocks) :]
            report.load_errors.update(failed)
            first_bad = load.first + len(blocks)
            self._tainted[load.req_id] = first_bad
            self.held_full[load.session] = min(self.held_full.get(load.session, 0), first_bad)
            self.loop.ordered(lambda: self._truncate(load.session, first_bad))

    # after the forward pass
    def after_forward(self, plan: StepPlan) -> StepReport:
        report = StepReport()
        for copy in plan.copies:
            report.copied_blocks += self._copy(copy.req_id, copy.session, copy.first, copy.block_ids, None)
        for finish in plan.finishes:
            report.copied_blocks += self._finish(finish)
        return report

    def _copy(self, req_id: str, session: str, first: int, block_ids: Sequence[int], tail: int | None) -> int:
        """Copy the blocks the agent lacks among ``first ..`` (the last one partial, ``tail`` positions, when given);
        returns how many were copied."""
        held = self.held_full.get(session)
        if held is None:
            return 0  # never claimed here (a request of a session that another request runs)
        limit = self._tainted.get(req_id, len(block_ids) + first)
        indexes = [first + i for i in range(len(block_ids)) if held <= first + i < limit]
        if not indexes or indexes[0] != held:
            return 0  # nothing new, or a gap the agent cannot hold: recomputed blocks are told again later
        ids = [block_ids[i - first] for i in indexes]
        full_count = len(ids) if tail is None else len(ids) - 1
        tokens = [self.bs] * full_count + ([] if tail is None else [tail])
        host = self._paged().gather(ids, tokens)
        self.held_full[session] = held + full_count
        end_tokens = (held + full_count) * self.bs + (0 if tail is None else tail)
        self.loop.ordered(lambda: self._put(session, held, host, end_tokens))
        return len(host)

    async def _put(self, session: str, first: int, blocks: list[torch.Tensor], tokens: int) -> None:
        if session not in self.agent.sessions():
            self.agent.register_session(session)
        count = len(self.agent.blocks(session))
        if first > count:
            log.warning("session %s: a gap before block %d; not kept", session, first)
            return
        for i, block in enumerate(blocks, first):
            if i < count:
                self.agent.update_block(session, i, block)
            else:
                self.agent.append_block(session, block, tokens=min(tokens, (i + 1) * self.bs))
        self.agent.truncate(session, first + len(blocks))  # a stale tail beyond what was just written
        self.agent.set_tokens(session, tokens)

    def _finish(self, finish: FinishSpec) -> int:
        copied = 0
        full, tail = divmod(finish.tokens, self.bs)
        if finish.session in self.held_full and finish.tokens > 0:
            held = self.held_full[finish.session]
            ids = list(finish.block_ids[held : full + (1 if tail else 0)])
            if ids and held <= full:
                copied = self._copy(finish.req_id, finish.session, held, ids, tail if tail else None)
        session = finish.session
        if finish.end:
            self.held_full.pop(session, None)
            self.loop.ordered(lambda: self._end(session))
        elif self.save_on_finish and session in self.held_full:
            self._saves.append(self.loop.ordered(lambda: self.agent.save([session], reason="finish")))
        if finish.held:
            self._done.add(finish.req_id)
        return copied

    async def _end(self, session: str) -> None:
        self.port.end(session)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """``get_finished``'s sending half: finished requests whose blocks were copied; each once."""
        self._finished_seen.update(finished_req_ids)
        ready = self._done & self._finished_seen
        self._done -= ready
        self._finished_seen -= ready
        return ready

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self, timeout: float | None = None) -> list[Any]:
        """Wait for the ordered work queued so far (and the saves it started); returns the save reports."""
        self.loop.ordered(_nothing).result(timeout)
        saves, self._saves = self._saves, []
        return [s.result(timeout) for s in saves]


async def _nothing() -> None:
    return None
