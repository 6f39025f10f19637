"""Which metrics source and store the service gets: the source its settings name (dcgm-exporter, Prometheus or the
GPU port), built over the ports it is handed (``ctx.backends``)."""

from __future__ import annotations

from shared.adapters.exposition import ExpositionParser
from shared.adapters.metrics import DcgmScrape, NvmlSource, PrometheusQuery
from shared.contract.subjects import Subjects
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.ports.backends import Backends, PortUnavailable
from shared.ports.metrics import MetricsSource

from .config import MetricsSettings
from .ports import UtilisationStore
from .store import RedisUtilisationStore

DEFAULT_EXPORTER_URL = "http://127.0.0.1:9400/metrics"


class SourceUnavailable(RuntimeError):
    """No source can be built from the settings (yet): says what is missing."""


async def open_source(settings: Settings, metrics: MetricsSettings, backends: Backends) -> MetricsSource:
    parser = ExpositionParser(engine="reference" if metrics.parser == "reference" else "cached")
    if metrics.source == "prometheus":
        return PrometheusQuery(metrics.url, timeout=metrics.timeout_s, selector=metrics.selector)
    if metrics.source == "dcgm":
        url = metrics.url_for(settings.node)
        if not url:
            try:
                url = await backends.exporter_url() or ""
            except PortUnavailable as exc:
                raise SourceUnavailable(str(exc)) from None
        return DcgmScrape(url or DEFAULT_EXPORTER_URL, timeout=metrics.timeout_s, parser=parser)
    return NvmlSource(backends.gpus(), settings.node)


def open_store(settings: Settings, subjects: Subjects) -> UtilisationStore:
    return RedisUtilisationStore(redis_client(settings.redis), subjects, owns_client=True)
