"""The benchmarks run end to end on tiny sizes and write the report they promise. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bus as bench_bus
from bench.common import Target, default_out, parse_args, percentile

REQUIRED_BUS_KEYS = (
    "core_msgs_per_s",
    "raw_core_msgs_per_s",
    "core_ratio",
    "jetstream_events_per_s",
    "raw_jetstream_events_per_s",
    "jetstream_p50_ms",
    "jetstream_p99_ms",
)


def test_bench_bus_runs_on_a_private_server_and_writes_the_figures(tmp_path: Path) -> None:
    sizes = bench_bus.Sizes(core_n=300, js_n=200, latency_s=0.2, rounds=1, warmup_n=50, idle_timeout_s=5.0)
    out = tmp_path / "bus.json"
    report = bench_bus.run(None, sizes, out=out, quick=True, quiet=True)  # None: starts its own nats-server

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert data["benchmark"] == "bus" and data["mode"] == "quick"
    for key in REQUIRED_BUS_KEYS:
        value = data[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), key
        assert value > 0, f"{key} = {value}"
    assert data["core_lost"] == 0 and data["jetstream_lost"] == 0
    assert data["jetstream_latency_events"] == 200
    targets = {t["key"]: t for t in data["targets"]}
    assert set(targets) == {"core_ratio", "jetstream_events_per_s", "jetstream_p99_ms"}
    for t in targets.values():
        assert t["measured"] == data[t["key"]] and isinstance(t["passed"], bool)
    machine = data["machine"]
    assert machine["cpu_count"] and machine["python"] and machine["timestamp"]
    assert data["params"]["server"] == "private" and data["params"]["js_n"] == 200
    for side in ("raw", "bus"):  # every event acked, none redelivered
        for trial in data["params"]["detail"]["jetstream"][side]:
            assert trial["num_ack_pending"] == 0 and trial["num_redelivered"] == 0 and trial["num_pending"] == 0


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([3, 1, 2], 100) == 3
    with pytest.raises(ValueError):
        percentile([], 50)


def test_targets_report_value_and_verdict() -> None:
    at_least = Target("rate", ">=", 10, "")
    at_most = Target("p99", "<=", 5.0, "")
    assert at_least.check({"rate": 12})["passed"] is True
    assert at_least.check({"rate": 9.9})["passed"] is False
    assert at_most.check({"p99": 5.0})["passed"] is True
    missing = at_most.check({})
    assert missing["passed"] is False and missing["measured"] is None


def test_command_line_defaults_to_a_private_server_and_the_results_folder() -> None:
    options = parse_args("bus", argv=[])
    assert options.nats_url is None and not options.quick and options.out == default_out("bus")
    assert default_out("bus").parts[-3:] == ("bench", "results", "bus.json")
    options = parse_args("bus", argv=["--quick", "--nats-url", "nats://h:1", "--out", "x.json", "--strict"])
    assert options.quick and options.nats_url == "nats://h:1" and options.out == Path("x.json") and options.strict
