"""What ships for operators, checked without a running mesh: the rules pass ``promtool check rules`` and their unit
tests (``promtool test rules``), every dashboard query parses, the metric list in docs/observability.md is the one
the code declares, names follow Prometheus' conventions, and the rules and the dashboard name only metrics that
exist. (tests/test_observability_mesh.py runs them against a real Prometheus scraping a real mesh.)

promtool comes from Debian's prometheus package, which ``make install`` unpacks into the virtualenv where apt-get
works; where it could not be fetched the promtool tests skip and say so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.promkit import RULES, promql
from tools import metricsdoc

_VENV_PROMTOOL = Path(sys.prefix) / "bin" / "promtool"
PROMTOOL = (
    os.environ.get("GPUWARDEN_PROMTOOL_BIN")
    or shutil.which("promtool")
    or (str(_VENV_PROMTOOL) if _VENV_PROMTOOL.exists() else None)
)
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool (make install fetches Debian's prometheus package where apt-get works; "
    "or set GPUWARDEN_PROMTOOL_BIN)",
)


def promtool(*args: str, cwd: Path = RULES) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_the_rules_pass_promtool_and_their_unit_tests() -> None:
    checked = promtool("check", "rules", "gpuwarden-rules.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "gpuwarden-rules.test.yaml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


@needs_promtool
def test_promtool_fails_a_rule_unit_test_that_does_not_hold(tmp_path: Path) -> None:
    """The unit tests can fail: the same tests against rules whose drain alert never fires."""
    rules = yaml.safe_load((RULES / "gpuwarden-rules.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "GpuwardenDrainPastDeadline":
                rule["expr"] = "vector(1) == 0"
    (tmp_path / "gpuwarden-rules.yaml").write_text(yaml.safe_dump(rules))
    shutil.copy(RULES / "gpuwarden-rules.test.yaml", tmp_path)
    failed = promtool("test", "rules", "gpuwarden-rules.test.yaml", cwd=tmp_path)
    assert failed.returncode != 0 and "GpuwardenDrainPastDeadline" in failed.stdout + failed.stderr


@needs_promtool
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    queries = metricsdoc.dashboard_queries()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query_{i}", "expr": promql(q)} for i, (_, q) in enumerate(queries)],
            }
        ]
    }
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", "dashboard.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_covers_what_an_operator_needs() -> None:
    board = json.loads(metricsdoc.DASHBOARD.read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Drains", "Checkpoints", "Restores", "Upgrades", "Scaler", "GPU health"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in (p for p in board["panels"] if p["type"] != "row"):
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
    text = " ".join(q for _, q in metricsdoc.dashboard_queries())
    for needed in (
        "gpuwarden_scaler_kv_cache_utilisation_ratio",
        "gpuwarden_scaler_ttft_p90_seconds",
        "gpuwarden_scaler_queue_depth",
        "gpuwarden_scaler_gpu_utilisation_ratio",
        "gpuwarden_scaler_decision_signal",
        "gpuwarden:drain_seconds:p90_30m",
        "gpuwarden:checkpoint_bytes:rate5m",
        "gpuwarden:checkpoint_restores:rate5m",
        "gpuwarden_device_gpus",
        "gpuwarden_driver_upgrade_nodes",
    ):
        assert needed in text, needed


def test_the_metric_list_is_current_and_names_follow_the_conventions() -> None:
    metrics, problems = metricsdoc.collect()
    assert problems == []
    names = {m.name for m in metrics}
    assert {
        "gpuwarden_drain_verdicts_total",
        "gpuwarden_drain_deadline_timestamp_seconds",
        "gpuwarden_scaler_kv_cache_utilisation_ratio",
        "gpuwarden_driver_upgrade_state_since_timestamp_seconds",
        "gpuwarden_messages_total",
    } <= names
    assert metricsdoc.main(["--check"]) == 0


def test_a_stale_list_a_bad_name_and_an_unknown_metric_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / "observability.md"
    stale.write_text(f"# Observability\n\n{metricsdoc.BEGIN}\n| old |\n{metricsdoc.END}\n")
    monkeypatch.setattr(metricsdoc, "TARGET", stale)
    assert metricsdoc.main(["--check"]) == 1
    assert metricsdoc.main([]) == 0 and metricsdoc.main(["--check"]) == 0
    assert "`gpuwarden_scaler_ttft_p90_seconds` | gauge |" in stale.read_text()

    bad = metricsdoc.Metric("gpuwarden_drain_ms", "histogram", "", (), "x.py")
    assert len(metricsdoc._convention_problems(bad)) == 3  # not base units, not seconds or bytes, no help
    assert metricsdoc._convention_problems(metricsdoc.Metric("gpuwarden_x_total", "gauge", "h", (), "x.py"))

    rules = tmp_path / "prometheus"
    rules.mkdir()
    (rules / "r.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "gpuwarden_no_such_thing > 0"}]}]})
    )
    monkeypatch.setattr(metricsdoc, "RULES_DIR", rules)
    _, problems = metricsdoc.collect()
    assert any("gpuwarden_no_such_thing" in p and "no such metric" in p for p in problems), problems
