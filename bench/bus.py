"""End-to-end event throughput and latency through the bus layer, against raw nats-py in the same run.

``python -m bench.bus [--quick] [--nats-url URL] [--out PATH] [--strict]`` writes ``bench/results/bus.json``.

1. Core (telemetry): N ``GpuSample`` events through ``Bus.publish`` -> ``Bus.subscribe`` (decode, typed handler),
   against raw nats-py doing the same job: ``nc.publish`` of each event encoded with msgspec -> ``nc.subscribe``
   callback that decodes it (``raw_core_msgs_per_s``; ``core_ratio`` = bus / raw). Publisher and subscriber use
   separate connections (in this one process and event loop). msgs/s = received / (first publish -> last receive).
   For attribution, raw nats-py moving the same bytes pre-encoded and never decoding them
   (``raw_core_bytes_msgs_per_s``, ``core_bytes_ratio``) is the transport's ceiling: on this machine msgspec's
   encode and decode of one event alone take about a quarter of that per-message time, so no layer that takes
   events and hands typed events to its handler can keep 80% of it.
2. JetStream throughput (lifecycle): N ``DrainRequested`` events through ``Bus.publish_many`` (outstanding ack
   window) into a durable consumer (``shared.plumbing.consumer.consume``) whose handler counts; events/s = N /
   (first publish -> the handler has seen the last event and every ack is out, i.e. flushed to the server). The raw
   peer is ``js.publish_async`` + ``pull_subscribe`` ``fetch`` + ``ack`` of the same bytes and ``Nats-Msg-Id`` headers.
3. JetStream latency: events offered at 1,000/s for a few seconds through ``Bus.publish`` -> ``consume``, each
   publish started on schedule as its own task (a slow ack never delays the next event); each event carries
   ``time.perf_counter_ns()`` taken just before its publish (in ``reason``); latency = the handler's receive time
   minus that. The raw peer is ``js.publish`` -> ``fetch`` (decode, ack) of the same events.

Each part alternates raw and bus trials, round by round, and reports medians (the rounds are in
``params.detail``). Every run uses a fresh subject root (``bench`` + random hex) and deletes its streams after.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
from nats.js import api as js_api

from bench.common import (
    BenchOptions,
    Target,
    default_out,
    exit_code,
    finish,
    latency_summary,
    machine_info,
    median,
    nats_server,
    parse_args,
)
from shared.contract.metrics import GpuSample
from shared.contract.node import DrainRequested
from shared.contract.registry import codec
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.consumer import Consumer, ConsumerSpec, consume
from shared.plumbing.settings import NatsSettings

NAME = "bus"

TARGETS = (
    Target(
        "core_ratio",
        ">=",
        0.8,
        "bus core publish/subscribe keeps >= 80% of raw nats-py (same events, encoded and decoded)",
    ),
    Target("jetstream_events_per_s", ">=", 10_000, "JetStream lifecycle events end to end (publish..ack)"),
    Target("jetstream_p99_ms", "<=", 5.0, "JetStream p99 latency at 1,000 events/s"),
)


@dataclass(frozen=True)
class Sizes:
    core_n: int = 50_000
    js_n: int = 20_000
    latency_s: float = 10.0
    latency_rate: float = 1000.0
    rounds: int = 3
    warmup_n: int = 3_000
    js_window: int = 1024  # publish_many's outstanding acks (and the raw peer's publish_async_max_pending)
    js_batch: int = 256  # ConsumerSpec.batch (and the raw peer's fetch batch)
    js_concurrency: int = 256  # ConsumerSpec.concurrency
    idle_timeout_s: float = 5.0  # a trial gives up when nothing arrived for this long


FULL = Sizes()
QUICK = Sizes(core_n=20_000, js_n=5_000, latency_s=2.0, rounds=1, warmup_n=1_000)


class Arrivals:
    """Counts deliveries; remembers when the last one came and wakes a waiter when all expected are in."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.last = 0.0
        self.done = asyncio.Event()

    def hit(self) -> None:
        self.count += 1
        self.last = time.perf_counter()
        if self.count >= self.expected:
            self.done.set()

    async def wait(self, idle_timeout: float) -> None:
        """Until all arrived, or nothing new arrived for ``idle_timeout`` seconds."""
        seen, since = -1, time.monotonic()
        while not self.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), timeout=0.25)
            if self.count != seen:
                seen, since = self.count, time.monotonic()
            elif time.monotonic() - since > idle_timeout:
                return


