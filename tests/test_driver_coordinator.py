"""The upgrade coordinator on the simulated cluster, driven pass by pass: restarts at every state, fencing (the lease
and the compare-and-set on each node's revision), failures that stop the rollout, PodDisruptionBudget refusals
retried with backoff, jobs waited for, installs and validations that hang or meet no agent at all. Every node's
GPUs are reached the real way: the coordinator asks each node's driver agent over NATS, and each agent answers with
that node's simulated GPUs. The checkpoint service is stood in for by a responder on the same bus that answers
each drain's verdict query from what the test decided (the full drain with live sessions is in
tests/test_driver_rollout.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from services.driver.agent import DriverAgent, bus_node_drivers
from services.driver.coordinator import UpgradeCoordinator
from services.driver.gauges import UpgradeCollector
from services.driver.lease import RedisLeaderLease
from services.driver.pace import PassPace
from services.driver.ports import LeaseUnavailable, NodeDriver, NodeDrivers, StaleLeader
from services.driver.upgrade import ORDER
from shared.clients.drains import RecordReader
from shared.contract.annotations import (
    CORDON_DRAIN_ANNOTATION,
    UPGRADE_FAILURE_ANNOTATION,
    UPGRADE_FENCE_ANNOTATION,
    UPGRADE_SINCE_ANNOTATION,
    UPGRADE_STATE_LABEL,
    UPGRADE_WAS_CORDONED_ANNOTATION,
)
from shared.contract.base import Event
from shared.contract.configdocs import DriverPolicy
from shared.contract.driver import DriverInstallFailed, DriverUpgradeStateChanged
from shared.contract.node import DrainCompleted, DrainFailed, DrainQuery, DrainRecord, DrainRequested
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus, Subscription
from shared.plumbing.settings import Settings
from shared.ports.cluster import ClusterChange, ClusterConflict, EvictionOutcome, NodeInfo, PodInfo
from shared.ports.gpu import DriverValidation, GpuPort
from shared.sim.cluster import SimCluster
from shared.sim.faults import DriverInstallFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import DeploymentSpec, NodeSpec, SimSpec
from tests.helpers import eventually

NEW = "560.35.03"
OLD = "550.54.15"
AGENT_TIMEOUT_S = 2.0


class Killed(BaseException):
    """The coordinator process dies here (not an error it could handle)."""


class CountingCluster(SimCluster):
    """The simulated cluster, counting every eviction call per pod; ``die_after_evict`` kills the caller once."""

    calls: Counter[str]
    outcomes: list[tuple[str, EvictionOutcome]]
    die_after_evict = False

    async def evict(self, namespace: str, pod: str) -> EvictionOutcome:
        outcome = await super().evict(namespace, pod)
        self.calls[pod] += 1
        self.outcomes.append((pod, outcome))
        if self.die_after_evict and outcome is EvictionOutcome.EVICTED:
            self.die_after_evict = False
            raise Killed
        return outcome


class HungValidationGpus(SimGpus):
    """A node whose driver no longer answers a validation (nvidia-smi hangs): the simulated GPUs, but
    ``validate_driver`` never returns."""

    async def validate_driver(self, expected_version: str) -> DriverValidation:
        await asyncio.Event().wait()
        raise AssertionError("not reached")


class Harness:
    """The cluster, one driver agent per node (each on its own NATS connection, as each node's driver service),
    and the coordinator, driven one pass at a time with ``step``."""

    def __init__(
        self, settings: Settings, client: aioredis.Redis, bus: Bus, spec: SimSpec, policy: DriverPolicy
    ) -> None:
        self.settings = settings
        self.client = client
        self.bus = bus
        self.subjects = bus.subjects
        self.spec = spec
        self.policy = policy
        self.events: list[Event] = []
        self.verdicts = RecordReader(bus)
        self.recorded: dict[str, DrainCompleted | DrainFailed] = {}
        """What the stand-in checkpoint service answers, by drain id."""
        self.answer = "completed"
        self.responder: Subscription | None = None
        self.kill_at = ""
        self.clock: Callable[[], float] = time.time
        self.generation = 0
        self.agent_timeout_s = AGENT_TIMEOUT_S
        self.agents: dict[str, tuple[DriverAgent, Bus]] = {}
        self.cluster_for_coordinator: SimCluster | None = None
        """What the coordinators read the cluster through (default: ``cluster``)."""
        self.drivers_for_coordinator: NodeDrivers | None = None

    async def setup(self) -> None:
        await self.setup_responder()
        created = await CountingCluster.create(self.client, self.subjects, self.spec)
        assert isinstance(created, CountingCluster)
        self.cluster = created
        self.cluster.calls = Counter()
        self.cluster.outcomes = []
        for node in self.spec.nodes:
            await self.start_agent(node.name)
        self.coordinator = self.new_coordinator()

    async def setup_responder(self) -> None:
        """The checkpoint service's part: the verdicts it recorded, answered by drain id."""

        async def on_query(query: DrainQuery) -> DrainRecord:
            return DrainRecord(drain_id=query.drain_id, verdict=self.recorded.get(query.drain_id))

        self.responder = await self.bus.serve(self.subjects.command("checkpoint", "drain"), on_query, (DrainQuery,))

    async def start_agent(self, node: str, gpus: GpuPort | None = None) -> DriverAgent:
        agent_bus = await Bus.connect(self.settings.nats, self.subjects, f"driver/{node}")
        # the agent reads its node through a view of its own (the coordinator's reads are the ones counted)
        agent = DriverAgent(node, gpus or self.gpus(node), SimCluster(self.client, self.subjects))
        await agent.serve(agent_bus)
        self.agents[node] = (agent, agent_bus)
        return agent

    async def stop_agent(self, node: str) -> None:
        agent, agent_bus = self.agents.pop(node)
        await agent.close()
        await agent_bus.close(grace=0.5)

    async def close(self) -> None:
        for node in list(self.agents):
            await self.stop_agent(node)
        if self.responder is not None:
            await self.responder.unsubscribe()

    def gpus(self, node: str) -> SimGpus:
        return SimGpus(self.client, self.subjects, self.spec, node)

    def new_coordinator(self) -> UpgradeCoordinator:
        self.generation += 1
        lease = RedisLeaderLease(self.client, self.subjects, f"coordinator-{self.generation}", ttl_s=30.0)
        return UpgradeCoordinator(
            self.cluster_for_coordinator or self.cluster,
            self.drivers_for_coordinator or bus_node_drivers(self.bus, self.agent_timeout_s),
            lease,
            self.verdicts,
            self.publish,
            lambda: self.policy,
            clock=lambda: self.clock(),
            on_transition=self.transition,
        )

    def transition(self, node: str, previous: str, state: str) -> None:
        if state == self.kill_at:
            self.kill_at = ""
            raise Killed

    async def publish(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, DrainRequested) and self.answer:
            node, drain_id = event.node, event.drain_id
            failed = self.answer.removeprefix("failed: ")
            self.recorded[drain_id] = (
                DrainCompleted(node=node, drain_id=drain_id)
                if self.answer == "completed"
                else DrainFailed(node=node, drain_id=drain_id, reason=failed)
            )

    async def kubelet(self) -> None:
        """The workload's side: every Terminating pod finishes its preStop at once."""
        for pod in await self.cluster.pods():
            if pod.phase == "Terminating":
                await self.cluster.mark_prestop_done(pod.namespace, pod.name)
        await self.cluster.tick()

    async def step(self) -> None:
        """One pass; a killed coordinator is replaced by a new process (new holder), which leads once the dead one's
        lease has run out."""
        try:
            await self.coordinator.reconcile_once()
        except Killed:
            self.coordinator = self.new_coordinator()
            assert not await self.coordinator.reconcile_once()
            await self.lease_runs_out()
            assert await self.coordinator.reconcile_once()
        await self.kubelet()

    async def lease_runs_out(self) -> None:
        """What the lease's TTL does to a holder that stopped renewing it."""
        await self.client.delete(self.subjects.redis_key("driver", "leader"))

    async def run_until(self, done: Callable[[], object], passes: int = 200) -> None:
        for _ in range(passes):
            await self.step()
            value = done()
            if hasattr(value, "__await__"):
                value = await value  # type: ignore[misc]
            if value:
                return
        raise AssertionError("the rollout did not get there")

    async def states(self) -> dict[str, str]:
        return {n.name: n.labels.get(UPGRADE_STATE_LABEL, "") for n in await self.cluster.nodes()}

    def history(self, node: str) -> list[str]:
        return [e.state for e in self.events if isinstance(e, DriverUpgradeStateChanged) and e.node == node]

    def failures(self, node: str) -> list[str]:
        return [
            e.reason
            for e in self.events
            if isinstance(e, DriverUpgradeStateChanged) and e.node == node and e.state == "upgrade-failed"
        ]


MakeHarness = Callable[[SimSpec, DriverPolicy], Awaitable[Harness]]


@pytest.fixture
async def make_harness(settings: Settings, bus: Bus, redis_client: aioredis.Redis) -> AsyncIterator[MakeHarness]:
    made: list[Harness] = []

    async def make(spec: SimSpec, policy: DriverPolicy) -> Harness:
        harness = Harness(settings, redis_client, bus, spec, policy)
        made.append(harness)
        await harness.setup()
        return harness

    yield make
    for harness in made:
        await harness.close()


def two_nodes(max_unavailable: int = 1) -> SimSpec:
    return SimSpec(
        nodes=[NodeSpec(name="node-1"), NodeSpec(name="node-2", driver_version=NEW)],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2, max_unavailable=max_unavailable)],
    )


