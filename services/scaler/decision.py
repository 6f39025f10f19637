"""The replica decision: a pure function of the inputs and the time, plus the scale-down stabiliser.

The rule, for one trigger (see ``trigger.py`` for the keys):

1. Fresh inputs only. The queue depth (JetStream ``num_pending + num_ack_pending`` of the deployment's request
   consumer) is fresh when read within ``queueStaleAfter``; the GPU utilisation (the metrics service's
   ``DeploymentUtilisation``) when sampled within ``utilStaleAfter`` and the current replica count is known.
2. Queue term ``q = ceil(depth / queueDepthPerReplica)``; GPU term ``u = ceil(current * util / gpuUtilTarget)``
   (the HPA's own utilisation formula). ``combine: max`` takes the larger, ``sum`` adds them.
3. Active (KEDA's 0 <-> 1) when the queue is deeper than ``activationQueueDepth``, or utilisation is above
   ``activationGpuUtil`` (when set), or pods of the deployment sit on a draining node; active means at least one
   replica. The queue depth counts requests in progress too, so an inactive queue means no work at all, and KEDA
   scales to zero after its ``cooldownPeriod`` whatever the GPUs report, unless ``activationGpuUtil`` is set.
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

    @property
    def metric_value(self) -> float:
        """Reported with ``METRIC_TARGET``: the HPA's ``ceil(value / target)`` is exactly ``desired``."""
        return float(self.desired) * METRIC_TARGET


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

    q = _ceil(inputs.queue_depth / trigger.queue_depth_per_replica) if queue_fresh and inputs.queue_depth else 0
    q_term = q if queue_fresh else None
    u_term: int | None = None
    if util_fresh and trigger.gpu_util_target and inputs.current_replicas is not None and inputs.gpu_util is not None:
        u_term = _ceil(inputs.current_replicas * inputs.gpu_util / trigger.gpu_util_target)
    terms = [t for t in (q_term, u_term) if t is not None]
    surge = inputs.draining_pods if trigger.drain_surge else 0

    if not terms:
        if previous is not None and previous.available:
            return Decision(
                desired=previous.desired,
                active=previous.active,
                stale=tuple(stale),
                held=True,
                reason=f"held {previous.desired}: no fresh input ({', '.join(stale)} stale)",
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
    base = max(terms) if trigger.combine == "max" else sum(terms)
    desired = (max(base, 1) if active else base) + surge
    desired = min(max(desired, trigger.min_replicas), trigger.max_replicas)
    held = False
    if stale and previous is not None and previous.available and desired < previous.desired:
        desired, held = previous.desired, True
    rollout_floor = min(inputs.current_replicas or 0, trigger.max_replicas) if inputs.rollout else 0
    rollout_held = desired < rollout_floor
    if rollout_held:
        desired = rollout_floor
        active = True

    parts = []
    if q_term is not None:
        parts.append(f"queue {inputs.queue_depth}/{trigger.queue_depth_per_replica} -> {q_term}")
    if u_term is not None:
        parts.append(f"gpu {inputs.current_replicas}x{inputs.gpu_util:g}%/{trigger.gpu_util_target:g}% -> {u_term}")
    reason = f"{trigger.combine}({', '.join(parts)})"
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
    )


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
    )