@dataclass
class Trial:
    sent: int
    received: int
    seconds: float
    cpu_s: float = 0.0  # this process's CPU time over the trial (wall minus this is time spent waiting)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def per_s(self) -> float:
        return self.received / self.seconds if self.seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "received": self.received,
            "seconds": round(self.seconds, 4),
            "per_s": round(self.per_s, 1),
            "cpu_s": round(self.cpu_s, 3),
            **self.extra,
        }


class _Clock:
    """Wall and CPU time from the first publish."""

    def __init__(self) -> None:
        gc.collect()
        self.start = time.perf_counter()
        self.cpu = time.process_time()

    def trial(self, sent: int, received: int, end: float | None = None, **extra: Any) -> Trial:
        end = end if end else time.perf_counter()
        return Trial(sent, received, end - self.start, time.process_time() - self.cpu, extra)


def _settings(url: str) -> NatsSettings:
    return NatsSettings(servers=(url,))


def _samples(node: str, n: int) -> list[GpuSample]:
    return [
        GpuSample(
            node=node,
            gpu_uuid=f"GPU-{i % 8:02d}-4a1f9c3e-0b7d-4e52-9d8e-{i % 8:012d}",
            gpu_util=float(i % 100),
            mem_used_mib=40_000.0 + i % 1000,
            mem_free_mib=40_000.0,
            power_w=350.0,
            temperature_c=61.0,
            pod=f"llm-{i % 16}",
            namespace="inference",
        )
        for i in range(n)
    ]


def _drains(node: str, n: int, prefix: str = "d") -> list[DrainRequested]:
    return [DrainRequested(node=node, drain_id=f"{prefix}{i}", requested_by="bench") for i in range(n)]


def _stamped(event: Any) -> Any:
    """The event as the bus sends it: ``source`` stamped by the publishing bus."""
    return msgspec.structs.replace(event, source="bench-pub")


# -- 1. core ------------------------------------------------------------------------------------------------------
async def core_bus_trial(url: str, subjects: Subjects, n: int, tag: str, idle_timeout: float) -> Trial:
    node = f"core-bus-{tag}"
    events = _samples(node, n)
    pub = await Bus.connect(_settings(url), subjects, "bench-pub")
    sub = await Bus.connect(_settings(url), subjects, "bench-sub")
    try:
        arrivals = Arrivals(n)

        async def handle(event: GpuSample) -> None:
            arrivals.hit()

        await sub.subscribe(subjects.pattern("metrics.gpu.sample", node=node), handle, accepts=(GpuSample,))
        await sub.nc.flush()
        clock = _Clock()
        for event in events:
            await pub.publish(event)
        await pub.nc.flush()
        await arrivals.wait(idle_timeout)
        return clock.trial(n, arrivals.count, arrivals.last)
    finally:
        await pub.close(grace=1.0)
        await sub.close(grace=1.0)


async def core_raw_trial(
    url: str, subjects: Subjects, n: int, tag: str, idle_timeout: float, with_codec: bool = False
) -> Trial:
    """Raw nats-py: the bus's bytes, pre-encoded; or (``with_codec``) encoded per publish and decoded per receipt."""
    node = f"core-raw{'c' if with_codec else ''}-{tag}"
    events = [_stamped(e) for e in _samples(node, n)]
    payloads = [codec.encode(e) for e in events]
    subject = subjects.for_event(events[0])
    nc_pub = await nats.connect(url)
    nc_sub = await nats.connect(url)
    try:
        arrivals = Arrivals(n)
        decode = codec.decode

        async def on_msg(msg: Any) -> None:
            arrivals.hit()

        async def on_msg_decoded(msg: Any) -> None:
            decode(msg.data)
            arrivals.hit()

        await nc_sub.subscribe(subject, cb=on_msg_decoded if with_codec else on_msg)
        await nc_sub.flush()
        clock = _Clock()
        if with_codec:
            encode = codec.encode
            for event in events:
                await nc_pub.publish(subject, encode(event))
        else:
            for data in payloads:
                await nc_pub.publish(subject, data)
        await nc_pub.flush()
        await arrivals.wait(idle_timeout)
        return clock.trial(n, arrivals.count, arrivals.last)
    finally:
        await nc_pub.close()
        await nc_sub.close()


