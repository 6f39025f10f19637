"""Which pods hold a GPU: the kubelet's PodResources API over real gRPC on a temp unix socket (a test plays the
kubelet), the simulated cluster's GPU assignment, the device service naming the pods when a GPU fails, and the
checkpoint service saving those pods' sessions."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.device.config import DeviceSettings, load
from services.device.gen import podresources_pb2 as pb
from services.device.gen import podresources_pb2_grpc as pb_grpc
from services.device.podresources import PodResourcesClient, holds
from services.device.ports import GpuPods, PodLookupError
from services.device.service import DeviceService
from shared.contract.checkpoint import CheckpointSaved
from shared.contract.device import DeviceHealthChanged, GpuDevice, MigInstance
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.clusterstate import ClusterState, from_spec
from shared.sim.faults import XidFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.lookups import SimGpuPods
from shared.sim.spec import DeploymentSpec, GpuSpec, NodeSpec, SimSpec, default_spec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content
from tools import protogen

MIG_A = [MigInstance(uuid="MIG-a0", profile="1g.10gb"), MigInstance(uuid="MIG-a1", profile="1g.10gb")]
GPU_A = GpuDevice(index=0, uuid="GPU-aaaa", model="NVIDIA A100", mig_enabled=True, mig_instances=MIG_A)
GPU_B = GpuDevice(index=1, uuid="GPU-bbbb", model="NVIDIA A100")


# -- the rule ------------------------------------------------------------------------------------------------------
def test_device_ids_that_are_the_gpu() -> None:
    assert holds("GPU-aaaa", GPU_A)
    assert holds("GPU-aaaa::3", GPU_A), "a time-slice"
    assert holds("MIG-a1", GPU_A) and holds("MIG-a0::1", GPU_A), "a MIG instance, whole or time-sliced"
    assert not holds("GPU-aaaab", GPU_A) and not holds("GPU-aaa", GPU_A)
    assert not holds("MIG-a1", GPU_B) and not holds("0", GPU_A)


def test_committed_stubs_do_not_drift_from_either_proto() -> None:
    assert protogen.POD_RESOURCES.drift() == [], "run: python -m tools.protogen"
    assert protogen.drift() == []


# -- the kubelet's side --------------------------------------------------------------------------------------------
def pod(namespace: str, name: str, *containers: list[tuple[str, list[str]]]) -> pb.PodResources:
    return pb.PodResources(
        name=name,
        namespace=namespace,
        containers=[
            pb.ContainerResources(
                name=f"c{i}",
                devices=[
                    pb.ContainerDevices(
                        resource_name=resource,
                        device_ids=ids,
                        topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=0)]),
                    )
                    for resource, ids in devices
                ],
                cpu_ids=[2, 3],
            )
            for i, devices in enumerate(containers)
        ],
    )


class FakeKubelet(pb_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources service on a unix socket; ``refuse`` makes it answer with that status."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.pods: list[pb.PodResources] = []
        self.refuse: grpc.StatusCode | None = None
        self.calls = 0
        self.server = grpc.aio.server()
        pb_grpc.add_PodResourcesListerServicer_to_server(self, self.server)

    async def List(
        self, request: pb.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPodResourcesResponse:
        self.calls += 1
        if self.refuse is not None:
            await context.abort(self.refuse, "the kubelet is unwell")
        return pb.ListPodResourcesResponse(pod_resources=self.pods)

    async def start(self) -> None:
        assert self.server.add_insecure_port(f"unix://{self.socket}") != 0
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)


@pytest.fixture
def folder() -> Iterator[Path]:
    """Short on purpose: a unix socket path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gw-pr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(folder: Path) -> AsyncIterator[FakeKubelet]:
    fake = FakeKubelet(folder / "kubelet.sock")
    fake.pods = [
        pod("llm", "whole", [("nvidia.com/gpu", ["GPU-aaaa"])]),
        pod("llm", "sliced", [("nvidia.com/gpu", ["GPU-bbbb::0"])], [("nvidia.com/gpu", ["GPU-aaaa::1"])]),
        pod("llm", "mig", [("nvidia.com/mig-1g.10gb", ["MIG-a1"])]),
        pod("web", "cpu-only", [("example.com/foo", ["GPU-aaaa-not"])], []),
        pod("llm", "other-gpu", [("nvidia.com/gpu", ["GPU-bbbb"])]),
    ]
    await fake.start()
    yield fake
    await fake.stop()


