"""The cluster port: what the services need from Kubernetes.

The real adapter uses the ``kubernetes`` client; the simulated one (``shared.sim.cluster``) is a small control
plane whose state lives in Redis so that separate processes see one cluster.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol, runtime_checkable


class ClusterError(RuntimeError):
    pass


class ClusterConflict(ClusterError):
    """A conditional write found the object changed since it was read (Kubernetes answers 409 Conflict): nothing
    was written; read the object again and decide anew."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    schedulable: bool = True
    ready: bool = True
    gpus: int = 0
    revision: str = ""
    """The node's resourceVersion as read: ``update_node(..., expect=revision)`` writes only if nothing has changed
    the node since."""


PodPhase = Literal["Pending", "Running", "Terminating"]


@dataclass(frozen=True, slots=True)
class PodInfo:
    name: str
    namespace: str
    node: str
    deployment: str
    phase: PodPhase
    gpus: int = 1
    labels: Mapping[str, str] = field(default_factory=dict)
    uid: str = ""
    """The pod's UID: another pod, even of the same name, has another ('' where the cluster does not say)."""
    ip: str = ""
    """The pod's IP address ('' until it has one)."""
    ready: bool = True
    """The pod's Ready condition where the cluster reports one (a Running pod counts as ready otherwise)."""
    restarts: int = 0
    """Container restarts so far (summed over its containers): a restarted server lost what its memory held."""


@dataclass(frozen=True, slots=True)
class DeploymentInfo:
    name: str
    namespace: str
    replicas: int
    gpus_per_pod: int = 1
    max_unavailable: int = 1
    labels: Mapping[str, str] = field(default_factory=dict)


class EvictionOutcome(Enum):
    EVICTED = "evicted"
    BLOCKED_BY_PDB = "blocked-by-pdb"  # HTTP 429: retry later
    NOT_FOUND = "not-found"


@dataclass(frozen=True, slots=True)
class ClusterChange:
    """One change seen by a watch: ``kind`` is node or pod, ``type`` ADDED, MODIFIED or DELETED. ``node`` is the
    node the change is about: the node itself, or the node a pod is bound to (was, when it is DELETED); '' for a
    pod not yet bound and for a deployment. A consumer that keeps state per node reads only that node again."""

    kind: Literal["node", "pod", "deployment"]
    type: Literal["ADDED", "MODIFIED", "DELETED"]
    name: str
    namespace: str = ""
    revision: str = ""
    node: str = ""


SERVICE_ACCOUNT_USER = "system:serviceaccount:"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


@dataclass(frozen=True, slots=True)
class TokenReview:
    """What the cluster says of a bearer token (the TokenReview API's ``status``): whether it is genuine, unexpired
    and meant for one of the audiences asked about, and whose it is. A bound service-account token names its
    pod in ``extra`` (``authentication.kubernetes.io/pod-name``, ``pod-uid``, and on newer clusters
    ``node-name``). ``error``: why it was refused, as the cluster says it."""

    authenticated: bool
    username: str = ""
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    audiences: tuple[str, ...] = ()
    error: str = ""

    def _extra(self, key: str) -> str:
        values = self.extra.get(key) or ()
        return values[0] if len(values) == 1 else ""

    @property
    def service_account(self) -> tuple[str, str]:
        """(namespace, name) of the service account the token is of; ('', '') for any other user."""
        if not self.username.startswith(SERVICE_ACCOUNT_USER):
            return "", ""
        namespace, _, name = self.username[len(SERVICE_ACCOUNT_USER) :].partition(":")
        return (namespace, name) if namespace and name and ":" not in name else ("", "")

    @property
    def pod(self) -> str:
        """The pod the token is bound to ('' for a token bound to none)."""
        return self._extra(POD_NAME_EXTRA)

    @property
    def pod_uid(self) -> str:
        return self._extra(POD_UID_EXTRA)

    @property
    def node(self) -> str:
        """The node of the pod the token is bound to, where the cluster says it ('' otherwise)."""
        return self._extra(NODE_NAME_EXTRA)


