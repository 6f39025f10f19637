"""What the metrics service needs from the outside world besides its source (``shared.ports.metrics``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from shared.contract.metrics import UtilisationRecord


class UtilisationStore(Protocol):
    """Where the aggregates are kept for the scaler (Redis)."""

    async def put(self, records: Sequence[UtilisationRecord], ttl_s: float) -> None: ...

    async def close(self) -> None: ...


class PodOwners(Protocol):
    """Which deployment each pod belongs to, as the cluster says; refreshed by the service each interval."""

    async def owners(self) -> Mapping[tuple[str, str], str]: ...

    async def close(self) -> None: ...
