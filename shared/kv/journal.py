"""The KV journal: each block persisted soon after it fills, so that an unplanned loss (a pod killed, an engine
crashed, a node gone) costs each session at most the tokens after its last full block, not a checkpoint period.

A paged-attention engine never changes a full block again, so a full block can be written once and referenced by
every later checkpoint. The journal is write-behind: the engine only appends blocks to the agent (``KvAgent``
notes which sessions grew), and a task of its own, every ``interval_s``, saves the sessions that grew through the
agent's one save path (``KvAgent.save(full_blocks_only=True)``: content-addressed chunks in one pack per round,
then one manifest per session, sealed and committed atomically). Each journal entry is a checkpoint of the
session's full-block prefix; it is recorded by the checkpoint service like any save report (the same road as the
preStop hook's, ``record_report``), so ownership is fenced unchanged: an entry of a generation the pod no longer
holds is refused and removed, and entries only ever hold more tokens than the session's last checkpoint. A
restore then takes the newest recorded checkpoint (journal entry, periodic or drain save, whichever is newest by
generation and sequence) and the engine recomputes only what came after it.

Bounded cost: the engine never waits for the journal (the engine's calls only add a session id to a set); a
flush writes only blocks no checkpoint of the session holds yet (the tail block is left to the final saves: a
drain's, the preStop hook's). While it keeps up, the periodic saves leave the tail block out too
(``journal_covers``): a tail is at most the one block the journal's bound gives up anyway, and writing it again
at every period would write much of the KV twice at a short period. A flush that fails or overruns its deadline
(a slow or full store) pauses the journal for ``backoff_s`` with a warning, and the failures go on the record road
(the checkpoint service publishes them as ``checkpoint.failed``), so the session falls back to its periodic
checkpoints (whole again, tail blocks included) meanwhile instead of piling up writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from shared.kv.agent import KvAgent, SaveReport
from shared.plumbing.settings import documented, seconds, setting, settings_from_env

log = logging.getLogger(__name__)

JOURNAL_REASON = "journal"
"""The ``reason`` of every checkpoint the journal writes (manifests and save reports say it)."""

DEFAULT_BACKOFF_S = 30.0
"""How long a journal that could not keep up pauses (at least ten intervals)."""


@dataclass(frozen=True)
class JournalSettings:
    interval_s: float = setting(
        "GPUWARDEN_KV_JOURNAL_S",
        0.0,
        "agents: journal each full KV block to the checkpoint store within this many seconds of filling, off the "
        "decode path, so a pod lost without warning costs each session at most its last block; 0: off "
        "(periodic checkpoints only)",
        parse=seconds(allow_zero=True, maximum=3600.0),
    )


DOCUMENTED = documented(JournalSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def journal_settings(env: Mapping[str, str] | None = None) -> JournalSettings:
    return settings_from_env(JournalSettings, env)


def journal_covers(journal: KvJournal | None) -> bool:
    """Whether a periodic save leaves each session's tail block out (``KvAgent.save(full_blocks_only=True)``: it
    writes only full blocks the journal has not flushed yet): only while a journal runs and keeps up. A paused
    journal (a slow or failing store) leaves the periodic saves whole, tail blocks included, as without one."""
    return journal is not None and journal.covers


Recorder = Callable[[SaveReport], Awaitable[object]]
"""Hands a journal flush's report to whoever records it (the checkpoint service, ``record_report``)."""


@dataclass
class JournalStats:
    flushes: int = 0
    """Flushes that had something to write."""
    entries: int = 0
    """Checkpoints (one per session and flush) committed to the store."""
    bytes_written: int = 0
    failed: int = 0
    """Sessions a flush could not write (they fall back to periodic checkpoints until the journal resumes)."""
    paused: int = 0
    """Times the journal paused because the store was slow or failing."""


class KvJournal:
    """Write-behind journal of one pod's agent (see the module). ``start``/``stop`` run it; ``flush`` writes what
    grew now (tests, and the last flush when stopping)."""

    def __init__(
        self,
        agent: KvAgent,
        interval_s: float,
        record: Recorder | None = None,
        *,
        deadline_s: float | None = None,
        backoff_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("a journal needs an interval above 0 s")
        self.agent = agent
        self.interval_s = interval_s
        self.record = record
        self.deadline_s = deadline_s if deadline_s is not None else max(5.0, 4 * interval_s)
        """A flush that takes longer than this is given up (its sessions wait for the next one) and pauses the
        journal: the store is slower than the engine."""
        self.backoff_s = backoff_s if backoff_s is not None else max(DEFAULT_BACKOFF_S, 10 * interval_s)
        self.clock = clock
        self.stats = JournalStats()
        self.paused_until = 0.0
        self._retry: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        agent.track_growth()

    @property
    def paused(self) -> bool:
        return self.clock() < self.paused_until

    @property
    def covers(self) -> bool:
        """Running and not paused: the sessions' full blocks are being journaled now."""
        return self._task is not None and not self._task.done() and not self.paused

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"kv-journal-{self.agent.pod}")

    async def stop(self) -> None:
        """Stop journaling; a flush under way ends first (its report recorded), nothing more is written."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._lock:  # a flush under way (shielded from the cancel) ends first
            pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.paused:
                continue
            try:
                await asyncio.shield(self.flush())  # a flush is never cut in the middle by stop
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the journal never takes the pod down: periodic checkpoints stand
                log.warning("journal flush failed", extra={"pod": self.agent.pod, "error": str(exc)})
                self._pause(str(exc))

    async def flush(self) -> SaveReport:
        """Write the full blocks of every session that grew since the last flush, as one journal entry each, and
        have them recorded. Sessions whose entry failed are tried again at the next flush."""
        async with self._lock:
            held = set(self.agent.sessions())
            todo = sorted((self.agent.take_grown() | self._retry) & held)
            self._retry = set()
            if not todo:
                return SaveReport()
            started = self.clock()
            report = await self.agent.save(
                todo, deadline_s=self.deadline_s, reason=JOURNAL_REASON, full_blocks_only=True
            )
            took = self.clock() - started
            self.stats.flushes += 1
            self.stats.entries += len(report.committed)
            self.stats.bytes_written += report.bytes_written
            self.stats.failed += len(report.failed)
            self._retry = {f.session_id for f in report.failed} & set(self.agent.sessions())
            if report.failed:
                self._pause(report.failed[0].reason)
            elif took > self.deadline_s:
                self._pause(f"a flush took {took:.1f} s, more than its deadline of {self.deadline_s:g} s")
            if self.record is not None and (report.committed or report.failed):
                try:
                    await self.record(report)
                except Exception as exc:  # not recorded now: the next save of the session is
                    log.warning("journal entries not recorded", extra={"pod": self.agent.pod, "error": str(exc)})
            return report

    def _pause(self, why: str) -> None:
        self.stats.paused += 1
        self.paused_until = self.clock() + self.backoff_s
        log.warning(
            "journal paused: the store does not keep up; sessions fall back to periodic checkpoints",
            extra={"pod": self.agent.pod, "reason": why[:300], "pause_s": self.backoff_s},
        )