POLICY = DriverPolicy(desired_version=NEW, auto_upgrade=True, max_parallel_upgrades=1, max_unavailable="1")


async def _all_done(h: Harness) -> bool:
    return all(state == "upgrade-done" for state in (await h.states()).values() if state)


@pytest.mark.parametrize("kill_at", [*ORDER[1:-1], "evicted"])
async def test_a_coordinator_killed_at_any_state_resumes_without_double_evictions(
    make_harness: MakeHarness, kill_at: str
) -> None:
    h = await make_harness(two_nodes(), POLICY)
    pods_before = {p.name for p in await h.cluster.pods(node="node-1")}
    if kill_at == "evicted":
        h.cluster.die_after_evict = True
    else:
        h.kill_at = kill_at
    await h.run_until(lambda: _all_done(h))
    assert h.generation == 2, "the coordinator was killed once and replaced once"
    assert h.history("node-1") == list(ORDER)
    assert h.history("node-2") == []
    assert set(h.cluster.calls) == pods_before and max(h.cluster.calls.values()) == 1, h.cluster.calls
    node = await h.cluster.node("node-1")
    assert node is not None and node.schedulable and UPGRADE_WAS_CORDONED_ANNOTATION not in node.annotations
    assert (await h.gpus("node-1").versions()).driver == NEW
    assert sum(isinstance(e, DrainRequested) for e in h.events) == 1


