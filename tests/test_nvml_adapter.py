"""The NVML adapter against a hand-written fake NVML module: two GPUs joined by NVLink on NUMA nodes 0 and 1."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import pytest

from shared.adapters.driverinstall import INSTALL_COMMAND_ENV
from shared.adapters.metrics import NvmlSource
from shared.adapters.nvml import NvmlGpus, cuda_version_text, mig_profile_name, normalise_bus_id
from shared.ports.gpu import DriverInstallError, GpuError, GpuHealthEvent, GpuPort, MigProfile
from tests.fake_nvml import EventData, FakeGpu, FakeNvml, Memory, NVMLError
from tests.helpers import eventually


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
async def gpus(fake: FakeNvml) -> Any:
    port = NvmlGpus(fake, event_wait_ms=20)
    yield port
    await port.close()


async def next_event(events: Any, timeout: float = 3.0) -> GpuHealthEvent:
    event: GpuHealthEvent = await asyncio.wait_for(anext(events), timeout)
    return event


async def watching(fake: FakeNvml, gpus: int) -> None:
    """Until the health thread has registered ``gpus`` GPUs for XID events (it starts once a stream subscribed, and
    lists the GPUs first): a state awaited, not slept for."""
    await eventually(lambda: len(fake.registered) >= gpus, timeout=5)


def test_helpers() -> None:
    assert cuda_version_text(12040) == "12.4"
    assert cuda_version_text(11080) == "11.8"
    assert normalise_bus_id("0000:0F:00.0") == normalise_bus_id(b"00000000:0f:00.0") == "00000000:0f:00.0"


async def test_is_a_gpu_port(gpus: NvmlGpus) -> None:
    assert isinstance(gpus, GpuPort)
    assert gpus.simulated is False


async def test_devices(gpus: NvmlGpus, fake: FakeNvml) -> None:
    devices = await gpus.devices()
    assert [d.uuid for d in devices] == ["GPU-aaaa", "GPU-bbbb"]
    a, b = devices
    assert (a.index, b.index) == (0, 1)
    assert a.model == "NVIDIA H100 80GB HBM3"
    assert a.pci_bus_id == "00000000:07:00.0"
    assert a.memory_total_mib == 80 * 1024
    assert (a.numa_node, b.numa_node) == (0, 1)
    assert a.nvlink_peers == ["GPU-bbbb"]
    assert b.nvlink_peers == ["GPU-aaaa"]
    assert not a.mig_capable and not a.mig_enabled and a.mig_instances == []


class OlderNvml(FakeNvml):
    """An older pynvml without nvmlDeviceGetNumaNodeId."""

    nvmlDeviceGetNumaNodeId = None  # type: ignore[assignment]


async def test_numa_missing_and_mig_mode() -> None:
    fake = OlderNvml()
    fake.mig_modes["GPU-aaaa"] = 0
    port = NvmlGpus(fake)
    a, b = await port.devices()
    assert a.numa_node is None
    assert a.mig_capable and not a.mig_enabled
    assert not b.mig_capable
    await port.set_mig_mode("GPU-aaaa", True)
    assert fake.mig_modes["GPU-aaaa"] == 1
    assert (await port.devices())[0].mig_enabled
    with pytest.raises(GpuError, match="GPU-bbbb"):
        await port.set_mig_mode("GPU-bbbb", True)
    assert await port.mig_profiles("GPU-bbbb") == []
    with pytest.raises(GpuError, match=r"MIG profile '1g\.10gb' is not offered by GPU GPU-aaaa \(offered: none\)"):
        await port.create_mig_instance("GPU-aaaa", "1g.10gb")
    await port.close()


async def test_versions_and_utilisation(gpus: NvmlGpus) -> None:
    versions = await gpus.versions()
    assert (versions.driver, versions.cuda) == ("550.54.15", "12.4")
    a, b = await gpus.utilisation()
    assert a.uuid == "GPU-aaaa" and a.gpu_util == 75.0 and a.mem_copy_util == 30.0
    assert b.gpu_util == 5.0
    assert a.mem_used_mib == 20 * 1024 and a.mem_free_mib == 60 * 1024
    assert a.power_w == pytest.approx(350.5)
    assert a.temperature_c == 61.0


async def test_a_reading_a_gpu_does_not_offer_is_missing_not_an_error(gpus: NvmlGpus, fake: FakeNvml) -> None:
    """A GPU in MIG mode has no device-wide utilisation (NVML: NOT_SUPPORTED): its sample says unknown (NaN), the
    other GPUs are read as usual, and the metrics source passes it on as missing, never as 0."""
    fake.gpus[0].utilisation_supported = False
    a, b = await gpus.utilisation()
    assert math.isnan(a.gpu_util) and math.isnan(a.mem_copy_util) and a.mem_used_mib == 20 * 1024
    assert b.gpu_util == 5.0
    read = await NvmlSource(gpus, "node-1").read()
    first = next(r for r in read.readings if r.uuid == "GPU-aaaa")
    assert first.util is None and set(first.invalid) == {"gpu_util", "mem_copy_util"}
    assert first.values["mem_used_mib"] == 20 * 1024


async def test_nvml_missing_is_a_clear_error(fake: FakeNvml) -> None:
    fake.init_error = FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND
    port = NvmlGpus(fake)
    with pytest.raises(GpuError, match=r"NVML is not available on this node: .*Library Not Found"):
        await port.devices()
    with pytest.raises(GpuError, match="NVML is not available on this node"):
        await port.versions()


async def test_real_pynvml_without_a_gpu_is_a_clear_error() -> None:
    pytest.importorskip("pynvml")
    port = NvmlGpus()
    try:
        await port.versions()
    except GpuError as exc:
        assert "NVML is not available on this node" in str(exc)
    else:  # a machine with a GPU: the adapter works
        assert (await port.versions()).driver
    await port.close()


async def test_xid_reaches_health_events(gpus: NvmlGpus, fake: FakeNvml) -> None:
    fake.gpus[1].xid_capable = False  # skipped with a log line, not fatal
    events: Any = gpus.health_events()
    fake.events.put(EventData(device=fake.gpus[0], eventType=8, eventData=79))
    event = await next_event(events)
    assert (event.uuid, event.kind, event.xid) == ("GPU-aaaa", "xid", 79)
    assert fake.registered == ["GPU-aaaa"]
    await events.aclose()


async def test_lost_gpu(gpus: NvmlGpus, fake: FakeNvml) -> None:
    events: Any = gpus.health_events()
    pending = asyncio.ensure_future(next_event(events))
    await watching(fake, 2)  # the health thread took both GPUs' handles before one is lost
    fake.gpus[1].lost = True
    event = await pending
    assert (event.uuid, event.kind) == ("GPU-bbbb", "lost")
    assert [d.uuid for d in await gpus.devices()] == ["GPU-aaaa"]
    assert [u.uuid for u in await gpus.utilisation()] == ["GPU-aaaa"]
    validation = await gpus.validate_driver("550.54.15")
    assert not validation.ok and validation.visible_gpus == 1
    await events.aclose()


async def test_lost_seen_by_a_call_is_reported(gpus: NvmlGpus, fake: FakeNvml) -> None:
    await gpus.devices()
    events: Any = gpus.health_events()
    pending = asyncio.ensure_future(next_event(events))
    await watching(fake, 2)  # subscribed: the health thread starts after the subscription
    fake.gpus[0].lost = True
    await gpus.utilisation()
    event = await pending
    assert (event.uuid, event.kind) == ("GPU-aaaa", "lost")
    await events.aclose()


async def test_health_events_end_on_close(fake: FakeNvml) -> None:
    port = NvmlGpus(fake, event_wait_ms=20)
    events: Any = port.health_events()
    pending = asyncio.ensure_future(next_event(events))
    await watching(fake, 2)  # subscribed and watching: the close ends a running stream
    await port.close()
    with pytest.raises(StopAsyncIteration):
        await pending


async def test_install_command(gpus: NvmlGpus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INSTALL_COMMAND_ENV, raising=False)
    with pytest.raises(DriverInstallError, match=INSTALL_COMMAND_ENV):
        await gpus.install_driver("560.35.03")
    monkeypatch.setenv(INSTALL_COMMAND_ENV, "true {version}")
    await gpus.install_driver("560.35.03")
    monkeypatch.setenv(INSTALL_COMMAND_ENV, "false")
    with pytest.raises(DriverInstallError, match="exited with 1"):
        await gpus.install_driver("560.35.03")
    monkeypatch.setenv(INSTALL_COMMAND_ENV, "sh -c 'echo boom {version} >&2; exit 3'")
    with pytest.raises(DriverInstallError, match=r"exited with 3: boom 560\.35\.03"):
        await gpus.install_driver("560.35.03")
    with pytest.raises(DriverInstallError, match="not a driver version"):
        await gpus.install_driver("560; rm -rf /")


async def test_validate_driver(gpus: NvmlGpus, fake: FakeNvml) -> None:
    await gpus.devices()
    ok = await gpus.validate_driver("550.54.15")
    assert ok.ok and ok.visible_gpus == 2 and ok.version == "550.54.15"
    mismatch = await gpus.validate_driver("560.35.03")
    assert not mismatch.ok and mismatch.version == "550.54.15" and "expected 560.35.03" in mismatch.reason
    fake.gpus.pop()
    fewer = await gpus.validate_driver("550.54.15")
    assert not fewer.ok and fewer.visible_gpus == 1 and "1 of the 2" in fewer.reason
    fake.init_error = 9  # driver not loaded
    down = await gpus.validate_driver("550.54.15")
    assert not down.ok and "NVML does not start" in down.reason
    assert fake.inits == 1  # every re-init was balanced by a shutdown


# -- MIG ------------------------------------------------------------------------------------------------------------
@dataclass
class GiProfileInfo:
    id: int
    sliceCount: int
    instanceCount: int
    memorySizeMB: int
    name: bytes = b""


@dataclass
class FakeGi:
    gpu: FakeGpu
    id: int
    profile: int
    cis: dict[int, FakeCi]
    start: int = 0
    """Its first memory slice (NVML's placement; the fake lays instances side by side)."""


@dataclass
class Placement:
    start: int
    size: int


@dataclass
class GiInfo:
    id: int
    placement: Placement


@dataclass
class FakeCi:
    gi: FakeGi
    id: int


@dataclass
class FakeMig:
    uuid: str
    name: str
    gi: FakeGi
    ci: FakeCi
    memory_mb: int
    lost: bool = False


# An H100 80GB's GPU instance profiles: NVML profile id -> (name, slices, instances, memory in MB).
H100_PROFILES: dict[int, tuple[str, int, int, int]] = {
    0: ("1g.10gb", 1, 7, 9856),
    1: ("2g.20gb", 2, 3, 20096),
    2: ("3g.40gb", 3, 2, 40192),
    3: ("4g.40gb", 4, 1, 40192),
    4: ("7g.80gb", 7, 1, 80384),
    7: ("1g.10gb+me", 1, 1, 9856),
    9: ("1g.20gb", 1, 4, 19968),
}


class MigNvml(FakeNvml):
    """GPU-aaaa is MIG-capable (MIG off at first) with an H100's profiles; GPU instances hold compute instances,
    each compute instance is one MIG device, as in NVML. ``named``: the driver gives profile names (v2 info)."""

    NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
    NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0x0
    NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 0x1
    NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 0x2
    NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 0x3
    NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 0x4
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0x0
    NVML_ERROR_IN_USE = 19
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23

    def __init__(self, named: bool = True) -> None:
        super().__init__()
        self.named = named
        self.mig_modes["GPU-aaaa"] = 0
        self.gis: dict[int, FakeGi] = {}
        self.next_gi = 1
        self.activation = 0
        self.fail_compute_instance = False

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: FakeGpu, profile: int) -> GiProfileInfo:
        self._gpu(h)
        if h.uuid not in self.mig_modes or profile not in H100_PROFILES:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        name, slices, count, memory = H100_PROFILES[profile]
        return GiProfileInfo(profile, slices, count, memory, f"MIG {name}".encode() if self.named else b"")

    def nvmlDeviceSetMigMode(self, h: FakeGpu, mode: int) -> int:
        if self.activation:  # the change waits for a GPU reset
            return self.activation
        return super().nvmlDeviceSetMigMode(h, mode)

    def nvmlDeviceCreateGpuInstance(self, h: FakeGpu, profile: int) -> FakeGi:
        if self.mig_modes.get(h.uuid) != self.NVML_DEVICE_MIG_ENABLE:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        _name, slices, count, _memory = H100_PROFILES[profile]
        used = sum(H100_PROFILES[gi.profile][1] for gi in self.gis.values())
        same = sum(1 for gi in self.gis.values() if gi.profile == profile)
        if used + slices > 7 or same >= count:
            raise NVMLError(self.NVML_ERROR_INSUFFICIENT_RESOURCES)
        start = sum(H100_PROFILES[g.profile][1] for g in self.gis.values())
        gi = FakeGi(gpu=h, id=self.next_gi, profile=profile, cis={}, start=start)
        self.gis[gi.id] = gi
        self.next_gi += 1
        return gi

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: FakeGi, profile: int, engine: int) -> Any:
        slices = H100_PROFILES[gi.profile][1]
        assert profile == {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4}[slices]  # the compute instance fills the GPU one
        assert engine == self.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        return GiProfileInfo(profile, slices, 1, 0)

    def nvmlGpuInstanceCreateComputeInstance(self, gi: FakeGi, profile_id: int) -> FakeCi:
        if self.fail_compute_instance:
            raise NVMLError(self.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci = FakeCi(gi=gi, id=len(gi.cis))
        gi.cis[ci.id] = ci
        return ci

    def nvmlGpuInstanceGetInfo(self, gi: FakeGi) -> Any:
        return GiInfo(gi.id, Placement(gi.start, H100_PROFILES[gi.profile][1]))

    def _migs(self) -> list[FakeMig]:
        return [
            FakeMig(
                uuid=f"MIG-{gi.id}-{ci.id}",
                name=f"{gi.gpu.name} MIG {H100_PROFILES[gi.profile][0]}",
                gi=gi,
                ci=ci,
                memory_mb=H100_PROFILES[gi.profile][3],
            )
            for gi in sorted(self.gis.values(), key=lambda g: g.id)
            for ci in gi.cis.values()
        ]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        return 7 if h.uuid == "GPU-aaaa" else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, index: int) -> FakeMig:
        migs = self._migs()
        if index >= len(migs):
            raise NVMLError(self.NVML_ERROR_NOT_FOUND)
        return migs[index]

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Memory:
        if isinstance(h, FakeMig):
            return Memory(total=h.memory_mb * 1024 * 1024, used=0, free=h.memory_mb * 1024 * 1024)
        return super().nvmlDeviceGetMemoryInfo(h)

    def nvmlDeviceGetGpuInstanceId(self, mig: FakeMig) -> int:
        return mig.gi.id

    def nvmlDeviceGetComputeInstanceId(self, mig: FakeMig) -> int:
        return mig.ci.id

    def nvmlDeviceGetGpuInstanceById(self, h: FakeGpu, gi_id: int) -> FakeGi:
        if gi_id not in self.gis:
            raise NVMLError(self.NVML_ERROR_NOT_FOUND)
        return self.gis[gi_id]

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: FakeGi, ci_id: int) -> FakeCi:
        return gi.cis[ci_id]

    def nvmlComputeInstanceDestroy(self, ci: FakeCi) -> None:
        del ci.gi.cis[ci.id]

    def nvmlGpuInstanceDestroy(self, gi: FakeGi) -> None:
        if gi.cis:
            raise NVMLError(self.NVML_ERROR_IN_USE)
        del self.gis[gi.id]


