"""``python -m bench.metrics``: sustained ingest of dcgm-exporter pages, 1,000 nodes x 8 GPUs at a 1 s interval, on
one core.

Pages are rendered beforehand by the simulated exporter's renderer (every default series, pod labels), two
variants per node so that values change between scrapes, and served over HTTP/1.1 by ``SmallHttpServer`` (what
the simulated exporters run) in a separate process, one path per node. The ingesting process, pinned to one core,
does what the metrics service does for each node's page, end to end: each second every node's scrape falls due at
its own offset (spread over the second, as independent scrapes are); it is fetched with the service's scraper
(``DcgmScrape``: a kept-alive connection per exporter, the page parsed by ``ExpositionParser`` with the node's
page plan) and fed to the aggregator; every pod and deployment aggregate is computed once per second, as the
service does. It measures CPU seconds per wall second of this process (``cpu_fraction``), GPU samples per second,
and how late the latest page was handled after it fell due (``max_lag_s``). For attribution, the same pages parsed
and aggregated without HTTP (``parse_cpu_fraction``) and prometheus-client's parser on whole pages
(``reference_parse_ms_per_page``). Last, one source scraped back to back over one kept-alive connection, the
round trip per page of a service's own ``/metrics`` (a fresh registry rendered per request, as ``HealthServer``
answers) and of a node's exporter page (``health_scrape_ms_p50`` ... ``dcgm_scrape_ms_p99``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bench.common import BenchOptions, Target, exit_code, finish, machine_info, parse_args
from services.metrics.aggregate import Aggregator
from services.metrics.samples import observation
from shared.adapters.exposition import ExpositionParser
from shared.adapters.metrics import DcgmScrape
from shared.plumbing.http import SmallHttpServer
from shared.plumbing.telemetry import Telemetry
from shared.ports.gpu import GpuUtilisation
from shared.ports.metrics import MetricsSourceError
from shared.sim.exporter import ExporterEntity, PodRef, device_values, gpu_labels, render_page

GPUS_PER_NODE = 8
MEMORY_MIB = 81559.0
DEPLOYMENTS = ("llama", "mistral", "qwen", "gemma")


def node_page(node: int, variant: int) -> str:
    entities = []
    for i in range(GPUS_PER_NODE):
        util = float((node * 7 + i * 13 + variant * 29) % 101)
        used = MEMORY_MIB * ((node + i + variant) % 10) / 10.0
        u = GpuUtilisation(
            uuid=f"GPU-{node:08x}-{i:04x}-4000-8000-{variant * 0:012x}",
            gpu_util=util,
            mem_copy_util=util / 4,
            mem_used_mib=used,
            mem_free_mib=MEMORY_MIB - used,
            power_w=70.0 + util * 6.3,
            temperature_c=35.0 + util / 2,
        )
        deployment = DEPLOYMENTS[(node + i) % len(DEPLOYMENTS)]
        pod = PodRef(f"{deployment}-7d9c8b6f5-{node:05d}"[:40] if i % 2 else f"{deployment}-{node * 8 + i}", "llm")
        labels = gpu_labels(
            index=i,
            uuid=u.uuid,
            pci_bus_id=f"00000000:{0x18 + i * 16:02X}:00.0",
            model="NVIDIA H100 80GB HBM3",
            hostname=f"node-{node:04d}",
            driver_version="550.54.15",
            pod=pod,
        )
        entities.append(ExporterEntity(labels, device_values(u, 1.0e9 + variant * 1000.0, 0)))
    return render_page(entities)


def ingest_parsed(pages: list[tuple[str, str]], seconds: float) -> dict[str, Any]:
    """Without HTTP: each node's page due once a second at its own offset; parse and aggregate each when due."""
    parser = ExpositionParser("cached")
    aggregator = Aggregator(window_s=60.0, stale_after_s=3.0)
    nodes = len(pages) // 2
    for n in range(nodes):  # the first sight of every series (validated by prometheus-client), not measured
        for r in parser.parse(pages[2 * n][1], source=f"node-{n}", read_at=0.0).readings:
            aggregator.observe(observation(r, 0.0))
    aggregator = Aggregator(window_s=60.0, stale_after_s=3.0)
    ticks = int(seconds)
    wall0 = time.monotonic()
    cpu0 = time.process_time()
    for second in range(ticks):
        for n in range(nodes):
            due = wall0 + second + n / nodes
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
            read = parser.parse(pages[2 * n + second % 2][1], source=f"node-{n}", read_at=time.time())
            for r in read.readings:
                aggregator.observe(observation(r, read.read_at))
        aggregator.aggregates(time.time())
    wall = time.monotonic() - wall0
    cpu = time.process_time() - cpu0
    return {
        "parse_cpu_fraction": round(cpu / wall, 4),
        "parse_cpu_ms_per_page": round(cpu * 1000.0 / (nodes * ticks), 4),
    }


