"""Simulated GPUs: the GPU port for one node of the node spec, with the node's state in Redis.

The node's state and the rules that change it are ``shared.sim.gpustate``; where it is kept, and how separate
processes (the device and driver services, the simulated workload, the fault CLI) share it, is
``shared.sim.gpustore``. This adapter answers the port from them, injected faults included.

Like NVML, a lost GPU is gone: it leaves ``devices()`` and ``utilisation()`` and stays gone until its state is
deleted. Everything here is labelled simulated (``simulated = True``, log lines say SIMULATED).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

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
from shared.sim.gpustate import (
    DRIVER_VERSION_RE,
    SimLoad,
    SimNodeState,
    as_device,
    check_spec,
    cuda_for_driver,
    initial_state,
    mig_profile,
    sample,
    validation,
    with_mig_instance,
    with_mig_mode,
    without_mig_instance,
)
from shared.sim.gpustore import (
    HealthEntry,
    SimGpuStore,
    SimHealthFeed,
    UnreadableNote,
    health_event,
    raise_if_cancelled,
    redis_down,
    stream_order,
)
from shared.sim.spec import SimSpec

log = logging.getLogger(__name__)

T = TypeVar("T")


@contextlib.contextmanager
def _redis_errors(node: str) -> Iterator[None]:
    try:
        yield
    except (redis.exceptions.RedisError, OSError) as exc:
        raise GpuError(f"simulated GPUs of {node}: Redis did not answer: {type(exc).__name__}: {exc}") from exc


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
        unreadable = UnreadableNote("SIMULATED GPU health stream unreadable; retrying")
        key = self.store.health_key(self.node)
        while not self._closed:
            try:
                reply: Any = await SIM_REDIS.call(
                    functools.partial(self.client.xread, {key: cursor}, count=100, block=self._block_ms),
                    when=lambda exc: redis_down(exc) and not self._closed,
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
                    if stream_order(cursor) > stream_order(self._cursor):
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
                if stream_order(entry_id) > stream_order(self._cursor):
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
