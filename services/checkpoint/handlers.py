"""What the checkpoint service decides. So far: it takes every drain request durably and records it; saving the
sessions comes with the checkpoint issue."""

from __future__ import annotations

import logging

from shared.contract.node import DrainRequested
from shared.plumbing.bus import ConsumerSpec
from shared.plumbing.runner import ServiceContext

from .config import CheckpointSettings, load

log = logging.getLogger(__name__)


class CheckpointService:
    name = "checkpoint"
    config_names: tuple[str, ...] = ("checkpoint", "models")

    def __init__(self, settings: CheckpointSettings | None = None) -> None:
        self.settings = settings or load()
        self.drains: dict[str, str] = {}

    async def start(self, ctx: ServiceContext) -> None:
        s = ctx.subjects
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("checkpoint", "drains"),
                filter_subjects=(s.pattern("node.drain.requested"),),
                accepts=(DrainRequested,),
                stream=s.events_stream,
                ack_wait=30.0,
            ),
            self.on_drain_requested,
        )
        ctx.status["drains"] = self.drains

    async def on_drain_requested(self, event: DrainRequested) -> None:
        """Idempotent on ``drain_id``: a duplicate or late copy of a drain changes nothing."""
        if event.drain_id in self.drains:
            return
        self.drains[event.drain_id] = event.node
        log.info("drain requested", extra={"node": event.node, "drain_id": event.drain_id})
