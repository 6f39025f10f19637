"""The handover wait: a session being moved is held for its new holder, never sent to a pod that does not hold it.

A session is *being moved* from the moment the router hands it to a pod while no live pod holds it (the first
request after its holder left, drained, restarted or was replaced: ``holder-gone``, or of a session known but
unplaced) until the router hears a newer ``kv.session.location`` of it naming a holder (the pod it was sent to
claimed it: ``placed``, then ``restored``; a location naming none, the old holder's last save or its leaving, does
not end it). A second request of that session in between would be balanced again, perhaps to
another pod, which would race the first for the session: its claim refused while the first pod holds it
(``to_non_holder``), or the session split. Instead it waits, up to ``wait_s`` (``GPUWARDEN_ROUTER_HANDOVER_WAIT_S``),
for the newer location, and is then picked again (its new holder first). Past the bound it is answered 503 (the
gateway's client retries) and the handover is forgotten, so the retry hands the session over afresh.

The bound runs from the handover's last renewal. The prefetcher renews a handover while its pod is restoring the
session (every half bound until the pod answers), and each time it asks its pod again because the old holder
still holds the session (terminating, its last save under way). In both cases no other pod could do better: a
retry elsewhere would be refused the claim, or race the prefetch with a cold restore of its own. So a waiting
request goes on waiting while the handover is renewed, and gets ``wait_s`` from the last sign of progress (the
prefetcher stops renewing at its own deadline).

Kept in memory, bounded: one entry per session in handover (at most ``max_pending``, the oldest forgotten first),
an entry older than ``wait_s`` counts for nothing and is dropped when next looked at. Waiting changes nothing the
router knows; a location naming a holder wakes the session's waiters.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Handover:
    """One session in handover: the pod it was handed to and when; ``heard`` is set by its next location."""

    pod: str
    since: float
    heard: asyncio.Event = field(default_factory=asyncio.Event)


class Handovers:
    """Sessions in handover, and the requests waiting for their new holder."""

    def __init__(self, wait_s: float, max_pending: int = 100_000) -> None:
        self.wait_s = wait_s
        self.max_pending = max_pending
        self._pending: OrderedDict[str, Handover] = OrderedDict()
        self.started = 0
        self.waited = 0
        self.heard_in_time = 0
        self.timed_out = 0
        self.renewed_waits = 0
        """Waits carried past their first bound because the old holder still held the session."""

    def __len__(self) -> int:
        return len(self._pending)

    def moving(self, session: str, now: float) -> Handover | None:
        """The session's handover in flight (younger than ``wait_s``), or None."""
        handover = self._pending.get(session)
        if handover is None:
            return None
        if now - handover.since > self.wait_s:
            del self._pending[session]
            return None
        return handover

    def start(self, session: str, pod: str, now: float) -> None:
        """The router handed ``session`` to ``pod`` while no live pod held it."""
        if not self.wait_s:
            return
        current = self._pending.pop(session, None)
        if current is not None and current.pod == pod:  # the same handover asked again: its waiters keep waiting
            current.since = now
            self._pending[session] = current
            return
        if current is not None:  # handed to another pod: the old waiters pick again
            current.heard.set()
        self._pending[session] = Handover(pod, now)
        self.started += 1
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)[1].heard.set()

    def on_location(self, session: str) -> None:
        """A newer location of ``session`` was heard: its handover is over, its waiters pick again."""
        self.forget(session)

    def renew(self, sessions: list[str], pod: str, now: float) -> int:
        """The sessions' handovers to ``pod`` are still under way (its prefetch is restoring them): their bound runs
        from ``now``, their waiters wait on. Sessions no longer in handover to ``pod`` are left alone. Returns how
        many were renewed."""
        renewed = 0
        for session in sessions:
            handover = self._pending.get(session)
            if handover is not None and handover.pod == pod and not handover.heard.is_set():
                handover.since = now
                self._pending.move_to_end(session)
                renewed += 1
        return renewed

    def given_up(self, sessions: list[str], pod: str) -> None:
        """The sessions' handover to ``pod`` will not happen (its prefetch failed or went unanswered): their next
        request hands them over afresh, and requests waiting for them pick again now."""
        for session in sessions:
            handover = self._pending.get(session)
            if handover is not None and handover.pod == pod:
                self.forget(session)

    def forget(self, session: str) -> None:
        """The handover is over (timed out, given up, or its location heard): its waiters pick again, and the next
        request of a session still unheld hands it over afresh."""
        handover = self._pending.pop(session, None)
        if handover is not None:
            handover.heard.set()

    async def wait(self, handover: Handover, deadline: float, clock: Callable[[], float]) -> bool:
        """Wait until the session's next location is heard (True) or ``deadline`` passes (False), the deadline
        moved on to ``wait_s`` after each renewal of the handover while it is still the session's (module doc)."""
        self.waited += 1
        while True:
            try:
                await asyncio.wait_for(handover.heard.wait(), max(0.0, deadline - clock()))
            except TimeoutError:
                renewed = handover.since + self.wait_s
                if renewed > deadline and not handover.heard.is_set() and renewed > clock():
                    self.renewed_waits += 1
                    deadline = renewed
                    continue
                self.timed_out += 1
                return False
            self.heard_in_time += 1
            return True

    def status(self) -> dict[str, int]:
        return {
            "in_flight": len(self._pending),
            "started": self.started,
            "waited": self.waited,
            "heard_in_time": self.heard_in_time,
            "timed_out": self.timed_out,
            "renewed_waits": self.renewed_waits,
        }
