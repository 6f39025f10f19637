"""A drain's save as the KV agents report it: ``checkpoint.save.progress`` (published by each pod's agent after each
committed round of a save and at its end, ``shared.kv.endpoint``) of one drain, summed over the drained node's pods,
for ``gpuwarden drain`` to draw while it waits for the verdict.

The checkpoint service asks a pod for its sessions in batches (one save command each), and each save reports its
own counts from zero: a pod's total is its finished batches plus the current one. A batch is finished when its
sessions are all committed or failed; the next event of the pod starts the next one. Progress travels on core NATS
(heard only while listening, never stored): what is shown is a lower bound, never past the sessions asked for, and
the verdict, not this, says what was saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shared.contract.checkpoint import SaveProgress
from shared.plumbing.bus import Bus


@dataclass
class _PodSaves:
    finished_done: int = 0
    finished_bytes: int = 0
    current: SaveProgress | None = None

    def add(self, event: SaveProgress) -> None:
        last = self.current
        if last is not None and (
            last.sessions_done + last.sessions_failed >= last.sessions_total
            or (event.sessions_done < last.sessions_done)
        ):
            self.finished_done += last.sessions_done
            self.finished_bytes += last.bytes_done
        self.current = event

    @property
    def done(self) -> int:
        return self.finished_done + (self.current.sessions_done if self.current else 0)

    @property
    def bytes_done(self) -> int:
        return self.finished_bytes + (self.current.bytes_done if self.current else 0)


class SaveProgressListener:
    """Entered before the drain is asked for, it hears the progress of ``drain_id``'s saves on ``pods`` (one
    subscription per pod: what the drained node holds, never the fleet's) and calls ``on_change(sessions saved,
    bytes saved)`` as it grows."""

    def __init__(self, bus: Bus, drain_id: str, pods: Iterable[str], on_change: Callable[[int, int], None]) -> None:
        self.bus = bus
        self.drain_id = drain_id
        self.pods = sorted(set(pods))
        self.on_change = on_change
        self._saves: dict[str, _PodSaves] = {}
        self._subs: list[Any] = []

    @property
    def sessions_done(self) -> int:
        return sum(p.done for p in self._saves.values())

    @property
    def bytes_done(self) -> int:
        return sum(p.bytes_done for p in self._saves.values())

    async def __aenter__(self) -> SaveProgressListener:
        s = self.bus.subjects
        try:
            for pod in self.pods:
                self._subs.append(
                    await self.bus.subscribe(s.pattern("checkpoint.save.progress", pod=pod), self._on, (SaveProgress,))
                )
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def _close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def _on(self, event: SaveProgress) -> None:
        if event.drain_id != self.drain_id or event.pod not in self.pods:
            return
        self._saves.setdefault(event.pod, _PodSaves()).add(event)
        self.on_change(self.sessions_done, self.bytes_done)
