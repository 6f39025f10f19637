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
    """One change seen by a watch: ``kind`` is node or pod, ``type`` ADDED, MODIFIED or DELETED."""

    kind: Literal["node", "pod", "deployment"]
    type: Literal["ADDED", "MODIFIED", "DELETED"]
    name: str
    namespace: str = ""
    revision: str = ""


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

    async def evict(self, namespace: str, pod: str) -> EvictionOutcome: ...

    async def deployments(self, namespace: str | None = None) -> list[DeploymentInfo]: ...

    async def scale(self, namespace: str, deployment: str, replicas: int) -> None: ...

    def watch(self) -> AsyncIterator[ClusterChange]:
        """Changes from now on, in order."""
        ...

    async def close(self) -> None: ...