@pytest.mark.parametrize("named", [True, False], ids=["driver-names", "derived-names"])
async def test_mig_profiles_are_read_from_nvml(named: bool) -> None:
    port = NvmlGpus(MigNvml(named=named))
    profiles = await port.mig_profiles("GPU-aaaa")
    assert [p.name for p in profiles] == [
        "1g.10gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
        "1g.10gb+me",
        "1g.20gb",
    ]
    assert profiles[2] == MigProfile(name="3g.40gb", slices=3, max_count=2, memory_mib=40192)
    assert await port.mig_profiles("GPU-bbbb") == []
    await port.close()


def test_profile_names_follow_nvidia_s_rounding() -> None:
    assert mig_profile_name(1, 9856, 81559) == "1g.10gb"
    assert mig_profile_name(7, 80384, 81559) == "7g.80gb"
    assert mig_profile_name(1, 4864, 40536) == "1g.5gb"  # A100 40GB
    assert mig_profile_name(2, 11968, 24258) == "2g.12gb"  # A30
    assert mig_profile_name(1, 9856, 81559, "+me") == "1g.10gb+me"


async def test_mig_instances_are_made_and_destroyed_through_nvml() -> None:
    fake = MigNvml()
    port = NvmlGpus(fake)
    await port.set_mig_mode("GPU-aaaa", True)
    a = await port.create_mig_instance("GPU-aaaa", "3g.40gb")
    b = await port.create_mig_instance("GPU-aaaa", "3g.40gb")
    c = await port.create_mig_instance("GPU-aaaa", "1g.10gb")
    assert (a.profile, a.memory_mib, c.profile) == ("3g.40gb", 40192, "1g.10gb")
    assert (await port.devices())[0].mig_instances == [a, b, c]
    assert [(i.gpu_instance_id, i.compute_instance_id) for i in (a, b, c)] == [(1, 0), (2, 0), (3, 0)]
    assert [(i.placement_start, i.placement_size) for i in (a, b, c)] == [(0, 3), (3, 3), (6, 1)]  # NVML's, as read
    with pytest.raises(GpuError, match="nvmlDeviceCreateGpuInstance on GPU GPU-aaaa failed"):
        await port.create_mig_instance("GPU-aaaa", "1g.10gb")  # 7 of 7 slices in use
    with pytest.raises(GpuError, match=r"'5g\.50gb' is not offered by GPU GPU-aaaa \(offered: 1g\.10gb, 2g\.20gb"):
        await port.create_mig_instance("GPU-aaaa", "5g.50gb")

    await port.destroy_mig_instance("GPU-aaaa", b.uuid)
    assert (await port.devices())[0].mig_instances == [a, c] and len(fake.gis) == 2
    with pytest.raises(GpuError, match=f"no MIG instance 'MIG-9-0' \\(instances: {a.uuid}, {c.uuid}\\)"):
        await port.destroy_mig_instance("GPU-aaaa", "MIG-9-0")

    # A compute instance that cannot be made leaves no GPU instance behind holding slices.
    fake.fail_compute_instance = True
    with pytest.raises(GpuError, match="nvmlGpuInstanceCreateComputeInstance"):
        await port.create_mig_instance("GPU-aaaa", "3g.40gb")
    assert len(fake.gis) == 2
    await port.close()


async def test_a_mig_mode_change_that_waits_for_a_reset_is_an_error() -> None:
    fake = MigNvml()
    fake.activation = fake.NVML_ERROR_IN_USE
    port = NvmlGpus(fake)
    with pytest.raises(GpuError, match=r"MIG mode of GPU GPU-aaaa is still disabled .*needs the GPU idle and reset"):
        await port.set_mig_mode("GPU-aaaa", True)
    assert not (await port.devices())[0].mig_enabled
    await port.close()
