"""What ``gpuwarden drain``, ``uncordon`` and ``upgrade-driver`` do, as any client of the mesh could.

``drain`` does what ``kubectl drain`` users expect, plus the step gpuwarden exists for. The drain itself is the drain
client's (``shared.clients.drains.drain_node``): it cordons the node (naming its drain on the node, so the driver
service asks for no second one), asks the checkpoint service to commit every session there, learns the verdict
from the drain's record, evicts the node's pods through the Eviction API (a PodDisruptionBudget refusal is retried
with backoff) and waits until the node is empty. This module adds what is the command's: the progress it shows,
the result it prints, and with ``--wait`` it follows
each session to the pod that takes it until that pod has restored it and verified every digest (its
``checkpoint.restored`` event, published by the KV agent only after the check, for a generation newer than the one
drained; heard by subscription: ``SessionMoves``). A session whose conversation ends in between, for any reason (its
client closes it: an inference request with neither prompt nor new tokens; or its pod ends it: expired, or at its
context limit, which the registry publishes as a ``kv.session.location`` ``ended``) has nothing left to restore and
is counted as ended, not as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgspec

from shared.clients.drains import (
    UNCORDON_FREE_STATES,
    DrainClient,
    DrainStep,
    InvalidDrain,
    NodeKeptChanging,
    RecordReader,
    drain_node,
    drain_request,
)
from shared.console.client import CommandError, MeshClient
from shared.console.saveprogress import SaveProgressListener
from shared.console.snapshot import read_sessions
from shared.console.state import named
from shared.contract.annotations import (
    UPGRADE_FAILURE_ANNOTATION,
    UPGRADE_STATE_LABEL,
    UPGRADE_WAS_CORDONED_ANNOTATION,
)
from shared.contract.checkpoint import SessionRestored
from shared.contract.configdocs import DriverPolicy
from shared.contract.device import DeviceInventory
from shared.contract.driver import UpgradeState
from shared.contract.node import DrainFailed, DrainOutcome, NodeUncordoned
from shared.contract.requests import InferenceRequest
from shared.contract.sessions import SessionLocation
from shared.plumbing.configsync import ConfigStore, redis_unreachable
from shared.ports.cluster import ClusterConflict

DrainPhase = Literal[DrainStep, "moving"]
"""Where ``drain`` is: the drain client's steps (``DrainStep``: the node cordoned, with ``sessions``, how many to
save; the save asked for, with ``sessions``, then, as the pods' agents report it, ``done`` and ``bytes`` so far:
``SaveProgressListener``; saved, with ``sessions`` and ``bytes``; one pod evicted, ``pod``; pods still to leave,
``pods_left``), then sessions restored or ended elsewhere so far (``done`` of ``total``)."""

Report = Callable[[DrainPhase, dict[str, Any]], None]
"""Progress: the phase and what it has done so far (the keys ``DrainPhase`` names); the command draws it (a bar,
or plain lines)."""

MoveOutcome = Literal["", "restored", "ended"]
"""What became of a drained session: restored elsewhere (and verified), ended (closed by its client, expired, or at
its context limit, in transit), or nothing yet ('')."""


@dataclass
class MovedSession:
    id: str
    pod: str
    generation: int
    outcome: MoveOutcome = ""
    new_pod: str = ""
    new_node: str = ""
    checkpoint_id: str = ""
    fell_back_from: list[str] = field(default_factory=list)


@dataclass
class DrainResult:
    node: str
    drain_id: str
    verdict: DrainOutcome | Literal[""] = ""
    """The checkpoint service's verdict on the saves; '' when none came."""
    sessions_committed: int = 0
    bytes_saved: int = 0
    save_s: float = 0.0
    pods_evicted: list[str] = field(default_factory=list)
    evict_s: float = 0.0
    sessions: list[MovedSession] = field(default_factory=list)
    move_s: float = 0.0
    ok: bool = False
    reason: str = ""

    def as_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.__dict__ | {"sessions": [s.__dict__ for s in self.sessions]})


async def known_node(mesh: MeshClient, node: str) -> None:
    """``CommandError`` naming the nodes there are, unless the cluster has ``node``."""
    cluster = mesh.need_cluster()
    if await cluster.node(node) is None:
        raise CommandError(f"no node {node!r} in the cluster (nodes: {named(n.name for n in await cluster.nodes())})")


_CAS_TRIES = 5


async def cordon(mesh: MeshClient, node: str, drain_id: str = "", by: str = "cli") -> None:
    """Cordon ``node`` (naming the drain on it), as the drain client does (``DrainClient.cordon``)."""
    await known_node(mesh, node)
    try:
        await DrainClient(mesh.bus.publish, by, None).cordon(mesh.need_cluster(), node, drain_id, by)
    except NodeKeptChanging as exc:
        raise CommandError(str(exc)) from None


