"""What the scaler knows and decides: inputs kept fresh in the background, one decision per ScaledObject.

``ScalerCore`` holds the inputs (queue depths, utilisation, drains in flight, pod placement) and each watched
ScaledObject's current ``Decision`` (``decision.py``). The gRPC layer only reads it: every answer comes from
memory. Inputs are refreshed by loops and events, level-triggered: a periodic JetStream read of each watched
queue (every ``GPUWARDEN_SCALER_REFRESH_S``), the first request of an empty queue heard at once on a core
subscription, utilisation from the metrics service's events, the pods' KV-cache utilisation and time to first
token from their ``kv.pod.load`` reports, drains from the node events. Each change of a decision (its count, its
activity or the signal that set it) is published as a ``ScaleDecision`` event with its inputs and reason.

Load reports are kept per deployment and pod, stamped with the scaler's own clock when they arrive (a pod's clock
may be off). A deployment's figures are taken over the pods whose report is fresh (``loadStaleAfter`` of the
trigger): KV-cache utilisation is the sum of blocks used over the sum of blocks in their pools; time to first
token is the highest p90 among them (a deployment's p90 is never above its slowest pod's). With no fresh report
the figures are missing, never 0. A pod silent for ``LOAD_FORGET_S`` is forgotten.

The one wait on a request path: the first call for a ScaledObject the scaler has not seen yet waits (at most
``FIRST_READ_TIMEOUT_S``) for its queue's first read, so that KEDA's first answer is not a made-up number.

What is watched is what KEDA still asks about, and no more: a ScaledObject KEDA polls (``IsActive``,
``GetMetrics``, ``GetMetricSpec``) is kept for ``IDLE_WATCH_S`` after the last poll (a long ``pollingInterval``
must not lose its stabilisation history); one that only streams asked about is forgotten at the first refresh
after its last stream ended, and a queue no watched ScaledObject needs is no longer read nor subscribed to.
KEDA reconnecting opens a new stream, which follows the queue again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.contract.load import PodLoad
from shared.contract.metrics import DeploymentUtilisation
from shared.contract.models import RolloutState
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.scaler import ScaleDecision

from .decision import Decision, Inputs, Stabiliser, decide
from .ports import Placement, RequestQueue
from .trigger import KEDA_KEYS, Trigger, check_limits, check_ref, parse_trigger

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Deployment = tuple[str, str]  # (namespace, deployment)

ROLLOUT_HOLD_MAX_S = 900.0  # a preparing rollout holds the count at most this long should its outcome never come
ARRIVAL_HOLD_S = 1.0  # a request just heard counts as depth >= 1 for this long, until a JetStream read confirms
FIRST_READ_TIMEOUT_S = 2.0
PLACEMENT_EVERY = 2.0  # placement is read every this many queue refresh periods
PLACEMENT_STALE_S = 30.0
IDLE_WATCH_S = 900.0  # a ScaledObject KEDA has not polled for this long (deleted), and no stream holds, is forgotten
LOAD_FORGET_S = 300.0  # a pod that has not reported its load for this long is forgotten (it is gone)
VERDICT_WAIT_MAX_S = 24 * 3600.0  # a drain without a verdict is shown as such this long after its deadline, at most
VERDICT_WAITS_KEPT = 10_000


@dataclass
class QueueView:
    depth: int | None = None
    read_at: float | None = None
    arrived_at: float = float("-inf")
    error: str = ""
    unsubscribe: Callable[[], Awaitable[None]] | None = None
    first_read: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class UtilView:
    util: float
    sampled_at: float
    gpus: int


@dataclass(frozen=True, slots=True)
class LoadView:
    """One pod's newest load report, as the scaler keeps it."""

    blocks_used: int
    blocks_total: int
    ttft_p90_s: float | None
    received_at: float
    sent_at: float = 0.0
    """When the pod sent it (its own clock: compared only with its own earlier reports)."""


@dataclass(frozen=True, slots=True)
class DeploymentLoad:
    """A deployment's load from its pods' fresh reports; the figures are None when no pod's report says."""

    kv_util: float | None
    ttft_p90_s: float | None
    newest: float | None
    pods: int


def aggregate_load(reports: Mapping[str, LoadView], now: float, stale_after_s: float) -> DeploymentLoad:
    """KV utilisation = blocks used / blocks in the pools, over the fresh reports that know their pool; TTFT p90 =
    the highest of the fresh reports that measured one."""
    used = total = pods = 0
    ttft: float | None = None
    newest: float | None = None
    for view in reports.values():
        if now - view.received_at > stale_after_s:
            continue
        pods += 1
        newest = view.received_at if newest is None else max(newest, view.received_at)
        if view.blocks_total > 0:
            used += view.blocks_used
            total += view.blocks_total
        if view.ttft_p90_s is not None:
            ttft = view.ttft_p90_s if ttft is None else max(ttft, view.ttft_p90_s)
    return DeploymentLoad(kv_util=used / total if total else None, ttft_p90_s=ttft, newest=newest, pods=pods)


