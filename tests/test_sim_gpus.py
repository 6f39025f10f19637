"""The simulated GPUs: a node spec becomes GPUs shared through Redis, load becomes utilisation, MIG and driver
installs behave like the real ones, and injected faults reach the device service as the events a real GPU would
cause."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from services.device.config import DEFAULT_APPLICATION_XIDS, DeviceSettings
from services.device.health import GpuHealth, judge
from services.device.service import DeviceService
from shared.contract.device import DeviceHealthChanged, DeviceInventory, GpuXid
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from shared.ports.gpu import DriverInstallError, GpuError, GpuHealthEvent, GpuPort
from shared.sim.faults import (
    DriverInstallFault,
    FaultError,
    LoseGpuFault,
    SlowCopiesFault,
    XidFault,
    apply_fault,
    fault_cli,
    parse_fault,
    request_fault,
)
from shared.sim.gpus import SimGpus
from shared.sim.spec import SimSpec, SpecError, default_spec, parse_spec
from shared.wiring import Wiring
from tests.helpers import eventually
from tests.servers import free_port

SPEC = """
driver_version: "550.54.15"
cuda_version: "12.4"
nodes:
  - name: gpu-a
    numa_nodes: 2
    gpus:
      - {model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 2, mig_profiles: ["1g.10gb", "3g.40gb"]}
      - {model: NVIDIA L4, memory_mib: 23034, count: 1, nvlink: false}
  - name: gpu-b
    driver_version: "560.35.03"
  - name: node-1
    gpus:
      - {count: 2, mig_profiles: ["1g.10gb", "7g.80gb"]}