# -- 2. JetStream throughput ----------------------------------------------------------------------------------
def _spec(subjects: Subjects, node: str, sizes: Sizes) -> ConsumerSpec:
    return ConsumerSpec(
        durable=f"bench-{node}",
        filter_subjects=(subjects.pattern("node.drain.requested", node=node),),
        accepts=(DrainRequested,),
        stream=subjects.events_stream,
        batch=sizes.js_batch,
        concurrency=sizes.js_concurrency,
        ack_wait=30.0,
    )


def _raw_consumer_config(spec: ConsumerSpec) -> js_api.ConsumerConfig:
    """What ``consume`` creates for ``spec`` (``consumer_config``), written out for the raw peer."""
    return js_api.ConsumerConfig(
        durable_name=spec.durable,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait,
        max_deliver=spec.max_deliver,
        max_ack_pending=max(spec.concurrency * 4, spec.batch * 2),
        deliver_policy=js_api.DeliverPolicy.ALL,
        filter_subject=spec.filter_subjects[0],
    )


async def _settled(consumer: Consumer, n: int, timeout: float) -> None:
    """Until the consumer loop has acked ``n`` events (it acks right after the handler returns)."""
    deadline = time.monotonic() + timeout
    while consumer.stats.handled < n and time.monotonic() < deadline:  # noqa: ASYNC110 - no event to wait on
        await asyncio.sleep(0.0002)


async def _trial_cleanup(js: Any, subjects: Subjects, durable: str) -> dict[str, int]:
    """Check nothing is left unacked or was redelivered, then drop the consumer and the trial's messages."""
    stream = subjects.events_stream.name
    left: dict[str, int] = {}
    deadline = time.monotonic() + 5.0
    while True:  # acks are fire-and-forget publishes: on a busy machine the server may not have them all yet
        with contextlib.suppress(Exception):
            info = await js.consumer_info(stream, durable)
            left = {
                "num_pending": int(info.num_pending or 0),
                "num_ack_pending": int(info.num_ack_pending or 0),
                "num_redelivered": int(info.num_redelivered or 0),
            }
        if not left.get("num_ack_pending") or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    with contextlib.suppress(Exception):
        await js.delete_consumer(stream, durable)
    with contextlib.suppress(Exception):
        await js.purge_stream(stream)
    return left


async def js_bus_trial(url: str, subjects: Subjects, n: int, tag: str, sizes: Sizes) -> Trial:
    node = f"js-bus-{tag}"
    events = _drains(node, n)
    pub = await Bus.connect(_settings(url), subjects, "bench-pub")
    sub = await Bus.connect(_settings(url), subjects, "bench-sub")
    try:
        await pub.ensure_streams()
        arrivals = Arrivals(n)

        async def handle(event: DrainRequested) -> None:
            arrivals.hit()

        spec = _spec(subjects, node, sizes)
        consumer = await consume(sub, spec, handle)
        clock = _Clock()
        await pub.publish_many(events, window=sizes.js_window)
        published = time.perf_counter() - clock.start
        await arrivals.wait(sizes.idle_timeout_s)
        await _settled(consumer, n, sizes.idle_timeout_s)
        await sub.nc.flush()
        trial = clock.trial(n, min(arrivals.count, consumer.stats.handled), published_s=round(published, 4))
        await consumer.stop(grace=1.0)
        trial.extra.update(await _trial_cleanup(sub.js, subjects, spec.durable))
        return trial
    finally:
        await pub.close(grace=1.0)
        await sub.close(grace=1.0)


