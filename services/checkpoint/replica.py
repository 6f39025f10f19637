"""One replica of the checkpoint service, as every part of it sees it: its id (``owner``: its drain leases,
turns and membership are taken under it), its settings, its ports and metrics, the ``checkpoint`` document in
force, and the one way a change of where a session is reaches the routers (``publish_locations``).

Parts read the store and the settings here at the moment they act, so a store or settings handed to the service
after it started (tests wrap the store) reach all of them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.contract.configdocs import CheckpointPolicy
from shared.contract.sessions import SessionLocation
from shared.host.runner import ServiceContext
from shared.kv.store import StoreError

from .config import CheckpointSettings
from .metrics import CheckpointMetrics
from .ports import Cluster, Leases, Registry, Store

log = logging.getLogger(__name__)

PROVISIONED_KEPT = 100_000
"""Pods a replica remembers having made a bucket for (a pod forgotten is made sure of again: one request)."""


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
    provisioned: dict[str, None] = field(default_factory=dict)
    """Pods whose bucket this replica made sure of, oldest first (at most ``PROVISIONED_KEPT``)."""

    def policy(self) -> CheckpointPolicy:
        current = self.ctx.config.current("checkpoint")
        return current.doc if current and isinstance(current.doc, CheckpointPolicy) else CheckpointPolicy()

    async def provision(self, pod: str) -> None:
        """Make sure ``pod`` has its bucket, where the store keeps one per pod (``nats://<bucket>``: pods may not
        create streams, see ``PodBuckets.provision``): once per pod and replica, when the pod is first heard, so the
        cost follows new pods, not announcements. A store that cannot make it now is logged and asked again at the
        pod's next announcement; the pod's saves fail meanwhile, and its sessions' last checkpoints stand."""
        make = getattr(self.store, "provision", None)
        if make is None or pod in self.provisioned:
            return
        try:
            await make(pod)
        except StoreError as exc:
            log.warning("pod's checkpoint bucket not made; asked again", extra={"pod": pod, "error": str(exc)})
            return
        self.provisioned[pod] = None
        while len(self.provisioned) > PROVISIONED_KEPT:
            del self.provisioned[next(iter(self.provisioned))]

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
