"""Where each session's KV cache lives, for routers: one event per change of a session's location, and the
question "which pod holds session S now?".

A KV-aware router (a gateway's endpoint picker keeping a conversation on the pod that has its cache) follows
``kv.session.location`` events, or asks with ``kv.session.where`` when it has no answer yet. Where engines'
own KV events (vLLM's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) describe blocks of one pod,
these describe whole sessions across pods: gpuwarden moves sessions between pods, engines do not.

Order: ``sequence`` strictly increases over every change of one session, in the order the registry applied
them, whatever order events arrive in; a router keeps, per session, the location with the highest sequence
(``supersedes``) and drops the rest. ``generation`` is the ownership fence the holder took (it never falls
along a session's sequence), not an order of events: saves and drops happen within one generation.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from shared.contract.base import (
    Event,
    OptCheckpointId,
    OptDeploymentName,
    OptModelVersion,
    OptNamespace,
    OptNodeName,
    OptPodName,
    PodName,
    SessionId,
)

LOCATION_REASONS: dict[str, str] = {
    "placed": "a pod took the session (started it, or claimed it to restore it), or announced it unplaced",
    "restored": "the pod that holds the session restored it from ``checkpoint_id``",
    "saved": "the pod that holds the session committed checkpoint ``checkpoint_id``",
    "dropped": "the pod no longer holds the session's KV (preempted or evicted by the engine); not ended",
    "forgotten": "the pod is gone (silent and no longer in the cluster): nothing holds the session now",
    "ended": "the conversation is over: its checkpoints are retired",
    "unknown": "(answers only) the registry knows nothing of the session",
}
"""Why a location changed (``SessionLocation.reason``); an answer to ``kv.session.where`` repeats the reason
of the last change. Consumers must accept reasons they do not know (evolution is additive)."""


class SessionLocation(Event, frozen=True, kw_only=True, tag="kv.session.location"):
    """Where a session's KV cache is, after the change ``reason`` names (published once per change by the
    checkpoint service, from the registry's own record of it), or now (the answer to ``kv.session.where``).

    ``held``: a pod holds the KV now: route the session's requests to ``pod``. Otherwise no pod holds it:
    any pod of ``namespace``/``deployment`` may take it, restoring ``checkpoint_id`` when there is one.
    ``previous_pod``: the pod that held it before this change, when that was another one (forget it there)."""

    family: ClassVar[str] = "kv"

    session_id: SessionId
    sequence: int
    """Strictly increasing per session over every change (microseconds of the registry's clock where that is
    larger, so it keeps increasing across a registry that lost its data); 0 for a session never seen."""
    reason: str
    held: bool
    pod: OptPodName = ""
    node: OptNodeName = ""
    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    generation: int = 0
    """The session's newest generation handed out: the holder's ownership fence."""
    token_count: int = 0
    """Tokens in ``checkpoint_id``."""
    checkpoint_id: OptCheckpointId = ""
    """The checkpoint this change is about (saved, restored from), else the session's newest committed one."""
    previous_pod: OptPodName = ""
    model_version: OptModelVersion = ""
    """The model version of ``checkpoint_id`` (it restores only into a pod holding that version); '' when there is
    no checkpoint or it did not say."""

    def supersedes(self, other: SessionLocation) -> bool:
        """Whether this location is newer than ``other`` (of the same session): the one rule a router needs."""
        return self.sequence > other.sequence


class WhereIsSession(Event, frozen=True, kw_only=True, tag="kv.session.where"):
    """Which pod holds this session's KV cache now? Answered with a ``kv.session.location`` (``held`` false
    and ``reason`` ``"unknown"`` for a session the registry never saw)."""

    family: ClassVar[str] = "kv"

    session_id: SessionId


class PrefetchSessions(Event, frozen=True, kw_only=True, tag="kv.session.prefetch.command"):
    """A command to one pod's KV agent, from the router: restore these sessions now, ahead of their next request
    (their holder is leaving: drained, scaled in, replaced), through the pod's own restore path, taking each only
    from a holder the cluster no longer lists. Answered ``SessionsPrefetched`` before ``deadline_s``. Idempotent:
    a session the pod already holds is answered held."""

    family: ClassVar[str] = "kv"

    pod: PodName
    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    session_ids: Annotated[list[SessionId], msgspec.Meta(max_length=1000)]
    deadline_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 30.0


class SessionsPrefetched(Event, frozen=True, kw_only=True, tag="kv.session.prefetched"):
    """A KV agent's answer to ``PrefetchSessions``: the sessions it restored (or started: no checkpoint), those it
    held already, those another pod still holds (``held_elsewhere``: asked again later), and those that failed,
    with the reason."""

    family: ClassVar[str] = "kv"

    pod: PodName
    restored: list[SessionId] = msgspec.field(default_factory=list)
    held: list[SessionId] = msgspec.field(default_factory=list)
    held_elsewhere: list[SessionId] = msgspec.field(default_factory=list)
    failed: dict[str, str] = msgspec.field(default_factory=dict)


class SessionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One session as the registry places it, with its newest committed checkpoint (one row of a page)."""

    session_id: SessionId
    pod: OptPodName = ""
    node: OptNodeName = ""
    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    generation: int = 0
    checkpoint_id: OptCheckpointId = ""
    checkpoint_at: float | None = None
    """When the newest checkpoint was recorded (seconds since the epoch); None when there is none."""
    bytes: int = 0
    tokens: int = 0


class SessionsQuery(Event, frozen=True, kw_only=True, tag="kv.sessions.query"):
    """A page of the sessions a node, a pod or a deployment holds (all sessions when none is named), asked of the
    checkpoint service. What it costs follows the page and the filter, never the fleet: ``cursor`` continues
    where the last page ended ('' for the first)."""

    family: ClassVar[str] = "kv"

    node: OptNodeName = ""
    pod: OptPodName = ""
    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    cursor: str = ""
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 200


class SessionsPage(Event, frozen=True, kw_only=True, tag="kv.sessions.page"):
    """The answer to ``kv.sessions.query``: ``sessions`` in no particular order, and ``next_cursor`` ('' when this
    was the last page). ``total``: how many sessions match, when the registry knows it without counting."""

    family: ClassVar[str] = "kv"

    sessions: list[SessionRecord] = msgspec.field(default_factory=list)
    next_cursor: str = ""
    total: int | None = None


class FleetQuery(Event, frozen=True, kw_only=True, tag="kv.fleet.query"):
    """How many sessions each node, pod and deployment holds: asked of the checkpoint service."""

    family: ClassVar[str] = "kv"


class FleetSummary(Event, frozen=True, kw_only=True, tag="kv.fleet.summary"):
    """Session counts per node, pod and deployment (``namespace/name``), from per-pod indexes: its cost follows
    the number of pods, never the number of sessions. ``pods`` maps every pod the registry knows to its node;
    ``alive`` lists those whose lease stands."""

    family: ClassVar[str] = "kv"

    sessions_total: int = 0
    by_node: dict[str, int] = msgspec.field(default_factory=dict)
    by_pod: dict[str, int] = msgspec.field(default_factory=dict)
    by_deployment: dict[str, int] = msgspec.field(default_factory=dict)
    pods: dict[str, str] = msgspec.field(default_factory=dict)
    alive: list[str] = msgspec.field(default_factory=list)
