"""The KEDA external scaler's latencies, as KEDA sees them: over real gRPC to a scaler in its own process.

``python -m bench.scaler [--quick] [--nats-url URL] [--out PATH] [--strict]`` writes ``bench/results/scaler.json``.

The scaler (``ScalerCore`` + ``ScalerServer``, what ``python -m services.scaler`` runs, without the Redis-backed
runner around it) runs in a child process on a private NATS server; the callers run in this process.

1. ``GetMetrics`` with 100 concurrent callers on one channel (KEDA shares one connection per scaler address),
   each calling every ``caller_interval_s`` (0.5 s: 200 calls/s in all, about 12 times what KEDA sends for 100
   ScaledObjects: GetMetrics + IsActive per HPA sync of 15 s, IsActive per 30 s poll); latency per call from its
   scheduled start, p50/p99. Answers come
   from memory. Then the same callers back to back (``getmetrics_saturated_*``, ``getmetrics_max_calls_per_s``):
   the ceiling of one Python process, where latency is simply 100 / throughput.
   Throughout both, the ScaledObject scales on every signal (queue, ``kvCacheUtilTarget``, ``ttftP90TargetMs``)
   and ``load_pods`` pods of its deployment each publish a ``kv.pod.load`` report every ``load_interval_s`` (500
   reports/s by default, what a 2,500-pod fleet reporting every 5 s sends; from a process of their own), which the
   scaler takes and aggregates while it answers; ``load_reports_taken`` counts what it took and
   ``decision_signal`` says what set its count. Each pod reports at its own phase of the interval, as
   ``LoadReporter`` does from its pod's start (the target is on this: ``getmetrics_*``); then the same calls
   again with every pod reporting at the same instant, 500 reports in one burst a second, the worst case of pods
   started together (``getmetrics_burst_*``, reported beside it, no target).
2. Activation through ``StreamIsActive`` (trigger ``external-push``): per trial a fresh, empty queue; the stream's
   first answer (false) is read, then one ``InferenceRequest`` is published to JetStream; latency = publish start
   -> ``true`` received. p50/p99 over the trials.
3. The same activation as KEDA's built-in way has it: a client that polls ``IsActive`` every ``poll_interval_s``
   (shortened from KEDA's default ``pollingInterval`` of 30 s); the request is published at a random phase of the
   poll cycle. ``poll_activation_p50_ms`` is the measured median scaled by 30 s / ``poll_interval_s`` (the wait is
   dominated by the phase, uniform over the interval); the measured figure is reported too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import random
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from bench.common import (
    BenchOptions,
    Target,
    build_report,
    default_out,
    exit_code,
    finish,
    latency_summary,
    machine_info,
    median,
    nats_server,
    parse_args,
    write_report,
)
from services.scaler.adapters import JetStreamQueue
from services.scaler.config import ScalerSettings
from services.scaler.gen import externalscaler_pb2 as pb
from services.scaler.gen import externalscaler_pb2_grpc as pb_grpc
from services.scaler.grpcserver import ScalerServer
from services.scaler.handlers import ScalerCore
from shared.contract.load import PodLoad
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import HostPort, NatsSettings

KEDA_POLLING_INTERVAL_S = 30.0
NAMESPACE = "bench"


@dataclass(frozen=True)
class Sizes:
    callers: int = 100
    caller_interval_s: float = 0.5  # 100 callers -> 200 calls/s, ~12x what KEDA sends for 100 ScaledObjects
    calls_per_caller: int = 50
    saturation_calls_per_caller: int = 50
    activation_trials: int = 200
    poll_trials: int = 40
    poll_interval_s: float = 0.2
    refresh_s: float = 1.0
    load_pods: int = 500
    load_interval_s: float = 1.0


QUICK = Sizes(
    calls_per_caller=10, saturation_calls_per_caller=5, activation_trials=20, poll_trials=8, poll_interval_s=0.1
)


def ref(deployment: str) -> pb.ScaledObjectRef:
    metadata = {"scalerAddress": "127.0.0.1", "deployment": deployment, "queueDepthPerReplica": "4"}
    if deployment == LOADED:  # every signal: the queue, the pods' KV caches and their time to first token
        metadata.update(kvCacheUtilTarget="70", ttftP90TargetMs="500", maxReplicas="1000")
    return pb.ScaledObjectRef(name=deployment, namespace=NAMESPACE, scalerMetadata=metadata)


LOADED = "metrics"


def report_load(nats_url: str, root: str, sizes: Sizes, conn: Connection) -> None:
    """The pods, in a process of their own (as they are, elsewhere): report until told to stop, then say how many
    reports went out and over how long. Told ``burst``, every pod reports at the same instant from then on."""
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_report_load(nats_url, root, sizes, conn))


async def _report_load(nats_url: str, root: str, sizes: Sizes, conn: Connection) -> None:
    bus = await Bus.connect(NatsSettings(servers=(nats_url,)), Subjects(root), "bench-pods")
    stop = asyncio.Event()
    burst = asyncio.Event()
    loop = asyncio.get_running_loop()

    def listen() -> None:
        while True:
            said = conn.recv()
            if said == "burst":
                loop.call_soon_threadsafe(burst.set)
            else:
                loop.call_soon_threadsafe(stop.set)
                return

    listening = loop.run_in_executor(None, listen)
    conn.send("started")
    started = time.perf_counter()
    sent = await publish_load(bus, sizes, stop, burst)
    conn.send((sent, time.perf_counter() - started))
    await listening
    await bus.close(grace=1.0)


async def publish_load(bus: Bus, sizes: Sizes, stop: asyncio.Event, burst: asyncio.Event | None = None) -> int:
    """``load_pods`` pods of the measured deployment report their load every ``load_interval_s`` until ``stop``.

    Each pod at its own phase of the interval, spread evenly, as ``shared.kv.load.LoadReporter`` does (it reports
    every interval from its pod's start, and pods start at different times); once ``burst`` is set, all of them
    at the same instant instead: the worst case, every pod started together."""
    rng = random.Random(5)
    total = 2048
    n = sizes.load_pods
    sent = 0
    cycle = time.perf_counter()
    while not stop.is_set() and n > 0:
        together = burst is not None and burst.is_set()
        due = [cycle] * n if together else [cycle + sizes.load_interval_s * (i + 0.5) / n for i in range(n)]
        for i in range(n):
            wait = due[i] - time.perf_counter()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
                if stop.is_set():
                    return sent
            await bus.publish(
                PodLoad(
                    pod=f"{LOADED}-{i}",
                    node=f"node-{i // 8}",
                    namespace=NAMESPACE,
                    deployment=LOADED,
                    blocks_used=rng.randint(0, total),
                    blocks_total=total,
                    ttft_p90_s=rng.uniform(0.05, 0.6),
                    window_s=sizes.load_interval_s,
                    requests=rng.randint(1, 50),
                )
            )
            sent += 1
        cycle += sizes.load_interval_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, cycle - time.perf_counter()))
        cycle = max(cycle, time.perf_counter() - sizes.load_interval_s)  # a late cycle is not made up in a rush
    return sent


# -- the scaler, in a process of its own ------------------------------------------------------------------------
def serve(nats_url: str, root: str, refresh_s: float, conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(nats_url, root, refresh_s, conn))


async def _serve(nats_url: str, root: str, refresh_s: float, conn: Connection) -> None:
    bus = await Bus.connect(NatsSettings(servers=(nats_url,)), Subjects(root), "bench-scaler")
    await bus.ensure_streams()
    core = ScalerCore(JetStreamQueue(bus), refresh_s=refresh_s)
    await bus.subscribe(bus.subjects.pattern("kv.pod.load"), core.on_load, accepts=(PodLoad,))
    server = ScalerServer(core, ScalerSettings(listen=HostPort("127.0.0.1", 0), refresh_s=refresh_s))
    port = await server.start()
    loops = [asyncio.create_task(core.refresh_loop()), asyncio.create_task(core.publish_loop())]
    conn.send(port)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    watch = core.watches.get((NAMESPACE, LOADED))
    decision = watch.decision if watch is not None else None
    conn.send(
        {
            "load_reports_taken": core.load_reports,
            "decision_signal": decision.signal if decision is not None else "",
            "decision_signal_replicas": decision.signal_replicas if decision is not None else {},
        }
    )
    for task in loops:
        task.cancel()
    await server.stop(grace=0.5)
    await core.close()
    await bus.close(grace=1.0)


# -- the measurements -------------------------------------------------------------------------------------------
async def measure_getmetrics(stub: pb_grpc.ExternalScalerStub, sizes: Sizes) -> list[float]:
    """100 callers, each calling every ``caller_interval_s`` from a random phase; latency from the scheduled
    start (a late start counts against the server: no coordinated omission)."""
    request = pb.GetMetricsRequest(scaledObjectRef=ref("metrics"), metricName="s0-gpuwarden-bench-metrics")
    for _ in range(50):
        await stub.GetMetrics(request)
    latencies: list[float] = []
    rng = random.Random(11)

    async def caller(phase: float) -> None:
        scheduled = time.perf_counter() + phase
        for _ in range(sizes.calls_per_caller):
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            await stub.GetMetrics(request)
            latencies.append(time.perf_counter() - scheduled)
            scheduled += sizes.caller_interval_s

    await asyncio.gather(*(caller(rng.uniform(0, sizes.caller_interval_s)) for _ in range(sizes.callers)))
    return latencies


async def measure_saturation(stub: pb_grpc.ExternalScalerStub, sizes: Sizes) -> tuple[list[float], float]:
    """The same callers back to back, for the server's ceiling: latency is then concurrency / throughput."""
    request = pb.GetMetricsRequest(scaledObjectRef=ref("metrics"), metricName="s0-gpuwarden-bench-metrics")
    latencies: list[float] = []

    async def caller() -> None:
        for _ in range(sizes.saturation_calls_per_caller):
            started = time.perf_counter()
            await stub.GetMetrics(request)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(sizes.callers)))
    return latencies, time.perf_counter() - started


