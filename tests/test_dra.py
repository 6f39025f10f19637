"""The device service's DRA driver: the node's ResourceSlice from simulated GPUs (whole and MIG), published through
the cluster port (the Kubernetes adapter against the fake API server, checked against the client's
``resource.k8s.io/v1`` models; the simulated cluster) only when it changes; and the kubelet's DRA plugin service
over real gRPC on unix sockets, with a fake kubelet that registers it, prepares and unprepares claims, and restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import yaml
from kubernetes.client import V1DeviceClass, V1ResourceClaimTemplate, V1ResourceSlice

from services.device.cdi import spec_problems
from services.device.config import load
from services.device.dra.claims import CLAIM_KIND, cdi_device_id, spec_path
from services.device.dra.driver import DraDriver
from services.device.dra.slices import DRIVER_NAME, LOST_TAINT, MIG_CHANGING_TAINT, XID_TAINT, node_slice, semver
from services.device.gen import podresources_pb2
from services.device.podresources import pods_holding
from services.device.service import DeviceService
from shared.adapters.kube import KubeCluster
from shared.contract.device import DeviceInventory, GpuDevice, MigInstance
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.settings import Settings
from shared.ports.cluster import AllocatedDevice, DeviceTaint, ResourceClaimInfo, ResourceSlice, Semver, SliceDevice
from shared.sim.cluster import SimCluster
from shared.sim.faults import LoseGpuFault, XidFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.gpustate import mig_placement
from shared.sim.spec import SimSpec, parse_spec
from shared.wiring import Wiring
from tests.fake_dra_kubelet import FakeDraKubelet, dra_settings
from tests.fake_kube_api import FakeKubeApi
from tests.helpers import eventually
from tests.rbackit import allowed, shipped_rules

ROOT = Path(__file__).resolve().parents[1]
SPEC = """
driver_version: "535.104.05"
cuda_version: "12.4"
nodes:
  - name: gpu-a
    gpus:
      - {model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 2, mig_profiles: ["1g.10gb", "3g.40gb"]}
      - {model: NVIDIA L4, memory_mib: 23034, count: 1, nvlink: false}
"""


@pytest.fixture
def spec() -> SimSpec:
    return parse_spec(SPEC, "test-spec.yaml")


@pytest.fixture
def folder() -> Iterator[Path]:
    """Short on purpose: a unix socket path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gw-dra-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def inventory_of(gpus: SimGpus) -> DeviceInventory:
    versions = await gpus.versions()
    return DeviceInventory(
        node=gpus.node, driver_version=versions.driver, cuda_version=versions.cuda, gpus=await gpus.devices()
    )


def by_name(resource_slice: ResourceSlice) -> dict[str, SliceDevice]:
    return {d.name: d for d in resource_slice.devices}


# -- the slice ------------------------------------------------------------------------------------------------------
async def test_whole_gpus_are_one_device_each_with_nvidias_attributes_and_capacity(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec
) -> None:
    gpus = SimGpus(redis_client, subjects, spec, "gpu-a")
    h100a, h100b, l4 = await gpus.devices()
    made = node_slice(await inventory_of(gpus))
    assert (made.driver, made.node, made.pool, made.name) == (DRIVER_NAME, "gpu-a", "gpu-a", "gpu-a-gpu.gpuwarden.io")
    devices = by_name(made)
    assert list(devices) == ["gpu-0", "gpu-1", "gpu-2"]
    assert devices["gpu-0"].attributes == {
        "type": "gpu",
        "uuid": h100a.uuid,
        "index": 0,
        "productName": "NVIDIA H100 80GB HBM3",
        "architecture": "Hopper",
        "cudaComputeCapability": Semver("9.0.0"),
        "driverVersion": Semver("535.104.5"),
        "cudaDriverVersion": Semver("12.4.0"),
        **({"pcieBusID": h100a.pci_bus_id} if h100a.pci_bus_id else {}),
    }
    assert devices["gpu-0"].capacity == {"memory": "81559Mi"} and devices["gpu-0"].taints == ()
    assert devices["gpu-1"].attributes["uuid"] == h100b.uuid
    assert devices["gpu-2"].attributes["uuid"] == l4.uuid
    assert (devices["gpu-2"].attributes["architecture"], devices["gpu-2"].attributes["cudaComputeCapability"]) == (
        "Ada Lovelace",
        Semver("8.9.0"),
    )
    assert devices["gpu-2"].capacity == {"memory": "23034Mi"}


