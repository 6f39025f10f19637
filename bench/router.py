"""The endpoint picker's pick latency, as the gateway sees it: Envoy ext_proc over real gRPC to a router in its own
process, against a no-op ext_proc server in the same process model.

``python -m bench.router [--quick] [--out PATH] [--strict]`` writes ``bench/results/router.json``.

Besides (``measure_moves``), a drain under load through the whole mesh: ``gpuwarden run`` with the router in front
of its pool, ``MoveSizes.sessions`` open conversations per deployment, the node whose pool pods hold the most
sessions drained with ``gpuwarden drain``; the figures are what changed across it, as the simulation and the router
count them: ``sessions_moved`` (the pool's sessions on the node when it was drained), ``prefetched`` (restored on
their next pod by the router's prefetch), ``requests_to_non_holder`` (the simulated gateway: a request of a live
session sent to a pod that does not hold it), ``cold_restores_on_request`` (requests of a known session with no
live holder, so restored or recomputed on the pod they reached: moved sessions not prefetched, and preempted
ones), ``sessions_recomputed``, ``sessions_lost``, the handovers waited for, and the time to first token of the
moved sessions' first requests on their new pod against every other request's (``moved_first_token_vs_unmoved_p50``,
from the simulation's buckets). The full run (``MoveSizes()``) is the issue's size: 3,000 conversations on the three
pods of ``deploy/sim/routing.yaml``, a node holding about 1,000 drained; then the same with the prefetch off (the
peer, ``without_prefetch``) and a scale-in of the pool from 4 to 2 pods (``SCALE_IN``, figures ``scale_in_*``).

The router (``services/router``: its ``ExternalProcessorServicer`` and ``RouterServer``, what ``python -m
services.router`` serves, without the bus around it) runs in a child process, its memory set as the bus and the
cluster would set it: ``pods`` serving pods of the pool (IPs, UIDs, a KV load report each) and ``sessions``
sessions, each held by one of them (a ``kv.session.location`` each, fed to the picker as the router's subscription
feeds it). The no-op server is the same grpc.aio server in a child process of its own, whose servicer answers
every request's headers with one fixed ``x-gateway-destination-endpoint`` (same header mutation, same metadata):
what is left of the router's figure once the no-op's is taken out is the router's own work (reading the request,
the pick over 2,000 pods, the answer).

The gateway is ``shared.sim.gateway.GatewayClient``, the simulation's own: one ``Process`` stream per request
(the request headers with the session header, ``end_of_stream``), the first answer read. Requests are sent open
loop at ``rate`` per second for ``seconds``, each for a session drawn at random; a request's latency runs from
its scheduled start (a client that falls behind counts its lateness), so ``router_pick_p99_ms`` and
``noop_pick_p99_ms`` are what a gateway waits per request at that rate. Each answer is checked: the router's
first endpoint must be the session's holder (``router_not_holder`` counts those that are not: 0 expected).

What this does not measure: the read-back of locations at start (docs/routing.md: about 9 s for 100,000 sessions)
and events arriving while it picks (one small dict update each).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.common import (
    BenchOptions,
    Target,
    build_report,
    default_out,
    exit_code,
    finish,
    latency_summary,
    machine_info,
    parse_args,
    write_report,
)
from services.router.config import RouterSettings
from services.router.extproc import ExternalProcessorServicer, RouterServer
from services.router.picker import EndpointPicker, Outcome, Pick
from shared.contract.load import PodLoad
from shared.contract.sessions import SessionLocation
from shared.plumbing.settings import HostPort
from shared.ports.cluster import PodInfo
from shared.sim.gateway import GatewayClient

NAMESPACE, DEPLOYMENT = "llm", "llama"
TARGET_PORT = 8000
ROUTING_SPEC = str(Path(__file__).resolve().parents[1] / "deploy" / "sim" / "routing.yaml")


@dataclass(frozen=True)
class Sizes:
    pods: int = 2_000
    sessions: int = 100_000
    rate: float = 1_000.0
    seconds: float = 10.0
    warmup_s: float = 1.0


QUICK = Sizes(pods=20, sessions=1_000, rate=200.0, seconds=1.0, warmup_s=0.2)


def pod_ip(index: int) -> str:
    return f"10.{(index >> 16) & 0xFF}.{(index >> 8) & 0xFF}.{index & 0xFF}"


def holder_of(session: int, pods: int) -> int:
    return (session * 7919) % pods + 1


def _build_picker(sizes: Sizes) -> EndpointPicker:
    picker = EndpointPicker(NAMESPACE, DEPLOYMENT, target_port=TARGET_PORT, max_sessions=max(sizes.sessions, 1))
    picker.set_pods(
        PodInfo(
            name=f"{DEPLOYMENT}-{i}",
            namespace=NAMESPACE,
            node=f"node-{i}",
            deployment=DEPLOYMENT,
            phase="Running",
            uid=f"uid-{i}",
            ip=pod_ip(i),
        )
        for i in range(1, sizes.pods + 1)
    )
    rng = random.Random(7)
    now = time.time()
    for i in range(1, sizes.pods + 1):
        load = PodLoad(
            pod=f"{DEPLOYMENT}-{i}",
            namespace=NAMESPACE,
            deployment=DEPLOYMENT,
            blocks_used=rng.randrange(0, 900),
            blocks_total=1000,
            window_s=5,
        )
        picker.on_load(load, now)
    for s in range(sizes.sessions):
        picker.on_location(
            SessionLocation(
                session_id=f"chat-{s}",
                sequence=1,
                reason="placed",
                held=True,
                pod=f"{DEPLOYMENT}-{holder_of(s, sizes.pods)}",
                namespace=NAMESPACE,
                deployment=DEPLOYMENT,
            )
        )
    return picker


class NoopServicer(ExternalProcessorServicer):
    """An ext_proc servicer that answers every request with one fixed endpoint: the router's own stream handling
    and answer (header mutation, metadata), without reading the request or picking."""

    def __init__(self, settings: RouterSettings) -> None:
        super().__init__(EndpointPicker(NAMESPACE, DEPLOYMENT), settings)
        self.fixed = Pick(Outcome.HOLDER, (f"{pod_ip(1)}:{TARGET_PORT}",))

    async def _pick(self, exchange: Any, with_body: bool) -> tuple[Pick, bool]:
        exchange.picked = True
        return self.fixed, False


def serve(kind: str, sizes: Sizes, conn: Connection) -> None:
    """The child process: the router (``kind`` "router") or the no-op server, until told to stop."""
    logging.basicConfig(level=logging.WARNING)

    async def main() -> None:
        settings = RouterSettings(listen=HostPort("127.0.0.1", 0), pool=f"{NAMESPACE}/{DEPLOYMENT}")
        picker = _build_picker(sizes) if kind == "router" else None
        servicer = ExternalProcessorServicer(picker, settings) if picker is not None else NoopServicer(settings)
        server = RouterServer(servicer, settings)
        port = await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(grace=0.5)
        conn.send(dict(picker.picks) if picker is not None else {})

    asyncio.run(main())


async def drive(port: int, sizes: Sizes, check: bool) -> tuple[list[float], int, int]:
    """Open-loop requests at ``sizes.rate`` for ``sizes.seconds`` (after a warm-up); returns the latencies (s),
    the answers whose first endpoint was not the session's holder, and the requests that got no endpoint."""
    client = GatewayClient([HostPort("127.0.0.1", port)], timeout_s=5.0)
    rng = random.Random(11)
    latencies: list[float] = []
    wrong = failed = 0

    async def one(scheduled: float, session: int, measured: bool) -> None:
        nonlocal wrong, failed
        answer = await client.ask(f"chat-{session}")
        elapsed = time.perf_counter() - scheduled
        if answer is None or answer.status != 200:
            failed += 1
            return
        if measured:
            latencies.append(elapsed)
            if check and answer.endpoints[0] != f"{pod_ip(holder_of(session, sizes.pods))}:{TARGET_PORT}":
                wrong += 1

    try:
        tasks: list[asyncio.Task[None]] = []
        interval = 1.0 / sizes.rate
        for phase_s, measured in ((sizes.warmup_s, False), (sizes.seconds, True)):
            start = time.perf_counter()
            for n in range(int(phase_s * sizes.rate)):
                scheduled = start + n * interval
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                session = rng.randrange(sizes.sessions)
                tasks.append(asyncio.create_task(one(scheduled, session, measured)))
            await asyncio.gather(*tasks)
            tasks.clear()
    finally:
        await client.close()
    return latencies, wrong, failed


