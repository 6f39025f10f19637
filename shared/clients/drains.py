"""The one drain client: how anything in gpuwarden drains a node as a caller sees it, and learns the drain's
verdict. The CLI (``gpuwarden drain`` in ``shared.console.operations``, ``gpuwarden checkpoint`` in
``shared.console.nodes``, the drains of ``gpuwarden status``), the driver's upgrade coordinator and the device
service's MIG controller all drain through it, adding only what is theirs (the CLI its presentation and the follow
of the sessions to their new pods; the coordinator its fenced upgrade states; the MIG controller its layout);
nothing else in gpuwarden names a drain, publishes ``DrainRequested`` or asks for a verdict (the benchmarks and
tests publish requests of their own, as any other system may).

A drain's life, as the caller sees it:

1. **Name it** (``new_id``): ``<what asks>-<node>[-<detail>...]-<unique>``, such as ``drain-node-1-3f9a0c12``
   (the CLI), ``upgrade-node-1-7-1700000000000`` (the driver: its fencing token, then the time) or
   ``mig-node-1-all-1g_10gb-v3-5d1e22ab`` (the MIG controller: the layout and the document's version), and write
   the name on the node (``name_on_node``; the CLI's ``cordon`` writes it with the cordon) *before* asking, so a
   process that dies in between asks the same drain again instead of a second one. The annotations are the
   contract's (``shared.contract.annotations``).
2. **Check it** (``drain_request``, for a command): the request as the checkpoint service would take it, refused
   (``InvalidDrain``) before anything is cordoned or published.
3. **Be woken** (``VerdictWake``, opened before asking): a subscription to the node's verdict events, and the
   connection's reconnects. It only wakes the caller; it never hands it a verdict.
4. **Ask** (``ask``): publish ``DrainRequested``. The checkpoint service runs a drain id once and answers a decided
   one with its verdict again, so asking again is harmless; ``asked`` says whether this process has sent it, and a
   drain found named but not asked by this process (after a restart) is asked again.
5. **Learn the verdict** (``verdict``): from the one source, the checkpoint service's record of the drain, asked
   with ``node.drain.query`` (``RecordReader``): when woken, after a reconnect, at a caller's pass, and at the end
   of a wait (``VerdictWatch.wait``). ``VerdictUnknown`` when the service does not answer: never "no verdict".
6. **Forget it** (``forget``, and ``clear_name`` for the node's annotation) once its verdict is used, or no longer
   wanted: a verdict that comes later is never used for a later change.
7. **Evict** the node's pods (``empty_node`` for a command, one round per pass for a controller): the Eviction API
   with the PodDisruptionBudget back-off of ``shared.clients.evictions``.

``drain_node`` runs 1-7 in order for a command (``gpuwarden drain``). ``newest_drain`` finds a node's newest drain
in the events stream and asks its record for its verdict (``gpuwarden status``), ``newest_drains`` those of many
nodes at once.

Not safe for concurrent use from several tasks beyond asyncio's single thread; each caller has its own client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from shared.clients.evictions import COMMAND_BACKOFF, COMMAND_POLL_S, evict_pods
from shared.contract.annotations import CORDON_DRAIN_ANNOTATION, UPGRADE_STATE_LABEL, UPGRADE_WAS_CORDONED_ANNOTATION
from shared.contract.base import Event
from shared.contract.node import (
    DrainCompleted,
    DrainFailed,
    DrainQuery,
    DrainRecord,
    DrainRequested,
    DrainVerdict,
    NodeCordoned,
    deadline_problem,
)
from shared.contract.registry import codec
from shared.plumbing.errors import TemporaryError
from shared.plumbing.newest import StoredMessage, newest_messages
from shared.plumbing.retries import DRAIN_RECORD
from shared.ports.cluster import ClusterConflict, ClusterPort, NodeInfo

if TYPE_CHECKING:
    from shared.plumbing.bus import Bus

log = logging.getLogger(__name__)

ID_CHARS = 128
"""The longest drain id the contract takes (``shared.contract.base.ID_RULES``)."""
UNIQUE_CHARS = 8
"""Random hex digits that end a drain id when the caller gives no unique suffix of its own."""
MAX_ID_CHARS = ID_CHARS - UNIQUE_CHARS - 1
"""The readable part of a drain id is cut to this before the random suffix (shorter before a longer suffix)."""
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9_-]")
VERDICT_KINDS = ("node.drain.completed", "node.drain.failed")
RECORD_TIMEOUT_S = 2.0
"""How long one question to the drain's record waits for the checkpoint service's answer."""

UNCORDON_FREE_STATES = ("", "upgrade-required", "upgrade-done")
"""Driver upgrade states in which the upgrade holds no cordon of its own (``upgrade-required`` waits for a slot
and has cordoned nothing): a person may uncordon the node without ``--force``, and a cordon by a person in any
other state is marked so that the upgrade leaves the node cordoned when it is done."""
_CAS_TRIES = 5


class InvalidDrain(ValueError):
    """A drain request the checkpoint service would refuse (the message says why): nothing was sent."""


class NodeKeptChanging(RuntimeError):
    """The node was written by someone else at every try of a compare-and-set: nothing was written."""


class VerdictUnknown(TemporaryError):
    """The checkpoint service did not say what became of a drain (not running, or its Redis away): not known now,
    which is never "no verdict"; ask again later."""


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


# -- the verdict: the checkpoint service's record, asked for ---------------------------------------------------------
async def recorded_verdict(
    bus: Bus, drain_id: str, timeout: float = RECORD_TIMEOUT_S, node: str = ""
) -> DrainVerdict | None:
    """The verdict the checkpoint service recorded for ``drain_id`` (its one stored copy), None while it has none.
    One request; with the drain's ``node``, a verdict Redis lost is found by the service in the events stream.
    Raises ``VerdictUnknown`` when the service does not answer within ``timeout``."""
    query = DrainQuery(drain_id=drain_id, node=node)
    try:
        answer = await bus.request(bus.subjects.command("checkpoint", "drain"), query, timeout)
    except TimeoutError as exc:
        raise VerdictUnknown(f"the checkpoint service did not answer for drain {drain_id}: {exc}") from exc
    if not isinstance(answer, DrainRecord) or answer.drain_id != drain_id:
        raise VerdictUnknown(f"drain {drain_id}: the checkpoint service answered {answer.kind}")
    return answer.verdict


class VerdictReader(Protocol):
    """Reads a drain's verdict where it is kept once: the checkpoint service's record."""

    async def read(self, drain_id: str, node: str = "") -> DrainVerdict | None:
        """The drain's verdict, None while it has none (``node``: the drain's, so that a verdict Redis lost is
        found in the events stream). Raises ``VerdictUnknown`` when the record cannot be read now."""
        ...


class RecordReader:
    """``VerdictReader`` over the bus: one ``node.drain.query`` per read, answered from the checkpoint service's
    registry by whichever replica takes it (every replica and every caller reads the same record)."""

    def __init__(self, bus: Bus, timeout_s: float = RECORD_TIMEOUT_S) -> None:
        self.bus = bus
        self.timeout_s = timeout_s

    async def read(self, drain_id: str, node: str = "") -> DrainVerdict | None:
        return await recorded_verdict(self.bus, drain_id, self.timeout_s, node)


class VerdictWake:
    """Wakes its owner when a verdict of ``node`` is published (``wake(drain_id)``; with ``drain_id`` given, for
    that drain only) and when the bus's connection reconnects (``wake("")``: what was published meanwhile was not
    heard): a subscription that only wakes, never hands over a verdict; the owner asks the record. Opened before
    the drain is asked, so no wake is missed; the owner asks the record once more at its end anyway."""

    def __init__(self, bus: Bus, node: str, wake: Callable[[str], None], drain_id: str = "") -> None:
        self.bus = bus
        self.node = node
        self.drain_id = drain_id
        self._wake = wake
        self._subs: list[Any] = []
        self._relinks: asyncio.Task[None] | None = None

    async def open(self) -> VerdictWake:
        async def on_verdict(event: DrainVerdict) -> None:
            if event.node == self.node and (not self.drain_id or event.drain_id == self.drain_id):
                self._wake(event.drain_id)

        verdicts: tuple[tuple[str, type[Event]], ...] = (
            ("node.drain.completed", DrainCompleted),
            ("node.drain.failed", DrainFailed),
        )
        try:
            for kind, accepts in verdicts:
                pattern = self.bus.subjects.pattern(kind, node=self.node)
                self._subs.append(await self.bus.subscribe(pattern, on_verdict, (accepts,)))
        except BaseException:
            await self.close()
            raise
        self._relinks = asyncio.create_task(self._on_relinks(), name=f"drain-wake-{self.node}")
        return self

    async def _on_relinks(self) -> None:
        while True:
            await self.bus.relinks.next().wait()
            self._wake("")

    async def close(self) -> None:
        if self._relinks is not None:
            self._relinks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._relinks
            self._relinks = None
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def __aenter__(self) -> VerdictWake:
        return await self.open()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


# -- the drains one caller follows ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Drain:
    """A drain this process follows. ``published``: sent by this process (one adopted from the node after a
    restart is not, and is sent again); ``verdict``: the checkpoint service's recorded answer, once read."""

    drain_id: str
    node: str
    asked_at: float
    published: bool = False
    verdict: DrainVerdict | None = None


