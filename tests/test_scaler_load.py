"""The scaler on the signals inference needs, end to end: pods report their KV pool and time to first token
(``kv.pod.load`` over real NATS), the scaler aggregates them per deployment, KEDA's ``GetMetrics`` (real gRPC)
answers from them, and ``gpuwarden status`` says which signal set the count.

The simulated workload serves real requests from its JetStream queue with a KV block pool per pod (the checkpoint
service hands out its sessions, as in the mesh), and reports its load through ``shared.kv.load.LoadReporter`` as
an inference server would. Where the pods run is read from the simulated cluster through the scaler's own
placement adapter. GPU utilisation is published as the metrics service would for a memory-bound deployment whose
GPUs look idle (15 %): alone it asks for one replica throughout, so the count that moves up and down with the load
can only come from KV-cache pressure.
"""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.scaler.adapters import ClusterPlacement
from services.scaler.config import ScalerSettings
from services.scaler.gen import externalscaler_pb2 as pb
from services.scaler.gen import externalscaler_pb2_grpc as pb_grpc
from services.scaler.service import ScalerService
from shared.console.client import MeshClient
from shared.console.render import status_tables
from shared.console.snapshot import take
from shared.contract.load import PodLoad
from shared.contract.metrics import DeploymentUtilisation
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.requests import InferenceRequest
from shared.contract.scaler import ScaleDecision
from shared.contract.subjects import Subjects
from shared.host.runner import RunningService, start_service
from shared.kv.filestore import FileStore
from shared.kv.load import LoadReporter
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import HostPort, Settings
from shared.sim.cluster import SimCluster
from shared.sim.gauges import WorkloadCollector
from shared.sim.spec import DeploymentSpec, ModelShape, NodeSpec, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.helpers import eventually

NS, DEP = "llm", "chat"
MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16, max_model_len=512)  # 16 KiB blocks
POOL_BLOCKS = 40  # per pod; a 200-token prompt holds 13 of them


@dataclass
class Scaler:
    service: ScalerService
    running: RunningService
    stub: pb_grpc.ExternalScalerStub
    decisions: list[ScaleDecision]


@pytest.fixture
async def scaler_on(settings: Settings, bus: Bus) -> AsyncIterator[Scaler]:
    """A scaler reading placement from the simulated cluster (set by the test through ``placement``)."""
    placement = _DeferredPlacement()
    service = ScalerService(ScalerSettings(listen=HostPort("127.0.0.1", 0), refresh_s=0.1), placement=placement)
    running = await start_service(service, settings, Wiring)
    decisions: list[ScaleDecision] = []

    async def on_decision(event: ScaleDecision) -> None:
        decisions.append(event)

    await bus.subscribe(bus.subjects.pattern("scaler.decision"), on_decision, accepts=(ScaleDecision,))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    scaler = Scaler(service, running, pb_grpc.ExternalScalerStub(channel), decisions)
    scaler.placement = placement  # type: ignore[attr-defined]
    yield scaler
    await channel.close()
    await running.stop(grace=1)


class _DeferredPlacement:
    """The scaler's ``Placement`` port over the simulated cluster, once the test has made it."""

    def __init__(self) -> None:
        self.inner: ClusterPlacement | None = None

    async def pods_by_node(self, namespace: str, deployment: str) -> dict[str, int]:
        if self.inner is None:
            raise RuntimeError("no cluster yet")
        return dict(await self.inner.pods_by_node(namespace, deployment))


def so(**metadata: str) -> pb.ScaledObjectRef:
    meta = {"scalerAddress": "gpuwarden-scaler:9090", "deployment": DEP, "namespace": NS, **metadata}
    return pb.ScaledObjectRef(name="chat", namespace=NS, scalerMetadata=meta)


async def replicas(stub: pb_grpc.ExternalScalerStub, ref: pb.ScaledObjectRef) -> int:
    reply = await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName="s0-gpuwarden-llm-chat"))
    return int(reply.metricValues[0].metricValueFloat)


def idle_looking_gpus() -> DeploymentUtilisation:
    return DeploymentUtilisation(
        namespace=NS, deployment=DEP, window_s=30, mean_util=15, max_util=20, gpus=2, sampled_at=dt.datetime.now(dt.UTC)
    )


