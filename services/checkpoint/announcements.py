"""What each pod holds, from its announcements: a full announcement replaces what the pod held, a delta applies
what it names; sessions announced under a generation that moved on are stale copies (refused, named back to the
pod so it drops them), and sessions the pod ended have their checkpoints retired."""

from __future__ import annotations

import logging

from shared.contract.checkpoint import AgentSessions, AnnouncementAck

from .replica import Replica
from .retention import Retention

log = logging.getLogger(__name__)


class Announcements:
    def __init__(self, replica: Replica, retention: Retention) -> None:
        self.replica = replica
        self.retention = retention

    async def on_announcement(self, event: AgentSessions) -> AnnouncementAck:
        """Idempotent: a full announcement replaces what the pod held before; a delta applies what it names (a
        repeat of the last one applied changes nothing). Sessions held under a generation that moved on are
        stale copies: ignored, and named in the answer so the pod drops them. ``resync`` when the registry does
        not have what a delta builds on."""
        if not event.leaving:  # the pod's bucket exists before it is told its announcement was applied
            await self.replica.provision(event.pod)
        applied = await self.replica.registry.apply_announcement(event)
        await self.replica.publish_locations(applied.changes)
        for sid in applied.retired:
            await self.retention.retire_session(sid)
        if applied.stale:
            self.replica.metrics.refused.labels("announcement").inc(len(applied.stale))
            log.warning(
                "pod announced sessions it no longer owns; ignored",
                extra={
                    "pod": event.pod,
                    "node": event.node,
                    "sessions": applied.stale[:20],
                    "count": len(applied.stale),
                },
            )
        if applied.resync:
            log.info("pod's announcements to be resent in full", extra={"pod": event.pod, "seq": event.seq})
        return AnnouncementAck(pod=event.pod, seq=event.seq, resync=applied.resync, stale=applied.stale[:1000])
