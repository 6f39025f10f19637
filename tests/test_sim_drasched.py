"""The simulated DRA scheduler (``shared.sim.drasched``, ``SimResourceApi.allocate_claim``): claims allocated by
DeviceClass, CEL selectors on attributes and capacities, and taints, all of a claim on one node, never a device to
two claims; what it cannot evaluate or place is said, never guessed."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml

from services.device.dra.slices import node_slice
from shared.contract.device import DeviceInventory
from shared.contract.subjects import Subjects
from shared.ports.cluster import DeviceTaint, ResourceSlice, Semver, SliceDevice
from shared.sim.cluster import SimCluster
from shared.sim.drasched import (
    DEVICE_CLASSES,
    DeviceRequest,
    Selector,
    SelectorError,
    Unschedulable,
    allocate,
    parse_quantity,
)
from shared.sim.gpus import SimGpus
from shared.sim.resourceapi import SimResourceApi
from shared.sim.spec import SpecError, parse_spec

DRIVER = "gpu.gpuwarden.io"
ROOT = Path(__file__).resolve().parent.parent


def gpu(name: str, product: str, memory: str, *, taints: tuple[DeviceTaint, ...] = (), **extra: object) -> SliceDevice:
    attributes: dict[str, object] = {"type": "gpu", "productName": product, "driverVersion": Semver("550.54.15")}
    attributes.update(extra)
    return SliceDevice(name=name, attributes=attributes, capacity={"memory": memory}, taints=taints)  # type: ignore[arg-type]


def mig(name: str, profile: str, memory: str, multiprocessors: int) -> SliceDevice:
    return SliceDevice(
        name=name,
        attributes={"type": "mig", "profile": profile},
        capacity={"memory": memory, "multiprocessors": str(multiprocessors)},
    )


def node(name: str, *devices: SliceDevice) -> ResourceSlice:
    return ResourceSlice(driver=DRIVER, node=name, pool=name, devices=devices)


H100 = "NVIDIA H100 80GB HBM3"
A10 = "NVIDIA A10"
SLICES = (
    node("node-1", gpu("gpu-0", A10, "23028Mi"), gpu("gpu-1", A10, "23028Mi")),
    node("node-2", gpu("gpu-0", H100, "81559Mi"), gpu("gpu-1", H100, "81559Mi"), mig("mig-0", "1g.10gb", "9984Mi", 16)),
)


def selects(expression: str, device: SliceDevice, driver: str = DRIVER) -> bool:
    return Selector.parse(expression).selects(driver, device)


def test_the_forms_claims_use_are_evaluated() -> None:
    h100 = SLICES[1].devices[0]
    assert selects(f'device.driver == "{DRIVER}"', h100)
    assert not selects('device.driver == "gpu.nvidia.com"', h100)
    assert selects(f'device.attributes["{DRIVER}"].productName == "{H100}"', h100)
    assert selects(f'device.attributes["{DRIVER}"].productName != "{A10}"', h100)
    assert selects(f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) >= 0', h100)
    assert not selects(f'device.capacity["{DRIVER}"].memory.compareTo(quantity("100Gi")) >= 0', h100)
    assert selects(f'device.capacity["{DRIVER}"].memory >= quantity("79Gi")', h100)
    assert selects(f'device.attributes["{DRIVER}"].driverVersion >= semver("550.0.0")', h100)
    assert not selects(f'device.attributes["{DRIVER}"].driverVersion >= semver("560.35.3")', h100)
    small = f'device.capacity["{DRIVER}"].memory < quantity("24Gi")'
    both = f'device.attributes["{DRIVER}"].type == "gpu" && ({small} || !(device.driver == "{DRIVER}"))'
    assert not selects(both, h100) and selects(both, SLICES[0].devices[0])
    assert selects(f'device.capacity["{DRIVER}"].multiprocessors >= quantity("14")', SLICES[1].devices[2])


def test_a_missing_attribute_or_capacity_selects_nothing_never_compares_as_zero() -> None:
    h100 = SLICES[1].devices[0]
    assert not selects(f'device.attributes["{DRIVER}"].profile == ""', h100)
    assert not selects(f'device.attributes["{DRIVER}"].profile != "1g.10gb"', h100)
    assert not selects(f'device.capacity["{DRIVER}"].multiprocessors.compareTo(quantity("0")) >= 0', h100)
    assert not selects('device.attributes["other.example.com"].productName != ""', h100)  # another domain's
    assert not selects(f'device.attributes["{DRIVER}"].productName == 3', h100)  # a type mismatch


@pytest.mark.parametrize(
    "expression",
    [
        "device.driver = 'x'",
        'device.name == "gpu-0"',
        'device.attributes["d"] == "x"',
        'device.capacity["d"].memory.compareTo(quantity("1Gi")) >= 1',
        'device.capacity["d"].memory >= quantity("lots")',
        "size(device.attributes) > 0",
        'device.driver == "a" &&',
        '(device.driver == "a"',
    ],
)
def test_what_it_cannot_evaluate_is_an_error_naming_the_expression(expression: str) -> None:
    with pytest.raises(SelectorError, match=r"CEL selector|quantity"):
        Selector.parse(expression)


def test_quantities() -> None:
    assert parse_quantity("81559Mi") == 81559 * 2**20
    assert parse_quantity("40Gi") == 40 * 2**30 and parse_quantity("16") == 16 and parse_quantity("2k") == 2000
    assert parse_quantity("500m") * 2 == 1
    with pytest.raises(SelectorError):
        parse_quantity("1.5.0Gi")


def test_the_deviceclasses_are_the_ones_deploy_ships() -> None:
    shipped = {
        doc["metadata"]["name"]: tuple(s["cel"]["expression"] for s in doc["spec"]["selectors"])
        for doc in yaml.safe_load_all((ROOT / "deploy/dra/deviceclasses.yaml").read_text())
        if doc and doc.get("kind") == "DeviceClass"
    }
    assert shipped == {name: tuple(s.expression for s in selectors) for name, selectors in DEVICE_CLASSES.items()}


def test_a_claim_gets_the_first_node_that_meets_every_request_and_only_free_devices() -> None:
    big = DeviceRequest(
        "gpus", "gpu.gpuwarden.io", (Selector.parse(f'device.capacity["{DRIVER}"].memory >= quantity("40Gi")'),), 2
    )
    where, devices = allocate([big], SLICES, set())
    assert where == "node-2" and [(d.request, d.pool, d.device) for d in devices] == [
        ("gpus", "node-2", "gpu-0"),
        ("gpus", "node-2", "gpu-1"),
    ]
    any_gpu = DeviceRequest("one", "gpu.gpuwarden.io")
    assert allocate([any_gpu], SLICES, set())[0] == "node-1"
    taken = {(DRIVER, "node-1", "gpu-0"), (DRIVER, "node-1", "gpu-1")}
    where, devices = allocate([any_gpu, DeviceRequest("slice", "mig.gpuwarden.io")], SLICES, taken)
    assert where == "node-2" and [d.device for d in devices] == ["gpu-0", "mig-0"]
    with pytest.raises(Unschedulable, match=r"gpus: node-1: 0, node-2: 1"):
        allocate([big], SLICES, {(DRIVER, "node-2", "gpu-0")})
    every = allocate([DeviceRequest("all", "gpu.gpuwarden.io", all_devices=True)], SLICES, set(), node="node-2")
    assert [d.device for d in every[1]] == ["gpu-0", "gpu-1"]  # every whole GPU of the pod's node, no MIG device
    with pytest.raises(Unschedulable, match="no DeviceClass"):
        allocate([DeviceRequest("x", "tpu.example.com")], SLICES, set())


def test_a_tainted_device_goes_only_to_a_request_that_tolerates_its_taint() -> None:
    xid = DeviceTaint("gpuwarden.io/xid", "79", "NoExecute")
    watched = DeviceTaint("gpuwarden.io/watch", "", "None")
    slices = (
        node("node-1", gpu("gpu-0", H100, "81559Mi", taints=(xid,)), gpu("gpu-1", H100, "81559Mi", taints=(watched,))),
    )
    _, devices = allocate([DeviceRequest("g", "gpu.gpuwarden.io")], slices, set())
    assert [d.device for d in devices] == ["gpu-1"]  # effect None schedules
    with pytest.raises(Unschedulable):
        allocate([DeviceRequest("g", "gpu.gpuwarden.io", count=2)], slices, set())
    tolerant = DeviceRequest("g", "gpu.gpuwarden.io", count=2, tolerates=("gpuwarden.io/xid",))
    assert [d.device for d in allocate([tolerant], slices, set())[1]] == ["gpu-0", "gpu-1"]


async def test_the_simulated_api_allocates_once_and_never_one_device_to_two_claims(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    api = SimResourceApi(redis_client, subjects)
    for resource_slice in SLICES:
        await api.publish_slice(resource_slice)
    request = DeviceRequest("gpu", "gpu.gpuwarden.io")
    results = await asyncio.gather(
        *(api.allocate_claim("llm", f"claim-{i}", f"uid-{i}", [request]) for i in range(4)), return_exceptions=False
    )
    devices = [(c.devices[0].pool, c.devices[0].device) for _, c in results]
    assert len(set(devices)) == 4 and all(c.allocated for _, c in results)
    assert {where for where, _ in results} == {"node-1", "node-2"}
    with pytest.raises(Unschedulable):
        await api.allocate_claim("llm", "claim-5", "uid-5", [request])
    again = await api.allocate_claim("llm", "claim-0", "uid-0", [request])  # allocated: answered as it is
    assert again == results[0] and await api.claim("llm", "claim-0") == results[0][1]
    assert await api.release_claim("llm", "claim-0") and not await api.release_claim("llm", "claim-0")
    _, freed = await api.allocate_claim("llm", "claim-5", "uid-5", [request])
    assert (freed.devices[0].pool, freed.devices[0].device) == devices[0]


CLAIM_SPEC = """
nodes:
  - name: node-1
    gpus: [{model: NVIDIA A10, memory_mib: 23028, count: 2, nvlink: false}]
  - name: node-2
    gpus: [{model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 2}]
