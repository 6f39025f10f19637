"""The pure upgrade state machine: a hypothesis stateful test against a small reference model, and the driver
policy refused at write time when it is wrong."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.driver.upgrade import (
    IN_PROGRESS,
    ORDER,
    RELEASABLE,
    VERDICT_UNKNOWN,
    Action,
    ClusterView,
    InstallProgress,
    NodeView,
    PodView,
    after_install,
    after_validation,
    max_unavailable,
    may_start,
    next_step,
    upgrade_order,
)
from shared.contract.annotations import (
    CORDON_DRAIN_ANNOTATION,
    UPGRADE_CLEAR_ANNOTATION,
    UPGRADE_DRAIN_ANNOTATION,
    UPGRADE_FAILURE_ANNOTATION,
    UPGRADE_SINCE_ANNOTATION,
    UPGRADE_STATE_LABEL,
    UPGRADE_WAS_CORDONED_ANNOTATION,
)
from shared.contract.configdocs import DriverPolicy
from shared.contract.subjects import Subjects
from shared.plumbing.configsync import ConfigStore, InvalidConfig, parse_document

NEW, OLD = "560.35.03", "550.54.15"
NODES = ("n1", "n2", "n3", "n4")

# The reference model: where each state may go, and nothing else.
NEXT: dict[str, set[str]] = {
    "": {"upgrade-required"},
    "upgrade-done": {"upgrade-required"},
    **{a: {b, "upgrade-failed"} for a, b in itertools.pairwise(ORDER)},
    "upgrade-failed": {"upgrade-required", "uncordon-required"},
}
NEXT["upgrade-required"] = {"cordon-required", "upgrade-done"}
NEXT["uncordon-required"] = {"upgrade-done"}
for _held in RELEASABLE:  # auto_upgrade turned off before any eviction gives the slot back
    NEXT[_held].add("upgrade-required")


@dataclass
class SimNode:
    """A node in the model's world: what the coordinator's effects do to it, in memory."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    schedulable: bool = True
    installed: str = OLD
    pods: int = 2
    terminating: int = 0
    verdict: str = ""
    install_fails: bool = False
    install_hangs: bool = False
    history: list[str] = field(default_factory=list)
    evicted_with_verdict: list[str] = field(default_factory=list)
    cordoned_before: bool | None = None

    def view(self) -> NodeView:
        pods = [PodView(f"{self.name}-p{i}", "llm", "Running") for i in range(self.pods)]
        pods += [PodView(f"{self.name}-t{i}", "llm", "Terminating") for i in range(self.terminating)]
        return NodeView(
            name=self.name,
            labels=dict(self.labels),
            annotations=dict(self.annotations),
            schedulable=self.schedulable,
            installed_version=self.installed,
            pods=tuple(pods),
            drain_verdict=self.verdict if self.annotations.get(UPGRADE_DRAIN_ANNOTATION) else "",
            gpus=2,
        )


class UpgradeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = DriverPolicy(
            desired_version=NEW, auto_upgrade=True, max_parallel_upgrades=1, max_unavailable="50%", drain_timeout_s=60
        )
        self.nodes = {name: SimNode(name) for name in NODES}
        self.now = 1000.0
        self.max_in_progress = 0
        self.over_budget_starts = 0

    def cluster(self) -> ClusterView:
        return ClusterView.of([n.view() for n in self.nodes.values()])

    def apply(self, node: SimNode, action: Action) -> None:
        """What the coordinator does for each action, on the in-memory node."""
        annotations = {k: v for k, v in action.annotations.items() if v is not None}
        removals = [k for k, v in action.annotations.items() if v is None]
        match action.kind:
            case "cordon":
                if node.cordoned_before is None:
                    node.cordoned_before = not node.schedulable
                node.annotations.update(annotations)
                node.schedulable = False
            case "uncordon":
                node.schedulable = True
            case "request_drain" | "external_drain":
                key = UPGRADE_DRAIN_ANNOTATION if action.kind == "request_drain" else "gpuwarden.io/cordon-drain-id"
                node.annotations[key] = f"d-{node.name}-{self.now}"
                node.verdict = ""
                return
            case "forget_external_drain":
                node.annotations.pop("gpuwarden.io/cordon-drain-id", None)
                return
            case "evict":
                node.evicted_with_verdict.append(node.verdict)
                node.terminating += node.pods
                node.pods = 0
                return
            case "install":
                progress: InstallProgress = "installed"
                if node.install_fails:
                    progress = "failed"
                elif node.install_hangs:
                    progress = "running"
                if progress == "installed":
                    node.installed = action.version
                self.apply(node, after_install(node.view(), self.policy, progress, "the agent says so", self.now))
                return
            case "validate":
                ok = node.installed == action.version
                self.apply(node, after_validation(node.view(), self.policy, ok, "", self.now))
                return
            case "wait":
                return
        node.annotations.update(annotations)
        if action.state and action.state != node.labels.get(UPGRADE_STATE_LABEL, ""):
            node.history.append(action.state)
            node.labels[UPGRADE_STATE_LABEL] = action.state
        for key in removals:
            node.annotations.pop(key, None)

    @rule(name=st.sampled_from(NODES))
    def reconcile(self, name: str) -> None:
        node = self.nodes[name]
        before = node.labels.get(UPGRADE_STATE_LABEL, "")
        cluster = self.cluster()
        action = next_step(node.view(), self.policy, cluster, self.now)
        if action.state == "cordon-required" and node.schedulable:  # one node fewer to run pods on
            budget = max_unavailable(self.policy, cluster.total)
            if cluster.unavailable + 1 > budget:
                self.over_budget_starts += 1
        self.apply(node, action)
        after = node.labels.get(UPGRADE_STATE_LABEL, "")
        if before in RELEASABLE and not self.policy.auto_upgrade:  # the slot is given back, the cordon lifted
            assert after == "upgrade-required", (before, after)
            assert node.schedulable or node.cordoned_before or before == "cordon-required"
            node.cordoned_before = None
        if after != before:
            assert after in NEXT[before] or (before, after) == ("upgrade-failed", "uncordon-required"), (before, after)
        if after == "pod-restart-required":  # an install that hangs is never waited for past its timeout
            assert self.now - node.view().since() < self.policy.install_timeout_s
        self.max_in_progress = max(self.max_in_progress, self.cluster().in_progress)

    @rule(name=st.sampled_from(NODES), ok=st.booleans())
    def verdict(self, name: str, ok: bool) -> None:
        """The checkpoint service decides a drain once: its verdict is final, later copies repeat it."""
        node = self.nodes[name]
        if node.annotations.get(UPGRADE_DRAIN_ANNOTATION) and not node.verdict:
            node.verdict = "completed" if ok else "failed: 1 session(s) not checkpointed"

    @rule(name=st.sampled_from(NODES))
    def pods_gone(self, name: str) -> None:
        self.nodes[name].terminating = 0

    @rule(dt=st.sampled_from([1.0, 30.0, 61.0, 700.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(on=st.booleans())
    def auto_upgrade(self, on: bool) -> None:
        self.policy = msgspec.structs.replace(self.policy, auto_upgrade=on)

    @rule(name=st.sampled_from(NODES))
    def admin_cordons(self, name: str) -> None:
        node = self.nodes[name]
        if node.labels.get(UPGRADE_STATE_LABEL, "") not in IN_PROGRESS:
            node.schedulable = False

    @rule(name=st.sampled_from(NODES), fails=st.booleans(), hangs=st.booleans())
    def install_outcome(self, name: str, fails: bool, hangs: bool) -> None:
        self.nodes[name].install_fails = fails
        self.nodes[name].install_hangs = hangs

    @precondition(lambda self: any(n.labels.get(UPGRADE_STATE_LABEL) == "upgrade-failed" for n in self.nodes.values()))
    @rule(name=st.sampled_from(NODES))
    def person_clears(self, name: str) -> None:
        node = self.nodes[name]
        if node.labels.get(UPGRADE_STATE_LABEL) == "upgrade-failed":
            node.annotations[UPGRADE_CLEAR_ANNOTATION] = "true"
            node.install_fails = node.install_hangs = False

    @invariant()
    def one_upgrade_at_a_time(self) -> None:
        assert self.max_in_progress <= self.policy.max_parallel_upgrades

    @invariant()
    def never_starts_over_budget(self) -> None:
        assert self.over_budget_starts == 0

    @invariant()
    def no_eviction_before_the_sessions_are_saved(self) -> None:
        for node in self.nodes.values():
            assert all(v == "completed" for v in node.evicted_with_verdict), node.evicted_with_verdict

    @invariant()
    def failures_are_loud_and_cordoned(self) -> None:
        for node in self.nodes.values():
            if node.labels.get(UPGRADE_STATE_LABEL) == "upgrade-failed":
                assert node.annotations.get(UPGRADE_FAILURE_ANNOTATION)
                assert not node.schedulable
            if node.labels.get(UPGRADE_STATE_LABEL) in IN_PROGRESS - {"cordon-required"}:
                assert not node.schedulable

    @invariant()
    def a_node_cordoned_before_stays_cordoned(self) -> None:
        for node in self.nodes.values():
            if node.labels.get(UPGRADE_STATE_LABEL) == "upgrade-done" and node.cordoned_before:
                assert not node.schedulable

    @invariant()
    def no_new_start_while_failures_exceed_the_budget(self) -> None:
        failed = sum(1 for n in self.nodes.values() if n.labels.get(UPGRADE_STATE_LABEL) == "upgrade-failed")
        if failed > self.policy.max_failed_nodes:
            for node in self.nodes.values():
                if node.labels.get(UPGRADE_STATE_LABEL) == "upgrade-required":
                    view = node.view()
                    # no upgrade starts; saving the sessions of a node someone else cordoned is not a start
                    assert next_step(view, self.policy, self.cluster(), self.now).kind in ("wait", "external_drain")


UpgradeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestUpgradeStateMachine = UpgradeMachine.TestCase


def test_an_untouched_cluster_upgrades_in_order() -> None:
    machine = UpgradeMachine()
    for _ in range(200):
        for name in NODES:
            machine.verdict(name, True)
            machine.pods_gone(name)
            machine.reconcile(name)
        machine.time_passes(1.0)
    for node in machine.nodes.values():
        assert node.history == list(ORDER)
        assert node.schedulable and node.installed == NEW
        assert UPGRADE_WAS_CORDONED_ANNOTATION not in node.annotations


def test_every_node_cordoned_by_someone_else_still_upgrades_one_at_a_time() -> None:
    """Every node drained (cordoned by someone else) and ``max_unavailable`` 1: the cordons do not hold the slots;
    each node takes its upgrade (it makes nothing less available), one at a time, and stays cordoned after."""
    machine = UpgradeMachine()
    machine.policy = msgspec.structs.replace(machine.policy, max_unavailable="1")
    for name in NODES:
        machine.admin_cordons(name)
    for _ in range(300):
        for name in NODES:
            machine.verdict(name, True)
            machine.pods_gone(name)
            machine.reconcile(name)
        machine.time_passes(1.0)
        assert machine.cluster().in_progress <= 1
    for node in machine.nodes.values():
        assert node.labels[UPGRADE_STATE_LABEL] == "upgrade-done" and node.installed == NEW, node
        assert not node.schedulable  # someone else's cordon outlives the upgrade
    assert machine.over_budget_starts == 0


def test_nodes_unavailable_already_go_first_and_the_rest_wait_within_the_budget() -> None:
    policy = DriverPolicy(desired_version=NEW, auto_upgrade=True, max_parallel_upgrades=2, max_unavailable="1")
    waiting = {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}, "installed_version": OLD}
    drained = {CORDON_DRAIN_ANNOTATION: "drain-n2-1"}  # its sessions saved by the drain that cordoned it
    cordoned = NodeView(name="n2", schedulable=False, annotations=drained, **waiting)  # type: ignore[arg-type]
    free = NodeView(name="n1", **waiting)  # type: ignore[arg-type]
    cluster = ClusterView.of([free, cordoned])
    assert upgrade_order([free, cordoned]) == [1, 0]
    assert next_step(cordoned, policy, cluster, 1.0).state == "cordon-required"
    blocked = next_step(free, policy, cluster, 1.0)
    assert blocked.kind == "wait" and "max_unavailable=1" in blocked.why
    assert may_start(policy, free, ClusterView.of([free, NodeView(name="n2", **waiting)])) == ""  # type: ignore[arg-type]


@pytest.mark.parametrize("state", sorted(RELEASABLE))
def test_turning_auto_upgrade_off_releases_a_slot_before_any_eviction(state: str) -> None:
    policy = DriverPolicy(desired_version=NEW, auto_upgrade=False)
    held = {UPGRADE_STATE_LABEL: state}
    by_upgrade = NodeView(
        name="n1",
        labels=held,
        schedulable=state == "cordon-required",
        annotations={UPGRADE_WAS_CORDONED_ANNOTATION: "false", UPGRADE_DRAIN_ANNOTATION: "d-1"},
        installed_version=OLD,
    )
    action = next_step(by_upgrade, policy, ClusterView.of([by_upgrade]), 5.0)
    assert action.state == "upgrade-required" and "released" in action.why
    assert action.kind == ("set_state" if state == "cordon-required" else "uncordon")
    assert (
        action.annotations[UPGRADE_DRAIN_ANNOTATION] is None
        and action.annotations[UPGRADE_WAS_CORDONED_ANNOTATION] is None
    )
    by_person = NodeView(
        name="n1",
        labels=held,
        schedulable=False,
        annotations={UPGRADE_WAS_CORDONED_ANNOTATION: "true"},
        installed_version=OLD,
    )
    kept = next_step(by_person, policy, ClusterView.of([by_person]), 5.0)
    assert kept.kind == "set_state" and kept.state == "upgrade-required"  # a person's cordon stays
    evicting = NodeView(name="n1", labels={UPGRADE_STATE_LABEL: "pod-deletion-required"}, schedulable=False)
    assert next_step(evicting, policy, ClusterView.of([evicting]), 5.0).state != "upgrade-required"  # finishes


def test_a_node_emptied_by_someone_else_needs_no_drain_and_a_failed_drain_there_stops_nothing() -> None:
    policy = DriverPolicy(desired_version=NEW, auto_upgrade=True)
    saving = {UPGRADE_STATE_LABEL: "checkpoint-required"}

    def node(*phases: str, **fields: object) -> NodeView:
        pods = tuple(PodView(f"p{i}", "llm", phase) for i, phase in enumerate(phases))
        return NodeView(name="n1", labels=saving, schedulable=False, pods=pods, **fields)  # type: ignore[arg-type]

    def step(view: NodeView) -> Action:
        return next_step(view, policy, ClusterView.of([view]), 5.0)

    assert step(node("Running", "Terminating")).kind == "request_drain"
    for drained in (node(), node("Terminating")):  # its pods gone, or leaving (their preStop saves them)
        assert step(drained).state == "pod-deletion-required"
    asked = {"annotations": {UPGRADE_DRAIN_ANNOTATION: "d-1"}, "drain_verdict": "failed: 3 session(s) not checkpointed"}
    assert step(node(**asked)).state == "pod-deletion-required"  # nothing left to evict, nothing to lose
    assert step(node("Running", **asked)).state == "upgrade-failed"  # pods it would evict: stop


def test_a_verdict_that_cannot_be_read_holds_the_node_past_the_drain_timeout_and_evicts_nothing() -> None:
    """The checkpoint service, which records verdicts, does not answer: the node waits (a drain that may have
    completed is never failed for it), and goes on once the verdict reads again."""
    policy = DriverPolicy(desired_version=NEW, auto_upgrade=True, drain_timeout_s=60)
    late = {UPGRADE_STATE_LABEL: "checkpoint-required"}
    annotations = {UPGRADE_DRAIN_ANNOTATION: "d-1", UPGRADE_SINCE_ANNOTATION: "1000"}

    def step(verdict: str) -> Action:
        pods = (PodView("p0", "llm", "Running"),)
        view = NodeView(
            name="n1", labels=late, annotations=annotations, schedulable=False, pods=pods, drain_verdict=verdict
        )
        return next_step(view, policy, ClusterView.of([view]), 1000.0 + 3600)

    unknown = step(VERDICT_UNKNOWN)
    assert unknown.kind == "wait" and "cannot be read" in unknown.why
    assert step("").state == "upgrade-failed"  # no verdict, readable: the timeout stops it
    assert step("completed").state == "pod-deletion-required"


def test_pool_overrides_pick_the_version_by_label() -> None:
    from services.driver.upgrade import desired_version

    policy = DriverPolicy(desired_version=NEW, pool_overrides={"pool=a100": "550.90.07"})
    assert desired_version(policy, {"pool": "a100"}) == "550.90.07"
    assert desired_version(policy, {"pool": "h100"}) == NEW
    assert max_unavailable(replace_policy(policy, "25%"), 3) == 1
    assert max_unavailable(replace_policy(policy, "2"), 10) == 2


def replace_policy(policy: DriverPolicy, max_unavail: str) -> DriverPolicy:
    return msgspec.structs.replace(policy, max_unavailable=max_unavail)


@pytest.mark.parametrize(
    ("raw", "field_name"),
    [
        (b'{"desired_version": "latest"}', "desired_version"),
        (b'{"desired_version": "5.0"}', "desired_version"),
        (b'{"max_unavailable": "150%"}', "max_unavailable"),
        (b'{"max_unavailable": "-1"}', "max_unavailable"),
        (b'{"max_parallel_upgrades": -1}', "max_parallel_upgrades"),
        (b'{"pool_overrides": {"a100": "550.90.07"}}', "pool_overrides"),
        (b'{"pool_overrides": {"pool=a100": "new"}}', "pool_overrides"),
        (b'{"on_drain_failure": "ignore"}', "on_drain_failure"),
        (b'{"install_timeout_s": 0}', "install_timeout_s"),
    ],
)
def test_bad_driver_policy_is_refused_with_the_field(raw: bytes, field_name: str) -> None:
    with pytest.raises(InvalidConfig, match=field_name):
        parse_document("driver", raw)


async def test_bad_driver_policy_is_refused_at_write_time(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    store = ConfigStore(redis_client, subjects)
    with pytest.raises(InvalidConfig, match=r"desired_version"):
        await store.write_raw("driver", b'{"desired_version": "v560"}', 0, "admin")
    assert await store.read("driver") is None
    ok = b'{"desired_version": "560.35.03", "max_unavailable": "100%", "pool_overrides": {"pool=a100": "550.90.07"}}'
    assert await store.write_raw("driver", ok, 0, "admin") == 1
