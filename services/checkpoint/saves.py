"""A pod's save, and whether what it reports is committed: the command that has its KV agent save (drains,
periodic saves, failing GPUs), and each checkpoint of its report verified in the store, fenced by the session's
generation and recorded (``record``), or refused with the reason. Reports handed in by others (``on_record``: the
pod's preStop hook, the earlier parts of a long report) are recorded the same way: one road, whoever asked.

A pod's last save writes only what changed since each session's last checkpoint and names the rest (``kept``):
those are confirmed, not recorded again, so a drain followed by the pod's preStop records each session once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from shared.contract.base import Event, is_token
from shared.contract.checkpoint import (
    CheckpointFailed,
    CheckpointSaved,
    CommittedCheckpoint,
    SaveSessions,
    SaveSessionsReport,
)
from shared.contract.deadletter import DeadLetter
from shared.contract.node import SessionFailure
from shared.contract.sessions import SessionLocation
from shared.kv.journal import JOURNAL_REASON as JOURNAL
from shared.kv.manifest import CheckpointManifest, lost_pack
from shared.kv.store import StoreError
from shared.plumbing.errors import TemporaryError

from .ports import Recording
from .replica import Replica

log = logging.getLogger(__name__)

REASON_CHARS = 500


@dataclass(frozen=True)
class NoSaveReport:
    """Why a pod's agent gave no save report: it did not answer in time, refused the command, or answered something
    else. Nothing of the pod's was saved by this command; its sessions' last checkpoints stand."""

    reason: str


class Recorded(NamedTuple):
    """What recording one report decided: the sessions whose checkpoint is committed, the failures (the report's
    own and those refused here), the bytes committed, and the sessions whose kept checkpoint is confirmed."""

    committed: set[str]
    failed: list[SessionFailure]
    bytes_total: int
    kept: set[str]
    """Sessions whose ``kept`` checkpoint (nothing new since it) is confirmed recorded."""


class Saves:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    async def command(
        self,
        pod: str,
        deadline_s: float,
        reason: str,
        drain_id: str = "",
        generations: dict[str, int] | None = None,
        timeout: float | None = None,
        changed_only: bool = False,
    ) -> SaveSessionsReport | NoSaveReport:
        """Have one pod's agent save; its report, or why there is none (``NoSaveReport``). With ``generations``
        the pod saves those sessions, each only under the generation named (a session it holds under another is
        refused); without, all it holds (what it no longer owns is then refused when recorded). ``changed_only``:
        sessions with nothing new since their last checkpoint write nothing. Sessions of the pod marked for a full
        save (a checkpoint of theirs lost a file) are named in ``rewrite``."""
        command = SaveSessions(
            pod=pod,
            drain_id=drain_id,
            deadline_s=deadline_s,
            reason=reason,
            generations=generations or {},
            changed_only=changed_only,
            rewrite=await self._rewrites(pod, generations),
        )
        ctx = self.replica.ctx
        try:
            reply = await ctx.bus.request(ctx.subjects.for_event(command), command, timeout=timeout or deadline_s + 5)
        except TimeoutError as exc:
            within = "within the drain deadline" if drain_id else "in time"
            return NoSaveReport(f"pod {pod}'s KV agent did not answer {within} ({exc})")
        if isinstance(reply, DeadLetter):
            return NoSaveReport(f"pod {pod}'s KV agent refused the save: {reply.reason}")
        if not isinstance(reply, SaveSessionsReport):
            return NoSaveReport(f"pod {pod}'s KV agent answered {reply.kind}, not a save report")
        return reply

    async def record(self, report: SaveSessionsReport, drain_id: str) -> Recorded:
        """Verify each committed checkpoint in the store (manifest present, verified and as reported, every pack
        it references present and long enough), record it if the pod still owns the session's generation, and
        publish ``checkpoint.saved``. A checkpoint of a pod that no longer owns the session is refused: not
        recorded, reported as failed, and its manifest removed only when it is provably a stale save nobody may
        take for committed (``Recording.deletable``). What it reads and writes follows the report, never the
        store. Idempotent under duplication and replay: a checkpoint recorded before is answered as committed,
        whoever holds the session now, and changes nothing (no record, event or deletion).

        Drains and preStop hooks both save a pod's sessions, often one right after the other: each report is
        recorded on its own, and the newer checkpoint (by generation, sequence) is the one restores take. A
        preStop save's ``kept`` checkpoints (sessions with nothing new since their last checkpoint) are confirmed:
        refused when the pod no longer holds the session under that generation (never deleted: it is what a drain
        committed), otherwise verified and recorded like the rest, which changes nothing for one recorded before
        (a drain's) and records one whose first report was lost."""
        store = self.replica.store
        metrics = self.replica.metrics
        ok: set[str] = set()
        failed = list(report.failed)
        total = 0
        kept, refused = await self._held(report)
        failed += refused
        entries = [*report.committed, *kept]
        manifests: list[tuple[CommittedCheckpoint, CheckpointManifest]] = []
        read = await asyncio.gather(
            *(store.manifest(c.session_id, c.checkpoint_id) for c in entries), return_exceptions=True
        )
        for c, manifest in zip(entries, read, strict=True):
            if isinstance(manifest, StoreError):
                reason = f"not in store: {manifest}"
                failed.append(SessionFailure(session_id=c.session_id, pod=report.pod, reason=reason))
            elif isinstance(manifest, BaseException):
                raise manifest
            else:
                manifests.append((c, manifest))
        try:
            packs = await store.pack_sizes({ref.pack for _, m in manifests for ref in m.blocks})
        except StoreError as exc:
            reason = f"store unreadable: {exc}"
            return Recorded(
                set(),
                failed + [SessionFailure(session_id=c.session_id, pod=report.pod, reason=reason) for c, _ in manifests],
                0,
                set(),
            )
        problems: dict[str, str] = {}
        for c, manifest in manifests:
            if manifest.bytes_total != c.bytes_total or len(manifest.blocks) != c.chunks:
                problems[c.checkpoint_id] = "manifest differs from the agent's report"
            elif (manifest.generation, manifest.sequence, manifest.pod) != (c.generation, c.sequence, report.pod):
                problems[c.checkpoint_id] = "manifest's generation, sequence or pod differs from the agent's report"
            if lost := lost_pack(manifest, packs):
                problems[c.checkpoint_id] = lost
        sound = [c for c, _ in manifests if c.checkpoint_id not in problems]
        recorded = dict(
            zip(
                (c.checkpoint_id for c in sound),
                await self.replica.registry.record_checkpoints(sound, report.store, report.pod, report.node),
                strict=True,
            )
        )
        events: list[Event] = []
        fresh: set[str] = set()  # recorded for the first time by this report (not a duplicate or a replay)
        confirmed: set[str] = set()
        kept_ids = {c.checkpoint_id for c in kept}
        for c, manifest in manifests:
            problem = problems.get(c.checkpoint_id, "")
            outcome = recorded.get(c.checkpoint_id)
            if outcome is not None and outcome.refused:
                metrics.refused.labels("save").inc()
                problem = f"refused: pod {report.pod} saved generation {c.generation}, but {outcome.refused}"
                await self._remove_refused(c, outcome)
                log.warning("stale save refused", extra={"session": c.session_id, "reason": problem})
            if problem:
                failed.append(SessionFailure(session_id=c.session_id, pod=report.pod, reason=problem))
                continue
            assert outcome is not None
            if c.checkpoint_id in kept_ids:
                confirmed.add(c.session_id)
            else:
                ok.add(c.session_id)
                total += c.bytes_total
            if not outcome.first_time:
                continue  # recorded before: a report sent again or replayed is answered, and changes nothing
            fresh.add(c.session_id)
            metrics.bytes.labels("logical").inc(c.bytes_total)
            metrics.bytes.labels("written").inc(c.bytes_written)
            metrics.sessions.labels("committed").inc()
            events.append(
                CheckpointSaved(
                    session_id=c.session_id,
                    checkpoint_id=c.checkpoint_id,
                    node=report.node,
                    pod=report.pod,
                    deployment=manifest.deployment,
                    bytes_total=c.bytes_total,
                    bytes_written=c.bytes_written,
                    chunks=c.chunks,
                    drain_id=drain_id,
                )
            )
            if outcome.location is not None:
                events.append(outcome.location)
        await self._note_rewrites(entries, report.pod, fresh, problems)
        await self._publish_recorded(events)
        return Recorded(ok, failed, total, confirmed)

    async def _held(self, report: SaveSessionsReport) -> tuple[list[CommittedCheckpoint], list[SessionFailure]]:
        """The report's ``kept`` checkpoints whose session the pod still holds under their generation (one read
        of the pod's index, only when it names some), and a refusal for each other one: the pod lost the session
        since (a drain moved it), so its checkpoint is no longer the pod's to confirm."""
        if not report.kept:
            return [], []
        held = await self.replica.registry.sessions_of_pod(report.pod)
        mine = [c for c in report.kept if held.get(c.session_id) == c.generation]
        return mine, [
            SessionFailure(
                session_id=c.session_id,
                pod=report.pod,
                reason=f"refused: pod {report.pod} no longer holds generation {c.generation} of the session",
            )
            for c in report.kept
            if held.get(c.session_id) != c.generation
        ]

    async def _remove_refused(self, c: CommittedCheckpoint, outcome: Recording) -> None:
        """A refusal deletes only what the refused save itself wrote and nobody may take for committed (a
        ``stale`` outcome: see ``Recording``); any other refused checkpoint stays, since it may be the seal a new
        holder restored from, whatever the report that names it (a late duplicate, a replay)."""
        if not outcome.deletable:
            return
        try:
            await self.replica.store.delete_checkpoint(c.session_id, c.checkpoint_id)
        except StoreError as exc:
            log.warning("refused checkpoint not removed", extra={"error": str(exc)})

    async def _rewrites(self, pod: str, generations: dict[str, int] | None) -> list[str]:
        """The pod's sessions marked for a full save (of those named, when the command names some); none when
        Redis does not answer now (the save is then incremental; the mark stays for the next one)."""
        try:
            marked = await self.replica.registry.rewrites(pod)
        except TemporaryError as exc:
            log.warning("sessions to save in full not read", extra={"pod": pod, "error": str(exc)})
            return []
        return sorted(marked & set(generations) if generations else marked)

    async def _note_rewrites(
        self, entries: Sequence[CommittedCheckpoint], pod: str, fresh: set[str], problems: dict[str, str]
    ) -> None:
        """A session whose save, recorded now for the first time, wrote every block (reused nothing) is healed: its
        mark goes (a replayed full save of before the mark clears nothing). A save refused because a pack it
        references is missing or short marks its session: the pod's next save of it is full."""
        healed = [c.session_id for c in entries if c.session_id in fresh and c.bytes_written >= c.bytes_total]
        lost = sorted({c.session_id for c in entries if problems.get(c.checkpoint_id, "").startswith("pack ")})
        try:
            await self.replica.registry.clear_rewrites(pod, healed)
            await self.replica.registry.mark_rewrite(pod, lost)
        except TemporaryError as exc:
            log.warning("sessions to save in full not updated", extra={"pod": pod, "error": str(exc)})
            return
        self.replica.metrics.rewrites.labels("save").inc(len(lost))

    async def _publish_recorded(self, events: Sequence[Event]) -> None:
        """``checkpoint.saved`` and the locations that changed, in one batch of acknowledgements. What is
        recorded stands even when the events cannot be published now (counted and logged)."""
        if not events:
            return
        locations = self.replica.metrics.locations
        try:
            await self.replica.ctx.bus.publish_many(events)
        except Exception as exc:
            lost = sum(1 for e in events if isinstance(e, SessionLocation))
            locations.labels("lost").inc(lost)
            log.warning("recorded checkpoints' events not published", extra={"events": len(events), "error": str(exc)})
            return
        locations.labels("published").inc(sum(1 for e in events if isinstance(e, SessionLocation)))

    async def _journal_failed(self, report: SaveSessionsReport, failed: Sequence[SessionFailure]) -> None:
        """A pod's journal could not write (or have recorded) some sessions' entries: ``checkpoint.failed`` for
        each, the warning an operator sees. The sessions keep their last checkpoint (periodic, or an earlier
        entry); the pod's journal pauses and tries again. What is recorded stands if the events are lost."""
        self.replica.metrics.sessions.labels("journal_failed").inc(len(failed))
        with contextlib.suppress(Exception):
            await self.replica.ctx.bus.publish_many(
                [
                    CheckpointFailed(
                        session_id=f.session_id,
                        reason=f"journal: {f.reason}; its periodic checkpoints stand in"[:REASON_CHARS],
                        node=report.node,
                        pod=report.pod,
                    )
                    for f in failed
                    if is_token(f.session_id)
                ]
            )

    async def on_record(self, report: SaveSessionsReport) -> SaveSessionsReport:
        """Reports handed in (the pod's preStop hook; the earlier parts of a long report): verified, fenced and
        recorded like a drain's. The answer names what is committed, what is confirmed (``kept``) and what
        failed."""
        recorded = await self.record(report, "")
        if report.reason == JOURNAL and recorded.failed:
            await self._journal_failed(report, recorded.failed)
        return SaveSessionsReport(
            pod=report.pod,
            node=report.node,
            store=report.store,
            committed=[c for c in report.committed if c.session_id in recorded.committed],
            failed=recorded.failed,
            unchanged=report.unchanged,
            kept=[c for c in report.kept if c.session_id in recorded.kept],
        )
