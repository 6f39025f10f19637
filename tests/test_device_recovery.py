"""A GPU taken out by a critical XID comes back after a quiet period and a passing probe; a lost one does not.
Which XIDs are the application's fault (and so ignored) is configurable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from services.device.config import DEFAULT_APPLICATION_XIDS, DeviceSettings, load
from services.device.health import judge, may_recover
from services.device.service import DeviceService
from shared.contract.device import DeviceHealthChanged, GpuXid
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.bus import Bus
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Settings
from shared.ports.gpu import GpuHealthEvent
from shared.sim.faults import XidFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import default_spec
from shared.wiring import Wiring
from tests.helpers import eventually


@given(
    st.sampled_from(["healthy", "unhealthy", "lost"]),
    st.floats(0, 1000),
    st.floats(0, 1000),
    st.floats(0, 100),
)
def test_only_a_quiet_unhealthy_gpu_may_recover(health: Any, last: float, now: float, quiet: float) -> None:
    allowed = may_recover(health, last, now, quiet)
    assert allowed == (health == "unhealthy" and quiet > 0 and now - last >= quiet)


def test_recovery_setting() -> None:
    assert load({}).recovery_s == 300.0
    assert load({"GPUWARDEN_DEVICE_RECOVERY_S": "0"}).recovery_s == 0.0


async def test_critical_xid_then_quiet_period_then_healthy_again(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    changes: list[DeviceHealthChanged] = []

    async def keep(event: DeviceHealthChanged) -> None:
        changes.append(event)

    await bus.subscribe(subjects.pattern("device.health.changed"), keep, accepts=(DeviceHealthChanged,))
    gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
    service = DeviceService(DeviceSettings(inventory_s=0.05, recovery_s=0.5, plugin="off"), gpus=gpus)
    running = await start_service(service, settings, Wiring)
    try:
        await eventually(lambda: service.gpu_state.health == {} and running.ctx.status.get("gpus"))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        down = await eventually(lambda: changes and changes[0])
        assert down.healthy is False and down.xid == 79
        metric = running.ctx.telemetry.registry.get_sample_value
        gpus = {"node": "node-1", "health": "unhealthy"}
        await eventually(lambda: metric("gpuwarden_device_gpus", gpus) == 1.0)  # /metrics says it too
        assert metric("gpuwarden_device_xid_errors_total", {"node": "node-1", "critical": "true"}) == 1.0
        up = await eventually(lambda: len(changes) == 2 and changes[1])
        assert up.gpu_uuid == down.gpu_uuid and up.healthy is True
        assert up.reason.startswith("recovered: no critical XID for")
        # the event is heard as soon as it is stored; the service forgets the reason right after
        await eventually(lambda: running.ctx.status["unhealthy"] == {})
        assert metric("gpuwarden_device_gpus", gpus) == 0.0
        assert metric("gpuwarden_device_gpus", {"node": "node-1", "health": "healthy"}) == 2.0
    finally:
        await running.stop(grace=1)


# -- which XIDs are the application's ---------------------------------------------------------------------------
def test_application_xids_setting() -> None:
    assert load({}).application_xids == DEFAULT_APPLICATION_XIDS == frozenset({13, 31, 43, 45, 68, 109})
    assert load({"GPUWARDEN_DEVICE_APPLICATION_XIDS": ""}).application_xids == DEFAULT_APPLICATION_XIDS
    assert load({"GPUWARDEN_DEVICE_APPLICATION_XIDS": " 13, 79,13 "}).application_xids == frozenset({13, 79})
    assert load({"GPUWARDEN_DEVICE_APPLICATION_XIDS": "none"}).application_xids == frozenset()


@pytest.mark.parametrize("raw", ["13,abc", "13,,31", "-13", "0", "13;31", "1.5"])
def test_a_bad_application_xid_list_names_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError, match=r"^GPUWARDEN_DEVICE_APPLICATION_XIDS=.*is not an XID"):
        load({"GPUWARDEN_DEVICE_APPLICATION_XIDS": raw})


def test_the_service_refuses_to_start_with_a_bad_list() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "services.device"],
        cwd=Path(__file__).resolve().parent.parent,
        env={"PATH": "/usr/bin:/bin", "GPUWARDEN_DEVICE_APPLICATION_XIDS": "13,x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip().startswith("device: GPUWARDEN_DEVICE_APPLICATION_XIDS='13,x': 'x' is not an XID")
    assert "Traceback" not in run.stderr


@given(st.integers(1, 200), st.frozensets(st.integers(1, 200), max_size=8))
def test_an_xid_is_critical_unless_listed(xid: int, application: frozenset[int]) -> None:
    verdict = judge(GpuHealthEvent(uuid="GPU-a", kind="xid", xid=xid), "healthy", application)
    assert verdict.critical == (xid not in application)
    assert verdict.changed == verdict.critical


async def test_the_configured_list_decides(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    xids: list[GpuXid] = []
    changes: list[DeviceHealthChanged] = []

    async def keep_xid(event: GpuXid) -> None:
        xids.append(event)

    async def keep_change(event: DeviceHealthChanged) -> None:
        changes.append(event)

    await bus.subscribe(subjects.pattern("device.xid"), keep_xid, accepts=(GpuXid,))
    await bus.subscribe(subjects.pattern("device.health.changed"), keep_change, accepts=(DeviceHealthChanged,))
    gpus = SimGpus(redis_client, subjects, default_spec(), "node-1")
    configured = DeviceSettings(inventory_s=0.05, recovery_s=0, plugin="off", application_xids=frozenset({79}))
    service = DeviceService(configured, gpus=gpus)
    running = await start_service(service, settings, Wiring)
    try:
        await eventually(lambda: running.ctx.status.get("gpus"))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        first = await eventually(lambda: xids and xids[0])
        assert first.xid == 79 and first.critical is False, "79 is listed as the application's here"
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=13))
        second = await eventually(lambda: len(xids) == 2 and xids[1])
        assert second.xid == 13 and second.critical is True, "13 is not listed here, so it counts"
        (change,) = await eventually(lambda: changes)
        assert change.xid == 13 and change.gpu_uuid == first.gpu_uuid and not change.healthy
        assert service.gpu_state.health == {first.gpu_uuid: "unhealthy"}
    finally:
        await running.stop(grace=1)
