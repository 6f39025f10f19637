"""A pod's load report (``kv.pod.load``), as an inference server sends it: how full its KV block pool is, and the
time to first token of its requests at the 90th percentile over the last window.

The server creates one ``LoadReporter`` per pod, calls ``first_token`` with each request's time to first token
(from the request's arrival to its first token: queue wait, restore and prefill included), and either runs
``run()`` as a task or calls ``tick()`` from a loop of its own; a ``PodLoad`` goes out every ``interval_s``. The
pool is read when the report is built (``pool()`` returns blocks used and blocks in the pool). Publishing never
raises into the server: a report that cannot be sent is dropped (the next one replaces it) and counted.

The percentile is exact over the window (nearest rank) up to ``MAX_SAMPLES`` requests per window; beyond that it
is taken over a uniform sample of them (reservoir sampling), so memory stays bounded under any load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Collection

from shared.contract.base import Event
from shared.contract.load import PodLoad

log = logging.getLogger(__name__)

MAX_SAMPLES = 4096
"""First-token latencies kept per window; more are sampled down to this many."""

Publish = Callable[[Event], Awaitable[None]]
PoolReading = Callable[[], tuple[int, int]]


def p90(samples: list[float]) -> float | None:
    """The 90th percentile by nearest rank (the smallest sample with at least 90 % of samples at or below it);
    None for no samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class LoadReporter:
    """One pod's ``kv.pod.load`` reports. ``publish`` is the bus's (``Bus.publish``: core NATS for this kind)."""

    def __init__(
        self,
        publish: Publish,
        pool: PoolReading,
        *,
        pod: str,
        namespace: str,
        deployment: str,
        node: str = "",
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        versions: Callable[[], Collection[str]] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, not {interval_s}")
        self.publish = publish
        self.pool = pool
        self.versions = versions
        """The model versions the pod can restore sessions into now (``KvAgent.layouts``); None: not said."""
        self.pod = pod
        self.node = node
        self.namespace = namespace
        self.deployment = deployment
        self.interval_s = interval_s
        self.clock = clock
        self.sent = 0
        self.dropped = 0
        self._random = random.Random(seed)
        self._samples: list[float] = []
        self._seen = 0
        self._window_started = clock()

    def first_token(self, seconds: float) -> None:
        """A request got its first token ``seconds`` after it arrived. Negative or non-finite values (a clock that
        stepped) are ignored."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        self._seen += 1
        if len(self._samples) < MAX_SAMPLES:
            self._samples.append(seconds)
            return
        slot = self._random.randrange(self._seen)
        if slot < MAX_SAMPLES:
            self._samples[slot] = seconds

    def report(self) -> PodLoad:
        """The report of the window ending now; a new window starts."""
        now = self.clock()
        used, total = self.pool()
        event = PodLoad(
            pod=self.pod,
            node=self.node,
            namespace=self.namespace,
            deployment=self.deployment,
            blocks_used=max(0, min(used, total)) if total > 0 else max(0, used),
            blocks_total=max(0, total),
            ttft_p90_s=p90(self._samples),
            window_s=max(now - self._window_started, 1e-3),
            requests=self._seen,
            model_versions=None if self.versions is None else sorted(self.versions())[:16],
        )
        self._samples, self._seen, self._window_started = [], 0, now
        return event

    def due(self) -> bool:
        return self.clock() - self._window_started >= self.interval_s

    async def send(self) -> bool:
        """Build and publish the report now; False (and counted in ``dropped``) when it could not be sent."""
        event = self.report()
        try:
            await self.publish(event)
        except Exception as exc:
            self.dropped += 1
            log.debug("load report not sent", extra={"pod": self.pod, "error": repr(exc)})
            return False
        self.sent += 1
        return True

    async def tick(self) -> bool:
        """Send a report if ``interval_s`` has passed since the last one; says whether one was sent."""
        if not self.due():
            return False
        return await self.send()

    async def run(self) -> None:
        """Report every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - self._window_started)))
            await self.send()
