"""The KV agent on the mesh: answers the checkpoint service's save commands, announces its sessions, runs
periodic checkpoints, and restores sessions after asking the checkpoint service where they are.

The endpoint speaks only core NATS request/reply (the agent lives in an inference pod with a narrow NATS user);
lifecycle events about checkpoints are published by the checkpoint service, which records what agents report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from shared.contract.checkpoint import (
    AgentSessions,
    CheckpointLocation,
    CommittedCheckpoint,
    LocateCheckpoint,
    SaveProgress,
    SaveSessions,
    SaveSessionsReport,
    SessionRestored,
)
from shared.contract.node import SessionFailure
from shared.kv.agent import KvAgent, RestoredSession, SaveReport
from shared.kv.store import CheckpointNotFound
from shared.plumbing.bus import Bus

log = logging.getLogger(__name__)


def report_event(agent: KvAgent, report: SaveReport) -> SaveSessionsReport:
    return SaveSessionsReport(
        pod=agent.pod,
        node=agent.node,
        store=agent.store.url,
        committed=[
            CommittedCheckpoint(
                session_id=m.session_id,
                checkpoint_id=m.checkpoint_id,
                bytes_total=m.bytes_total,
                bytes_written=m.bytes_written,
                chunks=len(m.blocks),
                token_count=m.token_count,
            )
            for m in report.committed
        ],
        failed=[SessionFailure(session_id=f.session_id, pod=agent.pod, reason=f.reason) for f in report.failed],
    )


class AgentEndpoint:
    def __init__(self, agent: KvAgent, bus: Bus, announce_s: float = 5.0) -> None:
        self.agent = agent
        self.bus = bus
        self.announce_s = announce_s
        self._tasks: list[asyncio.Task[Any]] = []
        self._announced: tuple[str, ...] | None = None
        self._changed = asyncio.Event()

    async def start(self, periodic_s: float = 0.0) -> None:
        subjects = self.bus.subjects
        await self.bus.serve(subjects.for_event(SaveSessions(pod=self.agent.pod)), self.on_save, (SaveSessions,))
        await self.announce()
        self._tasks.append(asyncio.create_task(self._announce_loop(), name=f"kv-announce-{self.agent.pod}"))
        if periodic_s > 0:
            self._tasks.append(asyncio.create_task(self._periodic(periodic_s), name=f"kv-periodic-{self.agent.pod}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)

    def sessions_changed(self) -> None:
        """Tell the endpoint the engine added or ended sessions; the registry hears of it promptly."""
        self._changed.set()

    async def on_save(self, command: SaveSessions) -> SaveSessionsReport:
        """Idempotent: a repeated save of unchanged sessions commits checkpoints that write no new bytes."""
        started = time.monotonic()

        async def progress(so_far: SaveReport, total: int) -> None:
            with contextlib.suppress(Exception):
                await self.bus.publish(
                    SaveProgress(
                        pod=self.agent.pod,
                        drain_id=command.drain_id,
                        sessions_done=len(so_far.committed),
                        sessions_failed=len(so_far.failed),
                        sessions_total=total,
                        bytes_done=so_far.bytes_total,
                    )
                )

        report = await self.agent.save(command.session_ids or None, command.deadline_s, command.reason, progress)
        log.info(
            "saved",
            extra={
                "pod": self.agent.pod,
                "drain_id": command.drain_id,
                "committed": len(report.committed),
                "failed": len(report.failed),
                "bytes": report.bytes_total,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        event = report_event(self.agent, report)
        if not command.drain_id and event.committed:  # a drain's saves are recorded by the service that asked
            await self._record(event)
        return event

    async def _record(self, event: SaveSessionsReport) -> None:
        with contextlib.suppress(Exception):
            await self.bus.request(self.bus.subjects.command("checkpoint", "record"), event, 5.0)

    async def announce(self) -> None:
        sessions = tuple(sorted(self.agent.sessions()))
        await self.bus.publish(
            AgentSessions(
                pod=self.agent.pod,
                node=self.agent.node,
                namespace=self.agent.namespace,
                deployment=self.agent.deployment,
                sessions=list(sessions),
                bytes_held=sum(self.agent.session_bytes(s) for s in sessions),
            )
        )
        with contextlib.suppress(Exception):
            await self.bus.nc.flush(timeout=2)
        self._announced = sessions

    async def _announce_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.announce_s)
            self._changed.clear()
            try:
                await self.announce()
            except Exception as exc:
                log.warning("session announcement failed", extra={"error": str(exc)})
            await asyncio.sleep(0.05)  # coalesce bursts of session changes

    async def _periodic(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            report = await self.agent.save(reason="periodic")
            if report.committed:
                await self._record(report_event(self.agent, report))

    async def final_save(self, deadline_s: float) -> SaveSessionsReport:
        """The preStop hook's save: everything the pod holds, recorded by the checkpoint service."""
        report = report_event(self.agent, await self.agent.save(deadline_s=deadline_s, reason="prestop"))
        await self._record(report)
        return report

    async def restore(
        self, session_id: str, into: Sequence[Any] | None = None, timeout: float = 10.0
    ) -> RestoredSession:
        """Ask the checkpoint service for the session's newest checkpoint, restore it verified, report it."""
        started = time.monotonic()
        answer = await self.bus.request(
            self.bus.subjects.command("checkpoint", "locate"),
            LocateCheckpoint(session_id=session_id, pod=self.agent.pod, node=self.agent.node),
            timeout,
        )
        if not isinstance(answer, CheckpointLocation) or not answer.found:
            reason = getattr(answer, "reason", "") or "no committed checkpoint"
            raise CheckpointNotFound(f"session {session_id!r}: {reason}")
        restored = await self.agent.restore(session_id, answer.checkpoint_id)
        self.sessions_changed()
        with contextlib.suppress(Exception):
            await self.bus.request(
                self.bus.subjects.command("checkpoint", "restored"),
                SessionRestored(
                    session_id=session_id,
                    checkpoint_id=restored.manifest.checkpoint_id,
                    node=self.agent.node,
                    pod=self.agent.pod,
                    bytes_total=restored.manifest.bytes_total,
                    duration_s=time.monotonic() - started,
                ),
                5.0,
            )
        return restored
