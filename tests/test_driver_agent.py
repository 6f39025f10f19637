"""The driver agent on each node and the coordinator's client of it, over real NATS: an install that runs long is
joined, never started twice; a finished one is answered from memory; the agent bounds what hangs; commands for
another node or with a bad version are refused with the reason; a node with no agent is reported as silent; and
the driver user, held to its own node, may still command every node's agent on a server that enforces it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from services.driver.agent import BusNodeDriver, DriverAgent
from services.driver.config import load
from services.driver.ports import AgentUnreachable, InstallStatus
from shared.contract.deadletter import DeadLetter
from shared.contract.driver import InstallDriver
from shared.contract.permissions import USERS, nats_auth_config, user_name
from shared.contract.subjects import Subjects
from shared.host.devservers import NatsServer
from shared.plumbing.bus import Bus
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import NatsSettings, Secret, Settings
from shared.ports.gpu import GpuError
from shared.sim.faults import DriverInstallFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import NodeSpec, SimSpec
from tests.helpers import eventually

OLD, NEW, NEWER = "550.54.15", "560.35.03", "570.86.10"
SPEC = SimSpec(nodes=[NodeSpec(name="node-1"), NodeSpec(name="node-2")])
TIMEOUT_S = 2.0


class CountingGpus(SimGpus):
    """The simulated GPUs, counting how many installs were started on them."""

    installs = 0

    async def install_driver(self, version: str) -> None:
        self.installs += 1
        await super().install_driver(version)


@pytest.fixture
async def node1(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis
) -> AsyncIterator[tuple[DriverAgent, CountingGpus]]:
    """node-1's driver agent on a NATS connection of its own, as node-1's driver service has."""
    agent_bus = await Bus.connect(settings.nats, subjects, "driver/node-1")
    gpus = CountingGpus(redis_client, subjects, SPEC, "node-1", poll_s=0.02)
    agent = DriverAgent("node-1", gpus)
    await agent.serve(agent_bus)
    yield agent, gpus
    await agent.close()
    await agent_bus.close(grace=0.5)


async def _fault(client: aioredis.Redis, subjects: Subjects, mode: str, reason: str = "") -> None:
    await apply_fault(client, subjects, DriverInstallFault(node="node-1", mode=mode, reason=reason), SPEC)  # type: ignore[arg-type]


async def test_versions_validation_and_install_through_the_agent(
    bus: Bus, node1: tuple[DriverAgent, CountingGpus]
) -> None:
    _, gpus = node1
    node = BusNodeDriver(bus, "node-1", TIMEOUT_S)
    assert (await node.versions()).driver == OLD
    before = await node.validate(NEW)
    assert not before.ok and f"{NEW} was expected" in before.reason and before.version == OLD
    assert await node.install(NEW, "node-1@1", 60.0) == InstallStatus("installed")
    assert await node.install(NEW, "node-1@1", 60.0) == InstallStatus("installed")  # answered from memory
    assert gpus.installs == 1
    after = await node.validate(NEW)
    assert after.ok and after.version == NEW and after.visible_gpus == 2
    assert (await node.versions()).driver == NEW


async def test_an_install_that_runs_long_is_joined_not_started_again(
    bus: Bus, node1: tuple[DriverAgent, CountingGpus], redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    agent, gpus = node1
    node = BusNodeDriver(bus, "node-1", TIMEOUT_S)
    await _fault(redis_client, subjects, "hang")
    first = await node.install(NEW, "node-1@1", 60.0)
    assert first.progress == "running" and NEW in first.reason
    # a restarted coordinator asks again, even under another attempt: the same install, joined
    assert (await node.install(NEW, "node-1@2", 60.0)).progress == "running"
    other = await node.install(NEWER, "node-1@3", 60.0)
    assert other.progress == "running" and f"installing {NEW} first" in other.reason
    assert gpus.installs == 1
    await _fault(redis_client, subjects, "clear")
    await eventually(lambda: agent.status()["outcome"] == "ok")
    assert await node.install(NEW, "node-1@1", 60.0) == InstallStatus("installed")
    assert gpus.installs == 1
    assert (await node.versions()).driver == NEW


async def test_the_agent_stops_an_install_past_its_timeout_and_a_new_attempt_installs_again(
    bus: Bus, node1: tuple[DriverAgent, CountingGpus], redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    _, gpus = node1
    node = BusNodeDriver(bus, "node-1", TIMEOUT_S)
    await _fault(redis_client, subjects, "hang")
    stopped = await node.install(NEW, "node-1@1", 0.2)
    assert stopped.progress == "failed" and "did not finish within 0.2s on node-1; stopped" in stopped.reason
    assert await node.install(NEW, "node-1@1", 0.2) == stopped  # the same attempt: its result, not a new install
    await _fault(redis_client, subjects, "fail", "DKMS build failed")
    failed = await node.install(NEW, "node-1@2", 60.0)
    assert failed.progress == "failed" and "DKMS build failed" in failed.reason
    await _fault(redis_client, subjects, "clear")
    assert await node.install(NEW, "node-1@3", 60.0) == InstallStatus("installed")
    assert gpus.installs == 3


async def test_commands_for_another_node_or_with_a_bad_version_are_refused(
    bus: Bus, node1: tuple[DriverAgent, CountingGpus], subjects: Subjects
) -> None:
    _, gpus = node1
    misrouted = InstallDriver(node="node-2", version=NEW)
    answer = await bus.request(subjects.pattern("driver.install.command", node="node-1"), misrouted, TIMEOUT_S)
    assert isinstance(answer, DeadLetter) and "node='node-2'" in answer.reason and "node-1" in answer.reason
    node = BusNodeDriver(bus, "node-1", TIMEOUT_S)
    with pytest.raises(GpuError, match=r"refused driver.install.command.*version") as refused:
        await node.install("latest", "node-1@1", 60.0)
    assert not isinstance(refused.value, AgentUnreachable)
    assert gpus.installs == 0


async def test_a_node_without_an_agent_does_not_answer(bus: Bus) -> None:
    node = BusNodeDriver(bus, "node-9", TIMEOUT_S)
    with pytest.raises(AgentUnreachable, match="the driver agent on node-9 does not answer"):
        await node.versions()
    with pytest.raises(AgentUnreachable, match="node-9"):
        await node.install(NEW, "node-9@1", 60.0)
    with pytest.raises(AgentUnreachable, match="node-9"):
        await node.validate(NEW)


# -- under the driver user's permissions ----------------------------------------------------------------------------
@pytest.fixture
def secured(tmp_path: Path, subjects: Subjects) -> Iterator[tuple[NatsServer, dict[str, str]]]:
    """A nats-server of this test's own, knowing only the users of ``nats_auth_config``, the driver held to node-1."""
    passwords = {name: secrets.token_urlsafe(18) for name in USERS}
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_auth_config(subjects, passwords, node="node-1"))
    conf.chmod(0o600)
    server = NatsServer(config=conf)
    try:
        server.start()
        yield server, passwords
    finally:
        server.cleanup()