async def test_client_names_the_pods_holding_a_gpu(kubelet: FakeKubelet) -> None:
    client = PodResourcesClient(kubelet.socket)
    assert isinstance(client, GpuPods) and client.simulated is False
    assert await client.pods_using(GPU_A) == ["llm/mig", "llm/sliced", "llm/whole"]
    assert await client.pods_using(GPU_B) == ["llm/other-gpu", "llm/sliced"]
    assert await client.pods_using(GpuDevice(index=2, uuid="GPU-cccc", model="x")) == []
    assert kubelet.calls == 3
    await client.close()


async def test_a_kubelet_that_refuses_is_a_clear_error(kubelet: FakeKubelet) -> None:
    kubelet.refuse = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(PodLookupError, match=rf"PodResources API at {kubelet.socket}: UNAVAILABLE: the kubelet is"):
        await PodResourcesClient(kubelet.socket).pods_using(GPU_A)


async def test_no_socket_is_a_clear_error(folder: Path) -> None:
    with pytest.raises(PodLookupError, match=r"no kubelet PodResources socket at .*missing\.sock"):
        await PodResourcesClient(folder / "missing.sock").pods_using(GPU_A)


async def test_a_silent_socket_is_an_error_not_a_hang(folder: Path) -> None:
    """A socket file nobody serves (a kubelet that died): refused, within the timeout."""
    import socket

    path = folder / "dead.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.close()
    with pytest.raises(PodLookupError, match=r"UNAVAILABLE|DEADLINE_EXCEEDED"):
        await PodResourcesClient(path, timeout_s=2.0).pods_using(GPU_A)


def test_socket_setting() -> None:
    assert str(load({}).pod_resources_socket) == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert str(load({"GPUWARDEN_DEVICE_POD_RESOURCES_SOCKET": "/x/k.sock"}).pod_resources_socket) == "/x/k.sock"


def test_adapter_by_backend(settings: Settings, subjects: Subjects) -> None:
    real = Wiring(Settings(backend="real"), subjects).gpu_pods(lambda: PodResourcesClient(Path("/x/k.sock")))
    assert isinstance(real, PodResourcesClient) and real.socket == Path("/x/k.sock")
    assert isinstance(Wiring(settings, subjects).gpu_pods(lambda: PodResourcesClient(Path("/x/k.sock"))), SimGpuPods)


# -- the simulation's assignment -----------------------------------------------------------------------------------
def spec_of(gpus: int, *deployments: tuple[str, int, int]) -> SimSpec:
    return SimSpec(
        nodes=[NodeSpec(name="n1", gpus=[GpuSpec(count=gpus)]), NodeSpec(name="n2", gpus=[GpuSpec(count=gpus)])],
        deployments=[DeploymentSpec(name=n, replicas=r, gpus_per_pod=g) for n, r, g in deployments],
    )


def check_assignment(state: ClusterState) -> None:
    for name, node in state.nodes.items():
        held = [i for p in state.pods.values() if p.node == name for i in p.gpu_indices]
        assert len(held) == len(set(held)), f"{name}: a GPU held twice"
        assert all(0 <= i < node.gpus for i in held)
    for p in state.pods.values():
        assert len(p.gpu_indices) == (p.gpus if p.node else 0)


