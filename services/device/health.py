"""The device service's health rules, pure: which XIDs are critical, what a GPU's health becomes, and when
a GPU taken out may be offered again (NVIDIA's device plugin's rules; see ``service`` for how they are applied)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.ports.gpu import GpuHealthEvent

from .config import DEFAULT_APPLICATION_XIDS

GpuHealth = Literal["healthy", "unhealthy", "lost"]
_SEVERITY: dict[GpuHealth, int] = {"healthy": 0, "unhealthy": 1, "lost": 2}


def is_critical_xid(xid: int, application_xids: frozenset[int] = DEFAULT_APPLICATION_XIDS) -> bool:
    return xid not in application_xids


@dataclass(frozen=True, slots=True)
class HealthVerdict:
    """What one health event means for its GPU: ``health`` is the GPU's state afterwards, ``changed`` whether it
    got worse (and so is announced), ``critical`` whether an XID counts."""

    health: GpuHealth
    changed: bool
    critical: bool
    reason: str


def judge(
    event: GpuHealthEvent, current: GpuHealth, application_xids: frozenset[int] = DEFAULT_APPLICATION_XIDS
) -> HealthVerdict:
    """An event only makes health worse: healthy, then unhealthy (a critical XID), then lost. Recovery is
    ``may_recover``'s, after a quiet period, never an event's."""
    if event.kind == "lost":
        observed: GpuHealth = "lost"
        critical = True
        reason = "GPU is lost" + (f": {event.message}" if event.message else "")
    else:
        critical = is_critical_xid(event.xid, application_xids)
        observed = "unhealthy" if critical else "healthy"
        reason = f"XID {event.xid}" + (f": {event.message}" if event.message else "")
    worse = _SEVERITY[observed] > _SEVERITY[current]
    return HealthVerdict(health=observed if worse else current, changed=worse, critical=critical, reason=reason)


def may_recover(health: GpuHealth, last_critical: float, now: float, quiet_s: float) -> bool:
    """Unlike NVIDIA's plugin, an unhealthy GPU can come back: once no critical XID has been seen for ``quiet_s``
    (and a probe then passes). A lost GPU never comes back by itself; ``quiet_s`` 0 turns recovery off."""
    return health == "unhealthy" and quiet_s > 0 and now - last_critical >= quiet_s
