"""The one drain client: how a service asks the checkpoint service to save every session on a node, and follows
its answer. The driver's upgrade coordinator and the device service's MIG controller both drain through it.

A drain's life, as the caller sees it:

1. **Name it** (``new_id``) and write the name where a restart finds it (the caller's job: a node annotation)
   *before* asking, so a process that dies in between asks the same drain again instead of a second one.
2. **Ask** (``ask``): publish ``DrainRequested``. The checkpoint service runs a drain id once, so asking again is
   harmless; ``asked`` says whether this process has sent it.
3. **Wait for the verdict**: ``DrainCompleted`` or ``DrainFailed``, handed in with ``settle`` (from the caller's
   consumer of ``node.drain.completed`` / ``node.drain.failed``); ``waited_s`` says for how long.
4. **Ask again after a restart**: a drain found named but not ``asked`` by this process is asked again (the
   caller calls ``ask`` whenever ``asked`` is false).
5. **Clear it** (``forget``) once its verdict is used, or no longer wanted: its verdict, should it come later, is
   never used for a later change.

Not safe for concurrent use from several tasks beyond asyncio's single thread; each caller has its own.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.contract.base import Event
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested

log = logging.getLogger(__name__)

Verdict = DrainCompleted | DrainFailed

MAX_ID_CHARS = 240
"""A drain id is a subject token; the readable part is cut to this before the unique suffix."""


@dataclass(slots=True)
class Drain:
    """A drain this process follows. ``published``: sent by this process (one adopted from the node after a
    restart is not, and is sent again); ``verdict``: the checkpoint service's answer, once it came."""

    drain_id: str
    node: str
    asked_at: float
    published: bool = False
    verdict: Verdict | None = None


class DrainClient:
    """Names, asks, follows and clears drains for one caller (``requested_by``), publishing with ``publish``."""

    def __init__(
        self, publish: Callable[[Event], Awaitable[None]], requested_by: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.publish = publish
        self.requested_by = requested_by
        self.clock = clock
        self._drains: dict[str, Drain] = {}

    @staticmethod
    def new_id(readable: str, unique: str | None = None) -> str:
        """A new drain id: ``readable`` (cut to fit) and a suffix never used before (``unique``, or 8 random hex
        digits): the checkpoint service answers an id only once, so a new attempt needs a new id."""
        return f"{readable[:MAX_ID_CHARS]}-{unique if unique is not None else uuid.uuid4().hex[:8]}"

    def follow(self, drain_id: str, node: str) -> Drain:
        """The drain ``drain_id`` of ``node``, followed from now (its wait starts now) or as already followed."""
        drain = self._drains.get(drain_id)
        if drain is None:
            drain = self._drains[drain_id] = Drain(drain_id, node, self.clock())
        return drain

    def asked(self, drain_id: str) -> bool:
        """Whether this process has published the drain (a restarted one has not: it asks again)."""
        drain = self._drains.get(drain_id)
        return drain is not None and drain.published

    async def ask(self, drain_id: str, node: str, reason: str, deadline_s: float) -> Drain:
        """Publish ``DrainRequested`` for the drain (followed from now if it was not); raises what publishing
        raises, and the drain stays un-asked, to be asked again. Idempotent for the checkpoint service."""
        drain = self.follow(drain_id, node)
        await self.publish(
            DrainRequested(
                node=node, drain_id=drain_id, reason=reason, requested_by=self.requested_by, deadline_s=deadline_s
            )
        )
        drain.published = True
        log.info("drain requested", extra={"node": node, "drain_id": drain_id, "reason": reason})
        return drain

    def settle(self, verdict: Verdict) -> Drain | None:
        """Record a verdict. Returns the drain it decides when this process follows that drain and had no verdict
        for it yet; None for a verdict seen again, or for a drain not (or no longer) followed. Idempotent."""
        drain = self._drains.get(verdict.drain_id)
        if drain is None or drain.verdict is not None or drain.node != verdict.node:
            return None
        drain.verdict = verdict
        return drain

    def waited_s(self, drain: Drain) -> float:
        """How long the drain has been followed without being forgotten."""
        return self.clock() - drain.asked_at

    def forget(self, drain_id: str) -> None:
        """Stop following the drain: a verdict that comes later is not used (``settle`` returns None)."""
        self._drains.pop(drain_id, None)
