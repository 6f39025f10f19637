"""A whole small fleet for fault scenarios: the simulated cluster and its workload (synthetic KV blocks), the real
checkpoint service, one driver service per node (each answering for its own simulated GPUs; whichever leads
coordinates upgrades), a client of the mesh as the CLI has it, and what the scenario needs to judge the outcome:
every drain verdict as stored in the events stream, the invariant checker, traffic that brings sessions back.

It runs on whatever NATS the settings name: the one server of the test session, or a cluster
(``tests.servers.NatsCluster``) with R3 streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis.asyncio as aioredis

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.registry import SessionRegistry
from services.checkpoint.service import CheckpointService
from services.driver.config import DriverSettings
from services.driver.service import DriverService
from services.router.config import RouterSettings
from services.router.service import RouterService
from shared.console.client import MeshClient
from shared.contract.annotations import UPGRADE_STATE_LABEL
from shared.contract.node import DrainCompleted, DrainFailed
from shared.contract.requests import InferenceRequest
from shared.contract.sessions import SessionLocation
from shared.contract.subjects import Subjects
from shared.host.runner import RunningService, ServiceContext, start_service
from shared.kv.filestore import FileStore
from shared.kv.manifest import CheckpointManifest
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.consumer import ConsumerSpec, consume
from shared.plumbing.settings import HostPort, Settings
from shared.sim.cluster import SimCluster
from shared.sim.engines import verify_blocks
from shared.sim.gateway import GatewayClient, GatewayRouting
from shared.sim.gpus import SimGpus
from shared.sim.spec import DeploymentSpec, ModelShape, NodeSpec, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.faults.checker import Findings, check_invariants
from tests.helpers import eventually

SMALL_MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16)  # 16 KiB synthetic blocks
NODES = ("node-1", "node-2", "node-3")
SPEC = SimSpec(
    nodes=[NodeSpec(name=name) for name in NODES],
    deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=3, max_unavailable=2, model=SMALL_MODEL)],
)
DRIVER_SETTINGS = DriverSettings(reconcile_s=0.2, lease_ttl_s=5, agent_timeout_s=2)
NEW_DRIVER = "560.35.03"
ROUTER_SETTINGS = RouterSettings(listen=HostPort("127.0.0.1", 0), pool="llm/llama", pods_resync_s=0.5)

Verdict = DrainCompleted | DrainFailed


class GatedStore(FileStore):
    """The real file store, whose commits wait while the test holds its ``gate`` closed: a drain is then surely
    in flight (its savers have written their chunks and wait to commit) when the test strikes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = 0
        """Commits waiting at the closed gate now."""

    async def commit_manifests(self, manifests: Sequence[CheckpointManifest]) -> None:
        if not self.gate.is_set():
            self.held += 1
            try:
                await self.gate.wait()
            finally:
                self.held -= 1
        await super().commit_manifests(manifests)


