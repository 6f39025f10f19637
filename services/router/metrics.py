"""The router's metrics (docs/observability.md lists them): where the requests it picked for were sent."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from .picker import Outcome, Pick

LANDED = ("holder", "prefetched", "cold", "new", "no_session", "refused_session", "unavailable")
"""Where a request was sent: to its session's holder (``prefetched``: the first request of a session a prefetch
brought there), to a pod that restores it on demand (``cold``: its holder left and no prefetch brought it), to any
pod for a session never heard of (``new``), balanced without a session (``no_session``, ``refused_session``), or
answered 503/429 (``unavailable``)."""


def landed_of(pick: Pick, prefetched: bool) -> str:
    if pick.status != 200:
        return "unavailable"
    if pick.outcome is Outcome.HOLDER:
        return "prefetched" if prefetched else "holder"
    return {
        Outcome.HOLDER_GONE: "cold",
        Outcome.UNPLACED: "cold",
        Outcome.UNKNOWN_SESSION: "new",
        Outcome.NO_SESSION: "no_session",
    }.get(pick.outcome, "refused_session")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None, deployment: str) -> None:
        self.deployment = deployment
        self.counts = dict.fromkeys(LANDED, 0)
        self.requests = (
            Counter(
                "gpuwarden_router_requests_total",
                "Requests the router picked for, by deployment and where they were sent (landed: holder, prefetched,"
                " cold, new, no_session, refused_session, unavailable)",
                ["deployment", "landed"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def landed(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.requests is not None:
            self.requests.labels(self.deployment, kind).inc()
