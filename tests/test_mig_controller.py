"""The MIG controller: its pure planning core (what fits, what is refused, that a plan converges), the controller on
real Redis with the simulated GPUs and cluster, and the device service applying layouts end to end over NATS, with
the kubelet's view of the device plugin while it works, and the drain before any change: with the real checkpoint
service and KV agents every session is committed before the first MIG change, and a failed drain, or none in time,
leaves the GPUs as they are."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.device.config import DeviceSettings, load, parse_plugin_config
from services.device.dra.slices import MIG_CHANGING_TAINT
from services.device.gen import deviceplugin_pb2 as pb
from services.device.mig import CONFIG_LABEL, REASON_ANNOTATION, STATE_LABEL, MigController
from services.device.mig_plan import LayoutRefused, MigStep, layout, plan
from services.device.service import DeviceService
from shared.clients.drains import RecordReader, VerdictWake
from shared.contract.annotations import MIG_DRAIN_ANNOTATION
from shared.contract.base import Event
from shared.contract.checkpoint import CheckpointSaved
from shared.contract.configdocs import MigConfig, MigDeviceGroup
from shared.contract.device import GpuDevice, MigConfigChanged, MigInstance
from shared.contract.node import DrainCompleted, DrainFailed, DrainQuery, DrainRecord, DrainRequested
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, VersionedConfig
from shared.plumbing.errors import InvalidConfig, SettingsError
from shared.plumbing.settings import Settings
from shared.ports.cluster import ResourceSlice
from shared.ports.gpu import GpuError, MigProfile
from shared.sim.cluster import SimCluster
from shared.sim.faults import FaultError, MigChangeFault, apply_fault, fault_cli, parse_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import parse_spec
from shared.wiring import Wiring
from tests.fake_dra_kubelet import dra_settings
from tests.fake_kubelet import FakeKubelet, listed, plugin_stub, read
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content

H100 = "NVIDIA H100 80GB HBM3"
PROFILES = [
    MigProfile(name="1g.10gb", slices=1, max_count=7, memory_mib=9856),
    MigProfile(name="1g.20gb", slices=1, max_count=4, memory_mib=19968),
    MigProfile(name="2g.20gb", slices=2, max_count=3, memory_mib=20096),
    MigProfile(name="3g.40gb", slices=3, max_count=2, memory_mib=40192),
    MigProfile(name="4g.40gb", slices=4, max_count=1, memory_mib=40192),
    MigProfile(name="7g.80gb", slices=7, max_count=1, memory_mib=80384),
    MigProfile(name="1g.10gb+me", slices=1, max_count=1, memory_mib=9856),
]


def h100(index: int, *profiles: str, enabled: bool | None = None) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=f"GPU-{index}",
        model=H100,
        mig_capable=True,
        mig_enabled=bool(profiles) if enabled is None else enabled,
        mig_instances=[MigInstance(uuid=f"MIG-{index}-{k}", profile=p) for k, p in enumerate(profiles)],
    )


L4 = GpuDevice(index=2, uuid="GPU-2", model="NVIDIA L4")


def profiles_of(*gpus: GpuDevice) -> dict[str, list[MigProfile]]:
    return {g.uuid: PROFILES for g in gpus if g.mig_capable}


def steps_text(steps: list[MigStep]) -> list[str]:
    return [str(s) for s in steps]


# -- the pure core ------------------------------------------------------------------------------------------------
def test_a_gpu_already_in_its_layout_needs_nothing() -> None:
    gpus = [h100(0, "3g.40gb", "1g.10gb", "1g.10gb"), h100(1), L4]
    groups = [
        MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"1g.10gb": 2, "3g.40gb": 1, "2g.20gb": 0}),
        MigDeviceGroup(devices=[1, 2], mig_enabled=False),
    ]
    assert plan("mine", groups, gpus, profiles_of(*gpus)) == []


def test_enabling_creates_the_largest_instances_first_and_leaves_other_gpus_alone() -> None:
    gpus = [h100(0), h100(1, "7g.80gb"), L4]
    groups = [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"1g.10gb": 4, "3g.40gb": 1})]
    assert steps_text(plan("mixed", groups, gpus, profiles_of(*gpus))) == [
        "GPU 0: enable MIG mode",
        "GPU 0: create 3g.40gb",
        "GPU 0: create 1g.10gb",
        "GPU 0: create 1g.10gb",
        "GPU 0: create 1g.10gb",
        "GPU 0: create 1g.10gb",
    ]


def test_a_different_layout_is_made_afresh_and_disabling_destroys_first() -> None:
    gpus = [h100(0, "7g.80gb"), h100(1, "3g.40gb", "3g.40gb"), L4]
    groups = [
        MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"3g.40gb": 2}),
        MigDeviceGroup(devices=[1, 2], mig_enabled=False),
    ]
    assert steps_text(plan("swap", groups, gpus, profiles_of(*gpus))) == [
        "GPU 0: destroy 7g.80gb MIG-0-0",
        "GPU 0: create 3g.40gb",
        "GPU 0: create 3g.40gb",
        "GPU 1: destroy 3g.40gb MIG-1-0",
        "GPU 1: destroy 3g.40gb MIG-1-1",
        "GPU 1: disable MIG mode",
    ]
    # MIG on with no instances yet: only the instances are made.
    empty = [h100(0, enabled=True)]
    assert steps_text(plan("x", [MigDeviceGroup(devices="all", mig_enabled=True)], empty, profiles_of(*empty))) == []
    assert steps_text(
        plan("x", [MigDeviceGroup(devices="all", mig_enabled=True, mig_devices={"7g.80gb": 1})], empty, {})
    ) == ["GPU 0: create 7g.80gb"]


@pytest.mark.parametrize(
    ("groups", "reason"),
    [
        (
            [MigDeviceGroup(devices=[0, 3], mig_enabled=False)],
            r"^bad\[0\]\.devices: GPU index 3 is not on this node \(GPUs: 0, 1, 2\)$",
        ),
        (
            [MigDeviceGroup(devices="all", mig_enabled=False), MigDeviceGroup(devices=[1], mig_enabled=False)],
            r"^bad\[1\]\.devices: GPU 1 is already covered by bad\[0\]$",
        ),
        (
            [MigDeviceGroup(devices="all", mig_enabled=True, mig_devices={"1g.10gb": 7})],
            r"^bad\[0\]: GPU 2 \(NVIDIA L4\) is not MIG-capable$",
        ),
        (
            [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"1g.5gb": 1})],
            r"^bad\[0\]\.mig-devices: GPU 0 \(NVIDIA H100 80GB HBM3\) has no MIG profile '1g\.5gb' "
            r"\(it offers: 1g\.10gb, 1g\.20gb, 2g\.20gb, 3g\.40gb, 4g\.40gb, 7g\.80gb, 1g\.10gb\+me\)$",
        ),
        (
            [MigDeviceGroup(devices=[1], mig_enabled=True, mig_devices={"3g.40gb": 3})],
            r"^bad\[0\]\.mig-devices: GPU 1 \(.*\): 3 x 3g\.40gb asked for, at most 2 fit$",
        ),
        (
            [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"3g.40gb": 2, "1g.10gb": 2})],
            r"^bad\[0\]\.mig-devices: GPU 0 \(.*\): the layout needs 8 compute slices, the GPU has 7$",
        ),
    ],
)
def test_a_layout_that_does_not_fit_is_refused_with_the_reason(groups: list[MigDeviceGroup], reason: str) -> None:
    gpus = [h100(0), h100(1), L4]
    with pytest.raises(LayoutRefused, match=reason):
        plan("bad", groups, gpus, profiles_of(*gpus))


def test_unknown_profiles_still_bound_the_slices_and_unknown_layouts_are_named() -> None:
    gpus = [h100(0)]
    fits = [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"4g.40gb": 1, "3g.40gb": 1})]
    assert len(plan("x", fits, gpus, {})) == 3
    too_many = [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"4g.40gb": 1, "2g.20gb": 2})]
    with pytest.raises(LayoutRefused, match="needs 8 compute slices, a GPU has at most 7"):
        plan("x", too_many, gpus, {})
    doc = MigConfig(mig_configs={"a": fits, "b": fits})
    assert layout(doc, "a") == fits
    with pytest.raises(LayoutRefused, match=r"no layout 'c' in the 'mig' configuration document \(layouts: a, b\)"):
        layout(doc, "c")


def apply_steps(gpus: list[GpuDevice], steps: list[MigStep]) -> list[GpuDevice]:
    """What the steps do to the GPUs, as a model GPU would do it (refusing what a GPU refuses)."""
    by_uuid = {g.uuid: g for g in gpus}
    for n, step in enumerate(steps):
        gpu = by_uuid[step.gpu_uuid]
        match step.action:
            case "enable":
                assert not gpu.mig_enabled
                gpu = msgspec.structs.replace(gpu, mig_enabled=True)
            case "disable":
                assert gpu.mig_enabled and not gpu.mig_instances
                gpu = msgspec.structs.replace(gpu, mig_enabled=False)
            case "destroy":
                assert any(i.uuid == step.instance_uuid for i in gpu.mig_instances)
                kept = [i for i in gpu.mig_instances if i.uuid != step.instance_uuid]
                gpu = msgspec.structs.replace(gpu, mig_instances=kept)
            case "create":
                assert gpu.mig_enabled
                made = MigInstance(uuid=f"MIG-new-{n}", profile=step.profile)
                gpu = msgspec.structs.replace(gpu, mig_instances=[*gpu.mig_instances, made])
        by_uuid[gpu.uuid] = gpu
    return list(by_uuid.values())


present = st.lists(st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]), max_size=4)
gpus_now = st.tuples(present, present, st.booleans(), st.booleans()).map(
    lambda t: [h100(0, *t[0], enabled=t[2] or bool(t[0])), h100(1, *t[1], enabled=t[3] or bool(t[1])), L4]
)
counts = st.dictionaries(st.sampled_from([p.name for p in PROFILES]), st.integers(0, 7), max_size=3)
entries = st.lists(
    st.tuples(st.sampled_from([[0], [1], [2], [0, 1], [3]]), st.booleans(), counts), min_size=1, max_size=2
).map(lambda es: [MigDeviceGroup(devices=d, mig_enabled=on, mig_devices=c if on else {}) for d, on, c in es])


@given(gpus_now, entries)
def test_a_plan_either_is_refused_or_converges_touching_only_the_named_gpus(
    gpus: list[GpuDevice], groups: list[MigDeviceGroup]
) -> None:
    profiles = profiles_of(*gpus)
    try:
        steps = plan("p", groups, gpus, profiles)
    except LayoutRefused:
        return
    named = {i for g in groups for i in (g.devices if g.devices != "all" else (0, 1, 2))}
    assert {s.gpu_index for s in steps} <= named
    after = apply_steps(gpus, steps)
    assert plan("p", groups, after, profiles) == []
    for g in groups:
        for index in g.devices if g.devices != "all" else ():
            gpu = next(x for x in after if x.index == index)
            if gpu.mig_capable:
                assert gpu.mig_enabled == g.mig_enabled
            if g.mig_enabled:
                want = Counter({p: n for p, n in g.mig_devices.items() if n})
                assert Counter(i.profile for i in gpu.mig_instances) == want
                used = sum(next(p.slices for p in PROFILES if p.name == name) * n for name, n in want.items())
                assert used <= 7


# -- the configuration document and the settings -------------------------------------------------------------
async def test_the_mig_document_is_refused_at_write_time_naming_the_field(
    subjects: Subjects, redis_client: aioredis.Redis
) -> None:
    store = ConfigStore(redis_client, subjects)
    good = b'{"version": "v1", "mig-configs": {"all-1g.10gb": [{"devices": "all", "mig-enabled": true, "mig-devices": {"1g.10gb": 7}}]}}'  # noqa: E501
    assert await store.write_raw("mig", good, 0, "test") == 1
    stored = await store.read("mig")
    assert stored is not None and isinstance(stored.doc, MigConfig)
    assert stored.doc.mig_configs["all-1g.10gb"][0] == MigDeviceGroup(
        devices="all", mig_enabled=True, mig_devices={"1g.10gb": 7}
    )
    refused = [
        (b'{"mig-configs": {"a": [{"devices": "all", "mig_enabled": true}]}}', "unknown field `mig_enabled`"),
        (
            b'{"mig-configs": {"a": [{"devices": "some", "mig-enabled": true}]}}',
            r"`\$.mig-configs\[...\]\[0\].devices`",
        ),
        (b'{"mig-configs": {"a": [{"devices": [0, 0], "mig-enabled": true}]}}', "a GPU index is listed twice"),
        (
            b'{"mig-configs": {"a": [{"devices": [0], "mig-enabled": false, "mig-devices": {"1g.10gb": 1}}]}}',
            "mig-devices: instances are asked for while mig-enabled is false",
        ),
        (
            b'{"mig-configs": {"a": [{"devices": [0], "mig-enabled": true, "mig-devices": {"1g.10": 1}}]}}',
            r"`key` in `\$.mig-configs\[...\]\[0\].mig-devices`",
        ),
        (b'{"mig-configs": {"a": []}}', r"length >= 1 - at `\$.mig-configs\[...\]`"),
        (b'{"version": "v2"}', r"`\$.version`"),
        (b'{"mig-configs": {"bad name": [{"devices": "all", "mig-enabled": false}]}}', r"`key` in `\$.mig-configs`"),
    ]
    for raw, match in refused:
        with pytest.raises(InvalidConfig, match=match):
            await store.write_raw("mig", raw, 1, "test")
    assert (await store.read("mig")).version == 1  # type: ignore[union-attr]


def test_mig_settings() -> None:
    defaults = load({})
    assert (defaults.mig_step_timeout_s, defaults.mig_reconcile_s, defaults.mig_retry_s) == (120.0, 60.0, 300.0)
    assert (defaults.mig_checkpoint, defaults.mig_drain_timeout_s) == (True, 300.0)
    assert load({"GPUWARDEN_MIG_STEP_TIMEOUT_S": "2.5"}).mig_step_timeout_s == 2.5
    assert load({"GPUWARDEN_MIG_CHECKPOINT": "off"}).mig_checkpoint is False
    assert load({"GPUWARDEN_MIG_CHECKPOINT": " On "}).mig_checkpoint is True
    assert load({"GPUWARDEN_MIG_DRAIN_TIMEOUT_S": "45"}).mig_drain_timeout_s == 45.0
    with pytest.raises(SettingsError, match="GPUWARDEN_MIG_STEP_TIMEOUT_S='0': must be positive"):
        load({"GPUWARDEN_MIG_STEP_TIMEOUT_S": "0"})
    with pytest.raises(SettingsError, match="GPUWARDEN_MIG_CHECKPOINT='no': expected one of on, off"):
        load({"GPUWARDEN_MIG_CHECKPOINT": "no"})
    with pytest.raises(SettingsError, match="GPUWARDEN_MIG_DRAIN_TIMEOUT_S='-1'"):
        load({"GPUWARDEN_MIG_DRAIN_TIMEOUT_S": "-1"})


# -- the simulated GPUs -------------------------------------------------------------------------------------------
SPEC = f"""
nodes:
  - name: node-1
    gpus:
      - {{model: {H100}, memory_mib: 81559, count: 2, mig_profiles: ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]}}
      - {{model: NVIDIA L4, memory_mib: 23034, count: 1, nvlink: false}}
