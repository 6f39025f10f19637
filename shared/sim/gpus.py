"""Simulated GPUs: the GPU port for one node of the node spec, with the node's state in Redis.

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

Like NVML, a lost GPU is gone: it leaves ``devices()`` and ``utilisation()`` and stays gone until its state is
deleted. Everything here is labelled simulated (``simulated = True``, log lines say SIMULATED).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import uuid as uuidlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from shared.contract.device import GpuDevice, MigInstance
from shared.contract.subjects import Subjects
from shared.plumbing.replies import as_text
from shared.plumbing.retries import SIM_REDIS
from shared.ports.gpu import (
    DriverInstallError,
    DriverValidation,
    DriverVersions,
    GpuError,
    GpuHealthEvent,
    GpuUtilisation,
    MigProfile,
)
from shared.sim.spec import SimSpec, SpecError

log = logging.getLogger(__name__)

T = TypeVar("T")

MIG_COMPUTE_SLICES = 7
MIG_PROFILE_RE = re.compile(r"^(?P<slices>[1-7])g\.(?P<gb>[1-9][0-9]*)gb(?:\+me)?$")
DRIVER_VERSION_RE = re.compile(r"^[0-9]{3}(\.[0-9]{1,3}){1,2}$")
IDLE_POWER_W = 70.0
IDLE_TEMPERATURE_C = 35.0
HEALTH_STREAM_MAXLEN = 1000

# The highest CUDA version each driver branch supports (what NVML and nvidia-smi report as "CUDA Version").
CUDA_BY_DRIVER_BRANCH: dict[int, str] = {
    525: "12.0",
    530: "12.1",
    535: "12.2",
    545: "12.3",
    550: "12.4",
    555: "12.5",
    560: "12.6",
    565: "12.7",
    570: "12.8",
    575: "12.9",
    580: "13.0",
}

_UUID_NAMESPACE = uuidlib.UUID("5b0c1d2e-7f1a-4c55-9a59-6770756172de")


class SimGpu(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated GPU as stored in Redis. ``mig_profiles`` empty means not MIG-capable."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    pci_bus_id: str
    numa_node: int
    nvlink_peers: list[str] = msgspec.field(default_factory=list)
    mig_profiles: list[str] = msgspec.field(default_factory=list)
    mig_enabled: bool = False
    mig_instances: list[MigInstance] = msgspec.field(default_factory=list)
    next_instance: int = 0
    lost: bool = False
    copy_slowdown: float = 1.0


InstallFault = Literal["", "fail", "hang"]
MigFault = Literal["", "fail", "hang"]


class SimNodeState(msgspec.Struct, frozen=True, kw_only=True):
    """A simulated node's GPUs and driver. ``install_fault`` persists until cleared: every install fails or hangs.
    ``mig_fault`` likewise for every MIG change (mode, create, destroy)."""

    node: str
    driver_version: str
    cuda_version: str
    gpus: list[SimGpu]
    install_fault: InstallFault = ""
    install_fault_reason: str = ""
    mig_fault: MigFault = ""
    mig_fault_reason: str = ""

    def gpu(self, uuid: str) -> SimGpu:
        """The GPU with ``uuid``, lost or not; ``GpuError`` when the node has none."""
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise GpuError(f"{self.node}: no GPU {uuid!r} (GPUs: {', '.join(g.uuid for g in self.gpus)})")

    def visible(self, uuid: str) -> SimGpu:
        """The GPU with ``uuid`` if it has not been lost; NVML answers "GPU is lost" for a lost one."""
        g = self.gpu(uuid)
        if g.lost:
            raise GpuError(f"{self.node}: GPU {g.index} ({uuid}) is lost")
        return g

    def replace_gpu(self, gpu: SimGpu) -> SimNodeState:
        return msgspec.structs.replace(self, gpus=[gpu if g.uuid == gpu.uuid else g for g in self.gpus])


class SimLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the simulated workload puts on one GPU: percentages 0-100 and MiB."""

    util: float = 0.0
    mem_used_mib: float = 0.0
    copy_util: float = 0.0