def measure_one(kind: str, sizes: Sizes) -> tuple[list[float], int, int, dict[str, int], float]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=serve, args=(kind, sizes, child), daemon=True)
    started = time.perf_counter()
    process.start()
    picks: dict[str, int] = {}
    try:
        if not parent.poll(600):
            raise RuntimeError(f"the {kind} process did not start")
        port = parent.recv()
        ready_s = time.perf_counter() - started
        latencies, wrong, failed = asyncio.run(drive(port, sizes, check=kind == "router"))
    finally:
        with contextlib.suppress(Exception):
            parent.send("stop")
            if parent.poll(30):
                picks = parent.recv()
        process.join(10)
        if process.is_alive():
            process.kill()
    return latencies, wrong, failed, picks, ready_s


def measure(sizes: Sizes) -> dict[str, Any]:
    noop, _, noop_failed, _, _ = measure_one("noop", sizes)
    router, wrong, router_failed, picks, ready_s = measure_one("router", sizes)
    results: dict[str, Any] = {
        **latency_summary(router, "router_pick"),
        **latency_summary(noop, "noop_pick"),
        "router_requests": len(router),
        "noop_requests": len(noop),
        "router_not_holder": wrong,
        "router_failed": router_failed,
        "noop_failed": noop_failed,
        "router_ready_s": round(ready_s, 2),
        "router_picks_holder": picks.get("holder", 0),
    }
    if noop and router:
        results["router_vs_noop_p99"] = round(results["router_pick_p99_ms"] / results["noop_pick_p99_ms"], 2)
    return results


