"""The services' messages sent again, byte for byte, at the worst moment (issue #30): once what they asked for is
over. tests/faults/test_replay.py does this for the pods', the CLI's and the checkpoint service's messages; here
the driver's rolling upgrade (its install, validate and version commands, its drain requests and queries, its
cordon and state events), the device service's inventory and cordon, the scaler's drains, rollouts and pod loads,
and the router's pod loads. Each is captured off the wire as the real service sent it, or built as its sender
builds it and passed through the codec, and heard again after the fact: it changes nothing.

The worst of them, before this test: the coordinator's install command heard again once the node was back in
service installed the driver again under its running pods (a driver install stops every GPU process: every KV
cache on the node lost), and one from an earlier upgrade put the older driver back."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from services.checkpoint.audit import RegistryAudit
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.device.service import DeviceService
from services.driver.config import DriverSettings
from services.driver.service import DriverService
from services.metrics.service import MetricsService
from services.router.picker import EndpointPicker
from services.scaler.gen import externalscaler_pb2 as pb
from services.scaler.gen import externalscaler_pb2_grpc as pb_grpc
from shared.contract.annotations import UPGRADE_STATE_LABEL
from shared.contract.configdocs import DriverPolicy
from shared.contract.device import DeviceInventory, GpuDevice
from shared.contract.load import PodLoad
from shared.contract.models import RolloutState
from shared.contract.node import DrainCompleted, DrainRequested, NodeCordoned, NodeUncordoned
from shared.contract.registry import codec
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.host.runner import RunningService, start_service
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.configsync import redis_client as open_redis
from shared.plumbing.settings import Settings
from shared.ports.cluster import PodInfo
from shared.sim.cluster import SimCluster
from shared.sim.gpus import SimGpus
from shared.sim.spec import DeploymentSpec, ModelShape, NodeSpec, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.faults.test_replay import Sent, Wire, kind_of, replay, source_of
from tests.helpers import eventually
from tests.scalerkit import DEP, NS, ref, serving_consumer, start_scaler, value

SMALL_MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16)
SPEC = SimSpec(
    nodes=[NodeSpec(name="node-1"), NodeSpec(name="node-2")],
    deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2, max_unavailable=1, model=SMALL_MODEL)],
)
NEW = "560.35.03"
DRIVER_SETTINGS = DriverSettings(reconcile_s=0.2, lease_ttl_s=5, agent_timeout_s=2)
DRIVER_KINDS = (
    "driver.install.command",
    "driver.validate.command",
    "driver.versions.command",
    "driver.upgrade.state",
    "driver.installed",
    "node.drain.requested",
    "node.drain.query",
)
"""What a driver upgrade sends (its cordons are writes to the cluster: the drain client's ``node.cordoned``, heard
again, is below)."""


class CountingGpus(SimGpus):
    """A node's simulated GPUs, counting the driver installs started on them."""

    installs = 0

    async def install_driver(self, version: str) -> None:
        self.installs += 1
        await super().install_driver(version)


async def consumers_idle(bus: Bus) -> bool:
    """Every durable consumer of the events stream has delivered and had acknowledged all it holds."""
    infos = await bus.js.consumers_info(bus.subjects.events_stream.name)
    return all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)


