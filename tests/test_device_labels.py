"""Node labels in the style of NVIDIA's GPU feature discovery: the pure inventory -> labels function, the patch that
leaves others' labels alone, and the device service writing them through the simulated cluster and through the
Kubernetes adapter (against the fake API server, under the shipped RBAC), retrying when the API refuses."""

from __future__ import annotations

import re

import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from services.device.config import DeviceSettings
from services.device.labels import (
    COUNT,
    DRIVER_MAJOR,
    DRIVER_MINOR,
    DRIVER_REV,
    MEMORY,
    MIG_STRATEGY,
    PRESENT,
    PRODUCT,
    RUNTIME_MAJOR,
    RUNTIME_MINOR,
    label_changes,
    label_value,
    node_labels,
    owned,
)
from services.device.service import DeviceService
from shared.adapters.kube import KubeCluster
from shared.contract.device import DeviceInventory, GpuDevice, MigInstance
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.faults import XidFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import default_spec
from shared.wiring import Wiring
from tests.fake_kube_api import Access, FakeKubeApi, node
from tests.helpers import eventually
from tests.rbackit import allowed, shipped_rules

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
H100 = "NVIDIA H100 80GB HBM3"


def gpu(index: int, model: str = H100, memory: int = 81559, mig: list[MigInstance] | None = None) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=f"GPU-{index}",
        model=model,
        memory_total_mib=memory,
        mig_capable=mig is not None,
        mig_enabled=bool(mig),
        mig_instances=mig or [],
    )


def inventory(*gpus: GpuDevice, driver: str = "550.54.15", cuda: str = "12.4") -> DeviceInventory:
    return DeviceInventory(node="node-1", driver_version=driver, cuda_version=cuda, gpus=list(gpus))


def slices(gpu_index: int, profile: str, count: int, memory: int) -> list[MigInstance]:
    return [MigInstance(uuid=f"MIG-{gpu_index}-{k}", profile=profile, memory_mib=memory) for k in range(count)]


# -- inventory -> labels -------------------------------------------------------------------------------------------
def test_whole_gpus() -> None:
    labels = node_labels(inventory(gpu(1), gpu(0)), "none")
    assert labels == {
        PRESENT: "true",
        PRODUCT: "NVIDIA-H100-80GB-HBM3",
        COUNT: "2",
        MEMORY: "81559",
        MIG_STRATEGY: "none",
        DRIVER_MAJOR: "550",
        DRIVER_MINOR: "54",
        DRIVER_REV: "15",
        RUNTIME_MAJOR: "12",
        RUNTIME_MINOR: "4",
    }
    assert not any("compute" in key for key in labels), "the GPU port gives no compute capability: not guessed"


def test_product_and_memory_are_the_first_gpus() -> None:
    labels = node_labels(inventory(gpu(1, "NVIDIA A100-SXM4-40GB", 40960), gpu(0, "Tesla T4", 15360)), "none")
    assert (labels[PRODUCT], labels[MEMORY], labels[COUNT]) == ("Tesla-T4", "15360", "2")


def test_versions_without_every_part() -> None:
    labels = node_labels(inventory(gpu(0), driver="535.104", cuda=""), "none")
    assert (labels[DRIVER_MAJOR], labels[DRIVER_MINOR]) == ("535", "104")
    assert DRIVER_REV not in labels and RUNTIME_MAJOR not in labels and RUNTIME_MINOR not in labels
    assert not {DRIVER_MAJOR, DRIVER_MINOR} & node_labels(inventory(gpu(0), driver=""), "none").keys()


def test_no_gpus() -> None:
    labels = node_labels(inventory(), "none")
    assert labels[COUNT] == "0"
    assert not {PRESENT, PRODUCT, MEMORY} & labels.keys()


def test_mig_single_labels_the_slice() -> None:
    mig = inventory(gpu(0, mig=slices(0, "1g.10gb", 7, 9856)), gpu(1, mig=slices(1, "1g.10gb", 7, 9856)))
    labels = node_labels(mig, "single")
    assert (labels[PRODUCT], labels[COUNT], labels[MEMORY]) == ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", "14", "9856")
    assert labels[MIG_STRATEGY] == "single"
    assert node_labels(mig, "none")[COUNT] == "2", "strategy none advertises whole GPUs"


def test_mig_single_with_two_profiles_labels_whole_gpus() -> None:
    mixed = inventory(gpu(0, mig=slices(0, "1g.10gb", 7, 9856)), gpu(1, mig=slices(1, "3g.40gb", 2, 40192)))
    labels = node_labels(mixed, "single")
    assert (labels[PRODUCT], labels[COUNT], labels[MEMORY]) == ("NVIDIA-H100-80GB-HBM3", "2", "81559")


def test_mig_mixed_labels_each_profile() -> None:
    mixed = inventory(
        gpu(0, mig=slices(0, "1g.10gb", 3, 9856) + slices(0, "3g.40gb", 1, 40192)),
        gpu(1, mig=slices(1, "1g.10gb+me", 1, 9856)),
        gpu(2),
    )
    labels = node_labels(mixed, "mixed")
    assert labels[COUNT] == "3" and labels[MIG_STRATEGY] == "mixed"
    assert {k: v for k, v in labels.items() if k.startswith("nvidia.com/mig-")} == {
        "nvidia.com/mig-1g.10gb.count": "3",
        "nvidia.com/mig-1g.10gb.memory": "9856",
        "nvidia.com/mig-3g.40gb.count": "1",
        "nvidia.com/mig-3g.40gb.memory": "40192",
        "nvidia.com/mig-1g.10gb-me.count": "1",
        "nvidia.com/mig-1g.10gb-me.memory": "9856",
    }
    assert all(owned(k) for k in labels if k != PRESENT)


