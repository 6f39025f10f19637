"""Periodic checkpoints, and how replicas share them: every ``periodic_interval_s`` of the ``checkpoint``
document each live pod is asked to save what changed (incremental: only new blocks are written), so a pod that
dies without its preStop loses at most one interval. Each pod is saved by one replica of those alive
(``share_of``, rendezvous hashing over the replicas' membership leases), and one save per interval and pod is
taken across replicas and restarts (a turn in Redis); a save that did not happen is tried again soon."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Sequence

from shared.contract.checkpoint import PERIODIC_REASON
from shared.plumbing.errors import TemporaryError

from .replica import Replica
from .saves import NoSaveReport, Saves

log = logging.getLogger(__name__)

REPLICA_LEASE_S = 5.0
"""How long a replica counts as alive without renewing (it renews every tick, at most a second apart): a replica
that dies hands its share of periodic saves to the others within about this long."""


def share_of(pod: str, replicas: Sequence[str]) -> str:
    """The replica that saves ``pod`` periodically: the highest hash of (pod, replica) wins (rendezvous hashing),
    so when a replica joins or leaves only the pods it wins or held move."""
    return max(replicas, key=lambda replica: hashlib.blake2b(f"{replica}|{pod}".encode(), digest_size=8).digest())


def periodic_slot(pod: str, interval_s: float, after: float) -> float:
    """The first of the pod's periodic save times (wall clock, seconds) after ``after``. Each pod's saves fall at a
    fixed point of every interval, taken from its name: the same on every replica (a pod that moves to another
    keeps its times) and spread evenly over the interval (a fleet's pods are not all due at once)."""
    digest = hashlib.blake2b(pod.encode(), digest_size=8).digest()
    phase = int.from_bytes(digest, "big") / 2**64 * interval_s
    return phase + (math.floor((after - phase) / interval_s) + 1) * interval_s


class PeriodicSaves:
    def __init__(self, replica: Replica, saves: Saves) -> None:
        self.replica = replica
        self.saves = saves
        self.share = 0
        """Live pods this replica saves periodically, as of its last tick."""
        self._due: dict[str, float] = {}
        self._running: set[str] = set()
        self._tasks: set[asyncio.Task[bool]] = set()
        self._slots = asyncio.Semaphore(replica.settings.periodic_parallelism)

    async def loop(self) -> None:
        """Every pod of this replica's share is asked to save what changed once per ``periodic_interval_s``, on
        time: at its own point of every interval (``periodic_slot``), checked every twentieth of the interval (at
        most a second), and never more than one save of a pod runs at once."""
        replica = self.replica
        while True:
            interval = replica.policy().periodic_interval_s
            await asyncio.sleep(min(1.0, max(0.05, interval / 20)) if interval > 0 else 1.0)
            interval = replica.policy().periodic_interval_s  # the document may have changed meanwhile
            try:
                if interval <= 0:  # still a member: shares are settled before periodic saves begin
                    await replica.leases.replicas(replica.owner, REPLICA_LEASE_S)
                    continue
                await self._tick(interval)
                replica.metrics.periodic_tick.set_to_current_time()
            except TemporaryError as exc:
                log.warning("periodic checkpoints skipped this turn", extra={"error": str(exc)})

    async def _my_pods(self, lease_s: float) -> list[str]:
        """The live pods this replica saves periodically: each pod goes to one replica of those alive, by
        rendezvous hashing, so a replica that dies hands its share to the others when its lease lapses, and
        only the pods whose owner changed move."""
        registry = self.replica.registry
        replicas = await self.replica.leases.replicas(self.replica.owner, lease_s)
        known = await registry.pods()
        silent = await registry.silent_pods(known)
        live = sorted(set(known) - set(silent))
        if len(replicas) <= 1:
            return live
        return [pod for pod in live if share_of(pod, replicas) == self.replica.owner]

    async def _tick(self, interval_s: float) -> None:
        now = time.time()
        mine = await self._my_pods(REPLICA_LEASE_S)
        self.share = len(mine)
        for pod in mine:
            if pod not in self._due:  # new to this replica: its first save at its own time
                self._due[pod] = periodic_slot(pod, interval_s, now)
            if pod in self._running or self._due[pod] > now:
                continue
            self.replica.metrics.periodic_late.inc(1 if now - self._due[pod] > 5.0 else 0)
            self._due[pod] = now + interval_s  # until the save starts and sets its next time
            self._running.add(pod)
            task = asyncio.create_task(self._save(pod, interval_s), name=f"periodic-{pod}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for pod in [p for p in self._due if p not in mine]:
            del self._due[pod]

    async def periodic_saves(self, interval_s: float) -> int:
        """One pass now over every live pod of this replica's share whose turn can be taken (tests and tools):
        returns how many pods saved something."""
        mine = await self._my_pods(REPLICA_LEASE_S)
        saved = await asyncio.gather(*(self._save(pod, interval_s) for pod in mine))
        return sum(saved)

    async def _save(self, pod: str, interval_s: float) -> bool:
        """The pod's periodic save, if this replica takes its turn (one per interval and pod across replicas
        and restarts): only sessions with something new are written. Says whether anything was saved."""
        replica = self.replica
        try:
            # the turn is taken, and the next save made due, when this save can start (a slot free), not when it
            # was queued: with many pods due at once, a save that waited for its slot would otherwise be followed
            # by the next one less than an interval later
            async with self._slots:
                held_ms = await replica.leases.take_turn_or_wait("periodic", pod, replica.owner, interval_s * 0.95)
                if held_ms:  # another replica saved it this interval: due when its turn lapses, not an interval on
                    self._due[pod] = time.time() + held_ms / 1000
                    return False
                started = time.monotonic()
                # the next save at the pod's next own time, one interval after this one's (however late this one
                # started): a delay is not carried into the next interval
                self._due[pod] = periodic_slot(pod, interval_s, time.time() + interval_s / 2)
                outcome = await self.saves.command(
                    pod, max(1.0, min(interval_s, 60.0) * 0.8), PERIODIC_REASON, changed_only=True
                )
        except TemporaryError as exc:
            log.warning("periodic checkpoint not taken", extra={"pod": pod, "error": str(exc)})
            self._retry_soon(pod, interval_s)
            return False
        finally:
            self._running.discard(pod)
        if isinstance(outcome, NoSaveReport):
            replica.metrics.periodic_missed.inc()
            log.warning("periodic checkpoint not taken", extra={"pod": pod, "error": outcome.reason})
            with contextlib.suppress(TemporaryError):  # the turn goes back: the pod is asked again soon
                await replica.leases.release_turn("periodic", pod, replica.owner)
            self._retry_soon(pod, interval_s)
            return False
        replica.metrics.periodic.observe(time.monotonic() - started)
        if outcome.committed or outcome.failed:
            await self.saves.record(outcome, "")
            return True
        return False

    def _retry_soon(self, pod: str, interval_s: float) -> None:
        """A periodic save that did not happen is tried again within a tenth of the interval (5 s at most), not
        an interval later. Not a ``retries`` policy: the retry is a due time in this replica's schedule of saves,
        picked up by ``loop``'s next ticks like any other (and moved to the next interval by a save that works),
        not a wait of its own."""
        self._due[pod] = time.time() + min(5.0, interval_s / 10)
