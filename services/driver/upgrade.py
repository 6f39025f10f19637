"""The rolling driver upgrade as a pure function: what to do next on one node, given what the cluster shows now.

Level-triggered: ``next_step`` reads the node's state label and annotations and the facts gathered this pass (pods,
installed version, the drain verdict) and returns one ``Action``; nothing is remembered between calls except what
the cluster itself holds. A coordinator restarted at any point reads the same label and annotations and resumes.

States and label values are NVIDIA's (``nvidia.com/gpu-driver-upgrade-state``), plus ``checkpoint-required``:
before any pod is evicted, ``drain.requested`` is published and the checkpoint service's verdict awaited.

    "" / upgrade-done --(installed != desired)--> upgrade-required --(a slot)--> cordon-required --> (cordon)
    wait-for-jobs-required --> checkpoint-required --(drain.completed)--> pod-deletion-required --(node empty)-->
    pod-restart-required --(install)--> validation-required --(valid)--> uncordon-required --> upgrade-done

A node with no running pod to move (drained by someone else already) needs no drain of its own; a drain that
failed while someone else emptied the node stops nothing, as the upgrade has nothing left to evict.

Any step may go to ``upgrade-failed``, which is sticky: the node stays cordoned with its reason until a person sets
the clear annotation, or a later validation of the desired version passes (and is logged as a recovery).

The disruption budget is shared with everyone else who cordons nodes (``may_start``, docs/drivers.md):

- A node that is unavailable already (cordoned by someone else, or not ready) takes its upgrade without a share of
  ``max_unavailable``: upgrading it makes nothing less available. Such nodes go first. So cordons the upgrade did
  not make never stall the upgrade of the nodes they are on (drain every node, then upgrade: every node upgrades).
- Every unavailable node still counts against ``max_unavailable`` for a schedulable node: cordoning one more would
  take the cluster below what the policy promises. A person lifts their cordon (``gpuwarden uncordon``, allowed in
  ``upgrade-required``) or raises ``max_unavailable``.
- ``auto_upgrade: false`` releases every slot whose node has not yet had a pod evicted (``cordon-required``,
  ``wait-for-jobs-required``, ``checkpoint-required``): back to ``upgrade-required``, uncordoned unless it was
  cordoned before the upgrade. Nodes past that point finish, so no node is left half-upgraded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from shared.contract.annotations import (
    CORDON_DRAIN_ANNOTATION,
    UPGRADE_CLEAR_ANNOTATION,
    UPGRADE_DRAIN_ANNOTATION,
    UPGRADE_FAILURE_ANNOTATION,
    UPGRADE_SINCE_ANNOTATION,
    UPGRADE_SKIP_DRAIN_POD_LABEL,
    UPGRADE_SKIP_NODE_LABEL,
    UPGRADE_STATE_LABEL,
    UPGRADE_TARGET_ANNOTATION,
    UPGRADE_WAS_CORDONED_ANNOTATION,
)
from shared.contract.configdocs import DriverPolicy
from shared.contract.driver import UpgradeState
from shared.contract.node import DrainCompleted, DrainFailed, DrainVerdict

UPGRADE_ANNOTATIONS = (
    UPGRADE_FAILURE_ANNOTATION,
    UPGRADE_WAS_CORDONED_ANNOTATION,
    UPGRADE_SINCE_ANNOTATION,
    UPGRADE_TARGET_ANNOTATION,
    UPGRADE_DRAIN_ANNOTATION,
)

ORDER: tuple[UpgradeState, ...] = (
    "upgrade-required",
    "cordon-required",
    "wait-for-jobs-required",
    "checkpoint-required",
    "pod-deletion-required",
    "pod-restart-required",
    "validation-required",
    "uncordon-required",
    "upgrade-done",
)
"""The states a successful upgrade passes through, in order (``drain-required`` reads as ``pod-deletion-required``)."""

IN_PROGRESS: frozenset[str] = frozenset(ORDER[1:-1]) | {"drain-required"}
"""States holding an upgrade slot."""

RELEASABLE: frozenset[str] = frozenset({"cordon-required", "wait-for-jobs-required", "checkpoint-required"})
"""States holding a slot before any pod was evicted: ``auto_upgrade: false`` gives their slot back."""

EXTERNAL_DRAIN_REASON = "cordoned"

VERDICT_UNKNOWN = "unknown"
"""``NodeView.drain_verdict`` when the verdict could not be read this pass (the checkpoint service, which records
it, did not answer): the node waits, and ``drain_timeout_s`` does not fail it meanwhile; nothing is evicted
before a verdict is known."""


def verdict_text(verdict: DrainVerdict | None) -> str:
    """``completed``, ``failed: <reason>``, or '' while there is none: what ``NodeView.drain_verdict`` holds."""
    match verdict:
        case DrainCompleted():
            return "completed"
        case DrainFailed():
            return f"failed: {verdict.reason}"
    return ""


InstallProgress = Literal["installed", "failed", "running", "unreachable"]
"""Where a node's install stands, as its driver agent answered: done, failed (with a reason), still running, or
no answer at all."""


@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    namespace: str
    phase: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the coordinator sees it this pass. ``installed_version`` is empty when the node's driver agent
    did not answer; ``drain_verdict`` is the verdict of the drain named in ``UPGRADE_DRAIN_ANNOTATION`` (or the external
    drain): ``""`` (none yet), ``"completed"``, ``"failed: <reason>"`` or ``VERDICT_UNKNOWN`` (not readable now).
    ``evict_after`` is when an eviction refused by a PodDisruptionBudget may be tried again. ``revision`` is the
    node's resourceVersion as read: every write based on this view is a compare-and-set against it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    schedulable: bool = True
    ready: bool = True
    gpus: int = 0
    installed_version: str = ""
    pods: Sequence[PodView] = ()
    drain_verdict: str = ""
    evict_after: float = 0.0
    revision: str = ""

    @property
    def state(self) -> str:
        return self.labels.get(UPGRADE_STATE_LABEL, "")

    @property
    def skipped(self) -> bool:
        return self.labels.get(UPGRADE_SKIP_NODE_LABEL, "") == "true"

    def since(self) -> float:
        try:
            return float(self.annotations.get(UPGRADE_SINCE_ANNOTATION, "0"))
        except ValueError:
            return 0.0


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What the slot rules need: how many nodes there are, which hold a slot, which are unavailable or failed."""

    total: int
    in_progress: int
    unavailable: int
    failed: int

    @classmethod
    def of(cls, nodes: Sequence[NodeView]) -> ClusterView:
        tally = [0, 0, 0]
        for node in nodes:
            for i, count in enumerate(counted(node)):
                tally[i] += count
        return cls(total=len(nodes), in_progress=tally[0], unavailable=tally[1], failed=tally[2])


