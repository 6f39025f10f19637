"""What the metrics service decides: which readings become GPU samples, and the rolling aggregates per pod and per
deployment that the scaler reads (Redis, and ``metrics.deployment.utilisation`` events).

Every interval it reads its source once. A read that fails (exporter down or restarting, a timeout, Prometheus
answering an error) is counted, logged once per change of error, and adds nothing: the groups it fed go stale by
themselves. Readings without a usable utilisation are not published as samples; missing fields of published
samples are named in ``missing``. The whole cycle is idempotent: a repeated read of the same sample is rejected by
the aggregator (points must be newer), and records are overwritten by key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from shared.contract.base import is_token
from shared.contract.device import DeviceInventory
from shared.contract.metrics import GpuSample, UtilisationRecord
from shared.host.runner import ServiceContext
from shared.plumbing.consumer import node_consumer
from shared.ports.metrics import MetricsSource, MetricsSourceError, SourceRead

from .aggregate import Aggregator, CounterWatch, deployment_from_pod_name
from .config import MetricsSettings, load
from .ports import PodOwners, UtilisationStore
from .samples import deployment_event, gpu_sample, observation, observation_of_sample, record

log = logging.getLogger(__name__)


class MetricsTelemetry:
    """The service's own Prometheus metrics."""

    def __init__(self, registry: Any) -> None:
        self.scrape_seconds = Histogram(
            "gpuwarden_metrics_read_seconds",
            "Time one read of the metrics source took (fetch and parse)",
            ["source"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.errors = Counter(
            "gpuwarden_metrics_read_errors_total", "Reads of the source that failed", ["source"], registry=registry
        )
        self.malformed = Counter(
            "gpuwarden_metrics_problems_total",
            "Malformed lines, NaN values and unusable series met in reads (skipped)",
            ["source"],
            registry=registry,
        )
        self.series = Gauge(
            "gpuwarden_metrics_series", "Samples seen in the last successful read", ["source"], registry=registry
        )
        self.gpus = Gauge("gpuwarden_metrics_gpus", "GPUs (or MIG instances) in the window", registry=registry)
        self.stale_gpus = Gauge(
            "gpuwarden_metrics_stale_gpus", "GPUs whose newest sample is older than the limit", registry=registry
        )
        self.staleness = Gauge(
            "gpuwarden_metrics_staleness_seconds",
            "Age of the newest successful read of the source",
            ["source"],
            registry=registry,
        )
        self.stale_groups = Gauge(
            "gpuwarden_metrics_stale_aggregates", "Pods and deployments whose figures are stale", registry=registry
        )
        self.counter_resets = Counter(
            "gpuwarden_metrics_counter_resets_total",
            "Counters that went backwards (an exporter restarted)",
            ["source"],
            registry=registry,
        )


class MetricsService:
    name = "metrics"
    config_names: tuple[str, ...] = ()

    def __init__(
        self,
        settings: MetricsSettings | None = None,
        *,
        source: MetricsSource | None = None,
        store: UtilisationStore | None = None,
        owners: PodOwners | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or load()
        self.source = source
        self.store = store
        self.pod_owners = owners
        self.clock = clock
        self.gpus: dict[str, list[str]] = {}
        self.inventory_at: dict[str, float] = {}  # node -> when its device service published the list kept
        self.aggregator = Aggregator(self.settings.window_s, self.settings.stale_after_s, self._owner)
        self.counters = CounterWatch()
        self.owners: Mapping[tuple[str, str], str] = {}
        self.known: dict[tuple[str, str, str], UtilisationRecord] = {}
        self.last_error = ""
        self.last_read_at: float | None = None
        self.reads = 0
        self.telemetry: MetricsTelemetry | None = None
        self.ctx: ServiceContext | None = None

    def _owner(self, namespace: str, pod: str) -> str | None:
        return self.owners.get((namespace, pod)) or deployment_from_pod_name(pod)

    async def start(self, ctx: ServiceContext) -> None:
        from .sources import open_store

        self.ctx = ctx
        self.telemetry = MetricsTelemetry(ctx.telemetry.registry)
        s = ctx.subjects
        await ctx.consume(
            node_consumer(s, "metrics", "inventory", ctx.node, ("device.inventory",), (DeviceInventory,)),
            self.on_inventory,
        )
        if self.settings.aggregate != "off":
            self.store = self.store or open_store(ctx.settings, ctx.subjects)
            self.pod_owners = self.pod_owners or ctx.backends.pod_owners()
        for port in (self.source, self.store, self.pod_owners):
            if port is not None:
                ctx.on_stop(port.close)
        if self.settings.aggregate == "bus":
            await ctx.bus.subscribe(s.pattern("metrics.gpu.sample"), self.on_sample, accepts=(GpuSample,))
        ctx.status["gpus"] = self.gpus
        ctx.status["metrics"] = self.status
        ctx.spawn(self.loop, "metrics-read")

    def status(self) -> dict[str, Any]:
        return {
            "source": self.source.name if self.source else self.settings.source,
            "reads": self.reads,
            "last_error": self.last_error or None,
            "last_read_at": self.last_read_at,
            "gpus_in_window": len(self.aggregator.gpus),
        }

    async def on_inventory(self, event: DeviceInventory) -> None:
        """Idempotent: replaces the node's GPU list with the one in the event, unless the node's device service
        published the list kept later (one heard again, late or replayed, changes nothing). Both come from that
        node's own clock."""
        published = event.occurred_at.timestamp()
        if published <= self.inventory_at.get(event.node, float("-inf")):
            return
        self.inventory_at[event.node] = published
        self.gpus[event.node] = [g.uuid for g in event.gpus]

    async def on_sample(self, event: GpuSample) -> None:
        """Idempotent: a sample not newer than the GPU's last point is ignored."""
        self.aggregator.observe(observation_of_sample(event))

    async def loop(self) -> None:
        from .sources import SourceUnavailable, open_source

        """Runs for the service's lifetime; a source it opens stays open (for the loop's next run too) until the
        service stops."""
        assert self.ctx is not None
        while True:
            started = time.monotonic()
            if self.source is None:
                try:
                    self.source = await open_source(self.ctx.settings, self.settings, self.ctx.backends)
                except SourceUnavailable as exc:
                    self._failed(str(exc))
                else:
                    self.ctx.on_stop(self.source.close)
            if self.source is not None:
                await self.tick(self.clock())
            await asyncio.sleep(max(self.settings.interval_s - (time.monotonic() - started), 0.0))

    def _failed(self, error: str) -> None:
        if error != self.last_error:
            log.warning("metrics source unreadable; its GPUs go stale", extra={"error": error})
        self.last_error = error

    async def tick(self, now: float) -> None:
        """One read, its samples published, the aggregates written. Never raises for a bad read."""
        assert self.ctx is not None and self.source is not None and self.telemetry is not None
        t = self.telemetry
        name = self.source.name
        started = time.perf_counter()
        read: SourceRead | None = None
        try:
            read = await self.source.read()
        except MetricsSourceError as exc:
            t.errors.labels(name).inc()
            self._failed(str(exc))
        t.scrape_seconds.labels(name).observe(time.perf_counter() - started)
        if read is not None:
            if self.last_error:
                log.info("metrics source readable again", extra={"source": name})
            self.last_error = ""
            self.reads += 1
            self.last_read_at = read.read_at
            await self._use(read)
        if self.last_read_at is not None:
            t.staleness.labels(name).set(max(now - self.last_read_at, 0.0))
        if self.settings.aggregate != "off":
            await self._aggregate(now)

    async def _use(self, read: SourceRead) -> None:
        assert self.ctx is not None and self.telemetry is not None and self.source is not None
        t = self.telemetry
        name = self.source.name
        t.series.labels(name).set(read.series)
        if read.problems:
            t.malformed.labels(name).inc(len(read.problems))
            log.warning(
                "metrics source: problems skipped",
                extra={"source": name, "count": len(read.problems), "first": read.problems[:3]},
            )
        for reading in read.readings:
            energy = reading.get("energy_mj")
            if energy is not None and self.counters.update(reading.key, energy) == "reset":
                t.counter_resets.labels(name).inc()
                log.info("counter reset: the exporter restarted", extra={"source": name, "gpu": reading.key})
            node = reading.node or self.ctx.node
            if not is_token(node):
                node = self.ctx.node
            sample = gpu_sample(reading, node, read.read_at)
            if sample is not None:
                with contextlib.suppress(Exception):
                    await self.ctx.publish(sample)
            if self.settings.aggregate == "local":
                self.aggregator.observe(observation(reading, read.read_at))

    async def _aggregate(self, now: float) -> None:
        assert self.ctx is not None and self.telemetry is not None
        if self.pod_owners is not None:
            with contextlib.suppress(Exception):
                self.owners = await self.pod_owners.owners()
        aggregates = self.aggregator.aggregates(now)
        records = [record(a, now) for a in aggregates]
        current = {(r.scope, r.namespace, r.name) for r in records}
        for key, last in list(self.known.items()):
            if key not in current:  # nothing left in the window: say so once, keeping when it was last seen
                records.append(
                    UtilisationRecord(
                        namespace=last.namespace,
                        name=last.name,
                        scope=last.scope,
                        window_s=last.window_s,
                        sampled_at=last.sampled_at,
                        written_at=now,
                        stale=True,
                    )
                )
                del self.known[key]
        for r in records:
            if (r.scope, r.namespace, r.name) in current:
                self.known[(r.scope, r.namespace, r.name)] = r
        self.telemetry.gpus.set(len(self.aggregator.gpus))
        self.telemetry.stale_gpus.set(len(self.aggregator.stale_gpus(now)))
        self.telemetry.stale_groups.set(sum(1 for r in records if r.stale))
        if self.store is not None:
            try:
                await self.store.put(records, ttl_s=max(10 * self.settings.window_s, 300.0))
            except Exception as exc:
                log.warning("aggregates not written to Redis; next interval retries", extra={"error": str(exc)})
        for a in aggregates:
            if a.scope == "deployment" and (event := deployment_event(a)) is not None:
                with contextlib.suppress(Exception):
                    await self.ctx.publish(event)
