"""The router's wiring: the service the runner starts. It builds ``EndpointPicker`` (``picker.py``), feeds it session
locations and pod loads from the bus and the pool's pods from the cluster port (``adapters.py``), and serves it to
the gateway over Envoy ext_proc (``extproc.py``).

Start order: the subscriptions first, then the read-back of the newest location per session, then the pods, then
the gRPC server: a router that answers already knows what was stored before it started and hears every change
since (an event heard live and read back too is kept once: the newest sequence wins).
"""

from __future__ import annotations

import logging
import time

from shared.contract.load import PodLoad
from shared.contract.sessions import PrefetchSessions, SessionLocation
from shared.host.runner import ServiceContext

from .adapters import LocationReader, PodFollower, follow_reconnects
from .config import RouterSettings, load
from .deletioncost import DeletionCosts
from .extproc import Clock, ExternalProcessorServicer, RouterServer
from .handover import Handovers
from .metrics import RouterMetrics
from .picker import EndpointPicker
from .prefetch import Prefetcher

log = logging.getLogger(__name__)


class RouterService:
    name = "router"
    config_names: tuple[str, ...] = ()

    def __init__(self, settings: RouterSettings | None = None, clock: Clock = time.time) -> None:
        self.settings = settings or load()
        self.clock = clock
        self.picker: EndpointPicker | None = None
        self.servicer: ExternalProcessorServicer | None = None
        self.handovers: Handovers | None = None
        self.prefetcher: Prefetcher | None = None
        self.pods_follower: PodFollower | None = None
        self.metrics: RouterMetrics | None = None
        self.port = 0

    async def start(self, ctx: ServiceContext) -> None:
        settings, s = self.settings, ctx.subjects
        picker = self.picker = EndpointPicker(
            settings.namespace,
            settings.deployment,
            target_port=settings.target_port,
            fallbacks=settings.fallbacks,
            shed_at=settings.shed_at,
            load_stale_s=settings.load_stale_s,
            max_sessions=settings.max_sessions,
            first_pick_s=settings.handover_wait_s,
        )
        handovers = self.handovers = Handovers(settings.handover_wait_s)

        async def on_location(event: SessionLocation) -> None:
            """Idempotent: an older or repeated location changes nothing (``EndpointPicker.on_location``); a newer
            one naming a holder ends the session's handover (its waiting requests pick again); one that names none
            (dropped, forgotten by the pod leaving) does not: the handover waits for the new holder."""
            if picker.on_location(event) and event.held:  # a new holder: the handover is over
                handovers.on_location(event.session_id)

        async def on_load(event: PodLoad) -> None:
            """Idempotent: the newest report of a pod replaces the last."""
            picker.on_load(event, self.clock())

        await ctx.bus.subscribe(s.pattern("kv.session.location"), on_location, accepts=(SessionLocation,))
        namespace = settings.namespace.replace(".", "_")
        await ctx.bus.subscribe(s.pattern("kv.pod.load"), on_load, accepts=(PodLoad,), name=f"router-load-{namespace}")
        reader = LocationReader(ctx.bus, picker)
        read = await reader.read_newest()
        log.info("newest session locations read", extra={"sessions": read, "refused": reader.refused})
        ctx.spawn(lambda: follow_reconnects(ctx.bus, reader.read_newest), "router-reread")

        async def ask(command: PrefetchSessions, timeout: float) -> object:
            return await ctx.bus.request(s.for_event(command), command, timeout)

        prefetcher = self.prefetcher = Prefetcher(
            picker, handovers, ask, settings.prefetch_s, self.clock, max_sessions=settings.max_sessions
        )
        ctx.on_stop(prefetcher.close)
        metrics = self.metrics = RouterMetrics(ctx.telemetry.registry, settings.deployment)
        cluster = await ctx.backends.cluster(watch_kinds=("pod", "node"))
        ctx.on_stop(cluster.close)
        pods = self.pods_follower = PodFollower(cluster, picker, settings.pods_resync_s, prefetcher, self.clock)
        try:
            await pods.list_once()
        except Exception as exc:  # the listing loop tries again; until then no endpoint can serve (503)
            log.warning("pods not listed yet", extra={"error": str(exc)})
        ctx.spawn(pods.watch, "router-pod-watch")
        ctx.spawn(pods.relist, "router-pod-list")
        if settings.deletion_cost_s > 0:
            deletion_costs = DeletionCosts(cluster, picker, settings.deletion_cost_s)
            ctx.spawn(deletion_costs.run, "router-deletion-cost")
            ctx.status["deletion_cost"] = deletion_costs.status

        servicer = self.servicer = ExternalProcessorServicer(
            picker, settings, self.clock, handovers, prefetcher, metrics
        )
        server = RouterServer(servicer, settings, serving=lambda: ctx.bus.connected)
        self.port = await server.start()
        ctx.on_stop(lambda: server.stop(grace=1.0))
        ctx.status["grpc"] = f"{settings.listen.host}:{self.port}"
        ctx.status["routing"] = picker.status
        ctx.status["handovers"] = handovers.status
        ctx.status["prefetch"] = prefetcher.status
        ctx.status["landed"] = lambda: {settings.pool: dict(metrics.counts)}
        ctx.status["locations_read_back"] = lambda: reader.read
        ctx.status["streams_refused"] = lambda: servicer.refused_streams
        ctx.status["pod_listings"] = lambda: pods.listings
