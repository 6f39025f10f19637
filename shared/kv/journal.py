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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.kv.agent import KvAgent, SaveReport
from shared.kv.crypto import ChunkCipher
from shared.kv.nodetier import NodeTier
from shared.plumbing.settings import any_text, count, documented, seconds, setting, settings_from_env

log = logging.getLogger(__name__)

JOURNAL_REASON = "journal"
"""The ``reason`` of every checkpoint the journal writes (manifests and save reports say it)."""

DEFAULT_BACKOFF_S = 30.0
"""How long a journal that could not keep up pauses (at least ten intervals)."""

DEFAULT_SPILL_S = 10.0
"""With a node tier: how often the journal's blocks go on to the shared store (what a node lost costs)."""


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
    node_dir: str = setting(
        "GPUWARDEN_KV_NODE_DIR",
        "",
        "agents: the node's local directory (a hostPath every pod of the node mounts) for the journal's node tier: "
        "blocks are logged there first and go on to the checkpoint store every GPUWARDEN_KV_JOURNAL_SPILL_S, so a "
        "pod killed costs a block when its sessions go on on the same node; '': no node tier",
        parse=any_text(),
    )
    spill_s: float = setting(
        "GPUWARDEN_KV_JOURNAL_SPILL_S",
        DEFAULT_SPILL_S,
        "agents: with a node tier, how often the journal's blocks go on to the checkpoint store (what a node lost "
        "costs)",
        parse=seconds(maximum=3600.0),
    )
    node_budget_mib: int = setting(
        "GPUWARDEN_KV_NODE_BUDGET_MIB",
        4096,
        "agents: the most the node tier holds on the node, all pods together; over it the largest logs go on to "
        "the checkpoint store at once; 0: no budget",
        parse=count(minimum=0, maximum=16 * 1024 * 1024),
    )


def journal_options(agent: KvAgent, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``AgentEndpoint``'s journal arguments as the environment sets them (``GPUWARDEN_KV_JOURNAL_S``, the node
    tier's ``GPUWARDEN_KV_NODE_DIR``, ``_SPILL_S``, ``_BUDGET_MIB``): ``AgentEndpoint(agent, bus,
    **journal_options(agent))``."""
    settings = journal_settings(env)
    return {
        "journal_s": settings.interval_s,
        "node_tier": node_tier_of(settings, agent.pod, agent.cipher),
        "spill_s": settings.spill_s,
    }


def node_tier_of(settings: JournalSettings, pod: str, cipher: ChunkCipher | None = None) -> NodeTier | None:
    """The pod's node tier as the settings name it (None without ``GPUWARDEN_KV_NODE_DIR``)."""
    if not settings.node_dir:
        return None
    return NodeTier(settings.node_dir, pod, cipher=cipher, budget_bytes=settings.node_budget_mib * 1024 * 1024)


