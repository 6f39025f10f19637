"""The fleet's sessions on pods the simulated cluster knows, and a rolling driver upgrade of every node with them
(``bench.scale``'s ``fleet_upgrade_*`` figures; ``bench.scale_sessions`` runs both).

``FleetPods`` creates a deployment of its own on the simulated cluster (``llm/bench``, one GPU a pod:
``SimCluster.create_deployment``), which the cluster's scheduler binds to the fleet's nodes, and plays its pods as
``shared.sim.workload`` plays the spec's (the simulation leaves a deployment it was not given alone): each Running
pod hosts a KV agent on the node the cluster bound it to (``SessionBench.add_pod``); a pod turning Terminating runs
its preStop (the final save, recorded by the checkpoint service), leaves, and tells the cluster it is done; the
sessions it held are then restored on the pod that holds the fewest (its replacement, which the cluster has started
on a node still schedulable), as a router sends their next requests there, each checked block for block against
what the pod held. A pod the cluster deletes without its preStop (its grace period ran out) loses what it held.

``upgrade`` asks for a rolling driver upgrade of every node as ``gpuwarden upgrade-driver VERSION --max-parallel N``
does (``operations.set_driver``: the ``driver`` document's ``desired_version``, ``auto_upgrade`` on, N nodes at
once and N unavailable), N a tenth of the nodes, and follows it to the end:

- ``fleet_upgrade_s``: from the document's write to the last node ``upgrade-done`` on the new driver;
- ``fleet_upgrade_nodes``: nodes upgraded; ``fleet_upgrade_drains``: drains the upgrade asked for (one a node that
  had pods); ``fleet_upgrade_verdicts``: those drains' verdicts (``_completed``: how many completed);
- ``fleet_upgrade_sessions``: sessions the fleet's pods held when it began; ``fleet_upgrade_lost``: of those, the
  ones no pod holds afterwards with the blocks it had (or that the registry does not place there, or records no
  checkpoint of); ``fleet_upgrade_evicted_pods`` and ``fleet_upgrade_moved``: preStops run and sessions restored;
- ``fleet_upgrade_prestop_s``: how long the preStops ran (p50, p99, max; from the reading that saw the pod
  Terminating; ``_wait_s`` and ``_save_s`` its two parts: the restores into the pod that had begun, then the
  final save), ``fleet_upgrade_reconcile_s_max``: the longest reading of the cluster (how late a Terminating pod
  may be seen), ``fleet_upgrade_killed_sessions``: sessions of pods deleted before their preStop began;
- ``fleet_upgrade_cpu_s``: CPU seconds each of the mesh's processes spent meanwhile (given ``cpu``), and
  ``fleet_upgrade_driver_cores``: the driver host's (the coordinator) over the upgrade's time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from bench.common import percentile
from bench.fleetkit import CpuSeconds, FleetBench, HostedPod
from shared.console.operations import set_driver
from shared.contract.annotations import UPGRADE_STATE_LABEL
from shared.contract.driver import DriverUpgradeStateChanged
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.kv.endpoint import LocateRefused, SessionHeld
from shared.kv.store import CheckpointNotFound, ChunkCorrupt
from shared.plumbing.retries import BENCH_READ
from shared.ports.cluster import ClusterError, PodInfo
from shared.sim.cluster import SimCluster

log = logging.getLogger(__name__)

NAMESPACE = "llm"
DEPLOYMENT = "bench"
"""The deployment the hosted pods name (``SessionBench.add_pod``), now also the cluster's."""
GRACE_S = 120.0
"""The pods' grace period: their preStop (a final save of 50 sessions, a move into them finishing first) fits."""
NEW_DRIVER = "560.35.03"
RESTORE_WAIT_S = 60.0
"""How long a move retries a session the registry still names the pod that left as holder of (it hears the pod
leave with its last announcement; at worst its lease lapses, 3 announcement intervals)."""
CONCURRENCY = 64
"""Sessions restored at once, all moves together."""
FOLLOW_EVERY_S = 0.25
"""The least time between two readings of the cluster: a burst of changes is read once."""
SETTLE_S = 900.0
"""How long the moves still running when the last node is upgraded may take (the last tenth of the fleet's
sessions restored on the pods left): a run of 1,000 nodes and 100,000 sessions on 2 cores passed 120 s."""


