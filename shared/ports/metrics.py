"""The metrics source port: where GPU utilisation comes from. One Protocol, three adapters.

- ``DcgmScrape``: GET a node's dcgm-exporter page and read the Prometheus text format.
- ``PrometheusQuery``: PromQL over Prometheus' HTTP API (prometheus-api-client), for clusters where only Prometheus
  is reachable.
- ``NvmlSource``: the GPU port (NVML, or the simulated GPUs in CI) on nodes without dcgm-exporter. NVML knows no
  pods, so its readings have none.

A reading never invents a value: a series that is absent, NaN or infinite is simply not in ``values`` (and named in
``invalid`` when it was there but unusable), so nothing downstream can mistake a gap for a zero. A source that
cannot be read raises ``MetricsSourceError`` saying why.

Exposition text is validated by prometheus-client's parser. A node's page repeats the same few label sets in every
scrape, so ``ExpositionParser`` hands each line whose label set (and metric name) it has not seen yet to that
parser, and afterwards only parses the value of a known shape; and a page laid out exactly as its source's last
clean page (same lines, same label sets, only the numbers differ) is read by that page's plan in one pass. The
reference parser costs about 8 ms per 8-GPU page (8 CPU seconds per second at 1,000 nodes, against a budget of
half a core), this well under 0.1 ms. A property test holds the fast paths to prometheus-client's own reading of
every page (tests/test_http_client.py). ``engine="reference"`` runs the whole page through prometheus-client
instead. Either way, a malformed line is reported and skipped; the rest is used.
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from shared.ports.gpu import GpuError, GpuPort

# dcgm-exporter series -> reading field. Counters arrive from prometheus-client's parser with ``_total`` added.
FIELD_OF: dict[str, str] = {
    "DCGM_FI_DEV_GPU_UTIL": "gpu_util",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "mem_copy_util",
    "DCGM_FI_DEV_FB_USED": "mem_used_mib",
    "DCGM_FI_DEV_FB_FREE": "mem_free_mib",
    "DCGM_FI_DEV_FB_RESERVED": "mem_reserved_mib",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "gr_engine_active",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "energy_mj",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total": "energy_mj",
}
SERIES_NAMES: tuple[str, ...] = tuple(n for n in FIELD_OF if not n.endswith("_total"))

# label -> position in ``Identity``; old and new spellings of the same label share a position.
_LABEL_SLOT: dict[str, int] = {
    "UUID": 0,
    "gpu": 1,
    "Hostname": 2,
    "hostname": 2,
    "modelName": 3,
    "GPU_I_PROFILE": 4,
    "GPU_I_ID": 5,
    "pod": 6,
    "pod_name": 6,
    "namespace": 7,
    "pod_namespace": 7,
    "container": 8,
    "container_name": 8,
}
Identity = tuple[str, str, str, str, str, str, str, str, str]
"""(uuid, gpu index, node, model, MIG profile, GPU instance id, pod, namespace, container)."""


class MetricsSourceError(RuntimeError):
    """A source could not be read (refused, timed out, HTTP or PromQL error). Says which source and why."""


def identity(labels: Mapping[str, str]) -> Identity:
    """Who a series is about, accepting both ``Hostname``/``hostname`` and the old ``pod_name``/``pod_namespace``/
    ``container_name`` spellings (the new one wins when both are present)."""
    slots = ["", "", "", "", "", "", "", "", ""]
    for name, value in labels.items():
        slot = _LABEL_SLOT.get(name)
        if slot is not None and value and (not slots[slot] or name in ("Hostname", "pod", "namespace", "container")):
            slots[slot] = value
    return tuple(slots)  # type: ignore[return-value]


@dataclass(slots=True)
class GpuReading:
    """One GPU, or one MIG GPU instance, as a source saw it at one time. ``values`` holds only finite numbers."""

    uuid: str
    gpu: str = ""
    node: str = ""
    model: str = ""
    mig_profile: str = ""
    gpu_instance_id: str = ""
    pod: str = ""
    namespace: str = ""
    container: str = ""
    values: dict[str, float] = field(default_factory=dict)
    invalid: list[str] = field(default_factory=list)
    timestamp: float | None = None  # seconds since the epoch, when the source said when it sampled

    @property
    def key(self) -> str:
        """Unique per GPU or GPU instance: the UUID, with ``/gi<N>`` for a MIG instance."""
        return f"{self.uuid}/gi{self.gpu_instance_id}" if self.gpu_instance_id else self.uuid

    @property
    def util(self) -> float | None:
        """GPU utilisation in percent: ``DCGM_FI_DEV_GPU_UTIL``, or for MIG slices (which lack it) the graphics
        engine activity ratio times 100. None when neither is usable."""
        value = self.values.get("gpu_util")
        if value is None and (ratio := self.values.get("gr_engine_active")) is not None:
            value = ratio * 100.0
        return value

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(slots=True)
class SourceRead:
    """What one read of a source returned: readings, the problems met (malformed lines, NaN series, series
    without a UUID) and how many samples were seen."""

    source: str
    readings: list[GpuReading]
    problems: list[str] = field(default_factory=list)
    series: int = 0
    read_at: float = 0.0  # wall clock, seconds since the epoch


@runtime_checkable
class MetricsSource(Protocol):
    name: str
    simulated: bool

    async def read(self) -> SourceRead:
        """One reading of every GPU the source covers; raises ``MetricsSourceError`` when it cannot."""
        ...

    async def close(self) -> None: ...


# -- the exposition format -------------------------------------------------------------------------------------
class _Builder:
    """Collects samples into readings keyed by (uuid, GPU instance)."""

    __slots__ = ("by_key", "problems", "series")

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], GpuReading] = {}
        self.problems: list[str] = []
        self.series = 0

    def add(self, name: str, ident: Identity, value: float, timestamp: float | None) -> None:
        self.series += 1
        slot = FIELD_OF.get(name)
        if slot is None:
            return
        if not ident[0]:
            self.problems.append(f"{name}: a series without a UUID label (skipped)")
            return
        key = (ident[0], ident[5])
        reading = self.by_key.get(key)
        if reading is None:
            reading = self.by_key[key] = GpuReading(*ident)
        if value != value or value in (math.inf, -math.inf):
            reading.invalid.append(slot)
            self.problems.append(f"{name}{{UUID={ident[0]!r}}}: {value} (not used)")
            return
        reading.values[slot] = float(value)
        if timestamp is not None and (reading.timestamp is None or timestamp > reading.timestamp):
            reading.timestamp = timestamp

    def readings(self) -> list[GpuReading]:
        return list(self.by_key.values())


def _reference_samples(text: str) -> Iterator[tuple[str, dict[str, str], float, float | None]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value, None if s.timestamp is None else float(s.timestamp)


def _lines_with_types(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, line, the ``# TYPE`` line of its family or "") for every sample line."""
    type_line: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                type_line[parts[2]] = line
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(None, 1)[0]
        yield number, line, type_line.get(name, "")


