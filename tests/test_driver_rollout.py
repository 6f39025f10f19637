"""Done means: a rolling driver upgrade of three nodes with live sessions on the simulated cluster, the driver
service (one per node, as the DaemonSet runs it: each answers for its own node's simulated GPUs, and whichever
leads coordinates, commanding the others over NATS) and the checkpoint service in-process. Every node goes
through the states in order, one at a time; no pod is evicted before its sessions are committed; every session is
restored elsewhere and verified; every node ends uncordoned on the new version."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import redis.asyncio as aioredis

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.driver.config import DriverSettings
from services.driver.service import DriverService
from services.driver.upgrade import ORDER
from shared.contract.annotations import UPGRADE_STATE_LABEL
from shared.contract.configdocs import DriverPolicy
from shared.contract.driver import DriverUpgradeStateChanged
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.host.runner import RunningService, start_service
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.configsync import redis_client as open_redis
from shared.plumbing.settings import Settings
from shared.ports.cluster import EvictionOutcome
from shared.sim.cluster import SimCluster
from shared.sim.engines import verify_blocks
from shared.sim.gpus import SimGpus
from shared.sim.spec import DeploymentSpec, ModelShape, NodeSpec, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.helpers import eventually

SMALL_MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16)
SPEC = SimSpec(
    nodes=[NodeSpec(name=f"node-{i}") for i in (1, 2, 3)],
    deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=4, max_unavailable=2, model=SMALL_MODEL)],
)
SESSIONS = 24
NEW = "560.35.03"
DRIVER_SETTINGS = DriverSettings(reconcile_s=0.2, lease_ttl_s=5, agent_timeout_s=2)


class CheckedCluster(SimCluster):
    """The cluster the driver service sees: before each eviction, every session the pod holds must already have a
    committed checkpoint in the registry."""

    workload: SimWorkload
    checkpoint: CheckpointService
    unsaved: list[str]

    async def evict(self, namespace: str, pod: str) -> EvictionOutcome:
        runtime = self.workload.runtimes.get(pod)
        for sid in runtime.agent.sessions() if runtime else []:
            if await self.checkpoint.registry.newest_checkpoint(sid) is None:
                self.unsaved.append(sid)
        return await super().evict(namespace, pod)


async def test_three_nodes_upgrade_one_at_a_time_and_lose_no_session(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    client = redis_client
    cluster = await SimCluster.create(client, subjects, SPEC)
    store = FileStore(tmp_path / "checkpoints")
    checkpoint = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(checkpoint, settings, Wiring)
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    workload = SimWorkload(workload_bus, cluster, store, SPEC, announce_s=1.0, tick_s=0.1)
    changes: list[DriverUpgradeStateChanged] = []

    async def on_change(event: DriverUpgradeStateChanged) -> None:
        changes.append(event)

    driver_client = open_redis(settings.redis)
    seen = CheckedCluster(driver_client, subjects)
    seen.workload, seen.checkpoint, seen.unsaved = workload, checkpoint, []

    def gpus(node: str) -> SimGpus:
        return SimGpus(driver_client, subjects, SPEC, node)

    drivers: list[RunningService] = []
    try:
        await bus.subscribe(subjects.pattern("driver.upgrade.state"), on_change, (DriverUpgradeStateChanged,))
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == 4)
        for i in range(SESSIONS):
            await bus.publish(
                InferenceRequest(namespace="llm", deployment="llama", session_id=f"chat-{i}", prompt_tokens=40 + 7 * i)
            )
        await eventually(lambda: workload.stats.served >= SESSIONS, timeout=20)
        tokens = {
            f"chat-{i}": workload.runtimes[workload.home[f"chat-{i}"]].agent.tokens(f"chat-{i}")
            for i in range(SESSIONS)
        }

        async def registered() -> bool:
            nodes = [n.name for n in SPEC.nodes]
            return sum([len(await checkpoint.registry.sessions_on_node(n)) for n in nodes]) == SESSIONS

        await eventually(registered, timeout=10)

        policy = DriverPolicy(
            desired_version=NEW, auto_upgrade=True, max_parallel_upgrades=1, max_unavailable="1", drain_timeout_s=30
        )
        await ConfigStore(client, subjects).write("driver", policy, 0, "test")
        for node in SPEC.nodes:
            driver = DriverService(DRIVER_SETTINGS, cluster=seen, gpu=gpus(node.name))
            drivers.append(await start_service(driver, replace(settings, node=node.name), Wiring))

        async def all_done() -> bool:
            nodes = await cluster.nodes()
            return all(n.labels.get(UPGRADE_STATE_LABEL) == "upgrade-done" and n.schedulable for n in nodes)

        await eventually(all_done, timeout=45, interval=0.1)
        for node in SPEC.nodes:
            assert [c.state for c in changes if c.node == node.name] == list(ORDER), node.name
            assert (await gpus(node.name).versions()).driver == NEW
        # one node at a time: each node is done before the next one takes the slot
        started = [c.node for c in changes if c.state == "cordon-required"]
        finished = [c.node for c in changes if c.state == "upgrade-done"]
        assert started == finished
        order = [(c.node, c.state) for c in changes]
        for first, second in itertools.pairwise(started):
            assert order.index((first, "upgrade-done")) < order.index((second, "cordon-required"))
        assert seen.unsaved == [], "a pod was evicted before its sessions were committed"

        before = workload.stats.served
        for i in range(SESSIONS):
            await bus.publish(
                InferenceRequest(
                    namespace="llm", deployment="llama", session_id=f"chat-{i}", prompt_tokens=5, max_new_tokens=0
                )
            )
        await eventually(lambda: workload.stats.served >= before + SESSIONS, timeout=20)
        assert workload.stats.lost == 0 and workload.stats.restored == SESSIONS
        for sid, count in tokens.items():
            home = workload.runtimes[workload.home[sid]]
            assert home.agent.tokens(sid) == count + 5
            assert verify_blocks(sid, workload.session_blocks(sid) or []), sid
        leaders = [d for d in drivers if d.ctx.health()["upgrade"]["leader"]]
        assert len(leaders) == 1, "one coordinator at a time"
    finally:
        for running_driver in drivers:
            await running_driver.stop(grace=1)
        await workload.stop()
        await workload_bus.close(1)
        await running.stop(grace=1)
        await cluster.close()
        await driver_client.aclose()


async def test_a_node_cordoned_by_someone_else_gets_its_sessions_saved(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """No upgrade at all: an admin (or the cluster autoscaler) cordons node-1; the driver asks for a drain so the
    sessions there are committed before anything evicts them, and leaves the cordon alone."""
    from shared.contract.node import DrainCompleted, DrainRequested

    cluster = await SimCluster.create(redis_client, subjects, SPEC)
    store = FileStore(tmp_path / "checkpoints")
    checkpoint = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(checkpoint, settings, Wiring)
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    workload = SimWorkload(workload_bus, cluster, store, SPEC, announce_s=1.0, tick_s=0.1)
    driver_client = open_redis(settings.redis)
    requested: list[DrainRequested] = []
    completed: list[DrainCompleted] = []

    async def on_requested(event: DrainRequested) -> None:
        requested.append(event)

    async def on_completed(event: DrainCompleted) -> None:
        completed.append(event)

    driver_running = None
    try:
        await bus.subscribe(subjects.pattern("node.drain.requested"), on_requested, (DrainRequested,))
        await bus.subscribe(subjects.pattern("node.drain.completed"), on_completed, (DrainCompleted,))
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == 4)
        for i in range(12):
            await bus.publish(
                InferenceRequest(namespace="llm", deployment="llama", session_id=f"c-{i}", prompt_tokens=30)
            )
        await eventually(lambda: workload.stats.served >= 12, timeout=20)
        on_node = sorted(s for r in workload.runtimes.values() if r.info.node == "node-1" for s in r.agent.sessions())
        assert on_node
        await eventually(lambda: _registered(checkpoint, "node-1", len(on_node)), timeout=10)

        driver = DriverService(
            DRIVER_SETTINGS,
            cluster=SimCluster(driver_client, subjects),
            gpu=SimGpus(driver_client, subjects, SPEC, "node-1"),
        )
        driver_running = await start_service(driver, settings, Wiring)
        await cluster.cordon("node-1")
        await eventually(lambda: any(c.node == "node-1" for c in completed), timeout=20)
        assert [r.node for r in requested] == ["node-1"]
        for sid in on_node:
            assert await checkpoint.registry.newest_checkpoint(sid) is not None, sid
        node = await cluster.node("node-1")
        assert node is not None and not node.schedulable  # someone else's cordon stays
    finally:
        if driver_running is not None:
            await driver_running.stop(grace=1)
        await workload.stop()
        await workload_bus.close(1)
        await running.stop(grace=1)
        await cluster.close()
        await driver_client.aclose()


async def _registered(checkpoint: CheckpointService, node: str, count: int) -> bool:
    return len(await checkpoint.registry.sessions_on_node(node)) == count