deployments:
  - name: big
    namespace: llm
    replicas: 3
    kv_blocks: 1024
    model: {layers: 2, kv_heads: 2, head_dim: 16, max_model_len: 256, weights_mib: 0}
    claim:
      selectors: ['device.capacity["gpu.gpuwarden.io"].memory.compareTo(quantity("40Gi")) >= 0']
  - name: any
    namespace: llm
    replicas: 1
    kv_blocks: 1024
    model: {layers: 2, kv_heads: 2, head_dim: 16, max_model_len: 256, weights_mib: 0}
"""


def test_a_spec_names_a_claim_it_cannot_evaluate() -> None:
    bad = CLAIM_SPEC.replace('.compareTo(quantity("40Gi")) >= 0', " is big")
    with pytest.raises(SpecError, match=r"claim\.selectors\[0\]: CEL selector"):
        parse_spec(bad, "claims.yaml")
    with pytest.raises(SpecError, match=r"claim\.device_class: 'tpu' is none of"):
        parse_spec(CLAIM_SPEC.replace("    claim:\n", "    claim:\n      device_class: tpu\n"), "claims.yaml")


async def test_pods_asking_by_claim_wait_for_a_slice_and_get_only_the_devices_it_selects(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    """The simulated scheduler end to end: claim pods stay Pending until the nodes' device services publish
    slices, then go where the selector matches (40 GiB or more: node-2's H100s), each holding its own devices
    (whose holders are what a failing GPU's evacuation asks), one more than there are devices waiting; a pod
    without a claim takes GPUs by count (the one here goes to node-1, a tie of free GPUs broken by name); a device
    tainted NoExecute is given to no new pod."""
    spec = parse_spec(CLAIM_SPEC, "claims.yaml")
    cluster = await SimCluster.create(redis_client, subjects, spec)

    async def placed(deployment: str) -> dict[str, str]:
        return {p.name: p.node for p in await cluster.pods() if p.deployment == deployment and p.phase == "Running"}

    assert await placed("big") == {} and list((await placed("any")).values()) == ["node-1"]
    for name in ("node-1", "node-2"):
        gpus = SimGpus(redis_client, subjects, spec, name)
        versions = await gpus.versions()
        inventory = DeviceInventory(node=name, driver_version=versions.driver, gpus=await gpus.devices())
        assert await cluster.publish_resource_slice(node_slice(inventory))
    big = await placed("big")
    on_two = await cluster.gpu_holders("node-2")
    assert sorted(big.values()) == ["node-2", "node-2"], big
    assert sorted(len(holders) for holders in on_two.values()) == [1, 1]  # each H100 held by one claim pod
    assert {h.split("/")[1] for holders in on_two.values() for h in holders} == set(big)
    pending = [p for p in await cluster.pods() if p.deployment == "big" and p.phase == "Pending"]
    assert len(pending) == 1  # no third device of 40 GiB
    for name in big:  # each pod's claim, as the DRA kubelet plugin reads it to prepare it: the scheduler's devices
        claim = await cluster.resource_claim("llm", f"{name}-gpus")
        assert (
            claim is not None
            and claim.allocated
            and claim.uid == next(p.uid for p in await cluster.pods() if p.name == name)
        )
        assert [(d.pool, d.device) for d in claim.devices] == [
            ("node-2", f"gpu-{i}") for i, holders in on_two.items() if f"llm/{name}" in holders
        ]
    assert await cluster.resource_claim("llm", f"{pending[0].name}-gpus") is None  # not allocated yet
    assert await cluster.resource_claim("llm", "any-1-gpus") is None  # a pod asking by count has no claim

    # the device of one claim pod fails (tainted NoExecute); its pod goes; the replacement is not given it
    two = (await cluster.resources.slices())[f"node-2-{DRIVER}"].slice
    doomed = on_two[1][0].split("/")[1]
    tainted = tuple(
        dataclasses.replace(d, taints=(DeviceTaint("gpuwarden.io/xid", "79", "NoExecute"),)) if d.name == "gpu-1" else d
        for d in two.devices
    )
    assert await cluster.publish_resource_slice(dataclasses.replace(two, devices=tainted))
    await cluster.kill_pod("llm", doomed)
    await cluster.tick()
    after = await placed("big")
    assert doomed not in after and list(after.values()) == ["node-2"]
    assert set((await cluster.gpu_holders("node-2")).keys()) == {0}


def test_up_runs_the_device_services_as_dra_drivers_for_a_spec_whose_pods_ask_by_claim(tmp_path: Path) -> None:
    """``gpuwarden up`` with deploy/sim/dra.yaml: the device services publish slices (``both``), their kubelet
    folders under the run's home unless the environment names them; a spec without claims changes nothing."""
    from shared.console.process import _claims, _dra_env

    env = {"GPUWARDEN_BACKEND": "sim", "GPUWARDEN_SIM_SPEC": str(ROOT / "deploy/sim/dra.yaml")}
    assert _claims(env)
    assert not _claims(dict(env, GPUWARDEN_SIM_SPEC=str(ROOT / "deploy/sim/synthetic.yaml")))
    assert not _claims(dict(env, GPUWARDEN_BACKEND="kube"))
    made = _dra_env(dict(env, GPUWARDEN_CDI_DIR=str(tmp_path / "mine")), tmp_path / "node-1")
    assert made["GPUWARDEN_DEVICE_API"] == "both" and made["GPUWARDEN_CDI_DIR"] == str(tmp_path / "mine")
    assert made["GPUWARDEN_DRA_PLUGIN_DIR"] == str(tmp_path / "node-1" / "plugin")
    assert all(
        Path(made[k]).is_dir() for k in ("GPUWARDEN_DRA_PLUGIN_DIR", "GPUWARDEN_DRA_REGISTRY_DIR", "GPUWARDEN_CDI_DIR")
    )
