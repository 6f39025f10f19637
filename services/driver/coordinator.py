"""The cluster-wide upgrade coordinator: one leader at a time moves each node through the upgrade states.

Each pass: take or renew the leader lease (its fencing token), read the nodes it must (labels, annotations, pods,
the installed driver as that node's driver agent answers, the verdict of its drain), and for each node to look at
(those unavailable already first, then in name order: ``upgrade.upgrade_order``) apply what ``upgrade.next_step``
says, re-reading the node after each step.

A pass costs what changed, not the fleet's size. The coordinator keeps a view of every node (``NodeView``), fed by
the cluster's watch (each ``ClusterChange`` names its node) and by the drain verdicts (``note_verdict``); a pass
reads again only the nodes that changed since the last, and those with an upgrade in flight (a state holding a
slot, ``upgrade-failed``, or an agent whose driver is unknown: what time or a node's agent moves without the
cluster changing). Nodes waiting for a slot (``upgrade-required``) are decided on their kept view: the slot counts
(``ClusterView``) are kept as views change, not counted over the fleet, and every write is a compare-and-set on the
revision the view holds, so a view gone stale is refused and read again. Every node is read (a full pass) while no
watch feeds the view (before ``follow_cluster`` runs, or after it failed), on a new lease, when the policy
changed, after a pass that failed midway, and every ``resync_s``: what the watch could not say (a driver installed
on a node by hand, a change the watch lost) is found then. Idle, a pass reads nothing.

A step waits for a pass no longer than it must: besides every ``interval_s``, a pass comes promptly when what a
node in flight waits for happens (its node or pods changed in the watch, its drain's verdict came, its install or
validation is due again), and reads only those nodes (``services.driver.pace``). A watched change whose revision
the kept view already holds (this coordinator's own write, read back) is passed over. So a node moves through its
states as fast as its drain, evictions and install go, and what a pass costs still follows the changes.

Nothing is remembered between passes that the cluster (or the node's agent) does not hold, except that view (read
whole again at start), the eviction backoff and which drains this process has published; so a coordinator killed
at any point and started again resumes where the labels say, and never evicts a pod twice (a Terminating pod is
never evicted again; evictions go through the Eviction API only, and nothing is deleted). The nodes' GPUs are never
touched from here: installs and validations are commands to the node's driver agent (``services.driver.agent``),
which answer within a bound, so a silent node delays a pass by one timeout and the policy's timeouts fail it.

Writes are fenced twice. Before acting the coordinator renews the lease, checks its token is still the lease's
and is not older than the token stamped on the node by the last writer. Then every node write is a
compare-and-set on the node's revision as read (Kubernetes' resourceVersion precondition, the simulated cluster's
own): it stamps the token and lands only if nothing changed the node since the read the decision was made on.
Side effects off the node (an eviction, an install) are preceded by such a stamp. So once a newer leader has
written a node, a stale leader can write it no more, and a write decided on a stale read is refused
(``ClusterConflict``: read again, decide again).

The stamps are also what keeps tokens unique when the lease's store forgets its counter (Redis restarted empty):
a new token is always taken above the highest token stamped on any node (``highest_stamped_token``), and a
coordinator whose lease holds a token below a stamp gives the lease up, so the next pass takes a token above it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast, get_args

from shared.clients.drains import DrainClient, VerdictReader, VerdictUnknown
from shared.clients.evictions import PdbBackoff, evict_pods
from shared.contract.annotations import (
    CORDON_DRAIN_ANNOTATION,
    UPGRADE_DRAIN_ANNOTATION,
    UPGRADE_FAILURE_ANNOTATION,
    UPGRADE_FENCE_ANNOTATION,
    UPGRADE_SINCE_ANNOTATION,
    UPGRADE_STATE_LABEL,
    UPGRADE_TARGET_ANNOTATION,
)
from shared.contract.base import Event
from shared.contract.configdocs import DriverPolicy
from shared.contract.driver import DriverInstalled, DriverInstallFailed, DriverUpgradeStateChanged, UpgradeState
from shared.plumbing.retries import CLUSTER_REWATCH
from shared.ports.cluster import ClusterChange, ClusterConflict, ClusterError, ClusterPort, NodeInfo
from shared.ports.gpu import GpuError

from .pace import PassPace
from .ports import (
    AgentUnreachable,
    InstallStatus,
    LeaderLease,
    LeaseUnavailable,
    NodeDrivers,
    StaleLeader,
)
from .upgrade import (
    EXTERNAL_DRAIN_REASON,
    IN_PROGRESS,
    VERDICT_UNKNOWN,
    Action,
    ClusterView,
    NodeView,
    PodView,
    after_install,
    after_validation,
    counted,
    desired_version,
    install_attempt,
    next_step,
    upgrade_order,
    verdict_text,
)

log = logging.getLogger(__name__)

Publish = Callable[[Event], Awaitable[None]]
Clock = Callable[[], float]
_MAX_STEPS_PER_NODE = 12
_DRAIN_DEADLINE_S = 25.0
RESYNC_S = 300.0
"""Seconds between full passes (every node read) while the watch feeds the view: ``GPUWARDEN_DRIVER_RESYNC_S``."""


@dataclass(frozen=True, slots=True)
class PassStats:
    """What the last pass read: every node (``full``) or only ``nodes_read`` of them, and why it was full."""

    full: bool
    nodes_read: int
    why: str = ""


def stamped_token(nodes: Iterable[NodeInfo]) -> int:
    """The highest fencing token stamped on ``nodes`` (0 when none is)."""
    stamped = (node.annotations.get(UPGRADE_FENCE_ANNOTATION, "") for node in nodes)
    return max((int(token) for token in stamped if token.isdigit()), default=0)


async def highest_stamped_token(cluster: ClusterPort) -> int:
    """The highest fencing token stamped on any node: every token taken from now on is above it."""
    return stamped_token(await cluster.nodes())


class UpgradeCoordinator:
    """Drives rolling driver upgrades. ``reconcile_once`` is one level-triggered pass; ``run`` repeats it."""

    def __init__(
        self,
        cluster: ClusterPort,
        drivers: NodeDrivers,
        lease: LeaderLease,
        record: VerdictReader,
        publish: Publish,
        policy: Callable[[], DriverPolicy],
        *,
        clock: Clock = time.time,
        on_transition: Callable[[str, str, str], None] | None = None,
        resync_s: float = RESYNC_S,
    ) -> None:
        self.cluster = cluster
        self.drivers = drivers
        self.lease = lease
        self.publish = publish
        self.policy = policy
        self.clock = clock
        self.on_transition = on_transition
        self.token = 0
        self.states: dict[str, dict[str, str]] = {}
        self._silent: dict[str, str] = {}
        self._verdicts_silent = False  # the checkpoint service did not answer for a verdict this pass
        self._backoff: dict[str, tuple[float, float]] = {}
        self.drains = DrainClient(lambda event: self.publish(event), "driver", record, lambda: self.clock())
        self.resync_s = resync_s
        self.watching = False
        """True while ``follow_cluster``'s watch feeds the view: only then may a pass read less than every node."""
        self.last_pass = PassStats(full=True, nodes_read=0, why="no pass yet")
        self._views: dict[str, NodeView] = {}
        self.pace = PassPace(clock)
        """What changed since the last pass, what is due again, and when the next pass comes."""
        self._in_flight: set[str] = set()
        self._waiting: set[str] = set()
        self._tally = [0, 0, 0]  # in_progress, unavailable, failed: ClusterView's counts, kept as views change
        self._resync_due = True
        self._resync_at = 0.0
        self._policy_seen: DriverPolicy | None = None

    # -- the loop ---------------------------------------------------------------------------------------------------
    async def run(self, interval_s: float, wake: asyncio.Event | None = None) -> None:
        """Passes every ``interval_s``, and promptly when ``wake`` is set (by the service: a verdict, the policy; by
        ``note_change``) or a node's install or validation is due again (module doc), with ``follow_cluster``
        feeding the view while this coordinator leads (a standby watches nothing: a hollow host's thousand driver
        instances are one watcher)."""
        pace = self.pace
        pace.interval_s = interval_s
        if wake is not None:
            pace.wake = wake
        follower: asyncio.Task[None] | None = None
        try:
            while True:
                prompt = True
                try:
                    await self.reconcile_once(poll_in_flight=pace.poll_due())
                except StaleLeader as exc:
                    log.warning("no longer the upgrade coordinator", extra={"error": str(exc)})
                    self.token, prompt = 0, False
                except (ClusterError, GpuError, LeaseUnavailable) as exc:
                    log.warning("upgrade pass interrupted; retrying", extra={"error": str(exc)})
                    prompt = False
                if self.token and (follower is None or follower.done()):  # where the pass's read left the cluster
                    follower = asyncio.create_task(self.follow_cluster(), name="driver-upgrade-watch")
                elif not self.token and follower is not None:
                    await _cancelled(follower)
                    follower = None
                if not self.token:
                    pace.standby()
                # a pass that failed, or a standby's, waits the interval (a wake still cuts it short); a leader's
                # next pass comes when an install or validation is due again, and never at once (no busy loop)
                await pace.wait(prompt and bool(self.token))
        finally:
            if follower is not None:
                await _cancelled(follower)

    async def follow_cluster(self) -> None:
        """Feeds the view for the coordinator's lifetime: each change marks its node to be read by the next pass. A
        watch that ends is watched again, at once when it brought changes, else as ``retries.CLUSTER_REWATCH``
        says; while none runs, every pass reads every node, and the first pass after a new watch does too."""
        while True:
            async for attempt in CLUSTER_REWATCH.tries(note=_rewatching):
                with attempt:
                    await self._follow_once()

    async def _follow_once(self) -> None:
        changed = False
        changes = self.cluster.watch()
        ready = getattr(changes, "ready", None)  # a Kubernetes watch lists first: changes count from then on
        try:
            if ready is not None:
                await ready()
            self.watching, self._resync_due = True, True  # what changed before the watch began is read whole
            async for change in changes:
                changed = True
                self.note_change(change)
            ended = ClusterError("the watch ended")
        except ClusterError as exc:
            ended = exc
        finally:
            self.watching, self._resync_due = False, True
            close = getattr(changes, "aclose", None)
            if close is not None:
                await close()
        if not changed:
            raise ended
        log.info("cluster watch ended; watching again", extra={"error": str(ended)})

    def note_change(self, change: ClusterChange) -> None:
        """The node ``change`` is about is read again by the next pass, which comes at once when that node's
        upgrade is in flight; a change the kept view already holds (its revision: this coordinator's own write,
        read back after it) is passed over. A pod gone from a node the change does not name (a Kubernetes
        watch's re-list reports a deleted pod by name alone) makes the next pass a full one."""
        if change.node:
            kept = self._views.get(change.node)
            if change.kind == "node" and change.revision and kept is not None and kept.revision == change.revision:
                return
            self.pace.mark(change.node, prompt=change.node in self._in_flight)
        elif change.kind == "pod" and change.type == "DELETED":
            self._resync_due = True

    def changed(self) -> frozenset[str]:
        """The nodes the next pass reads because they changed (the watch or a verdict said so)."""
        return self.pace.changed()

    def note_verdict(self, node: str) -> None:
        """A drain verdict was heard for ``node``: the next pass reads it (and its verdict) again, at once."""
        self.pace.mark(node, prompt=True)

    async def reconcile_once(self, poll_in_flight: bool = True) -> bool:
        """One pass; False when another coordinator leads. Raises ``StaleLeader`` when the lease was lost mid-pass.
        ``poll_in_flight`` False: a prompt pass, which reads only the nodes that changed and those asked soon (not
        every node in flight)."""
        token = await self.lease.acquire(self._floor)
        if token is None:
            self.token = 0
            return False
        if token != self.token:
            log.info("leading driver upgrades", extra={"holder": self.lease.holder, "fencing_token": token})
            self._resync_due = True  # another coordinator may have led meanwhile
        self.token = token
        self._verdicts_silent = False
        try:
            await self._pass(token, self.policy(), poll_in_flight)
        except BaseException:
            self._resync_due = True  # the nodes this pass was to read may be unread: the next one reads all
            raise
        return True

    async def _pass(self, token: int, policy: DriverPolicy, poll_in_flight: bool = True) -> None:
        now = self.clock()
        why = self._why_full(policy, now)
        self._policy_seen = policy
        due = self.pace.begin()
        changed = self.pace.take_changed()  # before the read: what changes during it is read again next pass
        if why:
            self.pace.polled()
            self._resync_due = False
            infos = await self.cluster.nodes()
            gone: list[str] = sorted(set(self._views) - {info.name for info in infos})
        else:
            names = sorted(changed | due | (self._in_flight if poll_in_flight else set()))
            found = await asyncio.gather(*(self.cluster.node(name) for name in names))
            infos = [info for info in found if info is not None]
            gone = [name for name, info in zip(names, found, strict=True) if info is None]
        stamped = stamped_token(infos)
        if stamped > token:
            await self._give_up(f"the lease's token {token} is older than token {stamped} stamped on a node")
        read = list(await asyncio.gather(*(self._view(info) for info in infos)))
        for name in gone:
            self._forget(name)
            self.pace.forget(name)
        for view in read:
            self._put(view)
        if why:
            self._resync_at = now + self.resync_s
        self.last_pass = PassStats(full=bool(why), nodes_read=len(read), why=why)
        looked_at = [self._views[name] for name in {v.name for v in read} | self._waiting if name in self._views]
        for index in upgrade_order(looked_at):
            current = self._views.get(looked_at[index].name)
            if current is not None:
                await self._advance(current, policy)
        self.pace.settle(v.name for v in read)  # read, and not asked again: no longer waiting on its agent

    def _why_full(self, policy: DriverPolicy, now: float) -> str:
        """Why this pass reads every node ('' when it reads only what changed or is in flight)."""
        if not self.watching:
            return "no watch feeds the view"
        if self._resync_due:
            return "a new watch, a new lease, or the last pass failed"
        if policy != self._policy_seen:
            return "the policy changed"
        if now >= self._resync_at:
            return f"resync every {self.resync_s:g} s"
        return ""

    def cluster_view(self) -> ClusterView:
        """The slot counts over the kept views (``ClusterView.of`` them all, counted as they change)."""
        in_progress, unavailable, failed = self._tally
        return ClusterView(total=len(self._views), in_progress=in_progress, unavailable=unavailable, failed=failed)

    def _put(self, view: NodeView) -> None:
        """Keep ``view`` as its node's, the counts, the sets of nodes in flight and waiting, and the status too."""
        self._forget(view.name)
        self._views[view.name] = view
        for i, count in enumerate(counted(view)):
            self._tally[i] += count
        if view.state in IN_PROGRESS or view.state == "upgrade-failed" or not view.installed_version:
            self._in_flight.add(view.name)
        if view.state == "upgrade-required":
            self._waiting.add(view.name)
        self.states[view.name] = self._state_of(view)

    def _forget(self, name: str) -> None:
        old = self._views.pop(name, None)
        if old is not None:
            for i, count in enumerate(counted(old)):
                self._tally[i] -= count
        self._in_flight.discard(name)
        self._waiting.discard(name)
        self.states.pop(name, None)

    async def _advance(self, view: NodeView, policy: DriverPolicy) -> NodeView:
        """Steps on one node until it waits; the slot counts are the kept views' as each step leaves them."""
        for _ in range(_MAX_STEPS_PER_NODE):
            await self._republish_drain(view)
            action = next_step(view, policy, self.cluster_view(), self.clock())
            if action.kind == "wait":
                return view
            before = (view.state, view.schedulable, dict(view.annotations))
            conflicted = False
            try:
                await self._execute(view, action, policy)
            except ClusterConflict as exc:
                log.info("node changed since it was read; deciding again", extra={"node": view.name, "error": str(exc)})
                conflicted = True
            info = await self.cluster.node(view.name)
            if info is None:
                self._forget(view.name)
                return view
            view = await self._view(info)
            self._put(view)
            if conflicted:
                continue
            if action.kind in ("evict", "request_drain", "external_drain") or before == (
                view.state,
                view.schedulable,
                dict(view.annotations),
            ):
                return view
        return view

    async def _floor(self) -> int:
        """What a new token must be above: read from the nodes, which keep their stamps whatever the lease's
        store loses."""
        highest = await highest_stamped_token(self.cluster)
        log.info("taking a fencing token above those on the nodes", extra={"highest_stamped": highest})
        return highest

    # -- reading --------------------------------------------------------------------------------------------------
    async def _view(self, info: NodeInfo) -> NodeView:
        installed = await self._installed(info.name)
        pods = await self.cluster.pods(node=info.name)
        drain_id = info.annotations.get(UPGRADE_DRAIN_ANNOTATION, "") or info.annotations.get(
            CORDON_DRAIN_ANNOTATION, ""
        )
        verdict = await self._verdict(drain_id, info.name) if drain_id else ""
        return NodeView(
            name=info.name,
            labels=dict(info.labels),
            annotations=dict(info.annotations),
            schedulable=info.schedulable,
            ready=info.ready,
            gpus=info.gpus,
            installed_version=installed,
            pods=tuple(PodView(p.name, p.namespace, p.phase, dict(p.labels)) for p in pods),
            drain_verdict=verdict,
            evict_after=self._backoff.get(info.name, (0.0, 0.0))[1],
            revision=info.revision,
        )

    async def _verdict(self, drain_id: str, node: str) -> str:
        """The drain's verdict; ``VERDICT_UNKNOWN`` when it cannot be read, and for the rest of the pass once one
        could not (a pass never waits on a silent checkpoint service once per drained node)."""
        if self._verdicts_silent:
            return VERDICT_UNKNOWN
        try:
            return verdict_text(await self.drains.verdict(drain_id, node))
        except VerdictUnknown as exc:
            log.warning("drain verdicts unreadable this pass", extra={"drain_id": drain_id, "error": str(exc)})
            self._verdicts_silent = True
            return VERDICT_UNKNOWN

    async def _installed(self, node: str) -> str:
        """The node's driver version as its agent answers; empty (unknown) when it cannot, which the state machine
        never takes for "up to date". A silent agent is logged when it falls silent, not on every pass."""
        try:
            installed = (await self.drivers(node).versions()).driver
        except GpuError as exc:
            if self._silent.get(node) != str(exc):
                log.warning("driver version unreadable", extra={"node": node, "error": str(exc)})
            self._silent[node] = str(exc)
            return ""
        if self._silent.pop(node, None) is not None:
            log.info("driver agent answers again", extra={"node": node, "driver": installed})
        return installed

    def _state_of(self, view: NodeView) -> dict[str, str]:
        state = {
            "state": view.state,
            "reason": view.annotations.get(UPGRADE_FAILURE_ANNOTATION, ""),
            "since": view.annotations.get(
                UPGRADE_SINCE_ANNOTATION, ""
            ),  # when the node entered its state (epoch seconds)
        }
        if view.name in self._silent:
            state["agent"] = self._silent[view.name]
        return state

    # -- writing, fenced ------------------------------------------------------------------------------------------
    async def _guard(self, node: NodeView) -> None:
        """Renew the lease (a pass that waits on agents outlasts a lease taken once at its start) and check this
        coordinator still holds it with its token, and that no newer one has written the node."""
        current = await self.lease.acquire(self._floor)
        if current != self.token:
            held = "another coordinator holds the lease" if current is None else f"the lease lapsed (now {current})"
            raise StaleLeader(f"fencing token {self.token} is stale: {held}")
        stamped = node.annotations.get(UPGRADE_FENCE_ANNOTATION, "0")
        if stamped.isdigit() and int(stamped) > self.token:
            await self._give_up(f"{node.name} was written with fencing token {stamped}, newer than {self.token}")

    async def _give_up(self, why: str) -> None:
        """The lease names this coordinator, yet a node carries a newer token than the lease's: the lease's store
        lost writes (its counter went back), or the token was taken before it did. Writing on would reuse tokens,
        so the lease is given up; the next pass (of whichever coordinator) takes a token above every stamp."""
        await self.lease.release()
        self.token = 0
        raise StaleLeader(why)

    async def _write(
        self,
        view: NodeView,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        schedulable: bool | None = None,
    ) -> NodeInfo:
        """One compare-and-set write on the node as ``view`` read it, stamped with this coordinator's token."""
        return await self.cluster.update_node(
            view.name,
            labels=labels,
            annotations={**(annotations or {}), **self._stamp()},
            schedulable=schedulable,
            expect=view.revision,
        )

    def _stamp(self) -> dict[str, str]:
        return {UPGRADE_FENCE_ANNOTATION: str(self.token)}

    async def _name_drain(self, view: NodeView, annotation: str, drain_id: str) -> None:
        """The drain's name on the node (the drain client's), in a write fenced as every other."""
        await self.drains.name_on_node(
            self.cluster, view.name, annotation, drain_id, expect=view.revision, stamp=self._stamp()
        )

    async def _claim(self, view: NodeView) -> NodeView:
        """Stamp the token on the node before an effect off it (an eviction, an install): refused if the node
        changed since ``view`` was read. The view as the node now is, so the step's own write still applies."""
        written = await self._write(view)
        return replace(
            view, labels=dict(written.labels), annotations=dict(written.annotations), revision=written.revision
        )

    async def _execute(self, view: NodeView, action: Action, policy: DriverPolicy) -> None:
        await self._guard(view)
        node = view.name
        match action.kind:
            case "cordon":
                await self._transition(view, action, schedulable=False)
            case "uncordon":
                await self._transition(view, action, schedulable=True)
            case "set_state" | "fail":
                await self._transition(view, action)
            case "request_drain":
                drain_id = self.drains.new_id(f"upgrade-{node}-{self.token}", str(int(self.clock() * 1000)))
                await self._name_drain(view, UPGRADE_DRAIN_ANNOTATION, drain_id)
                await self._request_drain(node, drain_id, policy, "driver-upgrade")
            case "external_drain":
                drain_id = self.drains.new_id(f"cordon-{node}-{self.token}", str(int(self.clock() * 1000)))
                await self._name_drain(view, CORDON_DRAIN_ANNOTATION, drain_id)
                await self._request_drain(node, drain_id, policy, EXTERNAL_DRAIN_REASON)
            case "forget_external_drain":
                await self.drains.clear_name(
                    self.cluster, node, CORDON_DRAIN_ANNOTATION, expect=view.revision, stamp=self._stamp()
                )
            case "evict":
                await self._evict(await self._claim(view), action, policy)
            case "install":
                await self._install(await self._claim(view), action, policy)
            case "validate":
                await self._validate(view, action, policy)

    async def _transition(self, view: NodeView, action: Action, schedulable: bool | None = None) -> None:
        """The annotations, the state label and the cordon in one compare-and-set write: a coordinator killed before
        it finds the node as it was, one killed after finds it moved on; the event follows the write."""
        labels = {UPGRADE_STATE_LABEL: action.state} if action.state and action.state != view.state else None
        await self._write(view, labels=labels, annotations=action.annotations, schedulable=schedulable)
        if not action.state or action.state == view.state:
            return
        target = view.annotations.get(UPGRADE_TARGET_ANNOTATION, "") or desired_version(self.policy(), view.labels)
        if action.state == "upgrade-failed":
            log.error(
                "driver upgrade FAILED; the node stays cordoned until the failure is cleared",
                extra={"node": view.name, "reason": action.why, "previous_state": view.state},
            )
        else:
            log.info(
                "driver upgrade state",
                extra={"node": view.name, "state": action.state, "previous_state": view.state, "reason": action.why},
            )
        await self.publish(
            DriverUpgradeStateChanged(
                node=view.name,
                state=_state(action.state),
                previous_state=_state(view.state),
                reason=action.why,
                desired_version=target,
                installed_version=view.installed_version,
            )
        )
        if self.on_transition is not None:
            self.on_transition(view.name, view.state, action.state)

    async def _request_drain(self, node: str, drain_id: str, policy: DriverPolicy, reason: str) -> None:
        await self.drains.ask(drain_id, node, reason, deadline_s=min(_DRAIN_DEADLINE_S, policy.drain_timeout_s * 0.8))

    async def _republish_drain(self, view: NodeView) -> None:
        """A drain named on the node but neither decided nor published by this process (its publisher died between
        naming it and publishing it) is requested again; the checkpoint service runs a drain id once."""
        drain_id = view.annotations.get(UPGRADE_DRAIN_ANNOTATION, "")
        if view.state == "checkpoint-required" and drain_id and not view.drain_verdict:
            if not self.drains.asked(drain_id):
                await self._guard(view)
                await self._request_drain(view.name, drain_id, self.policy(), "driver-upgrade")

    async def _evict(self, view: NodeView, action: Action, policy: DriverPolicy) -> None:
        """One round of evictions (``shared.clients.evictions``); a round a PodDisruptionBudget refused sets when
        the node may be tried again (``NodeView.evict_after``), later after each refused round in a row. Not a
        ``shared.plumbing.retries`` policy: the delay is state kept per node across passes, not a wait in a loop."""
        done = await evict_pods(self.cluster, view.name, action.pods)
        if done.blocked:
            previous = self._backoff.get(view.name)
            delay = PdbBackoff(policy.eviction_backoff_s).after(previous[0] if previous else None)
            self._backoff[view.name] = (delay, self.clock() + delay)
        else:
            self._backoff.pop(view.name, None)

    async def _install(self, view: NodeView, action: Action, policy: DriverPolicy) -> None:
        """Ask the node's agent to install (or how the install it runs is doing); a refusal is a failed install,
        silence a temporary failure until ``install_timeout_s``."""
        try:
            status = await self.drivers(view.name).install(
                action.version, install_attempt(view), policy.install_timeout_s
            )
        except AgentUnreachable as exc:
            status = InstallStatus("unreachable", str(exc))
        except GpuError as exc:
            status = InstallStatus("failed", str(exc))
        outcome = after_install(view, policy, status.progress, status.reason, self.clock())
        if outcome.kind == "wait":
            log.info("driver install not finished", extra={"node": view.name, "reason": outcome.why})
            self.pace.soon(view.name)
            return
        if status.progress == "installed":
            await self.publish(DriverInstalled(node=view.name, version=action.version))
        else:
            await self.publish(DriverInstallFailed(node=view.name, version=action.version, reason=outcome.why))
        await self._transition(view, outcome)

    async def _validate(self, view: NodeView, action: Action, policy: DriverPolicy) -> None:
        try:
            result = await self.drivers(view.name).validate(action.version)
            ok, reason = result.ok, result.reason
            if ok and result.version != action.version:
                ok, reason = False, f"driver {result.version} answers, {action.version} was expected"
            if ok and result.visible_gpus < view.gpus:
                ok, reason = False, f"{result.visible_gpus} GPU(s) visible, the node has more"
        except GpuError as exc:
            ok, reason = False, str(exc)
        outcome = after_validation(view, policy, ok, reason, self.clock())
        if ok and view.state != "upgrade-failed":
            await self.publish(DriverInstalled(node=view.name, version=action.version, validated=True))
        if outcome.kind == "wait":
            if view.state != "upgrade-failed":
                log.info("driver validation not passing yet", extra={"node": view.name, "reason": reason})
                self.pace.soon(view.name)
            return
        if outcome.state == "uncordon-required" and view.state == "upgrade-failed":
            log.warning("driver upgrade failure RECOVERED by a later validation", extra={"node": view.name})
        await self._transition(view, outcome)

    # -- status ---------------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {"leader": self.token > 0, "fencing_token": self.token, "nodes": dict(self.states)}


_STATES: frozenset[str] = frozenset(get_args(UpgradeState))


_WATCH_END_S = 5.0


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel the watch and let it end, for a bounded time: a standby's passes must not wait on a Redis read being
    cancelled (seen once to hang under a heavily loaded machine in bench.driver, not diagnosed)."""
    task.cancel()
    ended, _ = await asyncio.wait({task}, timeout=_WATCH_END_S)
    if not ended:
        log.warning(
            "the cluster watch did not end after its cancel; left to end on its own", extra={"waited_s": _WATCH_END_S}
        )


def _rewatching(exc: Exception, wait_s: float) -> None:
    log.warning("cluster watch failed; every pass reads every node until it runs again", extra={"error": str(exc)})


def _state(value: str) -> UpgradeState:
    return cast(UpgradeState, value) if value in _STATES else ""
