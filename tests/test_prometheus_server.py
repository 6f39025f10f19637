"""The whole chain with a real Prometheus: simulated exporter page -> Prometheus scrapes it -> the metrics service's
``PrometheusQuery`` source reads it back through prometheus-api-client.

Runs when a ``prometheus`` binary is found: ``GPUWARDEN_PROMETHEUS_BIN``, else ``prometheus`` on PATH, else the one
``make install`` unpacks into the virtualenv from Debian's package where apt-get can fetch it (no Python package
index ships one). Elsewhere the test skips and says so; the same source is tested everywhere against a fake
speaking Prometheus' real JSON (tests/test_metrics.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from shared.adapters.httpclient import http_get
from shared.adapters.metrics import PrometheusQuery
from shared.contract.subjects import Subjects
from shared.ports.metrics import MetricsSourceError
from shared.sim.exporter import PodRef, SimExporter
from shared.sim.gpus import SimGpus
from shared.sim.spec import GpuSpec, NodeSpec, SimSpec
from tests.helpers import eventually

_VENV_BINARY = Path(sys.prefix) / "bin" / "prometheus"
BINARY = (
    os.environ.get("GPUWARDEN_PROMETHEUS_BIN")
    or shutil.which("prometheus")
    or (str(_VENV_BINARY) if _VENV_BINARY.exists() else None)
)
pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="no prometheus binary (make install fetches one where apt-get works; or set GPUWARDEN_PROMETHEUS_BIN)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus of this test's own; the scrape targets are written to its file-based discovery later."""
    assert BINARY is not None
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: dcgm\n    file_sd_configs:\n"
        f"      - files: ['{targets}']\n        refresh_interval: 1s\n"
    )
    port = _free_port()
    proc = subprocess.Popen(
        [
            BINARY,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}", targets
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_real_prometheus_scrapes_the_simulated_exporter_and_the_source_reads_it(
    prometheus: tuple[str, Path], redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    url, targets = prometheus
    spec = SimSpec(nodes=[NodeSpec(name="node-1", gpus=[GpuSpec(count=2)])])
    gpus = SimGpus(redis_client, subjects, spec, "node-1")
    devices = await gpus.devices()
    await gpus.set_load(devices[0].uuid, 64.0, 2048.0, 16.0)
    exporter = SimExporter(gpus, pods=lambda: {devices[0].uuid: PodRef("llama-0", "llm")})
    await exporter.start()
    try:

        async def ready() -> bool:
            try:
                return (await http_get(f"{url}/-/ready", 1))[0] == 200
            except MetricsSourceError:
                return False

        await eventually(ready, timeout=30, interval=0.2)
        host_port = exporter.url.split("//", 1)[1].split("/", 1)[0]
        await asyncio.to_thread(targets.write_text, f'[{{"targets": ["{host_port}"]}}]')
        source = PrometheusQuery(url, timeout=2)

        async def scraped() -> dict[str, object]:
            try:
                read = await source.read()
            except MetricsSourceError:
                return {}
            return {r.key: r for r in read.readings}

        got = await eventually(scraped, timeout=30, interval=0.5)
        first = got[devices[0].uuid]
        assert (first.util, first.pod, first.namespace, first.node) == (64.0, "llama-0", "llm", "node-1")  # type: ignore[attr-defined]
        assert first.values["mem_used_mib"] == 2048.0  # type: ignore[attr-defined]
        assert got[devices[1].uuid].util == 0.0  # type: ignore[attr-defined]
        await source.close()
    finally:
        await exporter.stop()