async def measure_push(stub: pb_grpc.ExternalScalerStub, bus: Bus, sizes: Sizes) -> list[float]:
    latencies = []
    for i in range(sizes.activation_trials):
        deployment = f"push-{i}"
        stream = stub.StreamIsActive(ref(deployment))
        first = await asyncio.wait_for(stream.read(), 10)
        assert first.result is False, "the queue should start empty"
        started = time.perf_counter()
        await bus.publish(InferenceRequest(namespace=NAMESPACE, deployment=deployment, session_id=f"s{i}"))
        reply = await asyncio.wait_for(stream.read(), 10)
        latencies.append(time.perf_counter() - started)
        assert reply.result is True
        stream.cancel()
    return latencies


async def poll_until_active(stub: pb_grpc.ExternalScalerStub, so: pb.ScaledObjectRef, interval_s: float) -> float:
    """KEDA's ``external`` trigger: ask ``IsActive`` every ``interval_s``; the time the answer turned true."""
    while True:
        if (await stub.IsActive(so)).result:
            return time.perf_counter()
        await asyncio.sleep(interval_s)


async def measure_poll(stub: pb_grpc.ExternalScalerStub, bus: Bus, sizes: Sizes) -> list[float]:
    latencies = []
    rng = random.Random(7)
    for i in range(sizes.poll_trials):
        so = ref(f"poll-{i}")
        assert (await stub.IsActive(so)).result is False
        polling = asyncio.create_task(poll_until_active(stub, so, sizes.poll_interval_s))
        await asyncio.sleep(rng.uniform(0, sizes.poll_interval_s))  # a random phase of the poll cycle
        started = time.perf_counter()
        await bus.publish(InferenceRequest(namespace=NAMESPACE, deployment=f"poll-{i}", session_id=f"p{i}"))
        latencies.append(await asyncio.wait_for(polling, 10) - started)
    return latencies


