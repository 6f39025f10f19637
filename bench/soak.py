"""``python -m bench.soak``: the embedded default left running with traffic, drains and a rolling driver upgrade.
Does anything grow, is any session lost, does every drain get its verdict?

It starts a nats-server and a redis-server of its own on free ports, then ``gpuwarden run`` (the same processes
``make run`` starts: the five services per node or once, and the simulation with its traffic) as a subprocess in
a temporary folder, which holds its state file, logs and file checkpoint store; a ``make run`` already running is
never touched. For ``--seconds`` (default 600) it

- samples the resident memory (RSS) of every process: the CLI, each service, the simulation, NATS and Redis;
- asks for a drain of the next node every ``--drain-every`` seconds (``node.drain.requested``, as
  ``gpuwarden drain NODE --wait`` does) and times each verdict; the drains the driver asks for are timed too;
- at ``--upgrade-at`` seconds sets the driver configuration to a new version with ``auto_upgrade``
  (``gpuwarden config set driver``): a rolling upgrade, node by node, each node's pods evicted after their
  checkpoints are committed;

then reads the simulation's ``/healthz`` (lost sessions, preemptions, sessions ended, the sizes of its own
structures) and stops everything. The figures go to ``bench/results/soak.json`` with the RSS timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from bench.common import BenchOptions, Target, finish, latency_summary, machine_info
from shared.contract.driver import DriverUpgradeStateChanged
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.host.devservers import NatsServer, RedisServer
from shared.plumbing.bus import Bus
from shared.plumbing.settings import NatsSettings

REPO = Path(__file__).resolve().parent.parent
ROOT = "soak"
NEW_DRIVER = "560.35.03"
DRAIN_DEADLINE_S = 25.0
MB = 1e6


@dataclass(frozen=True)
class SoakPlan:
    seconds: float
    drain_every: float
    upgrade_at: float
    sample_every: float
    rate: float
    spec: str | None = None
    """A simulation spec file (``GPUWARDEN_SIM_SPEC``) instead of the embedded default: a smaller mesh."""


@dataclass
class ObservedDrain:
    drain_id: str
    node: str
    by: str
    requested_at: float
    verdict: str = ""
    verdict_at: float | None = None
    failed_sessions: int = 0
    reason: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def latency_s(self) -> float | None:
        return None if self.verdict_at is None else self.verdict_at - self.requested_at


@dataclass
class Observations:
    started: float = field(default_factory=time.monotonic)
    samples: list[dict[str, Any]] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    drains: dict[str, ObservedDrain] = field(default_factory=dict)
    upgrade_states: dict[str, str] = field(default_factory=dict)
    upgrade_done_at: dict[str, float] = field(default_factory=dict)
    upgrade_started: float | None = None
    simulation: list[dict[str, Any]] = field(default_factory=list)
    verdict_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.monotonic() - self.started


# -- the processes --------------------------------------------------------------------------------------------
def label_of(proc: psutil.Process) -> str | None:
    """``sim``, ``checkpoint``, ``driver@node-1``, ...: what ``gpuwarden run`` calls each child."""
    try:
        cmd = proc.cmdline()
        node = proc.environ().get("GPUWARDEN_NODE", "")
    except (psutil.Error, OSError):
        return None
    if "-m" not in cmd or cmd.index("-m") + 1 >= len(cmd):
        return None
    module = cmd[cmd.index("-m") + 1]
    if module == "shared.sim":
        return "sim"
    if not module.startswith("services."):
        return None
    name = module.removeprefix("services.")
    return f"{name}@{node}" if name in ("driver", "device", "metrics") else name


def processes(run: psutil.Process, servers: dict[str, int]) -> dict[str, psutil.Process]:
    found: dict[str, psutil.Process] = {"cli": run}
    with contextlib.suppress(psutil.Error):
        for child in run.children(recursive=True):
            label = label_of(child)
            if label is not None:
                found[label] = child
    for name, pid in servers.items():
        with contextlib.suppress(psutil.Error):
            found[name] = psutil.Process(pid)
    return found


def sample(obs: Observations, run: psutil.Process, servers: dict[str, int], store: Path | None = None) -> None:
    """RSS of every process; every fifth sample also the checkpoint store's size on disk."""
    rss: dict[str, float] = {}
    for label, proc in processes(run, servers).items():
        try:
            rss[label] = round(proc.memory_info().rss / MB, 1)
        except psutil.Error:
            continue
        if label in obs.pids and obs.pids[label] != proc.pid:
            obs.restarts[label] = obs.restarts.get(label, 0) + 1
        obs.pids[label] = proc.pid
    point: dict[str, Any] = {"t": round(obs.now(), 1), "rss_mb": rss}
    if store is not None and len(obs.samples) % 5 == 0:
        point["store_mb"] = round(_size(store) / MB, 1)
    obs.samples.append(point)


