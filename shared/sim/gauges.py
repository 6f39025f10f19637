"""The SIMULATED workload's Prometheus metrics (``gpuwarden_sim_*``, on the simulation's own ``/metrics``): what its
pods served, restored and lost, and how full their KV block pools are. A real cluster has none of these: its
inference servers report their load over the bus (``kv.pod.load``), which the scaler exports."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.sim.workload import SimWorkload


class WorkloadCollector(Collector):
    def __init__(self, workload: SimWorkload) -> None:
        self.workload = workload

    def collect(self) -> Iterator[Metric]:
        stats = self.workload.stats
        for counter, value in (
            (CounterMetricFamily("gpuwarden_sim_requests", "SIMULATED: inference requests taken"), stats.requests),
            (CounterMetricFamily("gpuwarden_sim_requests_served", "SIMULATED: requests served"), stats.served),
            (
                CounterMetricFamily("gpuwarden_sim_sessions_lost", "SIMULATED: sessions whose context was lost"),
                stats.lost,
            ),
            (
                CounterMetricFamily("gpuwarden_sim_preemptions", "SIMULATED: sessions preempted by a full KV pool"),
                stats.preemptions,
            ),
            (
                CounterMetricFamily(
                    "gpuwarden_sim_sessions_continued_after_kill",
                    "SIMULATED: sessions of pods killed without a preStop that went on on another pod",
                ),
                stats.continued_after_kill,
            ),
            (
                CounterMetricFamily(
                    "gpuwarden_sim_tokens_recomputed_after_kill",
                    "SIMULATED: positions those sessions computed again after their last checkpoint or journal entry",
                ),
                stats.tokens_recomputed_after_kill,
            ),
        ):
            counter.add_metric([], float(value))
            yield counter
        checks = CounterMetricFamily(
            "gpuwarden_sim_restores",
            "SIMULATED: sessions restored from a checkpoint, by the check of the restored conversation against a "
            "reference run (verified, failed, unchecked)",
            labels=["check"],
        )
        for check, value in (
            ("verified", stats.restore_verified),
            ("failed", stats.restore_check_failed),
            ("unchecked", stats.restore_unchecked),
        ):
            checks.add_metric([check], float(value))
        yield checks
        used = GaugeMetricFamily(
            "gpuwarden_sim_kv_used_blocks", "SIMULATED: KV blocks held in each pod's pool", labels=["pod", "node"]
        )
        pool = GaugeMetricFamily(
            "gpuwarden_sim_kv_pool_blocks", "SIMULATED: KV blocks in each pod's pool", labels=["pod", "node"]
        )
        sessions = GaugeMetricFamily(
            "gpuwarden_sim_sessions", "SIMULATED: sessions each pod holds", labels=["pod", "node"]
        )
        for name, runtime in list(self.workload.runtimes.items()):
            labels = [name, runtime.info.node]
            used.add_metric(labels, float(runtime.pool.used))
            pool.add_metric(labels, float(runtime.pool.capacity))
            sessions.add_metric(labels, float(len(runtime.agent.sessions())))
        yield from (used, pool, sessions)