_state_decoder = msgspec.json.Decoder(SimNodeState)
_load_decoder = msgspec.json.Decoder(SimLoad)


# -- pure rules ---------------------------------------------------------------------------------------------------
def gpu_uuid(root: str, node: str, index: int) -> str:
    """Deterministic: every process (and every run) names a simulated GPU the same way."""
    return "GPU-" + str(uuidlib.uuid5(_UUID_NAMESPACE, f"{root}/{node}/{index}"))


def mig_profile_slices(profile: str) -> tuple[int, int]:
    """``"3g.40gb"`` is ``(3, 40)``: compute slices out of 7, and memory in GB. ``ValueError`` for anything else."""
    match = MIG_PROFILE_RE.match(profile)
    if not match:
        raise ValueError(f"{profile!r} is not a MIG profile such as '1g.10gb' or '3g.40gb'")
    return int(match["slices"]), int(match["gb"])


def mig_profile(profile: str, gpu_memory_mib: int) -> MigProfile:
    """What a simulated GPU offers for ``profile``: a media-extension profile (``+me``) once per GPU, the others
    as many times as their compute slices fit in 7."""
    slices, gb = mig_profile_slices(profile)
    count = 1 if profile.endswith("+me") else MIG_COMPUTE_SLICES // slices
    return MigProfile(name=profile, slices=slices, max_count=count, memory_mib=min(gb * 1024, gpu_memory_mib))


def check_spec(spec: SimSpec) -> None:
    """Refuse a spec whose MIG profiles cannot exist; the error names the field."""
    for i, node in enumerate(spec.nodes):
        for j, group in enumerate(node.gpus):
            for k, profile in enumerate(group.mig_profiles):
                try:
                    mig_profile_slices(profile)
                except ValueError as exc:
                    raise SpecError(f"$.nodes[{i}].gpus[{j}].mig_profiles[{k}]: {exc}") from None


def pci_bus_id(index: int) -> str:
    return f"{index // 14:08X}:{0x18 + 0x10 * (index % 14):02X}:00.0"


def cuda_for_driver(driver_version: str, fallback: str) -> str:
    try:
        branch = int(driver_version.split(".")[0])
    except ValueError:
        return fallback
    return CUDA_BY_DRIVER_BRANCH.get(branch, fallback)


def initial_state(spec: SimSpec, node: str, root: str) -> SimNodeState:
    """The node's GPUs as the spec describes them: indexes in spec order, NUMA nodes spread evenly, NVLink
    between the GPUs of one spec entry that has ``nvlink``."""
    node_spec = spec.node(node)
    total = node_spec.gpu_count
    gpus: list[SimGpu] = []
    index = 0
    for group in node_spec.gpus:
        members = [gpu_uuid(root, node, index + k) for k in range(group.count)]
        for k in range(group.count):
            gpus.append(
                SimGpu(
                    index=index,
                    uuid=members[k],
                    model=group.model,
                    memory_mib=group.memory_mib,
                    pci_bus_id=pci_bus_id(index),
                    numa_node=index * node_spec.numa_nodes // total,
                    nvlink_peers=[u for u in members if u != members[k]] if group.nvlink else [],
                    mig_profiles=list(group.mig_profiles),
                )
            )
            index += 1
    driver = node_spec.driver_version or spec.driver_version
    cuda = spec.cuda_version if driver == spec.driver_version else cuda_for_driver(driver, spec.cuda_version)
    return SimNodeState(node=node, driver_version=driver, cuda_version=cuda, gpus=gpus)


def as_device(gpu: SimGpu, lost: frozenset[str] = frozenset()) -> GpuDevice:
    return GpuDevice(
        index=gpu.index,
        uuid=gpu.uuid,
        model=gpu.model,
        pci_bus_id=gpu.pci_bus_id,
        memory_total_mib=gpu.memory_mib,
        numa_node=gpu.numa_node,
        nvlink_peers=[p for p in gpu.nvlink_peers if p not in lost],
        mig_capable=bool(gpu.mig_profiles),
        mig_enabled=gpu.mig_enabled,
        mig_instances=list(gpu.mig_instances),
    )


