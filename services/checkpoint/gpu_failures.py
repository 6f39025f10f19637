"""A GPU that fails (``device.health.changed``, unhealthy, naming the pods that hold it): each of those pods'
agents saves everything it holds at once, before the pods are restarted or moved, and what they commit is
recorded."""

from __future__ import annotations

import asyncio
import logging

from shared.contract.base import is_token
from shared.contract.device import DeviceHealthChanged

from .replica import Replica
from .saves import NoSaveReport, Saves

log = logging.getLogger(__name__)

GPU_FAILURE_SAVE_S = 20.0
"""The deadline a pod on a failing GPU gets for its save."""


class GpuFailures:
    def __init__(self, replica: Replica, saves: Saves) -> None:
        self.replica = replica
        self.saves = saves

    async def on_gpu_health(self, event: DeviceHealthChanged) -> None:
        """Each pod on a GPU that failed saves all it owns, and what it committed is recorded. Idempotent:
        saving unchanged sessions again writes no new bytes. A pod whose agent does not answer is logged; its
        sessions' last checkpoints stand."""
        if event.healthy or not event.pods:
            return
        limit = asyncio.Semaphore(self.replica.policy().drain_parallelism)

        async def save(pod: str) -> None:
            name = pod.rpartition("/")[2]
            if not is_token(name):
                log.warning("pod on a failing GPU has a name no agent answers to", extra={"pod": pod})
                return
            async with limit:
                outcome = await self.saves.command(name, GPU_FAILURE_SAVE_S, "gpu-unhealthy")
            if isinstance(outcome, NoSaveReport):
                log.warning("pod on a failing GPU did not save", extra={"pod": pod, "error": outcome.reason})
                return
            recorded = await self.saves.record(outcome, "")
            log.info(
                "pod on a failing GPU saved",
                extra={
                    "pod": pod,
                    "gpu": event.gpu_uuid,
                    "committed": len(recorded.committed),
                    "failed": len(recorded.failed),
                },
            )

        await asyncio.gather(*(save(pod) for pod in sorted(set(event.pods))))
