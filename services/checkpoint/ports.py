"""What the checkpoint service needs from the outside world, as Protocols: the checkpoint store, the session
registry, the leases its replicas take and the cluster. The service gets them from ``ctx.backends``
(``adapters.py``: the store and Redis the composition root opens, the registry and the leases over that Redis, the
cluster port) or from its caller (tests hand a store); every decision module depends on these Protocols only. The
record types the registry answers in (where a session is placed, what an announcement, a claim, a record or a
repair decided) live here too, so the Redis adapters (``registry.py``, ``audit.py``) import their port, never the
reverse."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.contract.checkpoint import AgentSessions, CommittedCheckpoint
from shared.contract.node import DrainOutcome
from shared.contract.sessions import SessionLocation, SessionRecord
from shared.kv.manifest import CheckpointManifest, ChunkRef
from shared.kv.store import PackInfo
from shared.ports.cluster import NodeInfo, PodInfo


@dataclass(frozen=True)
class SessionPlace:
    """Where the registry places a session (its pod's view); ``SessionLocation`` is the routers' view."""

    session_id: str
    pod: str
    node: str
    namespace: str
    deployment: str
    generation: int = 0


@dataclass(frozen=True)
class Applied:
    """What one announcement changed: sessions announced under a generation that moved on (stale), ended ones
    whose checkpoints are to be retired, the locations that changed, and whether the agent must resync."""

    stale: list[str]
    retired: list[str]
    changes: list[SessionLocation]
    resync: bool = False


@dataclass(frozen=True)
class Repaired:
    """What a repair did with the store's checkpoints the registry lacked: recorded anew, or fenced (a stale save not
    deleted yet: another pod's checkpoint of the generation the session's holder has now, or an older generation's
    sorting after the current generation's seal; see ``lua.REPAIR``)."""

    added: list[str]
    fenced: list[str]


@dataclass(frozen=True)
class Recording:
    """What recording one reported checkpoint decided (``lua.RECORD``). ``outcome``: ``recorded`` (anew: ``location``
    is the session's new location), ``duplicate`` (recorded before: a report sent again or replayed, answered as
    committed and changing nothing), ``refused`` (``refused`` says why; kept, since it may be what someone else
    committed, such as the seal a new holder restored from) or ``stale`` (refused, and a save nobody may take for
    committed: the refusal may delete it)."""

    refused: str
    location: SessionLocation | None
    outcome: str

    @property
    def deletable(self) -> bool:
        return self.outcome == "stale"

    @property
    def first_time(self) -> bool:
        return self.outcome == "recorded"


@dataclass(frozen=True)
class Forgotten:
    """What the scrub's forgetting of a lost checkpoint did: ``forgotten`` (False: retention forgot it first, or it
    is the newest and was kept), whether it is or was the session's ``newest``, and the ``holder`` marked for a full
    next save ('' when no pod holds the session)."""

    forgotten: bool
    newest: bool
    holder: str


@dataclass(frozen=True)
class Claim:
    """A claim's outcome: the generation handed out and the session's new location, or why it was refused
    (``held``: ``holder`` on ``holder_node`` is alive and holds it; ``deployment``: it belongs to ``holder``)."""

    generation: int
    location: SessionLocation | None
    refused: str = ""
    holder: str = ""
    holder_node: str = ""
    taken_from: str = ""
    """The pod that took the session's previous generation ('' when not known), and that generation."""
    taken_from_generation: int = 0


@dataclass(frozen=True)
class FleetCounts:
    """Sessions per pod, each pod's node and deployment (``namespace/name``), and the pods whose lease stands."""

    by_pod: dict[str, int]
    nodes: dict[str, str]
    deployments: dict[str, str]
    alive: list[str]


class Store(Protocol):
    """The checkpoint store, as far as the service reads and deletes in it (``shared.kv.store.CheckpointStore``):
    agents write; the service verifies, lists and collects. A store that keeps a bucket per pod also has
    ``provision(pod)``, which the service calls when it first hears a pod (``Replica.provision``)."""

    url: str

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest: ...

    async def checkpoints(self, session_id: str) -> list[str]:
        """Checkpoint ids of a session whose manifests are in the store, newest (generation, sequence) first."""
        ...

    async def sessions(self) -> list[str]: ...

    async def read_chunks(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None: ...

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
    """Where every session is held and which checkpoints are committed (``registry.SessionRegistry`` in Redis)."""

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

    async def sessions_of_pod(self, pod: str) -> dict[str, int]: ...

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

    # the scrub, and the sessions whose next save is full
    async def run_id(self) -> str: ...

    async def scrub_position(self) -> tuple[int, str]: ...

    async def keep_scrub_position(self, cursor: int, run_id: str) -> None: ...

    async def scan_checkpointed(self, cursor: int, count: int) -> tuple[int, list[str]]: ...

    async def recorded_checkpoints(self, session_ids: Sequence[str], limit: int) -> dict[str, list[str]]: ...

    async def forget_lost(self, session_id: str, checkpoint_id: str, keep_newest: bool = False) -> Forgotten: ...

    async def rewrites(self, pod: str) -> set[str]: ...

    async def mark_rewrite(self, pod: str, session_ids: Sequence[str]) -> None: ...

    async def clear_rewrites(self, pod: str, session_ids: Sequence[str]) -> None: ...


class Leases(Protocol):
    """Who runs what among the replicas (``leases.ReplicaLeases`` in Redis): each drain's lease and its one recorded
    verdict, the turns that let one replica act per interval, and the replicas' membership."""

    # drains
    async def drain_verdict(self, drain_id: str) -> bytes | None: ...

    async def drain_node(self, drain_id: str) -> str | None: ...

    async def take_drain(self, drain_id: str, node: str, owner: str, lease_s: float) -> bool: ...

    async def renew_drain(self, drain_id: str, owner: str, lease_s: float) -> bool: ...

    async def keep_failures(self, drain_id: str, failures: list[bytes], ttl_s: float) -> str: ...

    async def finish_drain(self, drain_id: str, state: DrainOutcome, verdict: bytes, duration_s: float) -> bool: ...

    async def recover_drain(self, drain_id: str, node: str, state: DrainOutcome, verdict: bytes) -> bool: ...

    # turns
    async def take_turn_or_wait(self, what: str, pod: str, owner: str, interval_s: float) -> int: ...

    async def release_turn(self, what: str, pod: str, owner: str) -> None: ...

    async def take_turn(self, what: str, pod: str, owner: str, interval_s: float) -> bool: ...

    # the replicas' membership
    async def replicas(self, owner: str, lease_s: float) -> list[str]: ...