async def js_raw_trial(url: str, subjects: Subjects, n: int, tag: str, sizes: Sizes) -> Trial:
    node = f"js-raw-{tag}"
    events = [_stamped(e) for e in _drains(node, n)]
    messages = [(subjects.for_event(e), codec.encode(e), e.event_id) for e in events]
    spec = _spec(subjects, node, sizes)
    setup = await Bus.connect(_settings(url), subjects, "bench-setup")
    nc_pub = await nats.connect(url)
    nc_sub = await nats.connect(url)
    try:
        await setup.ensure_streams()
        js_pub = nc_pub.jetstream(publish_async_max_pending=sizes.js_window)
        js_sub = nc_sub.jetstream()
        await js_sub.add_consumer(spec.stream.name, _raw_consumer_config(spec))
        psub = await js_sub.pull_subscribe_bind(durable=spec.durable, stream=spec.stream.name)
        acked = 0

        async def consume() -> None:
            nonlocal acked
            idle_since = time.monotonic()
            while acked < n:
                try:
                    msgs = await psub.fetch(spec.batch, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    if time.monotonic() - idle_since > sizes.idle_timeout_s:
                        return
                    continue
                idle_since = time.monotonic()
                for msg in msgs:
                    await msg.ack()
                    acked += 1

        clock = _Clock()
        consumer = asyncio.create_task(consume())
        for subject, data, msg_id in messages:
            await js_pub.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id})
        await js_pub.publish_async_completed()
        published = time.perf_counter() - clock.start
        await consumer
        await nc_sub.flush()
        trial = clock.trial(n, acked, published_s=round(published, 4))
        await psub.unsubscribe()
        trial.extra.update(await _trial_cleanup(js_sub, subjects, spec.durable))
        return trial
    finally:
        await nc_pub.close()
        await nc_sub.close()
        await setup.close(grace=1.0)


# -- 3. JetStream latency -------------------------------------------------------------------------------------
async def _paced(n: int, rate: float, send: Callable[[int], Awaitable[None]]) -> dict[str, Any]:
    """Start ``send(i)`` for i in 0..n-1 on a fixed schedule of ``rate`` per second, each as its own task, so a
    slow publish (one awaiting its JetStream ack) never holds back the next: the offered load stays at ``rate``
    however the system copes (no coordinated omission). Waits for every send; fails if one failed."""
    interval = 1.0 / rate
    late = 0
    sends: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []

    def sent(task: asyncio.Task[None]) -> None:
        sends.discard(task)
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    gc.collect()
    start = time.perf_counter()
    for i in range(n):
        wait = start + i * interval - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -interval:
            late += 1
        task = asyncio.ensure_future(send(i))
        sends.add(task)
        task.add_done_callback(sent)
    took = time.perf_counter() - start
    if sends:
        await asyncio.wait(set(sends))
    if failures:
        raise failures[0]
    return {"sent": n, "achieved_rate": round(n / took, 1), "sends_over_1_interval_late": late}


async def _until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a plain predicate
        await asyncio.sleep(0.01)


async def js_bus_latency(
    url: str, subjects: Subjects, sizes: Sizes, seconds: float
) -> tuple[list[float], dict[str, Any]]:
    """Latencies (seconds) of events published one by one with ``Bus.publish`` at ``sizes.latency_rate``/s."""
    node = f"js-lat-bus-{secrets.token_hex(3)}"
    pub = await Bus.connect(_settings(url), subjects, "bench-pub")
    sub = await Bus.connect(_settings(url), subjects, "bench-sub")
    try:
        await pub.ensure_streams()
        latencies: list[float] = []

        async def handle(event: DrainRequested) -> None:
            latencies.append((time.perf_counter_ns() - int(event.reason)) / 1e9)

        spec = _spec(subjects, node, sizes)
        consumer = await consume(sub, spec, handle)

        async def send(i: int) -> None:
            await pub.publish(DrainRequested(node=node, drain_id=f"l{i}", reason=str(time.perf_counter_ns())))

        n = max(1, round(seconds * sizes.latency_rate))
        detail = await _paced(n, sizes.latency_rate, send)
        await _until(lambda: len(latencies) >= n, sizes.idle_timeout_s)
        await _settled(consumer, n, 1.0)
        await consumer.stop(grace=1.0)
        detail.update(received=len(latencies), **await _trial_cleanup(sub.js, subjects, spec.durable))
        return latencies, detail
    finally:
        await pub.close(grace=1.0)
        await sub.close(grace=1.0)