@dataclass(frozen=True, slots=True)
class Semver:
    """A ``version`` attribute of a device (a semantic version, compared as one by CEL), not a string."""

    value: str


DeviceAttribute = str | int | bool | Semver
TaintEffect = Literal["NoSchedule", "NoExecute", "None"]


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """A taint on one device of a ResourceSlice (KEP-5055): claims that do not tolerate it are not allocated the
    device (``NoSchedule``), and pods holding it are evicted (``NoExecute``)."""

    key: str
    value: str = ""
    effect: TaintEffect = "NoSchedule"


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One device of a ResourceSlice: ``capacity`` values are Kubernetes quantities (``81559Mi``, ``16``)."""

    name: str
    attributes: Mapping[str, DeviceAttribute] = field(default_factory=dict)
    capacity: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[DeviceTaint, ...] = ()


@dataclass(frozen=True, slots=True)
class ResourceSlice:
    """The devices ``driver`` offers on ``node``, all of them, as one pool of one slice (``resource.k8s.io/v1``).
    The pool's generation is the port's to keep: it goes up with every write that changes the devices."""

    driver: str
    node: str
    pool: str
    devices: tuple[SliceDevice, ...] = ()

    @property
    def name(self) -> str:
        """The object's name: one slice per node and driver."""
        return f"{self.node}-{self.driver}"


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One device the scheduler allocated to a claim (``status.allocation.devices.results[]``)."""

    request: str
    driver: str
    pool: str
    device: str


@dataclass(frozen=True, slots=True)
class ResourceClaimInfo:
    """A ResourceClaim as a DRA driver reads it to prepare it: ``allocated`` False while the scheduler has not
    allocated it (``devices`` is then empty)."""

    namespace: str
    name: str
    uid: str
    allocated: bool = False
    devices: tuple[AllocatedDevice, ...] = ()


@runtime_checkable
class ClusterPort(Protocol):
    simulated: bool

    async def nodes(self) -> list[NodeInfo]: ...

    async def node(self, name: str) -> NodeInfo | None: ...

    async def cordon(self, node: str) -> None: ...

    async def uncordon(self, node: str) -> None: ...

    async def set_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set labels; a value of None removes the label."""
        ...

    async def set_node_annotations(self, node: str, annotations: Mapping[str, str | None]) -> None: ...

    async def update_node(
        self,
        node: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        schedulable: bool | None = None,
        expect: str = "",
    ) -> NodeInfo:
        """Labels, annotations (None removes one) and schedulability in one atomic write; the node as written.
        With ``expect``, the write happens only while the node's revision is still ``expect``; otherwise
        ``ClusterConflict`` and nothing changes (a compare-and-set: what fences a writer that decided on a stale
        read)."""
        ...

    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[PodInfo]: ...

    async def set_pod_annotations(self, namespace: str, pod: str, annotations: Mapping[str, str | None]) -> None:
        """Set a pod's annotations (None removes one) in one merge patch; a pod that is gone is no error."""
        ...

    async def evict(self, namespace: str, pod: str) -> EvictionOutcome: ...

    async def deployments(self, namespace: str | None = None) -> list[DeploymentInfo]: ...

    async def scale(self, namespace: str, deployment: str, replicas: int) -> None: ...

    def watch(self) -> AsyncIterator[ClusterChange]:
        """Changes from now on, in order."""
        ...

    async def review_token(self, token: str, audiences: tuple[str, ...]) -> TokenReview:
        """Ask the cluster whether ``token`` (a service-account token, bound to a pod or not) is genuine, unexpired
        and meant for one of ``audiences``, and whose it is (the TokenReview API). A refused token is a review
        with ``authenticated`` False and the reason; ``ClusterError`` only when the cluster cannot be asked."""
        ...

    async def publish_resource_slice(self, resource_slice: ResourceSlice) -> bool:
        """Create the slice, or replace it when its devices differ (the pool's generation one higher); True when
        it wrote. Idempotent: publishing the same devices again writes nothing."""
        ...

    async def resource_claim(self, namespace: str, name: str) -> ResourceClaimInfo | None:
        """The claim, None when there is none."""
        ...

    async def close(self) -> None: ...
