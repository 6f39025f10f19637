"""The one drain client: how anything in gpuwarden asks the checkpoint service to save every session on a node, and
learns its answer. The CLI (``gpuwarden drain`` in ``shared.console.operations``, ``gpuwarden checkpoint`` in
``shared.console.nodes``, the drains of ``gpuwarden status``), the driver's upgrade coordinator and the device
service's MIG controller all drain through it; nothing else in gpuwarden names a drain, publishes
``DrainRequested`` or looks a verdict up (the benchmarks and tests publish requests of their own, as any other
system may).

A drain's life, as the caller sees it:

1. **Name it** (``new_id``): ``<what asks>-<node>[-<detail>...]-<unique>``, such as ``drain-node-1-3f9a0c12``
   (the CLI), ``upgrade-node-1-7-1700000000000`` (the driver: its fencing token, then the time) or
   ``mig-node-1-all-1g_10gb-v3-5d1e22ab`` (the MIG controller: the layout and the document's version). A service
   writes the name where a restart finds it (a node annotation) *before* asking, so a process that dies in
   between asks the same drain again instead of a second one.
2. **Check it** (``drain_request``, for a command): the request as the checkpoint service would take it, refused
   (``InvalidDrain``) before anything is cordoned or published.
3. **Listen** (``watch``, for a command; a service consumes ``node.drain.completed`` / ``node.drain.failed``
   durably instead): from before the request goes out, so no verdict is missed.
4. **Ask** (``ask``): publish ``DrainRequested``. The checkpoint service runs a drain id once and answers a decided
   one with its verdict again, so asking again is harmless; ``asked`` says whether this process has sent it.
5. **Wait for the verdict**: ``DrainCompleted`` or ``DrainFailed``, handed in with ``settle`` (by the watch, or by
   the MIG controller's consumer; the driver's replicas ask the checkpoint service, which keeps the one stored
   copy, each pass: ``recorded_verdict``); ``waited_s`` says for how long. A watch also reads the verdicts stored
   in the events stream since it began, so one published while the connection failed over is not missed
   (``wait_verdict``).
6. **Ask again after a restart**: a drain found named but not ``asked`` by this process is asked again (the
   caller calls ``ask`` whenever ``asked`` is false).
7. **Clear it** (``forget``) once its verdict is used, or no longer wanted: its verdict, should it come later, is
   never used for a later change.

``newest_drain`` looks a node's newest drain and its verdict up in the events stream (``gpuwarden status``).

Not safe for concurrent use from several tasks beyond asyncio's single thread; each caller has its own client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec

from shared.contract.base import Event
from shared.contract.node import DrainCompleted, DrainFailed, DrainQuery, DrainRequested, DrainState, deadline_problem
from shared.contract.registry import codec
from shared.plumbing.errors import TemporaryError

if TYPE_CHECKING:
    from shared.plumbing.bus import Bus

log = logging.getLogger(__name__)

Verdict = DrainCompleted | DrainFailed

ID_CHARS = 128
"""The longest drain id the contract takes (``shared.contract.base.ID_RULES``)."""
UNIQUE_CHARS = 8
"""Random hex digits that end a drain id when the caller gives no unique suffix of its own."""
MAX_ID_CHARS = ID_CHARS - UNIQUE_CHARS - 1
"""The readable part of a drain id is cut to this before the random suffix (shorter before a longer suffix)."""
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9_-]")
VERDICT_KINDS = ("node.drain.completed", "node.drain.failed")
STORED_READ_S = 1.0
"""How often a watch also reads the verdicts stored in the events stream (what its connection may have missed)."""


class InvalidDrain(ValueError):
    """A drain request the checkpoint service would refuse (the message says why): nothing was sent."""


def new_id(readable: str, unique: str | None = None) -> str:
    """A new drain id: ``readable`` (``<what asks>-<node>[-<detail>...]``; what a drain id may not hold, such as
    the dots of a node's DNS name, written as ``_``; cut to fit) and a suffix never used before (``unique``, or 8
    random hex digits): the checkpoint service answers an id only once, so a new attempt needs a new id."""
    suffix = unique if unique is not None else uuid.uuid4().hex[:UNIQUE_CHARS]
    return f"{_NOT_IN_ID.sub('_', readable)[: ID_CHARS - 1 - len(suffix)]}-{suffix}"


def drain_request(node: str, drain_id: str, reason: str, requested_by: str, deadline_s: float) -> DrainRequested:
    """The request as ``DrainClient.ask`` sends it, checked as any consumer checks it: ``InvalidDrain`` says why
    the checkpoint service would refuse it (a deadline it cannot keep, a field out of its rule)."""
    problem = deadline_problem(deadline_s)
    if problem:
        raise InvalidDrain(problem)
    try:
        request = DrainRequested(
            node=node, drain_id=drain_id, reason=reason, requested_by=requested_by, deadline_s=deadline_s
        )
        msgspec.json.decode(codec.encode(request), type=DrainRequested)
    except msgspec.ValidationError as exc:
        raise InvalidDrain(str(exc)) from None
    return request


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

    new_id = staticmethod(new_id)

    def __init__(
        self, publish: Callable[[Event], Awaitable[None]], requested_by: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.publish = publish
        self.requested_by = requested_by
        self.clock = clock
        self._drains: dict[str, Drain] = {}

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
        raises, and the drain stays un-asked, to be asked again. Idempotent for the checkpoint service, which
        answers a request it cannot run (a deadline out of range) with its failed verdict."""
        drain = self.follow(drain_id, node)
        await self.publish(
            DrainRequested(
                node=node, drain_id=drain_id, reason=reason, requested_by=self.requested_by, deadline_s=deadline_s
            )
        )
        drain.published = True
        log.info("drain requested", extra={"node": node, "drain_id": drain_id, "reason": reason})
        return drain

    def watch(self, bus: Bus, drain_id: str, node: str) -> VerdictWatch:
        """Listen for the verdict of ``drain_id`` (an ``async with`` around ``ask``): it settles the drain."""
        return VerdictWatch(bus, node, drain_id, self.settle)

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


