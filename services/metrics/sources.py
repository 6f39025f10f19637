"""Which metrics source, store and pod directory the service gets, from its settings."""

from __future__ import annotations

from shared.contract.subjects import Subjects
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.ports.metrics import DcgmScrape, ExpositionParser, MetricsSource, NvmlSource, PrometheusQuery
from shared.ports.select import gpu_port
from shared.sim.exporter import find_exporter

from .config import MetricsSettings
from .ports import PodOwners, UtilisationStore
from .store import RedisUtilisationStore, SimPodOwners

DEFAULT_EXPORTER_URL = "http://127.0.0.1:9400/metrics"


class SourceUnavailable(RuntimeError):
    """No source can be built from the settings (yet): says what is missing."""


async def open_source(settings: Settings, metrics: MetricsSettings, subjects: Subjects) -> MetricsSource:
    parser = ExpositionParser(engine="reference" if metrics.parser == "reference" else "cached")
    if metrics.source == "prometheus":
        return PrometheusQuery(metrics.url, timeout=metrics.timeout_s, selector=metrics.selector)
    if metrics.source == "dcgm":
        url = metrics.url_for(settings.node)
        if not url and settings.simulated:
            client = redis_client(settings.redis)
            try:
                url = await find_exporter(client, subjects, settings.node) or ""
            finally:
                await client.aclose()
            if not url:
                raise SourceUnavailable(
                    f"no SIMULATED dcgm-exporter is announced for node {settings.node} yet (start the simulation, "
                    "or set GPUWARDEN_METRICS_URL)"
                )
        return DcgmScrape(url or DEFAULT_EXPORTER_URL, timeout=metrics.timeout_s, parser=parser)
    return NvmlSource(gpu_port(settings, subjects), settings.node)


def open_store(settings: Settings, subjects: Subjects) -> UtilisationStore:
    return RedisUtilisationStore(redis_client(settings.redis), subjects, owns_client=True)


def open_owners(settings: Settings, subjects: Subjects) -> PodOwners | None:
    """The cluster's pod owners where they can be read (the simulated cluster); None: owners come from pod names."""
    if not settings.simulated:
        return None
    return SimPodOwners(redis_client(settings.redis), subjects)
