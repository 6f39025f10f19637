"""The Redis storage of the simulated GPUs, shared by the GPU port's adapter (``shared.sim.gpus``) and by fault
injection.

Separate processes (the device and driver services, the simulated workload, the fault CLI) share one simulated
node by sharing its Redis keys, all under the subject root:

- ``<root>:sim:gpus:<node>``: the node's state, one JSON document (``SimNodeState``). It is created from the spec
  with ``SET NX`` by whichever process attaches first; later processes see that state, not their own copy of the
  spec. Changes are read-modify-write under ``WATCH``, so concurrent MIG changes and faults never lose an update.
- ``<root>:sim:gpus:<node>:health``: a stream of health events (XID errors, lost GPUs), written in the same
  transaction as the state change that caused them.
- ``<root>:sim:load:<node>``: a hash ``gpu uuid -> {"util", "mem_used_mib", "copy_util"}`` that the simulated
  workload writes; utilisation samples follow it.
- ``<root>:sim:gpu-nodes``: the set of nodes whose state exists (for error messages).

``SimHealthFeed`` follows the health streams of many nodes with one loop, for a process that hosts many.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from shared.contract.subjects import Subjects
from shared.plumbing.replies import as_text
from shared.plumbing.retries import SIM_REDIS
from shared.ports.gpu import GpuError, GpuHealthEvent
from shared.sim.gpustate import SimLoad, SimNodeState

log = logging.getLogger("shared.sim.gpus")  # the adapter's logger, which log filters name

T = TypeVar("T")

HEALTH_STREAM_MAXLEN = 1000

_state_decoder = msgspec.json.Decoder(SimNodeState)
_load_decoder = msgspec.json.Decoder(SimLoad)


def stream_order(raw: bytes | str) -> tuple[int, int]:
    """A stream entry id as ``(ms, seq)``, which compare in the order Redis gives the entries."""
    text = as_text(raw)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


# -- the Redis layout ---------------------------------------------------------------------------------------------
class SimGpuStore:
    """The Redis keys of the simulated GPUs, shared by the adapter and by fault injection.

    With ``batch_reads`` (one store for the many nodes of a process), the nodes' states read in the same turn of
    the event loop are fetched by one ``MGET``: a thousand nodes whose loops wake together read their GPUs in one
    round trip."""

    MGET_KEYS = 512

    def __init__(self, client: aioredis.Redis, subjects: Subjects, *, batch_reads: bool = False) -> None:
        self.client = client
        self.subjects = subjects
        self.batch_reads = batch_reads
        self._waiting: dict[str, list[asyncio.Future[Any]]] = {}
        self.batches = 0

    def state_key(self, node: str) -> str:
        return self.subjects.redis_key("sim", "gpus", node)

    def health_key(self, node: str) -> str:
        return self.subjects.redis_key("sim", "gpus", node, "health")

    def load_key(self, node: str) -> str:
        return self.subjects.redis_key("sim", "load", node)

    @property
    def nodes_key(self) -> str:
        return self.subjects.redis_key("sim", "gpu-nodes")

    async def read(self, node: str) -> SimNodeState | None:
        raw = await (self._read_together(node) if self.batch_reads else self.client.get(self.state_key(node)))
        return None if raw is None else _state_decoder.decode(raw)

    def _read_together(self, node: str) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._fetch_waiting)
        self._waiting.setdefault(node, []).append(future)
        return future

    def _fetch_waiting(self) -> None:
        waiting, self._waiting = self._waiting, {}
        nodes = list(waiting)
        for start in range(0, len(nodes), self.MGET_KEYS):
            chunk = {node: waiting[node] for node in nodes[start : start + self.MGET_KEYS]}
            asyncio.ensure_future(self._fetch(chunk))

    async def _fetch(self, waiting: dict[str, list[asyncio.Future[Any]]]) -> None:
        nodes = list(waiting)
        try:
            values = await self.client.mget([self.state_key(node) for node in nodes])
            self.batches += 1
        except BaseException as exc:
            for futures in waiting.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for node, value in zip(nodes, values, strict=True):
            for future in waiting[node]:
                if not future.done():
                    future.set_result(value)

    async def ensure(self, state: SimNodeState) -> tuple[SimNodeState, bool]:
        """The stored state of ``state.node``, created from ``state`` when absent; says whether it was created."""
        created = bool(await self.client.set(self.state_key(state.node), msgspec.json.encode(state), nx=True))
        await self.client.sadd(self.nodes_key, state.node)
        stored = await self.read(state.node)
        return (stored if stored is not None else state), created

    async def nodes(self) -> list[str]:
        return sorted(as_text(n) for n in await self.client.smembers(self.nodes_key))

    async def update(
        self,
        node: str,
        change: Callable[[SimNodeState], tuple[SimNodeState, T]],
        health: Sequence[GpuHealthEvent] = (),
    ) -> T:
        """Apply ``change`` (pure; it may raise to refuse) atomically, and append ``health`` in the same
        transaction. Retried when another writer changed the node in between."""
        key = self.state_key(node)
        async with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise GpuError(f"{node}: the simulated state is gone from Redis")
                    state, result = change(_state_decoder.decode(raw))
                    pipe.multi()
                    pipe.set(key, msgspec.json.encode(state))
                    for event in health:
                        self._append(pipe, node, event)
                    await pipe.execute()
                    return result
                except redis.exceptions.WatchError:
                    continue

    async def emit(self, node: str, event: GpuHealthEvent) -> None:
        await self.client.xadd(
            self.health_key(node), self._fields(event), maxlen=HEALTH_STREAM_MAXLEN, approximate=True
        )

    def _append(self, pipe: Any, node: str, event: GpuHealthEvent) -> None:
        pipe.xadd(self.health_key(node), self._fields(event), maxlen=HEALTH_STREAM_MAXLEN, approximate=True)

    @staticmethod
    def _fields(event: GpuHealthEvent) -> dict[Any, Any]:
        return {"uuid": event.uuid, "kind": event.kind, "xid": event.xid, "message": event.message}

    async def health_end(self, node: str) -> str:
        """The id of the newest health event, or ``0-0``: reading after it yields only what comes next."""
        newest = await self.client.xrevrange(self.health_key(node), count=1)
        return as_text(newest[0][0]) if newest else "0-0"

    async def set_load(self, node: str, uuid: str, load: SimLoad) -> None:
        await self.client.hset(self.load_key(node), uuid, msgspec.json.encode(load))

    async def loads(self, node: str) -> dict[str, SimLoad]:
        raw = await self.client.hgetall(self.load_key(node))
        return {as_text(k): _load_decoder.decode(v) for k, v in raw.items()}

    async def page_view(self, node: str, events: int) -> tuple[SimNodeState | None, dict[str, SimLoad], list[Any]]:
        """What an exporter page shows, in one round trip: the node's state (None when gone), its loads and its
        newest ``events`` health entries (newest first)."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.get(self.state_key(node))
            pipe.hgetall(self.load_key(node))
            pipe.xrevrange(self.health_key(node), count=events)
            raw, loads, newest = await pipe.execute()
        state = None if raw is None else _state_decoder.decode(raw)
        return state, {as_text(k): _load_decoder.decode(v) for k, v in loads.items()}, list(newest or ())


