"""bench.router runs end to end on tiny sizes and writes the figures it promises. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench import router as bench_router


def test_bench_router_asks_a_router_and_a_noop_server_and_writes_the_figures(tmp_path: Path) -> None:
    sizes = bench_router.Sizes(pods=12, sessions=300, rate=100.0, seconds=0.3, warmup_s=0.1)
    out = tmp_path / "router.json"
    report = bench_router.run(sizes, out=out, quick=True, quiet=True)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert data["benchmark"] == "router" and data["mode"] == "quick"
    for key in ("router_pick_p50_ms", "router_pick_p99_ms", "noop_pick_p99_ms", "router_vs_noop_p99"):
        assert isinstance(data[key], int | float) and data[key] > 0, key
    assert data["router_requests"] == data["noop_requests"] == 30
    assert data["router_failed"] == data["noop_failed"] == 0
    assert data["router_not_holder"] == 0 and data["router_picks_holder"] >= 30  # every answer named the holder
    assert {t["key"] for t in data["targets"]} == {"router_pick_p99_ms", "router_vs_noop_p99", "router_not_holder"}


def test_bench_router_measures_a_drain_through_the_whole_mesh_at_a_tiny_size() -> None:
    """``gpuwarden run`` with the router, 8 conversations, one node drained: the figures are there and no request
    of a live session went to a pod that did not hold it."""
    moves = bench_router.measure_moves(bench_router.QUICK_MOVES)
    for key in (
        "sessions_moved",
        "prefetched",
        "requests_to_non_holder",
        "cold_restores_on_request",
        "sessions_recomputed",
        "sessions_lost",
        "moved_first_tokens",
        "unmoved_first_tokens",
    ):
        assert isinstance(moves[key], int), key
    assert moves["unmoved_first_tokens"] > 0 and moves["unmoved_first_token_p50_ms"] > 0  # measured, never 0
    assert moves["drain_ok"] and moves["requests_served"] > 0
    assert moves["requests_to_non_holder"] == 0 and moves["sessions_lost"] == 0


@pytest.mark.long  # 45 s of a whole mesh: `make faults` runs it; make test keeps the drain's (the same measure_moves)
def test_bench_router_measures_a_scale_in_through_the_whole_mesh_at_a_tiny_size() -> None:
    """The issue's scale-in at a tiny size: the routing spec's pool scaled 3 -> 2 with ``gpuwarden sim scale``
    under 8 conversations; the pod removed is named, nothing lost, no request to a non-holder."""
    sizes = dataclasses.replace(bench_router.QUICK_MOVES, nodes="", spec=bench_router.ROUTING_SPEC, scale_in=(3, 2))
    moves = bench_router.measure_moves(sizes)
    assert moves["drain_ok"] and moves["scaled_in_pods"].startswith("llama-"), moves
    assert moves["sessions_lost"] == 0 and moves["requests_to_non_holder"] == 0 and moves["requests_served"] > 0
    assert isinstance(moves["sessions_recomputed"], int) and isinstance(moves["moved_first_tokens"], int)