async def uncordon(mesh: MeshClient, node: str, by: str = "cli", *, force: bool = False) -> bool:
    """Make the node schedulable again; False when it already was. Refused while a driver upgrade holds the node's
    cordon (it uncordons the node itself when done), unless ``force``: a person's word over the upgrade's, which
    goes on with the node schedulable and leaves it so. A compare-and-set on the node as read: a node the upgrade
    takes meanwhile is read again and judged again."""
    await known_node(mesh, node)
    cluster = mesh.need_cluster()
    for _ in range(_CAS_TRIES):
        info = await cluster.node(node)
        if info is None or info.schedulable:
            return False
        state = info.labels.get(UPGRADE_STATE_LABEL, "")
        if state not in UNCORDON_FREE_STATES and not force:
            raise CommandError(
                f"{node} is in driver upgrade state {state!r}: the driver service uncordons it when done "
                f"(`gpuwarden uncordon --force {node}` to uncordon it now)"
            )
        try:
            await cluster.update_node(
                node, schedulable=True, annotations={UPGRADE_WAS_CORDONED_ANNOTATION: None}, expect=info.revision
            )
        except ClusterConflict:
            continue
        await mesh.bus.publish(NodeUncordoned(node=node, by=by))
        return True
    raise CommandError(f"{node} kept changing under this command; try again")


async def drain(
    mesh: MeshClient,
    node: str,
    *,
    wait: bool,
    timeout: float,
    deadline_s: float,
    reason: str,
    requested_by: str,
    drain_id: str = "",
    report: Report = lambda phase, done: None,
) -> DrainResult:
    """The drain client's drain of the node (``shared.clients.drains.drain_node``: cordon, save, evict) and, with
    ``wait``, the follow of its sessions to the pods that restore them (see the module)."""
    drains = DrainClient(mesh.bus.publish, requested_by, RecordReader(mesh.bus))
    drain_id = drain_id or drains.new_id(f"drain-{node}")
    try:
        drain_request(node, drain_id, reason, requested_by, deadline_s)
    except InvalidDrain as exc:
        raise CommandError(str(exc)) from None
    await known_node(mesh, node)
    started = time.monotonic()
    result = DrainResult(node=node, drain_id=drain_id)
    before = await read_sessions(mesh, node=node, verified=False)
    result.sessions = [MovedSession(s.id, s.pod, s.generation) for s in before]

    def progress(step: DrainStep, done: dict[str, Any]) -> None:
        report(step, {"sessions": len(before)} if step in ("cordoned", "saving") else done)

    def saving(done: int, nbytes: int) -> None:
        report("saving", {"sessions": len(before), "done": min(done, len(before)), "bytes": nbytes})

    async with contextlib.AsyncExitStack() as listening:
        moves = await listening.enter_async_context(SessionMoves(mesh, node, result.sessions)) if wait else None
        pods = {s.pod for s in before}
        await listening.enter_async_context(SaveProgressListener(mesh.bus, drain_id, pods, saving))
        try:
            drained = await drain_node(
                drains,
                mesh.need_cluster(),
                mesh.bus,
                node,
                drain_id,
                reason=reason,
                deadline_s=deadline_s,
                timeout=timeout,
                progress=progress,
            )
        except NodeKeptChanging as exc:
            raise CommandError(str(exc)) from None
        event = drained.verdict
        if event is None:
            result.reason = drained.reason
            return result
        result.save_s = drained.save_s
        result.verdict = event.outcome
        result.sessions_committed = event.sessions_committed
        if isinstance(event, DrainFailed):
            named = ", ".join(f"{f.session_id} ({f.reason})" for f in event.failed_sessions[:3])
            more = event.failed_total or len(event.failed_sessions)
            result.reason = f"not every session was saved: {event.reason}; {more} failed: {named}"
            return result  # evict nothing: the node stays cordoned with its sessions where they are
        result.bytes_saved = event.bytes_saved
        result.evict_s = drained.evict_s
        if drained.evicted is None:
            result.reason = drained.reason
            return result
        result.pods_evicted = drained.evicted
        if moves is not None:
            moved = await moves.follow(started + timeout, report)
            result.move_s = time.monotonic() - started - result.save_s - result.evict_s
            if not moved:
                waiting = [m.id for m in result.sessions if not m.outcome]
                result.reason = (
                    f"{len(waiting)} session(s) not restored elsewhere within {timeout:g}s: {', '.join(waiting[:5])}"
                    " (a session is restored when its next request arrives)"
                )
                return result
        result.ok = True
        return result


