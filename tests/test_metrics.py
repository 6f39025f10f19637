"""The metrics service: exporter pages and Prometheus answers over real HTTP, NVML through simulated GPUs, the pure
aggregation core with time passed in, and the service end to end on real NATS and Redis."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, unquote_plus, urlsplit

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from services.metrics import config as metrics_config
from services.metrics.aggregate import Aggregator, CounterWatch, Observation, deployment_from_pod_name
from services.metrics.samples import gpu_sample
from services.metrics.scrape_cli import derive
from services.metrics.scrape_cli import main as scrape_main
from services.metrics.service import MetricsService
from services.metrics.store import RedisUtilisationStore
from shared.adapters.exposition import ExpositionParser
from shared.adapters.metrics import DcgmScrape, NvmlSource, PrometheusQuery
from shared.contract.metrics import DeploymentUtilisation, GpuSample
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.bus import Bus
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Settings
from shared.ports.metrics import MetricsSourceError, SourceRead
from shared.sim.exporter import PodRef, SimExporter, find_exporter
from shared.sim.gpus import SimGpus
from shared.sim.spec import GpuSpec, NodeSpec, SimSpec
from shared.wiring import Wiring
from tests.helpers import eventually

# -- a realistic dcgm-exporter page ------------------------------------------------------------------------------
H100 = "NVIDIA H100 80GB HBM3"
U0, U1, U2, U3 = (f"GPU-{n}1c2d3e4-5f60-7182-93a4-b5c6d7e8f90{n}" for n in range(4))


def _labels(gpu: int, uuid: str, host_label: str, extra: str = "", mig: str = "") -> str:
    return (
        f'gpu="{gpu}",UUID="{uuid}",pci_bus_id="00000000:{0x18 + 16 * gpu:02X}:00.0",device="nvidia{gpu}",'
        f'modelName="{H100}",{mig}{host_label}="node-a",DCGM_FI_DRIVER_VERSION="550.54.15"{extra}'
    )


# Four GPUs: two used by llama pods (new label spellings, Hostname), GPU 2 in MIG mode with two instances used by
# a mistral pod (old pod_name/pod_namespace spellings, lowercase hostname, as older/newer exporters mix them),
# and GPU 3 used by nobody.
L0 = _labels(0, U0, "Hostname", ',pod="llama-7d9c8b6f5-x2x4q",namespace="llm",container="vllm"')
L1 = _labels(1, U1, "Hostname", ',pod="llama-7d9c8b6f5-k8p2m",namespace="llm",container="vllm"')
L2 = _labels(2, U2, "hostname")
L2A = _labels(
    2, U2, "hostname", ',pod_name="mistral-0",pod_namespace="chat",container_name="tgi"', 'GPU_I_PROFILE="3g.40gb",'
)
L2A = L2A.replace('GPU_I_PROFILE="3g.40gb",', 'GPU_I_PROFILE="3g.40gb",GPU_I_ID="1",')
L2B = _labels(
    2, U2, "hostname", ',pod_name="mistral-0",pod_namespace="chat",container_name="tgi"', 'GPU_I_PROFILE="1g.10gb",'
)
L2B = L2B.replace('GPU_I_PROFILE="1g.10gb",', 'GPU_I_PROFILE="1g.10gb",GPU_I_ID="2",')
L3 = _labels(3, U3, "Hostname")
WHOLE = (L0, L1, L3)


def page(util: tuple[float, float, float] = (80, 40, 0), energy: float = 1.0e9, nan_util_gpu1: bool = False) -> str:
    lines: list[str] = []

    def family(name: str, kind: str, rows: list[tuple[str, Any]]) -> None:
        lines.append(f"# HELP {name} {name} (help)")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value}" for labels, value in rows)

    family("DCGM_FI_DEV_SM_CLOCK", "gauge", [(x, 1980) for x in (L0, L1, L2, L3)])
    family("DCGM_FI_DEV_MEM_CLOCK", "gauge", [(x, 2619) for x in (L0, L1, L2, L3)])
    family("DCGM_FI_DEV_MEMORY_TEMP", "gauge", [(x, 40) for x in (L0, L1, L2, L3)])
    family("DCGM_FI_DEV_GPU_TEMP", "gauge", [(L0, 71), (L1, 55), (L2, 50), (L3, 33)])
    family("DCGM_FI_DEV_POWER_USAGE", "gauge", [(L0, 612.5), (L1, 350.25), (L2, 210.0), (L3, 71.0)])
    family("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", [(x, int(energy)) for x in (L0, L1, L2, L3)])
    family("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", [(x, 0) for x in (L0, L1, L2, L3)])
    u1: Any = "NaN" if nan_util_gpu1 else util[1]
    family("DCGM_FI_DEV_GPU_UTIL", "gauge", [(L0, util[0]), (L1, u1), (L3, util[2])])
    family("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", [(L0, 20), (L1, 10), (L3, 0)])
    family("DCGM_FI_DEV_ENC_UTIL", "gauge", [(x, 0) for x in WHOLE])
    family("DCGM_FI_DEV_DEC_UTIL", "gauge", [(x, 0) for x in WHOLE])
    family(
        "DCGM_FI_DEV_XID_ERRORS",
        "gauge",
        [(f'{L0},err_code="0",err_msg="No Error"', 0), (f'{L1},err_code="79",err_msg="GPU has fallen off"', 79)]
        + [(f'{x},err_code="0",err_msg="No Error"', 0) for x in (L2, L3)],
    )
    family("DCGM_FI_DEV_FB_FREE", "gauge", [(L0, 20000), (L1, 60000), (L2A, 30000), (L2B, 8000), (L3, 81000)])
    family("DCGM_FI_DEV_FB_USED", "gauge", [(L0, 60000), (L1, 20000), (L2A, 10960), (L2B, 2240), (L3, 0)])
    family("DCGM_FI_DEV_FB_RESERVED", "gauge", [(L0, 0), (L1, 0), (L2A, 0), (L2B, 0), (L3, 559)])
    family("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", [(L0, 0.8), (L1, 0.4), (L2A, 0.5), (L2B, 0.9), (L3, 0)])
    family("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", [(x, 0.1) for x in (L0, L1, L2A, L2B, L3)])
    family("DCGM_FI_PROF_DRAM_ACTIVE", "gauge", [(x, 0.2) for x in (L0, L1, L2A, L2B, L3)])
    family("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", [(x, 1000000) for x in (L0, L1, L2A, L2B, L3)])
    family("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", [(x, 2000000) for x in (L0, L1, L2A, L2B, L3)])
    return "\n".join(lines) + "\n"


# -- a small HTTP server whose answers a test controls -----------------------------------------------------------
@dataclass
class PageServer:
    """Serves ``body`` (a str, or a function of the request's path and query) with ``status``; ``hang`` accepts
    and never answers (a stuck exporter)."""

    body: str | Callable[[str, dict[str, list[str]]], str] = ""
    status: int = 200
    content_type: str = "text/plain; version=0.0.4"
    hang: bool = False
    chunked: bool = False
    requests: list[str] = field(default_factory=list)
    server: asyncio.Server | None = None
    port: int = 0
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, port: int = 0) -> PageServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self._released.set()
        if self.server:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = (await reader.readline()).decode()
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            self.requests.append(request)
            if self.hang:
                await self._released.wait()
                return
            target = urlsplit(request.split()[1])
            body = self.body(target.path, parse_qs(target.query)) if callable(self.body) else self.body
            data = body.encode()
            head = f"HTTP/1.1 {self.status} X\r\nContent-Type: {self.content_type}\r\nConnection: close\r\n"
            if self.chunked:
                half = len(data) // 2
                chunks = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (data[:half], data[half:]) if c)
                writer.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n")
            else:
                writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def served() -> AsyncIterator[PageServer]:
    server = await PageServer(body=page()).start()
    yield server
    await server.stop()


def by_key(read: SourceRead) -> dict[str, Any]:
    return {r.key: r for r in read.readings}


# -- the exporter page ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["cached", "reference"])
@pytest.mark.parametrize("chunked", [False, True])
async def test_a_realistic_exporter_page_over_http_gives_every_gpu_and_mig_instance(
    served: PageServer, engine: Any, chunked: bool
) -> None:
    served.chunked = chunked
    read = await DcgmScrape(f"{served.url}/metrics", timeout=5, parser=ExpositionParser(engine)).read()
    assert read.problems == []
    assert read.series == 4 * 7 + 3 * 4 + 4 + 5 * 8  # every sample of the page
    gpus = by_key(read)
    assert set(gpus) == {U0, U1, U3, U2, f"{U2}/gi1", f"{U2}/gi2"}
    g0 = gpus[U0]
    assert (g0.node, g0.gpu, g0.model, g0.pod, g0.namespace, g0.container) == (
        "node-a",
        "0",
        H100,
        "llama-7d9c8b6f5-x2x4q",
        "llm",
        "vllm",
    )
    assert g0.util == 80 and g0.values["mem_used_mib"] == 60000 and g0.values["mem_free_mib"] == 20000
    assert g0.values["power_w"] == 612.5 and g0.values["temperature_c"] == 71 and g0.values["xid"] == 0
    assert g0.values["mem_copy_util"] == 20 and g0.values["energy_mj"] == 1.0e9
    assert gpus[U1].values["xid"] == 79
    mig = gpus[f"{U2}/gi1"]  # old label spellings and lowercase hostname are read the same
    assert (mig.node, mig.pod, mig.namespace, mig.container) == ("node-a", "mistral-0", "chat", "tgi")
    assert (mig.mig_profile, mig.gpu_instance_id) == ("3g.40gb", "1")
    assert mig.util == 50.0  # no DCGM_FI_DEV_GPU_UTIL for a MIG slice: the engine activity ratio
    assert gpus[U2].util is None and gpus[U2].values["power_w"] == 210.0  # the parent: device-wide series only
    assert gpus[U3].pod == "" and gpus[U3].util == 0


async def test_both_parsers_agree_on_every_page_the_tests_use() -> None:
    for text in (page(), page(nan_util_gpu1=True), page() + "garbage{ line\n" + "DCGM_FI_DEV_GPU_UTIL{UUID=1} 5\n"):
        cached, reference = ExpositionParser("cached").parse(text, read_at=1.0), ExpositionParser().parse(text)
        assert {k: (r.values, r.invalid) for k, r in by_key(cached).items()} == {
            k: (r.values, r.invalid) for k, r in by_key(reference).items()
        }
        assert len(cached.problems) == len(reference.problems)


async def test_every_aggregate_of_the_page() -> None:
    read = ExpositionParser().parse(page(), read_at=1000.0)
    aggregator = Aggregator(window_s=60, stale_after_s=15)
    for r in read.readings:
        from services.metrics.samples import observation

        aggregator.observe(observation(r, read.read_at))
    figures = {(a.scope, a.namespace, a.name): a for a in aggregator.aggregates(now=1001.0)}
    assert set(figures) == {
        ("pod", "llm", "llama-7d9c8b6f5-x2x4q"),
        ("pod", "llm", "llama-7d9c8b6f5-k8p2m"),
        ("pod", "chat", "mistral-0"),
        ("deployment", "llm", "llama"),
        ("deployment", "chat", "mistral"),
    }  # GPU 3 has no pod, the MIG parent has no pod: in no group
    pod = figures[("pod", "llm", "llama-7d9c8b6f5-x2x4q")]
    assert (pod.mean_util, pod.max_util, pod.gpus, pod.samples) == (80.0, 80.0, 1, 1)
    assert pod.mem_pressure == pytest.approx(60000 / 80000)
    llama = figures[("deployment", "llm", "llama")]
    assert (llama.mean_util, llama.max_util, llama.gpus, llama.pods, llama.samples) == (60.0, 80.0, 2, 2, 2)
    assert llama.mem_pressure == pytest.approx(0.75) and llama.sampled_at == 1000.0 and not llama.stale
    mistral = figures[("deployment", "chat", "mistral")]
    assert (mistral.mean_util, mistral.max_util, mistral.gpus, mistral.pods) == (70.0, 90.0, 2, 1)
    assert mistral.mem_pressure == pytest.approx(10960 / 40960)  # the fuller of its two slices


async def test_nan_and_missing_series_are_unknown_never_zero() -> None:
    read = ExpositionParser("cached").parse(page(nan_util_gpu1=True), read_at=1000.0)
    g1 = by_key(read)[U1]
    assert "gpu_util" not in g1.values and g1.invalid == ["gpu_util"]
    assert g1.util == 40.0  # falls back to the engine activity ratio, a real measurement
    assert any("NaN" in p or "nan" in p for p in read.problems)
    bare = ExpositionParser().parse(f"DCGM_FI_DEV_GPU_UTIL{{{L0}}} NaN\nDCGM_FI_DEV_FB_USED{{{L0}}} 5\n", read_at=5)
    only = by_key(bare)[U0]
    assert only.util is None and gpu_sample(only, "node-a", 5.0) is None  # nothing to publish but a guess
    agg = Aggregator(window_s=60, stale_after_s=15)
    from services.metrics.samples import observation

    agg.observe(observation(only, 5.0))
    (pod, _deployment) = agg.aggregates(now=6.0)
    assert pod.mean_util is None and pod.max_util is None and pod.samples == 0 and pod.stale
    assert pod.mem_pressure is None  # FB_FREE absent: no pressure rather than a guess
    partial = gpu_sample(by_key(read)[U0], "node-a", 5.0)
    assert partial is not None and partial.missing == []


class GpuSampleBefore(msgspec.Struct, frozen=True, kw_only=True, tag="metrics.gpu.sample", tag_field="kind"):
    """``GpuSample`` as a reader from before values could be null decodes it: 0.0 defaults, ``missing`` beside."""

    node: str
    gpu_uuid: str
    gpu_util: float
    mem_copy_util: float = 0.0
    mem_used_mib: float = 0.0
    mem_free_mib: float = 0.0
    power_w: float = 0.0
    temperature_c: float = 0.0
    xid: int = 0
    missing: list[str] = []


def test_a_value_the_source_lacks_is_null_in_samples_and_deployment_figures_never_zero() -> None:
    bare = ExpositionParser().parse(
        f"DCGM_FI_DEV_GPU_UTIL{{{L0}}} 55\nDCGM_FI_DEV_POWER_USAGE{{{L0}}} NaN\nDCGM_FI_DEV_FB_USED{{{L0}}} 7\n",
        read_at=5,
    )
    sample = gpu_sample(by_key(bare)[U0], "node-a", 5.0)
    assert sample is not None and sample.gpu_util == 55.0 and sample.mem_used_mib == 7.0
    assert (sample.power_w, sample.temperature_c, sample.mem_free_mib, sample.mem_copy_util, sample.xid) == (
        None,
        None,
        None,
        None,
        None,
    )
    wire = msgspec.json.encode(sample)
    fields = msgspec.json.decode(wire)
    assert not {"power_w", "temperature_c", "mem_free_mib", "mem_copy_util", "xid"} & set(fields)  # none made up
    again = msgspec.json.decode(wire, type=GpuSample)
    assert again.power_w is None and again.mem_free_mib is None and again.mem_used_mib == 7.0
    older = msgspec.json.decode(wire, type=GpuSampleBefore)  # a reader from before: 0.0, with the flag beside it
    assert older.power_w == 0.0 and {"power_w", "temperature_c", "mem_free_mib"} <= set(older.missing)

    from services.metrics.samples import deployment_event, observation, observation_of_sample, record

    agg = Aggregator(window_s=60, stale_after_s=15)
    agg.observe(observation_of_sample(again))  # FB_FREE absent: no memory pressure can be said
    deployment = next(a for a in agg.aggregates(now=6.0) if a.scope == "deployment")
    event = deployment_event(deployment)
    assert event is not None and event.mean_util == 55.0 and event.mem_pressure is None
    assert "mem_pressure" not in msgspec.json.decode(msgspec.json.encode(event))
    assert msgspec.json.decode(msgspec.json.encode(event), type=DeploymentUtilisation).mem_pressure is None
    assert record(deployment, 6.0).mem_pressure is None
    agg.observe(observation(by_key(page_read())[U0], 7.0))  # a page with both: a pressure, measured
    assert deployment_event(next(a for a in agg.aggregates(now=8.0) if a.scope == "deployment")).mem_pressure == (
        pytest.approx(0.75)
    )


def page_read() -> SourceRead:
    return ExpositionParser("cached").parse(page(), read_at=1000.0)


def test_staleness_follows_time_and_old_points_are_refused() -> None:
    agg = Aggregator(window_s=30, stale_after_s=10)
    obs = Observation(key="g", t=100.0, util=50.0, mem_used_mib=1, mem_free_mib=3, pod="p-0", namespace="ns")
    assert agg.observe(obs)
    assert not agg.observe(obs)  # the same sample again (Prometheus repeating a scrape): nothing added
    assert agg.observe(replace(obs, t=105.0, util=70.0))
    fresh = {a.scope: a for a in agg.aggregates(now=106.0)}
    assert fresh["deployment"].mean_util == 60.0 and not fresh["deployment"].stale and fresh["deployment"].name == "p"
    late = {a.scope: a for a in agg.aggregates(now=120.0)}
    assert late["deployment"].stale and late["deployment"].stale_gpus == 1
    assert late["deployment"].mean_util == 60.0 and late["deployment"].sampled_at == 105.0  # last known, flagged
    assert agg.aggregates(now=140.0) == []  # nothing left in the window
    assert agg.gpus == {}


def test_counter_resets_and_pod_owner_names() -> None:
    watch = CounterWatch()
    assert [watch.update("g", v) for v in (10.0, 20.0, 5.0, 6.0)] == ["first", "ok", "reset", "ok"]
    assert watch.resets == 1
    assert deployment_from_pod_name("llama-7d9c8b6f5-x2x4q") == "llama"
    assert deployment_from_pod_name("mistral-0") == "mistral"
    assert deployment_from_pod_name("standalone") is None


@pytest.mark.parametrize("engine", ["cached", "reference"])
def test_malformed_lines_are_reported_and_skipped_the_rest_is_used(engine: Any) -> None:
    text = page().replace(
        f"DCGM_FI_DEV_GPU_UTIL{{{L1}}} 40\n",
        f"DCGM_FI_DEV_GPU_UTIL{{{L1}}} 40\n"
        'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-x" 7\n'  # unclosed labels
        'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-y"} forty\n'  # not a number
        'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-z"} 1_0\n'  # underscores are not allowed
        "9bad_name 1\n",
    )
    read = ExpositionParser(engine).parse(text)
    assert len(read.problems) == 4 and all("malformed, skipped" in p for p in read.problems)
    assert {r.uuid for r in read.readings} == {U0, U1, U2, U3}
    assert by_key(read)[U1].util == 40 and by_key(read)[U0].util == 80


async def test_exporter_restart_timeout_and_errors_raise_clearly(served: PageServer) -> None:
    url = f"{served.url}/metrics"
    served.hang = True
    with pytest.raises(MetricsSourceError, match=r"no complete answer within 0\.2s"):
        await DcgmScrape(url, timeout=0.2).read()
    served.hang = False
    served.status, served.body = 503, "exporter starting"
    with pytest.raises(MetricsSourceError, match="HTTP 503: exporter starting"):
        await DcgmScrape(url, timeout=2).read()
    port = served.port
    await served.stop()
    with pytest.raises(MetricsSourceError, match=r"ConnectionRefusedError|Connect"):
        await DcgmScrape(url, timeout=2).read()
    restarted = await PageServer(body=page(energy=5.0)).start(port)  # back on the same port, counters reset
    try:
        read = await DcgmScrape(url, timeout=2).read()
        assert by_key(read)[U0].values["energy_mj"] == 5.0
    finally:
        await restarted.stop()


# -- Prometheus ---------------------------------------------------------------------------------------------------
def prometheus_answers(text: str, at: float) -> Callable[[str, dict[str, list[str]]], str]:
    """``/api/v1/query`` as Prometheus answers it: the series of ``text`` as an instant vector, or for
    ``timestamp(...)`` the sample times (the metric name dropped, as PromQL functions do)."""
    read = ExpositionParser().parse(text)
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def answer(path: str, query: dict[str, list[str]]) -> str:
        assert path == "/api/v1/query", path
        promql = query["query"][0]
        result = []
        for s in samples:
            name = s.name.removesuffix("_total") if s.name.endswith("CONSUMPTION_total") else s.name
            if promql.startswith("timestamp("):
                if name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"):
                    result.append({"metric": dict(s.labels), "value": [at + 0.5, str(at)]})
            elif name in promql:
                value = "NaN" if math.isnan(s.value) else str(s.value)
                metric: dict[str, str] = {"__name__": name, **s.labels}
                result.append({"metric": metric, "value": [at + 0.5, value]})
        assert read.readings
        return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})

    return answer


async def test_prometheus_source_reads_the_same_series_through_prometheus_api_client() -> None:
    server = await PageServer(body=prometheus_answers(page(), at=1234.0), content_type="application/json").start()
    source = PrometheusQuery(server.url, timeout=2, selector='Hostname=~".+"')
    try:
        read = await source.read()
        gpus = by_key(read)
        assert gpus[U0].util == 80 and gpus[U0].values["mem_used_mib"] == 60000 and gpus[U0].timestamp == 1234.0
        assert gpus[f"{U2}/gi2"].pod == "mistral-0" and gpus[f"{U2}/gi2"].util == 90.0
        assert 'Hostname=~".+"' in unquote_plus(server.requests[0])
        # Prometheus answering errors, as it does: a JSON error body with 422 or 503
        server.status = 422
        server.body = json.dumps({"status": "error", "errorType": "execution", "error": "query timed out"})
        with pytest.raises(MetricsSourceError, match=r"Prometheus refused .*422.*query timed out"):
            await source.read()
        server.status, server.body = 503, "Service Unavailable"
        with pytest.raises(MetricsSourceError, match="503"):
            await source.read()
    finally:
        await source.close()
        await server.stop()


# -- NVML and the simulated exporter -----------------------------------------------------------------------------
SPEC = SimSpec(
    nodes=[
        NodeSpec(
            name="node-1",
            gpus=[GpuSpec(count=2), GpuSpec(count=1, mig_profiles=["1g.10gb", "3g.40gb"], nvlink=False)],
        )
    ]
)


async def test_nvml_source_follows_the_simulated_gpus(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    gpus = SimGpus(redis_client, subjects, SPEC, "node-1")
    devices = await gpus.devices()
    await gpus.set_load(devices[0].uuid, 75.0, 1000.0, 10.0)
    read = await NvmlSource(gpus, "node-1").read()
    first = by_key(read)[devices[0].uuid]
    assert first.util == 75.0 and first.values["mem_used_mib"] == 1000.0 and first.node == "node-1"
    assert first.values["mem_free_mib"] == devices[0].memory_total_mib - 1000.0 and first.pod == ""
    assert by_key(read)[devices[1].uuid].util == 0.0  # idle is a measured 0, not a missing value
    assert first.gpu == "0" and first.model == devices[0].model


async def test_the_simulated_exporter_serves_what_the_scrape_reads_back(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    gpus = SimGpus(redis_client, subjects, SPEC, "node-1")
    devices = await gpus.devices()
    await gpus.set_load(devices[0].uuid, 64.0, 2048.0, 16.0)
    await gpus.set_mig_mode(devices[2].uuid, True)
    await gpus.create_mig_instance(devices[2].uuid, "3g.40gb")
    exporter = SimExporter(gpus, pods=lambda: {devices[0].uuid: PodRef("llama-0", "llm")})
    await exporter.start()
    try:
        assert await find_exporter(redis_client, subjects, "node-1") == exporter.url
        read = await DcgmScrape(exporter.url, timeout=2, parser=ExpositionParser("reference")).read()
        assert read.problems == []
        got = by_key(read)
        g0 = got[devices[0].uuid]
        assert (g0.util, g0.values["mem_used_mib"], g0.pod, g0.namespace, g0.node) == (
            64.0,
            2048.0,
            "llama-0",
            "llm",
            "node-1",
        )
        assert g0.values["mem_free_mib"] + g0.values["mem_used_mib"] + g0.values["mem_reserved_mib"] == pytest.approx(
            devices[0].memory_total_mib
        )
        mig = got[f"{devices[2].uuid}/gi1"]
        assert mig.mig_profile == "3g.40gb" and mig.util == 0.0
        assert got[devices[2].uuid].util is None  # the MIG parent: device-wide series only
        text = await DcgmScrape(exporter.url, timeout=2).fetch()
        assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter" in text and 'Hostname="node-1"' in text
    finally:
        await exporter.stop()


# -- the CLI ------------------------------------------------------------------------------------------------------
async def test_scrape_cli_prints_per_gpu_and_per_pod_json(
    served: PageServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await asyncio.to_thread(scrape_main, [f"{served.url}/metrics", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    g0 = out["gpus"][U0]
    assert (g0["gpu_util"], g0["mem_used_mib"], g0["mem_free_mib"], g0["pod"], g0["namespace"]) == (
        80.0,
        60000.0,
        20000.0,
        "llama-7d9c8b6f5-x2x4q",
        "llm",
    )
    assert out["gpus"][U3]["pod"] is None and out["gpus"][U2]["gpu_util"] is None
    assert (
        out["pods"]["chat/mistral-0"]["max_util"] == 90.0 and out["pods"]["chat/mistral-0"]["deployment"] == "mistral"
    )
    assert await asyncio.to_thread(scrape_main, [f"{served.url}/metrics"]) == 0
    assert "llm/llama-7d9c8b6f5-x2x4q" in capsys.readouterr().out
    await served.stop()
    assert await asyncio.to_thread(scrape_main, [f"{served.url}/metrics", "--timeout", "1"]) == 1
    assert "gpuwarden metrics scrape:" in capsys.readouterr().err
    assert scrape_main(["ftp://x"]) == 2
    assert derive(ExpositionParser().parse(""))["gpus"] == {}


async def test_scrape_cli_json_says_null_for_a_nan_or_absent_value(capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        f"DCGM_FI_DEV_GPU_UTIL{{{L0}}} 12\nDCGM_FI_DEV_POWER_USAGE{{{L0}}} NaN\nDCGM_FI_DEV_GPU_TEMP{{{L0}}} +Inf\n"
        f"DCGM_FI_DEV_FB_USED{{{L0}}} 100\nDCGM_FI_DEV_GPU_UTIL{{{L1}}} NaN\n"
    )
    server = PageServer(body=text)
    await server.start()
    try:
        assert await asyncio.to_thread(scrape_main, [f"{server.url}/metrics", "--json"]) == 0
    finally:
        await server.stop()
    raw = capsys.readouterr().out
    out = json.loads(raw, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))  # strict JSON
    g0, g1 = out["gpus"][U0], out["gpus"][U1]
    assert g0["gpu_util"] == 12.0 and g0["mem_used_mib"] == 100.0
    assert g0["power_w"] is None and g0["temperature_c"] is None and g0["mem_free_mib"] is None
    assert g0["invalid"] == ["power_w", "temperature_c"]
    assert g1["gpu_util"] is None and g1["invalid"] == ["gpu_util"]
    pod = out["pods"]["llm/llama-7d9c8b6f5-x2x4q"]
    assert pod["mean_util"] == 12.0 and pod["mem_pressure"] is None  # no FB_FREE: no pressure, not 0
    assert out["pods"]["llm/llama-7d9c8b6f5-k8p2m"]["mean_util"] is None


# -- configuration --------------------------------------------------------------------------------------------------
def test_configuration_errors_name_the_variable() -> None:
    assert metrics_config.load({}).source == "nvml"
    ok = metrics_config.load(
        {"GPUWARDEN_METRICS_SOURCE": "dcgm", "GPUWARDEN_METRICS_URL": "http://{node}:9400/metrics"}
    )
    assert ok.url_for("n1") == "http://n1:9400/metrics" and ok.stale_after_s == 15.0
    bad = [
        ({"GPUWARDEN_METRICS_SOURCE": "snmp"}, "GPUWARDEN_METRICS_SOURCE='snmp': expected one of nvml, dcgm"),
        ({"GPUWARDEN_METRICS_SOURCE": "prometheus"}, "needs GPUWARDEN_METRICS_URL"),
        ({"GPUWARDEN_METRICS_URL": "localhost:9400"}, "expected an http"),
        ({"GPUWARDEN_METRICS_INTERVAL_S": "soon"}, "GPUWARDEN_METRICS_INTERVAL_S='soon': expected a number"),
        ({"GPUWARDEN_METRICS_INTERVAL_S": "10", "GPUWARDEN_METRICS_WINDOW_S": "5"}, "shorter than"),
        ({"GPUWARDEN_METRICS_AGGREGATE": "all"}, "GPUWARDEN_METRICS_AGGREGATE='all'"),
    ]
    for env, message in bad:
        with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
            metrics_config.load(env)


# -- the service, end to end --------------------------------------------------------------------------------------
async def test_service_publishes_samples_and_deployment_utilisation_and_keeps_them_in_redis(
    settings: Settings, bus: Bus, subjects: Subjects, redis_client: aioredis.Redis, served: PageServer
) -> None:
    samples: list[GpuSample] = []
    deployments: list[DeploymentUtilisation] = []

    async def on_sample(e: GpuSample) -> None:
        samples.append(e)

    async def on_dep(e: DeploymentUtilisation) -> None:
        deployments.append(e)

    await bus.subscribe(subjects.pattern("metrics.gpu.sample", node="node-a"), on_sample, accepts=(GpuSample,))
    await bus.subscribe(subjects.pattern("metrics.deployment.utilisation"), on_dep, accepts=(DeploymentUtilisation,))
    metrics_settings = metrics_config.load(
        {
            "GPUWARDEN_METRICS_SOURCE": "dcgm",
            "GPUWARDEN_METRICS_URL": f"{served.url}/metrics",
            "GPUWARDEN_METRICS_INTERVAL_S": "0.05",
            "GPUWARDEN_METRICS_WINDOW_S": "5",
            "GPUWARDEN_METRICS_STALE_S": "0.3",
        }
    )
    service = MetricsService(metrics_settings)
    running = await start_service(service, settings, Wiring)
    store = RedisUtilisationStore(redis_client, subjects)
    try:
        await eventually(lambda: {e.gpu_uuid for e in samples} >= {U0, U1, U3, U2})
        mig = next(e for e in samples if e.gpu_instance_id == "2")
        assert (mig.mig_profile, mig.gpu_util, mig.pod, mig.namespace) == ("1g.10gb", 90.0, "mistral-0", "chat")
        assert "mem_copy_util" in mig.missing and mig.mem_copy_util is None  # no copy utilisation for a MIG slice
        g0 = next(e for e in samples if e.gpu_uuid == U0)
        assert (g0.node, g0.gpu_util, g0.mem_used_mib, g0.power_w, g0.xid) == ("node-a", 80.0, 60000.0, 612.5, 0)
        llama = await eventually(lambda: next((e for e in deployments if e.deployment == "llama"), None))
        assert (llama.namespace, llama.mean_util, llama.max_util, llama.gpus, llama.pods) == ("llm", 60.0, 80.0, 2, 2)
        assert llama.mem_pressure == pytest.approx(0.75) and not llama.stale
        kept = await store.get("deployment", "llm", "llama")
        assert kept is not None and kept.mean_util == 60.0 and not kept.stale and kept.sampled_at is not None
        pod = await store.get("pod", "chat", "mistral-0")
        assert pod is not None and pod.max_util == 90.0 and pod.gpus == 2

        # The exporter stops answering: reads fail visibly, the aggregates go stale, nothing is made up.
        served.status, served.body = 500, "boom"
        await eventually(lambda: service.last_error.startswith(served.url))

        async def stale() -> bool:
            record = await store.get("deployment", "llm", "llama")
            return record is not None and record.stale

        await eventually(stale)
        status, text = await _get(running.http_port, "/metrics")
        assert status == 200
        assert 'gpuwarden_metrics_read_errors_total{source="dcgm:' in text
        assert "gpuwarden_metrics_staleness_seconds" in text and "gpuwarden_metrics_series" in text
        health = json.loads((await _get(running.http_port, "/healthz"))[1])
        assert health["metrics"]["last_error"].endswith("HTTP 500: boom")
    finally:
        await running.stop(grace=1)


async def test_service_on_simulated_gpus_publishes_nvml_samples(
    settings: Settings, bus: Bus, subjects: Subjects
) -> None:
    got: list[GpuSample] = []

    async def on_sample(e: GpuSample) -> None:
        got.append(e)

    await bus.subscribe(subjects.pattern("metrics.gpu.sample", node="node-1"), on_sample, accepts=(GpuSample,))
    service = MetricsService(metrics_config.load({"GPUWARDEN_METRICS_INTERVAL_S": "0.05"}))
    running = await start_service(service, settings, Wiring)
    try:
        await eventually(lambda: len({e.gpu_uuid for e in got}) >= 2)
        assert all(e.node == "node-1" and e.gpu_util == 0.0 and e.missing == [] for e in got)
    finally:
        await running.stop(grace=1)


async def _get(port: int, path: str) -> tuple[int, str]:
    from shared.adapters.httpclient import http_get

    status, body = await http_get(f"http://127.0.0.1:{port}{path}", 5)
    return status, body.decode()


def test_records_decode_as_the_contract_says() -> None:
    from shared.contract.metrics import UtilisationRecord

    raw = msgspec.json.encode(UtilisationRecord(namespace="n", name="d", scope="deployment", window_s=60))
    assert json.loads(raw)["mean_util"] is None and json.loads(raw)["stale"] is True


@given(
    st.lists(
        st.tuples(
            st.floats(0.1, 5.0),
            st.one_of(st.none(), st.floats(0, 100)),
            st.one_of(st.none(), st.floats(0, 80000)),
            st.sampled_from(["a", "b", "c"]),
        ),
        max_size=60,
    )
)
@hypothesis_settings(max_examples=100, deadline=None)
def test_rolling_figures_equal_a_recount_of_the_window(
    steps: list[tuple[float, float | None, float | None, str]],
) -> None:
    window, stale = 10.0, 3.0
    agg = Aggregator(window_s=window, stale_after_s=stale, owner=lambda ns, pod: "dep")
    seen: list[tuple[float, str, float | None, float | None]] = []
    t = 0.0
    for dt, util, used, gpu in steps:
        t += dt
        agg.observe(
            Observation(key=gpu, t=t, util=util, mem_used_mib=used, mem_free_mib=1000.0, pod=gpu, namespace="n")
        )
        seen.append((t, gpu, util, None if used is None else used / (used + 1000.0)))
        now = t + 0.05  # the clock never goes back: steps are at least 0.1 apart
        inside = [s for s in seen if s[0] >= now - window]
        utils = [s[2] for s in inside if s[2] is not None]
        pressures = [s[3] for s in inside if s[3] is not None]
        deployment = [a for a in agg.aggregates(now) if a.scope == "deployment"]
        if not inside:
            assert deployment == []
            continue
        (d,) = deployment
        assert d.samples == len(utils) and d.gpus == len({s[1] for s in inside})
        assert d.max_util == (max(utils) if utils else None)
        assert d.mem_pressure == (max(pressures) if pressures else None)
        assert (d.mean_util is None) == (not utils)
        if utils:
            assert d.mean_util == pytest.approx(sum(utils) / len(utils), abs=1e-6)
        assert d.sampled_at == max(s[0] for s in inside)
        assert d.stale == (now - d.sampled_at > stale or not utils)