async def test_a_gpu_in_mig_mode_is_offered_only_as_its_mig_devices(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec
) -> None:
    gpus = SimGpus(redis_client, subjects, spec, "gpu-a")
    h100a, h100b, _ = await gpus.devices()
    await gpus.set_mig_mode(h100a.uuid, True)
    big = await gpus.create_mig_instance(h100a.uuid, "3g.40gb")
    small = await gpus.create_mig_instance(h100a.uuid, "1g.10gb")
    made = node_slice(await inventory_of(gpus))
    migs = [d for d in made.devices if d.attributes["type"] == "mig"]
    assert [d.attributes["uuid"] for d in migs] == [big.uuid, small.uuid]
    assert all(d.name.startswith("gpu-0-mig-") for d in migs) and len({d.name for d in migs}) == 2
    assert {d.attributes["uuid"] for d in made.devices if d.attributes["type"] == "gpu"} == {
        h100b.uuid,
        (await gpus.devices())[2].uuid,
    }, "the GPU in MIG mode is not offered whole"
    first, second = migs
    assert first.attributes["parentUUID"] == h100a.uuid and first.attributes["profile"] == "3g.40gb"
    assert first.attributes["productName"] == "NVIDIA H100 80GB HBM3" and first.attributes["parentIndex"] == 0
    slots = {f"memorySlice{i}": "1" for i in range(4)}  # the simulation places the 3g at 0 (4 of 8 memory slices)
    assert first.capacity == {"memory": f"{big.memory_mib}Mi", "multiprocessors": "60", **slots}
    assert second.capacity == {"memory": f"{small.memory_mib}Mi", "multiprocessors": "16", "memorySlice4": "1"}


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("550.54.15", "550.54.15"),
        ("535.104.05", "535.104.5"),
        ("12.4", "12.4.0"),
        ("9", "9.0.0"),
        ("", None),
        ("550.54.15-beta", None),
        ("v12", None),
        ("1.2.3.4", None),
    ],
)
def test_versions_are_semantic_versions_the_api_server_accepts(text: str, version: str | None) -> None:
    assert semver(text) == (Semver(version) if version else None)


def test_what_the_gpu_port_cannot_say_is_left_out() -> None:
    odd = GpuDevice(index=0, uuid="GPU-x", model="Some Future GPU", memory_total_mib=1024)
    (device,) = node_slice(DeviceInventory(node="n", driver_version="", gpus=[odd])).devices
    assert device.attributes == {"type": "gpu", "uuid": "GPU-x", "index": 0, "productName": "Some Future GPU"}


# -- publishing -----------------------------------------------------------------------------------------------------
def h100(index: int) -> GpuDevice:
    return GpuDevice(index=index, uuid=f"GPU-{index}", model="NVIDIA H100 80GB HBM3", memory_total_mib=81559)


def writes(api: FakeKubeApi) -> list[str]:
    return [a.verb for a in api.accesses if a.resource == "resourceslices" and a.verb in ("create", "update")]


async def test_the_kubernetes_adapter_writes_a_valid_v1_slice_and_only_when_it_changes() -> None:
    async with FakeKubeApi() as api:
        cluster = KubeCluster.from_host(api.url)
        try:
            two = node_slice(DeviceInventory(node="n1", driver_version="550.54.15", gpus=[h100(0), h100(1)]))
            assert await cluster.publish_resource_slice(two)
            stored = api.get("resourceslices", "", two.name, group="resource.k8s.io")
            assert stored is not None
            V1ResourceSlice.from_dict(stored)  # the client's model of the upstream schema accepts it
            assert stored["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 1}
            assert stored["spec"]["nodeName"] == "n1" and stored["spec"]["driver"] == "gpu.gpuwarden.io"
            first = stored["spec"]["devices"][0]
            assert first["attributes"]["driverVersion"] == {"version": "550.54.15"}
            assert first["attributes"]["index"] == {"int": 0} and first["attributes"]["type"] == {"string": "gpu"}
            assert first["capacity"] == {"memory": {"value": "81559Mi"}}

            assert not await cluster.publish_resource_slice(two), "the same devices: nothing written"
            one = node_slice(DeviceInventory(node="n1", driver_version="550.54.15", gpus=[h100(1)]))
            assert await cluster.publish_resource_slice(one)
            stored = api.get("resourceslices", "", two.name, group="resource.k8s.io")
            assert stored is not None and stored["spec"]["pool"]["generation"] == 2
            assert [d["name"] for d in stored["spec"]["devices"]] == ["gpu-1"]
            assert writes(api) == ["create", "update"]
            rules = shipped_rules("device")
            assert all(allowed(a, rules) for a in api.used()), "only what deploy/rbac/device.yaml allows"
        finally:
            await cluster.close()


async def test_the_kubernetes_adapter_reads_a_claims_allocation() -> None:
    async with FakeKubeApi() as api:
        api.add("resourceclaims", claim_object("llm", "c1", [("gpu", "n1", "gpu-0")]), group="resource.k8s.io")
        api.add("resourceclaims", {"metadata": {"name": "pending", "namespace": "llm"}}, group="resource.k8s.io")
        cluster = KubeCluster.from_host(api.url)
        try:
            claim = await cluster.resource_claim("llm", "c1")
            assert claim is not None and claim.allocated and claim.uid
            assert claim.devices == (AllocatedDevice("gpu", DRIVER_NAME, "n1", "gpu-0"),)
            pending = await cluster.resource_claim("llm", "pending")
            assert pending is not None and not pending.allocated and pending.devices == ()
            assert await cluster.resource_claim("llm", "nope") is None
            rules = shipped_rules("device")
            assert all(allowed(a, rules) for a in api.used())
        finally:
            await cluster.close()


def claim_object(namespace: str, name: str, results: list[tuple[str, str, str]]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": DRIVER_NAME, "pool": pool, "device": device}
                        for r, pool, device in results
                    ]
                }
            }
        },
    }