"""

LAYOUTS = MigConfig(
    mig_configs={
        "all-disabled": [MigDeviceGroup(devices="all", mig_enabled=False)],
        "first-1g": [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"1g.10gb": 7})],
        "mixed": [
            MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"3g.40gb": 1, "1g.10gb": 4}),
            MigDeviceGroup(devices=[1], mig_enabled=True, mig_devices={"7g.80gb": 1}),
        ],
        "too-big": [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={"3g.40gb": 2, "2g.20gb": 1})],
        "l4": [MigDeviceGroup(devices=[2], mig_enabled=True, mig_devices={"1g.10gb": 1})],
    }
)


@pytest.fixture
async def sim_gpus(redis_client: aioredis.Redis, subjects: Subjects) -> SimGpus:
    gpus = SimGpus(redis_client, subjects, parse_spec(SPEC, "spec.yaml"), "node-1", poll_s=0.02)
    await gpus.attach()
    return gpus


@pytest.fixture
async def cluster(redis_client: aioredis.Redis, subjects: Subjects) -> AsyncIterator[SimCluster]:
    c = await SimCluster.create(redis_client, subjects, parse_spec(SPEC, "spec.yaml"))
    yield c
    await c.close()


async def test_simulated_gpus_offer_their_profiles_and_mig_faults_fail_hang_and_clear(
    sim_gpus: SimGpus, redis_client: aioredis.Redis, subjects: Subjects, settings: Settings
) -> None:
    a, _b, l4 = await sim_gpus.devices()
    assert [p.name for p in await sim_gpus.mig_profiles(a.uuid)] == ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]
    assert (await sim_gpus.mig_profiles(a.uuid))[2] == MigProfile("3g.40gb", slices=3, max_count=2, memory_mib=40960)
    assert await sim_gpus.mig_profiles(l4.uuid) == []

    await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="fail", reason="GPU in use"))
    with pytest.raises(GpuError, match=r"enabling MIG mode on .* failed: GPU in use \(SIMULATED\)"):
        await sim_gpus.set_mig_mode(a.uuid, True)
    assert not (await sim_gpus.devices())[0].mig_enabled

    assert await asyncio.to_thread(fault_cli, ["mig", "--node", "node-1", "--mode", "hang"], settings) == 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sim_gpus.set_mig_mode(a.uuid, True), 0.2)
    done = await apply_fault(redis_client, subjects, parse_fault('{"kind": "mig", "node": "node-1", "mode": "clear"}'))
    assert done == "MIG changes on node-1: normal again"
    await sim_gpus.set_mig_mode(a.uuid, True)
    made = await sim_gpus.create_mig_instance(a.uuid, "3g.40gb")
    assert [i.uuid for i in (await sim_gpus.devices())[0].mig_instances] == [made.uuid]
    with pytest.raises(FaultError, match=r"`\$.mode`"):
        parse_fault('{"kind": "mig", "node": "node-1", "mode": "sometimes"}')


# -- the controller on the simulated GPUs and cluster ------------------------------------------------------------
class Recorder:
    """What the controller tells the world: its state events, the drains it asks for (passed on to ``bus`` when
    given), and the hook calls in order."""

    def __init__(self, bus: Bus | None = None) -> None:
        self.events: list[MigConfigChanged] = []
        self.drains: list[DrainRequested] = []
        self.calls: list[str] = []
        self.bus = bus

    async def publish(self, event: Event) -> None:
        if isinstance(event, MigConfigChanged):
            self.events.append(event)
            return
        assert isinstance(event, DrainRequested)
        self.drains.append(event)
        if self.bus is not None:
            await self.bus.publish(event)

    def hook(self, name: str) -> Any:
        async def call() -> None:
            self.calls.append(name)

        return call


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def controller_for(
    gpus: SimGpus,
    cluster: SimCluster,
    doc: MigConfig,
    recorder: Recorder,
    clock: Callable[[], float],
    step_timeout_s: float = 5.0,
    record: RecordReader | None = None,
    **drain: float,
) -> MigController:
    versioned = VersionedConfig(name="mig", version=1, doc=doc, updated_at=0.0, updated_by="test")

    async def connect() -> SimCluster:
        return cluster

    return MigController(
        "node-1",
        gpus,
        connect,
        lambda: versioned,
        recorder.publish,
        step_timeout_s=step_timeout_s,
        reconcile_s=60.0,
        retry_s=300.0,
        pause=recorder.hook("pause"),
        resume=recorder.hook("resume"),
        refresh=recorder.hook("refresh"),
        clock=clock,
        record=record,
        **drain,
    )


async def node_state(cluster: SimCluster) -> tuple[str | None, str | None]:
    info = await cluster.node("node-1")
    assert info is not None
    return info.labels.get(STATE_LABEL), info.annotations.get(REASON_ANNOTATION)


async def test_the_controller_applies_a_layout_once_and_then_leaves_it_alone(
    sim_gpus: SimGpus, cluster: SimCluster
) -> None:
    recorder = Recorder()
    controller = controller_for(sim_gpus, cluster, LAYOUTS, recorder, Clock())
    await controller.reconcile()
    assert recorder.events == [] and controller.describe()["state"] == "idle"  # no label: nothing to do

    await cluster.set_node_labels("node-1", {CONFIG_LABEL: "mixed"})
    await controller.reconcile()
    a, b, l4 = await sim_gpus.devices()
    assert sorted(i.profile for i in a.mig_instances) == ["1g.10gb"] * 4 + ["3g.40gb"]
    assert [i.profile for i in b.mig_instances] == ["7g.80gb"]
    assert not l4.mig_enabled
    assert await node_state(cluster) == ("success", None)
    assert [(e.config, e.state, e.reason) for e in recorder.events] == [
        ("mixed", "pending", ""),
        ("mixed", "success", ""),
    ]
    assert recorder.events[0].steps[:2] == ["GPU 0: enable MIG mode", "GPU 0: create 3g.40gb"]
    assert recorder.calls == ["pause", "refresh", "resume"]

    # Level-triggered and idempotent: the same layout again changes nothing and says nothing.
    await controller.reconcile()
    assert (await sim_gpus.devices())[0].mig_instances == a.mig_instances
    assert len(recorder.events) == 2 and recorder.calls == ["pause", "refresh", "resume"]

    # Another layout: GPU 0 is made afresh, GPU 1 goes back to whole.
    await cluster.set_node_labels("node-1", {CONFIG_LABEL: "all-disabled"})
    await controller.reconcile()
    assert [(g.mig_enabled, g.mig_instances) for g in await sim_gpus.devices()] == [(False, [])] * 3
    assert [e.state for e in recorder.events] == ["pending", "success", "pending", "success"]


async def test_a_layout_that_does_not_fit_changes_nothing(sim_gpus: SimGpus, cluster: SimCluster) -> None:
    recorder = Recorder()
    controller = controller_for(sim_gpus, cluster, LAYOUTS, recorder, Clock())
    before = await sim_gpus.devices()
    for name, reason in [
        ("too-big", "refused: too-big[0].mig-devices: GPU 0 (NVIDIA H100 80GB HBM3): the layout needs 8 compute"),
        ("l4", "refused: l4[0]: GPU 2 (NVIDIA L4) is not MIG-capable"),
        ("nope", "refused: no layout 'nope' in the 'mig' configuration document (layouts: all-disabled, first-1g"),
    ]:
        await cluster.set_node_labels("node-1", {CONFIG_LABEL: name})
        await controller.reconcile()
        state, annotation = await node_state(cluster)
        assert state == "failed" and annotation is not None and annotation.startswith(reason)
        assert recorder.events[-1].state == "failed" and recorder.events[-1].reason == annotation
        await controller.reconcile()  # refused again: already reported, nothing new
    assert await sim_gpus.devices() == before
    assert [e.state for e in recorder.events] == ["failed"] * 3
    assert recorder.calls == []  # the plugin was never paused


async def test_a_hung_step_fails_the_layout_and_it_is_tried_again_later(
    sim_gpus: SimGpus, cluster: SimCluster, redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    recorder = Recorder()
    clock = Clock()
    controller = controller_for(sim_gpus, cluster, LAYOUTS, recorder, clock, step_timeout_s=0.3)
    await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="hang"))
    await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
    await controller.reconcile()
    state, reason = await node_state(cluster)
    assert state == "failed" and reason == "GPU 0: enable MIG mode: did not finish within 0.3s"
    assert [e.state for e in recorder.events] == ["pending", "failed"]
    assert recorder.calls == ["pause", "refresh", "resume"]  # the plugin is back, not left paused

    # Within the retry period: reported as failed again (never back to pending), nothing tried.
    await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="clear"))
    await cluster.set_node_labels("node-1", {STATE_LABEL: "pending"})  # as a crash mid-change would leave it
    await controller.reconcile()
    assert await node_state(cluster) == ("failed", reason)
    assert not (await sim_gpus.devices())[0].mig_enabled

    clock.now += 300.0
    await controller.reconcile()
    assert await node_state(cluster) == ("success", None)
    assert len((await sim_gpus.devices())[0].mig_instances) == 7


async def test_a_failing_step_is_reported_with_the_gpu_s_reason(
    sim_gpus: SimGpus, cluster: SimCluster, redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    recorder = Recorder()
    controller = controller_for(sim_gpus, cluster, LAYOUTS, recorder, Clock())
    await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
    await controller.reconcile()
    await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="fail", reason="GPU in use"))
    await cluster.set_node_labels("node-1", {CONFIG_LABEL: "all-disabled"})  # a new label is tried at once
    await controller.reconcile()
    state, reason = await node_state(cluster)
    assert state == "failed" and reason is not None
    assert reason.startswith("GPU 0: destroy 1g.10gb MIG-") and reason.endswith("failed: GPU in use (SIMULATED)")


# -- the device service, end to end -----------------------------------------------------------------------------
async def mig_events(bus: Bus, subjects: Subjects) -> list[MigConfigChanged]:
    seen: list[MigConfigChanged] = []

    async def keep(event: MigConfigChanged) -> None:
        seen.append(event)

    await bus.subscribe(subjects.pattern("device.mig.config", node="node-1"), keep, accepts=(MigConfigChanged,))
    return seen


async def heard(bus: Bus, subjects: Subjects, kind: type[Event], node: str = "node-1") -> list[Any]:
    """Every event of ``kind`` about ``node`` heard from now on."""
    seen: list[Any] = []

    async def keep(event: Event) -> None:
        seen.append(event)

    tag = kind.__struct_config__.tag
    assert isinstance(tag, str)
    await bus.subscribe(subjects.pattern(tag, node=node), keep, accepts=(kind,))
    return seen


@contextlib.asynccontextmanager
async def device_service(settings: Settings, service: DeviceService) -> AsyncIterator[Any]:
    running = await start_service(service, settings, Wiring)
    try:
        yield running
    finally:
        await running.stop(grace=1)


async def test_the_device_service_applies_a_layout_pausing_the_plugin_meanwhile(
    settings: Settings,
    subjects: Subjects,
    bus: Bus,
    redis_client: aioredis.Redis,
    sim_gpus: SimGpus,
    cluster: SimCluster,
    plugin_dir: Path,
    kubelet: FakeKubelet,
) -> None:
    events = await mig_events(bus, subjects)
    drains = await heard(bus, subjects, DrainRequested)
    device_settings = DeviceSettings(
        inventory_s=30.0,
        plugin_dir=plugin_dir,
        plugin="on",
        plugin_config=parse_plugin_config("mig_strategy: mixed"),
        kubelet_poll_s=0.05,
        cdi_dir=plugin_dir / "cdi",
        mig_step_timeout_s=30.0,
        mig_reconcile_s=30.0,
        mig_checkpoint=False,
    )
    service = DeviceService(device_settings, gpus=sim_gpus, cluster=cluster)
    async with device_service(settings, service) as running:
        reg = await kubelet.registration()
        a, b, l4 = (d.uuid for d in await sim_gpus.devices())
        async with plugin_stub(plugin_dir, reg.endpoint) as stub:
            stream = stub.ListAndWatch(pb.Empty())
            assert set(listed(await read(stream))) == {a, b, l4}

            # The label first: no document yet, so the controller waits; the document wakes it. The first MIG
            # change hangs, so the kubelet's view while the controller works can be looked at.
            await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="hang"))
            await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
            await eventually(lambda: running.ctx.health()["mig"]["state"] == "waiting")
            await ConfigStore(redis_client, subjects).write("mig", LAYOUTS, 0, "test")
            assert listed(await read(stream)) == {}  # paused: nothing advertised
            assert (await node_state(cluster))[0] == "pending"
            assert running.ctx.health()["device_plugin"]["paused"] is True

            await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="clear"))
            assert set(listed(await read(stream))) == {b, l4}  # GPU 0 is now sliced
            mig = await kubelet.registration()
            assert mig.resource_name == "nvidia.com/mig-1g.10gb"
            async with plugin_stub(plugin_dir, mig.endpoint) as slices:
                instances = listed(await read(slices.ListAndWatch(pb.Empty())))
        gpu0 = (await sim_gpus.devices())[0]
        assert set(instances) == {i.uuid for i in gpu0.mig_instances} and len(instances) == 7
        await eventually(lambda: [e.state for e in events] == ["pending", "success"])
        assert await node_state(cluster) == ("success", None)
        assert service.gpu_state.inventory is not None and len(service.gpu_state.inventory.gpus[0].mig_instances) == 7
        assert running.ctx.health()["mig"]["state"] == "success"
        assert running.ctx.health()["device_plugin"]["paused"] is False
        # GPUWARDEN_MIG_CHECKPOINT=off: the GPUs changed without a drain (it would have gone out before the first
        # step, on the same connection as the state events heard since).
        assert drains == []
        info = await cluster.node("node-1")
        assert info is not None and MIG_DRAIN_ANNOTATION not in info.annotations


async def test_the_device_service_refuses_a_bad_layout_and_fails_a_hung_one_without_wedging(
    settings: Settings,
    subjects: Subjects,
    bus: Bus,
    redis_client: aioredis.Redis,
    sim_gpus: SimGpus,
    cluster: SimCluster,
) -> None:
    events = await mig_events(bus, subjects)
    await ConfigStore(redis_client, subjects).write("mig", LAYOUTS, 0, "test")
    device_settings = DeviceSettings(
        inventory_s=30.0,
        plugin="off",
        mig_step_timeout_s=0.3,
        mig_reconcile_s=30.0,
        mig_retry_s=0.5,
        mig_checkpoint=False,
    )
    service = DeviceService(device_settings, gpus=sim_gpus, cluster=cluster)
    async with device_service(settings, service):
        before = await sim_gpus.devices()
        await cluster.set_node_labels("node-1", {CONFIG_LABEL: "too-big"})  # the node watch wakes the controller
        refused = await eventually(lambda: events and events[0])
        assert refused.state == "failed" and "the layout needs 8 compute slices, the GPU has 7" in refused.reason
        assert await node_state(cluster) == ("failed", refused.reason)
        assert await sim_gpus.devices() == before

        await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="hang"))
        await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
        failed = await eventually(lambda: len(events) >= 3 and events[2])
        assert [e.state for e in events[1:3]] == ["pending", "failed"]
        assert failed.reason == "GPU 0: enable MIG mode: did not finish within 0.3s"
        assert await node_state(cluster) == ("failed", failed.reason)

        # The fault goes away; after the retry period the layout is applied (the period wakes it, not an event).
        await apply_fault(redis_client, subjects, MigChangeFault(node="node-1", mode="clear"))
        service.mig.reconcile_s = 0.2  # type: ignore[union-attr]
        service.mig.wake()  # type: ignore[union-attr]
        await eventually(lambda: events[-1].state == "success")
        assert len((await sim_gpus.devices())[0].mig_instances) == 7
        assert await node_state(cluster) == ("success", None)


# -- the drain before any change ------------------------------------------------------------------------------------
class Checkpointing:
    """The real checkpoint service, and KV agents holding sessions on node-1 (real NATS, Redis and files)."""

    def __init__(self, service: CheckpointService, store: FileStore, settings: Settings, subjects: Subjects) -> None:
        self.service = service
        self.store = store
        self.settings = settings
        self.subjects = subjects
        self.agents: list[tuple[AgentEndpoint, Bus]] = []
        self.sessions: list[str] = []

    async def add_pod(self, name: str, sessions: int, *, serve: bool = True) -> list[str]:
        """A pod whose agent holds ``sessions`` sessions of three blocks; with ``serve=False`` it announces them
        and then never answers a save."""
        bus = await Bus.connect(self.settings.nats, self.subjects, f"agent/{name}")
        agent = KvAgent(self.store, pod=name, node="node-1", namespace="llm", deployment="llama", layout=LAYOUT)
        ids = [f"{name}-s{i}" for i in range(sessions)]
        for sid in ids:
            agent.register_session(sid)
            for b in range(3):
                agent.append_block(sid, block_content(sid, b, LAYOUT.block_bytes))
        endpoint = AgentEndpoint(agent, bus, announce_s=30)
        self.agents.append((endpoint, bus))
        await (endpoint.start() if serve else endpoint.announce())
        self.sessions += ids
        want = len(self.sessions)
        await eventually(lambda: self._registered(want))
        return ids

    async def _registered(self, count: int) -> bool:
        return len(await self.service.registry.sessions_on_node("node-1")) == count

    async def committed(self) -> dict[str, bool]:
        """Which sessions have a committed checkpoint in the registry, now."""
        return {sid: await self.service.registry.newest_checkpoint(sid) is not None for sid in self.sessions}


@pytest.fixture
async def checkpointing(settings: Settings, subjects: Subjects, tmp_path: Path) -> AsyncIterator[Checkpointing]:
    store = FileStore(tmp_path / "store")
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    mesh = Checkpointing(service, store, settings, subjects)
    yield mesh
    for endpoint, bus in mesh.agents:
        await endpoint.stop()
        await bus.close(1)
    await running.stop(grace=1)


class RecordingGpus(SimGpus):
    """The simulated GPUs, noting when the first MIG change began and what ``look`` found at that moment."""

    def __init__(self, *args: Any, look: Callable[[], Awaitable[Any]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.look = look
        self.first_change_at: datetime | None = None
        self.seen_then: Any = None

    async def _first_change(self) -> None:
        if self.first_change_at is None:
            self.first_change_at = datetime.now(UTC)
            self.seen_then = await self.look()

    async def set_mig_mode(self, uuid: str, enabled: bool) -> None:
        await self._first_change()
        await super().set_mig_mode(uuid, enabled)

    async def create_mig_instance(self, uuid: str, profile: str) -> MigInstance:
        await self._first_change()
        return await super().create_mig_instance(uuid, profile)

    async def destroy_mig_instance(self, uuid: str, instance_uuid: str) -> None:
        await self._first_change()
        await super().destroy_mig_instance(uuid, instance_uuid)


@contextlib.asynccontextmanager
async def running(controller: MigController) -> AsyncIterator[None]:
    task = asyncio.create_task(controller.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def drain_annotation(cluster: SimCluster) -> str | None:
    info = await cluster.node("node-1")
    assert info is not None
    return info.annotations.get(MIG_DRAIN_ANNOTATION)


async def test_a_layout_change_commits_every_session_before_the_first_mig_change(
    settings: Settings,
    subjects: Subjects,
    bus: Bus,
    redis_client: aioredis.Redis,
    cluster: SimCluster,
    checkpointing: Checkpointing,
) -> None:
    events = await mig_events(bus, subjects)
    requests = await heard(bus, subjects, DrainRequested)
    verdicts = await heard(bus, subjects, DrainCompleted)
    saved: list[CheckpointSaved] = []

    async def on_saved(event: CheckpointSaved) -> None:
        saved.append(event)

    await bus.subscribe(subjects.pattern("checkpoint.saved"), on_saved, accepts=(CheckpointSaved,))
    sessions = [*await checkpointing.add_pod("llama-1", 3), *await checkpointing.add_pod("llama-2", 2)]
    gpus = RecordingGpus(
        redis_client, subjects, parse_spec(SPEC, "spec.yaml"), "node-1", poll_s=0.02, look=checkpointing.committed
    )
    await gpus.attach()
    await ConfigStore(redis_client, subjects).write("mig", LAYOUTS, 0, "test")
    device_settings = DeviceSettings(
        inventory_s=30.0, plugin="off", mig_step_timeout_s=30.0, mig_reconcile_s=30.0, mig_drain_timeout_s=60.0
    )
    service = DeviceService(device_settings, gpus=gpus, cluster=cluster)
    async with device_service(settings, service) as service_running:
        assert await checkpointing.committed() == dict.fromkeys(sessions, False)
        await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
        await eventually(lambda: events and events[-1].state != "pending", timeout=30)
        assert service_running.ctx.health()["mig"]["state"] == "success"

    request = requests[0]
    assert request.drain_id.startswith("mig-node-1-first-1g-v1-")
    assert request.requested_by == "device/mig" and "MIG layout 'first-1g'" in request.reason
    assert [(e.state, e.reason) for e in events] == [
        ("pending", f"waiting for drain {request.drain_id}: every session on the node is saved before the GPUs change"),
        ("pending", ""),
        ("success", ""),
    ]
    verdict = await eventually(lambda: verdicts and verdicts[0])
    assert verdict.drain_id == request.drain_id and verdict.sessions_committed == len(sessions) == 5
    # The order: when the first MIG change began, every session already had its committed checkpoint, and every
    # checkpoint.saved had gone out.
    assert gpus.seen_then == dict.fromkeys(sessions, True)
    await eventually(
        lambda: {e.session_id for e in saved} == set(sessions)
    )  # (at least once: a redelivery may repeat one)
    assert {e.session_id for e in saved} == set(sessions) and {e.drain_id for e in saved} == {request.drain_id}
    assert gpus.first_change_at is not None and all(e.occurred_at <= gpus.first_change_at for e in saved)
    assert len((await gpus.devices())[0].mig_instances) == 7
    assert await node_state(cluster) == ("success", None)
    assert await drain_annotation(cluster) is None and len(requests) == 1


async def test_with_the_dra_driver_a_layout_change_takes_no_device_out_of_the_slice_before_its_sessions_are_saved(
    settings: Settings,
    subjects: Subjects,
    redis_client: aioredis.Redis,
    cluster: SimCluster,
    checkpointing: Checkpointing,
) -> None:
    """The same layout change with the device service a DRA driver: every ResourceSlice it writes is noted with
    what was committed at that moment. Until the drain committed every session, GPU 0 stays offered whole and
    untainted; the slice that first marks it changing (``gpuwarden.io/mig-changing``) or leaves it out comes only
    after; the last slice offers its 7 MIG devices in its place, none tainted."""
    sessions = [*await checkpointing.add_pod("llama-1", 3), *await checkpointing.add_pod("llama-2", 2)]
    written: list[tuple[dict[str, bool], dict[str, tuple[str, ...]]]] = []
    publish = cluster.publish_resource_slice

    async def noted(resource_slice: ResourceSlice) -> bool:
        devices = {d.name: tuple(t.key for t in d.taints) for d in resource_slice.devices}
        written.append((await checkpointing.committed(), devices))
        return await publish(resource_slice)

    cluster.publish_resource_slice = noted  # type: ignore[method-assign]
    gpus = SimGpus(redis_client, subjects, parse_spec(SPEC, "spec.yaml"), "node-1", poll_s=0.02)
    await gpus.attach()
    await ConfigStore(redis_client, subjects).write("mig", LAYOUTS, 0, "test")
    folder = Path(tempfile.mkdtemp(prefix="gw-migdra-", dir="/tmp"))  # short: unix sockets fit in 107 bytes
    device_settings = dra_settings(
        folder,
        inventory_s=0.1,
        mig_step_timeout_s=30.0,
        mig_reconcile_s=30.0,
        mig_drain_timeout_s=60.0,
    )
    try:
        async with device_service(settings, DeviceService(device_settings, gpus=gpus, cluster=cluster)) as running:
            await eventually(lambda: written)
            assert await checkpointing.committed() == dict.fromkeys(sessions, False)
            await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
            await eventually(lambda: running.ctx.health()["mig"]["state"] == "success", timeout=30)

            def settled() -> dict[str, tuple[str, ...]] | None:
                final = written[-1][1]
                mig = [name for name in final if name.startswith("gpu-0-mig-")]
                return final if len(mig) == 7 and not any(final.values()) else None

            final = await eventually(settled)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    first_committed, first_devices = written[0]
    assert first_devices["gpu-0"] == () and not any(first_committed.values())
    taken = [i for i, (_, devices) in enumerate(written) if devices.get("gpu-0") != ()]
    assert taken, "the slice never marked GPU 0 changing nor took it out"
    for committed, _ in written[taken[0] :]:
        assert committed == dict.fromkeys(sessions, True)
    assert any(MIG_CHANGING_TAINT in keys for _, devices in written for keys in devices.values())
    assert "gpu-0" not in final and set(final) >= {"gpu-1", "gpu-2"}  # its 7 MIG devices in its place


async def test_a_drain_that_fails_leaves_the_gpus_unchanged_and_names_the_sessions_not_saved(
    subjects: Subjects, bus: Bus, sim_gpus: SimGpus, cluster: SimCluster, checkpointing: Checkpointing
) -> None:
    await checkpointing.add_pod("llama-1", 2)
    await checkpointing.add_pod("llama-silent", 2, serve=False)
    recorder = Recorder(bus)
    controller = controller_for(
        sim_gpus,
        cluster,
        LAYOUTS,
        recorder,
        Clock(),
        record=RecordReader(bus),
        drain_timeout_s=60.0,
        drain_deadline_s=2.0,
    )
    before = await sim_gpus.devices()
    await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
    async with VerdictWake(bus, "node-1", controller.on_verdict_heard), running(controller):
        await eventually(lambda: recorder.events and recorder.events[-1].state == "failed", timeout=30)
    failed = recorder.events[-1]
    drain_id = recorder.drains[0].drain_id
    assert failed.reason.startswith(
        f"drain {drain_id} failed, GPUs left unchanged: 2 session(s) not checkpointed; not saved: "
        "llama-silent-s0 (llama-silent: pod llama-silent's KV agent did not answer within the drain deadline"
    )
    assert "; llama-silent-s1 (llama-silent: pod llama-silent's KV agent did not answer" in failed.reason
    assert [e.state for e in recorder.events] == ["pending", "failed"]
    assert await sim_gpus.devices() == before
    assert recorder.calls == []  # the plugin was never paused: nothing was about to change
    assert await node_state(cluster) == ("failed", failed.reason)
    assert await drain_annotation(cluster) is None

    # A failed layout waits for its retry period, as any failed layout does: no second drain before it.
    await controller.reconcile()
    assert len(recorder.drains) == 1 and await sim_gpus.devices() == before
    assert await node_state(cluster) == ("failed", failed.reason)


class Record:
    """The checkpoint service's part: the verdicts it recorded, answered by drain id to ``node.drain.query``."""

    def __init__(self) -> None:
        self.verdicts: dict[str, DrainCompleted | DrainFailed] = {}

    async def serve(self, bus: Bus) -> RecordReader:
        async def on_query(query: DrainQuery) -> DrainRecord:
            return DrainRecord(drain_id=query.drain_id, verdict=self.verdicts.get(query.drain_id))

        await bus.serve(bus.subjects.command("checkpoint", "drain"), on_query, (DrainQuery,))
        return RecordReader(bus)


