"""One replica of the checkpoint service, as every part of it sees it: its id (``owner``: its drain leases,
turns and membership are taken under it), its settings, its ports and metrics, the ``checkpoint`` document in
force, and the one way a change of where a session is reaches the routers (``publish_locations``).

Parts read the store and the settings here at the moment they act, so a store or settings handed to the service
after it started (tests wrap the store) reach all of them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from shared.contract.configdocs import CheckpointPolicy
from shared.contract.sessions import SessionLocation
from shared.host.runner import ServiceContext

from .config import CheckpointSettings
from .metrics import CheckpointMetrics
from .ports import Cluster, Leases, Registry, Store

log = logging.getLogger(__name__)


@dataclass
class Replica:
    ctx: ServiceContext
    settings: CheckpointSettings
    store: Store
    registry: Registry
    leases: Leases
    cluster: Cluster
    metrics: CheckpointMetrics
    owner: str

    def policy(self) -> CheckpointPolicy:
        current = self.ctx.config.current("checkpoint")
        return current.doc if current and isinstance(current.doc, CheckpointPolicy) else CheckpointPolicy()

    async def publish_locations(self, locations: Sequence[SessionLocation]) -> None:
        """Publish what the registry changed. Never fails the change itself (it is recorded): a location not
        published is counted and logged, and ``where`` still answers it."""
        if not locations:
            return
        try:
            await self.ctx.bus.publish_many(locations)
        except Exception as exc:
            self.metrics.locations.labels("lost").inc(len(locations))
            log.warning(
                "session locations not published; routers must ask where",
                extra={"sessions": [loc.session_id for loc in locations[:20]], "error": str(exc)},
            )
            return
        self.metrics.locations.labels("published").inc(len(locations))