async def test_the_simulated_cluster_keeps_slices_and_claims(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, spec)
    two = node_slice(DeviceInventory(node="gpu-a", gpus=[h100(0), h100(1)]))
    assert await cluster.publish_resource_slice(two)
    assert not await cluster.publish_resource_slice(two)
    one = node_slice(DeviceInventory(node="gpu-a", gpus=[h100(0)]))
    assert await cluster.publish_resource_slice(one)
    stored = (await cluster.resources.slices())[two.name]
    assert (stored.generation, stored.slice) == (2, one)
    claim = ResourceClaimInfo("llm", "c1", "uid-1", True, (AllocatedDevice("gpu", DRIVER_NAME, "gpu-a", "gpu-0"),))
    await cluster.resources.put_claim(claim)
    assert await cluster.resource_claim("llm", "c1") == claim
    assert await cluster.resource_claim("llm", "c2") is None


async def test_the_device_service_publishes_its_nodes_slice_in_dra_mode(
    redis_client: aioredis.Redis, subjects: Subjects, settings: Settings, spec: SimSpec, folder: Path
) -> None:
    gpus = SimGpus(redis_client, subjects, spec, "gpu-a")
    cluster = await SimCluster.create(redis_client, subjects, spec)
    device_settings = dra_settings(folder, inventory_s=0.05)
    assert device_settings.dra_enabled and not device_settings.plugin_enabled
    service = DeviceService(device_settings, gpus=gpus, cluster=cluster)
    runner = await start_service(service, dataclasses.replace(settings, node="gpu-a"), Wiring)
    try:
        name = f"gpu-a-{DRIVER_NAME}"
        stored = await eventually(lambda: _slice(cluster, name))
        assert [d.name for d in stored.slice.devices] == ["gpu-0", "gpu-1", "gpu-2"] and stored.generation == 1
        h100a = (await gpus.devices())[0]
        await gpus.set_mig_mode(h100a.uuid, True)
        await gpus.create_mig_instance(h100a.uuid, "3g.40gb")
        changed = await eventually(lambda: _slice(cluster, name, generation=2))
        assert [d.attributes["type"] for d in changed.slice.devices] == ["mig", "gpu", "gpu"]
        assert service.dra is not None
        await eventually(lambda: service.dra is not None and service.dra.writes == 2)  # counted once written
        kubelet = FakeDraKubelet(device_settings.dra_registry_dir)
        info = await kubelet.register()
        assert info.name == DRIVER_NAME
    finally:
        await runner.stop()


async def _slice(cluster: SimCluster, name: str, generation: int = 1) -> Any:
    stored = (await cluster.resources.slices()).get(name)
    return stored if stored is not None and stored.generation == generation else None


