"""What the driver service decides. So far: it follows the drain verdicts of its node and the desired driver
policy; the upgrade state machine comes with the driver issue."""

from __future__ import annotations

import logging

from shared.contract.configdocs import DriverPolicy
from shared.contract.node import DrainCompleted, DrainFailed
from shared.plumbing.bus import ConsumerSpec
from shared.plumbing.configsync import VersionedConfig
from shared.plumbing.runner import ServiceContext

from .config import DriverSettings, load

log = logging.getLogger(__name__)


class DriverService:
    name = "driver"
    config_names: tuple[str, ...] = ("driver",)

    def __init__(self, settings: DriverSettings | None = None) -> None:
        self.settings = settings or load()
        self.verdicts: dict[str, str] = {}

    async def start(self, ctx: ServiceContext) -> None:
        s = ctx.subjects
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("driver", "drain-verdicts", ctx.node),
                filter_subjects=(
                    s.pattern("node.drain.completed", node=ctx.node),
                    s.pattern("node.drain.failed", node=ctx.node),
                ),
                accepts=(DrainCompleted, DrainFailed),
                stream=s.events_stream,
            ),
            self.on_verdict,
        )
        ctx.config.on_change(self.on_policy)
        ctx.status["drain_verdicts"] = self.verdicts

    async def on_verdict(self, event: DrainCompleted | DrainFailed) -> None:
        """Idempotent: records the verdict of a drain by its id; a redelivered verdict writes the same value."""
        match event:
            case DrainCompleted():
                self.verdicts[event.drain_id] = "completed"
            case DrainFailed():
                self.verdicts[event.drain_id] = f"failed: {event.reason}"
        log.info("drain verdict", extra={"drain_id": event.drain_id, "verdict": self.verdicts[event.drain_id]})

    def on_policy(self, applied: VersionedConfig) -> None:
        if isinstance(applied.doc, DriverPolicy):
            log.info("driver policy", extra={"desired": applied.doc.desired_version, "version": applied.version})