"""


@pytest.fixture
def spec() -> SimSpec:
    return parse_spec(SPEC, "test-spec.yaml")


@pytest.fixture
def no_spec_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUWARDEN_SIM_SPEC", raising=False)


async def first_event(port: SimGpus, timeout: float = 5.0) -> GpuHealthEvent:
    events = port.health_events()
    try:
        return await asyncio.wait_for(anext(events), timeout)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


# -- devices from the spec --------------------------------------------------------------------------------------
async def test_devices_follow_the_spec(redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec) -> None:
    port = SimGpus(redis_client, subjects, spec, "gpu-a")
    assert isinstance(port, GpuPort) and port.simulated is True and "SIMULATED" in repr(port)
    devices = await port.devices()
    assert [d.index for d in devices] == [0, 1, 2]
    assert [d.model for d in devices] == ["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA L4"]
    assert [d.memory_total_mib for d in devices] == [81559, 81559, 23034]
    assert devices[0].nvlink_peers == [devices[1].uuid] and devices[1].nvlink_peers == [devices[0].uuid]
    assert devices[2].nvlink_peers == []
    assert [d.numa_node for d in devices] == [0, 0, 1]
    assert [d.mig_capable for d in devices] == [True, True, False]
    assert all(d.uuid.startswith("GPU-") and not d.mig_enabled and d.healthy for d in devices)
    assert len({d.pci_bus_id for d in devices}) == 3 and len({d.uuid for d in devices}) == 3
    assert await port.versions() == type(await port.versions())(driver="550.54.15", cuda="12.4")

    other = SimGpus(redis_client, subjects, spec, "gpu-b")
    assert len(await other.devices()) == 2
    versions = await other.versions()
    assert (versions.driver, versions.cuda) == ("560.35.03", "12.6")  # the CUDA version follows the driver


def test_a_bad_spec_is_refused_naming_the_field(subjects: Subjects, spec: SimSpec) -> None:
    bad = parse_spec('nodes: [{name: n1, gpus: [{count: 1, mig_profiles: ["1g.10gb", "9g.1tb"]}]}]')
    with pytest.raises(SpecError, match=r"\$\.nodes\[0\]\.gpus\[0\]\.mig_profiles\[1\]: '9g.1tb' is not a MIG"):
        SimGpus(aioredis.Redis(), subjects, bad, "n1")
    with pytest.raises(SpecError, match=r"\$\.nodes\[0\]\.gpus\[0\]\.memory_mib"):
        parse_spec("nodes: [{name: n1, gpus: [{memory_mib: -1}]}]", "bad.yaml")
    with pytest.raises(SpecError, match="node 'nope' is not in the spec"):
        SimGpus(aioredis.Redis(), subjects, spec, "nope")


async def test_default_spec_runs_standalone_and_every_process_sees_one_state(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis, no_spec_file: None
) -> None:
    ports = [Wiring(replace(settings, node=node), subjects).gpus() for node in ("node-1", "node-2", "node-3")]
    try:
        assert all(isinstance(p, SimGpus) and p.simulated for p in ports)
        inventories = [await p.devices() for p in ports]
        assert [len(devices) for devices in inventories] == [2, 2, 2]
        for node in ("node-1", "node-2", "node-3"):
            assert await redis_client.exists(subjects.redis_key("sim", "gpus", node))
        second = SimGpus(aioredis.Redis.from_url(settings.redis.url), subjects, default_spec(), "node-1")
        try:
            assert [d.uuid for d in await second.devices()] == [d.uuid for d in inventories[0]]
            await apply_fault(redis_client, subjects, LoseGpuFault(node="node-1", gpu=1))
            assert [d.uuid for d in await second.devices()] == [inventories[0][0].uuid]
            assert [d.uuid for d in await ports[0].devices()] == [inventories[0][0].uuid]
        finally:
            await second.close()
            await second.client.aclose()
    finally:
        for p in ports:
            await p.close()
    with pytest.raises(SpecError, match="GPUWARDEN_NODE=node-9: node 'node-9' is not in the spec"):
        Wiring(replace(settings, node="node-9"), subjects).gpus()
    real = Wiring(replace(settings, backend="real"), subjects).gpus()  # NVML, which this machine does not have
    assert real.simulated is False
    with pytest.raises(GpuError, match="NVML is not available on this node"):
        await real.devices()


# -- utilisation --------------------------------------------------------------------------------------------------
async def test_utilisation_follows_the_load_and_slow_copies(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec
) -> None:
    port = SimGpus(redis_client, subjects, spec, "gpu-a")
    h100, _, l4 = await port.devices()
    idle = {u.uuid: u for u in await port.utilisation()}
    assert (idle[h100.uuid].gpu_util, idle[h100.uuid].power_w, idle[h100.uuid].temperature_c) == (0.0, 70.0, 35.0)
    assert idle[h100.uuid].mem_free_mib == 81559

    await port.set_load(h100.uuid, util=50.0, mem_used_mib=40000, copy_util=20.0)
    await port.set_load(l4.uuid, util=100.0, mem_used_mib=23034, copy_util=0.0)
    busy = {u.uuid: u for u in await port.utilisation()}
    h = busy[h100.uuid]
    assert (h.gpu_util, h.mem_used_mib, h.mem_free_mib, h.mem_copy_util) == (50.0, 40000, 41559, 20.0)
    assert h.power_w == pytest.approx(70 + 0.5 * (700 - 70)) and h.temperature_c == 60.0
    assert busy[l4.uuid].mem_free_mib == 0 and busy[l4.uuid].temperature_c == 85.0

    assert await port.copy_slowdown(h100.uuid) == 1.0
    await apply_fault(redis_client, subjects, SlowCopiesFault(node="gpu-a", gpu=0, factor=2.5))
    assert await port.copy_slowdown(h100.uuid) == 2.5
    assert {u.uuid: u for u in await port.utilisation()}[h100.uuid].mem_copy_util == 50.0

    with pytest.raises(GpuError, match="util=120"):
        await port.set_load(h100.uuid, util=120.0, mem_used_mib=0, copy_util=0)
    with pytest.raises(GpuError, match="mem_used_mib=90000"):
        await port.set_load(h100.uuid, util=10.0, mem_used_mib=90000, copy_util=0)
    with pytest.raises(GpuError, match="no GPU 'GPU-nope'"):
        await port.set_load("GPU-nope", util=10.0, mem_used_mib=0, copy_util=0)


# -- MIG ----------------------------------------------------------------------------------------------------------
async def test_mig_instances_are_checked_against_profiles_and_capacity(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec
) -> None:
    port = SimGpus(redis_client, subjects, spec, "gpu-a")
    h100, _, l4 = await port.devices()
    with pytest.raises(GpuError, match="not MIG-capable"):
        await port.set_mig_mode(l4.uuid, True)
    with pytest.raises(GpuError, match="enable MIG mode first"):
        await port.create_mig_instance(h100.uuid, "1g.10gb")
    await port.set_mig_mode(h100.uuid, True)
    with pytest.raises(GpuError, match=r"'2g.20gb' is not allowed on GPU 0 \(allowed: 1g.10gb, 3g.40gb\)"):
        await port.create_mig_instance(h100.uuid, "2g.20gb")
    big = [await port.create_mig_instance(h100.uuid, "3g.40gb") for _ in range(2)]
    small = await port.create_mig_instance(h100.uuid, "1g.10gb")
    with pytest.raises(GpuError, match=r"7 of 7 compute slices are in use, 1g\.10gb needs 1"):
        await port.create_mig_instance(h100.uuid, "1g.10gb")
    assert small.memory_mib == 10240 and small.uuid.startswith("MIG-") and small.uuid not in {b.uuid for b in big}
    device = (await port.devices())[0]
    assert device.mig_enabled and [i.profile for i in device.mig_instances] == ["3g.40gb", "3g.40gb", "1g.10gb"]

    with pytest.raises(GpuError, match="destroy them before disabling MIG mode"):
        await port.set_mig_mode(h100.uuid, False)
    with pytest.raises(GpuError, match="no MIG instance 'MIG-nope'"):
        await port.destroy_mig_instance(h100.uuid, "MIG-nope")
    for instance in [*big, small]:
        await port.destroy_mig_instance(h100.uuid, instance.uuid)
    await port.set_mig_mode(h100.uuid, False)
    assert (await port.devices())[0].mig_instances == [] and not (await port.devices())[0].mig_enabled


# -- driver install -----------------------------------------------------------------------------------------------
async def test_driver_install_fails_hangs_and_validates_as_injected(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec, caplog: pytest.LogCaptureFixture
) -> None:
    port = SimGpus(redis_client, subjects, spec, "gpu-a", poll_s=0.01)
    assert (await port.validate_driver("550.54.15")).ok
    await port.install_driver("560.35.03")
    versions = await port.versions()
    assert (versions.driver, versions.cuda) == ("560.35.03", "12.6")
    result = await port.validate_driver("560.35.03")
    assert result.ok and result.visible_gpus == 3
    wrong = await port.validate_driver("570.86.15")
    assert not wrong.ok and "560.35.03 is installed, 570.86.15 was expected" in wrong.reason
    with pytest.raises(DriverInstallError, match="is not a driver version"):
        await port.install_driver("latest")

    await apply_fault(redis_client, subjects, DriverInstallFault(node="gpu-a", mode="fail", reason="DKMS build failed"))
    with pytest.raises(DriverInstallError, match=r"installing driver 570\.86\.15 failed: DKMS build failed"):
        await port.install_driver("570.86.15")
    assert (await port.versions()).driver == "560.35.03"

    await apply_fault(redis_client, subjects, DriverInstallFault(node="gpu-a", mode="hang"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(port.install_driver("570.86.15"), timeout=0.2)
    hung = asyncio.create_task(port.install_driver("570.86.15"))
    await eventually(lambda: caplog.text.count("SIMULATED driver install hangs") == 2)
    await apply_fault(redis_client, subjects, DriverInstallFault(node="gpu-a", mode="clear"))
    await asyncio.wait_for(hung, timeout=5)
    assert (await port.validate_driver("570.86.15")).ok

    await apply_fault(redis_client, subjects, LoseGpuFault(node="gpu-a", gpu=2))
    lost = await port.validate_driver("570.86.15")
    assert not lost.ok and lost.visible_gpus == 2 and "lost: GPU 2" in lost.reason


# -- fault requests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ('{"kind": "xid", "node": "node-1", "gpu": 0, "code": "79"}', "Expected `int`, got `str` - at `$.code`"),
        ('{"kind": "xid", "node": "node-1", "gpu": 0, "code": 0}', "`$.code`"),
        ('{"kind": "xid", "node": "node-1", "gpu": 0, "code": 256}', "`$.code`"),
        ('{"kind": "xid", "node": "node-1", "code": 79}', "missing required field `gpu`"),
        (
            '{"kind": "meteor", "node": "node-1"}',
            "`$.kind` (kinds: xid, lose_gpu, driver_install, slow_copies, mig, kill_pod, lose_node)",
        ),
        ('{"node": "node-1"}', "missing required field `kind`"),
        ('{"kind": "lose_gpu", "node": "node-1", "gpu": 0, "colour": "red"}', "unknown field `colour`"),
        ('{"kind": "slow_copies", "node": "node-1", "gpu": 0, "factor": 0.5}', "`$.factor`"),
        ('{"kind": "driver_install", "node": "node-1", "mode": "explode"}', "`$.mode`"),
        ('{"kind": "lose_gpu", "node": "no de", "gpu": 0}', "`$.node`"),
        ("kind: xid", "not valid JSON"),
    ],
)
def test_bad_fault_requests_name_the_field(raw: str, names: str) -> None:
    with pytest.raises(FaultError) as caught:
        parse_fault(raw)
    assert names in str(caught.value)


async def test_faults_on_unknown_nodes_or_gpus_name_the_field(
    redis_client: aioredis.Redis, subjects: Subjects, spec: SimSpec
) -> None:
    with pytest.raises(FaultError, match=r"\$\.node: 'node-1' has no simulated GPUs \(nodes: none yet\)"):
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
    await SimGpus(redis_client, subjects, spec, "gpu-a").devices()
    with pytest.raises(FaultError, match=r"\$\.node: 'gpu-z' has no simulated GPUs \(nodes: gpu-a\)"):
        await apply_fault(redis_client, subjects, XidFault(node="gpu-z", gpu=0, code=79))
    with pytest.raises(FaultError, match=r"\$\.gpu: gpu-a has no GPU 7 \(GPUs: 0 \(GPU-"):
        await apply_fault(redis_client, subjects, XidFault(node="gpu-a", gpu=7, code=79))
    with pytest.raises(FaultError, match=r"\$\.gpu: gpu-a has no GPU 'GPU-nope'"):
        await apply_fault(redis_client, subjects, LoseGpuFault(node="gpu-a", gpu="GPU-nope"))
    await apply_fault(redis_client, subjects, LoseGpuFault(node="gpu-a", gpu=1))
    with pytest.raises(FaultError, match=r"\$\.gpu: GPU 1 .* is already lost"):
        await apply_fault(redis_client, subjects, XidFault(node="gpu-a", gpu=1, code=79))
    # A node of the given spec gets its state created, as a service attaching would.
    done = await apply_fault(redis_client, subjects, XidFault(node="gpu-b", gpu=1, code=48), spec)
    assert "XID 48 raised on gpu-b GPU 1" in done


async def test_fault_cli_writes_through_redis(
    settings: Settings,
    subjects: Subjects,
    redis_client: aioredis.Redis,
    no_spec_file: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = SimGpus(redis_client, subjects, default_spec(), "node-2")
    devices = await port.devices()
    argv = ["xid", "--node", "node-2", "--gpu", "1", "--code", "79"]
    assert await asyncio.to_thread(fault_cli, argv, settings) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["simulated"] is True
    # The event was written before this read started: the port's cursor is where it attached.
    event = await first_event(port)
    assert (event.uuid, event.kind, event.xid, event.message) == (
        devices[1].uuid,
        "xid",
        79,
        "GPU has fallen off the bus",
    )

    assert await asyncio.to_thread(fault_cli, ["xid", "--node", "node-2", "--gpu", "0", "--code", "x"], settings) == 2
    assert "`$.code`" in capsys.readouterr().err
    assert await asyncio.to_thread(fault_cli, ["lose_gpu", "--node", "node-2", "--gpu", "5"], settings) == 2
    assert "$.gpu: node-2 has no GPU 5" in capsys.readouterr().err
    assert await asyncio.to_thread(fault_cli, ["lose_gpu", "--node", "node-7", "--gpu", "0"], settings) == 2
    assert "$.node: 'node-7' has no simulated GPUs" in capsys.readouterr().err
    assert await asyncio.to_thread(fault_cli, ["slow_copies", "--node", "node-2", "--gpu", "0"], settings) == 2
    assert "--factor" in capsys.readouterr().err
    argv = ["slow_copies", "--node", "node-2", "--gpu", devices[0].uuid, "--factor", "3"]
    assert await asyncio.to_thread(fault_cli, argv, settings) == 0
    assert await port.copy_slowdown(devices[0].uuid) == 3.0


# -- the health rules ---------------------------------------------------------------------------------------------
events = st.one_of(
    st.builds(GpuHealthEvent, uuid=st.just("GPU-1"), kind=st.just("xid"), xid=st.integers(1, 255)),
    st.builds(GpuHealthEvent, uuid=st.just("GPU-1"), kind=st.just("lost")),
)


@given(st.lists(events, max_size=20))
def test_health_only_gets_worse_and_application_xids_never_count(sequence: list[GpuHealthEvent]) -> None:
    order = {"healthy": 0, "unhealthy": 1, "lost": 2}
    health: GpuHealth = "healthy"
    for event in sequence:
        verdict = judge(event, health)
        if event.kind == "xid":
            assert verdict.critical == (event.xid not in DEFAULT_APPLICATION_XIDS)
        assert order[verdict.health] >= order[health]
        assert verdict.changed == (verdict.health != health)
        health = verdict.health
    if any(e.kind == "lost" for e in sequence):
        assert health == "lost"


# -- end to end: faults over NATS reach the device service --------------------------------------------------------
async def _fault(bus: Bus, subjects: Subjects, body: dict[str, Any]) -> dict[str, Any]:
    reply = await bus.nc.request(subjects.command("sim", "fault"), json.dumps(body).encode(), timeout=5)
    return dict(json.loads(reply.data))


async def test_faults_over_nats_reach_the_device_service_as_gpu_events(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, spec: SimSpec
) -> None:
    xids: list[GpuXid] = []
    health: list[DeviceHealthChanged] = []
    inventories: list[DeviceInventory] = []

    async def keep(event: Any) -> None:
        match event:
            case GpuXid():
                xids.append(event)
            case DeviceHealthChanged():
                health.append(event)
            case DeviceInventory():
                inventories.append(event)

    await bus.subscribe(subjects.pattern("device.xid"), keep, accepts=(GpuXid,))
    await bus.subscribe(subjects.pattern("device.health.changed"), keep, accepts=(DeviceHealthChanged,))
    await bus.subscribe(subjects.pattern("device.inventory"), keep, accepts=(DeviceInventory,))
    gpus = SimGpus(redis_client, subjects, spec, "node-1")
    service = DeviceService(DeviceSettings(inventory_s=0.05), gpus=gpus)
    running = await start_service(service, settings, Wiring)
    try:
        first = await eventually(lambda: inventories and inventories[0])
        assert first.simulated and len(first.gpus) == 2 and first.driver_version == "550.54.15"
        gpu0, gpu1 = (g.uuid for g in first.gpus)

        assert (await _fault(bus, subjects, {"kind": "xid", "node": "node-1", "gpu": 1, "code": 13}))["ok"]
        reply = await _fault(bus, subjects, {"kind": "xid", "node": "node-1", "gpu": gpu0, "code": 79})
        assert reply == {"ok": True, "simulated": True, "applied": f"XID 79 raised on node-1 GPU 0 ({gpu0})"}
        changed = await eventually(lambda: health and health[0])
        # Health changes arrive in order on one subscription: had XID 13 counted, its change would be first.
        assert (changed.gpu_uuid, changed.healthy, changed.xid) == (gpu0, False, 79)
        assert changed.reason == "XID 79: GPU has fallen off the bus"
        await eventually(lambda: len(xids) == 2)
        assert {(x.gpu_uuid, x.xid, x.critical) for x in xids} == {(gpu1, 13, False), (gpu0, 79, True)}
        marked = await eventually(lambda: inventories[-1].gpus[0].healthy is False and inventories[-1])
        assert [g.healthy for g in marked.gpus] == [False, True]

        assert (await _fault(bus, subjects, {"kind": "lose_gpu", "node": "node-1", "gpu": 1}))["ok"]
        lost = await eventually(lambda: len(health) == 2 and health[1])
        assert (lost.gpu_uuid, lost.healthy, lost.xid) == (gpu1, False, None) and "lost" in lost.reason
        after = await eventually(lambda: len(inventories[-1].gpus) == 1 and inventories[-1])
        assert [g.uuid for g in after.gpus] == [gpu0]
        status = running.ctx.status
        # The service records a GPU's health once its change is published: the test may hear it first.
        await eventually(lambda: set(status["unhealthy"]) == {gpu0, gpu1})
        assert status["gpus"] == [gpu0]
        assert status["simulated"] is True and running.ctx.health()["simulated"] is True

        refused = await _fault(bus, subjects, {"kind": "xid", "node": "node-1", "gpu": 1, "code": 79})
        assert (
            refused["ok"] is False
            and refused["error"].startswith("$.gpu: GPU 1")
            and "already lost" in refused["error"]
        )
        refused = await _fault(bus, subjects, {"kind": "xid", "node": "node-1", "gpu": 0, "code": 79.5})
        assert refused["ok"] is False and "`$.code`" in refused["error"]

        done = await request_fault(bus, DriverInstallFault(node="node-1", mode="fail", reason="no space left"))
        assert done == "driver installs on node-1: fail no space left"
        with pytest.raises(DriverInstallError, match="no space left"):
            await gpus.install_driver("560.35.03")
        with pytest.raises(
            FaultError, match=r"\$\.node: 'node-9' has no simulated GPUs \(nodes: gpu-a, gpu-b, node-1\)"
        ):
            await request_fault(bus, SlowCopiesFault(node="node-9", gpu=0, factor=2.0))

        # A MIG change made by another process is found by the inventory loop and published.
        other = SimGpus(redis_client, subjects, spec, "node-1")
        await other.set_mig_mode(gpu0, True)
        await other.create_mig_instance(gpu0, "7g.80gb")
        mig = await eventually(lambda: inventories[-1].gpus[0].mig_instances and inventories[-1])
        assert mig.gpus[0].mig_enabled and mig.gpus[0].mig_instances[0].profile == "7g.80gb"
        assert health == [changed, lost]  # nothing else got worse
    finally:
        await running.stop(grace=1)


# -- standalone processes -----------------------------------------------------------------------------------------
def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUWARDEN_SIM_SPEC"}
    env.update(
        GPUWARDEN_NATS_URL=settings.nats.servers[0],
        GPUWARDEN_REDIS_URL=settings.redis.url,
        GPUWARDEN_ROOT=settings.root,
        GPUWARDEN_BACKEND="sim",
    )
    env.update(extra)
    return env


def test_device_process_runs_standalone_on_the_default_spec(settings: Settings) -> None:
    port = free_port()
    env = _env(settings, GPUWARDEN_NODE="node-3", GPUWARDEN_HTTP_ADDR=f"127.0.0.1:{port}")
    proc = subprocess.Popen([sys.executable, "-m", "services.device"], env=env, stderr=subprocess.PIPE)
    try:
        start = time.monotonic()
        while time.monotonic() - start < 30 and proc.poll() is None:
            try:
                if _get(port, "/readyz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail(f"the device service never became ready: {proc.communicate(timeout=20)[1].decode()[-2000:]}")
        health = json.loads(_get(port, "/healthz")[1])
        assert health["simulated"] is True and health["sim_faults"] is True and len(health["gpus"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        stderr = proc.stderr.read().decode()  # type: ignore[union-attr]
        assert "SIMULATED" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()


def test_device_process_with_a_bad_spec_does_not_start(settings: Settings, tmp_path: Path) -> None:
    bad = tmp_path / "spec.yaml"
    bad.write_text("nodes: [{name: node-1, gpus: [{count: 0}]}]")
    env = _env(settings, GPUWARDEN_NODE="node-1", GPUWARDEN_SIM_SPEC=str(bad))
    result = subprocess.run(
        [sys.executable, "-m", "services.device"], env=env, capture_output=True, timeout=30, text=True
    )
    assert result.returncode == 1
    assert f"{bad}: Expected `int` >= 1 - at `$.nodes[0].gpus[0].count`" in result.stderr
    assert msgspec.json.decode(result.stderr.splitlines()[-1])["msg"] == "could not start"
