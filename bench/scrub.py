"""``python -m bench.scrub``: what the checkpoint service's scrub costs per recorded checkpoint it checks.

The real checkpoint service on a private NATS and Redis, a file store in a temporary folder. A KV agent saves every
session twice (one 16 KiB block each, one pack per round: two checkpoints a session), the checkpoints are recorded,
and 1% of the sessions lose their newest manifest (as a failover brings back records of ended sessions). Then one
walk round the registry, in turns of ``scrub_sessions`` sessions with the default sample of blocks read back, at a
small and a larger size. Per checkpoint checked:

- ``redis_round_trips``: the scrub's calls of the registry (each one round trip; a pipeline or a script is one);
- ``redis_commands``: what the Redis server ran meanwhile (``INFO commandstats``: the commands inside scripts and
  pipelines included, and the few of the service's other loops);
- ``store_calls``: the scrub's calls of the store (manifest reads, one look at the packs a turn, one sample read);
- ``checkpoints_per_s``: checked per second of walking (wall clock, every turn back to back).

The walk must forget exactly the lost checkpoints (``*_forgotten`` equals ``*_lost``), or the run fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.common import BenchOptions, Counting, exit_code, finish, machine_info, nats_server, parse_args

SIZES_FULL = {"small": 1000, "large": 10000}
SIZES_QUICK = {"small": 60, "large": 300}
LOST_SHARE = 0.01


async def _commands(client: Any) -> int:
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values() if isinstance(v, dict))


async def one_size(url: str, label: str, sessions_n: int, folder: Path) -> dict[str, Any]:
    from services.checkpoint.config import CheckpointSettings
    from services.checkpoint.scrub import Scrub
    from services.checkpoint.service import CheckpointService
    from shared.contract.subjects import Subjects
    from shared.host.devservers import RedisServer
    from shared.host.runner import start_service
    from shared.kv.agent import KvAgent
    from shared.kv.filestore import FileStore
    from shared.kv.presets import LLAMA_3_8B
    from shared.kv.reports import report_event
    from shared.plumbing.configsync import redis_client
    from shared.plumbing.settings import NatsSettings, RedisSettings, Settings
    from shared.wiring import Wiring

    layout = msgspec.structs.replace(LLAMA_3_8B, layers=2, kv_heads=2, head_dim=64)  # 16 KiB a block
    redis_server = RedisServer().start()
    subjects = Subjects("scrubbench" + uuid.uuid4().hex[:6])
    settings = Settings(
        nats=NatsSettings(servers=(url,)), redis=RedisSettings(url=redis_server.url), root=subjects.root, node="node-1"
    )
    store = FileStore(folder / label)
    service = CheckpointService(CheckpointSettings(gc_interval_s=0, scrub_interval_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    client = redis_client(settings.redis, timeout=10.0)
    try:
        agent = KvAgent(store, pod="pod-0", node="node-1", namespace="bench", deployment="llama", layout=layout)
        names = [f"s{i:06d}" for i in range(sessions_n)]
        rng = np.random.default_rng(7)
        for sid in names:
            agent.register_session(sid)
            agent.append_block(sid, rng.integers(0, 256, layout.block_bytes, dtype=np.uint8).reshape(2, -1))
        for _ in range(2):
            report = report_event(agent, await agent.save())
            for start in range(0, len(report.committed), 1000):
                part = report.committed[start : start + 1000]
                await service.registry.record_checkpoints(part, store.url, report.pod, report.node)
            for sid in names:
                agent.append_block(sid, rng.integers(0, 256, layout.block_bytes, dtype=np.uint8).reshape(2, -1))
        lost = names[:: int(1 / LOST_SHARE)]
        for sid in lost:
            newest = (await store.checkpoints(sid))[0]
            (store.sessions_dir / sid / f"{newest}.json").unlink()
        replica = service.scrub.replica
        registry, counted_store = Counting(replica.registry), Counting(replica.store)
        scrub = Scrub(dataclasses.replace(replica, registry=registry, store=counted_store))
        commands_before = await _commands(client)
        started = time.perf_counter()
        walked = await scrub.walk()
        elapsed = time.perf_counter() - started
        commands = await _commands(client) - commands_before - 1  # the first INFO counts itself
        if walked.forgotten != len(lost):
            raise RuntimeError(f"{label}: the walk forgot {walked.forgotten} checkpoints, {len(lost)} were lost")
        checked = walked.checked
        turns = registry.calls["run_id"]
        return {
            f"{label}_sessions": sessions_n,
            f"{label}_checkpoints": checked,
            f"{label}_lost": len(lost),
            f"{label}_forgotten": walked.forgotten,
            f"{label}_turns": turns,
            f"{label}_redis_round_trips_per_checkpoint": sum(registry.calls.values()) / checked,
            f"{label}_redis_commands_per_checkpoint": commands / checked,
            f"{label}_store_calls_per_checkpoint": sum(counted_store.calls.values()) / checked,
            f"{label}_sampled_bytes_per_checkpoint": walked.sampled_bytes / checked,
            f"{label}_checkpoints_per_s": checked / elapsed,
            f"{label}_walk_s": elapsed,
            f"{label}_detail": {"registry": dict(registry.calls), "store": dict(counted_store.calls)},
        }
    finally:
        await client.aclose()
        await running.stop(grace=1)
        redis_server.cleanup()


async def measure(url: str, sizes: dict[str, int]) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="gw-scrub-bench-"))
    results: dict[str, Any] = {}
    try:
        for label, n in sizes.items():
            results |= await one_size(url, label, n, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def run(options: BenchOptions, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    chosen = sizes or (SIZES_QUICK if options.quick else SIZES_FULL)
    with nats_server(options.nats_url) as url:
        results = asyncio.run(measure(url, chosen))
    details = {k: results.pop(k) for k in [k for k in results if k.endswith("_detail")]}
    from services.checkpoint.config import CheckpointSettings

    defaults = CheckpointSettings()
    params = {
        "sizes": chosen,
        "checkpoints_per_session": 2,
        "lost_share": LOST_SHARE,
        "scrub_sessions": defaults.scrub_sessions,
        "scrub_sample_bytes": defaults.scrub_sample_bytes,
        "calls": details,
    }
    return finish(options, results, [], params, machine_info())


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args("scrub", "the checkpoint scrub's cost per recorded checkpoint checked", argv)
    return exit_code(options, run(options))


if __name__ == "__main__":
    sys.exit(main())
