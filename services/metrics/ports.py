"""What the metrics service needs from the outside world besides its source (``shared.ports.metrics``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.contract.metrics import UtilisationRecord
from shared.ports.pods import PodOwners

__all__ = ["PodOwners", "UtilisationStore"]


class UtilisationStore(Protocol):
    """Where the aggregates are kept for the scaler (Redis)."""

    async def put(self, records: Sequence[UtilisationRecord], ttl_s: float) -> None: ...

    async def close(self) -> None: ...