def _bad_line(number: int, line: str, exc: Exception) -> str:
    shown = line if len(line) <= 160 else line[:157] + "..."
    reason = str(exc) or type(exc).__name__
    return f"line {number}: malformed, skipped: {shown!r} ({reason[:120]})"


# The number after a labelled sample's closing brace, to the end of the line: no '}', '_', space (a timestamp) or
# newline in it. A line whose tail has any of those does not match and so stays in the skeleton.
_VALUE_RE = re.compile(r"\} ([^\n}_ ]*)$", re.MULTILINE)


@dataclass(slots=True)
class _PagePlan:
    """One source's page layout: the page's text between the samples' numbers (``skeleton``), and for each number in
    order whether it is used (``used``: its position among the ``count`` numbers) and where it goes (``targets``:
    the reading's index and field)."""

    skeleton: str
    count: int
    used: list[int]
    targets: list[tuple[int, str]]
    identities: list[Identity]
    series: int

    def read(self, text: str) -> list[GpuReading] | None:
        """The page's readings, or None when it is not laid out as planned or a number is not a finite float."""
        parts = _VALUE_RE.split(text)  # text, number, text, number, ..., text: one pass over the page
        numbers = parts[1::2]
        if len(numbers) != self.count or "".join(parts[0::2]) != self.skeleton:
            return None
        try:
            values = [float(numbers[i]) for i in self.used]
        except ValueError:
            return None
        if not all(map(math.isfinite, values)):
            return None
        readings = [GpuReading(*identity) for identity in self.identities]
        for (reading, slot), value in zip(self.targets, values, strict=True):
            readings[reading].values[slot] = value
        return readings


