"""The replica decision: a pure function of the inputs and the time, plus the scale-down stabiliser.

The rule, for one trigger (see ``trigger.py`` for the keys):

1. Fresh inputs only. The queue depth (JetStream ``num_pending + num_ack_pending`` of the deployment's request
   consumer) is fresh when read within ``queueStaleAfter``; the GPU utilisation (the metrics service's
   ``DeploymentUtilisation``) when sampled within ``utilStaleAfter`` and the current replica count is known; the
   pods' load (their ``kv.pod.load`` reports: KV-cache utilisation and time to first token) when a pod reported
   within ``loadStaleAfter``. A deployment with no pod at all (current replicas known to be 0) has no load to
   report: its KV count is 0 and its TTFT count absent, and nothing is stale.
2. One replica count per signal, each the HPA's own formula for its kind:
   queue ``q = ceil(depth / queueDepthPerReplica)``;
   GPU ``u = ceil(current * util / gpuUtilTarget)``;
   KV cache ``k = ceil(n * kv_util / kvCacheUtilTarget)`` (``kv_util``: KV blocks used / blocks in the pools, over
   the pods that reported; ``n``: the current replicas, else the pods that reported);
   TTFT ``t = ceil(n * ttft_p90 / ttftP90TargetMs)`` (``ttft_p90``: the slowest reporting pod's p90; absent while
   no request got its first token in the window: an idle deployment is not a slow one, and nothing is stale).
   The rule that combines them: **the most demanding wins**, the largest count. ``combine: sum`` first adds the
   queue and GPU counts into one (``queue+gpu``), which then competes with the others.
3. Active (KEDA's 0 <-> 1) when the queue is deeper than ``activationQueueDepth``, or utilisation is above
   ``activationGpuUtil`` (when set), or pods of the deployment sit on a draining node; active means at least one
   replica. The queue depth counts requests in progress too, so an inactive queue means no work at all, and KEDA
   scales to zero after its ``cooldownPeriod`` whatever the GPUs or KV caches report, unless ``activationGpuUtil``
   is set.
4. Drain-aware surge: the pods of this deployment on nodes that are draining now are added, so their replacements
   warm up elsewhere before those pods are evicted (``drainSurge: false`` turns it off).
5. Clamped to ``[minReplicas, maxReplicas]``.
5b. Model rollout: while one of the deployment's rollouts prepares (its pods load the new version beside the one
   they serve, busy though their GPUs may look idle), the count may not fall below the current replicas, so the
   switch happens with the capacity it started with.
6. Stabilisation: scale-up at once; scale-down only to the highest count recommended within the last
   ``stabilisationWindow`` (the HPA's scale-down rule), so a dip does not remove a replica that is needed again.
7. Stale inputs. An input that is stale drops out of the rule, and the count may not fall below the last decision
   (missing data never scales down). With no fresh input at all the last decision is held; with no last decision
   either there is no answer (``available = False``): the gRPC layer answers ``UNAVAILABLE``, and KEDA's
   ``fallback`` (``failureThreshold``, ``replicas``) takes over, as it does for any scaler failure.

What set the count is the decision's ``signal``, one of ``SIGNALS``: the winning count's signal (``queue``,
``gpu``, ``kv``, ``ttft``, ``queue+gpu``; on a tie the first in that order), or the step after it that changed the
count: ``activation`` (active while every count is 0: one replica), ``drain-surge`` (every count 0, the pods of
draining nodes added), ``minReplicas`` / ``maxReplicas`` (clamped), ``held`` (stale input: no scale-down),
``rollout`` (a preparing rollout's floor), ``stabilisation`` (a higher count still inside the window), ``none``
(no answer). A surge on top of a count keeps that count's name; the surge itself is reported apart.

The value reported to KEDA: ``metricValue = desired`` with ``targetSize = 1`` and metric type ``AverageValue``;
the HPA computes ``ceil(metricValue / target) = ceil(desired / 1) = desired`` exactly (integers, exact in a
double). The HPA's tolerance (0.1) still applies: it leaves the count alone when ``desired / current`` is within
10 % of 1.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .trigger import Trigger

METRIC_TARGET = 1.0
_EPSILON = 1e-9

SIGNALS: tuple[str, ...] = (
    "queue",
    "gpu",
    "kv",
    "ttft",
    "queue+gpu",
    "activation",
    "drain-surge",
    "minReplicas",
    "maxReplicas",
    "held",
    "rollout",
    "stabilisation",
    "none",
)
"""Every value ``Decision.signal`` takes (the module's docstring says when each is given)."""


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the scaler knows about one deployment at a moment; times are seconds on the caller's clock."""

    queue_depth: int | None = None
    queue_read_at: float | None = None
    gpu_util: float | None = None  # percent, mean over the deployment's GPUs
    util_sampled_at: float | None = None
    current_replicas: int | None = None
    draining_pods: int = 0  # pods of this deployment on nodes that drain now
    rollout: str = ""  # the id of a rollout of this deployment preparing now
    kv_util: float | None = None  # 0..1: KV blocks used / blocks in the pools of the pods that reported
    ttft_p90_s: float | None = None  # the highest p90 time to first token among the pods that reported
    load_read_at: float | None = None  # when the newest of those reports came (None: no pod reported)
    load_pods: int = 0  # the pods whose fresh reports these figures are


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    active: bool
    available: bool = True
    queue_replicas: int | None = None
    util_replicas: int | None = None
    surge: int = 0
    stale: tuple[str, ...] = ()
    held: bool = False
    reason: str = ""
    kv_replicas: int | None = None
    ttft_replicas: int | None = None
    signal: str = "none"

    @property
    def metric_value(self) -> float:
        """Reported with ``METRIC_TARGET``: the HPA's ``ceil(value / target)`` is exactly ``desired``."""
        return float(self.desired) * METRIC_TARGET

    @property
    def signal_replicas(self) -> dict[str, int]:
        """The replica count each signal asked for (those with a fresh input)."""
        terms = (
            ("queue", self.queue_replicas),
            ("gpu", self.util_replicas),
            ("kv", self.kv_replicas),
            ("ttft", self.ttft_replicas),
        )
        return {name: n for name, n in terms if n is not None}


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPSILON))