async def ingest_http(base: str, nodes: int, seconds: float) -> dict[str, Any]:
    """The service's work for every node, end to end: scrape (kept-alive HTTP), parse, aggregate."""
    parser = ExpositionParser("cached")
    scrapers = [DcgmScrape(f"{base}/node-{n:04d}", timeout=5.0, parser=parser) for n in range(nodes)]
    aggregator = Aggregator(window_s=60.0, stale_after_s=3.0)
    for scraper in scrapers:  # connect, and the first sight of every series: not measured
        for r in (await scraper.read()).readings:
            aggregator.observe(observation(r, 0.0))
    aggregator = Aggregator(window_s=60.0, stale_after_s=3.0)
    counts = {"samples": 0, "series": 0, "problems": 0, "errors": 0}
    lags: list[float] = []
    loop = asyncio.get_running_loop()

    async def scrape(scraper: DcgmScrape, due: float) -> None:
        try:
            read = await scraper.read()
        except MetricsSourceError:
            counts["errors"] += 1
            return
        counts["series"] += read.series
        counts["problems"] += len(read.problems)
        for r in read.readings:
            counts["samples"] += aggregator.observe(observation(r, read.read_at))
        lags.append(loop.time() - due)

    ticks = int(seconds)
    tasks: set[asyncio.Task[None]] = set()
    groups = 0
    wall0 = loop.time()
    cpu0 = time.process_time()
    for second in range(ticks):
        for n, scraper in enumerate(scrapers):
            due = wall0 + second + n / nodes
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(scrape(scraper, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        groups = len(aggregator.aggregates(time.time()))
    if tasks:
        await asyncio.wait(set(tasks))
    wall = loop.time() - wall0
    cpu = time.process_time() - cpu0
    for scraper in scrapers:
        await scraper.close()
    return {
        "samples_per_s": round(counts["samples"] / wall, 1),
        "samples_ingested_fraction": round(counts["samples"] / (nodes * GPUS_PER_NODE * ticks), 6),
        "series_per_s": round(counts["series"] / wall, 1),
        "cpu_fraction": round(cpu / wall, 4),
        "max_lag_s": round(max(lags, default=0.0), 4),
        "p99_lag_s": round(sorted(lags)[int(len(lags) * 0.99)] if lags else 0.0, 4),
        "cpu_ms_per_page": round(cpu * 1000.0 / (nodes * ticks), 4),
        "aggregates_per_tick": groups,
        "problems": counts["problems"],
        "scrape_errors": counts["errors"],
        "connections": sum(s.http.connections for s in scrapers),
        "wall_s": round(wall, 2),
    }


async def keepalive_latency(base: str, requests: int) -> dict[str, Any]:
    """Milliseconds per GET of one source scraped back to back over one kept-alive connection (client and
    server), for a service's ``/metrics`` and a node's exporter page; the first GET (connecting) not counted."""
    results: dict[str, Any] = {}
    for name, path in (("health", "/metrics"), ("dcgm", "/node-0000")):
        scraper = DcgmScrape(base + path, timeout=5.0)
        await scraper.fetch()
        times: list[float] = []
        for _ in range(requests):
            start = time.perf_counter()
            await scraper.fetch()
            times.append((time.perf_counter() - start) * 1000.0)
        await scraper.close()
        times.sort()
        results[f"{name}_scrape_ms_p50"] = round(times[len(times) // 2], 4)
        results[f"{name}_scrape_ms_p99"] = round(times[int(len(times) * 0.99)], 4)
    return results


def reference_cost(pages: list[tuple[str, str]], n: int) -> float:
    """CPU ms per page of prometheus-client's parser on every line (the reference engine)."""
    parser = ExpositionParser("reference")
    cpu0 = time.process_time()
    for i in range(n):
        parser.parse(pages[i % len(pages)][1])
    return (time.process_time() - cpu0) * 1000.0 / n


def serve_pages(directory: str, port_file: str) -> None:
    """The exporters: every page under ``/<node>`` by ``SmallHttpServer`` (kept-alive HTTP/1.1), each node's two
    variants in turn. Runs in its own process until killed."""
    pages: dict[str, list[bytes]] = {}
    for path in sorted(Path(directory).iterdir()):
        pages.setdefault(path.name.rsplit("-", 1)[0], []).append(path.read_bytes())
    served = dict.fromkeys(pages, 0)
    telemetry = Telemetry("metrics")

    async def route(method: str, path: str) -> tuple[str, str, bytes]:
        if path == "/metrics":  # what a service's HealthServer answers there
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(telemetry.registry)
        name = path.lstrip("/")
        variants = pages.get(name)
        if variants is None:
            return "404 Not Found", "text/plain", b"no such node"
        served[name] += 1
        return "200 OK", "text/plain; version=0.0.4", variants[served[name] % len(variants)]

    async def run() -> None:
        server = SmallHttpServer(route, idle_s=60.0)
        port = await server.start("127.0.0.1", 0)
        Path(port_file).write_text(str(port))  # noqa: ASYNC240 - once, before serving
        await asyncio.Event().wait()

    asyncio.run(run())


@contextlib.contextmanager
def page_server(pages: list[tuple[str, str]]) -> Iterator[str]:
    """The pages served by a separate process, so this process' CPU is the scraper's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "pages")
        folder.mkdir()
        for name, text in pages:
            Path(folder, name).write_text(text)
        port_file = Path(tmp, "port")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from bench.metrics import serve_pages; serve_pages({str(folder)!r}, {str(port_file)!r})",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 20
            while not (port_file.exists() and port_file.read_text()):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the page server did not start")
                time.sleep(0.02)
            yield f"http://127.0.0.1:{port_file.read_text()}"
        finally:
            proc.terminate()
            proc.wait(5)


@contextlib.contextmanager
def one_core() -> Iterator[None]:
    """This process on one core, as the target says (the page server has the other); as it was afterwards."""
    before: set[int] | None = None
    with contextlib.suppress(AttributeError, OSError):
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, before)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args("metrics", __doc__.splitlines()[0] if __doc__ else "", argv)
    return exit_code(options, run(options))


def run(
    options: BenchOptions, nodes: int | None = None, seconds: float | None = None, reference_pages: int | None = None
) -> dict[str, Any]:
    """Measure, write the report to ``options.out`` and print it; sizes default to the quick or full run's."""
    nodes = nodes or (100 if options.quick else 1000)
    seconds = seconds or (3.0 if options.quick else 10.0)
    pages = [(f"node-{n:04d}-{v}", node_page(n, v)) for n in range(nodes) for v in (0, 1)]
    with page_server(pages) as base, one_core():  # the server started first: it runs on the other core
        results = asyncio.run(ingest_http(base, nodes, seconds))
        results.update(asyncio.run(keepalive_latency(base, 200 if options.quick else 2000)))
        results.update(ingest_parsed(pages, seconds))
        reference_ms = reference_cost(pages, reference_pages or (20 if options.quick else 100))
    results["reference_parse_ms_per_page"] = round(reference_ms, 3)
    results["reference_cpu_fraction_est"] = round(reference_ms * nodes / 1000.0, 3)
    targets = [
        Target(
            "cpu_fraction",
            "<=",
            0.5,
            f"scrape + parse + aggregate {nodes} nodes x 8 GPUs each second on under half a core",
        ),
        Target("max_lag_s", "<=", 1.0, "keeps up: no page handled more than one interval after it fell due"),
        Target("samples_ingested_fraction", ">=", 1.0, "every GPU sample of every page ingested"),
    ]
    params = {
        "nodes": nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "interval_s": 1.0,
        "seconds": seconds,
        "parser": "cached",
        "http": "HTTP/1.1 kept alive, one connection per exporter; pages served by SmallHttpServer in another process",
        "page_bytes": len(pages[0][1]),
        "series_per_page": pages[0][1].count("\n") - 2 * pages[0][1].count("# TYPE"),
    }
    return finish(options, results, targets, params, machine_info())


if __name__ == "__main__":
    raise SystemExit(main())
