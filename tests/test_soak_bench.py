"""bench.soak's arithmetic and report on made-up observations, and the soak itself for a few seconds on a one-node
mesh (the real one runs the embedded default for minutes: ``make soak``). No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import Observations, ObservedDrain, SoakPlan, main, parse, slope_per_min, summarise


def test_growth_is_the_least_squares_slope_in_mb_per_minute() -> None:
    assert slope_per_min([(0.0, 100.0), (30.0, 101.0), (60.0, 102.0)]) == pytest.approx(2.0)
    assert slope_per_min([(t, 500.0 + (40.0 if t % 20 else -40.0)) for t in range(0, 600, 10)]) == pytest.approx(
        0.0, abs=0.5
    )  # a sawtooth around a level does not grow
    assert slope_per_min([(0.0, 1.0), (1.0, 2.0)]) is None


def test_the_command_line_scales_drains_and_the_upgrade_with_the_run() -> None:
    options, plan, keep = parse(["--quick"])
    assert options.quick and options.out.parts[-3:] == ("bench", "results", "soak.json") and not keep
    assert (plan.seconds, plan.drain_every, plan.upgrade_at) == (60.0, 10.0, 12.0)
    _, plan, _ = parse(["--seconds", "1200", "--drain-every", "30"])
    assert (plan.seconds, plan.drain_every, plan.upgrade_at) == (1200.0, 30.0, 240.0)
    with pytest.raises(SystemExit):
        parse(["--seconds", "-5"])


def test_the_report_names_growth_losses_and_verdicts(tmp_path: Path) -> None:
    plan = SoakPlan(seconds=100.0, drain_every=10.0, upgrade_at=20.0, sample_every=10.0, rate=2.0)
    obs = Observations()
    obs.samples = [{"t": float(t), "rss_mb": {"sim": 300.0 + t, "cli": 50.0}} for t in range(0, 101, 10)]
    obs.drains = {
        "a": ObservedDrain("a", "node-1", "bench.soak", 10.0, "completed", 10.5),
        "b": ObservedDrain("b", "node-2", "driver", 20.0, "failed", 21.0, 1, "1 session(s) not checkpointed"),
        "c": ObservedDrain("c", "node-3", "bench.soak", 30.0),
    }
    obs.upgrade_started, obs.upgrade_done_at = 20.0, {"node-1": 40.0, "node-2": 70.0}
    final = {"lost": 0, "preemptions": 7, "ended": 3, "tracked": {"home": 4}}
    report = summarise(plan, obs, final, ["node-1", "node-2"], "", tmp_path)
    assert report["sim_rss_max_mb"] == 400.0 and report["sim_rss_growth_mb_per_min"] == pytest.approx(60.0)
    assert report["sim_rss_high_water_rise_mb"] == 60.0  # 400 MB at the end against 340 MB in the first half
    assert report["rss_max_mb"] == {"cli": 50.0, "sim": 400.0}
    assert (report["drains"], report["drains_completed"], report["drains_failed"]) == (3, 1, 1)
    assert report["drains_without_verdict"] == 1 and report["drains_asked_by_driver"] == 1
    assert report["verdict_max_s"] == pytest.approx(1.0) and report["verdict_p50_s"] == pytest.approx(0.75)
    assert report["upgrade_seconds"] == 50.0 and report["lost_sessions"] == 0 and report["preemptions"] == 7
    assert report["sim_tracked_end"] == {"home": 4} and report["checkpoint_store_mb"] == 0.0


ONE_NODE = """
nodes:
  - {name: node-1, gpus: [{count: 1}]}
deployments:
  - name: llama
    namespace: llm
    replicas: 1
    kv_blocks: 16
    model: {engine: synthetic, max_model_len: 256}
"""


def test_a_soak_of_a_few_seconds_on_one_node_writes_its_report(tmp_path: Path) -> None:
    """``gpuwarden run`` on a one-node synthetic spec, two drains and the rolling upgrade started: the JSON has
    every figure the soak promises, and no session is lost."""
    spec = tmp_path / "one-node.yaml"
    spec.write_text(ONE_NODE)
    out = tmp_path / "soak.json"
    argv = ["--spec", str(spec), "--seconds", "5", "--drain-every", "2", "--upgrade-at", "3", "--sample-every", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "soak" and data["params"]["spec"] == str(spec)
    for key in ("sim_rss_max_mb", "all_rss_max_mb", "lost_sessions", "drains", "drains_completed", "requests"):
        assert isinstance(data[key], int | float) and not isinstance(data[key], bool), key
    assert data["drains"] >= 2 and data["drains_without_verdict"] == 0 and data["lost_sessions"] == 0
    assert data["requests"] > 0 and {t["key"] for t in data["targets"]} >= {"lost_sessions", "drains_without_verdict"}