def tdp_watts(model: str) -> float:
    """Board power limit by model name; 300 W for models this table does not know."""
    name = model.upper()
    pcie = "PCIE" in name
    if "H100" in name or "H200" in name or "B200" in name:
        return 350.0 if pcie else 700.0
    if "A100" in name:
        return 300.0 if pcie else 400.0
    if "L40" in name:
        return 350.0
    if "L4" in name:
        return 72.0
    return 300.0


def sample(gpu: SimGpu, load: SimLoad) -> GpuUtilisation:
    """Deterministic in the load: power rises linearly from 70 W idle to the TDP, temperature from 35 °C by
    0.5 °C per percent, and slow copies keep the copy engines busy ``copy_slowdown`` times longer."""
    util = min(max(load.util, 0.0), 100.0)
    used = min(max(load.mem_used_mib, 0.0), float(gpu.memory_mib))
    tdp = tdp_watts(gpu.model)
    return GpuUtilisation(
        uuid=gpu.uuid,
        gpu_util=util,
        mem_copy_util=min(max(load.copy_util, 0.0) * gpu.copy_slowdown, 100.0),
        mem_used_mib=used,
        mem_free_mib=float(gpu.memory_mib) - used,
        power_w=IDLE_POWER_W + util / 100.0 * max(tdp - IDLE_POWER_W, 0.0),
        temperature_c=IDLE_TEMPERATURE_C + 0.5 * util,
    )


def with_mig_mode(state: SimNodeState, uuid: str, enabled: bool) -> SimNodeState:
    gpu = state.visible(uuid)
    if not gpu.mig_profiles:
        raise GpuError(f"{state.node}: GPU {gpu.index} ({gpu.model}) is not MIG-capable (no mig_profiles in the spec)")
    if gpu.mig_enabled == enabled:
        return state
    if not enabled and gpu.mig_instances:
        raise GpuError(
            f"{state.node}: GPU {gpu.index} still has {len(gpu.mig_instances)} MIG instance(s); destroy them before "
            "disabling MIG mode"
        )
    return state.replace_gpu(msgspec.structs.replace(gpu, mig_enabled=enabled))


def with_mig_instance(state: SimNodeState, uuid: str, profile: str) -> tuple[SimNodeState, MigInstance]:
    """Add an instance of ``profile``: the profile must be one the spec allows and its compute slices must fit
    in what the GPU's other instances leave of the 7."""
    gpu = state.visible(uuid)
    if not gpu.mig_profiles:
        raise GpuError(f"{state.node}: GPU {gpu.index} ({gpu.model}) is not MIG-capable (no mig_profiles in the spec)")
    if not gpu.mig_enabled:
        raise GpuError(f"{state.node}: GPU {gpu.index} is not in MIG mode; enable MIG mode first")
    if profile not in gpu.mig_profiles:
        raise GpuError(
            f"{state.node}: MIG profile {profile!r} is not allowed on GPU {gpu.index} "
            f"(allowed: {', '.join(gpu.mig_profiles)})"
        )
    slices, gb = mig_profile_slices(profile)
    used = sum(mig_profile_slices(i.profile)[0] for i in gpu.mig_instances)
    if used + slices > MIG_COMPUTE_SLICES:
        raise GpuError(
            f"{state.node}: no room for {profile} on GPU {gpu.index}: {used} of {MIG_COMPUTE_SLICES} compute slices "
            f"are in use, {profile} needs {slices}"
        )
    instance = MigInstance(
        uuid="MIG-" + str(uuidlib.uuid5(_UUID_NAMESPACE, f"{gpu.uuid}/{gpu.next_instance}")),
        profile=profile,
        memory_mib=min(gb * 1024, gpu.memory_mib),
        gpu_instance_id=gpu.next_instance + 1,
        compute_instance_id=0,
    )
    changed = msgspec.structs.replace(
        gpu, mig_instances=[*gpu.mig_instances, instance], next_instance=gpu.next_instance + 1
    )
    return state.replace_gpu(changed), instance


