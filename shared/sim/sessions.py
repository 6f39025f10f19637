"""What the simulated workload keeps per session: when one ends (``is_close``), what a preempted one is recomputed
to (``Preempted``), one request of a session at a time (``SessionLocks``), and the workload's counters
(``WorkloadStats``) with the time to first token its requests waited (``FirstTokens``)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from shared.contract.requests import InferenceRequest
from shared.kv.engines import SessionCheck

log = logging.getLogger(__name__)

LOST_SESSIONS_KEPT = 100  # the newest lost session ids kept for status; the count has them all
SESSION_IDLE_S = 300.0
RETIRED_KEPT = 10_000


def is_close(request: InferenceRequest) -> bool:
    """A request with neither prompt nor new tokens closes its session."""
    return request.prompt_tokens == 0 and request.max_new_tokens == 0


@dataclass(frozen=True)
class Preempted:
    """A session that lost its blocks to preemption: ``tokens`` is what it is recomputed to, ``pod`` where, on
    model ``version``."""

    tokens: int
    pod: str
    version: str = ""


@dataclass
class _SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class SessionLocks:
    """One request of a session at a time; a session's lock exists only while a request holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, _SessionLock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(session_id, _SessionLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[session_id]

    def __contains__(self, session_id: object) -> bool:
        """Whether a request of the session runs or waits."""
        return session_id in self._locks

    def __len__(self) -> int:
        return len(self._locks)


FIRST_TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
"""Upper bounds of ``FirstTokens``' buckets (the last bucket has none)."""


@dataclass
class FirstTokens:
    """The time to first token of every request served, as its user waits for it: from the request's making to
    its first token (the bus, the router's pick and a handover wait, a restore on demand, the engine). Counted in
    fixed buckets (``FIRST_TOKEN_BUCKETS_S``), apart for a session's first request on a pod other than the one that
    served it last (``moved``: a drain, an upgrade, a scale-in, a kill moved it) and for every other request
    (``stayed``); buckets, so that a run's figure is the difference of two readings (``quantile``)."""

    moved: list[int] = field(default_factory=lambda: [0] * (len(FIRST_TOKEN_BUCKETS_S) + 1))
    stayed: list[int] = field(default_factory=lambda: [0] * (len(FIRST_TOKEN_BUCKETS_S) + 1))

    def add(self, moved: bool, seconds: float) -> None:
        (self.moved if moved else self.stayed)[bisect.bisect_left(FIRST_TOKEN_BUCKETS_S, seconds)] += 1

    def as_status(self) -> dict[str, Any]:
        return {"buckets_s": list(FIRST_TOKEN_BUCKETS_S), "moved": list(self.moved), "stayed": list(self.stayed)}


def quantile(counts: list[int], q: float) -> float | None:
    """The ``q`` quantile of ``FirstTokens`` bucket counts, interpolated within its bucket (as Prometheus'
    ``histogram_quantile`` does; the open last bucket answers its lower bound); None when nothing was counted."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            if index >= len(FIRST_TOKEN_BUCKETS_S):
                return FIRST_TOKEN_BUCKETS_S[-1]
            low = FIRST_TOKEN_BUCKETS_S[index - 1] if index else 0.0
            return low + (FIRST_TOKEN_BUCKETS_S[index] - low) * (rank - seen) / count
        seen += count
    return FIRST_TOKEN_BUCKETS_S[-1]


@dataclass
class WorkloadStats:
    requests: int = 0
    served: int = 0
    restored: int = 0
    prefetched: int = 0
    """Sessions brought onto a pod by the router's prefetch, ahead of their next request (restored or started)."""
    started_fresh: int = 0
    recomputed: int = 0
    preemptions: int = 0
    ended: int = 0
    ended_at_max_len: int = 0
    expired: int = 0
    lost: int = 0
    """Sessions that could not go on: their context is gone (no checkpoint, no tokens to recompute it from)."""
    pods_killed: int = 0
    continued_after_kill: int = 0
    """Sessions of killed pods (no preStop) that went on, from a checkpoint or journal entry or recomputed."""
    tokens_recomputed_after_kill: int = 0
    """Positions those sessions computed again: what the kills cost."""
    node_tier_blocks: int = 0
    """Blocks restores took from the node tier's journal (``shared.kv.nodetier``) on top of a checkpoint."""
    prestop_saves: int = 0
    restore_verified: int = 0
    restore_check_failed: int = 0
    restore_unchecked: int = 0
    ended_by_rollout: int = 0
    refused_retired: int = 0
    restore_refused_version: int = 0
    mixed_versions: int = 0
    served_by_version: dict[str, int] = field(default_factory=dict)
    lost_sessions: deque[str] = field(default_factory=lambda: deque(maxlen=LOST_SESSIONS_KEPT))
    first_tokens: FirstTokens = field(default_factory=FirstTokens)

    def count_check(self, session_id: str, check: SessionCheck, checkpoint_id: str) -> None:
        """A restored session's check against its reference run; one that differs is logged as an error."""
        if check.verified is True:
            self.restore_verified += 1
        elif check.verified is None:
            self.restore_unchecked += 1
        else:
            self.restore_check_failed += 1
            log.error(
                "restored session differs from its reference run",
                extra={"session": session_id, "checkpoint": checkpoint_id, "detail": check.detail},
            )

    def as_status(self) -> dict[str, Any]:
        """The counters as ``/healthz`` and ``gpuwarden status`` show them (``SimWorkload.status``)."""
        return {
            "requests": self.requests,
            "served": self.served,
            "restored": self.restored,
            "prefetched": self.prefetched,
            "started_fresh": self.started_fresh,
            "recomputed": self.recomputed,
            "preemptions": self.preemptions,
            "ended": self.ended,
            "ended_at_max_len": self.ended_at_max_len,
            "expired": self.expired,
            "lost": self.lost,
            "lost_sessions": list(self.lost_sessions),
            "pods_killed": self.pods_killed,
            "continued_after_kill": self.continued_after_kill,
            "tokens_recomputed_after_kill": self.tokens_recomputed_after_kill,
            "node_tier_blocks": self.node_tier_blocks,
            "prestop_saves": self.prestop_saves,
            "restore_checks": {
                "verified": self.restore_verified,
                "failed": self.restore_check_failed,
                "unchecked": self.restore_unchecked,
            },
            "first_token": self.first_tokens.as_status(),
        }

    def rollouts(self) -> dict[str, Any]:
        """What model rollouts did to the sessions."""
        return {
            "ended_by_rollout": self.ended_by_rollout,
            "refused_retired": self.refused_retired,
            "restore_refused_version": self.restore_refused_version,
            "mixed_versions": self.mixed_versions,
            "served_by_version": dict(self.served_by_version),
        }