async def test_xids_and_a_lost_gpu_become_taints_on_exactly_that_gpus_devices(
    redis_client: aioredis.Redis, subjects: Subjects, settings: Settings, spec: SimSpec, folder: Path
) -> None:
    gpus = SimGpus(redis_client, subjects, spec, "gpu-a")
    h100a, h100b, l4 = await gpus.devices()
    await gpus.set_mig_mode(h100b.uuid, True)
    await gpus.create_mig_instance(h100b.uuid, "3g.40gb")
    await gpus.create_mig_instance(h100b.uuid, "1g.10gb")
    cluster = await SimCluster.create(redis_client, subjects, spec)
    service = DeviceService(dra_settings(folder, inventory_s=0.05), gpus=gpus, cluster=cluster)
    runner = await start_service(service, dataclasses.replace(settings, node="gpu-a"), Wiring)
    name = f"gpu-a-{DRIVER_NAME}"

    async def taints() -> dict[str, list[tuple[str, str, str]]] | None:
        stored = (await cluster.resources.slices()).get(name)
        if stored is None:
            return None
        return {d.name: [(x.key, x.value, x.effect) for x in d.taints] for d in stored.slice.devices}

    async def once(expected: dict[str, list[tuple[str, str, str]]]) -> bool:
        return await taints() == expected

    try:
        migs = [d.name for d in node_slice(await inventory_of(gpus)).devices if d.attributes["type"] == "mig"]
        clean = {"gpu-0": [], **{m: [] for m in migs}, "gpu-2": []}
        await eventually(lambda: once(clean))
        await apply_fault(redis_client, subjects, XidFault(node="gpu-a", gpu=2, code=13))  # the program's fault
        await apply_fault(redis_client, subjects, XidFault(node="gpu-a", gpu=1, code=94))
        ecc = [(XID_TAINT, "94", "NoSchedule")]
        await eventually(lambda: once(clean | {m: ecc for m in migs}))
        await apply_fault(redis_client, subjects, XidFault(node="gpu-a", gpu=0, code=79))
        fatal = [(XID_TAINT, "79", "NoExecute")]
        await eventually(lambda: once(clean | {m: ecc for m in migs} | {"gpu-0": fatal}))
        await apply_fault(redis_client, subjects, LoseGpuFault(node="gpu-a", gpu=l4.uuid))
        lost = [(LOST_TAINT, "", "NoExecute")]
        await eventually(lambda: once(clean | {m: ecc for m in migs} | {"gpu-0": fatal, "gpu-2": lost}))
        assert l4.uuid not in {d.uuid for d in await gpus.devices()}, "gone from NVML, kept in the slice, tainted"
        assert h100a.uuid in {d.uuid for d in await gpus.devices()}
    finally:
        await runner.stop()


def recording_driver(folder: Path) -> tuple[DraDriver, list[ResourceSlice]]:
    """A DRA driver of node n1 whose cluster only records the slices it is given to publish."""
    published: list[ResourceSlice] = []

    class Recording:
        async def publish_resource_slice(self, resource_slice: ResourceSlice) -> bool:
            published.append(resource_slice)
            return True

    async def connect() -> Any:
        return Recording()

    return DraDriver(dra_settings(folder), "n1", connect), published


async def test_a_recovered_gpu_loses_its_taint_and_the_slice_is_written_again(folder: Path) -> None:
    driver, published = recording_driver(folder)
    inventory = DeviceInventory(node="n1", gpus=[h100(0), h100(1)])
    driver.want(inventory, {"GPU-1": "unhealthy"}, {"GPU-1": 48})
    assert await driver.publish()
    driver.want(inventory, {"GPU-1": "unhealthy"}, {"GPU-1": 48})
    assert not await driver.publish(), "the same taints: nothing written"
    driver.want(inventory, {"GPU-1": "healthy"}, {})
    assert await driver.publish()
    assert [[(d.name, d.taints) for d in s.devices] for s in published] == [
        [("gpu-0", ()), ("gpu-1", (DeviceTaint(XID_TAINT, "48", "NoExecute"),))],
        [("gpu-0", ()), ("gpu-1", ())],
    ]


async def test_while_the_mig_controller_changes_the_layout_no_device_is_offered_for_new_claims(folder: Path) -> None:
    """The MIG controller pauses every advertiser after its drain saved the sessions: the DRA driver taints every
    device of its slice NoSchedule (running pods stay; no new claim gets a device being torn down), keeps the health
    taints beside it, and the slice is clean again on resume."""
    driver, published = recording_driver(folder)
    driver.want(DeviceInventory(node="n1", gpus=[h100(0), h100(1)]), {"GPU-1": "unhealthy"}, {"GPU-1": 48})
    assert await driver.publish()
    await driver.pause()
    assert await driver.publish()
    changing = DeviceTaint(MIG_CHANGING_TAINT, "", "NoSchedule")
    xid = DeviceTaint(XID_TAINT, "48", "NoExecute")
    assert [(d.name, d.taints) for d in published[-1].devices] == [("gpu-0", (changing,)), ("gpu-1", (xid, changing))]
    await driver.resume()
    assert await driver.publish()
    assert [(d.name, d.taints) for d in published[-1].devices] == [("gpu-0", ()), ("gpu-1", (xid,))]