class FleetPods:
    """The fleet's pods: a deployment of the simulated cluster that this benchmark plays. Level-triggered: the
    hosted pods follow the cluster's, woken by its changes."""

    def __init__(self, bench: FleetBench, cluster: SimCluster, replicas: int, grace_s: float = GRACE_S) -> None:
        self.bench = bench
        self.cluster = cluster
        self.replicas = replicas
        self.grace_s = grace_s
        """The pods' grace period (``terminationGracePeriodSeconds``): a preStop still running after it is killed."""
        self.pods: dict[str, HostedPod] = {}
        """The pods serving now, by name."""
        self.leaving: set[str] = set()
        """Pods whose preStop runs."""
        self.busy: dict[str, int] = {}
        """Per pod: restores (and announcements) into it running now. Its preStop waits for those alone, never for
        the rest of a move: once the pod is leaving, a move's sessions not yet begun go to another pod."""
        self.incoming: dict[str, int] = {}
        """Per pod: sessions a move means to restore on it and has not yet (the least loaded counts them)."""
        self._quiet = asyncio.Condition()
        self.moving = 0
        self.prestops = 0
        self.moved = 0
        self.killed: list[str] = []
        """Sessions of pods deleted without their preStop."""
        self.problems: list[str] = []
        self.joining: dict[str, asyncio.Task[None]] = {}
        """Running pods being hosted now (their agents starting)."""
        self.prestop_s: list[float] = []
        """How long each preStop ran, from the reading that saw the pod Terminating to the cluster hearing it done."""
        self.prestop_wait_s: list[float] = []
        """Of each preStop: the wait for the restores into its pod that had begun."""
        self.prestop_save_s: list[float] = []
        """Of each preStop: its final save."""
        self.reconcile_s_max = 0.0
        """The longest reading of the cluster: how late a Terminating pod may be seen at worst."""
        self._slots = asyncio.Semaphore(CONCURRENCY)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 300.0) -> list[HostedPod]:
        """Create the deployment, host each of its pods once all run, and follow the cluster from then on."""
        await self.cluster.create_deployment(
            NAMESPACE,
            DEPLOYMENT,
            self.replicas,
            max_unavailable=max(1, self.replicas // 10),
            grace_period_s=self.grace_s,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            running = [p for p in await self._mine() if p.phase == "Running"]
            if len(running) >= self.replicas:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(running)} of {self.replicas} pods of {NAMESPACE}/{DEPLOYMENT} running after {timeout_s:g}s "
                    "(too few free GPUs in the fleet?)"
                )
            await asyncio.sleep(0.5)
        await self.reconcile()
        await asyncio.gather(*list(self.joining.values()))
        self._spawn(self._watch(), "fleet-pods-watch")
        self._spawn(self._follow(), "fleet-pods-follow")
        return list(self.pods.values())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)

    async def settled(self, timeout_s: float) -> float:
        """Until no preStop and no move runs; the seconds that took. ``TimeoutError`` naming what still runs after
        ``timeout_s`` (the pods leaving and the moves: at the end of a fleet upgrade the last tenth of the nodes'
        sessions, some 10,000, are still being restored on 2 cores)."""
        started = time.monotonic()
        while self.leaving or self.moving:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(
                    f"after {timeout_s:g}s {len(self.leaving)} pods still leaving {sorted(self.leaving)[:10]} and "
                    f"{self.moving} moves still restoring"
                )
            await asyncio.sleep(0.2)
        return time.monotonic() - started

    def _spawn(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.problems.append(f"{task.get_name()}: {task.exception()!r}")

    # -- following the cluster ------------------------------------------------------------------------------------
    async def _mine(self) -> list[PodInfo]:
        return [p for p in await self.cluster.pods(namespace=NAMESPACE) if p.deployment == DEPLOYMENT]

    async def _watch(self) -> None:
        """Wakes ``_follow`` on every change of the cluster; a watch that ends (trimmed, Redis away) starts again
        from what the last reading saw."""
        while True:
            try:
                async for _ in self.cluster.watch():
                    self._wake.set()
            except ClusterError as exc:
                log.warning("cluster watch ended; following again", extra={"error": str(exc)})
                self._wake.set()
                await asyncio.sleep(0.5)

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            self._wake.clear()
            try:
                await self.reconcile()
            except ClusterError as exc:
                log.warning("cluster unreadable; pods followed again shortly", extra={"error": str(exc)})
            await asyncio.sleep(FOLLOW_EVERY_S)

    async def reconcile(self) -> None:
        """The hosted pods follow the cluster's, whatever changes were missed: a Terminating pod runs its preStop,
        one deleted before its preStop began loses what it held, and a Running pod is hosted. Nothing here waits
        for a pod to start or stop (those run as tasks of their own): a reading that waited for 200 replacement
        pods to start on a loaded machine saw the next Terminating pods too late, and their grace period ran out
        before their preStop began."""
        started = time.monotonic()
        mine = await self._mine()
        present = {p.name for p in mine}
        for pod in mine:
            if pod.phase == "Terminating" and pod.name in self.pods and pod.name not in self.leaving:
                self.leaving.add(pod.name)
                self._spawn(self._pre_stop(pod.name), f"prestop-{pod.name}")
        for name in [n for n in self.pods if n not in present and n not in self.leaving]:
            gone = self._forget(name)
            self.killed.extend(gone.agent.sessions())
            self._spawn(self.bench.leave(gone), f"killed-{name}")
        for pod in mine:
            if pod.phase == "Running" and pod.node and pod.name not in self.pods and pod.name not in self.joining:
                self.joining[pod.name] = asyncio.create_task(self._join(pod.name, pod.node), name=f"join-{pod.name}")
        self.reconcile_s_max = max(self.reconcile_s_max, time.monotonic() - started)

    async def _join(self, name: str, node: str) -> None:
        try:
            hosted = await self.bench.add_pod(name, node)
        except Exception as exc:  # reported; the next reading hosts it again
            self.problems.append(f"pod {name} not hosted: {exc!r}")
            return
        finally:
            self.joining.pop(name, None)
        self.pods[name], self.busy[name], self.incoming[name] = hosted, 0, 0
        self._wake.set()  # it may have turned Terminating meanwhile

    def _forget(self, name: str) -> HostedPod:
        """The pod ``name`` is no longer hosted (its preStop done, or the cluster deleted it): what it was."""
        self.busy.pop(name, None)
        self.incoming.pop(name, None)
        return self.pods.pop(name)

    # -- a pod leaves, its sessions move --------------------------------------------------------------------------
    async def _pre_stop(self, name: str) -> None:
        """The pod's preStop: once the restores into it that had begun are done (it is ``leaving``: the rest of
        those moves go elsewhere), its final save, then it leaves (the registry hears its sessions are free) and the
        cluster hears it is done; then its sessions move. It waits for at most the restores running at once
        (``CONCURRENCY``), never for a move queued behind others: at 100 nodes at once that queue is some 10,000
        sessions long, and a preStop that waited for it ran past the driver policy's ``pod_deletion_timeout_s``."""
        pod = self.pods[name]
        began = time.monotonic()
        try:
            async with self._quiet:
                await self._quiet.wait_for(lambda: not self.busy.get(name))
            quiet = time.monotonic()
            await pod.endpoint.final_save(deadline_s=self.grace_s * 0.8)
            saved = time.monotonic()
            held = {sid: len(pod.agent.blocks(sid)) for sid in pod.agent.sessions()}
            await self.bench.leave(pod)
            self._forget(name)
            with contextlib.suppress(ClusterError):  # its grace period ends it anyway
                await self.cluster.mark_prestop_done(NAMESPACE, name)
            self.prestop_s.append(time.monotonic() - began)
            self.prestop_wait_s.append(quiet - began)
            self.prestop_save_s.append(saved - quiet)
            self.prestops += 1
            self.moving += 1
        finally:
            self.leaving.discard(name)
        try:
            await self._move(held)
        finally:
            self.moving -= 1

    def _serving(self, name: str) -> bool:
        return name in self.pods and name not in self.leaving

    def _least_loaded(self) -> HostedPod | None:
        serving = [p for n, p in self.pods.items() if self._serving(n)]
        if not serving:
            return None
        return min(serving, key=lambda p: (len(p.agent.sessions()) + self.incoming.get(p.name, 0), p.name))

    async def _move(self, held: dict[str, int]) -> None:
        """Restore ``held`` (session -> its blocks) on the pod that holds the fewest; the sessions not yet begun
        when that pod starts leaving go on to the next."""
        deadline = time.monotonic() + self.grace_s
        while held:
            target = self._least_loaded()
            if target is None:
                if time.monotonic() > deadline:
                    self.problems.append(f"no pod to move {len(held)} sessions to")
                    return
                await asyncio.sleep(0.2)
                continue
            held = await self._restore_all(target, held)

    async def _restore_all(self, target: HostedPod, held: dict[str, int]) -> dict[str, int]:
        """Restore ``held`` on ``target``, each checked block for block; the sessions not begun because ``target``
        started leaving first are returned."""
        expected = self.bench.block.tobytes()
        name = target.name
        self.incoming[name] += len(held)
        passed: dict[str, int] = {}

        async def one(sid: str, blocks: int) -> None:
            async with self._slots:
                if name in self.incoming:
                    self.incoming[name] -= 1
                restored = await self._restore(target, sid)
            if restored is None:
                passed[sid] = blocks
                return
            if not restored:
                return
            got = target.agent.blocks(sid)
            if len(got) != blocks or any(memoryview(b).tobytes() != expected for b in got):
                self.problems.append(f"{sid} restored on {name} with {len(got)} blocks, {blocks} were held")
                return
            self.moved += 1

        await asyncio.gather(*(one(sid, blocks) for sid, blocks in held.items()))
        if self._serving(name):
            async with self._busy(name):
                await target.endpoint.announce()
        return passed

    @contextlib.asynccontextmanager
    async def _busy(self, name: str) -> AsyncIterator[None]:
        """Counts work into the pod ``name`` that its preStop waits for (checked serving just before: no await
        between the check and the count)."""
        self.busy[name] += 1
        try:
            yield
        finally:
            async with self._quiet:
                if name in self.busy:
                    self.busy[name] -= 1
                self._quiet.notify_all()

    async def _restore(self, target: HostedPod, sid: str) -> bool | None:
        """Restore ``sid`` on ``target``: True once it is, False when it cannot be (a problem named), None when
        ``target`` started leaving before (or between) the tries: the session goes to another pod. Only a try
        counts as work into the pod that its preStop waits for, never the pause before the next."""
        deadline = time.monotonic() + RESTORE_WAIT_S
        while True:
            if not self._serving(target.name):
                return None
            try:
                async with self._busy(target.name):
                    await target.endpoint.restore(sid, timeout=30)
                return True
            except (SessionHeld, LocateRefused, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    self.problems.append(f"{sid} not restored on {target.name} in {RESTORE_WAIT_S:g}s: {exc}")
                    return False
                await asyncio.sleep(0.2)
            except (CheckpointNotFound, ChunkCorrupt) as exc:
                self.problems.append(f"{sid} has no good checkpoint to restore on {target.name}: {exc}")
                return False


# -- the upgrade --------------------------------------------------------------------------------------------------
async def upgrade(
    bench: FleetBench,
    fleet: FleetPods,
    parallel: float,
    timeout_s: float,
    cpu: CpuSeconds | None = None,
) -> dict[str, Any]:
    """A rolling driver upgrade of every node of the cluster, ``parallel`` of them at once (at least one), with
    the fleet's sessions on their pods; its drains join ``bench.drain_ids`` (the checker expects one verdict each)."""
    assert bench.bus is not None
    subjects = bench.subjects
    nodes = [n.name for n in await fleet.cluster.nodes()]
    before = {sid: len(p.agent.blocks(sid)) for p in fleet.pods.values() for sid in p.agent.sessions()}
    drains: dict[str, str] = {}
    verdicts: dict[str, str] = {}
    done: dict[str, float] = {}
    failed: dict[str, str] = {}
    finished = asyncio.Event()
    heard = asyncio.Event()

    async def on_drain(event: DrainRequested) -> None:
        if event.requested_by == "driver":
            drains.setdefault(event.drain_id, event.node)

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        verdicts.setdefault(event.drain_id, "completed" if isinstance(event, DrainCompleted) else "failed")
        heard.set()

    async def on_state(event: DriverUpgradeStateChanged) -> None:
        if event.state == "upgrade-done" and event.installed_version == NEW_DRIVER:
            done.setdefault(event.node, time.monotonic())
        elif event.state == "upgrade-failed":
            failed[event.node] = event.reason
        if len(done) >= len(nodes) or failed:
            finished.set()

    subs = [
        await bench.bus.subscribe(subjects.pattern("node.drain.requested"), on_drain, (DrainRequested,)),
        await bench.bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,)),
        await bench.bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,)),
        await bench.bus.subscribe(subjects.pattern("driver.upgrade.state"), on_state, (DriverUpgradeStateChanged,)),
    ]
    labels = UpgradeLabels(bench.redis_url, subjects)
    max_parallel = max(1, math.ceil(len(nodes) * parallel))
    cpu_before = dict(cpu()) if cpu else {}
    started = time.monotonic()
    try:
        await set_driver(bench.mesh(), NEW_DRIVER, max_parallel, by="bench.scale")
        end = started + timeout_s
        while not finished.is_set() and time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), min(10.0, max(0.0, end - time.monotonic())))
            if len(await labels.done()) == len(nodes):  # the events' count, should one be missed
                break
        took = (max(done.values()) if done and len(done) == len(nodes) else time.monotonic()) - started
        spent = {k: round(v - cpu_before[k], 2) for k, v in (cpu() if cpu else {}).items() if k in cpu_before}
        try:
            settle_s: float | None = await fleet.settled(SETTLE_S)
        except TimeoutError as unsettled:  # reported, and its sessions counted as lost below: never a crash
            fleet.problems.append(str(unsettled))
            settle_s = None
        deadline = time.monotonic() + 60
        while set(drains) - set(verdicts) and time.monotonic() < deadline:  # the verdicts still on their way
            heard.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(heard.wait(), deadline - time.monotonic())
        labelled = await labels.done()
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await labels.close()
    bench.drain_ids.extend(drains)
    holders = {sid: p for p in fleet.pods.values() for sid in p.agent.sessions()}
    expected = bench.block.tobytes()
    lost = [
        sid
        for sid, blocks in before.items()
        if sid not in holders
        or len(got := holders[sid].agent.blocks(sid)) != blocks
        or any(memoryview(b).tobytes() != expected for b in got)
    ]
    unplaced = await bench.lost(list(fleet.pods.values()))
    driver = [label for label in spent if label.startswith("driver")]
    return {
        "fleet_upgrade_s": round(took, 1),
        "fleet_upgrade_settle_s": None if settle_s is None else round(settle_s, 1),
        "fleet_upgrade_nodes": len(done),
        "fleet_upgrade_nodes_missing": len(nodes) - len(done),
        "fleet_upgrade_nodes_labelled_done": len(labelled),
        "fleet_upgrade_max_parallel": max_parallel,
        "fleet_upgrade_failed_nodes": dict(sorted(failed.items())[:10]),
        "fleet_upgrade_drains": len(drains),
        "fleet_upgrade_verdicts": sum(1 for d in drains if d in verdicts),
        "fleet_upgrade_verdicts_completed": sum(1 for d in drains if verdicts.get(d) == "completed"),
        "fleet_upgrade_verdicts_missing": sum(1 for d in drains if d not in verdicts),
        "fleet_upgrade_sessions": len(before),
        "fleet_upgrade_lost": len(lost) + unplaced,
        "fleet_upgrade_lost_first": sorted(lost)[:10],
        "fleet_upgrade_evicted_pods": fleet.prestops,
        "fleet_upgrade_killed_sessions": len(fleet.killed),
        "fleet_upgrade_moved": fleet.moved,
        "fleet_upgrade_prestop_s": _spread(fleet.prestop_s),
        "fleet_upgrade_prestop_wait_s": _spread(fleet.prestop_wait_s),
        "fleet_upgrade_prestop_save_s": _spread(fleet.prestop_save_s),
        "fleet_upgrade_reconcile_s_max": round(fleet.reconcile_s_max, 2),
        "fleet_upgrade_problems": fleet.problems[:10],
        "fleet_upgrade_cpu_s": spent,
        "fleet_upgrade_driver_cores": round(sum(spent[d] for d in driver) / took, 3) if driver and took else None,
    }