class DrainClient:
    """Names, asks, follows and clears drains for one caller (``requested_by``), publishing with ``publish`` and
    reading verdicts with ``record`` (the checkpoint service's record: ``RecordReader``; None for a caller that
    asks no verdict, whose ``verdict`` is always unknown)."""

    new_id = staticmethod(new_id)

    def __init__(
        self,
        publish: Callable[[Event], Awaitable[None]],
        requested_by: str,
        record: VerdictReader | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.publish = publish
        self.requested_by = requested_by
        self.record = record
        self.clock = clock
        self._drains: dict[str, Drain] = {}

    # naming
    async def name_on_node(
        self,
        cluster: ClusterPort,
        node: str,
        annotation: str,
        drain_id: str,
        *,
        expect: str = "",
        stamp: Mapping[str, str] | None = None,
    ) -> NodeInfo:
        """Write the drain's name on the node (``annotation``: the caller's, from ``shared.contract.annotations``)
        before asking it; ``expect`` and ``stamp``: a compare-and-set on the node's revision and what else the
        caller writes with it (the driver's fencing token). Raises what the cluster port raises."""
        return await cluster.update_node(node, annotations={**(stamp or {}), annotation: drain_id}, expect=expect)

    async def clear_name(
        self,
        cluster: ClusterPort,
        node: str,
        annotation: str,
        *,
        expect: str = "",
        stamp: Mapping[str, str] | None = None,
    ) -> NodeInfo:
        """Remove the drain's name from the node (once its verdict is used, or it is no longer wanted)."""
        return await cluster.update_node(node, annotations={**(stamp or {}), annotation: None}, expect=expect)

    async def cordon(self, cluster: ClusterPort, node: str, drain_id: str = "", by: str = "cli") -> None:
        """Cordon ``node`` and name the drain on it (``CORDON_DRAIN_ANNOTATION``, so the driver's coordinator asks
        no second one) in one compare-and-set write, then publish ``NodeCordoned``. A node a driver upgrade holds
        is marked as cordoned by a person too, so the upgrade leaves it cordoned when it is done, as it does a node
        cordoned before it began. ``NodeKeptChanging`` when the node changed under every try."""
        for _ in range(_CAS_TRIES):
            info = await cluster.node(node)
            if info is None:
                break
            annotations = {CORDON_DRAIN_ANNOTATION: drain_id} if drain_id else {}
            if info.labels.get(UPGRADE_STATE_LABEL, "") not in UNCORDON_FREE_STATES:
                annotations[UPGRADE_WAS_CORDONED_ANNOTATION] = "true"
            try:
                await cluster.update_node(
                    node, annotations=annotations or None, schedulable=False, expect=info.revision
                )
                break
            except ClusterConflict:
                continue  # the driver wrote the node meanwhile: read it again
        else:
            raise NodeKeptChanging(f"{node} kept changing under this command; try again")
        await self.publish(NodeCordoned(node=node, by=by, reason=f"drain {drain_id}" if drain_id else ""))

    # asking and following
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

    async def verdict(self, drain_id: str, node: str) -> DrainVerdict | None:
        """The drain's verdict as its record holds it (one question), None while it has none; a followed drain
        keeps the first one read (its node must match). Raises ``VerdictUnknown`` when the record cannot be read
        now. Idempotent."""
        drain = self._drains.get(drain_id)
        if drain is not None and drain.verdict is not None:
            return drain.verdict
        if self.record is None:
            raise VerdictUnknown(f"drain {drain_id}: this client reads no drain record")
        found = await self.record.read(drain_id, node)
        if found is None or found.node != node:
            return None
        if drain is not None and drain.node == node:
            drain.verdict = found
        return found

    def watch(self, bus: Bus, drain_id: str, node: str) -> VerdictWatch:
        """Wait for the verdict of ``drain_id`` (an ``async with`` around ``ask``)."""
        return VerdictWatch(self, bus, drain_id, node)

    def waited_s(self, drain: Drain) -> float:
        """How long the drain has been followed without being forgotten."""
        return self.clock() - drain.asked_at

    def forget(self, drain_id: str) -> None:
        """Stop following the drain: a verdict read later is not kept for it."""
        self._drains.pop(drain_id, None)


class VerdictWatch:
    """The verdict of one drain, for a command that waits for it: entered before the request is published, it is
    woken by the drain's verdict event and by reconnects (``VerdictWake``), and each time asks the record, which
    ``wait`` also asks on entry and once more at its end (a wake lost with a connection costs nothing)."""

    def __init__(self, client: DrainClient, bus: Bus, drain_id: str, node: str) -> None:
        self.client = client
        self.drain_id = drain_id
        self.node = node
        self._woken = asyncio.Event()
        self._wake = VerdictWake(bus, node, lambda _drain_id: self._woken.set(), drain_id)

    async def __aenter__(self) -> VerdictWatch:
        await self._wake.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._wake.close()

    async def wait(self, timeout: float) -> DrainVerdict:
        """The verdict, once the record has it; ``TimeoutError`` after ``timeout`` seconds without one (the
        record asked a last time). A record that does not answer is asked again (``retries.DRAIN_RECORD``) until
        the end."""
        end = time.monotonic() + timeout
        while True:
            self._woken.clear()
            try:
                found = await DRAIN_RECORD.call(lambda: self.client.verdict(self.drain_id, self.node), deadline=end)
            except VerdictUnknown as exc:
                raise TimeoutError(f"drain {self.drain_id}: {exc}") from exc
            if found is not None:
                return found
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(self.drain_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), timeout=left)