async def test_the_driver_upgrades_messages_heard_again_once_it_is_over_change_nothing(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A rolling upgrade of two nodes with live sessions (the driver service on each node, the checkpoint service,
    the simulated pods). Once both nodes are done, every message the driver services sent is sent again as it
    was (and each stored event once more without its message id): the nodes' upgrade labels, annotations and
    schedulability, their drivers, the drains' verdicts and the sessions' holders are as they were, and no
    driver is installed again."""
    cluster = await SimCluster.create(redis_client, subjects, SPEC)
    store = FileStore(tmp_path / "checkpoints")
    checkpoint = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running: list[RunningService] = [await start_service(checkpoint, settings, Wiring)]
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    workload = SimWorkload(workload_bus, cluster, store, SPEC, announce_s=1.0, tick_s=0.1)
    driver_client = open_redis(settings.redis)
    gpus = {n.name: CountingGpus(driver_client, subjects, SPEC, n.name) for n in SPEC.nodes}
    wire = Wire()
    sub = await bus.nc.subscribe(f"{subjects.root}.>", cb=wire.heard)
    sessions = [f"chat-{i}" for i in range(6)]
    try:
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == 2)
        for sid in sessions:
            await bus.publish(InferenceRequest(namespace="llm", deployment="llama", session_id=sid, prompt_tokens=40))
        await eventually(lambda: workload.stats.served >= len(sessions), timeout=20)

        async def registered() -> bool:
            return sum([len(await checkpoint.registry.sessions_on_node(n.name)) for n in SPEC.nodes]) == len(sessions)

        await eventually(registered, timeout=10)
        policy = DriverPolicy(desired_version=NEW, auto_upgrade=True, max_parallel_upgrades=1, drain_timeout_s=30)
        await ConfigStore(redis_client, subjects).write("driver", policy, 0, "test")
        for node in SPEC.nodes:
            service = DriverService(DRIVER_SETTINGS, cluster=SimCluster(driver_client, subjects), gpu=gpus[node.name])
            running.append(await start_service(service, replace(settings, node=node.name), Wiring))

        async def all_done() -> bool:
            nodes = await cluster.nodes()
            return all(n.labels.get(UPGRADE_STATE_LABEL) == "upgrade-done" and n.schedulable for n in nodes)

        await eventually(all_done, timeout=60, interval=0.1)
        await eventually(lambda: consumers_idle(bus), timeout=10)
        await sub.unsubscribe()
        from_driver = [s for s in wire.sent if source_of(s).startswith("driver/") or kind_of(s) in DRIVER_KINDS]
        kinds = {kind_of(s) for s in from_driver}
        assert set(DRIVER_KINDS) <= kinds, f"the upgrade sent no {sorted(set(DRIVER_KINDS) - kinds)}"
        drains = sorted({codec.decode(s.data).drain_id for s in from_driver if kind_of(s) == "node.drain.requested"})
        assert len(drains) == 2

        async def state() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for node in await cluster.nodes():
                versions = await gpus[node.name].versions()
                out[node.name] = (node.labels, node.annotations, node.schedulable, versions.driver)
            for drain_id in drains:
                out[drain_id] = await checkpoint.leases.drain_verdict(drain_id)
            for sid in sessions:
                place = await RegistryAudit(redis_client, subjects).session_record(sid)
                out[sid] = (place.pod, place.generation) if place else None
            return out

        before = await state()
        assert all(before[n.name][3] == NEW for n in SPEC.nodes)
        installs = {n: g.installs for n, g in gpus.items()}
        assert installs == {"node-1": 1, "node-2": 1}
        answers = await replay(only(from_driver), lambda _: bus.nc)
        assert "driver.agent.answer" in answers  # the agents that ran the installs answer them from memory
        await eventually(lambda: consumers_idle(bus), timeout=10)
        assert {n: g.installs for n, g in gpus.items()} == installs
        assert await state() == before

        # the driver services restarted (the agents' memory gone), the same messages once more
        for service in running[1:]:
            await service.stop(grace=1)
        del running[1:]
        for node in SPEC.nodes:
            service = DriverService(DRIVER_SETTINGS, cluster=SimCluster(driver_client, subjects), gpu=gpus[node.name])
            running.append(await start_service(service, replace(settings, node=node.name), Wiring))
        answers = await replay(only(from_driver), lambda _: bus.nc)
        commands = [s for s in from_driver if kind_of(s) == "driver.install.command"]
        assert answers.count("deadletter") == len(commands) > 0, answers  # each refused, with the reason
        await eventually(lambda: consumers_idle(bus), timeout=10)
        assert {n: g.installs for n, g in gpus.items()} == installs
        assert await state() == before
    finally:
        for service in reversed(running):
            await service.stop(grace=1)
        await workload.stop()
        await workload_bus.close(grace=0.5)
        await driver_client.aclose()
        await cluster.close()


def only(sent: list[Sent]) -> Wire:
    """A wire holding only ``sent``, in the order it was heard."""
    chosen = Wire()
    chosen.sent = list(sent)
    return chosen


async def test_the_scaler_holds_nothing_for_a_drain_or_rollout_heard_again_after_it_ended(
    settings: Settings, bus: Bus
) -> None:
    """A drain's request and a rollout's ``preparing``, heard again after the drain's verdict and the rollout's
    switch (without their message ids: past the stream's duplicate window), hold no replicas; a pod's older
    load report heard after a newer one changes neither its load nor how fresh it reads."""
    service, running, placement, _ = await start_scaler(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        placement.pods[(NS, DEP)] = {"node-1": 2, "node-2": 1}
        await serving_consumer(bus)
        so = ref(queueDepthPerReplica="4", stabilisationWindow="0")
        await bus.publish_many([InferenceRequest(namespace=NS, deployment=DEP, session_id=f"s{i}") for i in range(4)])
        await eventually(lambda: _is(stub, so, 1.0), timeout=5)
        wire = Wire()
        sub = await bus.nc.subscribe(f"{bus.subjects.root}.>", cb=wire.heard)
        await bus.publish(DrainRequested(node="node-1", drain_id="d1"))
        await eventually(lambda: _is(stub, so, 3.0), timeout=5)
        await bus.publish(DrainCompleted(node="node-1", drain_id="d1"))
        await eventually(lambda: _is(stub, so, 1.0), timeout=5)
        await bus.publish(RolloutState(namespace=NS, deployment=DEP, rollout_id="r1", phase="preparing"))
        await eventually(lambda: _is(stub, so, 3.0), timeout=5)
        await bus.publish(RolloutState(namespace=NS, deployment=DEP, rollout_id="r1", phase="switched"))
        await eventually(lambda: _is(stub, so, 1.0), timeout=5)
        await sub.unsubscribe()
        assert {kind_of(s) for s in wire.sent} >= {"node.drain.requested", "node.drain.completed", "kv.rollout.state"}

        await replay(wire, lambda _: bus.nc)
        # what comes after the replays in the same streams, through the same consumers: once it is heard, so
        # were they. node-2's drain adds its one pod; a rollout of another deployment holds only that one.
        await bus.publish(DrainRequested(node="node-2", drain_id="d2"))
        await bus.publish(RolloutState(namespace=NS, deployment="other", rollout_id="r2", phase="preparing"))
        await eventually(lambda: running.ctx.status["drains_in_flight"] == {"d2": "node-2"}, timeout=5)
        await eventually(lambda: running.ctx.health()["rollouts_preparing"] == {f"{NS}/other": "r2"}, timeout=5)
        assert await value(stub, so) == 2.0  # 1 + node-2's pod: no hold of d1's or r1's

        core = service.core
        newer, older = _loads(used=(10, 90))
        await core.on_load(codec.decode(codec.encode(newer)))
        kept = core.loads[(NS, DEP)]["chat-a"]
        await core.on_load(codec.decode(codec.encode(older)))  # sent before, heard after
        await core.on_load(codec.decode(codec.encode(newer)))  # heard twice
        assert core.loads[(NS, DEP)]["chat-a"] == kept and kept.blocks_used == 10
    finally:
        await channel.close()
        await running.stop(grace=1)


async def _is(stub: pb_grpc.ExternalScalerStub, so: pb.ScaledObjectRef, expected: float) -> bool:
    return await value(stub, so) == expected


def _loads(used: tuple[int, int]) -> tuple[PodLoad, PodLoad]:
    """Two load reports of pod chat-a: the newer one (``used[0]`` blocks), and one it sent a second before."""
    now = dt.datetime.now(dt.UTC)
    newer = PodLoad(
        pod="chat-a", namespace=NS, deployment=DEP, blocks_used=used[0], blocks_total=100, window_s=5, occurred_at=now
    )
    older = PodLoad(
        pod="chat-a",
        namespace=NS,
        deployment=DEP,
        blocks_used=used[1],
        blocks_total=100,
        window_s=5,
        occurred_at=now - dt.timedelta(seconds=1),
    )
    return newer, older


def test_the_router_keeps_a_pods_newer_load_over_an_older_report_heard_after_it() -> None:
    picker = EndpointPicker(NS, DEP)
    picker.set_pods(
        [PodInfo(name="chat-a", namespace=NS, node="n", deployment=DEP, phase="Running", uid="a", ip="10.0.0.1")]
    )
    newer, older = _loads(used=(10, 90))
    picker.on_load(codec.decode(codec.encode(newer)), 100.0)
    picker.on_load(codec.decode(codec.encode(older)), 101.0)
    picker.on_load(codec.decode(codec.encode(newer)), 102.0)
    pod = picker.pods["chat-a"]
    assert (pod.blocks_used, pod.load_at) == (10, 100.0)  # neither the older load nor a fresher stamp


async def test_an_older_inventory_and_a_cordon_heard_again_change_nothing(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    """The metrics service keeps a node's newest GPU list over an older one heard after it (a replay from before
    a MIG change); the device service's cordon state follows the node, not a cordon event heard again after the
    node was uncordoned."""
    metrics = MetricsService()
    now = dt.datetime.now(dt.UTC)
    before_mig = DeviceInventory(node="node-1", gpus=[GpuDevice(uuid="GPU-1", index=0, model="H100")], occurred_at=now)
    after_mig = DeviceInventory(
        node="node-1",
        gpus=[GpuDevice(uuid="MIG-1a", index=0, model="H100"), GpuDevice(uuid="MIG-1b", index=1, model="H100")],
        occurred_at=now + dt.timedelta(seconds=5),
    )
    await metrics.on_inventory(codec.decode(codec.encode(before_mig)))
    await metrics.on_inventory(codec.decode(codec.encode(after_mig)))
    await metrics.on_inventory(codec.decode(codec.encode(before_mig)))
    assert metrics.gpus == {"node-1": ["MIG-1a", "MIG-1b"]}

    cluster = await SimCluster.create(redis_client, subjects, SPEC)
    try:
        device = DeviceService(cluster=cluster)
        cordoned = NodeCordoned(node="node-1")
        await cluster.cordon("node-1")
        await device.on_cordon(codec.decode(codec.encode(cordoned)))
        assert device.cordoned
        await cluster.uncordon("node-1")
        await device.on_cordon(codec.decode(codec.encode(NodeUncordoned(node="node-1"))))
        await device.on_cordon(codec.decode(codec.encode(cordoned)))  # heard again once the node is back
        assert not device.cordoned
    finally:
        await cluster.close()