async def js_raw_latency(
    url: str, subjects: Subjects, sizes: Sizes, seconds: float
) -> tuple[list[float], dict[str, Any]]:
    """The raw peer: ``js.publish`` (awaiting the ack, like ``Bus.publish``) and a ``fetch`` loop that decodes
    and acks, on the same consumer configuration and batch."""
    node = f"js-lat-raw-{secrets.token_hex(3)}"
    spec = _spec(subjects, node, sizes)
    setup = await Bus.connect(_settings(url), subjects, "bench-setup")
    nc_pub = await nats.connect(url)
    nc_sub = await nats.connect(url)
    try:
        await setup.ensure_streams()
        js_pub = nc_pub.jetstream()
        js_sub = nc_sub.jetstream()
        await js_sub.add_consumer(spec.stream.name, _raw_consumer_config(spec))
        psub = await js_sub.pull_subscribe_bind(durable=spec.durable, stream=spec.stream.name)
        latencies: list[float] = []
        n = max(1, round(seconds * sizes.latency_rate))
        subject = subjects.for_event(DrainRequested(node=node, drain_id="x"))

        async def consume() -> None:
            idle_since = time.monotonic()
            while len(latencies) < n:
                try:
                    msgs = await psub.fetch(spec.batch, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    if time.monotonic() - idle_since > sizes.idle_timeout_s:
                        return
                    continue
                idle_since = time.monotonic()
                for msg in msgs:
                    event = codec.decode(msg.data)
                    assert isinstance(event, DrainRequested)
                    latencies.append((time.perf_counter_ns() - int(event.reason)) / 1e9)
                    await msg.ack()

        async def send(i: int) -> None:
            event = DrainRequested(node=node, drain_id=f"l{i}", reason=str(time.perf_counter_ns()), source="bench")
            await js_pub.publish(subject, codec.encode(event), headers={"Nats-Msg-Id": event.event_id})

        consumer = asyncio.create_task(consume())
        detail = await _paced(n, sizes.latency_rate, send)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(consumer, timeout=sizes.idle_timeout_s + 2.0)
        await nc_sub.flush()
        await psub.unsubscribe()
        detail.update(received=len(latencies), **await _trial_cleanup(js_sub, subjects, spec.durable))
        return latencies, detail
    finally:
        await nc_pub.close()
        await nc_sub.close()
        await setup.close(grace=1.0)


# -- the whole run ------------------------------------------------------------------------------------------------
async def _server_version(url: str) -> str | None:
    with contextlib.suppress(Exception):
        nc = await nats.connect(url)
        try:
            version = nc._server_info.get("version")
            return str(version) if version else None
        finally:
            await nc.close()
    return None


async def _delete_streams(url: str, subjects: Subjects) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for spec in subjects.streams:
            with contextlib.suppress(Exception):
                await js.delete_stream(spec.name)
    finally:
        await nc.close()


def _progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def _spread(trials: Sequence[Trial]) -> dict[str, float]:
    rates = [t.per_s for t in trials]
    return {"min": round(min(rates), 1), "median": round(median(rates), 1), "max": round(max(rates), 1)}


async def measure(url: str, sizes: Sizes, quiet: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run all three parts against ``url``; returns (results, detail)."""
    say: Callable[[str], None] = (lambda _text: None) if quiet else _progress
    subjects = Subjects("bench" + secrets.token_hex(4))
    idle = sizes.idle_timeout_s
    detail: dict[str, Any] = {"subject_root": subjects.root}
    try:
        # 1. core
        say(f"core warm-up ({sizes.warmup_n} events per variant)")
        await core_raw_trial(url, subjects, sizes.warmup_n, "warm", idle)
        await core_raw_trial(url, subjects, sizes.warmup_n, "warm", idle, with_codec=True)
        await core_bus_trial(url, subjects, sizes.warmup_n, "warm", idle)
        raw_core: list[Trial] = []
        codec_core: list[Trial] = []
        bus_core: list[Trial] = []
        for r in range(sizes.rounds):
            say(f"core round {r + 1}/{sizes.rounds}: {sizes.core_n} events raw, raw+codec, then through the bus")
            raw_core.append(await core_raw_trial(url, subjects, sizes.core_n, f"r{r}", idle))
            codec_core.append(await core_raw_trial(url, subjects, sizes.core_n, f"r{r}", idle, with_codec=True))
            bus_core.append(await core_bus_trial(url, subjects, sizes.core_n, f"r{r}", idle))
        detail["core"] = {
            "raw": [t.row() for t in raw_core],
            "raw_codec": [t.row() for t in codec_core],
            "bus": [t.row() for t in bus_core],
            "spread": {"raw": _spread(raw_core), "raw_codec": _spread(codec_core), "bus": _spread(bus_core)},
        }

        # 2. JetStream throughput
        say(f"jetstream warm-up ({sizes.warmup_n} events each)")
        await js_raw_trial(url, subjects, sizes.warmup_n, "warm", sizes)
        await js_bus_trial(url, subjects, sizes.warmup_n, "warm", sizes)
        raw_js: list[Trial] = []
        bus_js: list[Trial] = []
        for r in range(sizes.rounds):
            say(f"jetstream round {r + 1}/{sizes.rounds}: {sizes.js_n} events raw, then through the bus")
            raw_js.append(await js_raw_trial(url, subjects, sizes.js_n, f"r{r}", sizes))
            bus_js.append(await js_bus_trial(url, subjects, sizes.js_n, f"r{r}", sizes))
        detail["jetstream"] = {
            "raw": [t.row() for t in raw_js],
            "bus": [t.row() for t in bus_js],
            "spread": {"raw": _spread(raw_js), "bus": _spread(bus_js)},
        }

        # 3. JetStream latency at a paced rate
        say(f"jetstream latency: {sizes.latency_rate:g} events/s for {sizes.latency_s:g} s, bus then raw")
        warm_s = min(0.5, sizes.latency_s)
        await js_bus_latency(url, subjects, sizes, warm_s)  # warm-up, discarded
        bus_lat, bus_lat_detail = await js_bus_latency(url, subjects, sizes, sizes.latency_s)
        await js_raw_latency(url, subjects, sizes, warm_s)
        raw_lat, raw_lat_detail = await js_raw_latency(url, subjects, sizes, sizes.latency_s)
        detail["latency"] = {"bus": bus_lat_detail, "raw": raw_lat_detail}
    finally:
        with contextlib.suppress(Exception):
            await _delete_streams(url, subjects)

    def rate(trials: Sequence[Trial]) -> float:
        return round(median([t.per_s for t in trials]), 1)

    def ratio(a: float, b: float) -> float:
        return round(a / b, 4) if b else 0.0

    core_bus, core_raw, core_codec = rate(bus_core), rate(raw_core), rate(codec_core)
    js_bus, js_raw = rate(bus_js), rate(raw_js)
    results: dict[str, Any] = {
        "core_msgs_per_s": core_bus,
        "raw_core_msgs_per_s": core_codec,
        "core_ratio": ratio(core_bus, core_codec),
        "raw_core_bytes_msgs_per_s": core_raw,
        "core_bytes_ratio": ratio(core_bus, core_raw),
        "core_lost": sum(t.sent - t.received for t in bus_core),
        "raw_core_lost": sum(t.sent - t.received for t in codec_core),
        "jetstream_events_per_s": js_bus,
        "raw_jetstream_events_per_s": js_raw,
        "jetstream_ratio": ratio(js_bus, js_raw),
        "jetstream_lost": sum(t.sent - t.received for t in bus_js),
        **latency_summary(bus_lat, "jetstream"),
        "jetstream_latency_events": len(bus_lat),
        "jetstream_latency_rate": bus_lat_detail["achieved_rate"],
        **latency_summary(raw_lat, "raw_jetstream"),
        "raw_jetstream_latency_rate": raw_lat_detail["achieved_rate"],
    }
    return results, detail


def run(
    nats_url: str | None = None,
    sizes: Sizes = FULL,
    out: Path | None = None,
    quick: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the benchmark with the given sizes against ``nats_url`` (None: a private server started here), write
    the JSON to ``out`` (default ``bench/results/bus.json``), print the table; returns the report."""
    options = BenchOptions(name=NAME, quick=quick, nats_url=nats_url, out=out or default_out(NAME))
    load_before = machine_info()["load_avg"]
    with nats_server(nats_url) as url:
        server_version = asyncio.run(_server_version(url))
        results, detail = asyncio.run(measure(url, sizes, quiet=quiet))
    params = {**asdict(sizes), "server": "given" if nats_url else "private", "detail": detail}
    machine = {**machine_info(server_version), "load_avg_before": load_before}
    return finish(options, results, TARGETS, params, machine)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(NAME, "Event throughput and latency through the bus layer against raw nats-py.", argv)
    report = run(options.nats_url, QUICK if options.quick else FULL, options.out, quick=options.quick)
    return exit_code(options, report)


if __name__ == "__main__":
    sys.exit(main())