def test_a_mig_device_lists_the_memory_slices_its_instance_occupies() -> None:
    """NVIDIA's placement capacities: ``memorySlice<i>`` for each memory slice the GPU instance holds, from the
    GPU port's placement (NVML's; the simulation places as an H100 does); none where the port does not say."""
    placed = MigInstance(uuid="MIG-a", profile="3g.40gb", memory_mib=40192, placement_start=4, placement_size=4)
    unknown = MigInstance(uuid="MIG-b", profile="1g.10gb", memory_mib=9856)
    gpu = msgspec.structs.replace(h100(0), mig_capable=True, mig_enabled=True, mig_instances=[placed, unknown])
    devices = by_name(node_slice(DeviceInventory(node="n1", gpus=[gpu])))
    slots = {name: sorted(k for k in d.capacity if k.startswith("memorySlice")) for name, d in devices.items()}
    assert slots == {"gpu-0-mig-0": [f"memorySlice{i}" for i in (4, 5, 6, 7)], "gpu-0-mig-1": []}
    taken: set[int] = set()
    order = []
    for slices in (3, 2, 1, 1, 1):  # 3g.40gb, 2g.20gb, then 1g.10gb until the memory slices run out
        where = mig_placement(slices, taken)
        order.append(where)
        if where is not None:
            taken |= set(range(where[0], where[0] + where[1]))
    assert order == [(0, 4), (4, 2), (6, 1), None, None]


def test_the_setting_picks_plugin_dra_or_both(folder: Path) -> None:
    (folder / "dp").mkdir()
    env = {"GPUWARDEN_DEVICE_PLUGIN_DIR": str(folder / "dp")}
    assert load(env).plugin_enabled and not load(env).dra_enabled
    assert load(env | {"GPUWARDEN_DEVICE_API": "both"}).plugin_enabled
    assert load(env | {"GPUWARDEN_DEVICE_API": "both"}).dra_enabled
    dra = load(env | {"GPUWARDEN_DEVICE_API": "dra", "GPUWARDEN_DEVICE_PLUGIN": "on"})
    assert dra.dra_enabled and not dra.plugin_enabled
    with pytest.raises(Exception, match="GPUWARDEN_DEVICE_API"):
        load(env | {"GPUWARDEN_DEVICE_API": "csi"})


# -- the kubelet's DRA plugin service -------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def dra_driver(
    folder: Path, cluster: SimCluster, inventory: DeviceInventory
) -> AsyncIterator[tuple[DraDriver, FakeDraKubelet]]:
    async def connect() -> SimCluster:
        return cluster

    driver = DraDriver(dra_settings(folder), inventory.node, connect)
    driver.want(inventory)
    task = asyncio.create_task(driver.kubelet.run())
    try:
        kubelet = FakeDraKubelet(folder / "plugins_registry")
        yield driver, kubelet
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def answers(response: Any) -> dict[str, Any]:
    return {
        uid: (r.error, [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in r.devices])
        for uid, r in response.claims.items()
    }


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
async def test_prepare_writes_the_claims_cdi_spec_once_and_unprepare_removes_it(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec, folder: Path, version: str
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, spec)
    gpus = SimGpus(redis_client, subjects, spec, "gpu-a")
    h100a, _, _ = await gpus.devices()
    await gpus.set_mig_mode(h100a.uuid, True)
    mig = await gpus.create_mig_instance(h100a.uuid, "1g.10gb")
    inventory = await inventory_of(gpus)
    mig_name = next(d.name for d in node_slice(inventory).devices if d.attributes["uuid"] == mig.uuid)
    uid = "0b5c9a6e-1f7d-4c1a-9d51-5b2f3c4d5e6f"
    results = (
        AllocatedDevice("gpu", DRIVER_NAME, "gpu-a", "gpu-1"),
        AllocatedDevice("mig", DRIVER_NAME, "gpu-a", mig_name),
    )
    other = AllocatedDevice("nic", "net.example.com", "gpu-a", "eth1")
    await cluster.resources.put_claim(ResourceClaimInfo("llm", "c1", uid, True, (*results, other)))
    async with dra_driver(folder, cluster, inventory) as (driver, kubelet):
        info = await kubelet.register()
        assert (info.type, info.name, list(info.supported_versions)) == (
            "DRAPlugin",
            DRIVER_NAME,
            ["v1.DRAPlugin", "v1beta1.DRAPlugin"],
        )
        assert info.endpoint == str(folder / "plugins" / DRIVER_NAME / "dra.sock")
        await eventually(lambda: driver.kubelet.registered)

        prepared = answers(await kubelet.prepare(("llm", uid, "c1"), version=version))
        assert prepared == {
            uid: (
                "",
                [
                    (["gpu"], "gpu-a", "gpu-1", [f"{CLAIM_KIND}={uid}-gpu-1"]),
                    (["mig"], "gpu-a", mig_name, [f"{CLAIM_KIND}={uid}-{mig_name}"]),
                ],
            )
        }, "only this driver's devices; the NIC is another driver's to prepare"
        path = spec_path(folder / "cdi", uid)
        written = json.loads(path.read_text())
        assert spec_problems(written) == [] and written["kind"] == CLAIM_KIND
        nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in written["devices"]}
        assert nodes == {f"{uid}-gpu-1": ["/dev/nvidia1"], f"{uid}-{mig_name}": ["/dev/nvidia0"]}
        before = path.stat()

        again = answers(await kubelet.prepare(("llm", uid, "c1"), version=version))
        assert again == prepared
        after = path.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "a repeat changes nothing"

        unprepared = await kubelet.unprepare(("llm", uid, "c1"), version=version)
        assert {u: r.error for u, r in unprepared.claims.items()} == {uid: ""} and not path.exists()
        repeat = await kubelet.unprepare(("llm", uid, "c1"), version=version)
        assert {u: r.error for u, r in repeat.claims.items()} == {uid: ""}
        assert sorted(p.name for p in (folder / "cdi").iterdir()) == []