# -- fencing ------------------------------------------------------------------------------------------------------
async def test_a_stale_leader_cannot_write(make_harness: MakeHarness) -> None:
    h = await make_harness(two_nodes(), POLICY)
    old = h.coordinator
    assert await old.reconcile_once()
    await h.lease_runs_out()
    new = h.new_coordinator()
    assert await new.reconcile_once() and new.token > old.token
    with pytest.raises(StaleLeader):
        await old._guard(await old._view((await h.cluster.nodes())[0]))
    assert not await old.reconcile_once()  # it cannot take the lease back while the new one holds it


async def test_a_write_decided_on_a_stale_read_is_refused(make_harness: MakeHarness) -> None:
    """The gap the lease check leaves: the old leader checks its token, then a new leader takes over and writes the
    node, then the old leader's write arrives. It is a compare-and-set on the revision it read, so it is refused."""
    h = await make_harness(two_nodes(), POLICY)
    old = h.coordinator
    assert await old.reconcile_once()
    info = await h.cluster.node("node-1")
    assert info is not None
    view = await old._view(info)
    await old._guard(view)  # still the leader: the check passes
    await h.lease_runs_out()
    new = h.new_coordinator()
    assert await new.reconcile_once()
    moved = await h.cluster.node("node-1")
    assert moved is not None and moved.annotations[UPGRADE_FENCE_ANNOTATION] == str(new.token)
    with pytest.raises(ClusterConflict):
        await old._write(view, labels={UPGRADE_STATE_LABEL: "upgrade-failed"})
    assert await h.cluster.node("node-1") == moved


async def test_the_simulated_cluster_writes_a_node_only_at_the_revision_read(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, two_nodes())
    read = await cluster.node("node-1")
    other = await cluster.node("node-2")
    assert read is not None and other is not None and read.revision
    answered = await cluster.update_node(
        "node-1",
        labels={UPGRADE_STATE_LABEL: "cordon-required"},
        annotations={UPGRADE_FENCE_ANNOTATION: "2"},
        schedulable=False,
        expect=read.revision,
    )
    written = await cluster.node("node-1")
    assert written == answered and int(written.revision) > int(read.revision)
    assert (
        written.labels[UPGRADE_STATE_LABEL] == "cordon-required"
        and written.annotations[UPGRADE_FENCE_ANNOTATION] == "2"
    )
    assert not written.schedulable
    assert await cluster.node("node-2") == other  # a node's revision moves with its own writes only
    with pytest.raises(ClusterConflict, match="node-1"):
        await cluster.update_node("node-1", labels={UPGRADE_STATE_LABEL: "upgrade-done"}, expect=read.revision)
    with pytest.raises(ClusterConflict):  # even a write that would change nothing
        await cluster.update_node("node-1", annotations={UPGRADE_FENCE_ANNOTATION: "2"}, expect=read.revision)
    assert await cluster.node("node-1") == written
    await cluster.uncordon("node-1")  # any writer moves the revision
    with pytest.raises(ClusterConflict):
        await cluster.update_node("node-1", labels={UPGRADE_STATE_LABEL: "upgrade-done"}, expect=written.revision)
    await cluster.update_node("node-1", labels={UPGRADE_STATE_LABEL: None})  # without expect: unconditional
    final = await cluster.node("node-1")
    assert final is not None and UPGRADE_STATE_LABEL not in final.labels and final.schedulable


