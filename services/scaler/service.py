"""The scaler's wiring: the service the runner starts. It builds ``ScalerCore`` (``handlers.py``) over its
adapters (``adapters.py``), feeds it drain, utilisation and pod load events, serves it over gRPC
(``grpcserver.py``), exports its metrics (``gauges.py``) and spawns its loops."""

from __future__ import annotations

import logging
import time

from shared.contract.load import PodLoad
from shared.contract.metrics import DeploymentUtilisation
from shared.contract.models import RolloutState
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.host.runner import ServiceContext
from shared.plumbing.consumer import ConsumerSpec

from .adapters import JetStreamQueue, cluster_placement
from .config import ScalerSettings, load
from .gauges import ScalerCollector
from .grpcserver import ScalerServer
from .handlers import Clock, ScalerCore
from .ports import Placement

log = logging.getLogger(__name__)


class ScalerService:
    name = "scaler"
    config_names: tuple[str, ...] = ()

    def __init__(
        self, settings: ScalerSettings | None = None, placement: Placement | None = None, clock: Clock = time.time
    ) -> None:
        self.settings = settings or load()
        self._placement = placement
        self.clock = clock
        self.core: ScalerCore | None = None
        self.port = 0

    async def start(self, ctx: ServiceContext) -> None:
        s = ctx.subjects
        placement: Placement | None = self._placement
        if placement is None:
            try:
                placement, close_placement = await cluster_placement(ctx.backends)
                ctx.on_stop(close_placement)
            except Exception as exc:  # no cluster to read: the surge falls back as documented, the rest works
                log.warning("pod placement unavailable; drains surge without it", extra={"error": str(exc)})
                ctx.status["placement"] = f"unavailable: {exc}"
        core = self.core = ScalerCore(
            JetStreamQueue(ctx.bus), placement, ctx.publish, clock=self.clock, refresh_s=self.settings.refresh_s
        )
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("scaler", "drains"),
                filter_subjects=(
                    s.pattern("node.drain.requested"),
                    s.pattern("node.drain.completed"),
                    s.pattern("node.drain.failed"),
                ),
                accepts=(DrainRequested, DrainCompleted, DrainFailed),
                stream=s.events_stream,
            ),
            core.on_drain,
        )
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("scaler", "rollouts"),
                filter_subjects=(s.pattern("kv.rollout.state"),),
                accepts=(RolloutState,),
                stream=s.events_stream,
            ),
            core.on_rollout,
        )
        await ctx.bus.subscribe(
            s.pattern("metrics.deployment.utilisation"), core.on_utilisation, accepts=(DeploymentUtilisation,)
        )
        await ctx.bus.subscribe(s.pattern("kv.pod.load"), core.on_load, accepts=(PodLoad,))
        server = ScalerServer(core, self.settings, serving=lambda: ctx.bus.connected)
        ctx.on_stop(core.close)
        self.port = await server.start()
        ctx.on_stop(lambda: server.stop(grace=1.0))
        ctx.spawn(core.refresh_loop, "scaler-refresh")
        ctx.spawn(core.publish_loop, "scaler-publish")
        if placement is not None:
            ctx.spawn(core.placement_loop, "scaler-placement")
        ctx.status["drains_in_flight"] = core.drains_in_flight
        ctx.status["rollouts_preparing"] = lambda: {"/".join(k): v[0] for k, v in core.rollouts.items()}
        ctx.status["grpc"] = f"{self.settings.host}:{self.port}"
        ctx.status["scaled_objects"] = core.status
        ctx.status["following"] = core.following
        ctx.telemetry.registry.register(ScalerCollector(core))