@dataclass
class Fleet:
    settings: Settings
    subjects: Subjects
    spec: SimSpec
    client: aioredis.Redis
    cluster: SimCluster
    store: GatedStore
    checkpoint: HeldWhere
    workload: SimWorkload
    bus: Bus
    mesh: MeshClient
    drivers: list[RunningService] = field(default_factory=list)
    routers: list[tuple[RouterService, RunningService]] = field(default_factory=list)
    """The endpoint pickers the workload's gateway asks, in the order it asks them (``fleet(routers=N)``)."""
    running: list[RunningService] = field(default_factory=list)
    """Every service the fleet started and stops at its end (one stopped by the scenario leaves this list)."""
    verdicts: dict[str, list[Verdict]] = field(default_factory=dict)
    """Every drain verdict stored in the events stream, by drain id (read by a durable consumer: none is missed
    while a connection fails over)."""

    async def kill_router(self, index: int) -> None:
        """The ``index``-th endpoint picker stops answering: its gRPC server and its connections close."""
        _, running = self.routers[index]
        self.running.remove(running)
        await running.stop(grace=0)

    def gpus(self, node: str) -> SimGpus:
        return SimGpus(self.client, self.subjects, self.spec, node)

    async def begin(self, count: int, prompt: int = 40) -> list[str]:
        """``count`` sessions, one turn each, served and registered with the checkpoint service."""
        sessions = [f"chat-{i}" for i in range(count)]
        served = self.workload.stats.served
        for i, sid in enumerate(sessions):
            await self.bus.publish(self.turn(sid, prompt + 7 * i))
        await eventually(lambda: self.workload.stats.served >= served + count, timeout=60)

        async def registered() -> bool:
            on = [await self.checkpoint.registry.sessions_on_node(n.name) for n in self.spec.nodes]
            return sum(len(s) for s in on) >= count

        await eventually(registered, timeout=30)
        return sessions

    @staticmethod
    def turn(sid: str, prompt: int = 5) -> InferenceRequest:
        return InferenceRequest(namespace="llm", deployment="llama", session_id=sid, prompt_tokens=prompt)

    async def talk(self, sessions: list[str], timeout: float = 90) -> None:
        """One more turn of every session, all served (a session whose pod is gone is restored on the way)."""
        served = self.workload.stats.served
        for sid in sessions:
            await self.bus.publish(self.turn(sid))
        await eventually(lambda: self.workload.stats.served >= served + len(sessions), timeout=timeout)

    def sessions_intact(self, sessions: list[str]) -> None:
        """Nothing lost, and every session's blocks as its conversation built them, wherever it lives now."""
        stats = self.workload.stats
        assert stats.lost == 0, stats
        for sid in sessions:
            assert verify_blocks(sid, self.workload.session_blocks(sid) or []), sid

    async def busiest_node(self) -> tuple[str, list[str]]:
        """The node whose sessions the registry counts most, and those sessions."""
        on = {
            n.name: [s.session_id for s in await self.checkpoint.registry.sessions_on_node(n.name)]
            for n in self.spec.nodes
        }
        node = max(on, key=lambda n: len(on[n]))
        return node, sorted(on[node])

    async def one_verdict_each(self, drain_ids: list[str]) -> None:
        """Every drain has a verdict in the stream, and only one: copies sent again (a redelivered request is
        answered with the recorded verdict) all say the same."""
        for drain_id in drain_ids:
            seen = await eventually(lambda d=drain_id: self.verdicts.get(d), timeout=30)
            kinds = {(type(v).__name__, v.node, v.sessions_committed) for v in seen}
            assert len(kinds) == 1, f"drain {drain_id}: verdicts disagree: {kinds}"

    async def upgraded(self, version: str) -> bool:
        """Every node done with the upgrade and its GPUs on ``version``."""
        nodes = await self.cluster.nodes()
        if not all(n.labels.get(UPGRADE_STATE_LABEL) == "upgrade-done" for n in nodes):
            return False
        return all([(await self.gpus(n.name).versions()).driver == version for n in nodes])

    async def check(self, *, min_checkpoints: int, drains: list[str] = ()) -> Findings:  # type: ignore[assignment]
        """The invariant checker over the fleet: ``min_checkpoints`` recorded checkpoints the scenario made at
        least, and every verdict the events stream holds checked against the recorded one."""
        seen = [v for each in self.verdicts.values() for v in each]
        found = await check_invariants(
            self.store, self.client, self.subjects, min_checkpoints=min_checkpoints, drains=drains, verdicts=seen
        )
        assert found, "\n".join(found.problems)
        return found


class HeldRegistry(SessionRegistry):
    """The registry whose first answer to ``where`` waits until ``release`` is set, once ``asked`` is."""

    def __init__(self, registry: SessionRegistry, asked: asyncio.Event, release: asyncio.Event) -> None:
        super().__init__(registry.client, registry.subjects)
        self.asked = asked
        self.release = release

    async def where(self, session_id: str) -> SessionLocation:
        if not self.asked.is_set():
            self.asked.set()
            await self.release.wait()
        return await super().where(session_id)


