"""Durable JetStream consumers over the bus (``shared.plumbing.bus``): what one is (``ConsumerSpec``), and the one
consumer loop every service takes its lifecycle events with (``consume``).

A durable pull consumer is made (or repaired) on its stream, with explicit acks. The loop owns acknowledgement;
handlers never ack by hand:

- decoded and handled: ``ack``;
- ``TemporaryError`` or any unexpected exception: ``nak`` with a delay from the backoff schedule;
- ``PermanentError``, an undecodable payload, an unknown kind, a kind this consumer does not take, an oversized
  message, or a message out of redeliveries: a ``DeadLetter`` is stored first, then the message is terminated.
  If the dead letter cannot be stored, the message is nak'ed instead, so nothing is lost.

Handlers that run long are kept alive with ``in_progress()`` automatically, every third of ``ack_wait``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api as js_api

from shared.contract.base import Event
from shared.contract.subjects import StreamSpec, Subjects
from shared.plumbing.bus import DEFAULT_MAX_EVENT_BYTES, Bus, Handler
from shared.plumbing.errors import PermanentError, TemporaryError

log = logging.getLogger(__name__)

Refused = Callable[[str, bytes, str], Awaitable[None]]

PULL_EXPIRES = 1.0
"""Seconds a pull request stays open on the server."""


@dataclass(frozen=True)
class NodeScope:
    """What makes a durable consumer one node's: the node, the route kinds it follows (each route has a
    ``{node}`` field) and the consumer's name without the node (``family``). One node's process consumes exactly
    the spec's ``durable`` and ``filter_subjects``; a process hosting many nodes' agents (the hollow host,
    ``shared.host.hollow``) consumes each family once for all of them and hands every event to the handler of
    the node it names, so its cost does not grow with the nodes it hosts."""

    node: str
    family: str
    kinds: tuple[str, ...]


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer and how its loop behaves.

    ``accepts`` lists the event types the handler takes; anything else that arrives on the filter subjects is a
    broken contract and is dead-lettered. ``backoff`` is the nak delay for the n-th failed delivery (the last
    value repeats): the server redelivers after it, so it is no ``shared.plumbing.retries`` policy (nothing here
    waits).
    """

    durable: str
    filter_subjects: tuple[str, ...]
    accepts: tuple[type[Event], ...]
    stream: StreamSpec
    max_deliver: int = 5
    ack_wait: float = 30.0
    backoff: tuple[float, ...] = (0.5, 2.0, 5.0, 15.0)
    concurrency: int = 8
    batch: int = 64
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    deliver_new_only: bool = False
    on_refused: Refused | None = None
    """Called with (subject, payload, reason) before a message is dead-lettered as bad input (undecodable,
    invalid, a subject its body contradicts, or refused by the handler as permanent), so the service can still
    answer whoever waits on it (a drain request gets its failed verdict). Never raises into the loop."""
    node_scope: NodeScope | None = None
    """Set when the consumer follows one node's events (``node_consumer`` builds such specs)."""


def node_consumer(
    subjects: Subjects,
    service: str,
    purpose: str,
    node: str,
    kinds: tuple[str, ...],
    accepts: tuple[type[Event], ...],
    **options: Any,
) -> ConsumerSpec:
    """The durable consumer of one node's events of ``kinds`` (routes with a ``{node}`` field, on the events
    stream): named ``<service>-<purpose>-<node>``, filtered to that node's subjects, and scoped (``NodeScope``) so
    that a host of many nodes can share one consumer among them. ``options`` are other ``ConsumerSpec`` fields."""
    return ConsumerSpec(
        durable=subjects.durable(service, purpose, node),
        filter_subjects=tuple(subjects.pattern(kind, node=node) for kind in kinds),
        accepts=accepts,
        stream=options.pop("stream", subjects.events_stream),
        node_scope=NodeScope(node=node, family=subjects.durable(service, purpose), kinds=kinds),
        **options,
    )


@dataclass
class ConsumerStats:
    handled: int = 0
    retried: int = 0
    dead_lettered: int = 0
    last_error: str = ""
    fetch_errors: int = 0