class ExpositionParser:
    """Turns exporter pages into readings. Keep one per source: it remembers each series (name and label set)
    it has validated, at most ``max_shapes`` of them (about 200 per 8-GPU node; the memory is dropped when
    full)."""

    def __init__(
        self, engine: Literal["cached", "reference"] = "cached", max_shapes: int = 1_000_000, max_pages: int = 16_384
    ) -> None:
        self.engine = engine
        self.max_shapes = max_shapes
        self.max_pages = max_pages
        self._shapes: dict[str, tuple[str | None, str, Identity, tuple[str, str]]] = {}
        self._pages: dict[str, _PagePlan] = {}

    def parse(self, text: str, source: str = "", read_at: float | None = None) -> SourceRead:
        """With a ``source`` named, a page laid out exactly as that source's last clean page (same lines, same
        label sets, only the numbers differ: the usual case for an exporter) is read by its plan, without
        looking at a line; anything else is parsed line by line, and a clean page becomes the new plan."""
        read_at = time.time() if read_at is None else read_at
        if self.engine == "cached" and source:
            plan = self._pages.get(source)
            if plan is not None:
                readings = plan.read(text)
                if readings is not None:
                    return SourceRead(source=source, readings=readings, series=plan.series, read_at=read_at)
        builder = _Builder()
        if self.engine == "reference":
            self._parse_reference(text, builder)
        else:
            self._parse_cached(text, builder)
            if source:
                self._plan(source, text, builder)
        return SourceRead(
            source=source,
            readings=builder.readings(),
            problems=builder.problems,
            series=builder.series,
            read_at=read_at,
        )

    def _plan(self, source: str, text: str, builder: _Builder) -> None:
        """Remember where each number of this page goes, if the page was clean (no problem, no timestamp)."""
        self._pages.pop(source, None)
        if builder.problems or any(r.timestamp is not None for r in builder.by_key.values()):
            return
        index = {key: i for i, key in enumerate(builder.by_key)}
        targets: list[tuple[int, str] | None] = []
        for match in _VALUE_RE.finditer(text):
            head = text[text.rfind("\n", 0, match.start()) + 1 : match.start()]
            if head.startswith("#"):
                targets.append(None)
                continue
            shape = self._shapes.get(head)
            if shape is None:
                return
            slot, _, _, key = shape
            targets.append(None if slot is None else (index[key], slot))
        if len(self._pages) >= self.max_pages:
            self._pages.clear()
        self._pages[source] = _PagePlan(
            skeleton="".join(_VALUE_RE.split(text)[0::2]),
            count=len(targets),
            used=[i for i, t in enumerate(targets) if t is not None],
            targets=[t for t in targets if t is not None],
            identities=[
                (r.uuid, r.gpu, r.node, r.model, r.mig_profile, r.gpu_instance_id, r.pod, r.namespace, r.container)
                for r in builder.by_key.values()
            ],
            series=builder.series,
        )

    @staticmethod
    def _parse_reference(text: str, builder: _Builder) -> None:
        try:
            samples = list(_reference_samples(text))
        except ValueError:
            samples = []
            for number, line, type_line in _lines_with_types(text):
                try:
                    samples.extend(_reference_samples(f"{type_line}\n{line}\n" if type_line else line + "\n"))
                except ValueError as exc:
                    builder.problems.append(_bad_line(number, line, exc))
        for name, labels, value, timestamp in samples:
            builder.add(name, identity(labels), value, timestamp)

    def _learn(self, line: str) -> tuple[str, dict[str, str], float, float | None]:
        """Validate one sample line with prometheus-client's parser and remember its name and label set."""
        found = list(_reference_samples(line + "\n"))
        if len(found) != 1:
            raise ValueError("not one sample")
        name, labels, value, timestamp = found[0]
        return name, labels, value, timestamp

    def _parse_cached(self, text: str, builder: _Builder) -> None:
        shapes = self._shapes
        if len(shapes) > self.max_shapes:
            shapes.clear()
        by_key = builder.by_key
        problems = builder.problems
        series = 0
        for number, line in enumerate(text.split("\n"), start=1):
            if not line or line[0] == "#":
                continue
            head, sep, rest = line.rpartition("} ")
            shape = shapes.get(head) if sep else None
            if shape is None:
                if line.isspace():
                    continue
                try:
                    name, labels, value, timestamp = self._learn(line)
                except ValueError as exc:
                    problems.append(_bad_line(number, line, exc))
                    continue
                ident = identity(labels)
                if sep:
                    shapes[head] = (FIELD_OF.get(name), name, ident, (ident[0], ident[5]))
                builder.add(name, ident, float(value), timestamp)
                continue
            slot, name, ident, key = shape
            try:
                if "_" in rest:
                    raise ValueError("'_' in a value")
                if " " in rest.strip():
                    value_text, _, stamp_text = rest.strip().partition(" ")
                    value, timestamp = float(value_text), float(stamp_text) / 1000.0
                else:
                    value, timestamp = float(rest), None
            except ValueError as exc:
                problems.append(_bad_line(number, line, exc))
                continue
            series += 1
            if slot is None:
                continue
            if not key[0] or value != value or value in (math.inf, -math.inf):
                series -= 1
                builder.add(name, ident, value, timestamp)
                continue
            reading = by_key.get(key)
            if reading is None:
                reading = by_key[key] = GpuReading(*ident)
            reading.values[slot] = value
            if timestamp is not None and (reading.timestamp is None or timestamp > reading.timestamp):
                reading.timestamp = timestamp
        builder.series += series


