"""``python -m bench.metrics``: sustained ingest of dcgm-exporter pages, 1,000 nodes x 8 GPUs at a 1 s interval, on
one core.

Pages are rendered beforehand by the simulated exporter's renderer (every default series, pod labels), two
variants per node so that values change between scrapes. Each second every node's page falls due at its own offset
(spread over the second, as independent scrapes are); the ingest loop parses it (``ExpositionParser``, the service's
parser) and feeds the aggregator, and computes every pod and deployment aggregate once per second, as the service
does. It measures CPU seconds per wall second of this process (``cpu_fraction``), GPU samples per second, and how
late the latest page was handled (``max_lag_s``). HTTP is measured separately on a subset: pages served by a
separate ``python -m http.server`` process and fetched with the service's HTTP client, client CPU per page.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import Target, exit_code, finish, machine_info, parse_args
from services.metrics.aggregate import Aggregator
from services.metrics.handlers import observation
from shared.ports.gpu import GpuUtilisation
from shared.ports.metrics import ExpositionParser, http_get
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


def ingest(pages: list[tuple[str, str]], seconds: float) -> dict[str, Any]:
    """Each node's page due once a second at its own offset; parse and aggregate each when due."""
    parser = ExpositionParser("cached")
    aggregator = Aggregator(window_s=60.0, stale_after_s=3.0)
    nodes = len(pages) // 2
    for n in range(nodes):  # the first sight of every series (validated by prometheus-client), not measured
        for r in parser.parse(pages[2 * n][1], read_at=0.0).readings:
            aggregator.observe(observation(r, 0.0))
    aggregator = Aggregator(window_s=60.0, stale_after_s=3.0)
    samples = series = problems = groups = 0
    max_lag = 0.0
    ticks = int(seconds)
    wall0 = time.monotonic()
    cpu0 = time.process_time()
    for second in range(ticks):
        for n in range(nodes):
            due = wall0 + second + n / nodes
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
                now = time.monotonic()
            max_lag = max(max_lag, now - due)
            read = parser.parse(pages[2 * n + second % 2][1], read_at=time.time())
            series += read.series
            problems += len(read.problems)
            for r in read.readings:
                samples += aggregator.observe(observation(r, read.read_at))
        groups = len(aggregator.aggregates(time.time()))
    wall = time.monotonic() - wall0
    cpu = time.process_time() - cpu0
    return {
        "samples_per_s": round(samples / wall, 1),
        "samples_ingested_fraction": round(samples / (nodes * GPUS_PER_NODE * ticks), 6),
        "series_per_s": round(series / wall, 1),
        "cpu_fraction": round(cpu / wall, 4),
        "max_lag_s": round(max_lag, 4),
        "cpu_ms_per_page": round(cpu * 1000.0 / (nodes * ticks), 4),
        "aggregates_per_tick": groups,
        "problems": problems,
        "wall_s": round(wall, 2),
    }


def reference_cost(pages: list[tuple[str, str]], n: int) -> float:
    """CPU ms per page of prometheus-client's parser on every line (the reference engine)."""
    parser = ExpositionParser("reference")
    cpu0 = time.process_time()
    for i in range(n):
        parser.parse(pages[i % len(pages)][1])
    return (time.process_time() - cpu0) * 1000.0 / n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def http_server(pages: list[tuple[str, str]]) -> Iterator[str]:
    """The pages as files served by a separate process, so this process' CPU is the client's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in pages:
            Path(tmp, name).write_text(text)
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", tmp],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("python -m http.server did not start")
                time.sleep(0.02)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(5)


def http_cost(pages: list[tuple[str, str]], rounds: int) -> dict[str, float]:
    async def fetch_all(base: str) -> tuple[float, float, int]:
        names = [name for name, _ in pages]
        await http_get(f"{base}/{names[0]}", 5)
        wall0, cpu0 = time.monotonic(), time.process_time()
        for _ in range(rounds):
            for name in names:
                status, body = await http_get(f"{base}/{name}", 5)
                assert status == 200 and body
        return time.monotonic() - wall0, time.process_time() - cpu0, rounds * len(names)

    with http_server(pages) as base:
        wall, cpu, n = asyncio.run(fetch_all(base))
    return {"http_fetch_ms_per_page": round(wall * 1000.0 / n, 3), "http_cpu_ms_per_page": round(cpu * 1000.0 / n, 3)}


def main() -> int:
    options = parse_args("metrics", __doc__.splitlines()[0] if __doc__ else "")
    nodes = 100 if options.quick else 1000
    seconds = 2.0 if options.quick else 10.0
    http_nodes = 10 if options.quick else 50
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    pages = [(f"node-{n:04d}-{v}.txt", node_page(n, v)) for n in range(nodes) for v in (0, 1)]
    results = ingest(pages, seconds)
    reference_ms = reference_cost(pages, 20 if options.quick else 100)
    results["reference_parse_ms_per_page"] = round(reference_ms, 3)
    results["reference_cpu_fraction_est"] = round(reference_ms * nodes / 1000.0, 3)
    results.update(http_cost(pages[: 2 * http_nodes : 2], rounds=2))
    results["cpu_fraction_with_http_est"] = round(
        results["cpu_fraction"] + results["http_cpu_ms_per_page"] * nodes / 1000.0, 4
    )
    targets = [
        Target("cpu_fraction", "<=", 0.5, f"parse + aggregate {nodes} nodes x 8 GPUs each second on under half a core"),
        Target("max_lag_s", "<=", 1.0, "keeps up: no page handled more than one interval late"),
        Target("samples_ingested_fraction", ">=", 1.0, "every GPU sample of every page ingested"),
    ]
    params = {
        "nodes": nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "interval_s": 1.0,
        "seconds": seconds,
        "parser": "cached",
        "http_subset_nodes": http_nodes,
        "page_bytes": len(pages[0][1]),
        "series_per_page": pages[0][1].count("\n") - 2 * pages[0][1].count("# TYPE"),
    }
    report = finish(options, results, targets, params, machine_info())
    return exit_code(options, report)


if __name__ == "__main__":
    raise SystemExit(main())
