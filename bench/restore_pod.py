"""One pod's restore of N sessions, alone: is it linear in N? ``python -m bench.restore_pod [--quick] [--out PATH]
[--strict]`` writes ``bench/results/restore_pod.json``.

``bench.scale`` measures the same restore (``restore_s_1000`` / ``restore_s_5000``) inside a 1,000-node fleet,
where whatever else the fleet runs shares the machine. This runs it with nothing else: private NATS and Redis,
one checkpoint replica (``GC_REPLICA`` adds one that also applies retention every few seconds, as the fleet's
own service does), pods hosted in this process as ``bench.scale_sessions`` hosts them. Per size: a pod starts N
one-block sessions, saves them and leaves; a new pod restores every one (claim, verified read, report). Figures:
``restore_s_<N>``, ``restore_ms_per_session_<N>``, the CPU seconds this process (the pods) and the replicas
spent (``pods_cpu_s_<N>``, ``service_cpu_s_<N>``), and ``restore_growth`` (largest over smallest size; linear
is the size ratio, 5 for the default 1,000 and 5,000).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import BenchOptions, Target, default_out, exit_code, finish, machine_info
from bench.scale_sessions import SessionBench
from shared.host.devservers import NatsServer, RedisServer

SIZES = (1000, 5000)
QUICK_SIZES = (20, 100)
GC_REPLICA_S = 5.0
"""Seconds between the retention passes of the second replica (0: no second replica)."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(sizes: tuple[int, ...], gc_s: float) -> dict[str, Any]:
    nats, redis = NatsServer().start(), RedisServer().start()
    try:
        with tempfile.TemporaryDirectory(prefix="gw-restore-") as home:
            bench = SessionBench(nats.url, redis.url, Path(home), 1)
            await bench.start()
            if gc_s > 0:
                bench.add_replica(gc_s)
            out: dict[str, Any] = {}
            try:
                for n in sizes:
                    pod = await bench.add_pod(f"before-{n}", bench.node_names[0])
                    sids = [f"r{n}-s{i}" for i in range(n)]
                    await bench.start_sessions(pod, sids)
                    await bench.save_all(pod)
                    await bench.leave(pod)
                    target = await bench.add_pod(f"after-{n}", bench.node_names[1])
                    service_before = sum(cpu_seconds(r.proc.pid) for r in bench.replicas)
                    own_before, started = time.process_time(), time.monotonic()
                    await bench.restore_all(target, sids)
                    took = time.monotonic() - started
                    out[f"restore_s_{n}"] = round(took, 3)
                    out[f"restore_ms_per_session_{n}"] = round(took / n * 1000, 3)
                    out[f"pods_cpu_s_{n}"] = round(time.process_time() - own_before, 2)
                    out[f"service_cpu_s_{n}"] = round(
                        sum(cpu_seconds(r.proc.pid) for r in bench.replicas) - service_before, 2
                    )
                    out[f"restored_{n}"] = len(target.agent.sessions())
                    await bench.leave(target)
            finally:
                await bench.close()
    finally:
        nats.stop()
        redis.stop()
    out["restore_growth"] = round(out[f"restore_s_{sizes[-1]}"] / out[f"restore_s_{sizes[0]}"], 2)
    out["linear_growth"] = round(sizes[-1] / sizes[0], 2)
    return out


def targets(sizes: tuple[int, ...]) -> tuple[Target, ...]:
    ratio = sizes[-1] / sizes[0]
    return (
        Target(
            "restore_growth",
            "<=",
            round(ratio * 1.2, 2),
            f"restoring {ratio:g}x the sessions takes at most 1.2 x {ratio:g} as long",
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.restore_pod", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} (a smoke run)")
    parser.add_argument(
        "--gc-s", type=float, default=GC_REPLICA_S, help="retention every S s on a second replica (0: none)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes")
    parser.add_argument(
        "--nats-url",
        default=None,
        help="taken for `make bench`'s BENCH_ARGS and not used: this runs NATS and Redis of its own",
    )
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = QUICK_SIZES if args.quick else SIZES
    options = BenchOptions("restore_pod", args.quick, None, args.out or default_out("restore_pod"), args.strict)
    results = asyncio.run(measure(sizes, args.gc_s))
    report = finish(options, results, targets(sizes), {"sizes": list(sizes), "gc_s": args.gc_s}, machine_info())
    return exit_code(options, report)


if __name__ == "__main__":
    sys.exit(main())