async def test_no_verdict_in_time_fails_the_layout_unchanged_and_a_restart_asks_the_same_drain(
    bus: Bus, sim_gpus: SimGpus, cluster: SimCluster
) -> None:
    recorder = Recorder()
    clock = Clock()
    record = Record()
    reader = await record.serve(bus)
    controller = controller_for(
        sim_gpus, cluster, LAYOUTS, recorder, clock, record=reader, drain_timeout_s=5.0, drain_deadline_s=4.0
    )
    before = await sim_gpus.devices()
    await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
    await controller.reconcile()
    [asked] = recorder.drains
    assert (asked.node, asked.deadline_s, asked.requested_by) == ("node-1", 4.0, "device/mig")
    assert asked.drain_id.startswith("mig-node-1-first-1g-v1-")
    assert await drain_annotation(cluster) == asked.drain_id  # named on the node before it was asked
    assert (await node_state(cluster))[0] == "pending" and controller.describe()["drain"] == asked.drain_id
    assert [e.state for e in recorder.events] == ["pending"]
    await controller.reconcile()  # still waiting: asked once, said once
    assert len(recorder.drains) == 1 and len(recorder.events) == 1

    # A restarted controller asks the same drain again (the checkpoint service runs a drain id once).
    restarted_recorder = Recorder()
    restarted = controller_for(
        sim_gpus, cluster, LAYOUTS, restarted_recorder, clock, record=reader, drain_timeout_s=5.0, drain_deadline_s=4.0
    )
    await restarted.reconcile()
    assert [d.drain_id for d in restarted_recorder.drains] == [asked.drain_id]
    assert restarted_recorder.events == []  # the node already shows it pending for this drain

    # Verdicts for other drains, or other nodes, are not this one's.
    record.verdicts["mig-node-1-first-1g-v1-other"] = DrainCompleted(
        node="node-1", drain_id="mig-node-1-first-1g-v1-other"
    )
    record.verdicts[asked.drain_id] = DrainCompleted(node="node-2", drain_id=asked.drain_id)
    await restarted.reconcile()
    assert (await node_state(cluster))[0] == "pending" and await sim_gpus.devices() == before

    clock.now += 5.0
    await restarted.reconcile()
    state, reason = await node_state(cluster)
    assert state == "failed" and reason == (
        f"drain {asked.drain_id}: no verdict from the checkpoint service within 5s "
        "(GPUWARDEN_MIG_DRAIN_TIMEOUT_S), GPUs left unchanged"
    )
    assert await sim_gpus.devices() == before and restarted_recorder.calls == []
    assert await drain_annotation(cluster) is None and "drain" not in restarted.describe()

    # A verdict that comes too late is not used, then or later.
    record.verdicts[asked.drain_id] = DrainCompleted(node="node-1", drain_id=asked.drain_id)
    await restarted.reconcile()
    assert await node_state(cluster) == ("failed", reason) and await sim_gpus.devices() == before

    # After the retry period a new drain is asked; its verdict lets the change go on, once.
    clock.now += 300.0
    await restarted.reconcile()
    retry = restarted_recorder.drains[-1]
    assert retry.drain_id != asked.drain_id and await drain_annotation(cluster) == retry.drain_id
    record.verdicts[retry.drain_id] = DrainCompleted(node="node-1", drain_id=retry.drain_id, sessions_committed=3)
    await restarted.reconcile()  # the record read, the drain used up, the layout applied
    assert await drain_annotation(cluster) is None
    assert await node_state(cluster) == ("success", None)
    assert len((await sim_gpus.devices())[0].mig_instances) == 7
    assert [e.state for e in restarted_recorder.events] == ["failed", "pending", "pending", "success"]
    assert restarted_recorder.calls == ["pause", "refresh", "resume"]