# -- sessions moved by a drain, through the whole mesh ----------------------------------------------------------
@dataclass(frozen=True)
class MoveSizes:
    """A drain under load: ``gpuwarden run`` (every service, the router, the simulated cluster and workload, the
    simulated gateway asking the router for every request of its pool) with ``sessions`` open conversations per
    deployment at ``rate`` requests a second; after ``warm_s`` the node whose pool pods hold the most sessions is
    drained, and ``settle_s`` of traffic follow its verdict. ``prefetch``: the router's GPUWARDEN_ROUTER_PREFETCH_S
    (0: off). The defaults are the issue's size: a node of ``deploy/sim/routing.yaml`` holding about 1,000 live
    sessions (each has a request about every minute, within the prefetch window)."""

    sessions: int = 3_000
    rate: float = 50.0
    warm_s: float = 90.0
    settle_s: float = 90.0
    prefetch_s: float = 120.0
    nodes: str = ""
    spec: str = ROUTING_SPEC
    """The simulation spec (``GPUWARDEN_SIM_SPEC``; '' the embedded default)."""
    scale_in: tuple[int, int] | None = None
    """Instead of a drain, a scale-in of the pool from ``[0]`` to ``[1]`` replicas (``gpuwarden sim scale``, as
    ``kubectl scale``: the ReplicaSet removes the pods of lowest deletion cost, the router's, first)."""


QUICK_MOVES = MoveSizes(sessions=8, rate=6.0, warm_s=8.0, settle_s=6.0, nodes="2", prefetch_s=30.0, spec="")
SCALE_IN = MoveSizes(sessions=2_000, scale_in=(4, 2))
"""The issue's scale-in: four pods of 500 conversations, two removed (1,000 sessions moved)."""


