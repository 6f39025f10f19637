"""The rules and the dashboard against the real thing: a real Prometheus, loaded with deploy/prometheus's rules,
scrapes every process of a running mesh (``gpuwarden up``: the five services and the simulation of
deploy/sim/synthetic.yaml, traffic flowing); KEDA's part is played by a ``GetMetrics`` call to the scaler; a rolling
driver upgrade drains every node. Then every dashboard panel's query and every recording rule returns data over the
test's time range (as Grafana asks for a panel) and none errors, every alert's expression evaluates, and no drain,
restore or upgrade alert fires.

Runs where a ``prometheus`` binary is found (``make install`` unpacks Debian's package into the virtualenv where
apt-get works); elsewhere it skips and says so. The rules' 30 s recording interval is shortened to 1 s here, and
Grafana's ``$__rate_interval`` is taken as 1m."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from services.scaler.gen import externalscaler_pb2 as pb
from services.scaler.gen import externalscaler_pb2_grpc as pb_grpc
from tests.meshkit import gpuwarden, until, up_detached
from tests.promkit import ROOT, RULES, promql
from tools import metricsdoc

_VENV_BINARY = Path(sys.prefix) / "bin" / "prometheus"
BINARY = (
    os.environ.get("GPUWARDEN_PROMETHEUS_BIN")
    or shutil.which("prometheus")
    or (str(_VENV_BINARY) if _VENV_BINARY.exists() else None)
)
pytestmark = [
    pytest.mark.skipif(
        BINARY is None,
        reason="no prometheus binary (make install fetches one where apt-get works; or set GPUWARDEN_PROMETHEUS_BIN)",
    ),
    pytest.mark.timeout(420),
]

NEW_DRIVER = "560.35.03"
NEVER_IN_A_HEALTHY_MESH = (
    "GpuwardenDrainPastDeadline",
    "GpuwardenDrainFailed",
    "GpuwardenRestoreVerificationFailed",
    "GpuwardenDriverUpgradeFailed",
    "GpuwardenDependencyUnreachable",
)


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def query(base: str, expr: str, since: float | None = None) -> dict[str, Any]:
    """Prometheus' answer to a query, as Grafana asks it for a panel: over a range (``since`` until now, a point
    every 2 s), else at this instant. Errors come back as ``status: error`` with the reason."""
    if since is None:
        url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    else:
        span = {"query": expr, "start": f"{since:.3f}", "end": f"{time.time():.3f}", "step": "2"}
        url = f"{base}/api/v1/query_range?{urllib.parse.urlencode(span)}"
    try:
        answer: dict[str, Any] = get_json(url)
    except urllib.error.HTTPError as exc:  # 400/422: a query Prometheus refused, with its reason in the body
        answer = json.loads(exc.read())
    return answer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """A mesh of its own (``gpuwarden up --detach``): the environment to command it, and each process's
    ``host:port``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env.update(GPUWARDEN_HOME=str(tmp_path / "home"), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    # The upgrade's passes come sooner, and the pods hold synthetic blocks (no model to load): the test is shorter.
    env.update(GPUWARDEN_DRIVER_RECONCILE_S="2", GPUWARDEN_SIM_SPEC=str(ROOT / "deploy" / "sim" / "synthetic.yaml"))
    try:
        up = up_detached(env, "--rate", "3")
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((tmp_path / "home" / "run.json").read_text())
        addresses = {label: url.split("//", 1)[1].split("/", 1)[0] for label, url in state["services"].items()}
        yield env, addresses
    finally:
        gpuwarden(env, "down", timeout=90)


@pytest.fixture
def prometheus(tmp_path: Path, mesh: tuple[dict[str, str], dict[str, str]]) -> Iterator[str]:
    """A Prometheus of this test's own scraping every process of the mesh every second, one job per service."""
    assert BINARY is not None
    _, addresses = mesh
    jobs: dict[str, list[str]] = {}
    for label, address in addresses.items():
        jobs.setdefault(label.split("@", 1)[0], []).append(address)
    rules = yaml.safe_load((RULES / "gpuwarden-rules.yaml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [
            {"job_name": f"gpuwarden-{job}", "static_configs": [{"targets": targets}]}
            for job, targets in sorted(jobs.items())
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = subprocess.Popen(
        [
            BINARY,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def ask_like_keda(scaler_health_url: str) -> None:
    """One ``GetMetrics`` for the simulation's deployment on every signal: the scaler watches it from then on."""
    grpc_address = get_json(scaler_health_url)["grpc"].replace("0.0.0.0", "127.0.0.1")
    metadata = {
        "scalerAddress": grpc_address,
        "deployment": "llama",
        "namespace": "llm",
        "queueDepthPerReplica": "4",
        "gpuUtilTarget": "70",
        "kvCacheUtilTarget": "70",
        "ttftP90TargetMs": "2000",
        "maxReplicas": "6",
    }
    ref = pb.ScaledObjectRef(name="llama", namespace="llm", scalerMetadata=metadata)
    with grpc.insecure_channel(grpc_address) as channel:
        stub = pb_grpc.ExternalScalerStub(channel)
        reply = stub.GetMetrics(
            pb.GetMetricsRequest(scaledObjectRef=ref, metricName="s0-gpuwarden-llm-llama"), timeout=10
        )
    assert len(reply.metricValues) == 1


def test_every_panel_and_recording_rule_returns_data_from_a_running_mesh(
    mesh: tuple[dict[str, str], dict[str, str]], prometheus: str
) -> None:
    env, addresses = mesh
    started = time.time()
    until(lambda: _ready(prometheus), 60, "Prometheus ready", every=1.0)
    ask_like_keda(f"http://{addresses['scaler']}/healthz")
    targets = until(lambda: _all_up(prometheus, len(addresses)), 60, "every process scraped", every=1.0)
    assert {t["labels"]["job"] for t in targets} >= {"gpuwarden-scaler", "gpuwarden-checkpoint", "gpuwarden-sim"}

    upgrade = gpuwarden(
        env, "upgrade-driver", NEW_DRIVER, "--max-parallel", "3", "--wait", "--timeout", "200", "--json", timeout=260
    )
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    assert json.loads(upgrade.stdout)["ok"]

    records = sorted(metricsdoc.recording_rules())
    wanted = [(title, promql(expr)) for title, expr in metricsdoc.dashboard_queries()] + [(r, r) for r in records]
    missing: dict[str, str] = {}

    def answered() -> bool:
        missing.clear()
        for title, expr in wanted:
            answer = query(prometheus, expr, since=started)
            assert answer["status"] == "success", (title, expr, answer)
            if not answer["data"]["result"]:
                missing[title] = expr
        return not missing

    try:
        until(answered, 90, "every query answered with data", every=1.0)
    except AssertionError as exc:
        raise AssertionError(f"no data for: {json.dumps(missing, indent=1)}") from exc

    drained = query(prometheus, 'gpuwarden:drain_verdicts:increase1h{outcome="completed"}')["data"]["result"]
    assert drained and float(drained[0]["value"][1]) > 0  # the upgrade's drains were seen
    decided = query(prometheus, "gpuwarden_scaler_decision_signal")["data"]["result"]
    assert decided and decided[0]["metric"]["deployment"] == "llama"
    for group in yaml.safe_load((RULES / "gpuwarden-rules.yaml").read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert query(prometheus, rule["expr"])["status"] == "success", rule["alert"]
    firing = query(prometheus, f'ALERTS{{alertname=~"{"|".join(NEVER_IN_A_HEALTHY_MESH)}"}}')["data"]["result"]
    assert firing == [], firing


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _all_up(base: str, count: int) -> list[dict[str, Any]]:
    active = get_json(f"{base}/api/v1/targets")["data"]["activeTargets"]
    healthy = [t for t in active if t["health"] == "up"]
    return healthy if len(healthy) == count else []