DOCUMENTED = documented(JournalSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def journal_settings(env: Mapping[str, str] | None = None) -> JournalSettings:
    return settings_from_env(JournalSettings, env)


def journal_covers(journal: KvJournal | None) -> bool:
    """Whether a periodic save leaves each session's tail block out (``KvAgent.save(full_blocks_only=True)``: it
    writes only full blocks the journal has not flushed yet): only while a journal runs and keeps up. A paused
    journal (a slow or failing store) leaves the periodic saves whole, tail blocks included, as without one."""
    return journal is not None and journal.covers


Recorder = Callable[[SaveReport], Awaitable[set[str] | None]]
"""Hands a journal flush's report to whoever records it (the checkpoint service, ``record_report``); returns the
checkpoint ids it recorded (None: no answer, nothing known to be recorded)."""


@dataclass
class JournalStats:
    flushes: int = 0
    """Flushes that had something to write to the shared store (spills, with a node tier)."""
    entries: int = 0
    """Checkpoints (one per session and flush) committed to the store."""
    bytes_written: int = 0
    """Bytes written to the shared store."""
    failed: int = 0
    """Sessions a flush could not write (they fall back to periodic checkpoints until the journal resumes)."""
    paused: int = 0
    """Times the journal paused because the store was slow or failing."""
    node_bytes_written: int = 0
    """Bytes appended to the node tier's logs."""
    node_blocks: int = 0
    compactions: int = 0
    """Spills the node's byte budget forced before their time."""


class KvJournal:
    """Write-behind journal of one pod's agent (see the module). ``start``/``stop`` run it; ``flush`` writes what
    grew to the shared store now, ``flush_node`` to the node tier (tests, and the last flush when stopping).

    ``node``: the node tier (``shared.kv.nodetier``). With it, each tick appends the sessions' new full blocks to
    the node's local logs, and the shared store is written (``flush``, recorded) only every ``spill_s`` seconds, or
    sooner for the largest logs when the node's tier is over its byte budget; a log is deleted once what it holds is
    recorded from the shared store. Without it, each tick writes to the shared store as before."""

    def __init__(
        self,
        agent: KvAgent,
        interval_s: float,
        record: Recorder | None = None,
        *,
        deadline_s: float | None = None,
        backoff_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        node: NodeTier | None = None,
        spill_s: float = DEFAULT_SPILL_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("a journal needs an interval above 0 s")
        if node is not None and spill_s < interval_s:
            raise ValueError("a node tier's spill period must be at least the journal's interval")
        self.agent = agent
        self.interval_s = interval_s
        self.record = record
        self.deadline_s = deadline_s if deadline_s is not None else max(5.0, 4 * interval_s)
        """A flush that takes longer than this is given up (its sessions wait for the next one) and pauses the
        journal: the store is slower than the engine."""
        self.backoff_s = backoff_s if backoff_s is not None else max(DEFAULT_BACKOFF_S, 10 * interval_s)
        self.clock = clock
        self.node = node
        self.spill_s = spill_s
        self.stats = JournalStats()
        self.paused_until = 0.0
        self._retry: set[str] = set()
        self._unspilled: set[str] = set()
        """Sessions that grew since the shared store last had them (with a node tier)."""
        self._unconfirmed: dict[str, str] = {}
        """The journal's own entries whose recording was not confirmed (no answer): their logs stay."""
        self._last_spill = clock()
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
            if self.node is not None:
                with contextlib.suppress(OSError):
                    self.node.sweep()
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
                await asyncio.shield(self._tick())  # a flush is never cut in the middle by stop
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the journal never takes the pod down: periodic checkpoints stand
                log.warning("journal flush failed", extra={"pod": self.agent.pod, "error": str(exc)})
                self._pause(str(exc))

    async def _tick(self) -> None:
        if self.node is None:
            await self.flush()
            return
        logged = await self.flush_node()
        if self.clock() - self._last_spill >= self.spill_s:
            await self.flush()
            return
        # a session the shared store holds nothing of yet goes there at once: a node-tier log extends a checkpoint
        held = set(self.agent.sessions())
        new = sorted(sid for sid in logged & held if self.agent.last_checkpoint(sid) is None)
        if new:
            await self.flush(new)
        if not self.node.bytes_held:
            return  # nothing of this pod's to spill early: the node's usage is not even read
        excess = await asyncio.to_thread(self.node.over_budget)
        if excess > 0:  # the node's tier is full: the largest logs go to the shared store now
            chosen, freed = [], 0
            for sid, size in self.node.sessions_by_size():
                chosen.append(sid)
                freed += size
                if freed >= excess:
                    break
            if chosen:
                self.stats.compactions += 1
                await self.flush(chosen)

    async def flush_node(self) -> set[str]:
        """Append the new full blocks of every session that grew to the node tier's logs; returns the sessions
        logged. Sessions the pod no longer holds lose their logs."""
        assert self.node is not None
        async with self._lock:
            held = set(self.agent.sessions())
            grown = self.agent.take_grown()
            self._unspilled |= grown
            for sid in [s for s in self.node.sessions() if s not in held]:
                self.node.forget(sid)
            batch = []
            for sid in sorted(grown & held):
                try:
                    generation = self.agent.generation(sid)
                    start = self.node.next_block(sid, generation)
                    held_under, blocks = await self.agent.full_blocks_from(sid, start)
                except KeyError:  # left the pod meanwhile
                    continue
                if blocks and held_under == generation:
                    batch.append((sid, generation, start, blocks))
            if not batch:
                return set()
            self.stats.node_bytes_written += await self.node.append(batch)
            self.stats.node_blocks += sum(len(b[3]) for b in batch)
            return {b[0] for b in batch}

    async def flush(self, sessions: Sequence[str] | None = None) -> SaveReport:
        """Write the full blocks of every session that grew since the last flush (or of ``sessions``) to the shared
        store, as one journal entry each, and have them recorded. Sessions whose entry failed are tried again at
        the next flush. With a node tier, the logs of the entries recorded are deleted."""
        async with self._lock:
            held = set(self.agent.sessions())
            # with a node tier, what grew is the node step's to take (``flush_node``): it adds it to ``_unspilled``
            grown = self._unspilled if self.node is not None else self.agent.take_grown()
            if sessions is None:
                todo = sorted((grown | self._retry) & held)
                self._unspilled, self._retry = set(), set()
                self._last_spill = self.clock()
            else:
                todo = sorted(set(sessions) & held)
                self._unspilled = (grown - set(todo)) & held
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
            self._retry |= {f.session_id for f in report.failed} & set(self.agent.sessions())
            if report.failed:
                self._pause(report.failed[0].reason)
            elif took > self.deadline_s:
                self._pause(f"a flush took {took:.1f} s, more than its deadline of {self.deadline_s:g} s")
            recorded: set[str] | None = {m.checkpoint_id for m in report.committed}
            if self.record is not None and (report.committed or report.failed):
                try:
                    recorded = await self.record(report)
                except Exception as exc:  # not recorded now: the next save of the session is
                    recorded = None
                    log.warning("journal entries not recorded", extra={"pod": self.agent.pod, "error": str(exc)})
            if self.node is not None:
                for m in report.committed:
                    if recorded is not None and m.checkpoint_id in recorded:
                        self.node.rotate(m.session_id, m.generation, len(m.blocks))
                        self._unconfirmed.pop(m.session_id, None)
                    else:  # the log stays until the store's copy is recorded
                        self._unspilled.add(m.session_id)
                        self._unconfirmed[m.session_id] = m.checkpoint_id
                # passed over: the store already holds their full blocks (a periodic or drain save wrote them since)
                written = {m.session_id for m in report.committed} | {f.session_id for f in report.failed}
                for sid in set(todo) - written:
                    last = self.agent.last_checkpoint(sid)
                    if last is not None and self._unconfirmed.get(sid) != last.checkpoint_id:
                        self.node.rotate(sid, last.generation, len(last.blocks))
                await asyncio.to_thread(self.node.note_usage)
            return report

    def _pause(self, why: str) -> None:
        self.stats.paused += 1
        self.paused_until = self.clock() + self.backoff_s
        log.warning(
            "journal paused: the store does not keep up; sessions fall back to periodic checkpoints",
            extra={"pod": self.agent.pod, "reason": why[:300], "pause_s": self.backoff_s},
        )
