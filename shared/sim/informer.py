"""The simulated cluster for everything one process hosts: ``SharedSimCluster``, the informer the hollow host's
nodes share (as Kubernetes' shared informers serve many controllers of one process), and ``SimClusterView``, one
agent's ``ClusterPort`` over it. Both are ``SimCluster``s (``shared.sim.cluster``): the same state in Redis, the
same transactions, read through one follower of the change stream. SIMULATED.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis

from shared.contract.subjects import Subjects
from shared.plumbing.retries import SIM_REDIS
from shared.ports.cluster import ClusterChange, ClusterError
from shared.sim.cluster import (
    LAST_SEQ,
    REDIS_DOWN,
    WATCH_BATCH,
    WATCH_BLOCK_MS,
    Clock,
    SimCluster,
    Slices,
    change_from,
    stream_entries,
    stream_id,
)
from shared.sim.clusterstate import ClusterState
from shared.sim.gpustore import raise_if_cancelled

log = logging.getLogger("shared.sim.cluster")  # the adapter's logger, which log filters name

T = TypeVar("T")


def _informer_again(exc: Exception) -> bool:
    return isinstance(exc, (ClusterError, *REDIS_DOWN))


def _informer_failed(exc: Exception, wait_s: float) -> None:
    if isinstance(exc, REDIS_DOWN):
        log.warning("simulated cluster informer: Redis unreachable (%s); retrying in %.2f s", exc, wait_s)


Operation = Callable[[ClusterState, float], tuple[Any, list[ClusterChange]]]
WatchKinds = frozenset[str] | None


class SharedSimCluster(SimCluster):
    """The simulated cluster for everything one process hosts (the hollow host's nodes), as Kubernetes' shared
    informers serve many controllers of one process.

    - One follower reads the change stream and keeps the newest state decoded; reads are answered from that copy
      while the follower has heard from Redis within ``FRESH_S``, and a write of this process is seen by its next
      read at once. Otherwise a read goes to Redis as ``SimCluster``'s does (``ClusterError`` while Redis does not
      answer), one at a time: readers that come while one read is on its way share its answer, so a thousand
      agents reading at once decode the cluster once, not a thousand times.
    - Each ``view`` (an agent's ``ClusterPort``) watches only what it asked for: a view of one node's changes
      is woken by that node's changes alone, not by every change of the fleet.
    - Writes that arrive together, from any number of views, are applied in one transaction on the state read
      inside it, in the order they came, each one still refused on its own (a stale ``expect`` is a
      ``ClusterConflict`` for that write only: a node one write of the batch changed carries the batch's new
      revision for the writes after it). Redis stays the one truth.
    """

    FRESH_S = 10.0
    """Reads use the copy while the follower heard from Redis this recently (its blocking read returns every
    second when nothing changes; a busy process may answer it late)."""
    HISTORY = 10_000
    """Changes kept for watches that start behind the newest one."""

    def __init__(
        self, client: aioredis.Redis, subjects: Subjects, clock: Clock = time.time, *, owns_client: bool = False
    ) -> None:
        super().__init__(client, subjects, clock, owns_client=owns_client)
        self._state: ClusterState | None = None
        self._heard = 0.0
        self._history: deque[tuple[tuple[int, int], ClusterChange]] = deque(maxlen=self.HISTORY)
        self._history_from = 0
        self._last: tuple[int, int] | None = None
        """The newest change the informer has handed on; None: read the cluster (again) first."""
        self._by_node: dict[str, set[asyncio.Queue[ClusterChange | ClusterError]]] = {}
        self._filtered: dict[asyncio.Queue[ClusterChange | ClusterError], tuple[WatchKinds, str | None]] = {}
        self._pending: list[tuple[Operation, asyncio.Future[Any]]] = []
        self._committer: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._reading: asyncio.Future[ClusterState] | None = None
        self.batches = 0
        """Transactions written by the group commit (each holding one or more writes)."""

    def start(self) -> None:
        """Start following the change stream (idempotent)."""
        if self._follower is None or self._follower.done():
            self._follower = asyncio.create_task(self._follow_changes(), name="sim-cluster-informer")

    def watch(self) -> AsyncIterator[ClusterChange]:
        return self.follow(self._seen, None, None)

    async def tick(self) -> None:
        """As ``SimCluster.tick``; nothing to do (and nothing read from Redis) while the copy is fresh and holds
        no Terminating pod: the clock changes nothing else (every write reconciles as it is made)."""
        state = self._state
        fresh = state is not None and time.monotonic() - self._heard < self.FRESH_S
        if fresh and state is not None and not any(p.phase == "Terminating" for p in state.pods.values()):
            return
        await super().tick()

    def view(self, kinds: Iterable[str] | None = None, node: str | None = None) -> SimClusterView:
        """A ``ClusterPort`` over this cluster whose watch yields only changes of ``kinds`` (and, for node
        changes, of ``node``); closing it closes nothing shared."""
        return SimClusterView(self, frozenset(kinds) if kinds is not None else None, node)

    @property
    def live(self) -> bool:
        return self._state is not None and time.monotonic() - self._heard < self.FRESH_S

    # -- reads ----------------------------------------------------------------------------------------------------
    async def _read(self) -> ClusterState:
        state = self._state
        if state is not None and time.monotonic() - self._heard < self.FRESH_S:
            return state
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_through())
        return await asyncio.shield(self._reading)

    async def _read_through(self) -> ClusterState:
        state = await super()._read()
        self._adopt(state)
        return state

    def _committed(self, state: ClusterState) -> None:
        self._adopt(state)

    def _adopt(self, state: ClusterState) -> None:
        if self._state is None or state.revision >= self._state.revision:
            self._state = state

    async def _follow_changes(self) -> None:
        """Runs for the informer's lifetime, one read of the change stream after another (``_next_changes``):
        Redis away, or changes gone from the stream (the cluster is read again), tried again as
        ``retries.SIM_REDIS`` says."""
        while True:
            await SIM_REDIS.call(self._next_changes, when=_informer_again, note=_informer_failed)

    async def _next_changes(self) -> None:
        """Read the cluster when there is no revision to follow from, then one blocking read of the changes after
        it, handed to the watches. Redis away: ``REDIS_DOWN``; changes gone: ``ClusterError``, each watch told
        (list again and watch anew) and the cluster read again next time."""
        try:
            last = self._last
            if last is None:
                state = await super()._read()
                self._adopt(state)
                last = self._last = (state.revision, LAST_SEQ)
                self._history.clear()
                self._history_from = state.revision
                self._heard = time.monotonic()
            reply = await self._client.xread(
                {self._changes_key: stream_id(*last)}, count=WATCH_BATCH, block=WATCH_BLOCK_MS
            )
            raise_if_cancelled()
            self._heard = time.monotonic()
            entries = list(stream_entries(reply))
            if not entries:
                if last[0] > 0:
                    await self._still_there(last[0])
                return
            changes: list[tuple[tuple[int, int], ClusterChange]] = []
            for entry_id, fields in entries:
                key = _revision_key(entry_id)
                expected = [(last[0] + 1, 0)] + ([(last[0], last[1] + 1)] if last[1] != LAST_SEQ else [])
                if key not in expected:
                    raise ClusterError(
                        f"changes after {stream_id(*last)} are gone (trimmed, or the cluster was made afresh; "
                        f"next is {entry_id})"
                    )
                last = self._last = key
                changes.append((last, change_from(entry_id, fields)))
            if self._state is None or last[0] > self._state.revision:
                self._adopt(await super()._read())
            for key, change in changes:
                self._history.append((key, change))
                self._notify(change)
        except ClusterError as exc:
            log.info("simulated cluster informer: %s; reading the cluster again", exc)
            self._fail_watchers(exc)
            self._state, self._heard, self._last = None, 0.0, None
            raise
        except REDIS_DOWN:
            self._heard = 0.0
            raise

    # -- watches --------------------------------------------------------------------------------------------------
    def _notify(self, change: ClusterChange) -> None:
        if change.kind == "node":
            for queue in self._by_node.get(change.name, ()):
                queue.put_nowait(change)
        for queue, (kinds, node) in self._filtered.items():
            if _selects(change, kinds, node):
                queue.put_nowait(change)

    def _fail_watchers(self, exc: ClusterError) -> None:
        for queues in self._by_node.values():
            for queue in queues:
                queue.put_nowait(exc)
        for queue in self._filtered:
            queue.put_nowait(exc)

    async def follow(self, after: int, kinds: WatchKinds, node: str | None) -> AsyncIterator[ClusterChange]:
        """The changes after revision ``after`` that ``kinds`` and ``node`` select (``after`` 0: from now on).
        Raises ``ClusterError`` when changes after ``after`` are no longer held: list again and watch anew."""
        queue: asyncio.Queue[ClusterChange | ClusterError] = asyncio.Queue()
        indexed = node is not None and kinds == frozenset({"node"})
        if indexed:
            assert node is not None
            self._by_node.setdefault(node, set()).add(queue)
        else:
            self._filtered[queue] = (kinds, node)
        try:
            newest = (after, LAST_SEQ)
            if after > 0:
                if after < self._history_from:
                    raise ClusterError(
                        f"simulated cluster watch: changes after revision {after} are no longer held; list again"
                    )
                for key, change in list(self._history):
                    if key > newest and _selects(change, kinds, node):
                        newest = key
                        yield change
            while True:
                item = await queue.get()
                if isinstance(item, ClusterError):
                    raise item
                key = _revision_key(item.revision)
                if key > newest or after == 0:
                    newest = max(newest, key)
                    yield item
        finally:
            if indexed:
                assert node is not None
                watchers = self._by_node.get(node)
                if watchers is not None:
                    watchers.discard(queue)
                    if not watchers:
                        del self._by_node[node]
            else:
                self._filtered.pop(queue, None)

    # -- writes ---------------------------------------------------------------------------------------------------
    async def _mutate(self, operation: Callable[[ClusterState, float], tuple[T, list[ClusterChange]]]) -> T:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((operation, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_pending(), name="sim-cluster-group-commit")
        result: T = await future
        return result

    async def _commit_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                outcomes = await self._transact(functools.partial(self._batch_step, batch))
            except BaseException as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            self.batches += 1
            for (_, future), (ok, value) in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    def _batch_step(
        self,
        batch: list[tuple[Operation, asyncio.Future[Any]]],
        current: ClusterState | None,
        now: float,
        slices: Slices,
    ) -> tuple[list[tuple[bool, Any]], ClusterState | None, list[ClusterChange]]:
        if current is None:
            raise self._absent()
        revision = current.revision + 1
        outcomes: list[tuple[bool, Any]] = []
        changes: list[ClusterChange] = []
        for operation, _ in batch:
            try:
                result, made = operation(current, now)
            except Exception as exc:  # refused before it changed anything (ClusterState's operations do)
                outcomes.append((False, exc))
                continue
            made = made + current.reconcile(now, slices)
            for change in made:  # later writes of the batch see the revision this one gives the node
                if change.kind == "node" and change.name in current.nodes:
                    current.nodes[change.name].revision = revision
            changes += made
            outcomes.append((True, result))
        return outcomes, current, changes

    async def close(self) -> None:
        for task in (self._follower, self._committer):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await super().close()


class SimClusterView(SimCluster):
    """One agent's ``ClusterPort`` over a ``SharedSimCluster``: reads and writes go to the shared cluster, its
    watch yields what it selects; ``close`` closes nothing shared. SIMULATED."""

    def __init__(self, shared: SharedSimCluster, kinds: WatchKinds, node: str | None) -> None:
        super().__init__(shared._client, shared._subjects, shared._clock)
        self.shared = shared
        self.kinds = kinds
        self.node_filter = node

    async def _read(self) -> ClusterState:
        state = await self.shared._read()
        self._seen = max(self._seen, state.revision)
        return state

    async def _mutate(self, operation: Callable[[ClusterState, float], tuple[T, list[ClusterChange]]]) -> T:
        result = await self.shared._mutate(operation)
        self._seen = max(self._seen, self.shared.revision)
        return result

    def watch(self) -> AsyncIterator[ClusterChange]:
        return self.shared.follow(self._seen, self.kinds, self.node_filter)

    async def close(self) -> None:
        return None


def _selects(change: ClusterChange, kinds: WatchKinds, node: str | None) -> bool:
    return (kinds is None or change.kind in kinds) and (node is None or change.kind != "node" or change.name == node)


def _revision_key(revision: str) -> tuple[int, int]:
    head, _, seq = revision.partition("-")
    return int(head), int(seq or 0)
