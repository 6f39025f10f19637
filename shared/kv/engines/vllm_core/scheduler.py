"""The scheduler side: which tokens a checkpoint offers each request, and the step plans that tell the workers
what to claim, load, copy and finish (``SchedulerBook``); what the newest checkpoint of a session holds
(``checkpoint_tokens``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.kv.engines.vllm_core.plan import ClaimSpec, CopySpec, FinishSpec, LoadSpec, StepPlan, TruncateSpec
from shared.kv.manifest import KvLayout, check_compatible, newest_first
from shared.kv.store import CheckpointNotFound, CheckpointStore

log = logging.getLogger("vllm.gpuwarden.scheduler")  # under vLLM's logger: its handlers print it


@dataclass
class _Request:
    session: str
    block_ids: list[int]
    told_full: int = 0
    end: bool = False


@dataclass
class _Offer:
    session: str
    from_store: bool
    num_computed: int
    external: int


class SchedulerBook:
    """The scheduler side's state. ``lookup(session)`` answers how many tokens the newest usable checkpoint of a
    session holds (0: none, or refused); it is asked at most once per request."""

    def __init__(self, block_size: int, lookup: Callable[[str], int]) -> None:
        self.block_size = block_size
        self.lookup = lookup
        self.held: dict[str, list[int]] = {}  # sessions this engine's agents hold: the tokens they hold
        self.requests: dict[str, _Request] = {}
        self.live: dict[str, str] = {}  # session -> the request running it
        self.offers: dict[str, _Offer] = {}
        self.store_tokens: dict[str, int] = {}  # req_id -> what lookup answered
        self.holding: set[str] = set()  # finished requests whose blocks wait for the worker's copy
        self._claims: list[ClaimSpec] = []
        self._truncates: list[TruncateSpec] = []
        self._loads: list[LoadSpec] = []
        self._finishes: list[FinishSpec] = []
        self._copy_specs: list[CopySpec] = []

    def matched(self, req_id: str, session: str | None, prompt: Sequence[int], num_computed: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: tokens beyond ``num_computed`` this connector loads (whole blocks, never
        the prompt's last token), and False (loads are synchronous). Side-effect free but for remembering the
        answer until the request is allocated."""
        if session is None or (session in self.live and self.live[session] != req_id):
            return 0, False  # no session, or another request of it is running: it cannot be copied twice
        limit = max(0, len(prompt) - 1)
        if session in self.held:
            available, from_store = common_prefix(self.held[session], prompt), False
        else:
            if req_id not in self.store_tokens:
                self.store_tokens[req_id] = max(0, int(self.lookup(session)))
            available, from_store = self.store_tokens[req_id], True
        loadable = min(available, limit) // self.block_size * self.block_size
        external = max(0, loadable - num_computed)
        self.offers[req_id] = _Offer(session, from_store, num_computed, external)
        return external, False

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """``update_state_after_alloc``: ``block_ids`` are all the request's blocks (its prefix-cached ones, then
        the new ones); the external tokens follow the locally computed ones."""
        offer = self.offers.pop(req_id, None)
        self.store_tokens.pop(req_id, None)
        if offer is None or num_external <= 0:
            return
        first = offer.num_computed // self.block_size
        count = num_external // self.block_size
        ids = list(block_ids[first : first + count])
        if len(ids) != count:
            log.warning("request %s: fewer blocks allocated (%d) than tokens offered", req_id, len(ids))
            return
        self._loads.append(LoadSpec(req_id, offer.session, first, ids, offer.from_store))
        if offer.from_store:
            self.held[offer.session] = []  # tokens unknown until the request runs: nothing to compare with
        self.live[offer.session] = req_id

    def new_request(
        self,
        req_id: str,
        session: str | None,
        end: bool,
        prompt: Sequence[int],
        block_ids: Sequence[int],
        num_computed: int,
        num_scheduled: int,
    ) -> None:
        """A request scheduled for the first time (``scheduled_new_reqs``)."""
        if session is None or (session in self.live and self.live[session] != req_id):
            return
        self.live[session] = req_id
        held = self.held.get(session)
        if held is None:
            self._claims.append(ClaimSpec(session))
            self.held[session] = []
        elif held:
            same = common_prefix(held, prompt)
            if same < len(held):
                self._truncates.append(TruncateSpec(session, same // self.block_size))
        self.requests[req_id] = _Request(session, list(block_ids), end=end)
        self._copies_for(req_id, num_computed, num_scheduled)

    def cached_request(
        self, req_id: str, new_block_ids: Sequence[int] | None, resumed: bool, num_computed: int, num_scheduled: int
    ) -> None:
        """A request scheduled again (``scheduled_cached_reqs``): its new blocks are appended, or replace its
        blocks when it resumed from preemption."""
        request = self.requests.get(req_id)
        if request is None:
            return
        if resumed:
            request.block_ids = list(new_block_ids or [])
        elif new_block_ids:
            request.block_ids.extend(new_block_ids)
        self._copies_for(req_id, num_computed, num_scheduled)

    def _copies_for(self, req_id: str, num_computed: int, num_scheduled: int) -> None:
        request = self.requests[req_id]
        # a rollback (preemption, or blocks that failed to load and are recomputed) re-tells what is computed again
        request.told_full = min(request.told_full, num_computed // self.block_size)
        full = min((num_computed + num_scheduled) // self.block_size, len(request.block_ids))
        if full > request.told_full:
            spec = CopySpec(req_id, request.session, request.told_full, request.block_ids[request.told_full : full])
            request.told_full = full
            self._copy_specs.append(spec)

    def finished(self, req_id: str, block_ids: Sequence[int], num_computed: int, tokens: Sequence[int]) -> bool:
        """``request_finished``: True when the worker must first copy the request's blocks (vLLM then holds them
        until the worker reports the request done)."""
        request = self.requests.pop(req_id, None)
        self.offers.pop(req_id, None)
        self.store_tokens.pop(req_id, None)
        if request is None:
            return False
        if self.live.get(request.session) == req_id:
            del self.live[request.session]
        if request.end:
            self.held.pop(request.session, None)
        else:
            self.held[request.session] = list(tokens[:num_computed])
        hold = num_computed > 0 and bool(block_ids)
        self._finishes.append(FinishSpec(req_id, request.session, num_computed, list(block_ids), request.end, hold))
        if hold:
            self.holding.add(req_id)
        return hold

    def released(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests' copies done (``KVConnectorOutput.finished_sending``)."""
        self.holding.difference_update(req_ids)

    def build(self) -> StepPlan:
        """``build_connector_meta``: everything since the last step; the book starts the next step empty."""
        plan = StepPlan(
            claims=self._claims,
            truncates=self._truncates,
            loads=self._loads,
            copies=self._copy_specs,
            finishes=self._finishes,
        )
        self._claims, self._truncates, self._loads, self._copy_specs, self._finishes = [], [], [], [], []
        return plan


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    arr_a = np.asarray(a[:n], dtype=np.int64)
    arr_b = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(arr_a != arr_b)
    return int(diff[0]) if diff.size else n


async def checkpoint_tokens(
    store: CheckpointStore, layout: KvLayout, session: str, bus: Any = None, pod: str = ""
) -> int:
    """Tokens the newest checkpoint of ``session`` holds (0 when there is none, or it is of another layout, which
    is refused and logged). With ``bus``, the checkpoint service says which checkpoints count (newest first),
    asked as ``pod`` (the credentials' pod)."""
    ids: list[str]
    if bus is not None:
        from shared.contract.checkpoint import CheckpointLocation, LocateCheckpoint

        answer = await bus.request(
            bus.subjects.agent_command("locate", pod),
            LocateCheckpoint(session_id=session, pod=pod, take_session=False),
            5.0,
        )
        if not isinstance(answer, CheckpointLocation) or not answer.found:
            return 0
        ids = list(answer.candidates) or [answer.checkpoint_id]
    else:
        ids = newest_first(await store.checkpoints(session))
    for cid in ids[:1]:
        try:
            manifest = await store.manifest(session, cid)
        except CheckpointNotFound:
            return 0
        try:
            check_compatible(manifest, layout)
        except ValueError as exc:
            log.warning("checkpoint of session %s refused: %s", session, exc)
            return 0
        return manifest.token_count
    return 0
