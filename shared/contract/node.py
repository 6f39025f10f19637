"""Node and drain events: the start and the verdict of every drain (ARCHITECTURE.md, "The drain, end to end")."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from shared.contract.base import DrainId, Event, NodeName, OptPodName, SessionId


class DrainRequested(Event, frozen=True, kw_only=True, tag="node.drain.requested"):
    """Someone wants node ``node`` emptied: save every KV cache there before any pod is evicted.

    Published by the driver service before an upgrade, or by any other system (an autoscaler, an admin).
    ``drain_id`` names the drain: duplicates and late copies of the same drain change nothing.
    ``deadline_s`` is how long the savers have; it must be shorter than the pods' grace period.
    """

    family: ClassVar[str] = "node"

    node: NodeName
    drain_id: DrainId
    reason: str = "maintenance"
    requested_by: str = ""
    deadline_s: float = msgspec.field(default=25.0)
    grace_period_s: float = 30.0


class SessionFailure(msgspec.Struct, frozen=True, kw_only=True):
    session_id: SessionId
    pod: OptPodName = ""
    reason: str


class DrainCompleted(Event, frozen=True, kw_only=True, tag="node.drain.completed"):
    """Every session on the node is committed to a checkpoint; evicting its pods loses nothing."""

    family: ClassVar[str] = "node"

    node: NodeName
    drain_id: DrainId
    sessions_committed: int = 0
    bytes_saved: int = 0
    duration_s: float = 0.0


class DrainFailed(Event, frozen=True, kw_only=True, tag="node.drain.failed"):
    """Some sessions could not be saved by the deadline; ``failed_sessions`` names each one and why, up to a
    limit: ``failed_total`` counts them all, and when there are more than fit, ``failed_ref`` says where the whole
    list is kept (a Redis list of JSON ``SessionFailure`` records)."""

    family: ClassVar[str] = "node"

    node: NodeName
    drain_id: DrainId
    reason: str
    failed_sessions: list[SessionFailure] = msgspec.field(default_factory=list)
    sessions_committed: int = 0
    failed_total: int = 0
    failed_ref: str = ""


class NodeCordoned(Event, frozen=True, kw_only=True, tag="node.cordoned"):
    family: ClassVar[str] = "node"

    node: NodeName
    by: str = ""
    reason: str = ""


class NodeUncordoned(Event, frozen=True, kw_only=True, tag="node.uncordoned"):
    family: ClassVar[str] = "node"

    node: NodeName
    by: str = ""
    reason: str = ""
