"""What ``gpuwarden drain``, ``uncordon`` and ``upgrade-driver`` do, as any client of the mesh could.

``drain`` does what ``kubectl drain`` users expect, plus the step gpuwarden exists for: it cordons the node (naming
its drain on the node, so the driver service asks for no second one), asks the checkpoint service to commit every
session there and waits for the verdict, evicts the node's pods through the Eviction API (a PodDisruptionBudget
refusal is retried), waits until the node is empty, and with ``--wait`` follows each session to the pod that takes
it until that pod has restored it and verified every digest (its ``checkpoint.restored`` event, published by the
KV agent only after the check, for a generation newer than the one drained). A session whose conversation ends
in between (its client closes it: an inference request with neither prompt nor new tokens) has nothing left to
restore and is counted as ended, not as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

import msgspec

from shared.console.client import CommandError, MeshClient
from shared.console.snapshot import (
    CORDON_DRAIN_ANNOTATION,
    UPGRADE_FAILURE_ANNOTATION,
    UPGRADE_STATE_LABEL,
    UPGRADE_WAS_CORDONED_ANNOTATION,
    read_sessions,
)
from shared.contract.checkpoint import SessionRestored
from shared.contract.configdocs import DriverPolicy
from shared.contract.device import DeviceInventory
from shared.contract.driver import UpgradeState
from shared.contract.node import (
    DrainCompleted,
    DrainFailed,
    DrainRequested,
    NodeCordoned,
    NodeUncordoned,
    deadline_problem,
)
from shared.contract.registry import codec
from shared.contract.requests import InferenceRequest
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, redis_unreachable
from shared.ports.cluster import ClusterConflict, EvictionOutcome

Report = Callable[[str, dict[str, Any]], None]
"""Progress: a phase name and what it has done so far; the command draws it (a bar, or plain lines)."""


@dataclass
class MovedSession:
    id: str
    pod: str
    generation: int
    outcome: str = ""
    """restored, ended (its client closed it in transit), or empty while waiting."""
    new_pod: str = ""
    new_node: str = ""
    checkpoint_id: str = ""
    fell_back_from: list[str] = field(default_factory=list)


@dataclass
class DrainResult:
    node: str
    drain_id: str
    verdict: str = ""
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


async def _known_node(mesh: MeshClient, node: str) -> None:
    cluster = mesh.need_cluster()
    if await cluster.node(node) is None:
        names = ", ".join(sorted(n.name for n in await cluster.nodes())) or "none: is the mesh running?"
        raise CommandError(f"no node {node!r} in the cluster (nodes: {names})")


UNCORDON_FREE_STATES = ("", "upgrade-required", "upgrade-done")
"""Driver upgrade states in which the upgrade holds no cordon of its own (``upgrade-required`` waits for a slot
and has cordoned nothing): a person may uncordon the node without ``--force``."""

_CAS_TRIES = 5


async def cordon(mesh: MeshClient, node: str, drain_id: str = "", by: str = "cli") -> None:
    """Cordon ``node`` (naming the drain on it). A node a driver upgrade holds is marked as cordoned by a person
    too, so the upgrade leaves it cordoned when it is done, as it does a node cordoned before it began."""
    await _known_node(mesh, node)
    cluster = mesh.need_cluster()
    for _ in range(_CAS_TRIES):
        info = await cluster.node(node)
        if info is None:
            break
        annotations = {CORDON_DRAIN_ANNOTATION: drain_id} if drain_id else {}
        if info.labels.get(UPGRADE_STATE_LABEL, "") not in UNCORDON_FREE_STATES:
            annotations[UPGRADE_WAS_CORDONED_ANNOTATION] = "true"
        try:
            await cluster.update_node(node, annotations=annotations or None, schedulable=False, expect=info.revision)
            break
        except ClusterConflict:
            continue  # the driver wrote the node meanwhile: read it again
    else:
        raise CommandError(f"{node} kept changing under this command; try again")
    await mesh.bus.publish(NodeCordoned(node=node, by=by, reason=f"drain {drain_id}" if drain_id else ""))


async def uncordon(mesh: MeshClient, node: str, by: str = "cli", *, force: bool = False) -> bool:
    """Make the node schedulable again; False when it already was. Refused while a driver upgrade holds the node's
    cordon (it uncordons the node itself when done), unless ``force``: a person's word over the upgrade's, which
    goes on with the node schedulable and leaves it so. A compare-and-set on the node as read: a node the upgrade
    takes meanwhile is read again and judged again."""
    await _known_node(mesh, node)
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
    drain_id = drain_id or f"drain-{node}-{uuid.uuid4().hex[:8]}"
    problem = deadline_problem(deadline_s)
    if problem:
        raise CommandError(problem)
    try:
        request = DrainRequested(
            node=node, drain_id=drain_id, reason=reason, requested_by=requested_by, deadline_s=deadline_s
        )
        msgspec.json.decode(codec.encode(request), type=DrainRequested)
    except msgspec.ValidationError as exc:
        raise CommandError(f"{exc}") from None
    await _known_node(mesh, node)
    started = time.monotonic()
    result = DrainResult(node=node, drain_id=drain_id)
    before = await read_sessions(mesh, node=node)
    result.sessions = [MovedSession(s.id, s.pod, s.generation) for s in before]
    verdict: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        if event.drain_id == drain_id and not verdict.done():
            verdict.set_result(event)

    closed: set[str] = set()

    async def on_request(event: InferenceRequest) -> None:
        if event.prompt_tokens == 0 and event.max_new_tokens == 0:
            closed.add(event.session_id)

    s = mesh.subjects
    subs = [
        await mesh.bus.subscribe(s.pattern("node.drain.completed", node=node), on_verdict, (DrainCompleted,)),
        await mesh.bus.subscribe(s.pattern("node.drain.failed", node=node), on_verdict, (DrainFailed,)),
        await mesh.bus.subscribe(s.pattern("requests.inference"), on_request, (InferenceRequest,)),
    ]
    try:
        since = await stream_end(mesh.bus)
        await cordon(mesh, node, drain_id)
        report("cordoned", {"sessions": len(before)})
        await mesh.bus.publish(request)
        report("saving", {"sessions": len(before)})
        try:
            event = await wait_verdict(mesh.bus, node, drain_id, verdict, min(timeout, deadline_s + 30), since)
        except TimeoutError:
            result.reason = f"no drain verdict from the checkpoint service within {min(timeout, deadline_s + 30):g}s"
            return result
        result.save_s = time.monotonic() - started
        if isinstance(event, DrainFailed):
            result.verdict = "failed"
            result.sessions_committed = event.sessions_committed
            named = ", ".join(f"{f.session_id} ({f.reason})" for f in event.failed_sessions[:3])
            more = event.failed_total or len(event.failed_sessions)
            result.reason = f"not every session was saved: {event.reason}; {more} failed: {named}"
            return result  # evict nothing: the node stays cordoned with its sessions where they are
        result.verdict = "completed"
        result.sessions_committed = event.sessions_committed
        result.bytes_saved = event.bytes_saved
        report("saved", {"sessions": event.sessions_committed, "bytes": event.bytes_saved})
        end = started + timeout
        evicted = await _evict_all(mesh, node, end, report)
        result.evict_s = time.monotonic() - started - result.save_s
        if evicted is None:
            result.reason = f"pods still on {node} after {timeout:g}s (a PodDisruptionBudget, or a slow preStop)"
            return result
        result.pods_evicted = evicted
        if wait:
            moved = await _follow(mesh, node, result.sessions, closed, end, report)
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
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def wait_verdict(
    bus: Bus, node: str, drain_id: str, heard: asyncio.Future[Any], timeout: float, since_seq: int = 0
) -> DrainCompleted | DrainFailed:
    """The drain's verdict: as heard on the bus (``heard``), or as stored in the events stream after sequence
    ``since_seq``. A verdict published while this client's connection was failing over to another server is not
    heard (core NATS does not keep it), so the stream is read every second too, from where the last read ended."""
    s = bus.subjects
    cursors = {s.pattern(kind, node=node): since_seq + 1 for kind in ("node.drain.completed", "node.drain.failed")}
    end = time.monotonic() + timeout
    while True:
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(heard), timeout=max(0.0, min(1.0, end - time.monotonic())))
        for subject in cursors:
            found = await _stored_verdict(bus, subject, drain_id, cursors)
            if found is not None:
                return found
        if time.monotonic() >= end:
            raise TimeoutError(drain_id)


async def _stored_verdict(
    bus: Bus, subject: str, drain_id: str, cursors: dict[str, int]
) -> DrainCompleted | DrainFailed | None:
    """The verdict of ``drain_id`` among the messages stored on ``subject`` (one node's verdicts) from the cursor on;
    the cursor moves past what was read. None when there is none yet, or the stream cannot be read now."""
    stream = bus.subjects.events_stream.name
    while True:
        try:
            raw = await bus.js.get_msg(stream, seq=cursors[subject], subject=subject, next=True)
        except Exception:  # none after the cursor, or the stream not answering now: read again next time
            return None
        cursors[subject] = (raw.seq or cursors[subject]) + 1
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            event = codec.decode(raw.data or b"")
            if isinstance(event, DrainCompleted | DrainFailed) and event.drain_id == drain_id:
                return event


async def stream_end(bus: Bus) -> int:
    """The events stream's last sequence now (0 when it cannot be read): what is stored later is newer."""
    try:
        info = await bus.js.stream_info(bus.subjects.events_stream.name)
    except Exception:
        return 0
    return int(info.state.last_seq or 0)


async def _evict_all(mesh: MeshClient, node: str, end: float, report: Report) -> list[str] | None:
    """Evict every pod on ``node`` (retrying PodDisruptionBudget refusals) and wait until none is left there.
    The pods evicted, or None when some are still there at ``end``."""
    cluster = mesh.need_cluster()
    evicted: list[str] = []
    backoff = 0.5
    while time.monotonic() < end:
        pods = await cluster.pods(node=node)
        if not pods:
            return evicted
        blocked = False
        for pod in pods:
            if pod.phase == "Terminating":
                continue
            outcome = await cluster.evict(pod.namespace, pod.name)
            if outcome is EvictionOutcome.EVICTED:
                evicted.append(pod.name)
                report("evicted", {"pod": pod.name})
            elif outcome is EvictionOutcome.BLOCKED_BY_PDB:
                blocked = True
        report("evicting", {"pods_left": len(pods)})
        await asyncio.sleep(backoff if blocked else 0.2)
        backoff = min(backoff * 2, 5.0) if blocked else 0.5
    return None


async def _follow(
    mesh: MeshClient,
    node: str,
    sessions: list[MovedSession],
    closed: set[str],
    end: float,
    report: Report,
) -> bool:
    """Until each session is restored (and verified) on a pod off ``node`` under a newer generation, or ended by
    its client; False at ``end`` with some still waiting."""
    s = mesh.subjects
    while True:
        for moved in sessions:
            if moved.outcome:
                continue
            event = await mesh.last_event(s.pattern("checkpoint.restored", session_id=moved.id))
            if isinstance(event, SessionRestored) and event.generation > moved.generation and event.node != node:
                moved.outcome = "restored"
                moved.new_pod, moved.new_node = event.pod, event.node
                moved.checkpoint_id = event.checkpoint_id
                moved.fell_back_from = list(event.fell_back_from)
            elif moved.id in closed:
                moved.outcome = "ended"
        done = sum(1 for m in sessions if m.outcome)
        report("moving", {"done": done, "total": len(sessions)})
        if done == len(sessions):
            return True
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(0.3)


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


async def follow_upgrade(
    mesh: MeshClient,
    version: str,
    timeout: float,
    report: Callable[[list[NodeUpgrade]], None],
    waiting: Callable[[str], None] | None = None,
) -> tuple[bool, str]:
    """Until every node runs ``version`` and is done (True), one fails, or ``timeout`` passes (False, why).

    A Redis that does not answer for a while (paused, restarting, failing over) while the upgrade carries on is
    waited for, not a failure: ``waiting`` hears why, once per outage, and the reads go on until ``timeout``."""
    end = time.monotonic() + timeout
    outage = ""
    while True:
        try:
            nodes = await upgrade_progress(mesh, version)
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