class VerdictWatch:
    """The verdict of one drain, for a command that waits for it: entered before the request is published, it
    hears the node's verdicts on the bus and notes where the events stream ends, so ``wait`` finds the verdict
    whether it was heard or only stored (published while this connection failed over to another server)."""

    def __init__(self, bus: Bus, node: str, drain_id: str, settle: Callable[[Verdict], object] | None = None) -> None:
        self.bus = bus
        self.node = node
        self.drain_id = drain_id
        self._settle = settle
        self._heard: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._subs: list[Any] = []
        self.since_seq = 0

    async def __aenter__(self) -> VerdictWatch:
        async def on_verdict(event: Verdict) -> None:
            if event.drain_id == self.drain_id and not self._heard.done():
                self._heard.set_result(event)

        s = self.bus.subjects
        try:
            completed, failed = (s.pattern(kind, node=self.node) for kind in VERDICT_KINDS)
            self._subs.append(await self.bus.subscribe(completed, on_verdict, (DrainCompleted,)))
            self._subs.append(await self.bus.subscribe(failed, on_verdict, (DrainFailed,)))
            self.since_seq = await stream_end(self.bus)
        except BaseException:
            await self._close()
            raise
        return self

    async def wait(self, timeout: float) -> Verdict:
        """The verdict, once heard or stored; ``TimeoutError`` after ``timeout`` seconds without one."""
        verdict = await wait_verdict(self.bus, self.node, self.drain_id, self._heard, timeout, self.since_seq)
        if self._settle is not None:
            self._settle(verdict)
        return verdict

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()


async def wait_verdict(
    bus: Bus, node: str, drain_id: str, heard: asyncio.Future[Any], timeout: float, since_seq: int = 0
) -> Verdict:
    """The drain's verdict: as heard on the bus (``heard``), or as stored in the events stream after sequence
    ``since_seq``. A verdict published while the connection was failing over to another server is not heard (core
    NATS does not keep it), so the stream is read every ``STORED_READ_S`` too, from where the last read ended."""
    cursors = {bus.subjects.pattern(kind, node=node): since_seq + 1 for kind in VERDICT_KINDS}
    end = time.monotonic() + timeout
    while True:
        with contextlib.suppress(TimeoutError):
            left = max(0.0, min(STORED_READ_S, end - time.monotonic()))
            return await asyncio.wait_for(asyncio.shield(heard), timeout=left)
        found = await _stored_verdict(bus, drain_id, cursors)
        if found is not None:
            return found
        if time.monotonic() >= end:
            raise TimeoutError(drain_id)


