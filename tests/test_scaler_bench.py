"""bench.scaler runs end to end on tiny sizes and writes the figures it promises. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench import scaler as bench_scaler

KEYS = (
    "getmetrics_p50_ms",
    "getmetrics_p99_ms",
    "getmetrics_burst_p99_ms",
    "activation_p50_ms",
    "activation_p99_ms",
    "poll_activation_p50_ms",
    "getmetrics_max_calls_per_s",
)


def test_bench_scaler_runs_on_a_private_server_and_writes_the_figures(tmp_path: Path) -> None:
    sizes = bench_scaler.Sizes(
        callers=10,
        caller_interval_s=0.05,
        calls_per_caller=3,
        saturation_calls_per_caller=3,
        activation_trials=3,
        poll_trials=2,
        poll_interval_s=0.05,
        load_pods=20,
        load_interval_s=0.05,
    )
    out = tmp_path / "scaler.json"
    report = bench_scaler.run(None, sizes, out=out, quick=True, quiet=True)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert data["benchmark"] == "scaler" and data["mode"] == "quick"
    for key in KEYS:
        assert isinstance(data[key], int | float) and data[key] > 0, key
    assert data["activation_trials"] == 3 and data["poll_trials"] == 2 and data["getmetrics_calls"] == 30
    assert {t["key"] for t in data["targets"]} == {"getmetrics_p99_ms", "activation_p99_ms"}
    assert data["load_reports_sent"] >= 20 and 0 < data["load_reports_taken"] <= data["load_reports_sent"]
    assert {"queue", "kv", "ttft"} <= set(data["decision_signal_replicas"])  # it scaled on the pods' load too