# -- a command's drain, from the cordon to the empty node -----------------------------------------------------------
DrainStep = Literal["cordoned", "saving", "saved", "evicted", "evicting"]
"""Where ``drain_node`` is: the node cordoned, the save asked for, saved (``sessions``, ``bytes``), one pod
evicted (``pod``), pods still to leave (``pods_left``)."""

Progress = Callable[[DrainStep, dict[str, Any]], None]


@dataclass
class NodeDrained:
    """What ``drain_node`` did: the verdict (None when none came in time), the pods evicted (None when some were
    still on the node at the end), how long the save and the evictions took, and why it stopped short."""

    drain_id: str
    node: str
    verdict: DrainVerdict | None = None
    save_s: float = 0.0
    evicted: list[str] | None = None
    evict_s: float = 0.0
    reason: str = ""
    pods_evicted: list[str] = field(default_factory=list)

    @property
    def emptied(self) -> bool:
        return isinstance(self.verdict, DrainCompleted) and self.evicted is not None


async def drain_node(
    drains: DrainClient,
    cluster: ClusterPort,
    bus: Bus,
    node: str,
    drain_id: str,
    *,
    reason: str,
    deadline_s: float,
    timeout: float,
    progress: Progress = lambda step, done: None,
    by: str = "cli",
) -> NodeDrained:
    """A command's drain (``gpuwarden drain``), in order: woken for its verdict, cordon naming the drain, ask,
    learn the verdict from the record (waiting at most ``min(timeout, deadline_s + 30)``), and only on
    ``DrainCompleted`` evict every pod until none is left (``empty_node``), all within ``timeout`` seconds. A
    failed verdict, or none, evicts nothing: the node stays cordoned with its sessions where they are. Raises
    ``NodeKeptChanging`` when the cordon cannot be written."""
    started = time.monotonic()
    done = NodeDrained(drain_id=drain_id, node=node)
    async with drains.watch(bus, drain_id, node) as watch:
        await drains.cordon(cluster, node, drain_id, by)
        progress("cordoned", {})
        await drains.ask(drain_id, node, reason, deadline_s)
        progress("saving", {})
        waited = min(timeout, deadline_s + 30)
        try:
            verdict = await watch.wait(waited)
        except TimeoutError:
            done.reason = f"no drain verdict from the checkpoint service within {waited:g}s"
            return done
    done.verdict = verdict
    done.save_s = time.monotonic() - started
    if isinstance(verdict, DrainFailed):
        return done
    progress("saved", {"sessions": verdict.sessions_committed, "bytes": verdict.bytes_saved})
    done.evicted = await empty_node(cluster, node, started + timeout, progress)
    done.evict_s = time.monotonic() - started - done.save_s
    if done.evicted is None:
        done.reason = f"pods still on {node} after {timeout:g}s (a PodDisruptionBudget, or a slow preStop)"
    return done