async def test_the_device_service_fails_a_layout_whose_drain_gets_no_verdict_and_never_waits_for_ever(
    settings: Settings,
    subjects: Subjects,
    bus: Bus,
    redis_client: aioredis.Redis,
    sim_gpus: SimGpus,
    cluster: SimCluster,
) -> None:
    events = await mig_events(bus, subjects)
    requests = await heard(bus, subjects, DrainRequested)
    await ConfigStore(redis_client, subjects).write("mig", LAYOUTS, 0, "test")
    device_settings = DeviceSettings(
        inventory_s=30.0, plugin="off", mig_step_timeout_s=30.0, mig_reconcile_s=30.0, mig_drain_timeout_s=0.5
    )
    service = DeviceService(device_settings, gpus=sim_gpus, cluster=cluster)
    async with device_service(settings, service):
        before = await sim_gpus.devices()
        await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
        # Nothing but the drain's own time wakes the controller here (the reconcile period is 30s).
        await eventually(lambda: events and events[-1].state == "failed")
        assert await sim_gpus.devices() == before
    [request] = requests
    assert request.deadline_s == pytest.approx(0.4)  # the savers get less time than the controller waits
    assert [e.state for e in events] == ["pending", "failed"]
    assert events[-1].reason == (
        f"drain {request.drain_id}: no verdict from the checkpoint service within 0.5s "
        "(GPUWARDEN_MIG_DRAIN_TIMEOUT_S), GPUs left unchanged"
    )
    assert await node_state(cluster) == ("failed", events[-1].reason)
    assert await drain_annotation(cluster) is None