async def measure(nats_url: str, sizes: Sizes) -> dict[str, Any]:
    root = "bench" + secrets.token_hex(4)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=serve, args=(nats_url, root, sizes.refresh_s, child), daemon=True
    )
    process.start()
    loop = asyncio.get_running_loop()
    bus = await Bus.connect(NatsSettings(servers=(nats_url,)), Subjects(root), "bench-client")
    try:
        if not await loop.run_in_executor(None, parent.poll, 30):
            raise RuntimeError("the scaler process did not start")
        port = parent.recv()
        await bus.ensure_streams()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            pods, pods_end = multiprocessing.get_context("spawn").Pipe()
            reporter = multiprocessing.get_context("spawn").Process(
                target=report_load, args=(nats_url, root, sizes, pods_end), daemon=True
            )
            reporter.start()
            if not await loop.run_in_executor(None, pods.poll, 30):
                raise RuntimeError("the reporting pods' process did not start")
            pods.recv()
            getmetrics = await measure_getmetrics(stub, sizes)
            pods.send("burst")
            getmetrics_burst = await measure_getmetrics(stub, sizes)
            saturated, saturated_wall = await measure_saturation(stub, sizes)
            pods.send("stop")
            load_sent, load_wall = await loop.run_in_executor(None, pods.recv)
            await loop.run_in_executor(None, reporter.join, 10)
            push = await measure_push(stub, bus, sizes)
            poll = await measure_poll(stub, bus, sizes)
    finally:
        parent.send("stop")
        taken: dict[str, Any] = {}
        if await loop.run_in_executor(None, parent.poll, 10):
            taken = parent.recv()
        await loop.run_in_executor(None, process.join, 10)
        if process.is_alive():
            process.kill()
        for spec in bus.subjects.streams:
            try:
                await bus.js.delete_stream(spec.name)
            except Exception:
                pass
        await bus.close(grace=1.0)
    poll_measured_ms = median(poll) * 1000.0
    results: dict[str, Any] = {
        **latency_summary(getmetrics, "getmetrics"),
        "getmetrics_offered_calls_per_s": round(sizes.callers / sizes.caller_interval_s, 1),
        **latency_summary(getmetrics_burst, "getmetrics_burst"),
        **latency_summary(saturated, "getmetrics_saturated"),
        "getmetrics_max_calls_per_s": round(len(saturated) / saturated_wall, 1),
        **latency_summary(push, "activation"),
        "poll_activation_p50_ms": round(poll_measured_ms * KEDA_POLLING_INTERVAL_S / sizes.poll_interval_s, 1),
        "poll_activation_measured_p50_ms": round(poll_measured_ms, 3),
        "getmetrics_calls": len(getmetrics),
        "activation_trials": len(push),
        "poll_trials": len(poll),
        "load_reports_sent": load_sent,
        "load_reports_per_s": round(load_sent / load_wall, 1) if load_wall > 0 else 0.0,
        **taken,
    }
    return results


TARGETS = (
    Target("getmetrics_p99_ms", "<=", 5.0, "GetMetrics p99 with 100 concurrent callers"),
    Target("activation_p99_ms", "<=", 100.0, "first request in an empty queue -> true on StreamIsActive"),
)


def run(
    nats_url: str | None,
    sizes: Sizes,
    out: Path | None = None,
    quick: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    options = BenchOptions(name="scaler", quick=quick, nats_url=nats_url, out=out or default_out("scaler"))
    with nats_server(nats_url) as url:
        results = asyncio.run(measure(url, sizes))
    params = {**asdict(sizes), "server": "given" if nats_url else "private", "keda_polling_interval_s": 30.0}
    if quiet:
        report = build_report(options, results, TARGETS, params, machine_info())
        write_report(report, options.out)
        return report
    return finish(options, results, TARGETS, params, machine_info())


def main(argv: list[str] | None = None) -> int:
    options = parse_args("scaler", __doc__ or "", argv)
    logging.basicConfig(level=logging.WARNING)
    report = run(options.nats_url, QUICK if options.quick else Sizes(), options.out, options.quick)
    return exit_code(options, report)


if __name__ == "__main__":
    sys.exit(main())
