"""The session half of the fleet-scale benchmark at a tiny size: it runs against real checkpoint service replicas
and gives every figure it promises (no timing is asserted: the figures are the benchmark's to report)."""

from __future__ import annotations

import inspect
from pathlib import Path

import redis.asyncio as aioredis

from bench import scale_sessions
from bench.fleetkit import FleetBench
from tests.conftest import Servers

KEYS = {
    "start_redis_calls_per_session_1000",
    "start_redis_calls_per_session_5000",
    "restore_s_1000",
    "restore_s_5000",
    "restore_growth_5000_vs_1000",
    "drain_verdict_s_1000",
    "idle_redis_calls_per_session_s",
    "periodic_round_s",
    "periodic_sessions",
    "periodic_interval_s",
    "periodic_interval_kept",
    "status_s_small",
    "status_s_large",
    "status_sessions_small",
    "status_sessions_large",
    "checkpoint_replicas",
    "fleet_sessions",
    "lost_sessions",
    "checker_problems",
    "checker_checkpoints",
}


async def test_the_session_figures_at_a_tiny_size(servers: Servers, root: str) -> None:
    client = aioredis.Redis.from_url(servers.redis_url)
    try:
        out = await scale_sessions.run(
            servers.nats_url,
            servers.redis_url,
            quick=True,
            sessions=120,
            nodes=3,
            replicas=2,
            interval_s=2.0,
            rounds=2,
            root=root,
        )
    finally:
        keys = [k async for k in client.scan_iter(match=f"{root}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    assert KEYS <= set(out), KEYS - set(out)
    assert out["one_pod_sizes"] == [20, 100] and out["restored_1000"] == 20 and out["restored_5000"] == 100
    assert out["drain_verdict_ok_1000"] is True
    assert out["fleet_sessions"] == 120 and out["lost_sessions"] == 0
    assert out["checkpoint_replicas"] == 2 and out["periodic_saves"] > 0
    assert out["checker_problems"] == 0, out["checker_first_problems"]
    assert out["checker_checkpoints"] >= 120  # every session saved at least once, each checkpoint read back


async def test_the_session_bench_is_what_the_fleet_upgrade_asks_of_it(tmp_path: Path) -> None:
    """``bench.fleetkit.FleetBench`` is what the rolling upgrade (``bench.scale_upgrade``) reads of the benchmark
    hosting the pods: the one benchmark that hosts them has every attribute and coroutine it names, so the kit and
    its user cannot drift apart unnoticed (constructing the bench connects to nothing)."""
    bench = scale_sessions.SessionBench("nats://127.0.0.1:1", "redis://127.0.0.1:1", tmp_path, replicas=1)
    try:
        for name in FleetBench.__annotations__:
            assert hasattr(bench, name), f"SessionBench lacks {name!r} that FleetBench names"
        for name in ("add_pod", "leave", "lost"):
            assert inspect.iscoroutinefunction(getattr(bench, name)), name
        assert callable(bench.mesh)
    finally:
        await bench.redis.aclose()