# -- failures that stop the rollout -------------------------------------------------------------------------------
async def test_a_failed_install_stops_the_rollout_with_its_reason(
    make_harness: MakeHarness, redis_client: aioredis.Redis
) -> None:
    spec = SimSpec(nodes=[NodeSpec(name=f"node-{i}") for i in (1, 2, 3)])
    h = await make_harness(spec, DriverPolicy(desired_version=NEW, auto_upgrade=True, max_unavailable="2"))
    await apply_fault(
        redis_client, h.subjects, DriverInstallFault(node="node-1", mode="fail", reason="DKMS build failed"), spec
    )
    await h.run_until(lambda: _state_is(h, "node-1", "upgrade-failed"))
    for _ in range(5):
        await h.step()
    states = await h.states()
    assert states == {"node-1": "upgrade-failed", "node-2": "upgrade-required", "node-3": "upgrade-required"}
    node = await h.cluster.node("node-1")
    assert node is not None and not node.schedulable
    assert "DKMS build failed" in node.annotations[UPGRADE_FAILURE_ANNOTATION]
    failed = h.failures("node-1")
    assert len(failed) == 1 and "DKMS build failed" in failed[0]
    assert h.coordinator.status()["nodes"]["node-1"]["reason"] == node.annotations[UPGRADE_FAILURE_ANNOTATION]
    exported = CollectorRegistry()  # what the leader's /metrics says of it: the state and since when
    exported.register(UpgradeCollector(h.coordinator))
    since = {"node": "node-1", "state": "upgrade-failed"}
    assert exported.get_sample_value("gpuwarden_driver_upgrade_state_since_timestamp_seconds", since) == float(
        node.annotations[UPGRADE_SINCE_ANNOTATION]
    )
    assert exported.get_sample_value("gpuwarden_driver_upgrade_nodes", {"state": "upgrade-failed"}) == 1.0
    assert exported.get_sample_value("gpuwarden_driver_upgrade_leader") == 1.0

    # sticky until a person clears it; then the node starts over and the rollout goes on
    await apply_fault(redis_client, h.subjects, DriverInstallFault(node="node-1", mode="clear"), spec)
    for _ in range(3):
        await h.step()
    assert (await h.states())["node-1"] == "upgrade-failed"
    await h.cluster.set_node_annotations("node-1", {"gpuwarden.io/driver-upgrade-clear": "true"})
    await h.run_until(lambda: _all_done(h))
    for name in ("node-1", "node-2", "node-3"):
        assert (await h.gpus(name).versions()).driver == NEW


async def test_a_drain_that_cannot_finish_stops_the_rollout(make_harness: MakeHarness) -> None:
    h = await make_harness(two_nodes(), POLICY)
    h.answer = "failed: 3 session(s) not checkpointed"
    await h.run_until(lambda: _state_is(h, "node-1", "upgrade-failed"))
    node = await h.cluster.node("node-1")
    assert node is not None and not node.schedulable
    assert "not checkpointed" in node.annotations[UPGRADE_FAILURE_ANNOTATION]
    assert "on_drain_failure=stop" in node.annotations[UPGRADE_FAILURE_ANNOTATION]
    assert sum(h.cluster.calls.values()) == 0, "nothing is evicted when the sessions were not saved"
    assert (await h.gpus("node-1").versions()).driver == OLD


async def test_a_drain_without_verdict_times_out_and_stops(make_harness: MakeHarness) -> None:
    now = [1000.0]
    h = await make_harness(two_nodes(), POLICY)
    h.clock = lambda: now[0]
    h.answer = ""
    await h.run_until(lambda: _state_is(h, "node-1", "checkpoint-required"))
    await h.step()
    assert (await h.states())["node-1"] == "checkpoint-required"
    now[0] += POLICY.drain_timeout_s
    await h.run_until(lambda: _state_is(h, "node-1", "upgrade-failed"))
    assert sum(h.cluster.calls.values()) == 0


async def test_a_silent_checkpoint_service_holds_the_drain_past_its_timeout_and_evicts_nothing(
    make_harness: MakeHarness,
) -> None:
    """The verdict is recorded by the checkpoint service; while nobody answers for it the node waits (never failed
    for a verdict it cannot read), and the upgrade goes on once the service answers again."""
    now = [1000.0]
    h = await make_harness(two_nodes(), POLICY)
    h.clock = lambda: now[0]
    assert h.responder is not None
    await h.responder.unsubscribe()
    await h.run_until(lambda: _state_is(h, "node-1", "checkpoint-required"))
    now[0] += POLICY.drain_timeout_s * 2
    await h.step()
    await h.step()
    assert (await h.states())["node-1"] == "checkpoint-required"
    assert sum(h.cluster.calls.values()) == 0, "nothing is evicted before the verdict is known"
    await h.setup_responder()
    await h.run_until(lambda: _all_done(h))