async def test_the_driver_user_held_to_its_node_commands_every_nodes_agent(
    secured: tuple[NatsServer, dict[str, str]], subjects: Subjects, redis_client: aioredis.Redis
) -> None:
    server, passwords = secured
    as_driver = NatsSettings(
        servers=(server.url,), user=user_name(subjects, "driver"), password=Secret(passwords["driver"])
    )
    coordinator_bus = await Bus.connect(as_driver, subjects, "driver/node-1", connect_timeout=2.0)
    agent_bus = await Bus.connect(as_driver, subjects, "driver/node-2", connect_timeout=2.0)
    agent = DriverAgent("node-2", SimGpus(redis_client, subjects, SPEC, "node-2"))
    try:
        await agent.serve(agent_bus)
        node2 = BusNodeDriver(coordinator_bus, "node-2", TIMEOUT_S)
        assert (await node2.versions()).driver == OLD
        assert await node2.install(NEW, "node-2@1", 60.0) == InstallStatus("installed")
        assert (await node2.validate(NEW)).ok
    finally:
        await agent.close()
        await agent_bus.close(grace=0.5)
        await coordinator_bus.close(grace=0.5)


def test_the_lease_must_outlast_two_agent_commands() -> None:
    assert load({}).agent_timeout_s == 5.0 and load({}).lease_ttl_s == 15.0
    with pytest.raises(SettingsError, match="GPUWARDEN_DRIVER_LEASE_TTL_S=8 must be at least twice"):
        load({"GPUWARDEN_DRIVER_LEASE_TTL_S": "8"})
    with pytest.raises(SettingsError, match="GPUWARDEN_DRIVER_AGENT_TIMEOUT_S"):
        load({"GPUWARDEN_DRIVER_AGENT_TIMEOUT_S": "soon"})
