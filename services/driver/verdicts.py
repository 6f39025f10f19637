"""Drain verdicts as the coordinator reads them: asked of the checkpoint service, which records each drain's one
verdict (``shared.clients.drains.recorded_verdict``). The driver keeps no copy: any replica that leads asks the
same record."""

from __future__ import annotations

from shared.clients.drains import recorded_verdict
from shared.contract.node import DrainCompleted, DrainFailed
from shared.plumbing.bus import Bus


def verdict_text(verdict: DrainCompleted | DrainFailed | None) -> str:
    """``completed``, ``failed: <reason>``, or '' while there is none: what ``NodeView.drain_verdict`` holds."""
    match verdict:
        case DrainCompleted():
            return "completed"
        case DrainFailed():
            return f"failed: {verdict.reason}"
    return ""


class BusDrainVerdicts:
    """``DrainVerdicts`` over the bus: one request per look-up, answered from the checkpoint service's registry."""

    def __init__(self, bus: Bus, timeout_s: float = 2.0) -> None:
        self.bus = bus
        self.timeout_s = timeout_s

    async def get(self, drain_id: str, node: str = "") -> str:
        """Raises ``VerdictUnknown`` when the checkpoint service does not answer."""
        return verdict_text(await recorded_verdict(self.bus, drain_id, self.timeout_s, node))
