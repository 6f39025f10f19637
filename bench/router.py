"""The endpoint picker's pick latency, as the gateway sees it: Envoy ext_proc over real gRPC to a router in its own
process, against a no-op ext_proc server in the same process model.

``python -m bench.router [--quick] [--out PATH] [--strict]`` writes ``bench/results/router.json``.

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
import logging
import multiprocessing
import random
import sys
import time
from dataclasses import asdict, dataclass
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


TARGETS = (
    Target("router_pick_p99_ms", "<=", 2.0, "ext_proc pick p99, 1,000 requests/s, 100,000 sessions on 2,000 pods"),
    Target("router_vs_noop_p99", "<=", 2.0, "the router's p99 against a no-op ext_proc server's, same run"),
    Target("router_not_holder", "<=", 0, "answers whose first endpoint is not the session's holder"),
)


def run(sizes: Sizes, out: Path | None = None, quick: bool = False, quiet: bool = False) -> dict[str, Any]:
    options = BenchOptions(name="router", quick=quick, nats_url=None, out=out or default_out("router"))
    results = measure(sizes)
    params = asdict(sizes)
    if quiet:
        report = build_report(options, results, TARGETS, params, machine_info())
        write_report(report, options.out)
        return report
    return finish(options, results, TARGETS, params, machine_info())


def main(argv: list[str] | None = None) -> int:
    options = parse_args("router", __doc__ or "", argv)
    logging.basicConfig(level=logging.WARNING)
    report = run(QUICK if options.quick else Sizes(), options.out, options.quick)
    return exit_code(options, report)


if __name__ == "__main__":
    sys.exit(main())