@given(st.text(max_size=100))
def test_label_values_are_always_valid(text: str) -> None:
    value = label_value(text)
    assert LABEL_VALUE.match(value) and len(value) <= 63


def test_label_value_keeps_what_is_valid() -> None:
    assert label_value("NVIDIA GeForce RTX 4090") == "NVIDIA-GeForce-RTX-4090"
    assert label_value(" Quadro RTX 6000/8000 ") == "Quadro-RTX-6000-8000"


label_keys = st.sampled_from(
    [PRODUCT, COUNT, MEMORY, PRESENT, DRIVER_MAJOR, "nvidia.com/mig-1g.10gb.count", "nvidia.com/mig.config", "pool"]
)
label_maps = st.dictionaries(label_keys, st.sampled_from(["a", "b", "true"]))


@given(label_maps, label_maps)
def test_the_patch_reaches_desired_and_touches_nothing_else(desired: dict[str, str], current: dict[str, str]) -> None:
    changes = label_changes(desired, current)
    after = {k: v for k, v in ({**current, **changes}).items() if v is not None}
    assert {k: after[k] for k in desired} == desired
    for key in current.keys() - desired.keys():
        assert (key in after) == (not owned(key))
    assert not owned(PRESENT) and not owned("nvidia.com/mig.config") and not owned("pool")
    assert label_changes(desired, after) == {}


# -- the service ---------------------------------------------------------------------------------------------------
async def test_the_service_labels_its_node_and_follows_the_inventory(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, default_spec())
    stale = {"nvidia.com/mig-1g.10gb.count": "7", "nvidia.com/mig.config": "all-disabled", "pool": "a"}
    await cluster.set_node_labels("node-1", stale)
    gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
    service = DeviceService(DeviceSettings(inventory_s=0.05, plugin="off"), gpus=gpus, cluster=cluster)
    running = await start_service(service, settings, Wiring)

    async def labels() -> dict[str, str]:
        found = await cluster.node("node-1")
        assert found is not None
        return dict(found.labels)

    try:
        # the labeller counts a write once the patch has returned, a moment after the node shows it
        await eventually(lambda: service.labeller is not None and service.labeller.writes >= 1)
        first = await labels()
        assert first[COUNT] == "2" and first[PRODUCT] == "NVIDIA-H100-80GB-HBM3" and first[PRESENT] == "true"
        assert first[DRIVER_MAJOR] == "550" and first[MIG_STRATEGY] == "none"
        assert "nvidia.com/mig-1g.10gb.count" not in first, "a label it owns and no longer means is removed"
        assert first["nvidia.com/mig.config"] == "all-disabled" and first["pool"] == "a", "others' labels stay"
        assert service.labeller is not None and service.labeller.writes == 1

        await gpus.install_driver("560.35.03")
        await eventually(lambda: service.labeller is not None and service.labeller.writes >= 2)
        upgraded = await labels()
        assert upgraded[DRIVER_MAJOR] == "560"
        assert (upgraded[DRIVER_MINOR], upgraded[DRIVER_REV]) == ("35", "03")
        assert service.labeller.writes == 2

        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        state = service.gpu_state
        await eventually(lambda: state.inventory is not None and not state.inventory.gpus[0].healthy)
        assert service.labeller.writes == 2, "a health change changes no label: nothing is written"
        assert running.ctx.status["node_labels"]() == {"up_to_date": True, "writes": 2, "failures": 0, "error": None}
    finally:
        await running.stop(grace=1)
        await cluster.close()


async def test_a_refusing_api_is_retried_under_the_shipped_rbac(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    rules = shipped_rules("device")
    service: DeviceService | None = None

    def authorize(access: Access) -> bool:
        """Everything is refused until the labeller has failed once."""
        if service is None or service.labeller is None or service.labeller.failures == 0:
            return False
        return allowed(access, rules)

    async with FakeKubeApi() as api:
        api.add("nodes", node("node-1", gpus=2, labels={"pool": "a"}))
        api.authorize = authorize
        kube = KubeCluster.from_host(api.url, watch_kinds=("node",))
        gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
        service = DeviceService(DeviceSettings(inventory_s=0.05, plugin="off"), gpus=gpus, cluster=kube)
        running = await start_service(service, settings, Wiring)
        try:

            def node_labels_now() -> dict[str, str]:
                found = api.get("nodes", "", "node-1")
                assert found is not None
                return dict(found["metadata"].get("labels") or {})

            labels = await eventually(lambda: COUNT in node_labels_now() and node_labels_now())
            assert labels[PRODUCT] == "NVIDIA-H100-80GB-HBM3" and labels["pool"] == "a"
            status = running.ctx.status["node_labels"]()
            assert status["error"] is None and status["writes"] == 1 and status["failures"] == 1
        finally:
            await running.stop(grace=1)
            await kube.close()
        used = api.used()
    assert {Access("get", "", "nodes"), Access("patch", "", "nodes")} <= used
    assert all(allowed(a, rules) for a in used), "the device service does only what deploy/rbac/device.yaml allows"
    assert not [a for a in used if a.resource != "nodes"], "which pods hold a GPU is the kubelet's to say"