def without_mig_instance(state: SimNodeState, uuid: str, instance_uuid: str) -> SimNodeState:
    gpu = state.visible(uuid)
    remaining = [i for i in gpu.mig_instances if i.uuid != instance_uuid]
    if len(remaining) == len(gpu.mig_instances):
        known = ", ".join(i.uuid for i in gpu.mig_instances) or "none"
        raise GpuError(f"{state.node}: GPU {gpu.index} has no MIG instance {instance_uuid!r} (instances: {known})")
    return state.replace_gpu(msgspec.structs.replace(gpu, mig_instances=remaining))


def validation(state: SimNodeState, expected_version: str) -> DriverValidation:
    """OK only when the installed version is the expected one and no GPU is lost (nvidia-smi fails on a lost
    GPU, so a node with one never validates)."""
    visible = sum(1 for g in state.gpus if not g.lost)
    if state.driver_version != expected_version:
        return DriverValidation(
            ok=False,
            version=state.driver_version,
            visible_gpus=visible,
            reason=f"driver {state.driver_version} is installed, {expected_version} was expected",
        )
    lost = [f"GPU {g.index} ({g.uuid})" for g in state.gpus if g.lost]
    if lost:
        return DriverValidation(
            ok=False, version=state.driver_version, visible_gpus=visible, reason=f"lost: {', '.join(lost)}"
        )
    return DriverValidation(ok=True, version=state.driver_version, visible_gpus=visible)


def _stream_id(raw: bytes | str) -> tuple[int, int]:
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


def _redis_down(exc: Exception) -> bool:
    return isinstance(exc, redis.exceptions.RedisError | OSError)


class _Unreadable:
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