class SessionMoves:
    """Where the sessions drained from ``node`` went: entered before the node is cordoned, it hears every
    ``checkpoint.restored`` event (published by a KV agent only once every digest checked out, and stored), every
    session its client closes (an inference request with neither prompt nor new tokens) and every session that
    ends otherwise (its pod ended it: expired, or at its context limit; the registry's ``kv.session.location``
    ``ended``). A session is ``restored`` once a pod off the node restored it under a generation newer than the
    drained one, ``ended`` once it ended without that. What happened before the subscription began (between the
    read of the sessions and the cordon), or while this connection was failing over to another server and heard
    nothing, is looked up in the events stream: once per session still waiting when ``follow`` begins, after each
    reconnect, and at the end, never on a timer."""

    LOOKUPS_AT_ONCE = 64
    """Stored events read at once in a lookup: bounded, so a node of thousands of sessions does not flood NATS."""

    def __init__(self, mesh: MeshClient, node: str, sessions: list[MovedSession]) -> None:
        self.mesh = mesh
        self.node = node
        self.sessions = {m.id: m for m in sessions}
        self.restored: dict[str, SessionRestored] = {}
        self.ended: set[str] = set()
        self._changed = asyncio.Event()
        self._subs: list[Any] = []

    async def __aenter__(self) -> SessionMoves:
        s = self.mesh.subjects
        bus = self.mesh.bus
        try:
            self._subs.append(
                await bus.subscribe(s.pattern("checkpoint.restored"), self._on_restored, (SessionRestored,))
            )
            self._subs.append(
                await bus.subscribe(s.pattern("requests.inference"), self._on_request, (InferenceRequest,))
            )
            self._subs.append(
                await bus.subscribe(s.pattern("kv.session.location"), self._on_location, (SessionLocation,))
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

    def _note_restored(self, event: SessionRestored) -> None:
        moved = self.sessions.get(event.session_id)
        if moved is None or event.generation <= moved.generation or event.node == self.node:
            return
        known = self.restored.get(event.session_id)
        if known is None or event.generation >= known.generation:
            self.restored[event.session_id] = event
            self._changed.set()

    async def _on_restored(self, event: SessionRestored) -> None:
        self._note_restored(event)

    async def _on_request(self, event: InferenceRequest) -> None:
        if event.prompt_tokens == 0 and event.max_new_tokens == 0:
            self._note_ended(event.session_id)

    async def _on_location(self, event: SessionLocation) -> None:
        if event.reason == "ended":
            self._note_ended(event.session_id)

    def _note_ended(self, session_id: str) -> None:
        if session_id in self.sessions and session_id not in self.ended:
            self.ended.add(session_id)
            self._changed.set()

    async def _look_up(self) -> None:
        """The newest stored ``checkpoint.restored`` of each session still waiting, and for one never restored its
        newest location, which says whether it ended (bounded: see the class)."""
        waiting = [m.id for m in self.sessions.values() if not m.outcome and m.id not in self.restored]
        for at in range(0, len(waiting), self.LOOKUPS_AT_ONCE):
            await asyncio.gather(*(self._look_up_one(sid) for sid in waiting[at : at + self.LOOKUPS_AT_ONCE]))

    async def _look_up_one(self, sid: str) -> None:
        s = self.mesh.subjects
        event = await self.mesh.last_event(s.pattern("checkpoint.restored", session_id=sid))
        if isinstance(event, SessionRestored):
            self._note_restored(event)
        if sid in self.restored or sid in self.ended:
            return
        location = await self.mesh.last_event(s.pattern("kv.session.location", session_id=sid))
        if isinstance(location, SessionLocation) and location.reason == "ended":
            self._note_ended(sid)

    def _judge(self) -> int:
        """Decide what can be decided; the number of sessions with an outcome."""
        for moved in self.sessions.values():
            if moved.outcome:
                continue
            event = self.restored.get(moved.id)
            if event is not None:
                moved.outcome = "restored"
                moved.new_pod, moved.new_node = event.pod, event.node
                moved.checkpoint_id = event.checkpoint_id
                moved.fell_back_from = list(event.fell_back_from)
            elif moved.id in self.ended:
                moved.outcome = "ended"
        return sum(1 for m in self.sessions.values() if m.outcome)

    async def follow(self, end: float, report: Report) -> bool:
        """Until every session is restored elsewhere or ended (True); False at ``end`` (a monotonic time) with
        some still waiting."""
        await self._look_up()
        relinked = self.mesh.bus.relinks.next()
        total = len(self.sessions)
        last_look = False
        while True:
            self._changed.clear()
            done = self._judge()
            report("moving", {"done": done, "total": total})
            if done == total:
                return True
            left = end - time.monotonic()
            if left <= 0:
                if last_look:
                    return False
                last_look = True
                await self._look_up()  # a last look at what was stored but not heard
                continue
            changed = asyncio.ensure_future(self._changed.wait())
            reconnected = asyncio.ensure_future(relinked.wait())
            try:
                await asyncio.wait((changed, reconnected), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                reconnected.cancel()
            if relinked.is_set():  # what was published while the connection failed over was not heard
                relinked = self.mesh.bus.relinks.next()
                await self._look_up()


# -- driver upgrades ------------------------------------------------------------------------------------------------
STATE_ORDER: tuple[str, ...] = tuple(s for s in get_args(UpgradeState) if s not in ("", "drain-required"))


async def set_driver(mesh: MeshClient, version: str, max_parallel: int | None, by: str = "cli") -> int:
    """Merge the desired version (and the parallelism) into the ``driver`` document, compare-and-set; turns
    ``auto_upgrade`` on. Returns the document's new version."""
    store = ConfigStore(mesh.redis, mesh.subjects)
    for _ in range(5):
        current = await store.read("driver")
        doc = current.doc if current is not None and isinstance(current.doc, DriverPolicy) else DriverPolicy()
        changes: dict[str, Any] = {"desired_version": version, "auto_upgrade": True}
        if max_parallel is not None:
            changes["max_parallel_upgrades"] = max_parallel
            if doc.max_unavailable == DriverPolicy().max_unavailable:
                changes["max_unavailable"] = str(max_parallel)  # otherwise 25% of a small cluster allows one
        raw = msgspec.json.encode(msgspec.structs.replace(doc, **changes))
        from shared.plumbing.errors import ConfigConflict, InvalidConfig

        try:
            return await store.write_raw("driver", raw, current.version if current else 0, by)
        except InvalidConfig as exc:
            raise CommandError(str(exc)) from None
        except ConfigConflict:
            continue  # someone wrote it meanwhile: merge into theirs
    raise CommandError("the driver document kept changing under this command; try again")


@dataclass
class NodeUpgrade:
    node: str
    state: str
    version: str
    failure: str = ""


async def upgrade_progress(mesh: MeshClient, version: str) -> list[NodeUpgrade]:
    cluster = mesh.need_cluster()
    out = []
    for info in sorted(await cluster.nodes(), key=lambda n: n.name):
        inventory = await mesh.last_event(mesh.subjects.pattern("device.inventory", node=info.name))
        installed = inventory.driver_version if isinstance(inventory, DeviceInventory) else ""
        out.append(
            NodeUpgrade(
                info.name,
                info.labels.get(UPGRADE_STATE_LABEL, ""),
                installed,
                info.annotations.get(UPGRADE_FAILURE_ANNOTATION, ""),
            )
        )
    return out


def node_done(n: NodeUpgrade, version: str) -> bool:
    return n.version == version and n.state in ("", "upgrade-done")


SLOW_READ_S = 2.0
"""A read of the upgrade's progress unanswered this long is said to be waited for (``follow_upgrade``)."""


async def follow_upgrade(
    mesh: MeshClient,
    version: str,
    timeout: float,
    report: Callable[[list[NodeUpgrade]], None],
    waiting: Callable[[str], None] | None = None,
) -> tuple[bool, str]:
    """Until every node runs ``version`` and is done (True), one fails, or ``timeout`` passes (False, why).

    A Redis that does not answer for a while (paused, restarting, failing over) while the upgrade carries on is
    waited for, not a failure: ``waiting`` hears why, once per outage (a read unanswered for ``SLOW_READ_S`` is
    one: the command's clients wait longer than that before they give up), and the reads go on until
    ``timeout``."""
    end = time.monotonic() + timeout
    outage = ""
    while True:
        try:
            read = asyncio.ensure_future(upgrade_progress(mesh, version))
            answered, _ = await asyncio.wait({read}, timeout=SLOW_READ_S)
            if not answered and not outage and waiting is not None:
                outage = f"no answer within {SLOW_READ_S:g} s"
                waiting(f"waiting for Redis ({outage}); the upgrade carries on without this command")
            nodes = await read
        except Exception as exc:
            if not redis_unreachable(exc):
                raise
            if time.monotonic() >= end:
                return False, f"Redis did not answer for the last of {timeout:g}s: {exc}"
            if not outage and waiting is not None:
                waiting(f"waiting for Redis ({exc}); the upgrade carries on without this command")
            outage = str(exc)
            await asyncio.sleep(0.5)
            continue
        if outage and waiting is not None:
            waiting("Redis answers again")
        outage = ""
        report(nodes)
        failed = [n for n in nodes if n.state == "upgrade-failed"]
        if failed:
            return False, f"{failed[0].node}: upgrade-failed: {failed[0].failure or 'no reason recorded'}"
        if nodes and all(node_done(n, version) for n in nodes):
            return True, ""
        if time.monotonic() >= end:
            late = [
                f"{n.node} ({n.state or 'not started'}, {n.version or '?'})" for n in nodes if not node_done(n, version)
            ]
            return False, f"not every node runs {version} after {timeout:g}s: {', '.join(late)}"
        await asyncio.sleep(0.5)
