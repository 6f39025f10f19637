"""What the metrics service decides. So far: it tracks the GPUs each node reports, which it will sample; the
sources and aggregates come with the metrics issue."""

from __future__ import annotations

from shared.contract.device import DeviceInventory
from shared.plumbing.bus import ConsumerSpec
from shared.plumbing.runner import ServiceContext

from .config import MetricsSettings, load


class MetricsService:
    name = "metrics"
    config_names: tuple[str, ...] = ()

    def __init__(self, settings: MetricsSettings | None = None) -> None:
        self.settings = settings or load()
        self.gpus: dict[str, list[str]] = {}

    async def start(self, ctx: ServiceContext) -> None:
        s = ctx.subjects
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("metrics", "inventory", ctx.node),
                filter_subjects=(s.pattern("device.inventory", node=ctx.node),),
                accepts=(DeviceInventory,),
                stream=s.events_stream,
            ),
            self.on_inventory,
        )
        ctx.status["gpus"] = self.gpus

    async def on_inventory(self, event: DeviceInventory) -> None:
        """Idempotent: replaces the node's GPU list with the one in the event."""
        self.gpus[event.node] = [g.uuid for g in event.gpus]