async def test_a_pdb_refusal_is_retried_with_backoff(make_harness: MakeHarness) -> None:
    now = [1000.0]
    spec = SimSpec(
        nodes=[NodeSpec(name="node-1"), *(NodeSpec(name=f"node-{i}", driver_version=NEW) for i in (2, 3))],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=6, max_unavailable=1)],
    )
    policy = DriverPolicy(desired_version=NEW, auto_upgrade=True, max_unavailable="1", eviction_backoff_s=5.0)
    h = await make_harness(spec, policy)
    h.clock = lambda: now[0]
    on_node = [p.name for p in await h.cluster.pods(node="node-1")]
    assert len(on_node) == 2
    await h.run_until(lambda: _state_is(h, "node-1", "pod-deletion-required"))
    # the cluster is full: one pod went, its replacement waits for room, and the second was refused (it would
    # leave the deployment 2 short); the refused one is not retried before the backoff has passed
    assert h.cluster.outcomes == [(on_node[0], EvictionOutcome.EVICTED), (on_node[1], EvictionOutcome.BLOCKED_BY_PDB)]
    for _ in range(3):
        await h.step()
    assert h.cluster.calls[on_node[1]] == 1
    await h.cluster.scale("llm", "llama", 5)  # room again: one fewer replica is wanted
    now[0] += 5.0
    await h.run_until(lambda: _state_is(h, "node-1", "upgrade-done"))
    assert h.cluster.outcomes[2:] == [(on_node[1], EvictionOutcome.EVICTED)]


# -- jobs waited for ----------------------------------------------------------------------------------------------
def with_jobs() -> SimSpec:
    """node-1 (to upgrade) and node-2 (up to date) each run one pod of the ``train`` job and one of ``llama``."""
    return SimSpec(
        nodes=[NodeSpec(name="node-1"), NodeSpec(name="node-2", driver_version=NEW)],
        deployments=[
            DeploymentSpec(name="train", namespace="batch", replicas=2, max_unavailable=1),
            DeploymentSpec(name="llama", namespace="llm", replicas=2, max_unavailable=1),
        ],
    )


async def test_job_pods_hold_the_node_until_they_finish(make_harness: MakeHarness) -> None:
    now = [1000.0]
    policy = msgspec_replace(POLICY, wait_for_jobs_selector={"app": "train"}, wait_for_jobs_timeout_s=0.0)
    h = await make_harness(with_jobs(), policy)
    h.clock = lambda: now[0]
    jobs = [p.name for p in await h.cluster.pods(node="node-1") if p.deployment == "train"]
    assert len(jobs) == 1
    await h.run_until(lambda: _state_is(h, "node-1", "wait-for-jobs-required"))
    for _ in range(3):
        now[0] += 3600.0  # wait_for_jobs_timeout_s=0: as long as it takes
        await h.step()
    assert (await h.states())["node-1"] == "wait-for-jobs-required"
    assert sum(h.cluster.calls.values()) == 0 and not any(isinstance(e, DrainRequested) for e in h.events)

    await h.cluster.scale("batch", "train", 0)  # the job is over: its pods finish and go
    await h.run_until(lambda: _all_done(h))
    assert h.history("node-1") == list(ORDER)
    assert not set(jobs) & set(h.cluster.calls), "a finished job is not evicted"
    assert (await h.gpus("node-1").versions()).driver == NEW


async def test_job_pods_still_running_at_the_timeout_are_moved_like_the_rest(make_harness: MakeHarness) -> None:
    now = [1000.0]
    policy = msgspec_replace(POLICY, wait_for_jobs_selector={"app": "train"}, wait_for_jobs_timeout_s=120.0)
    h = await make_harness(with_jobs(), policy)
    h.clock = lambda: now[0]
    jobs = [p.name for p in await h.cluster.pods(node="node-1") if p.deployment == "train"]
    await h.run_until(lambda: _state_is(h, "node-1", "wait-for-jobs-required"))
    now[0] += 119.0
    await h.step()
    assert (await h.states())["node-1"] == "wait-for-jobs-required"
    now[0] += 1.0
    await h.run_until(lambda: _all_done(h))
    assert h.history("node-1") == list(ORDER)
    left = [e for e in h.events if isinstance(e, DriverUpgradeStateChanged) and e.state == "checkpoint-required"]
    assert "wait_for_jobs_timeout_s=120" in left[0].reason
    assert [h.cluster.calls[job] for job in jobs] == [1], "the job pod goes through the Eviction API, once"


# -- installs and validations that hang, agents that are silent ---------------------------------------------------
async def test_a_hanging_install_fails_the_node_at_the_timeout(
    make_harness: MakeHarness, redis_client: aioredis.Redis
) -> None:
    now = [1000.0]
    policy = msgspec_replace(POLICY, install_timeout_s=300.0)
    spec = two_nodes()
    h = await make_harness(spec, policy)
    h.clock = lambda: now[0]
    await apply_fault(redis_client, h.subjects, DriverInstallFault(node="node-1", mode="hang"), spec)
    await h.run_until(lambda: _state_is(h, "node-1", "pod-restart-required"))
    now[0] += 299.0
    await h.step()
    assert (await h.states())["node-1"] == "pod-restart-required"
    assert h.agents["node-1"][0].status()["outcome"] == "running"
    now[0] += 1.0
    await h.step()
    assert (await h.states())["node-1"] == "upgrade-failed"
    node = await h.cluster.node("node-1")
    assert node is not None and not node.schedulable
    reason = node.annotations[UPGRADE_FAILURE_ANNOTATION]
    assert f"install of {NEW} is still running after install_timeout_s=300" in reason, reason
    assert h.failures("node-1") == [reason]
    assert [e.reason for e in h.events if isinstance(e, DriverInstallFailed)] == [reason]

    # the install finishes after all: the next validation passes, and the node recovers, logged as such
    await apply_fault(redis_client, h.subjects, DriverInstallFault(node="node-1", mode="clear"), spec)
    await h.run_until(lambda: _all_done(h))
    assert h.history("node-1")[-3:] == ["upgrade-failed", "uncordon-required", "upgrade-done"]
    recovered = [e for e in h.events if isinstance(e, DriverUpgradeStateChanged) and e.state == "uncordon-required"]
    assert "recovered" in recovered[-1].reason