@dataclass
class Consumer:
    spec: ConsumerSpec
    task: asyncio.Task[None] | None = None
    stats: ConsumerStats = field(default_factory=ConsumerStats)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    meters: tuple[Any, Any] | None = None  # (handler seconds, acks) metric children, looked up once

    async def stop(self, grace: float = 10.0) -> None:
        """Stop fetching, let in-flight handlers finish for up to ``grace`` seconds, nak what is left."""
        self.stopping.set()
        if self.task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=grace + 1.0)
        except (TimeoutError, asyncio.CancelledError):
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


async def consume(bus: Bus, spec: ConsumerSpec, handler: Handler) -> Consumer:
    """Start the consumer loop for ``spec`` on ``bus`` in the background; returns once the consumer exists. The
    loop stops (its handlers given the close's grace) when the bus closes, or with ``Consumer.stop``."""
    await bus.ensure_stream(spec.stream)
    await bus.ensure_stream(bus.subjects.deadletter_stream)
    await ensure_consumer(bus, spec)
    bus.telemetry.dead_letters.labels(spec.durable)  # its series exists from the start, at 0 (rates need it)
    consumer = Consumer(spec=spec)
    await watch_exhausted(bus, spec)
    consumer.task = asyncio.create_task(_ConsumerLoop(bus, spec, handler, consumer).run(), name=spec.durable)
    bus.stop_on_close(consumer)
    return consumer


