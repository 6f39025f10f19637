"""The upgrade coordinator on the simulated cluster, driven pass by pass: restarts at every state, fencing,
failures that stop the rollout, PodDisruptionBudget refusals retried with backoff. The checkpoint service is
stood in for by a verdict book that answers each drain (the full drain with live sessions is in
tests/test_driver_rollout.py)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from services.driver.coordinator import UpgradeCoordinator
from services.driver.lease import RedisDrainVerdicts, RedisLeaderLease
from services.driver.ports import StaleLeader
from services.driver.upgrade import (
    FAILURE_ANNOTATION,
    ORDER,
    STATE_LABEL,
    WAS_CORDONED_ANNOTATION,
)
from shared.contract.base import Event
from shared.contract.configdocs import DriverPolicy
from shared.contract.driver import DriverUpgradeStateChanged
from shared.contract.node import DrainRequested
from shared.contract.subjects import Subjects
from shared.ports.cluster import EvictionOutcome
from shared.ports.gpu import GpuPort
from shared.sim.cluster import SimCluster
from shared.sim.faults import DriverInstallFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import DeploymentSpec, NodeSpec, SimSpec
from tests.helpers import eventually

NEW = "560.35.03"
OLD = "550.54.15"


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


class Harness:
    def __init__(self, client: aioredis.Redis, subjects: Subjects, spec: SimSpec, policy: DriverPolicy) -> None:
        self.client = client
        self.subjects = subjects
        self.spec = spec
        self.policy = policy
        self.events: list[Event] = []
        self.verdicts = RedisDrainVerdicts(client, subjects)
        self.answer = "completed"
        self.kill_at = ""
        self.clock: Callable[[], float] = time.time
        self.generation = 0

    async def setup(self) -> None:
        created = await CountingCluster.create(self.client, self.subjects, self.spec)
        assert isinstance(created, CountingCluster)
        self.cluster = created
        self.cluster.calls = Counter()
        self.cluster.outcomes = []
        self.coordinator = self.new_coordinator()

    def gpus(self, node: str) -> GpuPort:
        return SimGpus(self.client, self.subjects, self.spec, node)

    def new_coordinator(self) -> UpgradeCoordinator:
        self.generation += 1
        lease = RedisLeaderLease(self.client, self.subjects, f"coordinator-{self.generation}", ttl_s=0.3)
        return UpgradeCoordinator(
            self.cluster,
            self.gpus,
            lease,
            self.verdicts,
            self.publish,
            lambda: self.policy,
            clock=lambda: self.clock(),
            install_timeout_s=5.0,
            on_transition=self.transition,
        )

    def transition(self, node: str, previous: str, state: str) -> None:
        if state == self.kill_at:
            self.kill_at = ""
            raise Killed

    async def publish(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, DrainRequested) and self.answer:
            await self.verdicts.record(event.drain_id, self.answer)

    async def kubelet(self) -> None:
        """The workload's side: every Terminating pod finishes its preStop at once."""
        for pod in await self.cluster.pods():
            if pod.phase == "Terminating":
                await self.cluster.mark_prestop_done(pod.namespace, pod.name)
        await self.cluster.tick()

    async def step(self) -> None:
        """One pass; a killed coordinator is replaced by a new process (new holder) that waits for the lease."""
        try:
            await self.coordinator.reconcile_once()
        except Killed:
            self.coordinator = self.new_coordinator()
            await eventually(self.coordinator.reconcile_once, timeout=5)
        await self.kubelet()

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
        return {n.name: n.labels.get(STATE_LABEL, "") for n in await self.cluster.nodes()}

    def history(self, node: str) -> list[str]:
        return [e.state for e in self.events if isinstance(e, DriverUpgradeStateChanged) and e.node == node]


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
    redis_client: aioredis.Redis, subjects: Subjects, kill_at: str
) -> None:
    h = Harness(redis_client, subjects, two_nodes(), POLICY)
    await h.setup()
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
    assert node is not None and node.schedulable and WAS_CORDONED_ANNOTATION not in node.annotations
    assert (await h.gpus("node-1").versions()).driver == NEW
    assert sum(isinstance(e, DrainRequested) for e in h.events) == 1