async def empty_node(cluster: ClusterPort, node: str, end: float, progress: Progress) -> list[str] | None:
    """Evict every pod on ``node`` (PodDisruptionBudget refusals tried again with ``COMMAND_BACKOFF``) and wait
    until none is left there. The pods evicted, or None when some are still there at ``end`` (a monotonic time).
    A poll of the node, not a ``shared.plumbing.retries`` policy: a refusal is no failure, and the wait depends on
    the round's outcome (``COMMAND_POLL_S`` while the pods leave)."""
    evicted: list[str] = []

    def on_evicted(namespace: str, name: str) -> None:
        evicted.append(name)
        progress("evicted", {"pod": name})

    delay: float | None = None
    while time.monotonic() < end:
        pods = await cluster.pods(node=node)
        if not pods:
            return evicted
        leaving = [(pod.namespace, pod.name) for pod in pods if pod.phase != "Terminating"]
        done = await evict_pods(cluster, node, leaving, on_evicted)
        progress("evicting", {"pods_left": len(pods)})
        delay = COMMAND_BACKOFF.after(delay) if done.blocked else None
        await asyncio.sleep(COMMAND_POLL_S if delay is None else delay)
    return None


# -- a node's newest drain, for `gpuwarden status` -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StoredDrain:
    """A drain as the events stream holds it: its newest request, and its verdict once it has one."""

    request: DrainRequested
    verdict: DrainVerdict | None = None


