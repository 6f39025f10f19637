"""The scaler's Prometheus metrics, read from ``ScalerCore`` at scrape time (nothing on the request path).

Per ScaledObject (labels ``namespace``, ``scaled_object``, ``deployment``): the decided count, whether there is
one, the count each signal asked for, which signal set the count, the inputs it was decided on (only those the
scaler has: a missing input has no sample, never a 0) and which inputs were stale. Counters: answers without a
decision (KEDA's fallback counts these), decision changes by signal, load reports taken. And every drain that has
no verdict yet, with its deadline (the scaler hears every drain request and verdict).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .handlers import ScalerCore

_OBJECT = ["namespace", "scaled_object", "deployment"]


class ScalerCollector(Collector):
    def __init__(self, core: ScalerCore) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        following = self.core.following()
        for held, key in (
            (
                GaugeMetricFamily("gpuwarden_scaler_scaled_objects", "ScaledObjects the scaler watches"),
                "scaled_objects",
            ),
            (GaugeMetricFamily("gpuwarden_scaler_queues", "Request queues the scaler polls"), "queues"),
            (GaugeMetricFamily("gpuwarden_scaler_streams", "StreamIsActive streams open"), "streams"),
        ):
            held.add_metric([], float(following[key]))
            yield held
        desired = GaugeMetricFamily(
            "gpuwarden_scaler_desired_replicas", "Replica count the scaler decided for the ScaledObject", labels=_OBJECT
        )
        available = GaugeMetricFamily(
            "gpuwarden_scaler_decision_available",
            "1 while the scaler has a decision for the ScaledObject; 0: it answers UNAVAILABLE (KEDA falls back)",
            labels=_OBJECT,
        )
        asked = GaugeMetricFamily(
            "gpuwarden_scaler_signal_replicas",
            "Replica count each signal with a fresh input asks for (queue, gpu, kv, ttft)",
            labels=[*_OBJECT, "signal"],
        )
        deciding = GaugeMetricFamily(
            "gpuwarden_scaler_decision_signal",
            "1 for the signal that set the ScaledObject's count (services/scaler/decision.py SIGNALS)",
            labels=[*_OBJECT, "signal"],
        )
        stale = GaugeMetricFamily(
            "gpuwarden_scaler_input_stale",
            "1 for each input the last decision did not have fresh (queue, gpu, replicas, load, kv)",
            labels=[*_OBJECT, "input"],
        )
        depth = GaugeMetricFamily(
            "gpuwarden_scaler_queue_depth", "Requests queued or in progress, as last read", labels=_OBJECT
        )
        gpu = GaugeMetricFamily(
            "gpuwarden_scaler_gpu_utilisation_ratio", "Mean GPU utilisation of the deployment, 0-1", labels=_OBJECT
        )
        kv = GaugeMetricFamily(
            "gpuwarden_scaler_kv_cache_utilisation_ratio",
            "KV-cache blocks used / blocks in the pools of the pods with a fresh load report, 0-1",
            labels=_OBJECT,
        )
        ttft = GaugeMetricFamily(
            "gpuwarden_scaler_ttft_p90_seconds",
            "Time to first token at p90: the slowest pod with a fresh load report",
            labels=_OBJECT,
        )
        reporting = GaugeMetricFamily("gpuwarden_scaler_load_pods", "Pods with a fresh load report", labels=_OBJECT)
        for (namespace, name), watch in list(self.core.watches.items()):
            labels = [namespace, name, watch.trigger.deployment]
            decision, inputs = watch.decision, watch.inputs
            ok = decision is not None and decision.available
            available.add_metric(labels, 1.0 if ok else 0.0)
            if decision is not None and ok:
                desired.add_metric(labels, float(decision.desired))
                deciding.add_metric([*labels, decision.signal], 1.0)
                for signal, n in decision.signal_replicas.items():
                    asked.add_metric([*labels, signal], float(n))
            for what in decision.stale if decision is not None else ():
                stale.add_metric([*labels, what], 1.0)
            if inputs.queue_depth is not None:
                depth.add_metric(labels, float(inputs.queue_depth))
            if inputs.gpu_util is not None:
                gpu.add_metric(labels, inputs.gpu_util / 100.0)
            if inputs.kv_util is not None:
                kv.add_metric(labels, inputs.kv_util)
            if inputs.ttft_p90_s is not None:
                ttft.add_metric(labels, inputs.ttft_p90_s)
            reporting.add_metric(labels, float(inputs.load_pods))
        yield from (desired, available, asked, deciding, stale, depth, gpu, kv, ttft, reporting)

        unavailable = CounterMetricFamily(
            "gpuwarden_scaler_unavailable",
            "Answers to KEDA without a decision (UNAVAILABLE); KEDA's fallback applies after failureThreshold",
        )
        unavailable.add_metric([], float(self.core.unavailable))
        decisions = CounterMetricFamily(
            "gpuwarden_scaler_decisions",
            "Scale decision changes announced, by the signal that set them",
            labels=["signal"],
        )
        for signal, n in sorted(self.core.decisions_by_signal.items()):
            decisions.add_metric([signal], float(n))
        reports = CounterMetricFamily("gpuwarden_scaler_load_reports", "Pod load reports (kv.pod.load) taken")
        reports.add_metric([], float(self.core.load_reports))
        yield from (unavailable, decisions, reports)

        deadlines = GaugeMetricFamily(
            "gpuwarden_drain_deadline_timestamp_seconds",
            "Deadline (seconds since the epoch) of each drain that has no verdict yet",
            labels=["node", "drain_id"],
        )
        for drain_id, (node, due) in list(self.core.awaiting_verdict.items()):
            deadlines.add_metric([node, drain_id], due)
        yield deadlines
