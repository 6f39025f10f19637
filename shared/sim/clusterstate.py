"""The simulated control plane as a value: nodes, deployments and pods, and the few rules that move pods.

This is a stand-in for the Kubernetes scheduler, the ReplicaSet controller and the Eviction API, not a second
Kubernetes: pods are bound by free GPUs alone, start the moment they are bound (there are no images to pull), and a
PodDisruptionBudget is a deployment's ``max_unavailable``.

There is no I/O and no clock here; whatever depends on time takes ``now``. Operations change the state in place and
return the changes they caused, in order. Every change to the state is reported by at least one change record, so
an operation that returns none left the state exactly as it was; the Redis adapter relies on this to write only
when something happened, which keeps the revisions of its change stream dense.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Literal

import msgspec

from shared.contract.annotations import POD_DELETION_COST_ANNOTATION
from shared.ports.cluster import (
    ClusterChange,
    ClusterConflict,
    ClusterError,
    EvictionOutcome,
    PodPhase,
    ResourceSlice,
)
from shared.sim.drasched import Unschedulable, allocate
from shared.sim.spec import ClaimSpec, SimSpec

ChangeType = Literal["ADDED", "MODIFIED", "DELETED"]


def object_key(namespace: str, name: str) -> str:
    """How deployments and pods are keyed: ``namespace/name``, as ``kubectl`` writes them."""
    return f"{namespace}/{name}"


class SimNode(msgspec.Struct, kw_only=True):
    """A node. ``revision`` is the cluster revision of the write that last changed it (its resourceVersion)."""

    name: str
    gpus: int
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    annotations: dict[str, str] = msgspec.field(default_factory=dict)
    schedulable: bool = True
    ready: bool = True
    revision: int = 0


class SimDeployment(msgspec.Struct, kw_only=True):
    name: str
    namespace: str
    replicas: int
    gpus_per_pod: int = 1
    max_unavailable: int = 1
    grace_period_s: float = 30.0
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    claim: ClaimSpec | None = None
    """Its pods' GPUs by DRA claim, allocated from the nodes' ResourceSlices (``_schedule``)."""

    @property
    def key(self) -> str:
        return object_key(self.namespace, self.name)


class SimPod(msgspec.Struct, kw_only=True):
    """A pod of a deployment. ``node`` is empty exactly while the pod is Pending; a Terminating pod keeps its node
    and its GPUs until it is gone, as a real one does while its preStop hook runs. ``gpu_indices`` are the node's
    GPUs the pod holds (what the kubelet's device manager would have given it), set when it is bound."""

    name: str
    namespace: str
    deployment: str
    gpus: int
    created_seq: int
    node: str = ""
    phase: PodPhase = "Pending"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    terminating_since: float | None = None
    prestop_done: bool = False
    gpu_indices: list[int] = msgspec.field(default_factory=list)
    claim_devices: list[str] = msgspec.field(default_factory=list)
    """The devices of its node's ResourceSlice its claim was allocated (a deployment with a ``claim``)."""
    annotations: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def deletion_cost(self) -> int:
        """``controller.kubernetes.io/pod-deletion-cost`` as the ReplicaSet controller reads it (0 when absent or
        not an integer)."""
        try:
            return int(self.annotations.get(POD_DELETION_COST_ANNOTATION, "0"))
        except ValueError:
            return 0

    @property
    def key(self) -> str:
        return object_key(self.namespace, self.name)

    @property
    def uid(self) -> str:
        """The pod's UID: the same for the pod's whole life, never another pod's (a name is never used twice)."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpuwarden-sim:pod:{self.key}/{self.created_seq}"))

    @property
    def ip(self) -> str:
        """The pod's IP once it is bound to a node ('' while Pending): ``10.a.b.c`` from its cluster-wide
        sequence, so no two pods of the simulated cluster ever share one (up to 2**24 pods)."""
        if not self.node:
            return ""
        seq = self.created_seq
        return f"10.{(seq >> 16) & 0xFF}.{(seq >> 8) & 0xFF}.{seq & 0xFF}"


class ClusterState(msgspec.Struct, kw_only=True, dict=True):
    """The whole simulated cluster. An operation that refuses (raises) does so before it changes anything.

    After ``reconcile(now)``: each deployment has exactly ``replicas`` pods that are not Terminating; no node holds
    more GPUs (Running plus Terminating pods) than it has; every Pending pod fits on no ready, schedulable node; no
    Terminating pod has finished its preStop or outlived its grace period. Pod names are ``<deployment>-<seq>``
    with a cluster-wide sequence, so a name is never used twice. ``revision`` counts the adapter's writes.
    """

    nodes: dict[str, SimNode]
    deployments: dict[str, SimDeployment]
    pods: dict[str, SimPod] = msgspec.field(default_factory=dict)
    next_seq: int = 1
    revision: int = 0

    # -- reading ------------------------------------------------------------------------------------------------
    def pods_by_node(self) -> dict[str, list[SimPod]]:
        """Node name -> the pods bound to it, oldest first ('' : the Pending ones). Built once per state and kept
        with it (not stored): for a state that is read, not changed, as every state ``SimCluster`` reads is (an
        operation on this state does not update it)."""
        index: dict[str, list[SimPod]] | None = self.__dict__.get("_pods_by_node")
        if index is None:
            index = {}
            for pod in sorted(self.pods.values(), key=lambda p: p.created_seq):
                index.setdefault(pod.node, []).append(pod)
            self.__dict__["_pods_by_node"] = index
        return index

    def node(self, name: str) -> SimNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise ClusterError(
                f"node {name!r} is not in the simulated cluster (nodes: {', '.join(sorted(self.nodes))})"
            ) from None

    def deployment(self, namespace: str, name: str) -> SimDeployment:
        try:
            return self.deployments[object_key(namespace, name)]
        except KeyError:
            raise ClusterError(
                f"deployment {object_key(namespace, name)} is not in the simulated cluster "
                f"(deployments: {', '.join(sorted(self.deployments))})"
            ) from None

    def pods_of(self, deployment: SimDeployment) -> list[SimPod]:
        """The deployment's pods, oldest first."""
        return sorted(
            (p for p in self.pods.values() if p.namespace == deployment.namespace and p.deployment == deployment.name),
            key=lambda p: p.created_seq,
        )

    def allocated_gpus(self, node: str) -> int:
        """GPUs held on ``node`` by pods that are Running or still Terminating."""
        return sum(p.gpus for p in self.pods.values() if p.node == node)

    def free_gpus(self, node: str) -> int:
        return self.nodes[node].gpus - self.allocated_gpus(node)

    def gpu_holders(self, node: str) -> dict[int, list[str]]:
        """GPU index -> the pods (``namespace/name``, by name) holding it on ``node``: Running or Terminating."""
        holders: dict[int, list[str]] = {}
        for pod in sorted(self.pods.values(), key=lambda p: p.key):
            if pod.node == node:
                for index in pod.gpu_indices:
                    holders.setdefault(index, []).append(pod.key)
        return holders

    def available(self, deployment: SimDeployment) -> int:
        """Pods of the deployment that serve: Running, which in this simulation is also ready."""
        return sum(1 for p in self.pods_of(deployment) if p.phase == "Running")

    def as_added(self) -> list[ClusterChange]:
        """ADDED for every node, deployment and pod: what a watch that began before the cluster existed has seen."""
        return [
            *(ClusterChange("node", "ADDED", n, node=n) for n in self.nodes),
            *(ClusterChange("deployment", "ADDED", d.name, d.namespace) for d in self.deployments.values()),
            *(_pod_change("ADDED", p) for p in self.pods.values()),
        ]

    # -- nodes --------------------------------------------------------------------------------------------------
    def cordon(self, node: str) -> list[ClusterChange]:
        """Keep new pods off ``node``; the pods already there stay, as Kubernetes leaves them."""
        return self._set_schedulable(node, False)

    def uncordon(self, node: str) -> list[ClusterChange]:
        return self._set_schedulable(node, True)

    def _set_schedulable(self, node: str, schedulable: bool) -> list[ClusterChange]:
        target = self.node(node)
        if target.schedulable == schedulable:
            return []
        target.schedulable = schedulable
        return [ClusterChange("node", "MODIFIED", node, node=node)]

    def set_labels(self, node: str, labels: Mapping[str, str | None]) -> list[ClusterChange]:
        """Set labels; a value of None removes the label. One change when anything differs, none otherwise."""
        return _merge(self.node(node).labels, labels, node)

    def set_annotations(self, node: str, annotations: Mapping[str, str | None]) -> list[ClusterChange]:
        return _merge(self.node(node).annotations, annotations, node)

    def set_pod_annotations(
        self, namespace: str, pod: str, annotations: Mapping[str, str | None]
    ) -> list[ClusterChange]:
        """A pod's annotations merged (None removes one); a pod that is gone changes nothing."""
        target = self.pods.get(object_key(namespace, pod))
        if target is None:
            return []
        before = dict(target.annotations)
        for key, value in annotations.items():
            if value is None:
                target.annotations.pop(key, None)
            else:
                target.annotations[key] = value
        return [] if target.annotations == before else [_pod_change("MODIFIED", target)]

    def update_node(
        self,
        node: str,
        labels: Mapping[str, str | None],
        annotations: Mapping[str, str | None],
        schedulable: bool | None,
        expect: str,
    ) -> list[ClusterChange]:
        """Labels, annotations and schedulability at once, only while the node's revision is ``expect`` (when
        given): else ``ClusterConflict`` and nothing changes. One change when anything differs."""
        target = self.node(node)
        if expect and str(target.revision) != expect:
            raise ClusterConflict(
                f"node {node!r} is at revision {target.revision}, not {expect}: it changed since it was read"
            )
        changes = _merge(target.labels, labels, node) + _merge(target.annotations, annotations, node)
        if schedulable is not None:
            changes += self._set_schedulable(node, schedulable)
        return changes[:1]

    def stamp(self, changes: list[ClusterChange]) -> None:
        """Give each node a change names the state's ``revision``, as the API server gives an object the
        resourceVersion of the write that changed it."""
        for change in changes:
            if change.kind == "node" and change.name in self.nodes:
                self.nodes[change.name].revision = self.revision

    # -- deployments --------------------------------------------------------------------------------------------
    def scale(self, namespace: str, deployment: str, replicas: int) -> list[ClusterChange]:
        """Set the desired replica count; ``reconcile`` adds or removes the pods."""
        if replicas < 0:
            raise ClusterError(f"deployment {object_key(namespace, deployment)}: replicas must be >= 0, not {replicas}")
        target = self.deployment(namespace, deployment)
        if target.replicas == replicas:
            return []
        target.replicas = replicas
        return [ClusterChange("deployment", "MODIFIED", deployment, namespace)]

    def add_deployment(self, deployment: SimDeployment) -> list[ClusterChange]:
        """Create a deployment, as ``kubectl create`` does; ``reconcile`` makes and binds its pods. Idempotent: the
        same deployment again changes nothing; another one under the same name is refused (``ClusterError``)."""
        if deployment.replicas < 0:
            raise ClusterError(f"deployment {deployment.key}: replicas must be >= 0, not {deployment.replicas}")
        existing = self.deployments.get(deployment.key)
        if existing is not None:
            if existing == deployment:
                return []
            raise ClusterError(f"deployment {deployment.key} is in the simulated cluster already, unlike this one")
        self.deployments[deployment.key] = deployment
        return [ClusterChange("deployment", "ADDED", deployment.name, deployment.namespace)]

    # -- pods ---------------------------------------------------------------------------------------------------
    def evict(self, namespace: str, pod: str, now: float) -> tuple[EvictionOutcome, list[ClusterChange]]:
        """The Eviction API. A Running pod becomes Terminating (its preStop runs) unless that would leave its
        deployment more than ``max_unavailable`` short of ``replicas`` in Running pods: then BLOCKED_BY_PDB, and
        nothing changes. A Pending pod serves no one and is deleted at once. A missing or already Terminating pod
        is NOT_FOUND."""
        target = self.pods.get(object_key(namespace, pod))
        if target is None or target.phase == "Terminating":
            return EvictionOutcome.NOT_FOUND, []
        if target.phase == "Pending":
            del self.pods[target.key]
            return EvictionOutcome.EVICTED, [_pod_change("DELETED", target)]
        owner = self.deployments.get(object_key(namespace, target.deployment))
        if owner is not None and owner.replicas - self.available(owner) + 1 > owner.max_unavailable:
            return EvictionOutcome.BLOCKED_BY_PDB, []
        return EvictionOutcome.EVICTED, self._terminate(target, now)

    def kill(self, namespace: str, pod: str) -> tuple[SimPod | None, list[ClusterChange]]:
        """The pod dies at once (OOM kill, engine crash): deleted with no preStop and no grace period; its
        deployment makes a new one at the next reconcile. ``namespace`` '': the one namespace holding a pod of
        that name. None (nothing changes) when there is no such bound pod, or several."""
        found = [
            p
            for p in self.pods.values()
            if p.name == pod and (p.namespace == namespace or not namespace) and p.phase in ("Running", "Terminating")
        ]
        if len(found) != 1:
            return None, []
        target = found[0]
        del self.pods[target.key]
        return target, [_pod_change("DELETED", target)]

    def lose_node(self, node: str) -> tuple[list[str], list[ClusterChange]]:
        """The node is gone: NotReady (nothing is scheduled there again) and every pod on it dies at once, as
        ``kill`` kills one; their deployments replace them elsewhere at the next reconcile."""
        target = self.node(node)
        changes: list[ClusterChange] = []
        if target.ready:
            target.ready = False
            changes.append(ClusterChange("node", "MODIFIED", node, node=node))
        killed = sorted((p for p in self.pods.values() if p.node == node), key=lambda p: p.created_seq)
        for pod in killed:
            del self.pods[pod.key]
            changes.append(_pod_change("DELETED", pod))
        return [p.key for p in killed], changes

    def mark_prestop_done(self, namespace: str, pod: str) -> list[ClusterChange]:
        """The workload finished its preStop hook (its checkpoint is safe); the pod goes at the next reconcile.
        Idempotent: a pod that is gone, not Terminating or already done is left alone."""
        target = self.pods.get(object_key(namespace, pod))
        if target is None or target.phase != "Terminating" or target.prestop_done:
            return []
        target.prestop_done = True
        return [_pod_change("MODIFIED", target)]

    def _terminate(self, pod: SimPod, now: float) -> list[ClusterChange]:
        pod.phase = "Terminating"
        pod.terminating_since = now
        return [_pod_change("MODIFIED", pod)]

    # -- the controllers ----------------------------------------------------------------------------------------
    @property
    def wants_slices(self) -> bool:
        """Whether a deployment asks for GPUs by claim (scheduling it reads the nodes' ResourceSlices)."""
        return any(d.claim is not None for d in self.deployments.values())

    def reconcile(self, now: float, slices: Mapping[str, ResourceSlice] | None = None) -> list[ClusterChange]:
        """Remove finished Terminating pods, bring each deployment to its replica count, then bind Pending pods.

        A Terminating pod is gone once its preStop is done, or when its grace period has run out (SIGKILL).
        Missing pods are created; surplus ones go unbound first, then, as the ReplicaSet controller chooses, the
        lowest ``controller.kubernetes.io/pod-deletion-cost`` first, then newest first (bound ones terminate
        gracefully). Pending pods, oldest first, go to the ready, schedulable node with the most free GPUs that
        has enough, ties broken by name, and run at once, holding that node's lowest-numbered free GPUs. A pod
        whose deployment asks by claim goes, in the same order of nodes, to the first whose ResourceSlice
        (``slices`` by node; none: it waits) offers the claim's devices free (``shared.sim.drasched``), and holds
        those. Idempotent: a second call with the same ``now`` finds nothing to do.
        """
        changes = self._remove_finished(now)
        for deployment in sorted(self.deployments.values(), key=lambda d: d.key):
            changes += self._scale_pods(deployment, now)
        changes += self._schedule(slices or {})
        return changes

    def _remove_finished(self, now: float) -> list[ClusterChange]:
        changes: list[ClusterChange] = []
        for pod in sorted(self.pods.values(), key=lambda p: p.created_seq):
            if pod.phase != "Terminating":
                continue
            owner = self.deployments.get(object_key(pod.namespace, pod.deployment))
            grace = owner.grace_period_s if owner is not None else 0.0
            since = pod.terminating_since if pod.terminating_since is not None else now
            if pod.prestop_done or now - since >= grace:
                del self.pods[pod.key]
                changes.append(_pod_change("DELETED", pod))
        return changes

    def _scale_pods(self, deployment: SimDeployment, now: float) -> list[ClusterChange]:
        active = [p for p in self.pods_of(deployment) if p.phase != "Terminating"]
        changes: list[ClusterChange] = []
        for _ in range(deployment.replicas - len(active)):
            pod = SimPod(
                name=f"{deployment.name}-{self.next_seq}",
                namespace=deployment.namespace,
                deployment=deployment.name,
                gpus=deployment.gpus_per_pod,
                created_seq=self.next_seq,
                labels={"app": deployment.name},
            )
            self.next_seq += 1
            self.pods[pod.key] = pod
            changes.append(_pod_change("ADDED", pod))
        surplus = len(active) - deployment.replicas
        if surplus > 0:
            removal = sorted(active, key=lambda p: (p.phase != "Pending", p.deletion_cost, -p.created_seq))
            for pod in removal[:surplus]:  # unbound first, then the lowest deletion cost, then the newest
                if pod.phase == "Pending":
                    del self.pods[pod.key]
                    changes.append(_pod_change("DELETED", pod))
                else:
                    changes += self._terminate(pod, now)
        return changes

    def _schedule(self, slices: Mapping[str, ResourceSlice]) -> list[ClusterChange]:
        changes: list[ClusterChange] = []
        pending = sorted((p for p in self.pods.values() if p.phase == "Pending"), key=lambda p: p.created_seq)
        if not pending:
            return changes
        allocated: dict[str, int] = {}  # allocated_gpus of every node, in one pass over the pods
        for placed in self.pods.values():
            if placed.node:
                allocated[placed.node] = allocated.get(placed.node, 0) + placed.gpus
        free = {n.name: n.gpus - allocated.get(n.name, 0) for n in self.nodes.values() if n.ready and n.schedulable}
        for pod in pending:
            fitting = sorted((name for name, gpus in free.items() if gpus >= pod.gpus), key=lambda n: (-free[n], n))
            claim = self.deployments[object_key(pod.namespace, pod.deployment)].claim
            if claim is not None:
                chosen = self._by_claim(pod, claim, fitting, slices)
                if chosen is None:
                    continue
                node, pod.claim_devices = chosen
                pod.gpu_indices = sorted({_gpu_index(d) for d in pod.claim_devices})
            elif not fitting:
                continue
            else:
                node = fitting[0]
                held = {i for p in self.pods.values() if p.node == node for i in p.gpu_indices}
                pod.gpu_indices = [i for i in range(self.nodes[node].gpus) if i not in held][: pod.gpus]
            free[node] -= pod.gpus
            pod.node = node
            pod.phase = "Running"
            changes.append(_pod_change("MODIFIED", pod))
        return changes

    def _by_claim(
        self, pod: SimPod, claim: ClaimSpec, nodes: list[str], slices: Mapping[str, ResourceSlice]
    ) -> tuple[str, list[str]] | None:
        """The first of ``nodes`` whose slice offers the claim's devices free: free of other claims and of the GPUs
        pods without a claim hold there. None: no node does (the pod waits, as a real one would)."""
        request = claim.request(pod.gpus)
        for node in nodes:
            offered = slices.get(node)
            if offered is None:
                continue
            on_node = [p for p in self.pods.values() if p.node == node]
            whole = {i for p in on_node if not p.claim_devices for i in p.gpu_indices}
            taken = {(offered.driver, offered.pool, d) for p in on_node for d in p.claim_devices}
            taken |= {(offered.driver, offered.pool, d.name) for d in offered.devices if _gpu_index(d.name) in whole}
            try:
                _, devices = allocate([request], [offered], taken, node=node)
            except Unschedulable:
                continue
            return node, [d.device for d in devices]
        return None


def _gpu_index(device: str) -> int:
    """The GPU a device of the slice is or is part of (``gpu-<index>`` or ``gpu-<index>-mig-...``)."""
    return int(device.split("-")[1])


def from_spec(spec: SimSpec) -> ClusterState:
    """The cluster a spec describes, with no pods yet: ``reconcile`` creates and binds them."""
    return ClusterState(
        nodes={n.name: SimNode(name=n.name, gpus=n.gpu_count, labels=dict(n.labels)) for n in spec.nodes},
        deployments={
            object_key(d.namespace, d.name): SimDeployment(
                name=d.name,
                namespace=d.namespace,
                replicas=d.replicas,
                gpus_per_pod=d.gpus_per_pod,
                max_unavailable=d.max_unavailable,
                grace_period_s=d.grace_period_s,
                labels={"app": d.name},
                claim=d.claim,
            )
            for d in spec.deployments
        },
    )


def _pod_change(type_: ChangeType, pod: SimPod) -> ClusterChange:
    return ClusterChange("pod", type_, pod.name, pod.namespace, node=pod.node)


def _merge(target: dict[str, str], update: Mapping[str, str | None], node: str) -> list[ClusterChange]:
    changed = False
    for key, value in update.items():
        if value is None:
            changed |= target.pop(key, None) is not None
        elif target.get(key) != value:
            target[key] = value
            changed = True
    return [ClusterChange("node", "MODIFIED", node, node=node)] if changed else []