async def watch_exhausted(bus: Bus, spec: ConsumerSpec) -> None:
    """Dead-letter what the server gave up on without the loop seeing the last failure: a message whose handler
    crashed the process or hung past ``ack_wait`` on its last delivery. The server announces it on the
    MAX_DELIVERIES advisory with the stream sequence; the message is read back from the stream. The dead letter's
    id is the same as the loop's own, so both paths store it once."""

    async def on_advisory(msg: Msg) -> None:
        try:
            advisory = msgspec.json.decode(msg.data)
            seq = int(advisory["stream_seq"])
            stored = await bus.js.get_msg(spec.stream.name, seq)
        except Exception as exc:
            log.warning("max-deliveries advisory not handled", extra={"error": repr(exc)})
            return
        letter = Msg(bus.nc, subject=stored.subject or "", data=stored.data or b"")
        deliveries = int(advisory.get("deliveries", spec.max_deliver))
        if spec.on_refused is not None:
            with contextlib.suppress(Exception):
                await spec.on_refused(
                    letter.subject, letter.data, f"exhausted {deliveries} deliveries without an answer"
                )
        with contextlib.suppress(Exception):
            await bus.dead_letter(
                spec.durable,
                letter,
                f"exhausted {deliveries} deliveries without an answer (handler crashed or hung)",
                seq,
                deliveries,
                stream=spec.stream.name,
            )

    await bus.listen(f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{spec.stream.name}.{spec.durable}", on_advisory)


def consumer_config(spec: ConsumerSpec, start_after: int | None = None) -> js_api.ConsumerConfig:
    """The durable's configuration as ``spec`` says; ``start_after``: made again after a repair, delivering from
    the message after that stream sequence (where the one it replaces had got to)."""
    policy = js_api.DeliverPolicy.NEW if spec.deliver_new_only else js_api.DeliverPolicy.ALL
    return js_api.ConsumerConfig(
        durable_name=spec.durable,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait,
        max_deliver=spec.max_deliver,
        max_ack_pending=max(spec.concurrency * 4, spec.batch * 2),
        deliver_policy=policy if start_after is None else js_api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=None if start_after is None else start_after + 1,
        filter_subjects=list(spec.filter_subjects) if len(spec.filter_subjects) > 1 else None,
        filter_subject=spec.filter_subjects[0] if len(spec.filter_subjects) == 1 else None,
    )


def consumer_drift(have: js_api.ConsumerConfig, want: js_api.ConsumerConfig) -> list[str]:
    """What of a durable's configuration as stored (``have``) differs from what its owner wants: its filter
    subjects, ack policy, ack wait, max deliveries, max acks pending, deliver policy (a start sequence stands for
    ALL or NEW: it is how a repaired consumer resumes), and that it stays a pull consumer that delivers whole
    messages, is never removed for idling and has no backoff of someone else's. Empty when nothing drifted."""

    def filters(config: js_api.ConsumerConfig) -> set[str]:
        return set(config.filter_subjects or ()) | ({config.filter_subject} if config.filter_subject else set())

    drift = [
        name
        for name, differs in (
            ("filter_subjects", filters(have) != filters(want)),
            ("ack_policy", have.ack_policy != want.ack_policy),
            ("ack_wait", abs((have.ack_wait or 0.0) - (want.ack_wait or 0.0)) > 1e-3),
            ("max_deliver", have.max_deliver != want.max_deliver),
            ("max_ack_pending", have.max_ack_pending != want.max_ack_pending),
            (
                "deliver_policy",
                have.deliver_policy not in (want.deliver_policy, js_api.DeliverPolicy.BY_START_SEQUENCE),
            ),
            ("deliver_subject", bool(have.deliver_subject)),
            ("headers_only", bool(have.headers_only)),
            ("inactive_threshold", bool(have.inactive_threshold)),
            ("backoff", bool(have.backoff)),
        )
        if differs
    ]
    return drift


async def ensure_consumer(bus: Bus, spec: ConsumerSpec) -> None:
    """Create the durable consumer, or check the one there against ``spec`` (``consumer_drift``): one that
    drifted (another user changed its filter, its acks, its deliveries) is put back, updated in place where
    JetStream allows it, else deleted and made again from where it had got to (its ack floor), so that nothing is
    skipped; what was delivered but not acknowledged is delivered again (handlers are idempotent). Only the owner
    may do either: no other user may touch the consumer (``shared.contract.permissions``)."""
    config = consumer_config(spec)
    stream = spec.stream.name
    try:
        info = await bus.api(lambda: bus.js.consumer_info(stream, spec.durable))
    except nats.js.errors.NotFoundError:
        try:
            await bus.api(lambda: bus.js.add_consumer(stream, config))
            return
        except nats.js.errors.BadRequestError:
            info = await bus.api(lambda: bus.js.consumer_info(stream, spec.durable))  # made by a peer meanwhile
    drift = consumer_drift(info.config, config)
    if not drift:
        return
    log.warning("consumer configuration drifted; repairing", extra={"consumer": spec.durable, "drift": drift})
    with contextlib.suppress(nats.js.errors.APIError):  # JetStream refuses to update some fields in place
        await bus.js.add_consumer(stream, config)
        info = await bus.js.consumer_info(stream, spec.durable)
        if not consumer_drift(info.config, config):
            return
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await bus.js.delete_consumer(stream, spec.durable)
    try:
        await bus.js.add_consumer(stream, consumer_config(spec, start_after=floor))
    except nats.js.errors.BadRequestError:
        await bus.js.consumer_info(stream, spec.durable)  # a peer repaired it first
    log.warning("consumer made again from where it was", extra={"consumer": spec.durable, "after_seq": floor})


def _delivery(msg: Msg) -> tuple[int | None, int]:
    """(stream sequence, deliveries so far), parsed from the reply subject: only on the failure paths."""
    metadata = msg.metadata
    return (metadata.sequence.stream if metadata.sequence else None), (metadata.num_delivered or 1)


class _ConsumerLoop:
    """The running loop of one durable consumer on one bus: the pull, and what becomes of each message."""

    def __init__(self, bus: Bus, spec: ConsumerSpec, handler: Handler, consumer: Consumer) -> None:
        self.bus = bus
        self.spec = spec
        self.handler = handler
        self.consumer = consumer

    async def run(self) -> None:
        """A continuous pull. Pull requests stay open on the server, which pushes each message into this loop's
        inbox as soon as it is stored; each is handled as it comes. No ``fetch()`` round trip per batch (nor its
        wait for a batch to fill), no task per message inside nats-py.

        Never more is asked for than can start at once (``concurrency`` minus handlers running, at most
        ``batch``), so no message waits here while its ``ack_wait`` runs. A request that ends (expired, no
        messages, 409) is written off and renewed. When nothing at all has been heard for a few expiry periods (a
        request lost with a connection or with the server that led the consumer), what was asked for is written
        off and asked for again at once, and the stream and consumer are ensured again beside the pull, never
        before it: while a JetStream cluster elects a new meta leader its API may not answer for tens of
        seconds, but the consumer's new leader serves pulls as soon as it is elected (a loop that waited for
        the API first heard nothing for as long; seen in the fault suite's leader kills). A consumer or stream
        the server says is gone (409 other than a leadership change, 503 no responders) is ensured the same
        way."""
        bus, spec, consumer = self.bus, self.spec, self.consumer
        nc = bus.nc
        loop = asyncio.get_running_loop()
        next_subject = f"{bus.js._prefix}.CONSUMER.MSG.NEXT.{spec.stream.name}.{spec.durable}"
        inbox = nc.new_inbox()
        slots = asyncio.Semaphore(spec.concurrency)
        inflight: set[asyncio.Task[None]] = set()
        most = min(spec.batch, spec.concurrency)
        low_water = max(1, most // 2)
        owed = 0  # messages asked for, neither delivered yet nor written off by a status message
        heard = time.monotonic()
        ensuring: asyncio.Task[None] | None = None
        wake = asyncio.Event()

        def finished(task: asyncio.Task[None]) -> None:
            inflight.discard(task)
            slots.release()
            wake.set()

        async def on_msg(msg: Msg) -> None:
            nonlocal owed, heard
            heard = time.monotonic()
            status = msg.headers.get("Status") if msg.headers and not msg.data else None
            if status:
                if status != "100":  # not a heartbeat: 404 no messages, 408 expired, 409 ...: the request is over
                    pending = msg.headers.get("Nats-Pending-Messages") if msg.headers else None
                    owed = max(0, owed - int(pending)) if pending else 0
                    if status in ("409", "503"):
                        description = (msg.headers or {}).get("Description", "")
                        consumer.stats.fetch_errors += 1
                        consumer.stats.last_error = f"pull: {status} {description}"
                        if "leadership change" not in description.lower():
                            heard = 0.0  # the consumer or its stream may be gone: ensure them again
                    wake.set()
                return
            owed = max(0, owed - 1)
            if consumer.stopping.is_set():
                with contextlib.suppress(Exception):
                    await msg.nak()
                return
            await slots.acquire()
            task = asyncio.create_task(self._handle(msg))
            inflight.add(task)
            task.add_done_callback(finished)

        ticker: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal ticker
            wake.set()
            ticker = loop.call_later(PULL_EXPIRES, tick)

        ticker = loop.call_later(PULL_EXPIRES, tick)
        stop_watch = asyncio.ensure_future(consumer.stopping.wait())
        stop_watch.add_done_callback(lambda _: wake.set())
        sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=max(most * 4, 1024))
        wake.set()
        try:
            while True:
                await wake.wait()
                wake.clear()
                if consumer.stopping.is_set():
                    break
                if time.monotonic() - heard > 3 * PULL_EXPIRES:
                    # silence: the requests were lost with a connection or a server; ask again, and ensure
                    # the stream and consumer beside the pull (the next silence tries again if that fails)
                    owed, heard = 0, time.monotonic()
                    if ensuring is None or ensuring.done():
                        ensuring = asyncio.create_task(self._ensure(), name=f"{spec.durable}-ensure")
                room = min(spec.batch, spec.concurrency - len(inflight)) - owed
                if room > 0 and (owed == 0 or room >= low_water):
                    owed += room
                    request = {"batch": room, "expires": int(PULL_EXPIRES * 1e9)}
                    await nc.publish(next_subject, json.dumps(request).encode(), reply=inbox)
        finally:
            ticker.cancel()
            stop_watch.cancel()
            if ensuring is not None:
                ensuring.cancel()
            if inflight:
                _, pending = await asyncio.wait(inflight, timeout=10.0)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            # messages the open requests still deliver meanwhile are nak'ed by on_msg; later ones wait ack_wait
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _ensure(self) -> None:
        """The stream and the durable consumer made again if they are gone (after a silence or a refusal)."""
        spec, consumer = self.spec, self.consumer
        try:
            await self.bus.ensure_stream(spec.stream, recheck=True)
            await ensure_consumer(self.bus, spec)
        except Exception as exc:
            consumer.stats.fetch_errors += 1
            consumer.stats.last_error = f"pull: {exc!r}"
            log.warning("consumer not ensured; trying again", extra={"consumer": spec.durable, "error": repr(exc)})

    async def _handle(self, msg: Msg) -> None:
        spec, consumer = self.spec, self.consumer
        meters = consumer.meters
        if meters is None:
            meters = consumer.meters = (
                self.bus.telemetry.handler_seconds.labels(spec.durable),
                self.bus.telemetry.messages.get(spec.durable, "ack"),
            )
        event, reason = self.bus.decode(msg.data, spec.accepts, spec.max_event_bytes, msg.subject)
        if event is None:
            await self._reject(msg, reason, *_delivery(msg))
            return
        loop = asyncio.get_running_loop()
        heartbeat: asyncio.TimerHandle | None = None

        def keep_alive() -> None:
            nonlocal heartbeat
            asyncio.ensure_future(msg.in_progress())
            heartbeat = loop.call_later(spec.ack_wait / 3, keep_alive)

        heartbeat = loop.call_later(spec.ack_wait / 3, keep_alive)
        started = time.perf_counter()
        try:
            await self.handler(event)
        except PermanentError as exc:
            heartbeat.cancel()
            await self._reject(msg, f"permanent: {exc}", *_delivery(msg))
            return
        except asyncio.CancelledError:
            heartbeat.cancel()
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Exception as exc:
            heartbeat.cancel()
            await self._retry(msg, exc, *_delivery(msg))
            return
        heartbeat.cancel()
        meters[0].observe(time.perf_counter() - started)
        await msg.ack()
        consumer.stats.handled += 1
        meters[1].inc()

    async def _retry(self, msg: Msg, exc: Exception, seq: int | None, deliveries: int) -> None:
        spec = self.spec
        if isinstance(exc, TemporaryError):
            log.info("temporary failure; will retry", extra={"consumer": spec.durable, "error": str(exc)})
        else:
            log.exception("handler raised; will retry", extra={"consumer": spec.durable})
        self.consumer.stats.last_error = repr(exc)
        if deliveries >= spec.max_deliver:
            await self._reject(msg, f"exhausted {deliveries} deliveries; last error: {exc!r}", seq, deliveries)
            return
        delay = exc.delay if isinstance(exc, TemporaryError) and exc.delay is not None else None
        if delay is None:
            delay = spec.backoff[min(deliveries - 1, len(spec.backoff) - 1)] if spec.backoff else 1.0
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)
        self.consumer.stats.retried += 1
        self.bus.telemetry.messages.get(spec.durable, "nak").inc()

    async def _reject(self, msg: Msg, reason: str, seq: int | None, deliveries: int) -> None:
        spec = self.spec
        if spec.on_refused is not None:
            try:
                await spec.on_refused(msg.subject, msg.data or b"", reason)
            except Exception as exc:  # the dead letter below still keeps the message and the reason
                log.warning("refusal not answered", extra={"consumer": spec.durable, "error": str(exc)})
        try:
            await self.bus.dead_letter(spec.durable, msg, reason, seq, deliveries, stream=spec.stream.name)
        except Exception as exc:
            log.warning("dead letter not stored; message kept", extra={"consumer": spec.durable, "error": str(exc)})
            with contextlib.suppress(Exception):
                await msg.nak(delay=spec.backoff[-1] if spec.backoff else 5.0)
            return
        with contextlib.suppress(Exception):
            await msg.term()
        self.consumer.stats.dead_lettered += 1
        self.bus.telemetry.messages.get(spec.durable, "term").inc()