class UpgradeLabels:
    """The watch of the upgrade labels: its own Redis client of one connection, waited for rather than exhausted
    (the bench's shared client serves every hosted pod and the cluster's followers at once; under the load measured
    its pool ran out after 36 min at 1,000 nodes), and a read that fails while Redis times out is tried again
    (``retries.BENCH_READ``) rather than ending the run."""

    def __init__(self, redis_url: str, subjects: Subjects) -> None:
        pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=30)
        self.cluster = SimCluster(aioredis.Redis(connection_pool=pool), subjects, owns_client=True)

    async def done(self) -> list[str]:
        """The nodes whose upgrade state is ``upgrade-done`` (none was before: the fleet starts unlabelled)."""
        nodes = await BENCH_READ.call(self.cluster.nodes, when=_temporary)
        return [n.name for n in nodes if n.labels.get(UPGRADE_STATE_LABEL) == "upgrade-done"]

    async def close(self) -> None:
        await self.cluster.close()


def _spread(values: list[float]) -> dict[str, float] | None:
    """p50, p99 and max of ``values`` (seconds), None when there are none."""
    if not values:
        return None
    return {
        "p50": round(percentile(values, 50), 2),
        "p99": round(percentile(values, 99), 2),
        "max": round(max(values), 2),
    }


def _temporary(exc: Exception) -> bool:
    """A failure of Redis or of the way to it (the cluster port says ``ClusterError``), not of the bench."""
    return isinstance(exc, ClusterError | RedisError | OSError | TimeoutError)
