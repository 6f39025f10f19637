"""KV-cache checkpoint events: a session's cache committed, failed or restored."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from shared.contract.base import (
    CheckpointId,
    Event,
    NodeName,
    OptCheckpointId,
    OptDeploymentName,
    OptDrainId,
    OptModelVersion,
    OptNamespace,
    OptNodeName,
    OptPodName,
    OptTakeId,
    PodName,
    SessionId,
)
from shared.contract.node import SessionFailure

PERIODIC_REASON = "periodic"
"""The reason of the checkpoint service's periodic saves (``SaveSessions.reason``): a pod whose KV journal keeps its
sessions' full blocks leaves their tail blocks out of these (``shared.kv.journal.journal_covers``)."""


class CheckpointSaved(Event, frozen=True, kw_only=True, tag="checkpoint.saved"):
    """A session's checkpoint is committed: its manifest is visible and every chunk digest was verified."""

    family: ClassVar[str] = "checkpoint"

    session_id: SessionId
    checkpoint_id: CheckpointId
    node: OptNodeName = ""
    pod: OptPodName = ""
    deployment: OptDeploymentName = ""
    bytes_total: int = 0
    bytes_written: int = 0
    chunks: int = 0
    duration_s: float = 0.0
    drain_id: OptDrainId = ""


class CheckpointFailed(Event, frozen=True, kw_only=True, tag="checkpoint.failed"):
    family: ClassVar[str] = "checkpoint"

    session_id: SessionId
    reason: str
    node: OptNodeName = ""
    pod: OptPodName = ""
    drain_id: OptDrainId = ""


class SessionRestored(Event, frozen=True, kw_only=True, tag="checkpoint.restored"):
    """A pod restored a session from ``checkpoint_id`` and holds it under ``generation``; ``fell_back_from``
    names each newer checkpoint it passed over and why (missing, unreadable, corrupt); ``from_store`` each
    checkpoint the registry had lost (a Redis failover) that the checkpoint service found in the store and
    recorded again: when ``checkpoint_id`` is one of them, only the store still knew the newest checkpoint."""

    family: ClassVar[str] = "checkpoint"

    session_id: SessionId
    checkpoint_id: CheckpointId
    node: OptNodeName = ""
    pod: OptPodName = ""
    bytes_total: int = 0
    duration_s: float = 0.0
    generation: int = 0
    fell_back_from: list[str] = msgspec.field(default_factory=list)
    from_store: list[CheckpointId] = msgspec.field(default_factory=list)
    tokens_recomputed: int | None = None
    """Tokens of the conversation after the checkpoint, which the engine computes again (a pod lost without a
    final save: what its journal or last checkpoint did not hold); None when the pod does not know the
    conversation's length."""


class CheckpointForgotten(Event, frozen=True, kw_only=True, tag="checkpoint.forgotten"):
    """The registry no longer names a checkpoint it had recorded: the checkpoint service's scrub found its files
    gone or damaged in the store. ``reason``: ``manifest`` (missing or unreadable), ``pack`` (a pack it references
    is missing or shorter than a block in it) or ``rot`` (a sampled block's bytes do not match its digest; a
    session's newest checkpoint is never forgotten for that, only marked). Nothing is deleted: only retention
    deletes files. ``newest``: it was the session's newest recorded checkpoint (restores now take the next one).
    ``pod``: the pod that holds the session, whose next save of it writes every block again (``SaveSessions.rewrite``);
    '' when no pod holds it."""

    family: ClassVar[str] = "checkpoint"

    session_id: SessionId
    checkpoint_id: CheckpointId
    reason: str
    detail: str = ""
    newest: bool = False
    pod: OptPodName = ""


class CommittedCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    session_id: SessionId
    checkpoint_id: CheckpointId
    bytes_total: int = 0
    bytes_written: int = 0
    chunks: int = 0
    token_count: int = 0
    generation: int = 0
    sequence: int = 0
    model_version: OptModelVersion = ""
    """The model version whose KV this is (the checkpoint restores only into it)."""