def test_pods_hold_the_lowest_free_gpus_and_give_them_back() -> None:
    state = from_spec(spec_of(4, ("a", 2, 1), ("b", 1, 2)))
    state.nodes["n2"].schedulable = False
    state.reconcile(0.0)
    assert state.gpu_holders("n1") == {0: ["default/a-1"], 1: ["default/a-2"], 2: ["default/b-3"], 3: ["default/b-3"]}
    state.scale("default", "a", 1)
    state.reconcile(1.0)
    assert state.gpu_holders("n1")[1] == ["default/a-2"], "a Terminating pod keeps its GPU"
    state.mark_prestop_done("default", "a-2")
    state.scale("default", "a", 2)
    state.reconcile(2.0)
    assert state.gpu_holders("n1") == {0: ["default/a-1"], 1: ["default/a-4"], 2: ["default/b-3"], 3: ["default/b-3"]}
    check_assignment(state)


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5), st.booleans()), max_size=12))
def test_no_gpu_is_ever_held_twice(steps: list[tuple[str, int, bool]]) -> None:
    state = from_spec(spec_of(3, ("a", 2, 1), ("b", 1, 2)))
    now = 0.0
    state.reconcile(now)
    for deployment, replicas, finish in steps:
        now += 1.0
        state.scale("default", deployment, replicas)
        if finish:
            for p in list(state.pods.values()):
                state.mark_prestop_done(p.namespace, p.name)
        state.reconcile(now)
        check_assignment(state)


async def test_sim_adapter_reads_the_simulated_cluster(subjects: Subjects, redis_client: aioredis.Redis) -> None:
    cluster = await SimCluster.create(redis_client, subjects, default_spec())
    holders = await cluster.gpu_holders("node-1")
    pods = SimGpuPods(cluster, "node-1")
    assert pods.simulated is True
    assert await pods.pods_using(GpuDevice(index=0, uuid="x", model="x")) == holders.get(0, [])
    assert holders.get(0), "the default spec puts a llama pod on node-1's first GPU"
    assert await SimGpuPods(cluster, "node-9").pods_using(GPU_A) == []
    absent = SimGpuPods(SimCluster(redis_client, Subjects("tnothere")), "node-1")
    with pytest.raises(PodLookupError, match="simulated cluster: no simulated cluster"):
        await absent.pods_using(GPU_A)


async def test_the_simulated_workload_loads_the_gpu_its_pod_holds(
    subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    spec = default_spec()
    cluster = await SimCluster.create(redis_client, subjects, spec)
    gpus = {n.name: SimGpus(redis_client, subjects, spec, n.name) for n in spec.nodes}
    workload = SimWorkload(bus, cluster, FileStore(tmp_path / "store"), spec, gpus=gpus, tick_s=0.1)
    await workload.start()
    try:
        await eventually(lambda: len(workload.runtimes) == 2)
        for name, runtime in workload.runtimes.items():
            node = runtime.info.node
            holders = await cluster.gpu_holders(node)
            index = min(i for i, pods in holders.items() if f"llm/{name}" in pods)
            assert runtime.gpu_uuid == next(d.uuid for d in await gpus[node].devices() if d.index == index)
    finally:
        await workload.stop()
        await cluster.close()


# -- the device service names them ---------------------------------------------------------------------------------
async def health_changes(bus: Bus, subjects: Subjects) -> list[DeviceHealthChanged]:
    seen: list[DeviceHealthChanged] = []

    async def keep(event: DeviceHealthChanged) -> None:
        seen.append(event)

    await bus.subscribe(subjects.pattern("device.health.changed"), keep, accepts=(DeviceHealthChanged,))
    return seen


async def test_an_unhealthy_gpu_names_its_pods_in_simulation(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    seen = await health_changes(bus, subjects)
    cluster = await SimCluster.create(redis_client, subjects, default_spec())
    holders = await cluster.gpu_holders("node-1")
    gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
    service = DeviceService(DeviceSettings(inventory_s=0.05, plugin="off"), gpus=gpus, cluster=cluster)
    running = await start_service(service, settings, Wiring)
    try:
        await eventually(lambda: running.ctx.status.get("gpus"))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=1, code=48))
        await eventually(lambda: len(seen) == 2)
        by_gpu = {e.xid: e for e in seen}
        assert by_gpu[79].pods == holders[0] and by_gpu[79].reason.startswith("XID 79")
        assert by_gpu[48].pods == holders.get(1, [])
        assert "unknown" not in by_gpu[48].reason
    finally:
        await running.stop(grace=1)
        await cluster.close()