async def test_a_stale_leader_cannot_write(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    h = Harness(redis_client, subjects, two_nodes(), POLICY)
    await h.setup()
    old = h.coordinator
    assert await old.reconcile_once()
    await redis_client.delete(subjects.redis_key("driver", "leader"))  # the old leader's lease ran out
    new = h.new_coordinator()
    assert await new.reconcile_once() and new.token > old.token
    with pytest.raises(StaleLeader):
        await old._guard(await old._view((await h.cluster.nodes())[0]))
    assert not await old.reconcile_once()  # it cannot take the lease back while the new one holds it


async def test_a_failed_install_stops_the_rollout_with_its_reason(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    spec = SimSpec(nodes=[NodeSpec(name=f"node-{i}") for i in (1, 2, 3)])
    h = Harness(redis_client, subjects, spec, DriverPolicy(desired_version=NEW, auto_upgrade=True, max_unavailable="2"))
    await h.setup()
    await apply_fault(
        redis_client, subjects, DriverInstallFault(node="node-1", mode="fail", reason="DKMS build failed"), spec
    )
    await h.run_until(lambda: _state_is(h, "node-1", "upgrade-failed"))
    for _ in range(5):
        await h.step()
    states = await h.states()
    assert states == {"node-1": "upgrade-failed", "node-2": "upgrade-required", "node-3": "upgrade-required"}
    node = await h.cluster.node("node-1")
    assert node is not None and not node.schedulable
    assert "DKMS build failed" in node.annotations[FAILURE_ANNOTATION]
    failed = [e for e in h.events if isinstance(e, DriverUpgradeStateChanged) and e.state == "upgrade-failed"]
    assert len(failed) == 1 and "DKMS build failed" in failed[0].reason
    assert h.coordinator.status()["nodes"]["node-1"]["reason"] == node.annotations[FAILURE_ANNOTATION]

    # sticky until a person clears it; then the node starts over and the rollout goes on
    await apply_fault(redis_client, subjects, DriverInstallFault(node="node-1", mode="clear"), spec)
    for _ in range(3):
        await h.step()
    assert (await h.states())["node-1"] == "upgrade-failed"
    await h.cluster.set_node_annotations("node-1", {"gpuwarden.io/driver-upgrade-clear": "true"})
    await h.run_until(lambda: _all_done(h))
    for name in ("node-1", "node-2", "node-3"):
        assert (await h.gpus(name).versions()).driver == NEW


async def test_a_drain_that_cannot_finish_stops_the_rollout(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    h = Harness(redis_client, subjects, two_nodes(), POLICY)
    await h.setup()
    h.answer = "failed: 3 session(s) not checkpointed"
    await h.run_until(lambda: _state_is(h, "node-1", "upgrade-failed"))
    node = await h.cluster.node("node-1")
    assert node is not None and not node.schedulable
    assert "not checkpointed" in node.annotations[FAILURE_ANNOTATION]
    assert "on_drain_failure=stop" in node.annotations[FAILURE_ANNOTATION]
    assert sum(h.cluster.calls.values()) == 0, "nothing is evicted when the sessions were not saved"
    assert (await h.gpus("node-1").versions()).driver == OLD


async def test_a_drain_without_verdict_times_out_and_stops(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    now = [1000.0]
    h = Harness(redis_client, subjects, two_nodes(), POLICY)
    h.clock = lambda: now[0]
    h.answer = ""
    await h.setup()
    await h.run_until(lambda: _state_is(h, "node-1", "checkpoint-required"))
    await h.step()
    assert (await h.states())["node-1"] == "checkpoint-required"
    now[0] += POLICY.drain_timeout_s
    await h.run_until(lambda: _state_is(h, "node-1", "upgrade-failed"))
    assert sum(h.cluster.calls.values()) == 0


async def test_a_pdb_refusal_is_retried_with_backoff(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    now = [1000.0]
    spec = SimSpec(
        nodes=[NodeSpec(name="node-1"), *(NodeSpec(name=f"node-{i}", driver_version=NEW) for i in (2, 3))],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=6, max_unavailable=1)],
    )
    policy = DriverPolicy(desired_version=NEW, auto_upgrade=True, max_unavailable="1", eviction_backoff_s=5.0)
    h = Harness(redis_client, subjects, spec, policy)
    h.clock = lambda: now[0]
    await h.setup()
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


async def _state_is(h: Harness, node: str, state: str) -> bool:
    return (await h.states())[node] == state