def recommend(trigger: Trigger, inputs: Inputs, now: float, previous: Decision | None = None) -> Decision:
    """Steps 1 to 5 and 7 of the rule (stabilisation is ``Stabiliser``'s)."""
    stale: list[str] = []
    queue_fresh = (
        inputs.queue_depth is not None
        and inputs.queue_read_at is not None
        and now - inputs.queue_read_at <= trigger.queue_stale_after_s
    )
    if not queue_fresh:
        stale.append("queue")
    util_fresh = False
    if trigger.gpu_util_target is not None:
        if inputs.current_replicas is None:
            stale.append("replicas")
        elif (
            inputs.gpu_util is None
            or inputs.util_sampled_at is None
            or now - inputs.util_sampled_at > trigger.util_stale_after_s
        ):
            stale.append("gpu")
        else:
            util_fresh = True
    k_term, t_term, load_n = _load_terms(trigger, inputs, now, stale)

    q = _ceil(inputs.queue_depth / trigger.queue_depth_per_replica) if queue_fresh and inputs.queue_depth else 0
    q_term = q if queue_fresh else None
    u_term: int | None = None
    if util_fresh and trigger.gpu_util_target and inputs.current_replicas is not None and inputs.gpu_util is not None:
        u_term = _ceil(inputs.current_replicas * inputs.gpu_util / trigger.gpu_util_target)
    named = _named_terms(trigger, q_term, u_term, k_term, t_term)
    surge = inputs.draining_pods if trigger.drain_surge else 0

    if not named:
        if previous is not None and previous.available:
            return Decision(
                desired=previous.desired,
                active=previous.active,
                stale=tuple(stale),
                held=True,
                reason=f"held {previous.desired}: no fresh input ({', '.join(stale)} stale)",
                signal="held",
            )
        return Decision(
            desired=trigger.min_replicas,
            active=False,
            available=False,
            stale=tuple(stale),
            reason=f"no fresh input ({', '.join(stale)} stale) and no earlier decision",
        )

    queue_active = queue_fresh and (inputs.queue_depth or 0) > trigger.activation_queue_depth
    util_active = (
        util_fresh
        and trigger.activation_gpu_util is not None
        and inputs.gpu_util is not None
        and inputs.gpu_util > trigger.activation_gpu_util
    )
    active = queue_active or util_active or surge > 0
    if not queue_fresh and previous is not None:
        active = active or previous.active
    winner, base = max(named, key=lambda item: item[1])  # max keeps the first of equals: ties go in SIGNALS order
    signal = winner
    unclamped = (max(base, 1) if active else base) + surge
    if base == 0 and surge:
        signal = "drain-surge"
    elif base == 0 and active:
        signal = "activation"
    desired = min(max(unclamped, trigger.min_replicas), trigger.max_replicas)
    if desired != unclamped:
        signal = "minReplicas" if desired > unclamped else "maxReplicas"
    held = False
    if stale and previous is not None and previous.available and desired < previous.desired:
        desired, held, signal = previous.desired, True, "held"
    rollout_floor = min(inputs.current_replicas or 0, trigger.max_replicas) if inputs.rollout else 0
    rollout_held = desired < rollout_floor
    if rollout_held:
        desired, active, signal = rollout_floor, True, "rollout"

    parts = []
    if q_term is not None:
        parts.append(f"queue {inputs.queue_depth}/{trigger.queue_depth_per_replica} -> {q_term}")
    if u_term is not None:
        parts.append(f"gpu {inputs.current_replicas}x{inputs.gpu_util:g}%/{trigger.gpu_util_target:g}% -> {u_term}")
    if k_term is not None:
        kv = "0%" if inputs.kv_util is None else f"{inputs.kv_util * 100:.3g}%"
        parts.append(f"kv {load_n}x{kv}/{trigger.kv_cache_util_target:g}% -> {k_term}")
    if t_term is not None and inputs.ttft_p90_s is not None:
        ttft = f"{inputs.ttft_p90_s * 1000:.4g}ms"
        parts.append(f"ttft p90 {load_n}x{ttft}/{trigger.ttft_p90_target_ms:g}ms -> {t_term}")
    reason = f"{trigger.combine}({', '.join(parts)}) = {base} by {winner}"
    if surge:
        reason += f" + drain surge {surge}"
    if not active:
        reason += " inactive"
    if stale:
        reason += f"; stale: {', '.join(stale)}"
    if held:
        reason += f"; held at {desired}: no scale-down on stale input"
    if rollout_held:
        reason += f"; held at {desired}: rollout {inputs.rollout} preparing (preparing pods count as busy)"
    return Decision(
        desired=desired,
        active=active,
        queue_replicas=q_term,
        util_replicas=u_term,
        surge=surge,
        stale=tuple(stale),
        held=held,
        reason=reason,
        kv_replicas=k_term,
        ttft_replicas=t_term,
        signal=signal,
    )