async def test_bad_claims_get_their_own_errors_and_the_good_one_is_prepared(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec, folder: Path
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, spec)
    inventory = await inventory_of(SimGpus(redis_client, subjects, spec, "gpu-a"))
    good = ResourceClaimInfo("llm", "good", "uid-good", True, (AllocatedDevice("gpu", DRIVER_NAME, "gpu-a", "gpu-0"),))
    ghost = ResourceClaimInfo("llm", "ghost", "uid-ghost", True, (AllocatedDevice("g", DRIVER_NAME, "gpu-a", "gpu-9"),))
    away = ResourceClaimInfo("llm", "away", "uid-away", True, (AllocatedDevice("g", DRIVER_NAME, "gpu-b", "gpu-0"),))
    pending = ResourceClaimInfo("llm", "pending", "uid-pending")
    for claim in (good, ghost, away, pending):
        await cluster.resources.put_claim(claim)
    async with dra_driver(folder, cluster, inventory) as (_, kubelet):
        await kubelet.register()
        response = await kubelet.prepare(
            ("llm", "uid-good", "good"),
            ("llm", "uid-missing", "missing"),
            ("llm", "uid-old", "good"),
            ("llm", "uid-ghost", "ghost"),
            ("llm", "uid-away", "away"),
            ("llm", "uid-pending", "pending"),
            ("", "uid-blank", ""),
        )
        errors = {uid: r.error for uid, r in response.claims.items()}
        assert errors.pop("uid-good") == ""
        expected = {
            "uid-missing": "llm/missing does not exist",
            "uid-old": "is now another claim",
            "uid-ghost": "['gpu-9'] are not on node 'gpu-a'",
            "uid-away": "another node's pool",
            "uid-pending": "is not allocated",
            "uid-blank": "needs its namespace, uid and name",
        }
        assert set(errors) == set(expected)
        for uid, fragment in expected.items():
            assert fragment in errors[uid], (uid, errors[uid])
        assert [d.device_name for d in response.claims["uid-good"].devices] == ["gpu-0"]
        bad_uid = await kubelet.unprepare(("llm", "../../etc/passwd", "x"))
        assert "is not a Kubernetes UID" in bad_uid.claims["../../etc/passwd"].error
        assert sorted(p.name for p in (folder / "cdi").iterdir()) == [spec_path(folder / "cdi", "uid-good").name]


async def test_the_plugin_survives_a_kubelet_restart_and_a_wiped_registry(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec, folder: Path
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, spec)
    inventory = await inventory_of(SimGpus(redis_client, subjects, spec, "gpu-a"))
    claim = ResourceClaimInfo("llm", "c", "uid-c", True, (AllocatedDevice("gpu", DRIVER_NAME, "gpu-a", "gpu-2"),))
    await cluster.resources.put_claim(claim)
    async with dra_driver(folder, cluster, inventory) as (driver, first):
        await first.register()
        assert (await first.prepare(("llm", "uid-c", "c"))).claims["uid-c"].error == ""

        restarted = FakeDraKubelet(folder / "plugins_registry")  # knows nothing; finds the socket that is there
        await restarted.register()
        assert (await restarted.prepare(("llm", "uid-c", "c"))).claims["uid-c"].error == ""
        assert (await restarted.unprepare(("llm", "uid-c", "c"))).claims["uid-c"].error == ""

        for path in (folder / "plugins_registry").iterdir():
            path.unlink()
        (folder / "plugins" / DRIVER_NAME / "dra.sock").unlink()
        await restarted.register()  # the plugin serves both sockets again; the watcher finds the new one
        assert driver.kubelet.serves == 2
        assert (await restarted.prepare(("llm", "uid-c", "c"))).claims["uid-c"].error == ""
        await eventually(lambda: driver.kubelet.registrations == 3)


