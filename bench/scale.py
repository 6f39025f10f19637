"""``python -m bench.scale``: the mesh at fleet scale. One function per figure (``FIGURES``; ``--only NAME`` runs
one), all writing into one JSON document, ``bench/results/scale.json``.

``fleet`` starts ``gpuwarden up --detach --nodes N --gpus-per-node G --hollow --rate 0`` (``deploy/sim/fleet.yaml``'s
deployments on N simulated nodes, default 1,000 x 8 GPUs) in a temporary ``GPUWARDEN_HOME`` with its own NATS and
Redis, so a ``make run`` already running is never touched. It measures

- ``up_s``: from the command to every process answering ``/readyz`` and every hollow node ``ok``;
- ``rss_mb_max``: the most the mesh held in resident memory at once, every process summed (the CLI's run, each
  service, the simulation, NATS and Redis), sampled every ``--sample-every`` seconds over the whole run; the peak of
  each process in ``rss_mb_by_process``;
- ``idle_cpu_cores``: the CPU each process used with no traffic at all, in cores, over ``--idle-seconds`` once the
  fleet has settled (``idle_cpu_cores_total`` for the mesh);
- ``fleet_drain_verdict_s``: a drain of the node whose pods hold the most sessions, from ``node.drain.requested`` to
  its verdict, after ``--sessions`` conversations were started (``fleet_drain_sessions`` were on that node;
  ``fleet_lost_sessions``: what the simulation lost, none expected).

``per_node`` runs the same services one process per service and node (``--no-hollow``, as a real cluster and
``make run`` run them) at 10 nodes: what each of those processes holds and uses idle (``per_node_agent_rss_mb``,
``per_node_agent_idle_cpu_cores``), the cost hollow nodes avoid.

The same run then holds ``--fleet-sessions`` sessions (``bench.scale_sessions``: restores, periodic checkpoints,
status, Redis calls per session) on pods of the fleet's simulated cluster, and upgrades every node's driver with
them, ``--upgrade-parallel`` of the nodes at once (a tenth; ``bench.scale_upgrade``): ``fleet_upgrade_s``,
``fleet_upgrade_verdicts`` (= ``fleet_upgrade_drains``, one a node), ``fleet_upgrade_lost``, the CPU each process
spent on it; the fault suite's checker then reads back every checkpoint the registry records.

The commands as a user runs them, each a ``gpuwarden`` process timed from its start (its interpreter's start and
imports included) against the same fleet: ``status_cli_s_small`` and ``status_cli_s_large`` (``gpuwarden status
--json``, the fastest of 3, beside ``status_s_small`` / ``status_s_large`` at the same moments) and
``drain_cli_request_s`` (``gpuwarden drain NODE``, from the start of the process to its ``node.drain.requested``
in the events stream, once the upgrade is done; the command then runs to its end).

``--quick`` runs the same at a few nodes (a smoke run; the fleet targets are missed by design), the coordinator
passing every 2 s instead of its default 10.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.common import BenchOptions, Target, default_out, finish, machine_info
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import NatsSettings

REPO = Path(__file__).resolve().parent.parent
FLEET_SPEC = REPO / "deploy" / "sim" / "fleet.yaml"
MB = 1e6


@dataclass(frozen=True)
class ScaleOptions:
    nodes: int = 1000
    gpus_per_node: int = 8
    idle_s: float = 60.0
    settle_s: float = 20.0
    sessions: int = 32
    sample_every: float = 2.0
    up_timeout_s: float = 900.0
    per_node_nodes: int = 10
    fleet_sessions: int = 100_000
    """Sessions held in the fleet for the session figures (``bench.scale_sessions``), 50 a pod; 0: none."""
    fleet_grace_s: float = 120.0
    """The fleet pods' grace period (their preStop's time before the cluster kills them)."""
    periodic_interval_s: float = 60.0
    periodic_rounds: int = 3
    extra_replicas: int = 2
    """Checkpoint service replicas joining the one the fleet runs."""
    upgrade_parallel: float = 0.1
    """The rolling driver upgrade of every node with the fleet's sessions: this fraction of the nodes at once
    (``max_parallel_upgrades``, at least one); 0: no upgrade."""
    driver_reconcile_s: float | None = None
    """The coordinator's pass interval (``GPUWARDEN_DRIVER_RECONCILE_S``); None: the service's default."""


QUICK = ScaleOptions(
    nodes=6,
    idle_s=5.0,
    settle_s=3.0,
    sessions=8,
    sample_every=1.0,
    up_timeout_s=180.0,
    per_node_nodes=2,
    fleet_sessions=200,
    periodic_interval_s=2.0,
    periodic_rounds=2,
    extra_replicas=1,
    driver_reconcile_s=2.0,
)


# -- a mesh of its own --------------------------------------------------------------------------------------------
def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


@dataclass
class Mesh:
    """A ``gpuwarden up --detach`` run in a temporary home of its own, and how to read it."""

    home: Path
    env: dict[str, str]
    state: dict[str, Any] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    total_peak: float = 0.0

    def processes(self) -> dict[str, psutil.Process]:
        found: dict[str, psutil.Process] = {}
        for label, pid in {"run": self.state.get("pid", 0), **self.state.get("pids", {})}.items():
            with contextlib.suppress(psutil.Error, ValueError):
                found[label] = psutil.Process(int(pid))
        return found

    def sample_rss(self) -> float:
        """The mesh's resident memory now (MB, every process summed); keeps each process's peak and the total's."""
        total = 0.0
        for label, proc in self.processes().items():
            with contextlib.suppress(psutil.Error):
                rss = proc.memory_info().rss / MB
                total += rss
                self.peaks[label] = max(self.peaks.get(label, 0.0), rss)
        self.total_peak = max(self.total_peak, total)
        return total

    async def sample_until(self, stop: asyncio.Event, every: float) -> None:
        while not stop.is_set():
            self.sample_rss()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shared.cli", *args],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def hollow_urls(self) -> dict[str, str]:
        return {label: url for label, url in self.state.get("services", {}).items() if label.endswith("@hollow")}

    def nodes_ok(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for label, url in self.hollow_urls().items():
            with contextlib.suppress(OSError, ValueError):
                found[label] = int(http_json(url).get("nodes_ok", 0))
        return found

    def bus_settings(self) -> NatsSettings:
        return NatsSettings(servers=(self.state["nats_url"],))


@contextlib.asynccontextmanager
async def started_mesh(
    nodes: int,
    gpus_per_node: int,
    *,
    hollow: bool = True,
    timeout: float = 900.0,
    settings: Mapping[str, str] | None = None,
) -> AsyncIterator[tuple[Mesh, float]]:
    """A fleet of ``nodes`` simulated nodes up (and every hollow node ok), with the seconds that took; stopped and
    removed after the block. ``settings``: more ``GPUWARDEN_*`` variables for every process of the mesh."""
    home = Path(tempfile.mkdtemp(prefix="gw-scale-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env.update(
        GPUWARDEN_HOME=str(home),
        GPUWARDEN_ROOT="scale",
        GPUWARDEN_SIM_SPEC=str(FLEET_SPEC),
        PYTHONPATH=str(REPO),
        **(settings or {}),
    )
    mesh = Mesh(home, env)
    began = time.monotonic()
    try:
        args = ["up", "--detach", "--nodes", str(nodes), "--gpus-per-node", str(gpus_per_node), "--rate", "0"]
        args += ["--ready-timeout", str(timeout), "--hollow" if hollow else "--no-hollow"]
        done = await asyncio.to_thread(mesh.cli, *args, timeout=timeout + 60)
        if done.returncode != 0:
            raise RuntimeError(f"gpuwarden up failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        mesh.state = json.loads((home / "run.json").read_text())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mesh.sample_rss()
            counts = await asyncio.to_thread(mesh.nodes_ok)
            if not hollow or (counts and all(n == nodes for n in counts.values())):
                break
            await asyncio.sleep(0.5)
        else:
            raise TimeoutError(f"hollow nodes not all ok within {timeout:g}s: {mesh.nodes_ok()}")
        yield mesh, time.monotonic() - began
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(mesh.cli, "down", timeout=120)
        shutil.rmtree(home, ignore_errors=True)


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    found: dict[str, float] = {}
    for label, proc in procs.items():
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            found[label] = times.user + times.system
    return found


# -- the figures --------------------------------------------------------------------------------------------------
Figure = Callable[[ScaleOptions], Awaitable[dict[str, Any]]]
FIGURES: dict[str, Figure] = {}
"""Every figure this benchmark can take, by name (``--only NAME``); each returns its keys of the JSON document."""


def figure(name: str) -> Callable[[Figure], Figure]:
    def register(fn: Figure) -> Figure:
        FIGURES[name] = fn
        return fn

    return register


async def idle_cores(mesh: Mesh, options: ScaleOptions) -> dict[str, float]:
    """Cores each of the mesh's processes used, idle, over ``idle_s`` once it has settled for ``settle_s``."""
    await asyncio.sleep(options.settle_s)
    procs = mesh.processes()
    before = cpu_seconds(procs)
    started = time.monotonic()
    await asyncio.sleep(options.idle_s)
    after = cpu_seconds(procs)
    spent = time.monotonic() - started
    return {label: (after[label] - before[label]) / spent for label in before if label in after}


@figure("fleet")
async def fleet(options: ScaleOptions) -> dict[str, Any]:
    """Nodes, GPUs, time to come up, memory, idle CPU per process, and one node's drain in the fleet."""
    settings = {}
    if options.driver_reconcile_s is not None:
        settings["GPUWARDEN_DRIVER_RECONCILE_S"] = f"{options.driver_reconcile_s:g}"
    async with started_mesh(options.nodes, options.gpus_per_node, timeout=options.up_timeout_s, settings=settings) as (
        mesh,
        up_s,
    ):
        stop = asyncio.Event()
        sampler = asyncio.create_task(mesh.sample_until(stop, options.sample_every))
        try:
            idle = {label: round(cores, 4) for label, cores in (await idle_cores(mesh, options)).items()}
            drain = await drain_busiest_node(mesh, options.sessions)
            sessions = await fleet_sessions(mesh, options) if options.fleet_sessions else {}
        finally:
            stop.set()
            await sampler
        hosts = {label: http_json(url) for label, url in mesh.hollow_urls().items()}
    return {
        "fleet_nodes": options.nodes,
        "fleet_gpus": options.nodes * options.gpus_per_node,
        "fleet_hollow": True,
        "fleet_processes": len(mesh.peaks),
        "up_s": round(up_s, 2),
        "hollow_start_s": {label: h.get("started_s") for label, h in hosts.items()},
        "rss_mb_max": round(mesh.total_peak, 1),
        "rss_mb_by_process": {label: round(mb, 1) for label, mb in sorted(mesh.peaks.items())},
        "idle_cpu_cores": dict(sorted(idle.items())),
        "idle_cpu_cores_total": round(sum(idle.values()), 4),
        "idle_cpu_cores_max_process": round(max(idle.values(), default=0.0), 4),
        **drain,
        **sessions,
    }


async def fleet_sessions(mesh: Mesh, options: ScaleOptions) -> dict[str, Any]:
    """The session figures (``bench.scale_sessions``) in the same run: pods on the fleet's nodes holding
    ``fleet_sessions`` sessions, saved to the fleet's store and recorded by its checkpoint service, which
    ``extra_replicas`` more replicas join."""
    from bench import scale_sessions

    lost_before = await simulation_lost(mesh)
    out = await scale_sessions.run(
        mesh.state["nats_url"],
        mesh.state["redis_url"],
        quick=options is QUICK or options.fleet_sessions < 1000,
        sessions=options.fleet_sessions,
        nodes=options.nodes,
        replicas=options.extra_replicas,
        interval_s=options.periodic_interval_s,
        rounds=options.periodic_rounds,
        root=mesh.env["GPUWARDEN_ROOT"],
        store=mesh.home / "checkpoints",
        node_names=[f"node-{i + 1}" for i in range(options.nodes)],
        replicas_running=1,
        on_cluster=True,
        upgrade_parallel=options.upgrade_parallel,
        upgrade_timeout_s=max(900.0, 4.0 * options.nodes),  # 438 s at 300 nodes, a busy machine
        grace_s=options.fleet_grace_s,
        cpu=lambda: cpu_seconds({**mesh.processes(), "bench": psutil.Process()}),  # the bench hosts the pods
        status_cli=lambda: status_cli_s(mesh),
        drain_cli=lambda node: drain_cli_request_s(mesh, node),
    )
    if "fleet_upgrade_lost" in out:  # the simulation's own pods (the spec's deployment) were upgraded too
        out["fleet_upgrade_sim_lost"] = await simulation_lost(mesh) - lost_before
        out["fleet_upgrade_lost"] += out["fleet_upgrade_sim_lost"]
    return out


async def status_cli_s(mesh: Mesh) -> float:
    """``gpuwarden status --json`` as a user runs it: a new process, from its start to its end (wall clock), its
    interpreter's start and imports included. Raises when it fails or prints no JSON document."""
    started = time.monotonic()
    done = await asyncio.to_thread(mesh.cli, "status", "--json", timeout=300)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"gpuwarden status failed: {done.stderr[-2000:]}")
    json.loads(done.stdout)
    return took


async def drain_cli_request_s(mesh: Mesh, node: str) -> tuple[float, str]:
    """``gpuwarden drain NODE`` as a user runs it: the seconds from starting the process to its
    ``node.drain.requested`` being published into the events stream (heard on the bus as the stream stores it),
    and the drain's id; the command is then followed to its end (the save, the evictions)."""
    subjects = Subjects(mesh.env["GPUWARDEN_ROOT"])
    bus = await Bus.connect(mesh.bus_settings(), subjects, "bench.scale-drain")
    asked: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def on_request(event: DrainRequested) -> None:
        if event.drain_id.startswith(f"drain-{node}-") and not asked.done():
            asked.set_result(time.monotonic())

    try:
        await bus.subscribe(subjects.pattern("node.drain.requested", node=node), on_request, (DrainRequested,))
        started = time.monotonic()
        done = await asyncio.to_thread(mesh.cli, "drain", node, "--json", timeout=600)
        if done.returncode != 0 or not asked.done():
            raise RuntimeError(f"gpuwarden drain {node} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return asked.result() - started, str(json.loads(done.stdout)["drain_id"])
    finally:
        await bus.close(1)


async def simulation_lost(mesh: Mesh) -> int:
    """Sessions the simulation's own pods lost so far (``/healthz`` of ``sim``)."""
    sim = (await asyncio.to_thread(http_json, mesh.state["services"]["sim"])).get("simulation", {})
    return int(sim["lost"])


@figure("per_node")
async def per_node(options: ScaleOptions) -> dict[str, Any]:
    """The same services as one process per service and node (``--no-hollow``: how a real cluster runs them, and
    how ``make run`` runs its 3 nodes), at ``per_node_nodes`` nodes: what a node costs that way, for comparison."""
    nodes = options.per_node_nodes
    async with started_mesh(nodes, options.gpus_per_node, hollow=False, timeout=options.up_timeout_s) as (mesh, up_s):
        idle = await idle_cores(mesh, options)
        mesh.sample_rss()
    agents = [label for label in idle if "@" in label]
    return {
        "per_node_nodes": nodes,
        "per_node_processes": len(mesh.peaks),
        "per_node_up_s": round(up_s, 2),
        "per_node_rss_mb_max": round(mesh.total_peak, 1),
        "per_node_idle_cpu_cores_total": round(sum(idle.values()), 4),
        "per_node_agent_rss_mb": round(sum(mesh.peaks[a] for a in agents) / max(len(agents), 1), 1),
        "per_node_agent_idle_cpu_cores": round(sum(idle[a] for a in agents) / max(len(agents), 1), 4),
    }


async def drain_busiest_node(mesh: Mesh, sessions: int) -> dict[str, Any]:
    """Start ``sessions`` conversations, then drain the node whose pods hold the most: request -> verdict."""
    subjects = Subjects(mesh.env["GPUWARDEN_ROOT"])
    bus = await Bus.connect(mesh.bus_settings(), subjects, "bench.scale")
    sim_url = mesh.state["services"]["sim"]
    verdicts: dict[str, tuple[float, DrainCompleted | DrainFailed]] = {}
    heard = asyncio.Event()

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        verdicts[event.drain_id] = (time.monotonic(), event)
        heard.set()

    try:
        await bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
        await bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
        for i in range(sessions):
            await bus.publish(
                InferenceRequest(namespace="llm", deployment="llama", session_id=f"scale-{i}", prompt_tokens=64)
            )
        deadline = time.monotonic() + 120
        pods: dict[str, Any] = {}
        while time.monotonic() < deadline:
            sim = (await asyncio.to_thread(http_json, sim_url)).get("simulation", {})
            pods = sim.get("pods", {})
            if sim.get("served", 0) >= sessions and sum(p["sessions"] for p in pods.values()) >= sessions:
                break
            await asyncio.sleep(0.5)
        by_node: dict[str, int] = {}
        for pod in pods.values():
            by_node[pod["node"]] = by_node.get(pod["node"], 0) + int(pod["sessions"])
        node = max(by_node, key=lambda n: by_node[n])
        await asyncio.sleep(3.0)  # the pods' agents announce their sessions every second or so
        drain_id = f"scale-{uuid.uuid4().hex[:8]}"
        asked = time.monotonic()
        await bus.publish(
            DrainRequested(node=node, drain_id=drain_id, reason="bench", requested_by="bench.scale", deadline_s=25)
        )
        while drain_id not in verdicts and time.monotonic() - asked < 120:
            heard.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(heard.wait(), 1.0)
        if drain_id not in verdicts:
            return {"fleet_drain_node": node, "fleet_drain_sessions": by_node[node], "fleet_drain_verdict": "none"}
        at, verdict = verdicts[drain_id]
        sim = (await asyncio.to_thread(http_json, sim_url)).get("simulation", {})
        return {
            "fleet_lost_sessions": int(sim.get("lost", -1)),
            "fleet_drain_node": node,
            "fleet_drain_sessions": by_node[node],
            "fleet_drain_verdict": "completed" if isinstance(verdict, DrainCompleted) else "failed",
            "fleet_drain_committed": verdict.sessions_committed if isinstance(verdict, DrainCompleted) else 0,
            "fleet_drain_verdict_s": round(at - asked, 3),
        }
    finally:
        await bus.close(1)


# -- the run ------------------------------------------------------------------------------------------------------
TARGETS = (
    Target("fleet_nodes", ">=", 1000, "simulated nodes in one run (hollow nodes), 8 GPUs each"),
    Target("idle_cpu_cores_total", "<=", 1.0, "the whole idle fleet uses at most half of this 2-core machine"),
    Target("rss_mb_max", "<=", 12_000, "the whole fleet fits in half of this 24 GiB machine"),
    Target("fleet_drain_verdict_s", "<=", 10.0, "a node's drain in the fleet answers within seconds"),
    Target("fleet_sessions", ">=", 100_000, "sessions held in the same run"),
    Target("lost_sessions", "<=", 0, "no session lost"),
    Target("checker_problems", "<=", 0, "the fault suite's invariant checker finds nothing after the run"),
    Target("restore_growth_5000_vs_1000", "<=", 6.0, "restoring 5x the sessions on one pod takes at most 6x"),
    Target("idle_redis_calls_per_session_s", "<=", 0.05, "idle registry load per held session"),
    Target("periodic_gaps_off", "<=", 0, "every pod's periodic saves kept their interval within 10%"),
    Target("status_ratio_large_vs_small", "<=", 2.0, "status at 100,000 sessions at most twice status at 1,000"),
    Target("status_cli_s_large", "<=", 1.0, "`gpuwarden status --json` at the fleet's size, its process included"),
    Target("drain_cli_request_s", "<=", 1.0, "`gpuwarden drain` publishes its request within a second"),
    Target("fleet_upgrade_nodes_missing", "<=", 0, "a rolling driver upgrade of every node, 10% at once, all done"),
    Target("fleet_upgrade_verdicts_missing", "<=", 0, "every drain the upgrade asked for got its verdict"),
    Target("fleet_upgrade_lost", "<=", 0, "no session lost by the upgrade"),
)


async def run(options: ScaleOptions, names: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    results: dict[str, Any] = {}
    params: dict[str, Any] = {"figures": list(names), "sizes": options.__dict__}
    for name in names:
        began = time.monotonic()
        results.update(await FIGURES[name](options))
        params[f"{name}_s"] = round(time.monotonic() - began, 1)
    return results, params


def parse(argv: Sequence[str] | None) -> tuple[BenchOptions, ScaleOptions, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK.nodes} nodes, short windows")
    parser.add_argument("--only", action="append", choices=sorted(FIGURES), help="this figure only (repeatable)")
    parser.add_argument("--nodes", type=int, default=None, help="simulated nodes (default 1000; quick: 6)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs of each node (default 8)")
    parser.add_argument("--idle-seconds", type=float, default=None, help="the idle CPU window (default 60)")
    parser.add_argument("--sessions", type=int, default=None, help="conversations before the drain (default 32)")
    parser.add_argument(
        "--fleet-sessions", type=int, default=None, help="sessions held in the fleet (default 100000; 0: none)"
    )
    parser.add_argument("--periodic-interval", type=float, default=None, help="seconds (default 60; quick: 2)")
    parser.add_argument(
        "--fleet-grace", type=float, default=None, help="the fleet pods' grace period, seconds (default 120)"
    )
    parser.add_argument(
        "--upgrade-parallel",
        type=float,
        default=None,
        help="the driver upgrade of every node: this fraction of them at once (default 0.1; 0: no upgrade)",
    )
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes (default bench/results/scale.json)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else ScaleOptions()
    sizes = ScaleOptions(
        nodes=args.nodes or base.nodes,
        gpus_per_node=args.gpus_per_node or base.gpus_per_node,
        idle_s=args.idle_seconds if args.idle_seconds is not None else base.idle_s,
        settle_s=base.settle_s,
        sessions=args.sessions if args.sessions is not None else base.sessions,
        sample_every=base.sample_every,
        up_timeout_s=base.up_timeout_s,
        per_node_nodes=base.per_node_nodes,
        fleet_sessions=args.fleet_sessions if args.fleet_sessions is not None else base.fleet_sessions,
        fleet_grace_s=args.fleet_grace if args.fleet_grace is not None else base.fleet_grace_s,
        periodic_interval_s=args.periodic_interval or base.periodic_interval_s,
        periodic_rounds=base.periodic_rounds,
        extra_replicas=base.extra_replicas,
        upgrade_parallel=args.upgrade_parallel if args.upgrade_parallel is not None else base.upgrade_parallel,
        driver_reconcile_s=base.driver_reconcile_s,
    )
    out = args.out or default_out("scale")
    return BenchOptions("scale", args.quick, None, out, args.strict), sizes, list(args.only or FIGURES)


def main(argv: Sequence[str] | None = None) -> int:
    bench, sizes, names = parse(argv)
    results, params = asyncio.run(run(sizes, names))
    report = finish(bench, results, TARGETS, params, machine_info())
    return 1 if bench.strict and not report["targets_passed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
