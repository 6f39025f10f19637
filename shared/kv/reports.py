"""A save's report on the bus: the agent's report as an event (``report_event``), in parts below the payload limit
(``report_parts``), and recorded by the checkpoint service when the asker is not the service itself
(``record_report``: the pod's preStop hook, and the agent with a long report's parts); the preStop's command."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec

from shared.contract.checkpoint import CommittedCheckpoint, SaveSessions, SaveSessionsReport
from shared.contract.node import SessionFailure
from shared.kv.agent import KvAgent, SaveReport
from shared.kv.manifest import CheckpointManifest
from shared.plumbing.bus import Bus

REPORT_PART = 1000
"""Checkpoints in one save report message; a longer report goes to the checkpoint service in parts."""


def _committed(m: CheckpointManifest) -> CommittedCheckpoint:
    return CommittedCheckpoint(
        session_id=m.session_id,
        checkpoint_id=m.checkpoint_id,
        bytes_total=m.bytes_total,
        bytes_written=m.bytes_written,
        chunks=len(m.blocks),
        token_count=m.token_count,
        generation=m.generation,
        sequence=m.sequence,
        model_version=m.layout.model_version,
    )


def report_event(
    agent: KvAgent, report: SaveReport, confirm_unchanged: bool = False, reason: str = ""
) -> SaveSessionsReport:
    """The agent's report as it goes on the bus; ``confirm_unchanged``: with the sessions passed over in ``kept``;
    ``reason``: what saved (``journal`` for the journal's entries)."""
    return SaveSessionsReport(
        pod=agent.pod,
        node=agent.node,
        store=agent.store.url,
        committed=[_committed(m) for m in report.committed],
        failed=[SessionFailure(session_id=f.session_id, pod=agent.pod, reason=f.reason) for f in report.failed],
        not_held=report.not_held,
        unchanged=report.unchanged,
        kept=[_committed(m) for m in report.kept] if confirm_unchanged else [],
        reason=reason,
    )


def report_parts(report: SaveSessionsReport) -> list[SaveSessionsReport]:
    """The report in parts of at most ``REPORT_PART`` entries each (checkpoints committed or kept, failures,
    sessions not held), the rest of its fields on the last: each part is one message well below the bus's
    payload limit."""
    lists = (report.committed, report.failed, report.not_held, report.kept)
    if sum(len(entries) for entries in lists) <= REPORT_PART:
        return [report]
    parts = []
    committed, failed, not_held, kept = (list(entries) for entries in lists)
    while committed or failed or not_held or kept:
        room = REPORT_PART
        taken = []
        for entries in (committed, failed, not_held, kept):
            taken.append(entries[:room])
            del entries[:room]
            room -= len(taken[-1])
        take_c, take_f, take_n, take_k = taken
        parts.append(
            msgspec.structs.replace(report, committed=take_c, failed=take_f, not_held=take_n, kept=take_k, unchanged=0)
        )
    parts[-1] = msgspec.structs.replace(parts[-1], unchanged=report.unchanged, parts_recorded=len(parts) - 1)
    return parts


async def record_report(bus: Bus, pod: str, report: SaveSessionsReport) -> SaveSessionsReport | None:
    """Have the checkpoint service verify and record ``pod``'s report (``record``), in parts when it is long:
    what it recorded, as one report, or None when it did not answer. What a save's asker does with the reply
    when it is not the checkpoint service (the pod's preStop hook), and what the agent does with the parts of a
    long report before the reply."""
    recorded: list[SaveSessionsReport] = []
    for part in report_parts(report):
        answer: Any = None
        with contextlib.suppress(Exception):
            answer = await bus.request(bus.subjects.agent_command("record", pod), part, 5.0)
        if not isinstance(answer, SaveSessionsReport):
            return None
        recorded.append(answer)
    if len(recorded) == 1:
        return recorded[0]
    return msgspec.structs.replace(
        recorded[-1],
        committed=[c for r in recorded for c in r.committed],
        failed=[f for r in recorded for f in r.failed],
        not_held=[n for r in recorded for n in r.not_held],
        kept=[k for r in recorded for k in r.kept],
    )


def final_save_command(pod: str, deadline_s: float) -> SaveSessions:
    """The pod's last save, as its preStop hook asks for it: every session it holds, only what changed since each
    one's last checkpoint written, the rest named to be confirmed (``confirm_unchanged``). The asker records the
    report."""
    return SaveSessions(pod=pod, deadline_s=deadline_s, reason="prestop", changed_only=True, confirm_unchanged=True)