def _load_terms(trigger: Trigger, inputs: Inputs, now: float, stale: list[str]) -> tuple[int | None, int | None, int]:
    """The KV-cache and TTFT replica counts (None: off or missing) and the replica count ``n`` they scale.
    Appends ``load`` (no fresh report) or ``kv`` (reports that do not know their pool) to ``stale``."""
    kv_target, ttft_target = trigger.kv_cache_util_target, trigger.ttft_p90_target_ms
    if kv_target is None and ttft_target is None:
        return None, None, 0
    if inputs.current_replicas == 0:  # no pod: nothing to report, nothing missing
        return (0 if kv_target is not None else None), None, 0
    if inputs.load_read_at is None or inputs.load_pods < 1 or now - inputs.load_read_at > trigger.load_stale_after_s:
        stale.append("load")
        return None, None, 0
    n = inputs.current_replicas if inputs.current_replicas is not None else inputs.load_pods
    k_term: int | None = None
    if kv_target is not None:
        if inputs.kv_util is None:
            stale.append("kv")
        else:
            k_term = _ceil(n * inputs.kv_util * 100.0 / kv_target)
    t_term: int | None = None
    if ttft_target is not None and inputs.ttft_p90_s is not None:
        t_term = _ceil(n * inputs.ttft_p90_s * 1000.0 / ttft_target)
    return k_term, t_term, n


def _named_terms(trigger: Trigger, q: int | None, u: int | None, k: int | None, t: int | None) -> list[tuple[str, int]]:
    """The competing replica counts with their signal's name, in ``SIGNALS`` order (``combine: sum`` makes the
    queue and GPU counts one)."""
    named: list[tuple[str, int]] = []
    if trigger.combine == "sum" and q is not None and u is not None:
        named.append(("queue+gpu", q + u))
    else:
        named += [(name, n) for name, n in (("queue", q), ("gpu", u)) if n is not None]
    named += [(name, n) for name, n in (("kv", k), ("ttft", t)) if n is not None]
    return named


@dataclass
class Stabiliser:
    """The HPA's scale-down stabilisation: the count is the highest recommendation within ``window_s``.

    Scale-up takes effect at once (a higher recommendation is the maximum immediately); a lower one only once
    every higher one has aged out of the window. Under a constant input the count is constant.
    """

    window_s: float
    _history: deque[tuple[float, int]] = field(default_factory=deque)  # values strictly decreasing: a window max

    def apply(self, now: float, recommended: int) -> int:
        while self._history and self._history[-1][1] <= recommended:
            self._history.pop()
        self._history.append((now, recommended))
        while self._history[0][0] < now - self.window_s:
            self._history.popleft()
        return self._history[0][1]


def decide(
    trigger: Trigger, inputs: Inputs, now: float, stabiliser: Stabiliser, previous: Decision | None = None
) -> Decision:
    """The whole rule: ``recommend`` then stabilised scale-down. ``stabiliser`` keeps this trigger's history."""
    rec = recommend(trigger, inputs, now, previous)
    if not rec.available:
        return rec
    stable = stabiliser.apply(now, rec.desired)
    if stable == rec.desired:
        return rec
    return Decision(
        desired=stable,
        active=rec.active or stable > 0,
        queue_replicas=rec.queue_replicas,
        util_replicas=rec.util_replicas,
        surge=rec.surge,
        stale=rec.stale,
        held=rec.held,
        reason=f"{rec.reason}; stabilised at {stable} (recommended {rec.desired}, "
        f"window {trigger.stabilisation_window_s:g}s)",
        kv_replicas=rec.kv_replicas,
        ttft_replicas=rec.ttft_replicas,
        signal="stabilisation",
    )