async def newest_drain(bus: Bus, node: str) -> StoredDrain | None:
    """The newest drain asked for ``node`` and its verdict (the first stored after the request), from the events
    stream; None when none is stored or the stream cannot be read. Costs one read, plus one per verdict of the
    node stored after that request.

    What ``gpuwarden status`` shows of the drains in flight, for every node at once: read from the stream, which
    answers whether the checkpoint service runs or not, and never waits on a silent one per node. Nothing that
    acts on a verdict reads it here: a drain's caller asks its record (``DrainClient.verdict``)."""
    stream = bus.subjects.events_stream.name
    try:
        raw = await bus.js.get_last_msg(stream, bus.subjects.pattern("node.drain.requested", node=node))
        request = codec.decode(raw.data or b"")
    except Exception:  # none stored, undecodable, or the stream not answering
        return None
    if not isinstance(request, DrainRequested):
        return None
    after = (raw.seq or 0) + 1
    for kind in VERDICT_KINDS:
        subject = bus.subjects.pattern(kind, node=node)
        seq = after
        while True:
            try:
                stored = await bus.js.get_msg(stream, seq=seq, subject=subject, next=True)
            except Exception:  # none after the cursor, or the stream not answering now
                break
            seq = (stored.seq or seq) + 1
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
                event = codec.decode(stored.data or b"")
                if isinstance(event, DrainCompleted | DrainFailed) and event.drain_id == request.drain_id:
                    return StoredDrain(request, event)
    return StoredDrain(request)


async def newest_drains(bus: Bus, nodes: Iterable[str]) -> dict[str, StoredDrain]:
    """``newest_drain`` of each of ``nodes`` (node -> its drain, for those with one), in a few batched reads of
    the events stream whatever the number of nodes (``shared.plumbing.newest``): each node's newest request, and
    its newest verdict of each kind. A verdict stored after the request that names it is its verdict; a node whose
    only verdicts after its request name another drain (an older one answered again) is read as ``newest_drain``
    reads it, one node at a time."""
    s = bus.subjects
    wanted = list(dict.fromkeys(nodes))
    kinds = ("node.drain.requested", *VERDICT_KINDS)
    subjects = {(node, kind): s.pattern(kind, node=node) for node in wanted for kind in kinds}
    found = await newest_messages(bus.nc, bus.js, s.events_stream.name, subjects.values())
    out: dict[str, StoredDrain] = {}
    unsure: list[str] = []
    for node in wanted:
        asked = found.get(subjects[node, "node.drain.requested"])
        request = _decoded(asked)
        if asked is None or not isinstance(request, DrainRequested):
            continue
        after: list[tuple[int, DrainVerdict]] = []
        for kind in VERDICT_KINDS:
            stored = found.get(subjects[node, kind])
            verdict = _decoded(stored)
            if stored is not None and stored.seq > asked.seq and isinstance(verdict, DrainCompleted | DrainFailed):
                after.append((stored.seq, verdict))
        mine = [
            verdict for _, verdict in sorted(after, key=lambda pair: pair[0]) if verdict.drain_id == request.drain_id
        ]
        if mine:
            out[node] = StoredDrain(request, mine[0])
        elif after:
            unsure.append(node)
        else:
            out[node] = StoredDrain(request)
    for node, read in zip(unsure, await asyncio.gather(*(newest_drain(bus, n) for n in unsure)), strict=True):
        if read is not None:
            out[node] = read
    return out


def _decoded(stored: StoredMessage | None) -> Any:
    if stored is None:
        return None
    try:
        return codec.decode(stored.data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