def health_event(fields: dict[Any, Any]) -> GpuHealthEvent:
    values = {as_text(k): as_text(v) for k, v in fields.items()}
    kind: Literal["xid", "lost"] = "lost" if values.get("kind") == "lost" else "xid"
    return GpuHealthEvent(
        uuid=values.get("uuid", ""), kind=kind, xid=int(values.get("xid") or 0), message=values.get("message", "")
    )


def redis_down(exc: Exception) -> bool:
    """Redis, or the way to it, failed: the read is worth trying again (``retries.SIM_REDIS``)."""
    return isinstance(exc, redis.exceptions.RedisError | OSError)


class UnreadableNote:
    """Told of each read of a health stream that failed and is tried again (``retries.SIM_REDIS``): logs the first
    failure in a row, the tenth and every hundredth, not each. ``failures`` is set back to 0 by a read that works."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.failures = 0

    def __call__(self, exc: Exception, wait_s: float) -> None:
        self.failures += 1
        if self.failures in (1, 10) or self.failures % 100 == 0:
            log.warning(self.message, extra={"error": str(exc), "retry_s": wait_s})


def raise_if_cancelled() -> None:
    """redis-py's asyncio client can finish a command whose task was cancelled meanwhile and drop the
    cancellation (redis/redis-py#2028, #2551); a loop over Redis calls this after each command so that a caller's
    timeout or a service's stop still ends it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# -- one reader for many nodes' health streams --------------------------------------------------------------------
HealthEntry = tuple[str, GpuHealthEvent]
"""A health event and its stream id."""


class SimHealthFeed:
    """The health streams of many simulated nodes followed by one loop, for the ``SimGpus`` of a process that
    hosts many nodes (the hollow host): one blocking ``XREAD`` over every stream followed, instead of one per
    node, each entry handed to its node's queue. Idle, it costs one command per ``block_ms`` whatever the
    number of nodes.

    ``follow(node, cursor)`` starts (or starts again, from an older cursor after a reader restarted) reading after
    ``cursor``; a read answered for a cursor that was replaced meanwhile is dropped for that node, so nothing is
    skipped and nothing is handed twice from the feed's side."""

    def __init__(self, client: aioredis.Redis, subjects: Subjects, *, block_ms: int = 1000, batch: int = 100) -> None:
        self.client = client
        self.store = SimGpuStore(client, subjects)
        self.block_ms = block_ms
        self.batch = batch
        self._cursors: dict[str, str] = {}
        self._queues: dict[str, asyncio.Queue[HealthEntry | None]] = {}
        self._generation: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._followed = asyncio.Event()

    def follow(self, node: str, cursor: str) -> asyncio.Queue[HealthEntry | None]:
        key = self.store.health_key(node)
        queue: asyncio.Queue[HealthEntry | None] = asyncio.Queue()
        previous = self._queues.get(key)
        if previous is not None:
            previous.put_nowait(None)
        self._queues[key] = queue
        self._cursors[key] = cursor
        self._generation[key] = self._generation.get(key, 0) + 1
        self._followed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="sim-health-feed")
        return queue

    def unfollow(self, node: str, queue: asyncio.Queue[HealthEntry | None]) -> None:
        key = self.store.health_key(node)
        if self._queues.get(key) is queue:
            del self._queues[key]
            del self._cursors[key]
            self._generation[key] = self._generation.get(key, 0) + 1
        queue.put_nowait(None)

    @property
    def following(self) -> int:
        return len(self._queues)

    async def _run(self) -> None:
        """Follows every stream followed, for as long as one is; Redis away, the read is tried again as
        ``retries.SIM_REDIS`` says."""
        unreadable = UnreadableNote("SIMULATED GPU health streams unreadable; retrying")
        while True:
            if not self._cursors:
                self._followed.clear()
                await self._followed.wait()
                continue
            cursors = dict(self._cursors)
            generation = dict(self._generation)
            reply: Any = await SIM_REDIS.call(
                functools.partial(self.client.xread, cursors, count=self.batch, block=self.block_ms),  # type: ignore[arg-type]
                when=redis_down,
                note=unreadable,
            )
            raise_if_cancelled()
            unreadable.failures = 0
            streams = reply.items() if isinstance(reply, dict) else (reply or ())
            for stream, entries in streams:
                key = as_text(stream)
                queue = self._queues.get(key)
                if queue is None or self._generation.get(key) != generation.get(key):
                    continue  # no longer followed, or followed again from another cursor meanwhile
                for entry_id, fields in entries:
                    queue.put_nowait((as_text(entry_id), health_event(fields)))
                    self._cursors[key] = as_text(entry_id)

    async def close(self) -> None:
        for queue in self._queues.values():
            queue.put_nowait(None)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