# -- HTTP -------------------------------------------------------------------------------------------------------
async def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """One HTTP/1.1 GET on a connection of its own, closed after (``HttpClient`` for a source read again and
    again). Raises ``MetricsSourceError``."""
    client = HttpClient(url, timeout)
    try:
        return await client.get()
    finally:
        client.close()


class _Response(asyncio.Protocol):
    """Bytes of one connection as they come; ``wait`` until there are more or the peer closed."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.closed = False
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        if self.closed:
            raise asyncio.IncompleteReadError(bytes(self.buffer), None)
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


class HttpClient:
    """HTTP/1.1 GETs to one origin over one kept-alive connection, as Prometheus scrapes: a scrape every second
    costs no TCP handshake and no teardown. The connection is opened on first use and again after the server
    closed it; a request on a reused connection that the server had already closed is sent once more on a new
    one (GET is idempotent). Not for concurrent use: one request at a time."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MetricsSourceError(f"{url}: expected an http:// or https:// URL")
        self.url = url
        self.timeout = timeout
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: text/plain\r\nAccept-Encoding: identity\r\n\r\n"
        ).encode("latin-1")
        self._conn: _Response | None = None
        self.connections = 0  # opened so far

    async def get(self) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.timeout):  # no task of its own, unlike wait_for
                return await self._get()
        except TimeoutError:
            self.close()
            raise MetricsSourceError(f"{self.url}: no complete answer within {self.timeout:g}s") from None
        except asyncio.IncompleteReadError:
            self.close()
            raise MetricsSourceError(f"{self.url}: the connection closed mid-answer") from None
        except (OSError, ValueError) as exc:
            self.close()
            raise MetricsSourceError(f"{self.url}: {type(exc).__name__}: {exc}") from None

    async def _get(self) -> tuple[int, bytes]:
        conn = self._conn
        if conn is not None and not conn.closed:
            try:
                return await self._exchange(conn)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:  # the server closed in the middle of an answer: no retry
                    raise
                self.close()  # closed while idle, before answering: ask again on a new connection
        return await self._exchange(await self._connect())

    async def _connect(self) -> _Response:
        _, conn = await asyncio.get_running_loop().create_connection(_Response, self.host, self.port, ssl=self.tls)
        self._conn = conn
        self.connections += 1
        return conn

    async def _exchange(self, conn: _Response) -> tuple[int, bytes]:
        assert conn.transport is not None
        conn.buffer.clear()
        conn.transport.write(self._request)
        buffer = conn.buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            await conn.wait()
        head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        del buffer[: end + 4]
        fields = head[0].split(None, 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/"):
            raise ValueError(f"not an HTTP response: {head[0][:80]!r}")
        status = int(fields[1])
        headers: dict[str, str] = {}
        for line in head[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        keep = fields[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._chunked(conn)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            while len(buffer) < length:
                await conn.wait()
            body = bytes(buffer[:length])
            del buffer[:length]
        else:  # the body ends with the connection
            while not conn.closed:
                await conn.wait()
            body, keep = bytes(buffer), False
        if not keep:
            self.close()
        return status, body

    @staticmethod
    async def _chunked(conn: _Response) -> bytes:
        buffer = conn.buffer
        chunks: list[bytes] = []
        while True:
            while (end := buffer.find(b"\r\n")) < 0:
                await conn.wait()
            size = int(bytes(buffer[:end]).split(b";")[0].strip() or b"0", 16)
            del buffer[: end + 2]
            if size == 0:
                while (end := buffer.find(b"\r\n")) != 0:  # trailers, then the blank line
                    if end > 0:
                        del buffer[: end + 2]
                    else:
                        await conn.wait()
                del buffer[:2]
                return b"".join(chunks)
            while len(buffer) < size + 2:
                await conn.wait()
            chunks.append(bytes(buffer[:size]))
            del buffer[: size + 2]

    def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None


# -- adapters ---------------------------------------------------------------------------------------------------
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


def readings_from_vectors(values: Iterable[Mapping[str, Any]], timestamps: Iterable[Mapping[str, Any]]) -> _Builder:
    """Readings from the ``result`` of an instant vector query for the series and of ``timestamp(...)`` of
    ``DCGM_FI_DEV_GPU_UTIL`` (when each GPU's newest sample was scraped, so stale data shows as old)."""
    builder = _Builder()
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