class SaveSessions(Event, frozen=True, kw_only=True, tag="checkpoint.save.command"):
    """A command to one pod's KV agent: save these sessions (all it holds when ``session_ids`` and
    ``generations`` are empty) and answer with a ``SaveSessionsReport`` before ``deadline_s``. Idempotent: saving
    twice costs only changes.

    ``generations``: the sessions to save with the generation the registry says this pod holds; a session the
    pod holds under another generation is refused (never saved: it moved)."""

    family: ClassVar[str] = "checkpoint"

    pod: PodName
    session_ids: list[SessionId] = msgspec.field(default_factory=list)
    drain_id: OptDrainId = ""
    deadline_s: float = 20.0
    reason: str = "drain"
    """Why it saves (``drain``, ``periodic``: ``PERIODIC_REASON``, ``prestop``, ...): said by the checkpoints it
    commits."""
    generations: dict[SessionId, int] = msgspec.field(default_factory=dict)
    changed_only: bool = False
    """Save only sessions with something new since their last checkpoint (periodic saves): a session whose
    blocks, tokens and generation are what its last checkpoint holds writes nothing and is counted as
    ``unchanged`` in the report."""
    rewrite: list[SessionId] = msgspec.field(default_factory=list)
    """Sessions whose save must write every block again, reusing nothing from their last checkpoint: the store
    lost or damaged a pack it references (the checkpoint service's scrub found it, or a record was refused for
    it). Saved even under ``changed_only``."""
    confirm_unchanged: bool = False
    """(With ``changed_only``) Name each session passed over in the report's ``kept``, with the last checkpoint that
    holds it, for the recorder to confirm: the pod's last save (its preStop hook) writes nothing a drain or a
    periodic save just committed, yet leaves nothing unrecorded whose first report was lost. Agents that predate
    it ignore it and save in full (what they always did)."""


class SaveSessionsReport(Event, frozen=True, kw_only=True, tag="checkpoint.save.report"):
    family: ClassVar[str] = "checkpoint"

    pod: PodName
    node: OptNodeName = ""
    store: str = ""
    committed: list[CommittedCheckpoint] = msgspec.field(default_factory=list)
    failed: list[SessionFailure] = msgspec.field(default_factory=list)
    not_held: list[SessionId] = msgspec.field(default_factory=list)
    """Sessions asked for that the pod does not hold (ended or preempted since): no KV of them on the pod."""
    unchanged: int = 0
    """Sessions a ``changed_only`` save passed over: their last checkpoint holds them as they are."""
    parts_recorded: int = 0
    """Earlier parts of this report the agent had recorded already (``record``), each one bounded in size, so
    that no message passes the bus's payload limit: the reply is the last part."""
    reason: str = ""
    """What saved: the command's reason, or ``journal`` for the KV journal's entries (``shared.kv.journal``),
    whose failures the checkpoint service publishes as ``checkpoint.failed`` (the session falls back to its
    periodic checkpoints)."""
    kept: list[CommittedCheckpoint] = msgspec.field(default_factory=list)
    """(``confirm_unchanged``) Sessions passed over, each with the last checkpoint that holds it as it is: nothing
    was written for them. Recording confirms each (a checkpoint recorded before changes nothing; one whose first
    report was lost is recorded now) and answers it here, or refuses it in ``failed`` when the pod no longer holds
    the session under that generation."""


class SaveProgress(Event, frozen=True, kw_only=True, tag="checkpoint.save.progress"):
    """A KV agent's progress through a save, after each committed round: what a drain is waiting for."""

    family: ClassVar[str] = "checkpoint"

    pod: PodName
    drain_id: OptDrainId = ""
    sessions_done: int = 0
    sessions_failed: int = 0
    sessions_total: int = 0
    bytes_done: int = 0


class AgentSessions(Event, frozen=True, kw_only=True, tag="checkpoint.agent.sessions"):
    """A KV agent's announcement of the sessions its pod holds (on change and periodically): the checkpoint
    service keeps the session registry in Redis from these."""

    family: ClassVar[str] = "checkpoint"

    pod: PodName
    node: NodeName
    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    sessions: list[SessionId] = msgspec.field(default_factory=list)
    bytes_held: int = 0
    generations: list[int] = msgspec.field(default_factory=list)
    """The generation the pod holds for each of ``sessions``, in the same order (empty: all 0)."""
    ttl_s: float = 0.0
    """How long the announcement stands: a pod silent for longer, and gone from the cluster, is forgotten."""
    ended: list[SessionId] = msgspec.field(default_factory=list)
    """Sessions the pod finished (the conversation is over) since its last announcement: their checkpoints are
    retired, if the pod still owned them."""
    full: bool = True
    """``sessions`` is every session the pod holds (what an announcement always was): the registry forgets the
    pod's others. False: a delta, what changed since announcement ``seq`` - 1 (``sessions`` placed or taken under
    a new generation, ``dropped`` no longer held, ``ended`` finished); nothing else is touched."""
    dropped: list[SessionId] = msgspec.field(default_factory=list)
    """(Deltas) Sessions the pod no longer holds (preempted, evicted by the engine), not ended."""
    incarnation: str = ""
    """Who is announcing: one id per start of the pod's agent. A delta from an incarnation the registry does not
    know, or with a gap in ``seq``, is answered ``resync``: the agent then announces in full."""
    seq: int = 0
    """The announcement's number within its incarnation (0: unnumbered, applied as it comes). A repeat of the
    last applied number (its answer was lost) is applied again, harmlessly; a heartbeat repeats it with no
    change."""
    part: int = 0
    parts: int = 1
    """A full announcement too long for one message comes in ``parts`` messages (``part`` 0 .. parts - 1) of the
    same ``seq``; the pod's other sessions are forgotten once the last part is in."""
    leaving: bool = False
    """The pod's agent stopped (its pod is going away): its sessions may be claimed by other pods at once."""
    monotonic: bool = False
    """The agent never numbers an announcement below one it sent before (a full announcement after a resync takes
    the number after the highest it sent): the registry then lets any announcement numbered below the last it
    applied change nothing (a late duplicate or a replay), answering ``resync``. Announcements of an incarnation
    a later one replaced change nothing either way."""