async def test_a_hanging_validation_fails_the_node_at_the_timeout(make_harness: MakeHarness) -> None:
    now = [1000.0]
    policy = msgspec_replace(POLICY, validation_timeout_s=60.0)
    h = await make_harness(two_nodes(), policy)
    h.clock = lambda: now[0]
    await h.stop_agent("node-1")
    hung = CountingHungValidation(h.client, h.subjects, h.spec, "node-1")
    await h.start_agent("node-1", hung)
    await h.run_until(lambda: _state_is(h, "node-1", "validation-required"))
    for _ in range(2):
        await h.step()
    assert (await h.states())["node-1"] == "validation-required"
    assert hung.validations == 1, "a hanging validation is joined, never started again beside it"
    now[0] += 60.0
    await h.step()
    node = await h.cluster.node("node-1")
    assert node is not None and node.labels[UPGRADE_STATE_LABEL] == "upgrade-failed" and not node.schedulable
    reason = node.annotations[UPGRADE_FAILURE_ANNOTATION]
    assert "validation failed for 60s" in reason and f"validating {NEW} has not finished" in reason, reason


@pytest.mark.parametrize("comes_back", [True, False])
async def test_a_silent_driver_agent_is_a_temporary_failure_until_the_timeout(
    make_harness: MakeHarness, comes_back: bool
) -> None:
    now = [1000.0]
    policy = msgspec_replace(POLICY, install_timeout_s=300.0)
    h = await make_harness(two_nodes(), policy)
    h.clock = lambda: now[0]
    await h.run_until(lambda: _state_is(h, "node-1", "pod-deletion-required"))
    await h.stop_agent("node-1")
    await h.step()
    await h.step()
    assert (await h.states())["node-1"] == "pod-restart-required"
    silent = h.coordinator.status()["nodes"]["node-1"]["agent"]
    assert "the driver agent on node-1 does not answer" in silent, silent
    if comes_back:
        await h.start_agent("node-1")
        await h.run_until(lambda: _all_done(h))
        assert h.history("node-1") == list(ORDER)
        assert "agent" not in h.coordinator.status()["nodes"]["node-1"]
        return
    now[0] += 300.0
    await h.step()
    node = await h.cluster.node("node-1")
    assert node is not None and node.labels[UPGRADE_STATE_LABEL] == "upgrade-failed"
    reason = node.annotations[UPGRADE_FAILURE_ANNOTATION]
    assert "got no answer after install_timeout_s=300" in reason and "does not answer" in reason, reason


class CountingHungValidation(HungValidationGpus):
    validations = 0

    async def validate_driver(self, expected_version: str) -> DriverValidation:
        self.validations += 1
        return await super().validate_driver(expected_version)


def msgspec_replace(policy: DriverPolicy, **changes: object) -> DriverPolicy:
    return msgspec.structs.replace(policy, **changes)


async def _state_is(h: Harness, node: str, state: str) -> bool:
    return (await h.states())[node] == state


# -- a pass costs what changed, not the fleet's size --------------------------------------------------------------
class SpyCluster(SimCluster):
    """The simulated cluster as the coordinator reads it, counting its reads of each node (the node, its pods) and
    of every node at once; its watch loses the changes of the nodes in ``deaf_to`` (a change no watch reports)."""

    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        super().__init__(client, subjects)
        self.reads: Counter[str] = Counter()
        self.full_reads = 0
        self.deaf_to: set[str] = set()

    async def nodes(self) -> list[NodeInfo]:
        self.full_reads += 1
        return await super().nodes()

    async def node(self, name: str) -> NodeInfo | None:
        self.reads[name] += 1
        return await super().node(name)

    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[PodInfo]:
        if node is not None:
            self.reads[node] += 1
        return await super().pods(node=node, namespace=namespace)

    def watch(self) -> AsyncIterator[ClusterChange]:
        return self._heard(super().watch())

    async def _heard(self, changes: AsyncIterator[ClusterChange]) -> AsyncIterator[ClusterChange]:
        async for change in changes:
            if change.node not in self.deaf_to:
                yield change

    def forget_counts(self) -> None:
        self.reads.clear()
        self.full_reads = 0