async def test_a_registry_folder_it_cannot_use_is_reported_and_tried_again(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec, folder: Path
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, spec)
    inventory = await inventory_of(SimGpus(redis_client, subjects, spec, "gpu-a"))
    (folder / "plugins_registry").write_text("a file where the folder should be")
    async with dra_driver(folder, cluster, inventory) as (driver, kubelet):
        error = await eventually(lambda: driver.describe()["kubelet"]["error"])
        assert "plugins_registry" in error
        (folder / "plugins_registry").unlink()
        await kubelet.register()
        await eventually(lambda: driver.describe()["kubelet"]["error"] is None)


def test_a_failing_gpu_names_the_pods_holding_it_by_claim() -> None:
    mig_gpu = msgspec.structs.replace(
        h100(0),
        mig_enabled=True,
        mig_instances=[MigInstance(uuid="MIG-a", profile="3g.40gb", gpu_instance_id=1, compute_instance_id=0)],
    )
    whole, eleventh = h100(1), h100(11)
    uid = "0b5c9a6e-1f7d-4c1a-9d51-5b2f3c4d5e6f"

    def by_claim(name: str, *devices: str) -> podresources_pb2.PodResources:
        cdi = [podresources_pb2.CDIDevice(name=cdi_device_id(uid, d)) for d in devices]
        claim = podresources_pb2.DynamicResource(
            claim_name=f"{name}-gpu",
            claim_namespace="llm",
            claim_resources=[podresources_pb2.ClaimResource(cdi_devices=cdi)],
        )
        container = podresources_pb2.ContainerResources(name="server", dynamic_resources=[claim])
        return podresources_pb2.PodResources(name=name, namespace="llm", containers=[container])

    other_driver = podresources_pb2.PodResources(
        name="nic",
        namespace="llm",
        containers=[
            podresources_pb2.ContainerResources(
                dynamic_resources=[
                    podresources_pb2.DynamicResource(
                        claim_resources=[
                            podresources_pb2.ClaimResource(
                                cdi_devices=[podresources_pb2.CDIDevice(name=f"net.example.com/nic={uid}-gpu-1")]
                            )
                        ]
                    )
                ]
            )
        ],
    )
    pods = [by_claim("a", "gpu-1"), by_claim("b", "gpu-0-mig-1-0"), by_claim("c", "gpu-11"), other_driver]
    assert pods_holding(pods, whole) == ["llm/a"]
    assert pods_holding(pods, mig_gpu) == ["llm/b"]
    assert pods_holding(pods, eleventh) == ["llm/c"]
    wire = podresources_pb2.ListPodResourcesResponse.FromString(
        podresources_pb2.ListPodResourcesResponse(pod_resources=pods).SerializeToString()
    )
    assert pods_holding(wire.pod_resources, whole) == ["llm/a"]


# -- deploy/, validated offline -------------------------------------------------------------------------------------
_TERM = re.compile(
    r'^device\.driver == "(?P<driver>[^"]+)"$'
    r'|^device\.attributes\["(?P<ad>[^"]+)"\]\.(?P<attr>\w+) == "(?P<value>[^"]*)"$'
    r'|^device\.(?P<kind>capacity|attributes)\["(?P<cd>[^"]+)"\]\.(?P<name>\w+)\.compareTo\('
    r'(?P<fn>quantity|semver)\("(?P<bound>[^"]+)"\)\) >= 0$'
)
_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _quantity(text: str) -> int:
    number, unit = re.fullmatch(r"([0-9]+)([KMGT]i)?", text).groups()  # type: ignore[union-attr]
    return int(number) * _UNITS[unit or ""]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def selects(expression: str, driver: str, device: SliceDevice) -> bool:
    """The CEL forms deploy/ uses (``&&`` of equalities and ``compareTo(...) >= 0``), evaluated on one device; any
    other form fails the test, so a manifest cannot drift into something this check does not understand."""
    result = True
    for term in (t.strip() for t in " ".join(expression.split()).split("&&")):
        m = _TERM.match(term)
        assert m is not None, f"a CEL form this check does not know: {term!r}"
        if m["driver"]:
            result &= m["driver"] == driver
        elif m["attr"]:
            result &= m["ad"] == driver and device.attributes.get(m["attr"]) == m["value"]
        else:
            values: Mapping[str, Any] = device.capacity if m["kind"] == "capacity" else device.attributes
            value = values.get(m["name"])
            if value is None or m["cd"] != driver:
                return False
            if m["fn"] == "quantity":
                result &= _quantity(str(value)) >= _quantity(m["bound"])
            else:
                assert isinstance(value, Semver)
                result &= _version(value.value) >= _version(m["bound"])
    return result


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


