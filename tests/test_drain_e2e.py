"""The heart of the product, end to end on the simulated cluster: drain a node holding several pods and dozens
of sessions; every session is committed before any eviction; each is restored on another node and checked: with
the real tiny Llama (file store), continued beside a reference run that recomputes the conversation (the same
tokens, bit-identical logits); with synthetic blocks (object store), byte for byte against their content."""

from __future__ import annotations

from pathlib import Path

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.kv.filestore import FileStore
from shared.kv.store import CheckpointStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.ports.cluster import EvictionOutcome
from shared.sim.cluster import SimCluster
from shared.sim.spec import TINY_LLAMA, DeploymentSpec, ModelShape, NodeSpec, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.faults.checker import check_invariants
from tests.helpers import eventually

SMALL_MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16)  # 16 KiB synthetic blocks
SESSIONS = 32


def spec_for(model: ModelShape) -> SimSpec:
    return SimSpec(
        nodes=[NodeSpec(name=f"node-{i}") for i in (1, 2, 3)],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=4, max_unavailable=2, model=model)],
    )


async def run_drain_scenario(
    settings: Settings, subjects: Subjects, bus: Bus, store: CheckpointStore, model: ModelShape
) -> None:
    spec = spec_for(model)
    client = redis_client(settings.redis)
    cluster = await SimCluster.create(client, subjects, spec)
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    workload = SimWorkload(workload_bus, cluster, store, spec, announce_s=1.0, tick_s=0.1)
    verdicts: list[DrainCompleted | DrainFailed] = []

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        verdicts.append(event)

    try:
        await bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
        await bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == 4)
        for i in range(SESSIONS):
            await bus.publish(
                InferenceRequest(
                    namespace="llm",
                    deployment="llama",
                    session_id=f"chat-{i}",
                    prompt_tokens=40 + 7 * i,
                    max_new_tokens=30,
                )
            )
        await eventually(lambda: workload.stats.served >= SESSIONS, timeout=20)
        by_node: dict[str, list[str]] = {}
        for runtime in workload.runtimes.values():
            by_node.setdefault(runtime.info.node, []).extend(runtime.agent.sessions())
        node = max(by_node, key=lambda n: len(by_node[n]))
        moving = sorted(by_node[node])
        pods_on_node = sorted(r.info.name for r in workload.runtimes.values() if r.info.node == node)
        assert len(pods_on_node) >= 2 and len(moving) >= 12, (pods_on_node, len(moving))
        tokens = {sid: workload.runtimes[workload.home[sid]].agent.tokens(sid) for sid in moving}
        await eventually(lambda: _registered(service, node, len(moving)), timeout=10)

        await cluster.cordon(node)
        await bus.publish(DrainRequested(node=node, drain_id="upgrade-1", deadline_s=20))
        await eventually(lambda: verdicts, timeout=30)
        assert isinstance(verdicts[0], DrainCompleted), verdicts[0]
        assert verdicts[0].sessions_committed == len(moving)
        for sid in moving:  # every session committed before any eviction
            assert await service.registry.newest_checkpoint(sid) is not None, sid

        for pod in pods_on_node:
            assert await cluster.evict("llm", pod) is EvictionOutcome.EVICTED
        await eventually(
            lambda: all(r.info.node != node for r in workload.runtimes.values()) and len(workload.runtimes) == 4,
            timeout=20,
        )
        assert workload.stats.prestop_saves == len(pods_on_node)

        before = workload.stats.served
        for sid in moving:  # each session's next request lands on a pod elsewhere, which restores it first
            await bus.publish(
                InferenceRequest(namespace="llm", deployment="llama", session_id=sid, prompt_tokens=5, max_new_tokens=0)
            )
        await eventually(lambda: workload.stats.served >= before + len(moving), timeout=20)
        assert workload.stats.lost == 0 and workload.stats.restored == len(moving)
        assert workload.stats.restore_verified == len(moving), workload.status()["restore_checks"]
        for sid in moving:
            home = workload.runtimes[workload.home[sid]]
            assert home.info.node != node
            assert home.agent.tokens(sid) >= tokens[sid] + 5  # (a real model's pending reply token adds one)
            check = await workload.check_session(sid)
            assert check.verified is True, (sid, check.detail)
        found = await check_invariants(store, client, subjects, drains=["upgrade-1"], min_checkpoints=len(moving))
        assert found, found.problems
        assert found.recorded >= len(moving)
    finally:
        await workload.stop()
        await workload_bus.close(1)
        await running.stop(grace=1)
        await cluster.close()
        await client.aclose()


async def _registered(service: CheckpointService, node: str, count: int) -> bool:
    return len(await service.registry.sessions_on_node(node)) == count


async def test_drain_with_the_file_store(settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path) -> None:
    await run_drain_scenario(settings, subjects, bus, FileStore(tmp_path / "checkpoints"), TINY_LLAMA)


async def test_drain_with_the_nats_object_store(settings: Settings, subjects: Subjects, bus: Bus) -> None:
    from shared.kv.objstore import NatsObjectStore

    bucket = f"{subjects.root}-ckpt"
    try:
        await run_drain_scenario(settings, subjects, bus, NatsObjectStore(bus.nc, bucket), SMALL_MODEL)
    finally:
        await bus.js.delete_object_store(bucket)