def counted(node: NodeView) -> tuple[int, int, int]:
    """What one node adds to ``ClusterView``'s ``in_progress``, ``unavailable`` and ``failed`` (a view kept node by
    node adds and takes these as its nodes change)."""
    return (
        int(node.state in IN_PROGRESS),
        int(not node.schedulable or not node.ready),
        int(node.state == "upgrade-failed"),
    )


ActionKind = Literal[
    "wait",
    "set_state",
    "cordon",
    "request_drain",
    "evict",
    "install",
    "validate",
    "uncordon",
    "fail",
    "external_drain",
    "forget_external_drain",
]


@dataclass(frozen=True, slots=True)
class Action:
    """One step for the coordinator. ``state`` is the label value to write once the effect succeeded (empty: the
    label stays); ``annotations`` are written with it (None removes one). ``why`` says in words why, for logs."""

    kind: ActionKind
    node: str
    state: str = ""
    why: str = ""
    annotations: Mapping[str, str | None] = field(default_factory=dict)
    pods: tuple[tuple[str, str], ...] = ()
    version: str = ""


def max_unavailable(policy: DriverPolicy, total: int) -> int:
    """NVIDIA's rule: a count, or a percent of the nodes rounded up."""
    raw = policy.max_unavailable
    if raw.endswith("%"):
        return math.ceil(total * int(raw[:-1]) / 100)
    return int(raw)


def desired_version(policy: DriverPolicy, labels: Mapping[str, str]) -> str:
    """The pool override whose ``label=value`` the node carries (the first in sorted order), else the cluster-wide
    version."""
    for selector in sorted(policy.pool_overrides):
        key, _, value = selector.partition("=")
        if labels.get(key) == value:
            return policy.pool_overrides[selector]
    return policy.desired_version