def _snapshot(services: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    from bench.soak import http_json

    return http_json(services["sim"]).get("simulation", {}), http_json(services["router"])


def _pool_sessions_by_node(simulation: dict[str, Any], deployment: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for name, pod in (simulation.get("pods") or {}).items():
        if name.startswith(f"{deployment}-") and not pod.get("stopping") and pod.get("node"):
            found[pod["node"]] = found.get(pod["node"], 0) + int(pod.get("sessions") or 0)
    return found


def _scale(env: dict[str, str], home: Path, pool: str, replicas: int) -> dict[str, str]:
    """``gpuwarden sim scale POOL REPLICAS``: the pool's pods and their phases after it (the same count again
    changes nothing, so it also reads them)."""
    from bench.soak import cli

    done = cli(env, home, "sim", "scale", pool, str(replicas))
    if done.returncode != 0:
        raise RuntimeError(f"sim scale {pool} {replicas}: {(done.stdout + done.stderr).strip()[-300:]}")
    return {str(name): str(phase) for name, phase in json.loads(done.stdout)["pods"].items()}


def _scaled_to(env: dict[str, str], home: Path, pool: str, replicas: int, timeout_s: float = 120.0) -> None:
    """The pool scaled to ``replicas`` with every one of them Running (a pod still Pending would be the one a
    scale-in removes, and nothing would move)."""
    deadline = time.monotonic() + timeout_s
    while True:
        phases = _scale(env, home, pool, replicas)
        if sum(1 for phase in phases.values() if phase == "Running") >= replicas:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{pool}: not {replicas} pods Running after {timeout_s:g}s: {phases}")
        time.sleep(1.0)


def _scaled_in(env: dict[str, str], home: Path, pool: str, scale: tuple[int, int]) -> list[str]:
    """The pool scaled in from ``scale[0]`` to ``scale[1]`` replicas: the pods it removed, those Running before that
    are Terminating now or already gone (a preStop that ended at once)."""
    before = [name for name, phase in _scale(env, home, pool, scale[0]).items() if phase == "Running"]
    after = _scale(env, home, pool, scale[1])
    return sorted(name for name in before if after.get(name, "Terminating") == "Terminating")


def _first_tokens(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The time to first token between two readings of the simulation (``shared.sim.sessions.FirstTokens``):
    p50 of the first requests of moved sessions on their new pod, p50 of every other request, and their ratio."""
    from shared.sim.sessions import quantile

    found: dict[str, Any] = {}
    now, then = after.get("first_token") or {}, before.get("first_token") or {}
    for kind, name in (("moved", "moved"), ("stayed", "unmoved")):
        later = [int(c) for c in now.get(kind) or []]
        earlier = [int(c) for c in then.get(kind) or []] or [0] * len(later)
        counts = [a - b for a, b in zip(later, earlier, strict=True)]
        p50 = quantile(counts, 0.5)
        found[f"{name}_first_tokens"] = sum(counts)
        found[f"{name}_first_token_p50_ms"] = None if p50 is None else round(p50 * 1000, 1)
    moved, unmoved = found["moved_first_token_p50_ms"], found["unmoved_first_token_p50_ms"]
    found["moved_first_token_vs_unmoved_p50"] = round(moved / unmoved, 3) if moved and unmoved else None
    return found


def _launch(argv: list[str], env: dict[str, str], home: Path) -> tuple[Any, Any]:
    """``gpuwarden run`` in ``home``, in a process group of its own, its output in ``home/run.out``."""
    import subprocess

    log = open(home / "run.out", "wb")
    proc = subprocess.Popen(argv, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


async def _moves(sizes: MoveSizes, home: Path, nats_url: str, redis_url: str) -> dict[str, Any]:
    import os

    from bench.soak import REPO, cli, stop, wait_ready

    root = "moves"
    env = dict(
        os.environ,
        GPUWARDEN_NATS_URL=nats_url,
        GPUWARDEN_REDIS_URL=redis_url,
        GPUWARDEN_ROOT=root,
        GPUWARDEN_HOME=str(home),
        GPUWARDEN_ROUTER_PREFETCH_S=str(sizes.prefetch_s),
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    for inherited in ("GPUWARDEN_SIM_SPEC", "GPUWARDEN_CHECKPOINT_STORE", "GPUWARDEN_NODE", "GPUWARDEN_HTTP_ADDR"):
        env.pop(inherited, None)
    if sizes.spec:
        env["GPUWARDEN_SIM_SPEC"] = sizes.spec  # made absolute by measure_moves
    argv = [sys.executable, "-m", "shared.cli", "run", "--rate", str(sizes.rate), "--sessions", str(sizes.sessions)]
    if sizes.nodes:
        argv += ["--nodes", sizes.nodes]
    proc, log = _launch(argv, env, home)
    try:
        state = await wait_ready(home, proc, timeout=300)
        services = {label: url for label, url in state["services"].items()}
        _, first = await asyncio.to_thread(_snapshot, services)
        pool = str((first.get("routing") or {}).get("pool") or "llm/llama")
        if sizes.scale_in is not None:
            await asyncio.to_thread(_scaled_to, env, home, pool, sizes.scale_in[0])
        await asyncio.sleep(sizes.warm_s)
        simulation, router = await asyncio.to_thread(_snapshot, services)
        deployment = pool.partition("/")[2]
        on = _pool_sessions_by_node(simulation, deployment)
        if not on:
            raise RuntimeError(f"no pod of {pool} holds a session after {sizes.warm_s:.0f}s; see {home / 'logs'}")
        started = time.monotonic()
        if sizes.scale_in is not None:
            leaving = await asyncio.to_thread(_scaled_in, env, home, pool, sizes.scale_in)
            node = ",".join(leaving)
            moved = sum(int((simulation["pods"].get(name) or {}).get("sessions") or 0) for name in leaving)
            outcome: dict[str, Any] = {"ok": bool(leaving)}
        else:
            node = max(on, key=lambda n: on[n])
            moved = on[node]
            done = await asyncio.to_thread(
                cli, env, home, "drain", node, "--json", "--timeout", "180", "--requested-by", "bench.router"
            )
            try:
                outcome = json.loads(done.stdout)
            except ValueError:
                outcome = {"ok": False, "reason": (done.stdout + done.stderr).strip()[-300:]}
        drain_s = time.monotonic() - started
        await asyncio.sleep(sizes.settle_s)
        after_sim, after_router = await asyncio.to_thread(_snapshot, services)
    finally:
        stop(proc)
        log.close()

    def delta(after: dict[str, Any], before: dict[str, Any], *path: str) -> int:
        now: Any = after
        then: Any = before
        for key in path:
            now, then = (now or {}).get(key), (then or {}).get(key)
        return int(now or 0) - int(then or 0)

    return {
        "drained_node" if sizes.scale_in is None else "scaled_in_pods": node,
        "drain_ok": bool(outcome.get("ok")),
        "drain_s": round(drain_s, 2),
        "sessions_moved": moved,
        "prefetched": delta(after_router, router, "prefetch", "prefetched"),
        "prefetch_held_elsewhere_asked_again": delta(after_router, router, "prefetch", "asked_again"),
        "prefetch_failed": delta(after_router, router, "prefetch", "failed")
        + delta(after_router, router, "prefetch", "unanswered"),
        "requests_to_non_holder": delta(after_sim, simulation, "gateway", "landed", "to_non_holder"),
        "requests_to_prefetched": delta(after_router, router, "landed", pool, "prefetched"),
        "cold_restores_on_request": delta(after_router, router, "landed", pool, "cold"),
        "cold_holder_gone": delta(after_router, router, "routing", "picks", "holder-gone"),
        "cold_unplaced": delta(after_router, router, "routing", "picks", "unplaced"),
        "handover_waits": delta(after_router, router, "handovers", "waited"),
        "handover_timeouts": delta(after_router, router, "handovers", "timed_out"),
        **_first_tokens(after_sim, simulation),
        "sessions_restored": delta(after_sim, simulation, "restored"),
        "sessions_recomputed": delta(after_sim, simulation, "recomputed"),
        "sessions_lost": delta(after_sim, simulation, "lost"),
        "requests_served": delta(after_sim, simulation, "served"),
    }


def measure_moves(sizes: MoveSizes, keep: Path | None = None) -> dict[str, Any]:
    """A drain under load through the whole mesh (``MoveSizes``); NATS and Redis servers of its own."""
    import shutil
    import tempfile

    from shared.host.devservers import NatsServer, RedisServer

    if sizes.spec:  # the run's working directory is its home
        sizes = replace(sizes, spec=str(Path(sizes.spec).resolve()))
    home = keep or Path(tempfile.mkdtemp(prefix="gw-router-moves-"))
    home.mkdir(parents=True, exist_ok=True)
    nats, redis = NatsServer().start(), RedisServer().start()
    try:
        return asyncio.run(_moves(sizes, home, nats.url, redis.url))
    finally:
        nats.cleanup()
        redis.cleanup()
        if keep is None:
            shutil.rmtree(home, ignore_errors=True)


TARGETS = (
    Target("router_pick_p99_ms", "<=", 2.0, "ext_proc pick p99, 1,000 requests/s, 100,000 sessions on 2,000 pods"),
    Target("router_vs_noop_p99", "<=", 2.0, "the router's p99 against a no-op ext_proc server's, same run"),
    Target("router_not_holder", "<=", 0, "answers whose first endpoint is not the session's holder"),
)


SCALE_IN_TARGETS = (
    Target("scale_in_sessions_recomputed", "<=", 0, "sessions computed again across a scale-in from 4 to 2 pods"),
    Target("scale_in_requests_to_non_holder", "<=", 0, "requests of a live session sent to a non-holder, scale-in"),
    Target("scale_in_sessions_lost", "<=", 0, "sessions whose context was lost across the scale-in"),
)


MOVE_TARGETS = (
    Target(
        "requests_to_non_holder", "<=", 0, "requests of a live session sent to a pod not holding it, across a drain"
    ),
    Target("sessions_lost", "<=", 0, "sessions whose context was lost across the drain"),
    Target(
        "moved_first_token_vs_unmoved_p50",
        "<=",
        1.5,
        "first token of a moved session's first request on its new pod against every other request, p50",
    ),
)


def run(
    sizes: Sizes,
    out: Path | None = None,
    quick: bool = False,
    quiet: bool = False,
    moves: MoveSizes | None = None,
    without_prefetch: bool = False,
    scale_in: MoveSizes | None = None,
) -> dict[str, Any]:
    """The pick's latency; with ``moves``, a drain under load through the whole mesh besides (``measure_moves``),
    the same with the router's prefetch off (``without_prefetch``: the peer, its figures under that key) and a
    scale-in (``scale_in``: its figures prefixed ``scale_in_``)."""
    options = BenchOptions(name="router", quick=quick, nats_url=None, out=out or default_out("router"))
    results = measure(sizes)
    params: dict[str, Any] = asdict(sizes)
    targets: tuple[Target, ...] = TARGETS
    if moves is not None:
        results.update(measure_moves(moves))
        params["moves"] = asdict(moves)
        targets = (*TARGETS, *MOVE_TARGETS)
        if without_prefetch:
            results["without_prefetch"] = measure_moves(replace(moves, prefetch_s=0.0))
    if scale_in is not None:
        results.update({f"scale_in_{key}": value for key, value in measure_moves(scale_in).items()})
        params["scale_in"] = asdict(scale_in)
        targets = (*targets, *SCALE_IN_TARGETS)
    if quiet:
        report = build_report(options, results, targets, params, machine_info())
        write_report(report, options.out)
        return report
    return finish(options, results, targets, params, machine_info())


def main(argv: list[str] | None = None) -> int:
    options = parse_args("router", __doc__ or "", argv)
    logging.basicConfig(level=logging.WARNING)
    if options.quick:
        report = run(QUICK, options.out, True, moves=QUICK_MOVES)
    else:
        report = run(Sizes(), options.out, False, moves=MoveSizes(), without_prefetch=True, scale_in=SCALE_IN)
    return exit_code(options, report)


if __name__ == "__main__":
    sys.exit(main())