async def test_a_device_service_stopped_while_waiting_reports_it_and_its_restart_asks_the_same_drain(
    settings: Settings,
    subjects: Subjects,
    bus: Bus,
    redis_client: aioredis.Redis,
    sim_gpus: SimGpus,
    cluster: SimCluster,
) -> None:
    events = await mig_events(bus, subjects)
    requests = await heard(bus, subjects, DrainRequested)
    await ConfigStore(redis_client, subjects).write("mig", LAYOUTS, 0, "test")
    device_settings = DeviceSettings(
        inventory_s=30.0, plugin="off", mig_step_timeout_s=30.0, mig_reconcile_s=30.0, mig_drain_timeout_s=60.0
    )
    before = await sim_gpus.devices()
    async with device_service(settings, DeviceService(device_settings, gpus=sim_gpus, cluster=cluster)) as first:
        await cluster.set_node_labels("node-1", {CONFIG_LABEL: "first-1g"})
        await eventually(lambda: requests)
        assert first.ctx.health()["mig"]["drain"] == requests[0].drain_id
    drain_id = requests[0].drain_id
    interrupted = f"interrupted: the device service stopped while waiting for drain {drain_id}"
    await eventually(lambda: events and events[-1].reason == interrupted)
    assert await node_state(cluster) == ("failed", interrupted)
    assert await drain_annotation(cluster) == drain_id and await sim_gpus.devices() == before

    async with device_service(settings, DeviceService(device_settings, gpus=sim_gpus, cluster=cluster)):
        await eventually(lambda: len(requests) == 2)
        assert requests[1].drain_id == drain_id
        await eventually(lambda: events[-1].state == "pending")
    await eventually(lambda: len(events) == 4)
    assert [e.state for e in events] == ["pending", "failed", "pending", "failed"]
    assert await sim_gpus.devices() == before