def may_start(policy: DriverPolicy, node: NodeView, cluster: ClusterView) -> str:
    """Empty when ``node`` may take an upgrade slot now, else why not."""
    if cluster.failed > policy.max_failed_nodes:
        return f"{cluster.failed} node(s) in upgrade-failed, more than max_failed_nodes={policy.max_failed_nodes}"
    if policy.max_parallel_upgrades and cluster.in_progress >= policy.max_parallel_upgrades:
        return f"{cluster.in_progress} upgrade(s) in progress, max_parallel_upgrades={policy.max_parallel_upgrades}"
    if not available(node):
        return ""  # unavailable already: upgrading it takes nothing more from the cluster
    budget = max_unavailable(policy, cluster.total)
    if cluster.unavailable + 1 > budget:
        return f"{cluster.unavailable} node(s) unavailable, max_unavailable={policy.max_unavailable} ({budget})"
    return ""


def available(node: NodeView) -> bool:
    """Whether pods can run on the node now (schedulable and ready): what ``max_unavailable`` protects."""
    return node.schedulable and node.ready


def upgrade_order(nodes: Sequence[NodeView]) -> list[int]:
    """The order in which a pass takes the nodes (indexes into ``nodes``): those unavailable already first, as
    their upgrade costs the cluster nothing, then by name."""
    return sorted(range(len(nodes)), key=lambda i: (available(nodes[i]), nodes[i].name))


def _pods_to_evict(node: NodeView, policy: DriverPolicy) -> list[PodView]:
    """Pods the upgrade must move: not marked to skip, matching the drain selector (empty: all)."""
    chosen = []
    for pod in node.pods:
        if pod.labels.get(UPGRADE_SKIP_DRAIN_POD_LABEL, "") == "true":
            continue
        if not _matches(pod.labels, policy.drain_pod_selector):
            continue
        chosen.append(pod)
    return chosen


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _enter(now: float, **extra: str | None) -> dict[str, str | None]:
    return {UPGRADE_SINCE_ANNOTATION: f"{now:.3f}", **extra}


def _fail(node: NodeView, why: str, now: float) -> Action:
    return Action(
        "fail",
        node.name,
        "upgrade-failed",
        why,
        {UPGRADE_FAILURE_ANNOTATION: why, UPGRADE_SINCE_ANNOTATION: f"{now:.3f}"},
    )