async def _stored_verdict(bus: Bus, drain_id: str, cursors: dict[str, int]) -> Verdict | None:
    """The verdict of ``drain_id`` among the messages stored on the subjects of ``cursors`` (one node's verdicts)
    from each cursor on; the cursors move past what was read. None when there is none yet, or the stream cannot be
    read now. What it reads follows the node's verdicts since the cursors, never the fleet's."""
    stream = bus.subjects.events_stream.name
    for subject in cursors:
        while True:
            try:
                raw = await bus.js.get_msg(stream, seq=cursors[subject], subject=subject, next=True)
            except Exception:  # none after the cursor, or the stream not answering now: read again next time
                break
            cursors[subject] = (raw.seq or cursors[subject]) + 1
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
                event = codec.decode(raw.data or b"")
                if isinstance(event, DrainCompleted | DrainFailed) and event.drain_id == drain_id:
                    return event
    return None


async def last_verdict(bus: Bus, node: str) -> Verdict | None:
    """The newest verdict stored for ``node`` in the events stream (completed or failed, whichever came last), None
    when there is none or the stream cannot be read now. Two reads, whatever the fleet holds."""
    stream = bus.subjects.events_stream.name
    newest: tuple[int, Verdict] | None = None
    for kind in VERDICT_KINDS:
        try:
            raw = await bus.js.get_last_msg(stream, bus.subjects.pattern(kind, node=node))
            event = codec.decode(raw.data or b"")
        except Exception:  # none stored, undecodable, or the stream not answering
            continue
        if isinstance(event, DrainCompleted | DrainFailed) and (newest is None or (raw.seq or 0) > newest[0]):
            newest = (raw.seq or 0, event)
    return newest[1] if newest else None


class VerdictUnknown(TemporaryError):
    """The checkpoint service did not say what became of a drain (not running, or its Redis away): not known now,
    which is never "no verdict"; ask again later."""


async def recorded_verdict(bus: Bus, drain_id: str, timeout: float = 2.0, node: str = "") -> Verdict | None:
    """The verdict the checkpoint service recorded for ``drain_id`` (its one stored copy), None while it has none.
    One request; with the drain's ``node``, a verdict Redis lost is found in the events stream. Raises
    ``VerdictUnknown`` when the service does not answer within ``timeout``."""
    query = DrainQuery(drain_id=drain_id, node=node)
    try:
        answer = await bus.request(bus.subjects.command("checkpoint", "drain"), query, timeout)
    except TimeoutError as exc:
        raise VerdictUnknown(f"the checkpoint service did not answer for drain {drain_id}: {exc}") from exc
    if not isinstance(answer, DrainState) or answer.drain_id != drain_id:
        raise VerdictUnknown(f"drain {drain_id}: the checkpoint service answered {answer.kind}")
    return answer.verdict


async def stream_end(bus: Bus) -> int:
    """The events stream's last sequence now (0 when it cannot be read): what is stored later is newer."""
    try:
        info = await bus.js.stream_info(bus.subjects.events_stream.name)
    except Exception:
        return 0
    return int(info.state.last_seq or 0)


@dataclass(frozen=True, slots=True)
class StoredDrain:
    """A drain as the events stream holds it: its newest request, and its verdict once it has one."""

    request: DrainRequested
    verdict: Verdict | None = None


async def newest_drain(bus: Bus, node: str) -> StoredDrain | None:
    """The newest drain asked for ``node`` and its verdict (the first stored after the request), from the events
    stream; None when none is stored or the stream cannot be read. Costs one read, plus one per verdict of the
    node stored after that request."""
    stream = bus.subjects.events_stream.name
    try:
        raw = await bus.js.get_last_msg(stream, bus.subjects.pattern("node.drain.requested", node=node))
        request = codec.decode(raw.data or b"")
    except Exception:  # none stored, undecodable, or the stream not answering
        return None
    if not isinstance(request, DrainRequested):
        return None
    cursors = {bus.subjects.pattern(kind, node=node): (raw.seq or 0) + 1 for kind in VERDICT_KINDS}
    return StoredDrain(request, await _stored_verdict(bus, request.drain_id, cursors))