@contextlib.contextmanager
def _redis_errors(node: str) -> Iterator[None]:
    try:
        yield
    except (redis.exceptions.RedisError, OSError) as exc:
        raise GpuError(f"simulated GPUs of {node}: Redis did not answer: {type(exc).__name__}: {exc}") from exc


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
        unreadable = _Unreadable("SIMULATED GPU health streams unreadable; retrying")
        while True:
            if not self._cursors:
                self._followed.clear()
                await self._followed.wait()
                continue
            cursors = dict(self._cursors)
            generation = dict(self._generation)
            reply: Any = await SIM_REDIS.call(
                functools.partial(self.client.xread, cursors, count=self.batch, block=self.block_ms),  # type: ignore[arg-type]
                when=_redis_down,
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


# -- the adapter --------------------------------------------------------------------------------------------------
class SimGpus:
    """The GPU port for one simulated node (``simulated = True``).

    The first call attaches: it creates the node's state from the spec unless another process already did, and
    marks the end of the health stream. ``health_events()`` reads after the port's cursor: the end of the stream
    at attach time, moved on as events are handled. So a service that reads its devices at start and then starts
    its health loop misses nothing in between, and a health loop restarted after a crash sees again the event it
    was handling. With a ``feed`` (``SimHealthFeed``) the stream is read by the feed's one loop for every node of
    the process, with the same cursor rules.
    """

    simulated = True

    def __init__(
        self,
        client: aioredis.Redis,
        subjects: Subjects,
        spec: SimSpec,
        node: str,
        *,
        owns_client: bool = False,
        poll_s: float = 0.1,
        block_ms: int = 1000,
        feed: SimHealthFeed | None = None,
        store: SimGpuStore | None = None,
    ) -> None:
        check_spec(spec)
        self.client = client
        self.subjects = subjects
        self.spec = spec
        self.node = node
        self.store = store or SimGpuStore(client, subjects)
        self._initial = initial_state(spec, node, subjects.root)
        self._owns_client = owns_client
        self._poll_s = poll_s
        self._block_ms = block_ms
        self._feed = feed
        self._queue: asyncio.Queue[HealthEntry | None] | None = None
        self._attached = False
        self._cursor = "0-0"
        self._closed = False

    def __repr__(self) -> str:
        return f"SimGpus(node={self.node!r}, root={self.subjects.root!r}, SIMULATED)"

    async def attach(self) -> None:
        """Idempotent: create the node's state when absent and mark the end of its health stream."""
        if self._attached:
            return
        with _redis_errors(self.node):
            state, created = await self.store.ensure(self._initial)
            self._cursor = await self.store.health_end(self.node)
        self._attached = True
        log.info(
            "SIMULATED GPUs attached",
            extra={"node": self.node, "gpus": len(state.gpus), "state_created": created, "simulated": True},
        )

    async def state(self) -> SimNodeState:
        await self.attach()
        with _redis_errors(self.node):
            found = await self.store.read(self.node)
            if found is None:
                found, _ = await self.store.ensure(self._initial)
        return found

    async def _update(self, change: Callable[[SimNodeState], tuple[SimNodeState, T]]) -> T:
        await self.state()
        with _redis_errors(self.node):
            return await self.store.update(self.node, change)

    # -- inventory and samples ------------------------------------------------------------------------------------
    async def devices(self) -> list[GpuDevice]:
        state = await self.state()
        lost = frozenset(g.uuid for g in state.gpus if g.lost)
        return [as_device(g, lost) for g in state.gpus if not g.lost]

    async def versions(self) -> DriverVersions:
        state = await self.state()
        return DriverVersions(driver=state.driver_version, cuda=state.cuda_version)

    async def utilisation(self) -> list[GpuUtilisation]:
        state = await self.state()
        with _redis_errors(self.node):
            loads = await self.store.loads(self.node)
        return [sample(g, loads.get(g.uuid, SimLoad())) for g in state.gpus if not g.lost]

    async def set_load(self, uuid: str, util: float, mem_used_mib: float, copy_util: float) -> None:
        """What the simulated workload puts on a GPU now; the next samples follow it."""
        gpu = (await self.state()).visible(uuid)
        for name, value, top in (("util", util, 100.0), ("copy_util", copy_util, 100.0)):
            if not 0.0 <= value <= top:
                raise GpuError(f"set_load {name}={value}: expected a percentage from 0 to 100")
        if not 0.0 <= mem_used_mib <= gpu.memory_mib:
            raise GpuError(f"set_load mem_used_mib={mem_used_mib}: expected 0 to {gpu.memory_mib} (the GPU's memory)")
        with _redis_errors(self.node):
            await self.store.set_load(
                self.node, uuid, SimLoad(util=util, mem_used_mib=mem_used_mib, copy_util=copy_util)
            )

    async def page_view(self, events: int = 100) -> tuple[SimNodeState, dict[str, SimLoad], list[Any]]:
        """The state, loads and newest health entries an exporter page shows, read in one round trip."""
        await self.attach()
        with _redis_errors(self.node):
            state, loads, newest = await self.store.page_view(self.node, events)
        if state is None:
            state = await self.state()
        return state, loads, newest

    async def copy_slowdown(self, uuid: str) -> float:
        """How many times slower than normal device-to-host copies on this GPU run (1.0: normal)."""
        return (await self.state()).visible(uuid).copy_slowdown

    # -- health ---------------------------------------------------------------------------------------------------
    async def health_events(self) -> AsyncIterator[GpuHealthEvent]:
        await self.attach()
        if self._feed is not None:
            async for event in self._fed():
                yield event
            return
        cursor = self._cursor
        unreadable = _Unreadable("SIMULATED GPU health stream unreadable; retrying")
        key = self.store.health_key(self.node)
        while not self._closed:
            try:
                reply: Any = await SIM_REDIS.call(
                    functools.partial(self.client.xread, {key: cursor}, count=100, block=self._block_ms),
                    when=lambda exc: _redis_down(exc) and not self._closed,
                    note=unreadable,
                )
            except (redis.exceptions.RedisError, OSError):
                if self._closed:
                    return
                raise
            raise_if_cancelled()
            unreadable.failures = 0
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    yield health_event(fields)
                    cursor = as_text(entry_id)
                    if _stream_id(cursor) > _stream_id(self._cursor):
                        self._cursor = cursor

    async def _fed(self) -> AsyncIterator[GpuHealthEvent]:
        assert self._feed is not None
        queue = self._queue = self._feed.follow(self.node, self._cursor)
        try:
            while not self._closed:
                entry = await queue.get()
                if entry is None:
                    return
                entry_id, event = entry
                yield event
                if _stream_id(entry_id) > _stream_id(self._cursor):
                    self._cursor = entry_id
        finally:
            self._feed.unfollow(self.node, queue)

    # -- MIG ------------------------------------------------------------------------------------------------------
    async def mig_profiles(self, uuid: str) -> list[MigProfile]:
        gpu = (await self.state()).visible(uuid)
        return [mig_profile(p, gpu.memory_mib) for p in gpu.mig_profiles]

    async def _mig_fault(self, what: str) -> None:
        await self._obey_fault("MIG change", what, lambda s: (s.mig_fault, s.mig_fault_reason), GpuError)

    async def _obey_fault(
        self, kind_of_change: str, what: str, fault: Callable[[SimNodeState], tuple[str, str]], error: type[GpuError]
    ) -> None:
        """An injected ``fail`` raises ``error`` with the injected reason; an injected ``hang`` waits until the
        fault is cleared (or changed), so the caller's timeout decides; no fault returns at once. The wait polls
        the fault every ``poll_s``: a steady poll of a state, not a retry after a failure (no ``retries`` policy)."""
        hanging = False
        while True:
            kind, reason = fault(await self.state())
            if kind == "fail":
                raise error(f"{self.node}: {what} failed: {reason or 'injected failure'} (SIMULATED)")
            if kind != "hang":
                return
            if not hanging:
                hanging = True
                log.warning(f"SIMULATED {kind_of_change} hangs", extra={"node": self.node, "change": what})
            raise_if_cancelled()
            await asyncio.sleep(self._poll_s)

    async def set_mig_mode(self, uuid: str, enabled: bool) -> None:
        await self._mig_fault(f"{'enabling' if enabled else 'disabling'} MIG mode on {uuid}")
        await self._update(lambda s: (with_mig_mode(s, uuid, enabled), None))

    async def create_mig_instance(self, uuid: str, profile: str) -> MigInstance:
        await self._mig_fault(f"creating MIG instance {profile} on {uuid}")
        return await self._update(lambda s: with_mig_instance(s, uuid, profile))

    async def destroy_mig_instance(self, uuid: str, instance_uuid: str) -> None:
        await self._mig_fault(f"destroying MIG instance {instance_uuid} on {uuid}")
        await self._update(lambda s: (without_mig_instance(s, uuid, instance_uuid), None))

    # -- driver ---------------------------------------------------------------------------------------------------
    async def install_driver(self, version: str) -> None:
        """Install ``version``. An injected ``fail`` raises ``DriverInstallError`` with the injected reason; an
        injected ``hang`` waits until the fault is cleared (or changed), so the caller's timeout decides."""
        if not DRIVER_VERSION_RE.match(version):
            raise DriverInstallError(f"{self.node}: {version!r} is not a driver version such as '550.54.15'")
        await self._obey_fault(
            "driver install",
            f"installing driver {version}",
            lambda s: (s.install_fault, s.install_fault_reason),
            DriverInstallError,
        )

        def install(s: SimNodeState) -> tuple[SimNodeState, None]:
            cuda = cuda_for_driver(version, s.cuda_version)
            return msgspec.structs.replace(s, driver_version=version, cuda_version=cuda), None

        await self._update(install)
        log.info("SIMULATED driver installed", extra={"node": self.node, "version": version})

    async def validate_driver(self, expected_version: str) -> DriverValidation:
        return validation(await self.state(), expected_version)

    async def close(self) -> None:
        self._closed = True
        if self._feed is not None and self._queue is not None:
            self._feed.unfollow(self.node, self._queue)
        if self._owns_client:
            with contextlib.suppress(Exception):
                await self.client.aclose()