def next_step(node: NodeView, policy: DriverPolicy, cluster: ClusterView, now: float) -> Action:
    """What to do next on ``node``. Pure: the same inputs give the same action."""
    state = node.state
    target = node.annotations.get(UPGRADE_TARGET_ANNOTATION, "") or desired_version(policy, node.labels)
    elapsed = now - node.since()

    if state not in IN_PROGRESS and state != "upgrade-failed":
        external = node.annotations.get(CORDON_DRAIN_ANNOTATION, "")
        if not node.schedulable and not external:
            return Action("external_drain", node.name, why="cordoned by someone else: saving its sessions")
        if node.schedulable and external:
            return Action("forget_external_drain", node.name, why="schedulable again")

    if state in RELEASABLE and not policy.auto_upgrade:
        return _release(node, now)

    match state:
        case "upgrade-failed":
            if node.annotations.get(UPGRADE_CLEAR_ANNOTATION, "") == "true":
                return Action(
                    "set_state",
                    node.name,
                    "upgrade-required",
                    "failure cleared by a person",
                    {
                        UPGRADE_CLEAR_ANNOTATION: None,
                        UPGRADE_FAILURE_ANNOTATION: None,
                        UPGRADE_DRAIN_ANNOTATION: None,
                        **_enter(now),
                    },
                )
            if target and node.installed_version == target:
                return Action("validate", node.name, version=target, why="failed node has the desired version")
            return Action("wait", node.name, why=node.annotations.get(UPGRADE_FAILURE_ANNOTATION, "upgrade-failed"))
        case "" | "upgrade-done":
            want = desired_version(policy, node.labels)
            if node.skipped or not want or not node.installed_version or node.installed_version == want:
                return Action("wait", node.name, why="up to date, skipped or unknown")
            if not policy.auto_upgrade:
                return Action("wait", node.name, why=f"{node.installed_version} != {want}; auto_upgrade is off")
            return Action("set_state", node.name, "upgrade-required", f"{node.installed_version} -> {want}")
        case "upgrade-required":
            want = desired_version(policy, node.labels)
            if node.skipped or not policy.auto_upgrade:
                return Action("wait", node.name, why="skipped or auto_upgrade off")
            if not node.installed_version:
                return Action("wait", node.name, why="installed driver unknown: the node's driver agent is silent")
            if node.installed_version == want:
                return Action("set_state", node.name, "upgrade-done", "already on the desired version")
            blocked = may_start(policy, node, cluster)
            if blocked:
                return Action("wait", node.name, why=blocked)
            return Action(
                "set_state",
                node.name,
                "cordon-required",
                f"slot taken for {want}",
                _enter(now, **{UPGRADE_TARGET_ANNOTATION: want}),
            )
        case "cordon-required":
            was = node.annotations.get(UPGRADE_WAS_CORDONED_ANNOTATION) or ("false" if node.schedulable else "true")
            return Action(
                "cordon",
                node.name,
                "wait-for-jobs-required",
                "cordoned",
                _enter(now, **{UPGRADE_WAS_CORDONED_ANNOTATION: was}),
            )
        case "wait-for-jobs-required":
            waiting = [
                p
                for p in node.pods
                if policy.wait_for_jobs_selector and _matches(p.labels, policy.wait_for_jobs_selector)
            ]
            timeout = policy.wait_for_jobs_timeout_s
            if waiting and (timeout == 0 or elapsed < timeout):
                return Action("wait", node.name, why=f"{len(waiting)} job pod(s) still running")
            why = "no jobs to wait for"
            if waiting:
                why = f"{len(waiting)} job pod(s) still running after wait_for_jobs_timeout_s={timeout:g}; going on"
            return Action("set_state", node.name, "checkpoint-required", why, _enter(now))
        case "checkpoint-required":
            drain_id = node.annotations.get(UPGRADE_DRAIN_ANNOTATION, "")
            to_move = _pods_to_evict(node, policy)
            if not drain_id:
                if all(p.phase == "Terminating" for p in to_move):  # none left, or on their way out (saving)
                    why = "no running pod to save sessions from (drained already)"
                    return Action("set_state", node.name, "pod-deletion-required", why, _enter(now))
                return Action("request_drain", node.name, why="save every KV cache before any eviction")
            if node.drain_verdict == "completed":
                return Action(
                    "set_state", node.name, "pod-deletion-required", f"drain {drain_id} completed", _enter(now)
                )
            if node.drain_verdict == VERDICT_UNKNOWN:
                return Action("wait", node.name, why=f"drain {drain_id}: its verdict cannot be read now")
            failure = ""
            if node.drain_verdict.startswith("failed"):
                failure = f"drain {drain_id} {node.drain_verdict}"
            elif elapsed >= policy.drain_timeout_s:
                failure = f"drain {drain_id} had no verdict within drain_timeout_s={policy.drain_timeout_s:g}"
            if not failure:
                return Action("wait", node.name, why=f"waiting for drain {drain_id}")
            if not to_move:  # someone else emptied the node meanwhile: the upgrade evicts nothing, loses nothing
                why = failure + "; no pod is left on the node to evict"
                return Action("set_state", node.name, "pod-deletion-required", why, _enter(now))
            if policy.on_drain_failure == "continue":
                return Action(
                    "set_state",
                    node.name,
                    "pod-deletion-required",
                    failure + "; on_drain_failure=continue",
                    _enter(now),
                )
            return _fail(node, failure + "; on_drain_failure=stop", now)
        case "pod-deletion-required" | "drain-required":
            remaining = _pods_to_evict(node, policy)
            if not remaining:
                return Action("set_state", node.name, "pod-restart-required", "no pods left to move", _enter(now))
            if elapsed >= policy.pod_deletion_timeout_s:
                names = ", ".join(p.name for p in remaining)
                return _fail(node, f"pods still on the node after pod_deletion_timeout_s: {names}", now)
            evictable = tuple((p.namespace, p.name) for p in remaining if p.phase != "Terminating")
            if not evictable or now < node.evict_after:
                return Action("wait", node.name, why=f"{len(remaining)} pod(s) terminating or eviction backing off")
            return Action("evict", node.name, pods=evictable, why=f"evicting {len(evictable)} pod(s)")
        case "pod-restart-required":
            return Action("install", node.name, why=f"installing {target}", version=target)
        case "validation-required":
            return Action("validate", node.name, "uncordon-required", f"validating {target}", version=target)
        case "uncordon-required":
            # the upgrade's annotations are cleared; when it was done stays (the state's age, for the dashboards)
            done = {key: None for key in UPGRADE_ANNOTATIONS} | _enter(now)
            if node.annotations.get(UPGRADE_WAS_CORDONED_ANNOTATION) == "true":
                return Action("set_state", node.name, "upgrade-done", "stays cordoned: it was before the upgrade", done)
            return Action("uncordon", node.name, "upgrade-done", "uncordoned", done)
    return Action("wait", node.name, why=f"unknown state {state!r}: left alone")