async def test_the_count_follows_kv_pressure_of_the_simulated_pods_where_gpu_utilisation_would_not(
    settings: Settings, subjects: Subjects, bus: Bus, scaler_on: Scaler, tmp_path: Path
) -> None:
    spec = SimSpec(
        nodes=[NodeSpec(name=f"node-{i}") for i in (1, 2)],
        deployments=[DeploymentSpec(name=DEP, namespace=NS, replicas=2, kv_blocks=POOL_BLOCKS, model=MODEL)],
    )
    client = redis_client(settings.redis)
    cluster = await SimCluster.create(client, subjects, spec)
    scaler_on.placement.inner = ClusterPlacement(cluster)  # type: ignore[attr-defined]
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    store = FileStore(tmp_path / "checkpoints")
    checkpoint = await start_service(
        CheckpointService(CheckpointSettings(gc_interval_s=0), store=store), settings, Wiring
    )
    workload = SimWorkload(workload_bus, cluster, store, spec, announce_s=1.0, load_interval_s=0.2, tick_s=0.1)
    heard: list[PodLoad] = []

    async def on_load(event: PodLoad) -> None:
        heard.append(event)

    ref = so(
        queueDepthPerReplica="50",
        gpuUtilTarget="70",
        kvCacheUtilTarget="60",
        maxReplicas="10",
        stabilisationWindow="0s",
        loadStaleAfter="2s",
    )
    try:
        await bus.subscribe(subjects.pattern("kv.pod.load"), on_load, accepts=(PodLoad,))
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == 2, timeout=20)
        await bus.publish(idle_looking_gpus())

        async def calm() -> bool:  # both pods report an empty pool: one replica (GPU and KV alike)
            n = await replicas(scaler_on.stub, ref)
            state = scaler_on.running.ctx.health()["scaled_objects"]["llm/chat"]
            return n == 1 and "kv" in state["signal_replicas"] and {e.pod for e in heard} == set(workload.runtimes)

        await eventually(calm, timeout=20)
        assert all(e.blocks_total == POOL_BLOCKS and e.node for e in heard)

        for rounds in range(2):  # load up, then down, twice
            sessions = [f"chat-{rounds}-{i}" for i in range(10)]
            await bus.publish(idle_looking_gpus())
            for sid in sessions:  # 10 long prompts: 130 blocks wanted of the 80 the two pools hold
                await bus.publish(
                    InferenceRequest(namespace=NS, deployment=DEP, session_id=sid, prompt_tokens=200, max_new_tokens=8)
                )

            async def pressed() -> bool:
                return await replicas(scaler_on.stub, ref) >= 3

            await eventually(pressed, timeout=30)

            def kv_decisions() -> list[ScaleDecision]:  # the decision event follows the answer over the bus
                return [d for d in scaler_on.decisions if d.desired_replicas >= 3 and d.signal == "kv"]

            await eventually(lambda: bool(kv_decisions()), timeout=10)
            kv = kv_decisions()
            assert kv[-1].signal_replicas["gpu"] == 1  # GPU utilisation alone: one replica
            assert kv[-1].kv_cache_util is not None and kv[-1].kv_cache_util >= 0.6
            assert any(e.ttft_p90_s is not None and e.requests > 0 for e in heard)  # first tokens were measured
            if rounds == 0:  # the simulation's /metrics shows the pools as full; `gpuwarden status` names the signal
                exported = CollectorRegistry()
                exported.register(WorkloadCollector(workload))
                for name, runtime in workload.runtimes.items():
                    where = {"pod": name, "node": runtime.info.node}
                    assert exported.get_sample_value("gpuwarden_sim_kv_pool_blocks", where) == POOL_BLOCKS
                    assert exported.get_sample_value("gpuwarden_sim_kv_used_blocks", where) == runtime.pool.used > 0
                shown = await take(MeshClient(settings, bus, client, cluster))
                assert [(d.name, d.scaler_signal) for d in shown.deployments] == [(DEP, "kv")], shown.deployments
                out = io.StringIO()
                Console(file=out, width=250).print(status_tables(shown))
                assert "by kv: max(queue" in out.getvalue(), out.getvalue()

            for sid in sessions:  # every conversation closes: the pools empty
                await bus.publish(InferenceRequest(namespace=NS, deployment=DEP, session_id=sid))

            async def relieved() -> bool:
                return await replicas(scaler_on.stub, ref) == 1

            await eventually(relieved, timeout=30)
            last = scaler_on.running.ctx.health()["scaled_objects"]["llm/chat"]
            assert last["signal"] != "kv" and last["signal_replicas"]["kv"] <= 1, last
    finally:
        await workload.stop()
        await workload_bus.close(1)
        await checkpoint.stop(grace=1)
        await cluster.close()
        await client.aclose()


