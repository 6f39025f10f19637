"""What the scaler decides. So far: it tracks drains in flight and deployment utilisation; the gRPC scaler and
the replica formula come with the scaler issue."""

from __future__ import annotations

from shared.contract.metrics import DeploymentUtilisation
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.plumbing.bus import ConsumerSpec
from shared.plumbing.runner import ServiceContext

from .config import ScalerSettings, load


class ScalerService:
    name = "scaler"
    config_names: tuple[str, ...] = ()

    def __init__(self, settings: ScalerSettings | None = None) -> None:
        self.settings = settings or load()
        self.drains_in_flight: dict[str, str] = {}
        self.utilisation: dict[str, float] = {}

    async def start(self, ctx: ServiceContext) -> None:
        s = ctx.subjects
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
            self.on_drain,
        )
        await ctx.bus.subscribe(
            s.pattern("metrics.deployment.utilisation"), self.on_utilisation, accepts=(DeploymentUtilisation,)
        )
        ctx.status["drains_in_flight"] = self.drains_in_flight

    async def on_drain(self, event: DrainRequested | DrainCompleted | DrainFailed) -> None:
        """Idempotent: a drain is in flight from its request until its verdict, keyed by drain id."""
        match event:
            case DrainRequested():
                self.drains_in_flight[event.drain_id] = event.node
            case DrainCompleted() | DrainFailed():
                self.drains_in_flight.pop(event.drain_id, None)

    async def on_utilisation(self, event: DeploymentUtilisation) -> None:
        self.utilisation[f"{event.namespace}/{event.deployment}"] = event.mean_util