class Watched:
    """The harness's coordinator reading through a ``SpyCluster``, its agents asked through a counter, and its
    view fed by ``follow_cluster`` as ``run`` feeds it."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.spy = SpyCluster(h.client, h.subjects)
        self.asked: Counter[str] = Counter()
        drivers = bus_node_drivers(h.bus, h.agent_timeout_s)

        def counted(node: str) -> NodeDriver:
            self.asked[node] += 1
            return drivers(node)

        h.cluster_for_coordinator, h.drivers_for_coordinator = self.spy, counted
        h.coordinator = h.new_coordinator()
        self.follower: asyncio.Task[None] | None = None

    async def start(self) -> UpgradeCoordinator:
        """A first full pass, then the watch; the pass after a new watch is full again (what changed before it)."""
        coordinator = self.h.coordinator
        await self.h.step()
        assert coordinator.last_pass.full
        self.follower = asyncio.create_task(coordinator.follow_cluster())
        await eventually(lambda: coordinator.watching)
        await self.h.step()
        assert coordinator.last_pass.full and "watch" in coordinator.last_pass.why
        return coordinator

    async def pass_reading(self) -> tuple[int, set[str]]:
        """One pass: how many times every node was read at once, and which nodes were read alone."""
        self.spy.forget_counts()
        self.asked.clear()
        await self.h.coordinator.reconcile_once()
        return self.spy.full_reads, set(self.spy.reads) | set(self.asked)

    async def close(self) -> None:
        if self.follower is not None:
            self.follower.cancel()
            await asyncio.gather(self.follower, return_exceptions=True)


def up_to_date(count: int) -> SimSpec:
    return SimSpec(
        nodes=[NodeSpec(name=f"node-{i}", driver_version=NEW) for i in range(1, count + 1)],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2)],
    )


async def test_a_pass_reads_only_the_nodes_that_changed(make_harness: MakeHarness) -> None:
    h = await make_harness(up_to_date(4), POLICY)
    watched = Watched(h)
    try:
        coordinator = await watched.start()
        assert await watched.pass_reading() == (0, set())  # idle: nothing read, no agent asked
        assert not coordinator.last_pass.full and coordinator.last_pass.nodes_read == 0

        await h.cluster.set_node_labels("node-3", {"team": "search"})  # someone labels one node
        await eventually(lambda: "node-3" in coordinator.changed())
        assert await watched.pass_reading() == (0, {"node-3"})

        killed = (await h.cluster.pods(node="node-1"))[0]  # a pod dies; its replacement is bound somewhere
        await h.cluster.kill_pod(killed.namespace, killed.name)
        replacement = (await h.cluster.pods())[-1]
        await eventually(lambda: {"node-1", replacement.node} <= coordinator.changed())
        assert await watched.pass_reading() == (0, {"node-1", replacement.node})

        coordinator.note_verdict("node-2")  # a drain verdict heard for a node: its view is read again
        assert await watched.pass_reading() == (0, {"node-2"})
        assert await watched.pass_reading() == (0, set())

        h.policy = msgspec_replace(POLICY, max_parallel_upgrades=2)  # a new policy: every node looked at again
        assert (await watched.pass_reading())[0] == 1 and coordinator.last_pass.why == "the policy changed"
        assert await watched.pass_reading() == (0, set())
    finally:
        await watched.close()


async def test_a_change_the_watch_missed_is_caught_by_the_resync(make_harness: MakeHarness) -> None:
    """Someone cordons node-2 and the watch never says so: passes go on reading nothing until the resync, which
    finds the cordon and saves node-2's sessions (the drain an external cordon asks for)."""
    h = await make_harness(up_to_date(3), POLICY)
    watched = Watched(h)
    now = [time.time()]
    h.clock = lambda: now[0]
    try:
        coordinator = await watched.start()
        watched.spy.deaf_to.add("node-2")
        await h.cluster.cordon("node-2")
        await h.cluster.set_node_labels("node-1", {"team": "search"})  # heard: the watch runs past the cordon
        await eventually(lambda: "node-1" in coordinator.changed())
        assert await watched.pass_reading() == (0, {"node-1"})
        node = await h.cluster.node("node-2")
        assert node is not None and CORDON_DRAIN_ANNOTATION not in node.annotations

        now[0] += coordinator.resync_s
        full, _ = await watched.pass_reading()
        assert full == 1 and coordinator.last_pass.why == f"resync every {coordinator.resync_s:g} s"
        node = await h.cluster.node("node-2")
        assert node is not None and node.annotations.get(CORDON_DRAIN_ANNOTATION, "")
        assert [e.node for e in h.events if isinstance(e, DrainRequested)] == ["node-2"]
        assert await watched.pass_reading() == (0, set())
    finally:
        await watched.close()


