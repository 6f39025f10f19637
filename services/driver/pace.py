"""When the upgrade coordinator passes, and which nodes a pass reads besides those in flight.

A pass runs every ``interval_s`` and also promptly (``WAKE_GATHER_S`` after the first wake of a burst) when what a
node in flight waits for happens: the coordinator ``mark``s a node whose change it heard (the watch, a drain
verdict) and wakes the loop when that node's upgrade is in flight; an install or validation not finished is asked
again ``soon`` (``CHECK_SOON_S``, doubling up to the interval while it stays unfinished). Such a prompt pass reads
only those nodes; every node in flight is read again by a pass at least every interval (``poll_due``).

Nothing here reads the cluster: this is the coordinator's memory of what changed and what is due, kept apart from
its decisions (``services.driver.coordinator``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

WAKE_GATHER_S = 0.2
"""A prompt pass waits this long after the first wake, so that a burst of changes (a node's pods evicted one by
one) makes one pass."""
MIN_GAP_S = 0.05
"""The least time between two passes."""
POLL_SLACK_S = 0.05
"""A pass this close to the interval's end reads every node in flight (a timer's wake may come a little early)."""
NO_INTERVAL_S = 300.0
"""Stands for the interval before the coordinator runs (its passes driven one by one: tests, benchmarks)."""
CHECK_SOON_S = 0.5
"""An install or validation not finished is asked again after this, then after twice as long each time, up to the
pass interval."""


class PassPace:
    """The nodes changed since the last pass, the nodes to ask again soon, and when the next pass is due."""

    def __init__(self, clock: Callable[[], float], interval_s: float | None = None) -> None:
        self.clock = clock
        self.interval_s = interval_s
        """The pass interval (None until the coordinator runs): the longest an install is left unasked."""
        self.wake = asyncio.Event()
        """Set by a change a node in flight waits for: the loop passes promptly."""
        self._dirty: set[str] = set()
        self._soon: dict[str, tuple[float, float]] = {}
        """Nodes whose unfinished install or validation is asked again soon: node -> (its delay, when)."""
        self._asked: set[str] = set()
        self._polled_at = 0.0
        """When a pass last read (or tried to read) every node in flight."""

    # -- what changed ---------------------------------------------------------------------------------------------
    def mark(self, node: str, prompt: bool) -> None:
        """``node`` changed: the next pass reads it, and comes at once when ``prompt``."""
        self._dirty.add(node)
        if prompt:
            self.wake.set()

    def changed(self) -> frozenset[str]:
        return frozenset(self._dirty)

    def take_changed(self) -> set[str]:
        """The nodes changed since the last pass, forgotten here (what changes from now on is read next pass)."""
        changed, self._dirty = self._dirty, set()
        return changed

    # -- what is due ----------------------------------------------------------------------------------------------
    def soon(self, node: str) -> None:
        """The node's install or validation is not finished: ask again after ``CHECK_SOON_S``, then twice as long
        each time it is still not, up to the pass interval."""
        delay = self._soon.get(node, (CHECK_SOON_S / 2, 0.0))[0] * 2
        if self.interval_s is not None:
            delay = min(delay, self.interval_s)
        self._soon[node] = (delay, self.clock() + delay)
        self._asked.add(node)

    def poll_due(self) -> bool:
        """Whether the next pass reads every node in flight (an interval since the last that did): counted as done
        now, whatever comes of the pass (one that fails waits the interval again)."""
        now = self.clock()
        due = self.interval_s is None or now + POLL_SLACK_S >= self._polled_at + self.interval_s
        if due:
            self._polled_at = now
        return due

    def polled(self) -> None:
        """A pass read every node (a full pass)."""
        self._polled_at = self.clock()

    def begin(self) -> set[str]:
        """A pass begins: the nodes asked soon that are due now. They are not due again unless asked again (a pass
        that fails never makes a busy loop)."""
        now = self.clock()
        due = {node for node, (_, at) in self._soon.items() if at <= now}
        for node in due:
            self._soon[node] = (self._soon[node][0], now + (self.interval_s or NO_INTERVAL_S))
        self._asked = set()
        return due

    def settle(self, read: Iterable[str]) -> None:
        """The pass read ``read``: those not asked again in it no longer wait on their agent."""
        for node in [n for n in read if n in self._soon and n not in self._asked]:
            del self._soon[node]

    def forget(self, node: str) -> None:
        self._soon.pop(node, None)

    def standby(self) -> None:
        """This coordinator does not lead: it asks no agent."""
        self._soon.clear()

    def until_next(self) -> float:
        """Seconds until the next pass is due by time: the interval's, or an install or validation asked soon."""
        interval = self.interval_s or NO_INTERVAL_S
        due = self._polled_at + interval
        if self._soon:
            due = min(due, min(at for _, at in self._soon.values()))
        return max(0.0, min(interval, due - self.clock()))

    async def wait(self, prompt: bool) -> None:
        """Until the next pass: a wake (then ``WAKE_GATHER_S`` more), or the time ``until_next`` says when
        ``prompt`` (a leader whose pass went through), else the interval; never less than ``MIN_GAP_S``."""
        wait = self.until_next() if prompt else (self.interval_s or NO_INTERVAL_S)
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=max(MIN_GAP_S, wait))
            await asyncio.sleep(WAKE_GATHER_S)
        except TimeoutError:
            pass
        self.wake.clear()
