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
from nats.aio.msg import Msg

from services.driver.agent import BusNodeDriver, DriverAgent
from services.driver.config import load
from services.driver.ports import AgentUnreachable, InstallStatus
from shared.contract.annotations import UPGRADE_SINCE_ANNOTATION, UPGRADE_STATE_LABEL
from shared.contract.deadletter import DeadLetter
from shared.contract.driver import DriverAgentAnswer, InstallDriver
from shared.contract.permissions import USERS, nats_auth_config, user_name
from shared.contract.registry import codec
from shared.contract.subjects import Subjects
from shared.host.devservers import NatsServer
from shared.plumbing.bus import Bus
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import NatsSettings, Secret, Settings
from shared.ports.cluster import NodeInfo
from shared.ports.gpu import GpuError
from shared.sim.cluster import SimCluster
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
async def cluster(redis_client: aioredis.Redis, subjects: Subjects) -> SimCluster:
    """The simulated cluster of ``SPEC``, both nodes waiting for their driver (``pod-restart-required``) since
    time 1: the install the agents are asked for is attempt ``<node>@1``."""
    created = await SimCluster.create(redis_client, subjects, SPEC)
    for node in SPEC.nodes:
        await restart_required(created, node.name, "1")
    return created


async def restart_required(cluster: SimCluster, node: str, since: str) -> None:
    """``node`` entered ``pod-restart-required`` at ``since``, as the coordinator writes it."""
    await cluster.set_node_labels(node, {UPGRADE_STATE_LABEL: "pod-restart-required"})
    await cluster.set_node_annotations(node, {UPGRADE_SINCE_ANNOTATION: since})


@pytest.fixture
async def node1(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis, cluster: SimCluster
) -> AsyncIterator[tuple[DriverAgent, CountingGpus]]:
    """node-1's driver agent on a NATS connection of its own, as node-1's driver service has."""
    agent_bus = await Bus.connect(settings.nats, subjects, "driver/node-1")
    gpus = CountingGpus(redis_client, subjects, SPEC, "node-1", poll_s=0.02)
    agent = DriverAgent("node-1", gpus, cluster)
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
    bus: Bus,
    node1: tuple[DriverAgent, CountingGpus],
    redis_client: aioredis.Redis,
    subjects: Subjects,
    cluster: SimCluster,
) -> None:
    _, gpus = node1
    node = BusNodeDriver(bus, "node-1", TIMEOUT_S)
    await _fault(redis_client, subjects, "hang")
    stopped = await node.install(NEW, "node-1@1", 0.2)
    assert stopped.progress == "failed" and "did not finish within 0.2s on node-1; stopped" in stopped.reason
    assert await node.install(NEW, "node-1@1", 0.2) == stopped  # the same attempt: its result, not a new install
    await _fault(redis_client, subjects, "fail", "DKMS build failed")
    await restart_required(cluster, "node-1", "2")  # the coordinator tries again: the node entered the state anew
    failed = await node.install(NEW, "node-1@2", 60.0)
    assert failed.progress == "failed" and "DKMS build failed" in failed.reason
    await _fault(redis_client, subjects, "clear")
    await restart_required(cluster, "node-1", "3")
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
    cluster = await SimCluster.create(redis_client, subjects, SPEC)
    await restart_required(cluster, "node-2", "1")
    agent = DriverAgent("node-2", SimGpus(redis_client, subjects, SPEC, "node-2"), cluster)
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


# -- a command heard again ------------------------------------------------------------------------------------------
class UnreadableCluster(SimCluster):
    """The cluster's API does not answer (a control plane restarting)."""

    async def node(self, name: str) -> NodeInfo | None:
        raise ConnectionError("the API server does not answer")


async def _agent(
    settings: Settings, subjects: Subjects, gpus: CountingGpus, cluster: SimCluster
) -> tuple[DriverAgent, Bus]:
    """node-1's driver agent, started afresh (nothing in its memory) on a NATS connection of its own."""
    agent_bus = await Bus.connect(settings.nats, subjects, "driver/node-1")
    agent = DriverAgent("node-1", gpus, cluster)
    await agent.serve(agent_bus)
    return agent, agent_bus


async def _stop(running: tuple[DriverAgent, Bus]) -> None:
    await running[0].close()
    await running[1].close(grace=0.5)


async def test_an_install_heard_again_once_the_node_moved_on_installs_nothing(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis, cluster: SimCluster
) -> None:
    """The coordinator's install command, captured off the wire and sent again byte for byte: to the agent that
    ran it, to the agent restarted (its memory gone) once the node is done, and after a later upgrade installed a
    newer driver. Only the node's upgrade state calls for an install: nothing is installed again, no older
    driver is put back, and each refusal names why. A node that cannot be read is a temporary failure."""
    gpus = CountingGpus(redis_client, subjects, SPEC, "node-1", poll_s=0.02)
    heard: list[tuple[str, bytes]] = []

    async def on_msg(msg: Msg) -> None:
        heard.append((msg.subject, bytes(msg.data)))

    sub = await bus.nc.subscribe(subjects.pattern("driver.install.command", node="node-1"), cb=on_msg)
    running = await _agent(settings, subjects, gpus, cluster)
    node = BusNodeDriver(bus, "node-1", TIMEOUT_S)
    try:
        assert await node.install(NEW, "node-1@1", 60.0) == InstallStatus("installed")
        await eventually(lambda: len(heard) == 1)
        await sub.unsubscribe()
        subject, data = heard[0]

        async def again() -> DriverAgentAnswer | DeadLetter:
            reply = await bus.nc.request(subject, data, timeout=TIMEOUT_S)
            answer = codec.decode(reply.data)
            assert isinstance(answer, DriverAgentAnswer | DeadLetter)
            return answer

        await cluster.set_node_labels("node-1", {UPGRADE_STATE_LABEL: "upgrade-done"})  # validated, uncordoned
        first = await again()  # the agent that ran it: its result, from memory
        assert isinstance(first, DriverAgentAnswer) and first.outcome == "ok" and gpus.installs == 1
        await _stop(running)
        running = await _agent(settings, subjects, gpus, cluster)
        refused = await again()  # restarted: the node is done, nothing to install
        assert isinstance(refused, DeadLetter), refused
        assert "node node-1 is in upgrade-done, not pod-restart-required" in refused.reason
        assert gpus.installs == 1

        await restart_required(cluster, "node-1", "5")  # a later upgrade, to a newer driver
        assert await node.install(NEWER, "node-1@5", 60.0) == InstallStatus("installed")
        assert gpus.installs == 2
        older = await again()  # the first upgrade's command while the node waits in the second's install state
        assert isinstance(older, DeadLetter) and "the node's current attempt is node-1@5" in older.reason
        await cluster.set_node_labels("node-1", {UPGRADE_STATE_LABEL: "upgrade-done"})
        assert isinstance(await again(), DeadLetter)
        assert gpus.installs == 2 and (await node.versions()).driver == NEWER  # no older driver put back

        await _stop(running)
        running = await _agent(settings, subjects, gpus, UnreadableCluster(redis_client, subjects))
        await restart_required(cluster, "node-1", "9")
        with pytest.raises(AgentUnreachable, match="cannot read node node-1's upgrade state"):
            await node.install(NEWER, "node-1@9", 60.0)
        assert gpus.installs == 2
    finally:
        await _stop(running)
