"""A GPU taken out by a critical XID comes back after a quiet period and a passing probe; a lost one does not."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from services.device.config import DeviceSettings, load
from services.device.handlers import DeviceService, may_recover
from shared.contract.device import DeviceHealthChanged
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.runner import start_service
from shared.plumbing.settings import Settings
from shared.sim.faults import XidFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import default_spec
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
    running = await start_service(service, settings)
    try:
        await eventually(lambda: service.health == {} and running.ctx.status.get("gpus"))
        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
        down = await eventually(lambda: changes and changes[0])
        assert down.healthy is False and down.xid == 79
        up = await eventually(lambda: len(changes) == 2 and changes[1])
        assert up.gpu_uuid == down.gpu_uuid and up.healthy is True
        assert up.reason.startswith("recovered: no critical XID for")
        assert running.ctx.status["unhealthy"] == {}
    finally:
        await running.stop(grace=1)
