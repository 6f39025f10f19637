"""What the device service decides. So far: it announces its node's inventory and follows the node's cordon
state; the GPU port, health rules and the device plugin come with the device issue."""

from __future__ import annotations

from shared.contract.device import DeviceInventory
from shared.contract.node import NodeCordoned, NodeUncordoned
from shared.plumbing.bus import ConsumerSpec
from shared.plumbing.runner import ServiceContext

from .config import DeviceSettings, load


class DeviceService:
    name = "device"
    config_names: tuple[str, ...] = ()

    def __init__(self, settings: DeviceSettings | None = None) -> None:
        self.settings = settings or load()
        self.cordoned = False
        self.ctx: ServiceContext | None = None

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        s = ctx.subjects
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("device", "cordon", ctx.node),
                filter_subjects=(
                    s.pattern("node.cordoned", node=ctx.node),
                    s.pattern("node.uncordoned", node=ctx.node),
                ),
                accepts=(NodeCordoned, NodeUncordoned),
                stream=s.events_stream,
            ),
            self.on_cordon,
        )
        ctx.status["node_cordoned"] = False
        await ctx.publish(DeviceInventory(node=ctx.node, simulated=ctx.settings.simulated))

    async def on_cordon(self, event: NodeCordoned | NodeUncordoned) -> None:
        """Idempotent: the latest cordon event sets the state."""
        self.cordoned = isinstance(event, NodeCordoned)
        if self.ctx is not None:
            self.ctx.status["node_cordoned"] = self.cordoned
