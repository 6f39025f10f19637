"""Node and drain events: the start and the verdict of every drain (ARCHITECTURE.md, "The drain, end to end")."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import msgspec

from shared.contract.base import DrainId, Event, NodeName, OptNodeName, OptPodName, SessionId


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


def deadline_problem(deadline_s: float, grace_period_s: float = 30.0) -> str:
    """Why a drain with this deadline cannot run (empty when it can): the savers need some time, and must be done
    before the pods' grace period runs out. The checkpoint service refuses such a request with its failed
    verdict; a sender (the CLI) checks first and sends nothing."""
    if not math.isfinite(deadline_s) or deadline_s <= 0:
        return f"deadline_s={deadline_s:g}: the savers need a positive number of seconds"
    if deadline_s > grace_period_s:
        return (
            f"deadline_s={deadline_s:g} is beyond the pods' grace period (grace_period_s={grace_period_s:g}): "
            "saving must be done before they are killed"
        )
    return ""


class SessionFailure(msgspec.Struct, frozen=True, kw_only=True):
    session_id: SessionId
    pod: OptPodName = ""
    reason: str


DrainOutcome = Literal["completed", "failed"]
"""What a drain's verdict says, in one word (``DrainCompleted.outcome``, ``DrainFailed.outcome``): where a
verdict is stored, counted or shown by its outcome."""


class DrainCompleted(Event, frozen=True, kw_only=True, tag="node.drain.completed"):
    """Every session on the node is committed to a checkpoint; evicting its pods loses nothing."""

    family: ClassVar[str] = "node"
    outcome: ClassVar[DrainOutcome] = "completed"

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
    outcome: ClassVar[DrainOutcome] = "failed"

    node: NodeName
    drain_id: DrainId
    reason: str
    failed_sessions: list[SessionFailure] = msgspec.field(default_factory=list)
    sessions_committed: int = 0
    failed_total: int = 0
    failed_ref: str = ""


DrainVerdict = DrainCompleted | DrainFailed
"""A drain's verdict: the checkpoint service decides one per drain id, records it (the drain's record, asked for
with ``node.drain.query``) and publishes it (``node.drain.completed`` / ``node.drain.failed``, which only wake
whoever waits: they ask the record)."""


class DrainQuery(Event, frozen=True, kw_only=True, tag="node.drain.query"):
    """What became of drain ``drain_id``, asked of the checkpoint service, which records every drain's one
    verdict (its registry's ``kv:drain:<id>``): whoever waits on a drain asks it (the drain client's
    ``RecordReader``) instead of keeping a copy of its own. ``node``, when the asker knows it: the drain's node, whose
    newest verdict in the events stream answers for a record Redis lost in a failover."""

    family: ClassVar[str] = "node"

    drain_id: DrainId
    node: OptNodeName = ""


class DrainRecord(Event, frozen=True, kw_only=True, tag="node.drain.state"):
    """The answer to ``node.drain.query``: the drain's record as the checkpoint service keeps it, its verdict or
    None while it has none (running, not yet asked, or unknown to the checkpoint service). The kind keeps its
    first name, ``node.drain.state``, for the wire's sake."""

    family: ClassVar[str] = "node"

    drain_id: DrainId
    verdict: DrainVerdict | None = None


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