async def test_the_device_classes_and_the_example_claims_select_what_the_slices_offer(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec
) -> None:
    (kustomization,) = documents(ROOT / "deploy" / "dra" / "kustomization.yaml")
    classes = {
        d["metadata"]["name"]: d
        for name in kustomization["resources"]
        for d in documents(ROOT / "deploy" / "dra" / name)
    }
    assert set(classes) == {"gpu.gpuwarden.io", "mig.gpuwarden.io"}
    for d in classes.values():
        V1DeviceClass.from_dict(d)
    templates = {d["metadata"]["name"]: d for d in documents(ROOT / "deploy" / "examples" / "dra-claim.yaml")}
    for d in templates.values():
        assert d["kind"] == "ResourceClaimTemplate"
        V1ResourceClaimTemplate.from_dict(d)

    gpus = SimGpus(redis_client, subjects, spec, "gpu-a")
    h100a = (await gpus.devices())[0]
    await gpus.set_mig_mode(h100a.uuid, True)
    await gpus.create_mig_instance(h100a.uuid, "3g.40gb")
    await gpus.create_mig_instance(h100a.uuid, "1g.10gb")
    devices = node_slice(await inventory_of(gpus)).devices

    def chosen(class_name: str, extra: tuple[str, ...] = ()) -> list[str]:
        expressions = [*(s["cel"]["expression"] for s in classes[class_name]["spec"]["selectors"]), *extra]
        return [d.name for d in devices if all(selects(e, DRIVER_NAME, d) for e in expressions)]

    assert chosen("gpu.gpuwarden.io") == ["gpu-1", "gpu-2"]
    assert chosen("mig.gpuwarden.io") == [d.name for d in devices if d.attributes["type"] == "mig"]
    for template in templates.values():
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        exactly = request["exactly"]
        extra = tuple(s["cel"]["expression"] for s in exactly["selectors"])
        picked = chosen(exactly["deviceClassName"], extra)
        if template["metadata"]["name"] == "big-gpu":
            assert picked == ["gpu-1"], "40 GiB and compute capability 9.0: the whole H100, not the L4"
        else:
            assert [next(d for d in devices if d.name == p).attributes["profile"] for p in picked] == ["1g.10gb"]


def _merged(base: list[dict[str, Any]], patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A strategic merge of a list keyed by ``name`` (what kustomize does to env, volumes and volumeMounts)."""
    out = {item["name"]: item for item in base}
    out.update({item["name"]: item for item in patch})
    return list(out.values())


def test_the_daemonset_patch_runs_the_dra_driver_with_the_kubelets_folders_mounted() -> None:
    (daemonset,) = [d for d in documents(ROOT / "deploy" / "workloads" / "device.yaml") if d["kind"] == "DaemonSet"]
    (patch,) = documents(ROOT / "deploy" / "dra" / "device-patch.yaml")
    assert (patch["kind"], patch["metadata"]["name"]) == ("DaemonSet", daemonset["metadata"]["name"])
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    (extra,) = patch["spec"]["template"]["spec"]["containers"]
    assert extra["name"] == container["name"]
    env = {e["name"]: e["value"] for e in _merged(container["env"], extra["env"]) if "value" in e}
    settings = load(env | {"GPUWARDEN_DEVICE_PLUGIN": "auto"})
    assert settings.dra_enabled
    mounts = {m["mountPath"]: m["name"] for m in _merged(container["volumeMounts"], extra["volumeMounts"])}
    volumes = {
        v["name"]: v["hostPath"]["path"]
        for v in _merged(daemonset["spec"]["template"]["spec"]["volumes"], patch["spec"]["template"]["spec"]["volumes"])
        if "hostPath" in v
    }
    for folder in (settings.dra_plugin_dir, settings.dra_registry_dir, settings.cdi_dir):
        assert volumes[mounts[str(folder)]] == str(folder), f"{folder} is the host's, mounted at the same path"
