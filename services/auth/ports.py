"""What the auth callout needs from the outside world, as Protocols: the cluster's TokenReview (the cluster port
has it; the Kubernetes API, or the SIMULATED cluster, stands behind it)."""

from __future__ import annotations

from typing import Protocol

from shared.ports.cluster import TokenReview


class TokenReviewer(Protocol):
    async def review_token(self, token: str, audiences: tuple[str, ...]) -> TokenReview:
        """Whether ``token`` is genuine, unexpired and meant for one of ``audiences``, and whose it is."""
        ...