@dataclass
class Watch:
    """One ScaledObject (KEDA's namespace and name) as the scaler follows it: kept while a stream holds it
    (``streams``) or KEDA polled it within ``IDLE_WATCH_S`` (``polled_at``)."""

    trigger: Trigger
    stabiliser: Stabiliser
    decision: Decision | None = None
    inputs: Inputs = field(default_factory=Inputs)
    polled_at: float | None = None
    streams: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def deployment(self) -> Deployment:
        return (self.trigger.namespace, self.trigger.deployment)


class ScalerCore:
    """The scaler's state and decisions; no transport here, only the ports."""

    def __init__(
        self,
        queue: RequestQueue,
        placement: Placement | None = None,
        publish: Callable[[ScaleDecision], Awaitable[None]] | None = None,
        clock: Clock = time.time,
        refresh_s: float = 1.0,
    ) -> None:
        self.queue = queue
        self.placement = placement
        self.publish = publish
        self.clock = clock
        self.refresh_s = refresh_s
        self.watches: dict[tuple[str, str], Watch] = {}
        self.queues: dict[Deployment, QueueView] = {}
        self.utilisation: dict[Deployment, UtilView] = {}
        self.drains_in_flight: dict[str, str] = {}  # drain id -> node
        self._drain_expiry: dict[str, float] = {}
        self.rollouts: dict[Deployment, tuple[str, float]] = {}  # preparing: rollout id, when the hold expires
        self.pods: dict[Deployment, tuple[Mapping[str, int], float]] = {}
        self.loads: dict[Deployment, dict[str, LoadView]] = {}
        self.load_reports = 0  # load reports taken so far
        self.awaiting_verdict: dict[str, tuple[str, float]] = {}  # drain id -> (node, deadline): no verdict yet
        self.over: dict[str, None] = {}
        """Drains whose verdict and rollouts whose end (``drain:<id>``, ``rollout:<id>``) were heard, oldest first
        (at most ``VERDICT_WAITS_KEPT``): their request or ``preparing`` heard again (a replay, a duplicate that
        arrives late) holds nothing."""
        self.unavailable = 0  # answers without a decision (UNAVAILABLE: KEDA's fallback counts these)
        self.decisions_by_signal: dict[str, int] = {}  # decision changes announced, by the signal that set them
        self.decisions_published = 0
        self.refreshes = 0  # refresh loop iterations so far: "within two refreshes" is counted, not timed
        self._parsed: dict[tuple[Any, ...], Trigger] = {}  # metadata as KEDA sends it -> its checked trigger
        self._wake = asyncio.Event()
        self._outbox: asyncio.Queue[ScaleDecision] = asyncio.Queue(maxsize=10_000)

    # -- the gRPC layer's entry ---------------------------------------------------------------------------------
    async def watch(
        self, ref_namespace: str, ref_name: str, metadata: Mapping[str, str], *, stream: bool = False
    ) -> Watch:
        """The ScaledObject's watch, created on first sight. Raises ``TriggerError`` for a bad request: metadata
        or names over the limits (``trigger.py``), or metadata the scaler cannot use.

        A poll (``stream=False``) marks the watch polled now. A stream (``stream=True``) holds the watch until it
        calls ``release``; the hold is taken before the first wait, so no refresh forgets the watch under a stream
        still starting, and it is given back here if the call ends (KEDA hung up) before the watch is returned.
        """
        check_ref(ref_name, ref_namespace)
        check_limits(metadata)
        # KEDA's own keys (a PEM may be 64 KiB) do not change the trigger: they are no part of the cache's key.
        cache_key = (ref_namespace, *sorted(item for item in metadata.items() if item[0] not in KEDA_KEYS))
        trigger = self._parsed.get(cache_key)
        if trigger is None:
            trigger = parse_trigger(metadata, ref_namespace)
            if len(self._parsed) > 10_000:
                self._parsed.clear()
            self._parsed[cache_key] = trigger
        key = (ref_namespace, ref_name or trigger.deployment)
        watch = self.watches.get(key)
        fresh = watch is None or watch.decision is None
        if watch is None:
            watch = self.watches[key] = Watch(trigger=trigger, stabiliser=Stabiliser(trigger.stabilisation_window_s))
        elif watch.trigger != trigger:  # the ScaledObject was edited: same watch (open streams follow), new rule
            watch.trigger, watch.stabiliser, fresh = trigger, Stabiliser(trigger.stabilisation_window_s), True
        if stream:
            watch.streams += 1
        else:
            watch.polled_at = self.clock()
        try:
            await self._follow_queue(watch.deployment)  # returns at once when the queue is followed already
            if fresh:
                self._evaluate(watch)
            if watch.decision is None or not watch.decision.available:
                view = self.queues.get(watch.deployment)
                if view is not None and not view.first_read.is_set():
                    self._wake.set()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(view.first_read.wait(), FIRST_READ_TIMEOUT_S)
                    self._evaluate(watch)
        except BaseException:
            if stream:
                self.release(watch)
            raise
        return watch

    def release(self, watch: Watch) -> None:
        """A stream on ``watch`` ended. Nothing is read for it at once: a watch no stream holds and KEDA does not
        poll is forgotten, with its queue, at the next refresh."""
        watch.streams -= 1

    # -- inputs -------------------------------------------------------------------------------------------------
    async def _follow_queue(self, deployment: Deployment) -> None:
        if deployment in self.queues:
            return
        view = self.queues[deployment] = QueueView()
        try:
            unsubscribe = await self.queue.on_arrival(*deployment, lambda: self._on_arrival(deployment))
        except BaseException:
            if self.queues.get(deployment) is view:  # not followed after all: the next call tries again
                del self.queues[deployment]
            raise
        if self.queues.get(deployment) is not view:  # forgotten while subscribing: no subscription may outlive it
            await unsubscribe()
            return
        view.unsubscribe = unsubscribe
        self._wake.set()

    def _on_arrival(self, deployment: Deployment) -> None:
        view = self.queues.get(deployment)
        if view is None:
            return
        now = self.clock()
        first = not view.depth and now - view.arrived_at > ARRIVAL_HOLD_S
        view.arrived_at = now
        if first:
            self._evaluate_deployment(deployment)
            self._wake.set()

    async def refresh_queues(self) -> None:
        """Read every followed queue's depth from JetStream once, then decide again."""
        deployments = list(self.queues)
        results = await asyncio.gather(*(self.queue.depth(*d) for d in deployments), return_exceptions=True)
        now = self.clock()
        for deployment, result in zip(deployments, results, strict=True):
            view = self.queues.get(deployment)
            if view is None:
                continue
            if isinstance(result, BaseException):
                if view.error != repr(result):
                    log.warning(
                        "queue depth unreadable", extra={"deployment": "/".join(deployment), "error": repr(result)}
                    )
                view.error = repr(result)
                continue
            view.depth, view.read_at, view.error = result, now, ""
            view.first_read.set()
        self._evaluate_all()

    async def refresh_placement(self) -> None:
        if self.placement is None:
            return
        for deployment in {w.deployment for w in self.watches.values()}:
            try:
                self.pods[deployment] = (await self.placement.pods_by_node(*deployment), self.clock())
            except Exception as exc:
                log.debug("placement unreadable", extra={"deployment": "/".join(deployment), "error": repr(exc)})
        self._evaluate_all()

    async def on_drain(self, event: DrainRequested | DrainCompleted | DrainFailed) -> None:
        """Idempotent: a drain is in flight from its request until its verdict (keyed by drain id), or until its
        deadline plus the pods' grace period has passed, should the verdict never come."""
        match event:
            case DrainRequested() if f"drain:{event.drain_id}" in self.over:
                return
            case DrainRequested():
                expires = event.occurred_at.timestamp() + event.deadline_s + event.grace_period_s
                if expires > self.clock():
                    self.drains_in_flight[event.drain_id] = event.node
                    self._drain_expiry[event.drain_id] = expires
                deadline = event.occurred_at.timestamp() + event.deadline_s
                if deadline + VERDICT_WAIT_MAX_S > self.clock():
                    self.awaiting_verdict[event.drain_id] = (event.node, deadline)
                    while len(self.awaiting_verdict) > VERDICT_WAITS_KEPT:
                        del self.awaiting_verdict[next(iter(self.awaiting_verdict))]
            case DrainCompleted() | DrainFailed():
                self._ended(f"drain:{event.drain_id}")
                self.drains_in_flight.pop(event.drain_id, None)
                self._drain_expiry.pop(event.drain_id, None)
                self.awaiting_verdict.pop(event.drain_id, None)
        self._evaluate_all()

    async def on_load(self, event: PodLoad) -> None:
        """Idempotent: keeps each pod's newest report, stamped with the scaler's clock on arrival; one the pod sent
        no later than the report kept (a duplicate, a replay, a report overtaken) changes nothing, not even how
        fresh the pod's load reads. The decision takes it at the next refresh (load changes in seconds; the
        refresh reads the queues as often)."""
        pods = self.loads.setdefault((event.namespace, event.deployment), {})
        sent_at = event.occurred_at.timestamp()
        known = pods.get(event.pod)
        if known is not None and sent_at <= known.sent_at:
            return
        pods[event.pod] = LoadView(event.blocks_used, event.blocks_total, event.ttft_p90_s, self.clock(), sent_at)
        self.load_reports += 1

    def load(self, deployment: Deployment, now: float, stale_after_s: float) -> DeploymentLoad:
        return aggregate_load(self.loads.get(deployment, {}), now, stale_after_s)

    def _forget_silent_pods(self, now: float) -> None:
        for deployment, pods in list(self.loads.items()):
            for pod in [p for p, view in pods.items() if now - view.received_at > LOAD_FORGET_S]:
                del pods[pod]
            if not pods:
                del self.loads[deployment]
        for drain_id in [d for d, (_, due) in self.awaiting_verdict.items() if due + VERDICT_WAIT_MAX_S <= now]:
            del self.awaiting_verdict[drain_id]

    async def on_rollout(self, event: RolloutState) -> None:
        """Idempotent: a rollout holds its deployment's count from ``preparing`` until it is switched or aborted
        (or ``ROLLOUT_HOLD_MAX_S`` has passed, should that never be heard)."""
        key = (event.namespace, event.deployment)
        if event.phase == "preparing":
            if event.rollout_id and f"rollout:{event.rollout_id}" in self.over:
                return
            expires = event.occurred_at.timestamp() + ROLLOUT_HOLD_MAX_S
            if expires > self.clock():
                self.rollouts[key] = (event.rollout_id, expires)
        else:
            if event.rollout_id:
                self._ended(f"rollout:{event.rollout_id}")
            if key in self.rollouts and self.rollouts[key][0] in (event.rollout_id, ""):
                del self.rollouts[key]
        self._evaluate_deployment(key)

    def _ended(self, what: str) -> None:
        self.over[what] = None
        while len(self.over) > VERDICT_WAITS_KEPT:
            del self.over[next(iter(self.over))]

    def _rollout(self, deployment: Deployment, now: float) -> str:
        held = self.rollouts.get(deployment)
        if held is None:
            return ""
        if held[1] <= now:
            del self.rollouts[deployment]
            return ""
        return held[0] or "(unnamed)"

    async def on_utilisation(self, event: DeploymentUtilisation) -> None:
        """Idempotent: keeps the newest sample per deployment (an older one arriving late is ignored)."""
        sampled = (event.sampled_at or event.occurred_at).timestamp()
        key = (event.namespace, event.deployment)
        current = self.utilisation.get(key)
        if current is not None and current.sampled_at > sampled:
            return
        self.utilisation[key] = UtilView(util=event.mean_util, sampled_at=sampled, gpus=event.gpus)
        self._evaluate_deployment(key)

    def _expire_drains(self, now: float) -> None:
        for drain_id in [d for d, expires in self._drain_expiry.items() if expires <= now]:
            self.drains_in_flight.pop(drain_id, None)
            del self._drain_expiry[drain_id]

    # -- deciding -----------------------------------------------------------------------------------------------
    def inputs(self, deployment: Deployment, now: float, load_stale_after_s: float = 15.0) -> Inputs:
        view = self.queues.get(deployment) or QueueView()
        depth, read_at = view.depth, view.read_at
        if now - view.arrived_at <= ARRIVAL_HOLD_S:
            depth, read_at = max(depth or 0, 1), max(read_at or view.arrived_at, view.arrived_at)
        util = self.utilisation.get(deployment)
        placed = self.pods.get(deployment)
        current: int | None = None
        draining = 0
        if placed is not None and now - placed[1] <= PLACEMENT_STALE_S:
            current = sum(placed[0].values())
            self._expire_drains(now)
            nodes = set(self.drains_in_flight.values())
            draining = sum(n for node, n in placed[0].items() if node in nodes)
        elif util is not None and util.gpus > 0:
            current = util.gpus
        load = self.load(deployment, now, load_stale_after_s)
        return Inputs(
            queue_depth=depth,
            queue_read_at=read_at,
            gpu_util=util.util if util else None,
            util_sampled_at=util.sampled_at if util else None,
            current_replicas=current,
            draining_pods=draining,
            rollout=self._rollout(deployment, now),
            kv_util=load.kv_util,
            ttft_p90_s=load.ttft_p90_s,
            load_read_at=load.newest,
            load_pods=load.pods,
        )

    def _evaluate_all(self) -> None:
        for watch in list(self.watches.values()):
            self._evaluate(watch)

    def _evaluate_deployment(self, deployment: Deployment) -> None:
        for watch in list(self.watches.values()):
            if watch.deployment == deployment:
                self._evaluate(watch)

    def _evaluate(self, watch: Watch) -> None:
        now = self.clock()
        inputs = self.inputs(watch.deployment, now, watch.trigger.load_stale_after_s)
        previous = watch.decision
        decision = decide(watch.trigger, inputs, now, watch.stabiliser, previous)
        watch.decision, watch.inputs = decision, inputs
        if previous is not None and (previous.desired, previous.active, previous.available, previous.signal) == (
            decision.desired,
            decision.active,
            decision.available,
            decision.signal,
        ):
            return
        old, watch.changed = watch.changed, asyncio.Event()
        old.set()
        if decision.available:
            self._announce(watch, decision, inputs)

    def _announce(self, watch: Watch, decision: Decision, inputs: Inputs) -> None:
        event = ScaleDecision(
            namespace=watch.trigger.namespace,
            deployment=watch.trigger.deployment,
            desired_replicas=decision.desired,
            current_replicas=inputs.current_replicas or 0,
            queue_depth=inputs.queue_depth or 0,
            gpu_util=inputs.gpu_util,
            drain_surge=decision.surge,
            reason=decision.reason,
            signal=decision.signal,
            signal_replicas=decision.signal_replicas,
            kv_cache_util=inputs.kv_util,
            ttft_p90_s=inputs.ttft_p90_s,
            stale=list(decision.stale),
        )
        self.decisions_by_signal[decision.signal] = self.decisions_by_signal.get(decision.signal, 0) + 1
        with contextlib.suppress(asyncio.QueueFull):
            self._outbox.put_nowait(event)

    # -- loops (spawned by the service) -------------------------------------------------------------------------
    async def refresh_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            self._wake.clear()
            self._forget_silent_pods(self.clock())
            await self._forget_idle()
            if self.queues:
                await self.refresh_queues()
            self.refreshes += 1

    async def placement_loop(self) -> None:
        while True:
            await self.refresh_placement()
            await asyncio.sleep(PLACEMENT_EVERY * self.refresh_s)

    async def publish_loop(self) -> None:
        while True:
            event = await self._outbox.get()
            if self.publish is None:
                continue
            try:
                await self.publish(event)
                self.decisions_published += 1
            except Exception as exc:
                log.warning("scale decision not published", extra={"error": repr(exc)})

    async def _forget_idle(self) -> None:
        """Forget the watches no stream holds and KEDA has not polled within ``IDLE_WATCH_S`` (never polled: at
        once), then the queues and placements no watch needs, unsubscribing from those queues."""
        now = self.clock()
        for key, watch in list(self.watches.items()):
            if watch.streams == 0 and (watch.polled_at is None or now - watch.polled_at > IDLE_WATCH_S):
                del self.watches[key]
        followed = {w.deployment for w in self.watches.values()}
        released = [self.queues.pop(d) for d in list(self.queues) if d not in followed]
        for deployment in [d for d in self.pods if d not in followed]:
            del self.pods[deployment]
        await asyncio.gather(*(v.unsubscribe() for v in released if v.unsubscribe is not None))

    async def close(self) -> None:
        for view in self.queues.values():
            if view.unsubscribe is not None:
                await view.unsubscribe()
        self.queues.clear()

    def following(self) -> dict[str, int]:
        """What the scaler holds now: ScaledObjects watched, queues polled (one JetStream read and one core
        subscription each), StreamIsActive streams open, and refresh loop iterations so far."""
        return {
            "scaled_objects": len(self.watches),
            "queues": len(self.queues),
            "streams": sum(w.streams for w in self.watches.values()),
            "refreshes": self.refreshes,
        }

    def status(self) -> dict[str, Any]:
        return {
            "/".join(key): {
                "deployment": "/".join(w.deployment),
                "desired": w.decision.desired if w.decision else None,
                "active": w.decision.active if w.decision else None,
                "available": w.decision.available if w.decision else None,
                "reason": w.decision.reason if w.decision else "",
                "signal": w.decision.signal if w.decision else "",
                "signal_replicas": w.decision.signal_replicas if w.decision else {},
                "streams": w.streams,
            }
            for key, w in self.watches.items()
        }
