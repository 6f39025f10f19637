"""Pod deletion cost: on scale-in the ReplicaSet controller removes the pods with the lowest
``controller.kubernetes.io/pod-deletion-cost`` first, so the router writes on each pod of its pool what evacuating
it costs: the sessions it holds plus their tokens over 4,096 (a long conversation costs more to move than a short
one), from what the router knows of where sessions are.

The value is rounded to its 3 most significant bits (8, 9, 10, 12, 14, 16, 20, ...), so that a session more or
less does not rewrite it; it is written only when it changed, every ``interval_s``
(``GPUWARDEN_ROUTER_DELETION_COST_S``, 10 s) at most, at most ``MAX_WRITES_PER_S`` pods a second (one merge patch
of the pod's annotations each: the API server is not flooded when a pool of 2,000 pods changes at once). The
sessions and tokens of each pod are the picker's totals, kept as locations change: a round reads the pool's pods,
not its sessions. What was written is kept in memory: a router that restarts writes each pod once again. A write
that fails is tried at the next round.
"""

from __future__ import annotations

import asyncio
import logging

from shared.contract.annotations import POD_DELETION_COST_ANNOTATION
from shared.ports.cluster import ClusterPort

from .picker import EndpointPicker

log = logging.getLogger(__name__)

TOKENS_PER_UNIT = 4096
MAX_WRITES_PER_S = 10
SIGNIFICANT_BITS = 3


def rounded(value: float, bits: int = SIGNIFICANT_BITS) -> int:
    """``value`` to the nearest integer with at most ``bits`` significant bits (0 and below: 0)."""
    whole = round(value)
    if whole <= 0:
        return 0
    shift = whole.bit_length() - bits
    if shift <= 0:
        return whole
    return ((whole + (1 << (shift - 1))) >> shift) << shift


def costs(picker: EndpointPicker) -> dict[str, int]:
    """Each current pod of the pool: its sessions plus their tokens over 4,096, rounded, from the totals the picker
    keeps per incarnation as locations change (a read of the pool's pods, never a walk of its sessions)."""
    return {
        name: rounded(pod.held_sessions + pod.held_tokens / TOKENS_PER_UNIT)
        for name, pod in picker.pods.items()
        if pod.current and pod.identity is not None
    }


class DeletionCosts:
    """Writes each pod's deletion cost when it changed (a loop for ``ctx.spawn``)."""

    def __init__(
        self,
        cluster: ClusterPort,
        picker: EndpointPicker,
        interval_s: float,
    ) -> None:
        self.cluster = cluster
        self.picker = picker
        self.interval_s = interval_s
        self.written: dict[str, int] = {}
        self.writes = 0
        self.failures = 0

    async def write_once(self) -> int:
        """Write the costs that changed since they were last written; returns how many were written."""
        wanted = costs(self.picker)
        for name in [n for n in self.written if n not in wanted]:
            del self.written[name]  # the pod is gone
        changed = [(name, cost) for name, cost in sorted(wanted.items()) if self.written.get(name) != cost]
        done = 0
        for index, (name, cost) in enumerate(changed):
            if index and index % MAX_WRITES_PER_S == 0:
                await asyncio.sleep(1.0)
            try:
                await self.cluster.set_pod_annotations(
                    self.picker.namespace, name, {POD_DELETION_COST_ANNOTATION: str(cost)}
                )
            except Exception as exc:  # tried again at the next round
                self.failures += 1
                log.warning("deletion cost not written", extra={"pod": name, "error": str(exc)[:200]})
                continue
            self.written[name] = cost
            self.writes += 1
            done += 1
        return done

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.write_once()

    def status(self) -> dict[str, object]:
        return {"interval_s": self.interval_s, "writes": self.writes, "failures": self.failures}
