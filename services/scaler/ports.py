"""What the scaler needs from the outside world, as Protocols; adapters live in ``adapters.py``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol


class RequestQueue(Protocol):
    """A deployment's inference request queue in JetStream."""

    async def depth(self, namespace: str, deployment: str) -> int:
        """Requests waiting or in progress: ``num_pending + num_ack_pending`` of the serving consumer, answered
        by the JetStream API (the consumer's leader), never a monitoring endpoint. Raises on failure."""
        ...

    async def on_arrival(
        self, namespace: str, deployment: str, callback: Callable[[], None]
    ) -> Callable[[], Awaitable[None]]:
        """Call ``callback`` as soon as a request is published to the queue; returns the unsubscribe."""
        ...


class Placement(Protocol):
    """Where a deployment's pods run: pods (Running or Pending, not Terminating) per node."""

    async def pods_by_node(self, namespace: str, deployment: str) -> Mapping[str, int]: ...