async def test_an_unhealthy_gpu_names_the_pods_the_kubelet_reports(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, kubelet: FakeKubelet
) -> None:
    seen = await health_changes(bus, subjects)
    gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
    uuid = (await gpus.devices())[0].uuid
    kubelet.pods = [pod("llm", "on-it", [("nvidia.com/gpu", [f"{uuid}::2"])]), pod("llm", "elsewhere", [])]
    settings_ = DeviceSettings(inventory_s=0.05, plugin="off", pod_resources_socket=kubelet.socket)
    service = DeviceService(settings_, gpus=gpus, pods=PodResourcesClient(kubelet.socket))
    running = await start_service(service, settings, Wiring)
    try:
        await eventually(lambda: running.ctx.status.get("gpus"))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        (event,) = await eventually(lambda: seen)
        assert event.gpu_uuid == uuid and event.pods == ["llm/on-it"] and not event.healthy
    finally:
        await running.stop(grace=1)


async def test_pods_unknown_still_announces_the_gpu(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, folder: Path
) -> None:
    seen = await health_changes(bus, subjects)
    gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
    service = DeviceService(
        DeviceSettings(inventory_s=0.05, plugin="off"), gpus=gpus, pods=PodResourcesClient(folder / "gone.sock")
    )
    running = await start_service(service, settings, Wiring)
    try:
        await eventually(lambda: running.ctx.status.get("gpus"))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        (event,) = await eventually(lambda: seen)
        assert event.pods == [] and not event.healthy
        assert event.reason.startswith("XID 79") and "the pods holding it are unknown: no kubelet PodResources" in (
            event.reason
        )
        assert not service.gpu_state.health or service.gpu_state.health[event.gpu_uuid] == "unhealthy"
    finally:
        await running.stop(grace=1)


# -- the checkpoint service saves their sessions ---------------------------------------------------------------------
async def test_a_failing_gpu_has_its_pods_sessions_saved(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    store = FileStore(tmp_path / "store")
    checkpoint = await start_service(
        CheckpointService(CheckpointSettings(gc_interval_s=0), store=store), settings, Wiring
    )
    cluster = await SimCluster.create(redis_client, subjects, default_spec())
    holders = await cluster.gpu_holders("node-1")
    namespace, name = holders[0][0].split("/")
    agent_bus = await Bus.connect(settings.nats, subjects, f"agent/{name}")
    agent = KvAgent(store, pod=name, node="node-1", namespace=namespace, deployment="llama", layout=LAYOUT)
    for sid in ("s-1", "s-2"):
        agent.register_session(sid)
        for b in range(3):
            agent.append_block(sid, block_content(sid, b, LAYOUT.block_bytes))
    endpoint = AgentEndpoint(agent, agent_bus, announce_s=30)
    await endpoint.start()
    saved: list[CheckpointSaved] = []

    async def on_saved(event: CheckpointSaved) -> None:
        saved.append(event)

    await bus.subscribe(subjects.pattern("checkpoint.saved"), on_saved, (CheckpointSaved,))
    gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
    device = await start_service(
        DeviceService(DeviceSettings(inventory_s=0.05, plugin="off"), gpus=gpus, cluster=cluster), settings, Wiring
    )
    try:
        await eventually(lambda: device.ctx.status.get("gpus"))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        await eventually(lambda: {e.session_id for e in saved} == {"s-1", "s-2"})
        assert {e.pod for e in saved} == {name} and {e.drain_id for e in saved} == {""}
        assert sorted(await store.checkpoints("s-1")) and sorted(await store.checkpoints("s-2"))
    finally:
        await device.stop(grace=1)
        await endpoint.stop()
        await agent_bus.close(1)
        await checkpoint.stop(grace=1)
        await cluster.close()