def http_json(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return dict(json.loads(reply.read()))


async def wait_ready(home: Path, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """The run's state file, once every process it lists answers ``/healthz``."""
    deadline = time.monotonic() + timeout
    state_file = home / "run.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpuwarden run exited with {proc.returncode}; see {home / 'logs'}")
        if state_file.exists():
            with contextlib.suppress(ValueError, OSError):
                state = json.loads(state_file.read_text())
                urls = list(state["services"].values())
                answers = await asyncio.gather(*(asyncio.to_thread(_answers, u) for u in urls))
                if all(answers):
                    sim = await asyncio.to_thread(http_json, state["services"]["sim"])
                    if sim.get("simulation", {}).get("pods"):
                        return dict(state)
        await asyncio.sleep(1.0)
    raise TimeoutError(f"gpuwarden run was not ready within {timeout:.0f}s; see {home / 'logs'}")


def _answers(url: str) -> bool:
    try:
        http_json(url, timeout=2.0)
    except (OSError, ValueError):
        return False
    return True


# -- what happens during the run ------------------------------------------------------------------------------
async def watch_events(bus: Bus, obs: Observations) -> None:
    s = bus.subjects

    async def on_requested(event: DrainRequested) -> None:
        if event.drain_id not in obs.drains:
            obs.drains[event.drain_id] = ObservedDrain(event.drain_id, event.node, event.requested_by, obs.now())

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        record = obs.drains.get(event.drain_id)
        if record is None or record.verdict:
            return
        record.verdict_at = obs.now()
        record.verdict = "completed" if isinstance(event, DrainCompleted) else "failed"
        if isinstance(event, DrainFailed):
            record.failed_sessions = len(event.failed_sessions)
            record.reason = event.reason
            record.failures = [f"{f.session_id}@{f.pod}: {f.reason}" for f in event.failed_sessions[:5]]
        obs.verdict_seen.set()

    async def on_state(event: DriverUpgradeStateChanged) -> None:
        obs.upgrade_states[event.node] = event.state
        if event.state == "upgrade-done" and event.installed_version == NEW_DRIVER:
            obs.upgrade_done_at.setdefault(event.node, obs.now())

    await bus.subscribe(s.pattern("node.drain.requested"), on_requested, (DrainRequested,))
    await bus.subscribe(s.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
    await bus.subscribe(s.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
    await bus.subscribe(s.pattern("driver.upgrade.state"), on_state, (DriverUpgradeStateChanged,))


async def drain(bus: Bus, obs: Observations, node: str, index: int) -> None:
    drain_id = f"soak-{index}-{uuid.uuid4().hex[:6]}"
    obs.drains[drain_id] = ObservedDrain(drain_id, node, "bench.soak", obs.now())
    event = DrainRequested(
        node=node, drain_id=drain_id, reason="soak", requested_by="bench.soak", deadline_s=DRAIN_DEADLINE_S
    )
    await bus.publish(event)


def cli(env: dict[str, str], home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args], env=env, cwd=home, capture_output=True, text=True, timeout=60
    )


async def start_upgrade(env: dict[str, str], home: Path, obs: Observations) -> str:
    doc = json.dumps({"desired_version": NEW_DRIVER, "auto_upgrade": True, "max_parallel_upgrades": 1})
    done = await asyncio.to_thread(cli, env, home, "config", "set", "driver", doc)
    obs.upgrade_started = obs.now()
    return (done.stdout + done.stderr).strip()


async def watch_simulation(url: str, obs: Observations, every: float) -> None:
    while True:
        with contextlib.suppress(OSError, ValueError):
            status = (await asyncio.to_thread(http_json, url)).get("simulation", {})
            keep = {k: v for k, v in status.items() if k not in ("pods", "lost_sessions")}
            obs.simulation.append({"t": round(obs.now(), 1), **keep})
        await asyncio.sleep(every)


async def soak(plan: SoakPlan, home: Path, nats_url: str, redis_url: str, servers: dict[str, int]) -> dict[str, Any]:
    env = dict(
        os.environ,
        GPUWARDEN_NATS_URL=nats_url,
        GPUWARDEN_REDIS_URL=redis_url,
        GPUWARDEN_ROOT=ROOT,
        GPUWARDEN_HOME=str(home),
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    for inherited in ("GPUWARDEN_SIM_SPEC", "GPUWARDEN_CHECKPOINT_STORE", "GPUWARDEN_NODE", "GPUWARDEN_HTTP_ADDR"):
        env.pop(inherited, None)  # the embedded default, its store in the temporary folder
    if plan.spec:
        env["GPUWARDEN_SIM_SPEC"] = plan.spec
    proc, log = launch(plan, env, home)
    obs = Observations()
    bus: Bus | None = None
    tasks: list[asyncio.Task[Any]] = []
    upgrade_output = ""
    nodes: list[str] = []
    final: dict[str, Any] = {}
    try:
        state = await wait_ready(home, proc, timeout=180)
        run = psutil.Process(proc.pid)
        bus = await Bus.connect(NatsSettings(servers=(nats_url,)), Subjects(ROOT), "bench-soak")
        await watch_events(bus, obs)
        sim_url = state["services"]["sim"]
        nodes = sorted({label.partition("@")[2] for label in state["services"] if "@" in label})
        obs.started = time.monotonic()
        tasks.append(asyncio.create_task(watch_simulation(sim_url, obs, max(plan.sample_every, 5.0))))
        next_sample, next_drain, drains, upgraded = 0.0, plan.drain_every, 0, False
        while obs.now() < plan.seconds:
            if proc.poll() is not None:
                raise RuntimeError(f"gpuwarden run exited with {proc.returncode} during the soak")
            if obs.now() >= next_sample:
                await asyncio.to_thread(sample, obs, run, servers, home / "checkpoints")
                next_sample += plan.sample_every
            if obs.now() >= next_drain:
                await drain(bus, obs, nodes[drains % len(nodes)], drains)
                drains += 1
                next_drain += plan.drain_every
            if not upgraded and obs.now() >= plan.upgrade_at:
                upgraded = True
                upgrade_output = await start_upgrade(env, home, obs)
            await asyncio.sleep(0.2)
        await asyncio.to_thread(sample, obs, run, servers)
        late = time.monotonic() + DRAIN_DEADLINE_S + 30  # verdicts still owed get their deadline, no more
        while any(not d.verdict for d in obs.drains.values()) and time.monotonic() < late:
            obs.verdict_seen.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(obs.verdict_seen.wait(), late - time.monotonic())
        final = (await asyncio.to_thread(http_json, sim_url)).get("simulation", {})
    finally:
        for task in tasks:
            task.cancel()
        if bus is not None:
            await bus.close(1)
        stop(proc)
        log.close()
    return summarise(plan, obs, final, nodes, upgrade_output, home)


def launch(plan: SoakPlan, env: dict[str, str], home: Path) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """``gpuwarden run`` in ``home``, in a process group of its own, its output in ``home/run.out`` (the caller
    closes it once the run has stopped)."""
    log = open(home / "run.out", "wb")
    argv = [sys.executable, "-m", "shared.cli", "run", "--rate", str(plan.rate), "--seconds", str(plan.seconds + 600)]
    proc = subprocess.Popen(argv, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM as Ctrl-C would (the CLI stops its children), then the whole group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


# -- the figures ----------------------------------------------------------------------------------------------
def slope_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares growth of ``(seconds, MB)`` points, in MB per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / var * 60.0


def summarise(
    plan: SoakPlan,
    obs: Observations,
    final: dict[str, Any],
    nodes: list[str],
    upgrade_output: str,
    home: Path,
) -> dict[str, Any]:
    labels = sorted({label for s in obs.samples for label in s["rss_mb"]})
    series = {label: [(s["t"], s["rss_mb"][label]) for s in obs.samples if label in s["rss_mb"]] for label in labels}
    sim = series.get("sim", [])
    first_half = [(t, v) for t, v in sim if t < plan.seconds / 2]
    second_half = [(t, v) for t, v in sim if t >= plan.seconds / 2]
    totals = [sum(s["rss_mb"].values()) for s in obs.samples]
    drains = list(obs.drains.values())
    latencies = [d.latency_s for d in drains if d.latency_s is not None]
    ours = [d for d in drains if d.by == "bench.soak"]
    results: dict[str, Any] = {
        "seconds": round(obs.now(), 1),
        "samples": len(obs.samples),
        "sim_rss_start_mb": sim[0][1] if sim else None,
        "sim_rss_end_mb": sim[-1][1] if sim else None,
        "sim_rss_max_mb": max((v for _, v in sim), default=None),
        "sim_rss_growth_mb_per_min": _round(slope_per_min(second_half)),
        "sim_rss_growth_whole_run_mb_per_min": _round(slope_per_min(sim)),
        "sim_rss_high_water_rise_mb": (
            round(max(v for _, v in second_half) - max(v for _, v in first_half), 1)
            if first_half and second_half
            else None
        ),
        "all_rss_max_mb": round(max(totals, default=0.0), 1),
        "lost_sessions": final.get("lost"),
        "requests": final.get("requests"),
        "served": final.get("served"),
        "sessions_started_fresh": final.get("started_fresh"),
        "sessions_restored": final.get("restored"),
        "sessions_recomputed": final.get("recomputed"),
        "preemptions": final.get("preemptions"),
        "sessions_ended": final.get("ended"),
        "sessions_ended_at_max_len": final.get("ended_at_max_len"),
        "sessions_expired": final.get("expired"),
        "prestop_saves": final.get("prestop_saves"),
        "restores_verified": final.get("restore_checks", {}).get("verified"),
        "restores_check_failed": final.get("restore_checks", {}).get("failed"),
        "restores_unchecked": final.get("restore_checks", {}).get("unchecked"),
        "engines": final.get("engines", {}),
        "drains": len(drains),
        "drains_asked_here": len(ours),
        "drains_asked_by_driver": sum(1 for d in drains if d.by != "bench.soak"),
        "drains_completed": sum(1 for d in drains if d.verdict == "completed"),
        "drains_failed": sum(1 for d in drains if d.verdict == "failed"),
        "drains_without_verdict": sum(1 for d in drains if not d.verdict),
        **{k.replace("_ms", "_s"): round(v / 1000.0, 3) for k, v in latency_summary(latencies, "verdict").items()},
        "upgrade_nodes_done": len(obs.upgrade_done_at),
        "upgrade_seconds": (
            round(max(obs.upgrade_done_at.values()) - obs.upgrade_started, 1)
            if obs.upgrade_started is not None and len(obs.upgrade_done_at) == len(nodes) and nodes
            else None
        ),
        "process_restarts": sum(obs.restarts.values()),
        "checkpoint_store_mb": round(_size(home / "checkpoints") / MB, 1),
        "checkpoint_store_max_mb": max((p["store_mb"] for p in obs.samples if "store_mb" in p), default=None),
        "checkpoint_store_second_half_max_mb": max(
            (p["store_mb"] for p in obs.samples if "store_mb" in p and p["t"] >= plan.seconds / 2), default=None
        ),
        "rss_max_mb": {label: max(v for _, v in points) for label, points in series.items()},
        "rss_growth_mb_per_min": {
            label: _round(slope_per_min([(t, v) for t, v in points if t >= plan.seconds / 2]))
            for label, points in series.items()
        },
        "lost_session_ids": final.get("lost_sessions", []),
        "sim_tracked_end": final.get("tracked", {}),
        "sim_pods_end": final.get("pods", {}),
        "upgrade_states": obs.upgrade_states,
        "upgrade_command": upgrade_output,
        "restarts": obs.restarts,
        "drain_records": [
            {
                "drain_id": d.drain_id,
                "node": d.node,
                "by": d.by,
                "requested_at_s": round(d.requested_at, 1),
                "verdict": d.verdict or None,
                "latency_s": _round(d.latency_s),
                "failed_sessions": d.failed_sessions,
                "reason": d.reason,
                "failures": d.failures,
            }
            for d in sorted(drains, key=lambda d: d.requested_at)
        ],
        "simulation_timeline": obs.simulation,
        "rss_timeline": obs.samples,
    }
    return results


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _size(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


TARGETS = [
    Target("sim_rss_high_water_rise_mb", "<=", 64.0, "the simulation's peak memory does not rise in the second half"),
    Target("lost_sessions", "<=", 0, "no session lost"),
    Target("drains_without_verdict", "<=", 0, "every drain gets a verdict"),
    Target("restores_check_failed", "<=", 0, "every restored session continues as its reference run does"),
]


def parse(argv: Sequence[str] | None) -> tuple[BenchOptions, SoakPlan, bool]:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 60 s smoke run (drains every 15 s)")
    parser.add_argument("--seconds", type=float, default=None, help="how long the soak runs (default 600; 60 quick)")
    parser.add_argument("--drain-every", type=float, default=None, help="seconds between drains (default run/10)")
    parser.add_argument("--upgrade-at", type=float, default=None, help="when the driver upgrade starts (default run/5)")
    parser.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--rate", type=float, default=2.0, help="simulated requests per second (gpuwarden run --rate)")
    parser.add_argument("--spec", default=None, help="a simulation spec file instead of the embedded default")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, checkpoints)")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes (default bench/results/soak.json)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)
    seconds = args.seconds or (60.0 if args.quick else 600.0)
    for name in ("seconds", "drain_every", "upgrade_at", "sample_every", "rate"):
        value = seconds if name == "seconds" else getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    plan = SoakPlan(
        seconds=seconds,
        drain_every=args.drain_every or max(10.0, seconds / 10),
        upgrade_at=args.upgrade_at if args.upgrade_at is not None else seconds / 5,
        sample_every=args.sample_every,
        rate=args.rate,
        spec=str(Path(args.spec).resolve()) if args.spec else None,
    )
    out = args.out or (Path(__file__).resolve().parent / "results" / "soak.json")
    return BenchOptions("soak", args.quick, None, out, args.strict), plan, args.keep


def main(argv: Sequence[str] | None = None) -> int:
    options, plan, keep = parse(argv)
    home = Path(tempfile.mkdtemp(prefix="gw-soak-"))
    nats, redis = NatsServer().start(), RedisServer().start()
    try:
        servers = {
            "nats-server": nats.proc.pid if nats.proc else 0,
            "redis-server": redis.proc.pid if redis.proc else 0,
        }
        print(f"soak: {plan.seconds:.0f}s of gpuwarden run in {home} (NATS {nats.url}, Redis {redis.url})", flush=True)
        results = asyncio.run(soak(plan, home, nats.url, redis.url, servers))
    finally:
        nats.cleanup()
        redis.cleanup()
        if not keep:
            shutil.rmtree(home, ignore_errors=True)
    params = {
        "seconds": plan.seconds,
        "drain_every_s": plan.drain_every,
        "upgrade_at_s": plan.upgrade_at,
        "sample_every_s": plan.sample_every,
        "rate": plan.rate,
        "spec": plan.spec or "embedded default",
        "new_driver": NEW_DRIVER,
        "home": str(home) if keep else None,
    }
    report = finish(options, results, TARGETS, params, machine_info())
    return 1 if options.strict and not report["targets_passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
