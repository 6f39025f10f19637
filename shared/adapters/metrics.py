"""The three adapters of the metrics source port (``shared.ports.metrics``).

- ``DcgmScrape``: GET a node's dcgm-exporter page and read the Prometheus text format (``exposition``).
- ``PrometheusQuery``: PromQL over Prometheus' HTTP API (prometheus-api-client), for clusters where only Prometheus
  is reachable.
- ``NvmlSource``: the GPU port (NVML, or the simulated GPUs in CI) on nodes without dcgm-exporter. NVML knows no
  pods, so its readings have none.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from shared.adapters.exposition import SERIES_NAMES, ExpositionParser, ReadingsBuilder, identity
from shared.adapters.httpclient import HttpClient
from shared.ports.gpu import GpuError, GpuPort
from shared.ports.metrics import GpuReading, MetricsSourceError, SourceRead


class DcgmScrape:
    """A node's dcgm-exporter page over HTTP."""

    simulated = False

    def __init__(self, url: str, timeout: float = 5.0, parser: ExpositionParser | None = None) -> None:
        self.url = url
        self.name = f"dcgm:{url}"
        self.timeout = timeout
        self.parser = parser or ExpositionParser()
        self.http = HttpClient(url, timeout)

    async def fetch(self) -> str:
        status, body = await self.http.get()
        if status != 200:
            raise MetricsSourceError(f"{self.url}: HTTP {status}: {body[:200].decode('utf-8', 'replace').strip()}")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MetricsSourceError(f"{self.url}: the page is not UTF-8 ({exc.reason})") from None

    async def read(self) -> SourceRead:
        text = await self.fetch()
        return self.parser.parse(text, source=self.url)

    async def close(self) -> None:
        self.http.close()


PROMQL_SERIES = "{__name__=~" + '"' + "|".join(SERIES_NAMES) + '"' + "}"


def _prom_value(raw: Any) -> float:
    """Prometheus answers ``[timestamp, "value"]``; the value may be "NaN" or "+Inf"."""
    return float(raw[1])


def readings_from_vectors(
    values: Iterable[Mapping[str, Any]], timestamps: Iterable[Mapping[str, Any]]
) -> ReadingsBuilder:
    """Readings from the ``result`` of an instant vector query for the series and of ``timestamp(...)`` of
    ``DCGM_FI_DEV_GPU_UTIL`` (when each GPU's newest sample was scraped, so stale data shows as old)."""
    builder = ReadingsBuilder()
    sampled: dict[tuple[str, str], float] = {}
    for item in timestamps:
        ident = identity(item.get("metric", {}))
        try:
            sampled[(ident[0], ident[5])] = _prom_value(item["value"])
        except (KeyError, TypeError, ValueError, IndexError):
            continue
    for item in values:
        metric = dict(item.get("metric", {}))
        name = metric.pop("__name__", "")
        try:
            value = _prom_value(item["value"])
        except (KeyError, TypeError, ValueError, IndexError):
            builder.problems.append(f"{name}: an answer without a usable value: {item!r:.160}")
            continue
        ident = identity(metric)
        builder.add(name, ident, value, sampled.get((ident[0], ident[5])))
    return builder


class PrometheusQuery:
    """The same series through Prometheus' HTTP API (``/api/v1/query``) with prometheus-api-client. ``selector``
    narrows the series (PromQL label matchers such as ``Hostname="node-1"``)."""

    simulated = False

    def __init__(self, url: str, timeout: float = 5.0, selector: str = "") -> None:
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = url.rstrip("/")
        self.name = f"prometheus:{self.url}"
        self.timeout = timeout
        self.selector = selector
        # One retry of a refused connection; no retry (with its seconds of backoff) on an HTTP error answer.
        retry = Retry(total=1, backoff_factor=0.0, status_forcelist=[], raise_on_status=False)
        self.client = PrometheusConnect(url=self.url, disable_ssl=False, retry=retry, timeout=timeout)

    def queries(self) -> tuple[str, str]:
        names = "|".join(SERIES_NAMES)
        extra = f",{self.selector}" if self.selector else ""
        narrow = f"{{{self.selector}}}" if self.selector else ""
        return (
            f'{{__name__=~"{names}"{extra}}}',
            f"timestamp(DCGM_FI_DEV_GPU_UTIL{narrow} or DCGM_FI_PROF_GR_ENGINE_ACTIVE{narrow})",
        )

    def _query(self, promql: str) -> list[dict[str, Any]]:
        from prometheus_api_client import PrometheusApiClientException
        from requests import RequestException

        try:
            result = self.client.custom_query(promql)
        except PrometheusApiClientException as exc:
            raise MetricsSourceError(f"{self.url}: Prometheus refused {promql!r}: {str(exc)[:300]}") from None
        except (RequestException, ValueError, KeyError, TypeError) as exc:
            raise MetricsSourceError(f"{self.url}: {type(exc).__name__}: {str(exc)[:300]}") from None
        if not isinstance(result, list):
            raise MetricsSourceError(f"{self.url}: expected a vector answer, got {type(result).__name__}")
        return result

    async def read(self) -> SourceRead:
        series_query, timestamp_query = self.queries()
        values = await asyncio.to_thread(self._query, series_query)
        stamps = await asyncio.to_thread(self._query, timestamp_query)
        builder = readings_from_vectors(values, stamps)
        return SourceRead(self.url, builder.readings(), builder.problems, builder.series, time.time())

    async def close(self) -> None:
        self.client._session.close()


class NvmlSource:
    """The node's GPUs through the GPU port (NVML, or simulated GPUs). NVML knows no pods."""

    def __init__(self, gpus: GpuPort, node: str) -> None:
        self.gpus = gpus
        self.node = node
        self.name = f"nvml:{node}"
        self.simulated = bool(getattr(gpus, "simulated", False))

    async def read(self) -> SourceRead:
        try:
            devices = {d.uuid: d for d in await self.gpus.devices()}
            samples = await self.gpus.utilisation()
        except GpuError as exc:
            raise MetricsSourceError(f"{self.name}: {exc}") from None
        now = time.time()
        readings = []
        for u in samples:
            device = devices.get(u.uuid)
            values = {
                "gpu_util": u.gpu_util,
                "mem_copy_util": u.mem_copy_util,
                "mem_used_mib": u.mem_used_mib,
                "mem_free_mib": u.mem_free_mib,
                "power_w": u.power_w,
                "temperature_c": u.temperature_c,
            }
            finite = {k: float(v) for k, v in values.items() if math.isfinite(v)}
            readings.append(
                GpuReading(
                    uuid=u.uuid,
                    gpu=str(device.index) if device else "",
                    node=self.node,
                    model=device.model if device else "",
                    values=finite,
                    invalid=[k for k in values if k not in finite],
                    timestamp=now,
                )
            )
        return SourceRead(self.name, readings, series=len(readings) * 6, read_at=now)

    async def close(self) -> None:
        await self.gpus.close()