class AnnouncementAck(Event, frozen=True, kw_only=True, tag="checkpoint.agent.ack"):
    """The checkpoint service's answer to an announcement: applied (``seq``), or ``resync``: the registry does
    not have what the announcement builds on (a new incarnation, a gap, a registry that lost writes), so the
    agent announces in full next."""

    family: ClassVar[str] = "checkpoint"

    pod: PodName
    seq: int = 0
    resync: bool = False
    stale: list[SessionId] = msgspec.field(default_factory=list)
    """Sessions announced under a generation that moved on (another pod took them): the pod should drop them."""


class LocateCheckpoint(Event, frozen=True, kw_only=True, tag="checkpoint.locate"):
    """Where is this session's newest committed checkpoint? Asked by a new pod, or on a session's next request.

    With ``take_session`` the asking pod also takes the session, to start it or to restore it: the service hands
    out the session's next generation (in the answer), which from then on only that pod may save; without, the
    question changes nothing."""

    family: ClassVar[str] = "checkpoint"

    session_id: SessionId
    pod: OptPodName = ""
    node: OptNodeName = ""
    take_session: Annotated[
        bool,
        msgspec.Meta(description="the asking pod takes the session under its next generation (each take is a new one)"),
    ] = False
    claim: Annotated[
        bool, msgspec.Meta(description="take_session's former name, honoured the same; new senders leave it unset")
    ] = False
    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    take_id: OptTakeId = ""
    """Names this take (a fresh id each time a pod takes a session): the same take sent again (a retry after a
    lost answer, a duplicate, a replay) is answered with the generation it was given and changes nothing. Without
    it (an older agent) each take is a new generation."""
    prefetch: Annotated[
        bool,
        msgspec.Meta(
            description="asked ahead of a request (the router's prefetch): never take the session from a holder the "
            "cluster still lists, even one that is terminating"
        ),
    ] = False

    @property
    def takes_session(self) -> bool:
        """Whether the asking pod takes the session (``take_session``, or ``claim`` from an older agent)."""
        return self.take_session or self.claim


class CheckpointLocation(Event, frozen=True, kw_only=True, tag="checkpoint.location"):
    family: ClassVar[str] = "checkpoint"

    session_id: SessionId
    found: bool
    checkpoint_id: OptCheckpointId = ""
    store: str = ""
    bytes_total: int = 0
    generation: int = 0
    """The generation the asking pod now holds (it took the session), else 0."""
    candidates: list[CheckpointId] = msgspec.field(default_factory=list)
    """Committed checkpoints to restore from, newest first: the first good one is used."""
    refused: str = ""
    """Why the pod may not take the session (nothing was handed out): another pod that is alive holds the session
    (``holder``; route the session's requests there), or the session belongs to another deployment."""
    holder: OptPodName = ""
    from_store: list[CheckpointId] = msgspec.field(default_factory=list)
    """Those of ``candidates`` newer than every checkpoint the registry recorded: the registry had lost them (a
    Redis failover), the store holds them; verified and recorded again. The pod says so when it restores."""
    taken_from: OptPodName = ""
    """The pod that took the session's previous generation ('' when not known), and that generation: the only
    node-tier journal (``shared.kv.nodetier``) the asking pod may read the session's newest blocks from, on top of
    the checkpoint it restores."""
    taken_from_generation: int = 0