async def test_an_upgrade_fed_by_the_watch_completes_with_the_same_verdicts(make_harness: MakeHarness) -> None:
    """The rolling upgrade with the view fed by the watch: every node through every state in order, one drain
    each, as with every node read on every pass; and the passes read only the nodes in flight or changed."""
    spec = SimSpec(
        nodes=[NodeSpec(name="node-1"), NodeSpec(name="node-2"), NodeSpec(name="node-3", driver_version=NEW)],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2)],
    )
    h = await make_harness(spec, POLICY)
    watched = Watched(h)
    try:
        coordinator = await watched.start()
        partial: list[int] = []
        for _ in range(200):
            await h.step()
            if not coordinator.last_pass.full:
                partial.append(coordinator.last_pass.nodes_read)
            if await _all_done(h) and (await h.states())["node-2"] == "upgrade-done":
                break
        else:
            raise AssertionError("the rollout did not get there")
        assert h.history("node-1") == list(ORDER) and h.history("node-2") == list(ORDER)
        assert h.history("node-3") == []
        assert sorted(e.node for e in h.events if isinstance(e, DrainRequested)) == ["node-1", "node-2"]
        for node in ("node-1", "node-2"):
            assert (await h.gpus(node).versions()).driver == NEW
        assert partial and max(partial) < len(spec.nodes), partial  # no pass fed by the watch read every node
        await h.cluster.set_node_labels("node-3", {"team": "search"})  # the watch past the coordinator's own writes
        await eventually(lambda: "node-3" in coordinator.changed())
        assert (await watched.pass_reading())[0] == 0
        assert await watched.pass_reading() == (0, set())  # done: idle again
    finally:
        await watched.close()


async def test_running_a_node_moves_through_its_states_as_fast_as_they_go_not_one_per_interval(
    make_harness: MakeHarness,
) -> None:
    """``run`` with an hour between passes: the node is still upgraded, every state in order, since what each
    step waits for makes a prompt pass (its drain's verdict as the service hears it, its pods' evictions through
    the watch, its install and validation asked again soon). A change that only echoes the coordinator's own
    write (the revision its view holds) wakes nothing."""
    h = await make_harness(two_nodes(), POLICY)
    coordinator = h.coordinator
    published = h.publish

    async def publish_and_verdict(event: Event) -> None:
        await published(event)
        if isinstance(event, DrainRequested):  # the checkpoint service's verdict, heard by the driver service
            asyncio.get_running_loop().call_later(0.05, coordinator.note_verdict, event.node)

    coordinator.publish = publish_and_verdict
    coordinator.drains = type(coordinator.drains)(
        lambda event: coordinator.publish(event), "driver", h.verdicts, lambda: coordinator.clock()
    )

    async def kubelet() -> None:
        while True:
            await h.kubelet()
            await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(coordinator.run(3600.0)), asyncio.create_task(kubelet())]
    try:

        async def upgraded() -> bool:
            return (await h.states()).get("node-1") == "upgrade-done"

        await eventually(upgraded, timeout=60)
        assert h.history("node-1") == list(ORDER)
        assert (await h.gpus("node-1").versions()).driver == NEW
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    coordinator.pace.take_changed()
    view = coordinator._views["node-1"]
    coordinator.note_change(ClusterChange("node", "MODIFIED", "node-1", revision=view.revision, node="node-1"))
    assert "node-1" not in coordinator.changed()  # its own write, read back already
    coordinator.note_change(ClusterChange("node", "MODIFIED", "node-1", revision="other", node="node-1"))
    assert "node-1" in coordinator.changed()


def test_an_install_not_finished_is_asked_again_sooner_then_less_often() -> None:
    """``PassPace.soon``: after 0.5 s, then twice as long each time, never past the pass interval; the next pass
    comes then, and a node it read and did not ask again waits on nothing."""
    now = [1000.0]
    pace = PassPace(lambda: now[0], interval_s=3.0)
    pace.poll_due()  # the pass reading every node in flight, at 1000
    waits = []
    for _ in range(5):
        pace.soon("node-1")
        waits.append(pace.until_next())
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]
    now[0] += 3.0
    assert pace.begin() == {"node-1"} and pace.begin() == set()  # due once, then pushed back
    pace.settle(["node-1"])
    assert pace.until_next() == 0.0  # only the interval's pass is due now (1000 + 3)


async def test_a_pass_that_keeps_failing_is_tried_once_an_interval_never_in_a_busy_loop(
    make_harness: MakeHarness,
) -> None:
    """The lease's store does not answer (Redis gone, as at a shutdown): each pass fails at once, and ``run`` tries
    again after the interval, however many installs it had meant to ask again soon; it stops when cancelled."""
    h = await make_harness(two_nodes(), POLICY)
    coordinator = h.coordinator
    tries = [0]

    class Unavailable:
        holder = "down"

        async def acquire(self, floor: Callable[[], Awaitable[int]]) -> int | None:
            tries[0] += 1
            raise LeaseUnavailable("the lease's store does not answer")

    coordinator.lease = Unavailable()  # type: ignore[assignment]
    coordinator.pace.soon("node-1")  # an install it meant to ask again long ago
    h.clock = lambda: time.time() + 3600
    task = asyncio.create_task(coordinator.run(0.5))
    await asyncio.sleep(1.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and 2 <= tries[0] <= 4, tries  # at 0, 0.5 and 1.0 s: a busy loop tries thousands
