"""What the checkpoint service needs from the outside world, as Protocols: the checkpoint store, the session
registry and the cluster. The service gets them from ``ctx.backends`` (``adapters.py``: the store and Redis the
composition root opens, the registry over that Redis, the cluster port) or from its caller (tests hand a store);
every decision module depends on these Protocols only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from shared.contract.checkpoint import AgentSessions, CommittedCheckpoint
from shared.contract.node import DrainOutcome
from shared.contract.sessions import SessionLocation, SessionRecord
from shared.kv.manifest import CheckpointManifest
from shared.kv.store import PackInfo
from shared.ports.cluster import NodeInfo, PodInfo

from .registry import Applied, Claim, FleetCounts, Recording, Repaired, SessionPlace


class Store(Protocol):
    """The checkpoint store, as far as the service reads and deletes in it (``shared.kv.store.CheckpointStore``):
    agents write; the service verifies, lists and collects."""

    url: str

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest: ...

    async def checkpoints(self, session_id: str) -> list[str]:
        """Checkpoint ids of a session whose manifests are in the store, newest (generation, sequence) first."""
        ...

    async def sessions(self) -> list[str]: ...

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None: ...

    async def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]: ...

    async def packs(self) -> list[PackInfo]: ...

    async def delete_pack(self, pack_id: str) -> None: ...

    async def sweep_orphans(self, grace_s: float) -> int: ...


class Cluster(Protocol):
    """What the service asks the cluster (``shared.ports.cluster.ClusterPort``): whether a node exists, and which
    pods run. It never writes to it."""

    async def node(self, name: str) -> NodeInfo | None: ...

    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[PodInfo]: ...


class Registry(Protocol):
    """Where every session is held and which checkpoints are committed (``registry.SessionRegistry`` in Redis),
    with the drains' records, the replicas' membership and their turns."""

    # sessions and pods
    async def apply_announcement(self, event: AgentSessions) -> Applied: ...

    async def claim(
        self,
        session_id: str,
        pod: str,
        node: str,
        namespace: str,
        deployment: str,
        floor: int,
        force: bool = False,
        seal: str | None = None,
        take: str = "",
    ) -> Claim: ...

    async def note_restored(
        self, session_id: str, pod: str, generation: int, checkpoint_id: str
    ) -> SessionLocation | None: ...

    async def where(self, session_id: str) -> SessionLocation: ...

    async def sessions_on_node(self, node: str) -> list[SessionPlace]: ...

    async def pods(self) -> dict[str, str]: ...

    async def silent_pods(self, known: dict[str, str] | None = None) -> dict[str, str]: ...

    async def forget_pod(self, pod: str) -> list[SessionLocation]: ...

    async def summary(self) -> FleetCounts: ...

    async def sessions_page(
        self, *, node: str = "", pod: str = "", cursor: str = "", limit: int = 200
    ) -> tuple[list[SessionRecord], str, int | None]: ...

    # checkpoints
    async def record_checkpoints(
        self, committed: Sequence[CommittedCheckpoint], store: str, pod: str, node: str
    ) -> list[Recording]: ...

    async def repair_checkpoints(
        self, session_id: str, manifests: Sequence[CheckpointManifest], store: str
    ) -> Repaired: ...

    async def checkpoints(self, session_id: str, limit: int = 16) -> list[dict[str, Any]]: ...

    async def forget_checkpoint(self, session_id: str, checkpoint_id: str) -> None: ...

    async def record_restore(self, session_id: str, checkpoint_id: str, pod: str, node: str) -> None: ...

    # retention's changes
    async def take_retention_changes(self, limit: int) -> list[str]: ...

    async def note_aging(self, older: Mapping[tuple[str, str], float]) -> None: ...

    async def aged(self, made_before: float, limit: int) -> list[tuple[str, str]]: ...

    async def retire_older(self, session_id: str, checkpoint_id: str) -> bool: ...

    # drains
    async def drain_verdict(self, drain_id: str) -> bytes | None: ...

    async def drain_node(self, drain_id: str) -> str | None: ...

    async def take_drain(self, drain_id: str, node: str, owner: str, lease_s: float) -> bool: ...

    async def renew_drain(self, drain_id: str, owner: str, lease_s: float) -> bool: ...

    async def keep_failures(self, drain_id: str, failures: list[bytes], ttl_s: float) -> str: ...

    async def finish_drain(self, drain_id: str, state: DrainOutcome, verdict: bytes, duration_s: float) -> bool: ...

    async def recover_drain(self, drain_id: str, node: str, state: DrainOutcome, verdict: bytes) -> bool: ...

    # replicas and their turns
    async def replicas(self, owner: str, lease_s: float) -> list[str]: ...

    async def take_turn_or_wait(self, what: str, pod: str, owner: str, interval_s: float) -> int: ...

    async def release_turn(self, what: str, pod: str, owner: str) -> None: ...

    async def take_turn(self, what: str, pod: str, owner: str, interval_s: float) -> bool: ...