def _release(node: NodeView, now: float) -> Action:
    """``auto_upgrade`` was turned off before any pod of the node was evicted: the slot is given back and the node
    waits in ``upgrade-required``, cordoned only if it was before the upgrade (the drain asked for it is
    forgotten; its verdict, should it come, moves nothing)."""
    forget = {
        UPGRADE_TARGET_ANNOTATION: None,
        UPGRADE_DRAIN_ANNOTATION: None,
        UPGRADE_WAS_CORDONED_ANNOTATION: None,
        **_enter(now),
    }
    why = "auto_upgrade turned off before any eviction: slot released"
    cordoned_by_upgrade = (
        node.state != "cordon-required" and node.annotations.get(UPGRADE_WAS_CORDONED_ANNOTATION) != "true"
    )
    if cordoned_by_upgrade and not node.schedulable:
        return Action("uncordon", node.name, "upgrade-required", why + "; uncordoned", forget)
    return Action("set_state", node.name, "upgrade-required", why, forget)


def after_validation(node: NodeView, policy: DriverPolicy, ok: bool, reason: str, now: float) -> Action:
    """What a validation result means: on from ``validation-required``, or a recovery from ``upgrade-failed``
    (logged as such); a failing validation waits up to ``validation_timeout_s`` then fails the node."""
    if node.state == "upgrade-failed":
        if ok:
            was = node.annotations.get(UPGRADE_FAILURE_ANNOTATION, "")
            return Action(
                "set_state",
                node.name,
                "uncordon-required",
                f"recovered: validation passed after failure ({was})",
                {UPGRADE_FAILURE_ANNOTATION: None, **_enter(now)},
            )
        return Action("wait", node.name, why=node.annotations.get(UPGRADE_FAILURE_ANNOTATION, reason))
    if ok:
        return Action("set_state", node.name, "uncordon-required", "validation passed", _enter(now))
    if now - node.since() >= policy.validation_timeout_s:
        return _fail(node, f"validation failed for {policy.validation_timeout_s:g}s: {reason}", now)
    return Action("wait", node.name, why=f"validation not passing yet: {reason}")


def install_attempt(node: NodeView) -> str:
    """The install's identity on the node's agent: the node and when it entered ``pod-restart-required``. The same
    for every pass and every coordinator until the node leaves the state, so a restarted coordinator joins the
    install it started; a later upgrade of the node is a new attempt."""
    return f"{node.name}@{node.annotations.get(UPGRADE_SINCE_ANNOTATION, '')}"


def after_install(node: NodeView, policy: DriverPolicy, progress: InstallProgress, reason: str, now: float) -> Action:
    """What the agent's answer to an install means: on to validation, a failed node, or another pass. An install
    still running, or an agent that does not answer, fails the node once ``install_timeout_s`` has passed since
    the node entered ``pod-restart-required``."""
    target = node.annotations.get(UPGRADE_TARGET_ANNOTATION, "") or desired_version(policy, node.labels)
    match progress:
        case "installed":
            return Action("set_state", node.name, "validation-required", f"installed {target}", _enter(now))
        case "failed":
            return _fail(node, f"install of {target} failed: {reason}", now)
    waited = now - node.since()
    if waited >= policy.install_timeout_s:
        what = "is still running" if progress == "running" else "got no answer"
        return _fail(
            node,
            f"install of {target} {what} after install_timeout_s={policy.install_timeout_s:g}: {reason}",
            now,
        )
    return Action("wait", node.name, why=f"install of {target}: {reason or progress} ({waited:.0f}s)")