async def test_ttft_reports_from_a_load_reporter_set_the_count_and_silence_is_missing(
    bus: Bus, scaler_on: Scaler
) -> None:
    """A server's ``LoadReporter`` per pod: slow first tokens scale the deployment; reports that stop are
    missing (held, never read as an idle 0)."""
    pools = {"chat-a": (10, 100), "chat-b": (20, 100)}
    reporters = [
        LoadReporter(bus.publish, lambda p=pod: pools[p], pod=pod, node="node-1", namespace=NS, deployment=DEP)
        for pod in pools
    ]
    ref = so(queueDepthPerReplica="50", ttftP90TargetMs="400", kvCacheUtilTarget="80", loadStaleAfter="1s")
    for reporter, slow in zip(reporters, (0.3, 1.0), strict=True):
        for i in range(20):
            reporter.first_token(slow if i % 10 in (0, 1) else 0.05)  # p90 (nearest rank) of 20: the 18th
        await reporter.send()

    async def by_ttft() -> bool:  # 2 pods reporting x 1000 ms / 400 ms -> 5
        return await replicas(scaler_on.stub, ref) == 5

    await eventually(by_ttft, timeout=10)
    state = scaler_on.running.ctx.health()["scaled_objects"]["llm/chat"]
    assert state["signal"] == "ttft" and (state["signal_replicas"]["kv"], state["signal_replicas"]["ttft"]) == (1, 5)
    decision = await eventually(lambda: [d for d in scaler_on.decisions if d.signal == "ttft"], timeout=5)
    assert decision[-1].ttft_p90_s == 1.0 and decision[-1].kv_cache_util == pytest.approx(0.15)
    metric = scaler_on.running.ctx.telemetry.registry.get_sample_value  # what /metrics says
    labels = {"namespace": NS, "scaled_object": "chat", "deployment": DEP}
    assert metric("gpuwarden_scaler_desired_replicas", labels) == 5.0
    assert metric("gpuwarden_scaler_ttft_p90_seconds", labels) == 1.0
    assert metric("gpuwarden_scaler_kv_cache_utilisation_ratio", labels) == pytest.approx(0.15)
    assert metric("gpuwarden_scaler_decision_signal", {**labels, "signal": "ttft"}) == 1.0
    assert metric("gpuwarden_scaler_signal_replicas", {**labels, "signal": "kv"}) == 1.0
    assert metric("gpuwarden_scaler_gpu_utilisation_ratio", labels) is None  # no utilisation heard: no sample, no 0
    assert metric("gpuwarden_scaler_load_reports_total") == 2.0

    async def held() -> bool:  # nobody reports any more: the load goes missing, the count is held
        state = scaler_on.running.ctx.health()["scaled_objects"]["llm/chat"]
        return state["signal"] == "held" and await replicas(scaler_on.stub, ref) == 5

    await eventually(held, timeout=10)
    assert metric("gpuwarden_scaler_input_stale", {**labels, "input": "load"}) == 1.0
    assert metric("gpuwarden_scaler_kv_cache_utilisation_ratio", labels) is None  # missing again, never 0


async def test_a_drain_without_a_verdict_is_exported_with_its_deadline_until_the_verdict(
    bus: Bus, scaler_on: Scaler
) -> None:
    metric = scaler_on.running.ctx.telemetry.registry.get_sample_value
    asked = DrainRequested(node="node-2", drain_id="d-7", deadline_s=30, grace_period_s=40)
    await bus.publish(asked)
    due = asked.occurred_at.timestamp() + 30
    labels = {"node": "node-2", "drain_id": "d-7"}
    await eventually(lambda: metric("gpuwarden_drain_deadline_timestamp_seconds", labels) == pytest.approx(due))
    await bus.publish(DrainCompleted(node="node-2", drain_id="d-7"))
    await eventually(lambda: metric("gpuwarden_drain_deadline_timestamp_seconds", labels) is None)