class HeldWhere(CheckpointService):
    """The checkpoint service, whose first answer to ``where`` waits until the test lets it go: the request is
    then surely in flight (asked, not answered) when the test strikes. Its queries read a ``HeldRegistry``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def start(self, ctx: ServiceContext) -> None:
        await super().start(ctx)
        self.queries.registry = HeldRegistry(self.registry, self.asked, self.release)


@contextlib.asynccontextmanager
async def fleet(
    settings: Settings, tmp_path: Path, spec: SimSpec = SPEC, *, drivers: bool = True, routers: int = 0
) -> AsyncIterator[Fleet]:
    """The fleet; with ``routers``, that many endpoint pickers (``services/router``, over the simulated cluster)
    and the workload's requests routed through them as a gateway routes (``shared.sim.gateway``)."""
    subjects = Subjects(settings.root)
    client = redis_client(settings.redis)
    bus = await Bus.connect(settings.nats, subjects, "test")
    await bus.ensure_streams()
    cluster = await SimCluster.create(client, subjects, spec)
    store = GatedStore(tmp_path / "checkpoints")
    checkpoint = HeldWhere(CheckpointSettings(gc_interval_s=0, drain_lease_s=2.0), store=store)
    checkpoint.release.set()  # answers at once unless a scenario holds it
    started: list[RunningService] = []
    workload_bus: Bus | None = None
    workload: SimWorkload | None = None
    mesh: MeshClient | None = None
    try:
        started.append(await start_service(checkpoint, settings, Wiring))
        pickers: list[tuple[RouterService, RunningService]] = []
        for _ in range(routers):
            router = RouterService(ROUTER_SETTINGS)
            pickers.append((router, await start_service(router, settings, Wiring)))
            started.append(pickers[-1][1])
        gateway = None
        if pickers:
            ports = [HostPort("127.0.0.1", router.port) for router, _ in pickers]
            gateway = GatewayRouting(GatewayClient(ports, timeout_s=15.0), "llm/llama")
        workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
        workload = SimWorkload(workload_bus, cluster, store, spec, announce_s=1.0, tick_s=0.1, gateway=gateway)
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == spec.deployments[0].replicas, timeout=30)
        mesh = await MeshClient.open(settings, {}, source="test-cli")
        f = Fleet(settings, subjects, spec, client, cluster, store, checkpoint, workload, bus, mesh)
        f.routers, f.running = pickers, started

        async def on_verdict(event: Verdict) -> None:
            seen = f.verdicts.setdefault(event.drain_id, [])
            if all(v.event_id != event.event_id for v in seen):
                seen.append(event)

        await consume(
            bus,
            ConsumerSpec(
                durable="t-fleet-verdicts",
                filter_subjects=(subjects.pattern("node.drain.completed"), subjects.pattern("node.drain.failed")),
                accepts=(DrainCompleted, DrainFailed),
                stream=subjects.events_stream,
            ),
            on_verdict,
        )
        if drivers:
            for node in spec.nodes:
                gpus = SimGpus(client, subjects, spec, node.name)
                service = DriverService(DRIVER_SETTINGS, cluster=SimCluster(client, subjects), gpu=gpus)
                f.drivers.append(await start_service(service, replace(settings, node=node.name), Wiring))
                started.append(f.drivers[-1])
        yield f
    finally:
        for running in reversed(started[1:]):
            await running.stop(grace=1)
        if workload is not None:
            await workload.stop()
        if workload_bus is not None:
            await workload_bus.close(1)
        if started:
            await started[0].stop(grace=1)
        if mesh is not None:
            await mesh.close()
        for stream in subjects.streams:
            with contextlib.suppress(Exception):
                await bus.js.delete_stream(stream.name)
        await bus.close(1)
        await cluster.close()
        keys = [k async for k in client.scan_iter(match=f"{subjects.root}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


__all__ = ["NEW_DRIVER", "NODES", "SPEC", "Fleet", "GatedStore", "HeldWhere", "fleet"]
