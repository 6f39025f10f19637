"""The one bus wrapper over nats-py: the connection (opened by ``shared.plumbing.connection``), its streams, typed
publish, core subscriptions, request/reply.

Lifecycle events go through JetStream: published with ``Nats-Msg-Id`` set to the event id (the stream stores a
retried publish once), consumed by durable pull consumers with explicit acks (``shared.plumbing.consumer``, the
consumer loop every service uses). Telemetry and commands use core NATS. Bad input is dead-lettered, on a core
subscription as on a durable consumer: a ``DeadLetter`` naming the reason is stored on the dead-letter stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, Union

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api as js_api

from shared.contract.base import Event, subject_token
from shared.contract.deadletter import DEAD_LETTER_PAYLOAD_LIMIT, DeadLetter
from shared.contract.registry import codec
from shared.contract.subjects import StreamSpec, Subjects
from shared.plumbing.connection import Relinks, open_connection
from shared.plumbing.errors import PermanentError, ServerUnreachable, TemporaryError
from shared.plumbing.retries import JETSTREAM_API, JETSTREAM_PUBLISH
from shared.plumbing.settings import NatsSettings
from shared.plumbing.telemetry import Telemetry

log = logging.getLogger(__name__)


def nats_unreachable(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, says that NATS is not there (no server answered, the
    connection was lost or closed)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ServerUnreachable) and exc.server == "NATS":
            return True
        if isinstance(
            exc, nats.errors.NoServersError | nats.errors.ConnectionClosedError | nats.errors.StaleConnectionError
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


Handler = Callable[[Any], Awaitable[None]]
Responder = Callable[[Any], Awaitable[Event | None]]

DEFAULT_MAX_EVENT_BYTES = 1024 * 1024

_T = TypeVar("_T")
_DUPLICATE_IN_PROCESS = 10158
"""JetStream's answer to a publish sent again while its first copy is still being stored (a retry during a leader
change): temporary; once stored, the next retry is answered as a duplicate with the first copy's ack."""


_NARROW: dict[tuple[type[Event], ...], msgspec.json.Decoder[Any]] = {}
_encode = codec.encode
_replace = msgspec.structs.replace
_DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _narrow_decoder(accepts: tuple[type[Event], ...]) -> msgspec.json.Decoder[Any] | None:
    """A decoder for exactly the kinds a consumer takes (a union is fine), built once per set of kinds."""
    if not accepts:
        return None
    decoder = _NARROW.get(accepts)
    if decoder is None:
        decoder = _NARROW[accepts] = msgspec.json.Decoder(accepts[0] if len(accepts) == 1 else Union[accepts])  # type: ignore[valid-type]  # noqa: UP007
    return decoder


def _scope_problem(subject: str, at: int, field_name: str, event: Event) -> str:
    """Why a command on ``subject`` may not carry ``event``: the subject's token ``at`` names the sender (what its
    credentials allow it to publish on), the body's ``field_name`` must name the same."""
    tokens = subject.split(".")
    named = tokens[at] if at < len(tokens) else ""
    written = getattr(event, field_name, None)
    if not isinstance(written, str) or subject_token(written) != named or not named:
        return f"subject {subject} is {field_name} {named!r}'s; the body says {field_name}={written!r}"
    return ""


class EventTooLarge(ValueError):
    pass


class PublishFailed(RuntimeError):
    """JetStream did not acknowledge an event before the publish deadline."""


class Stoppable(Protocol):
    """What a bus stops first when it closes (a durable consumer, ``shared.plumbing.consumer``)."""

    async def stop(self, grace: float = 10.0) -> None: ...


@dataclass
class Subscription:
    """One core subscription of a bus; ``unsubscribe`` stops its deliveries and lets the bus forget it."""

    bus: Bus
    sub: Any

    async def unsubscribe(self) -> None:
        with contextlib.suppress(ValueError):
            self.bus._subscriptions.remove(self.sub)
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()


class Bus:
    """A connection to NATS under one subject root. Create with ``await Bus.connect(...)``.

    Given several servers (a NATS cluster), the connection fails over to another one when its server goes; what
    was in flight there is sent again: JetStream publishes (same ``Nats-Msg-Id``), requests (``request``), and
    JetStream API calls (``API_DEADLINE``)."""

    API_DEADLINE = 30.0
    """Seconds a JetStream API call (stream and consumer lookups and creation) is tried again while the cluster
    cannot answer it: its server failed over, or a meta or stream leader election is running."""
    LOOKUP_DEADLINE = 20.0
    """How long ``missing_streams`` keeps asking, for all the streams together, while JetStream's API times out
    (a leader election after a server died can outlast a single call's timeout on a loaded machine). A server
    without JetStream answers at once (no responders, 503), so a foreign NATS costs nothing of this."""

    NO_RESPONDER_GRACE = 3.0
    """Seconds a request answered "no responders" is sent again: long enough for responders connected to a server
    that died to resubscribe on another, short enough that a responder that is really gone is said so soon."""

    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        source: str,
        telemetry: Telemetry,
        replicas: int = 1,
        publish_deadline: float = 30.0,
        *,
        owns_connection: bool = True,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.owns_connection = owns_connection
        self.subjects = subjects
        self.source = source
        self.telemetry = telemetry
        self.replicas = replicas
        self.publish_deadline = publish_deadline
        self._consumers: list[Stoppable] = []
        self._subscriptions: list[Any] = []
        self._streams_ready: set[str] = set()
        # Metric children looked up once: ``labels()`` costs a lock and a dict lookup on every message.
        self._published_core = telemetry.published.get("core")
        self._published_js = telemetry.published.get("jetstream")
        self._refused: dict[str, float] = {}
        self.relinks = Relinks()

    # -- connection ---------------------------------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        settings: NatsSettings,
        subjects: Subjects,
        source: str,
        telemetry: Telemetry | None = None,
        connect_timeout: float = 5.0,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Bus:
        telemetry = telemetry or Telemetry(source)
        link = await open_connection(settings, source, telemetry, connect_timeout, on_error)
        bus = cls(link.nc, subjects, source, telemetry, replicas=settings.replicas)
        bus._refused = link.refused
        bus.relinks = link.relinks
        return bus

    def view(self, source: str, telemetry: Telemetry | None = None) -> Bus:
        """This bus's connection under another ``source`` (the events it publishes name it): what each node's
        agent gets in a process that hosts many nodes on one connection. Closing the view stops what was started
        through it (consumers, subscriptions), never the connection."""
        view = Bus(
            self.nc,
            self.subjects,
            source,
            telemetry or self.telemetry,
            self.replicas,
            self.publish_deadline,
            owns_connection=False,
        )
        view.js = self.js
        view._streams_ready = self._streams_ready
        view._refused = self._refused
        view.relinks = self.relinks
        return view

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    def stop_on_close(self, consumer: Stoppable) -> None:
        """Stop ``consumer`` when this bus closes, before its subscriptions go: its handlers get the close's
        ``grace`` to finish."""
        self._consumers.append(consumer)

    async def close(self, grace: float = 10.0) -> None:
        await asyncio.gather(*(c.stop(grace) for c in self._consumers), return_exceptions=True)
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if not self.owns_connection:
            return
        if self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()

    # -- streams ------------------------------------------------------------------------------------------------
    async def ensure_stream(self, spec: StreamSpec, recheck: bool = False) -> None:
        """Create the stream if it is missing; widen its subjects if they changed; let the events stream answer
        direct gets (``allow_direct``: a gateway reads the newest location of a session back that way). Safe to
        call from every service at once: creation races end with one stream and no error. Done once per stream
        and connection, unless ``recheck`` asks again (the stream may have gone with a server: a consumer that
        hears nothing any more)."""
        if recheck:
            self._streams_ready.discard(spec.name)
        if spec.name in self._streams_ready:
            return
        direct = spec.name == self.subjects.events_stream.name  # a gateway reads the last location back directly
        retention = (
            js_api.RetentionPolicy.WORK_QUEUE
            if spec.name == self.subjects.requests_stream.name
            else js_api.RetentionPolicy.LIMITS
        )
        config = js_api.StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            description=spec.description,
            retention=retention,
            storage=js_api.StorageType.FILE,
            num_replicas=self.replicas,
            duplicate_window=120.0,
            max_age=7 * 24 * 3600.0,
            max_msg_size=DEFAULT_MAX_EVENT_BYTES * 4,
            allow_direct=direct or None,
        )
        try:
            info = await self.api(lambda: self.js.stream_info(spec.name))
        except nats.js.errors.NotFoundError:
            try:
                await self.api(lambda: self.js.add_stream(config))
            except nats.js.errors.BadRequestError:
                await self.api(lambda: self.js.stream_info(spec.name))  # created by a peer meanwhile
        else:
            if set(info.config.subjects or ()) != set(spec.subjects):
                await self.api(lambda: self.js.update_stream(config))
            elif direct and not info.config.allow_direct:
                try:  # an events stream made before direct gets were wanted; only the admin may change it
                    await self.js.update_stream(config)
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                    log.warning(
                        "the events stream does not allow direct gets (readers of locations need them); "
                        "any command of the admin's turns them on",
                        extra={"stream": spec.name, "error": str(exc) or type(exc).__name__},
                    )
        self._streams_ready.add(spec.name)

    async def api(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """A JetStream API call, tried again for up to ``API_DEADLINE`` seconds while the cluster cannot answer it
        (a timeout, no responders, 503: ``retries.JETSTREAM_API``): each call here is a lookup or an idempotent
        create."""
        return await JETSTREAM_API.call(call, deadline=time.monotonic() + self.API_DEADLINE)

    async def ensure_streams(self) -> None:
        for spec in self.subjects.streams:
            await self.ensure_stream(spec)

    async def missing_streams(self) -> list[str]:
        """The streams of this root that the server lacks: looked up, never created (what a reader asks before it
        reads, so that it writes nothing into a server that is not this mesh's)."""
        missing = []
        deadline = time.monotonic() + self.LOOKUP_DEADLINE
        for spec in self.subjects.streams:
            lookup = functools.partial(self.js.stream_info, spec.name)
            try:
                await JETSTREAM_API.call(lookup, deadline=deadline)
            except nats.js.errors.NotFoundError:
                missing.append(spec.name)
            except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
                return [s.name for s in self.subjects.streams]  # a server without JetStream has none of them
        return missing

    # -- publishing ---------------------------------------------------------------------------------------------
    def encode(self, event: Event) -> bytes:
        data = codec.encode(event)
        if len(data) > DEFAULT_MAX_EVENT_BYTES:
            raise EventTooLarge(f"{event.kind}: {len(data)} bytes is over the {DEFAULT_MAX_EVENT_BYTES} byte limit")
        return data

    async def publish(self, event: Event) -> None:
        """Publish an event on its subject: JetStream (retried with the same ``Nats-Msg-Id`` until acknowledged
        or the publish deadline passes) or core NATS, as the route says."""
        if not event.source:
            event = _replace(event, source=self.source)
        subject = self.subjects.for_event(event)
        data = _encode(event)
        if len(data) > DEFAULT_MAX_EVENT_BYTES:
            raise EventTooLarge(f"{event.kind}: {len(data)} bytes is over the {DEFAULT_MAX_EVENT_BYTES} byte limit")
        if not self.subjects.is_jetstream(event):
            await self.nc.publish(subject, data)
            self._published_core.n += 1
            return
        await self._publish_js(subject, data, event.event_id)
        self._published_js.n += 1

    async def _publish_js(self, subject: str, data: bytes, msg_id: str) -> None:
        """Publish until acknowledged (``retries.JETSTREAM_PUBLISH``), with the same message id each time; a
        refusal is not tried again: by JetStream (but a 503, or a copy still being stored) or, since this publish
        began, by the server's permissions."""
        started = time.monotonic()
        deadline = started + self.publish_deadline
        headers = {"Nats-Msg-Id": msg_id}

        def refusal(exc: Exception) -> str | None:
            if (
                isinstance(exc, nats.js.errors.APIError)
                and not isinstance(exc, nats.js.errors.ServiceUnavailableError)
                and exc.err_code != _DUPLICATE_IN_PROCESS
            ):
                return f"{subject}: JetStream refused the event: {exc}"
            if self._refused.get(subject.lower(), 0.0) >= started:
                return f"{subject}: this user may not publish here (permissions violation)"
            return None

        try:
            await JETSTREAM_PUBLISH.call(
                lambda: self.js.publish(
                    subject, data, headers=headers, timeout=max(0.05, min(2.0, deadline - time.monotonic()))
                ),
                deadline=deadline,
                when=lambda exc: refusal(exc) is None,
            )
        except JETSTREAM_PUBLISH.on as exc:
            reason = refusal(exc) or f"{subject}: no JetStream ack within {self.publish_deadline}s: {exc}"
            raise PublishFailed(reason) from exc

    async def publish_many(self, events: Sequence[Event], window: int = 1024) -> None:
        """Publish many JetStream events with up to ``window`` acknowledgements outstanding; each one still
        deduplicated by its event id. Raises ``PublishFailed`` if any was not acknowledged."""
        pending: list[tuple[asyncio.Future[Any], str, bytes, str]] = []

        async def settle(batch: list[tuple[asyncio.Future[Any], str, bytes, str]]) -> None:
            if not batch:
                return
            done, _ = await asyncio.wait([f for f, *_ in batch], timeout=5.0)
            for future, subject, data, msg_id in batch:
                if future in done and not future.cancelled() and future.exception() is None:
                    continue
                future.cancel()  # retried one by one, still deduplicated by the same id
                await self._publish_js(subject, data, msg_id)

        for event in events:
            if not event.source:
                event = msgspec.structs.replace(event, source=self.source)
            subject = self.subjects.for_event(event)
            data = self.encode(event)
            if not self.subjects.is_jetstream(event):
                await self.nc.publish(subject, data)
                continue
            future = await self.js.publish_async(subject, data, headers={"Nats-Msg-Id": event.event_id})
            pending.append((future, subject, data, event.event_id))
            if len(pending) >= window:
                await settle(pending)
                pending = []
        await settle(pending)
        self._published_js.inc(len(events))

    # -- core subscriptions and request/reply -------------------------------------------------------------------
    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        accepts: tuple[type[Event], ...],
        queue: str = "",
        name: str = "",
    ) -> Subscription:
        """Core NATS subscription (telemetry). Bad input is dead-lettered like on a durable consumer."""
        label = name or subject
        handled = self.telemetry.messages.get(label, "ack")
        failed = self.telemetry.messages.get(label, "error")

        narrow = _narrow_decoder(accepts)

        async def on_msg(msg: Msg) -> None:
            event: Event | None = None
            data = msg.data
            if narrow is not None and len(data) <= DEFAULT_MAX_EVENT_BYTES:
                try:
                    event = narrow.decode(data)
                except _DECODE_ERRORS:
                    pass  # the precise path below names what is wrong
                else:
                    reason = self.subjects.subject_problem(event, msg.subject)
                    if reason:
                        await self.dead_letter(label, msg, reason, None, 0)
                        return
            if event is None:
                event, reason = self.decode(data, accepts, DEFAULT_MAX_EVENT_BYTES, msg.subject)
                if event is None:
                    await self.dead_letter(label, msg, reason, None, 0)
                    return
            try:
                await handler(event)
                handled.n += 1
            except TemporaryError as exc:  # a dependency is down: said once, no stack trace
                log.warning("core handler could not act", extra={"subject": msg.subject, "error": str(exc)})
                failed.inc()
            except Exception as exc:
                log.exception("core handler failed", extra={"subject": msg.subject, "error": str(exc)})
                failed.inc()

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._subscriptions.append(sub)
        await self._subscribed()
        return Subscription(self, sub)

    async def _subscribed(self) -> None:
        """Once this returns the server has the subscription: what is published after it is delivered. Without
        it, a service that says it started can miss the first messages sent to it."""
        with contextlib.suppress(Exception):  # disconnected: the subscription is sent again on reconnect
            await self.nc.flush(timeout=2)

    async def request(self, subject: str, event: Event, timeout: float = 5.0) -> Event:
        """Send a command and wait for its typed reply. Raises ``TimeoutError`` when nobody answers in time.

        Within ``timeout`` the command is sent again when the connection fails over while it waits (the request,
        or its reply, may have gone with the old server), and for the first ``NO_RESPONDER_GRACE`` seconds while
        nobody subscribes (the responders may be failing over too); commands are idempotent, so one answered
        twice changes nothing. Hand-written, not a ``shared.plumbing.retries`` policy: a failover's re-send is no
        failure and waits for nothing, while the reply is awaited against the next relink."""
        if not event.source:
            event = msgspec.structs.replace(event, source=self.source)
        data = self.encode(event)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        patience = loop.time() + min(timeout, self.NO_RESPONDER_GRACE)
        pause = 0.05
        while True:
            relinked = asyncio.ensure_future(self.relinks.next().wait())
            attempt = asyncio.ensure_future(self.nc.request(subject, data, timeout=max(0.01, deadline - loop.time())))
            attempt.add_done_callback(_retrieved)  # an attempt given up on may still fail: nobody need hear it
            try:
                await asyncio.wait((attempt, relinked), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                attempt.cancel()
                raise
            finally:
                relinked.cancel()
            if not attempt.done():  # failed over meanwhile: ask the new server
                attempt.cancel()
                with contextlib.suppress(BaseException):
                    await attempt
                if loop.time() < deadline:
                    continue
                raise TimeoutError(f"{subject}: no reply within {timeout}s")
            try:
                reply = attempt.result()
            except nats.errors.NoRespondersError:
                if loop.time() + pause >= patience:
                    raise TimeoutError(f"{subject}: no responder") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            except nats.errors.TimeoutError:
                raise TimeoutError(f"{subject}: no reply within {timeout}s") from None
            return codec.decode(reply.data)

    async def serve(
        self,
        subject: str,
        responder: Responder,
        accepts: tuple[type[Event], ...],
        queue: str = "",
        scope_field: str = "",
    ) -> Subscription:
        """Answer commands on ``subject``. A bad command is dead-lettered and answered with a ``DeadLetter``
        naming the reason, so the caller learns why instead of timing out.

        ``scope_field``: ``subject`` has one ``*`` token naming who may send there (a pod): a command whose body
        field of that name says otherwise is refused the same way. The subject is what the sender's credentials
        allowed it to publish on; the body is only what it wrote."""
        scope_at = subject.split(".").index("*") if scope_field else -1

        async def on_msg(msg: Msg) -> None:
            event, reason = self.decode(msg.data, accepts, DEFAULT_MAX_EVENT_BYTES, msg.subject)
            if event is not None and scope_at >= 0:
                reason = _scope_problem(msg.subject, scope_at, scope_field, event)
                if reason:
                    event = None
            answer: Event | None
            if event is None:
                answer = await self.dead_letter(subject, msg, reason, None, 0)
            else:
                try:
                    answer = await responder(event)
                except PermanentError as exc:
                    answer = await self.dead_letter(subject, msg, str(exc), None, 0)
                except TemporaryError as exc:
                    log.warning("command not answered now", extra={"subject": msg.subject, "error": str(exc)})
                    answer = DeadLetter(origin_subject=msg.subject, reason=f"temporary: {exc}", source=self.source)
                except Exception as exc:
                    log.exception("command handler failed", extra={"subject": msg.subject})
                    answer = DeadLetter(origin_subject=msg.subject, reason=f"temporary: {exc}", source=self.source)
            if msg.reply and answer is not None:
                data = codec.encode(answer)
                limit = min(DEFAULT_MAX_EVENT_BYTES, self.nc.max_payload or DEFAULT_MAX_EVENT_BYTES)
                if len(data) > limit:  # never dropped: the caller hears why
                    reason = f"the answer ({answer.kind}, {len(data)} bytes) is over the bus's {limit} byte limit"
                    log.error("answer too large", extra={"subject": msg.subject, "bytes": len(data)})
                    data = codec.encode(DeadLetter(origin_subject=msg.subject, reason=reason, source=self.source))
                try:
                    await msg.respond(data)
                except Exception as exc:
                    log.warning("answer not sent", extra={"subject": msg.subject, "error": str(exc)})

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._subscriptions.append(sub)
        await self._subscribed()
        return Subscription(self, sub)

    async def answer(
        self, subject: str, respond: Callable[[bytes], Awaitable[bytes]], queue: str = "", name: str = ""
    ) -> Subscription:
        """Answer requests on ``subject`` that are no event of ours (a protocol of its own: nats-server's
        authorization requests): ``respond`` gets the payload and returns the reply. One that raises is logged
        and answered with an empty reply, which such a protocol reads as a refusal."""
        label = name or subject
        handled = self.telemetry.messages.get(label, "ack")
        failed = self.telemetry.messages.get(label, "error")

        async def on_msg(msg: Msg) -> None:
            try:
                reply = await respond(msg.data)
                handled.n += 1
            except Exception:
                log.exception("request not answered", extra={"subject": label})
                failed.inc()
                reply = b""
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(reply)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._subscriptions.append(sub)
        await self._subscribed()
        return Subscription(self, sub)

    async def listen(self, subject: str, on_msg: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """Hand ``on_msg`` every message on ``subject`` as it comes, undecoded: for what the server says (its
        JetStream advisories), which is no event of ours and needs no answer."""
        sub = await self.nc.subscribe(subject, cb=on_msg)
        self._subscriptions.append(sub)
        return Subscription(self, sub)

    # -- bad input ----------------------------------------------------------------------------------------------
    def decode(
        self, data: bytes, accepts: tuple[type[Event], ...], max_bytes: int, subject: str = ""
    ) -> tuple[Event | None, str]:
        """The event, or why there is none. With ``subject``, an event whose body contradicts the subject it
        came on (``Subjects.subject_problem``) is refused too."""
        if len(data) > max_bytes:
            return None, f"oversized: {len(data)} bytes is over the {max_bytes} byte limit"
        narrow = _narrow_decoder(accepts)
        if narrow is not None:
            try:  # the common case, at the cost of one Struct; anything else takes the precise path below
                event = narrow.decode(data)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            else:
                problem = self.subjects.subject_problem(event, subject) if subject else ""
                return (None, problem) if problem else (event, "")
        try:
            event = codec.decode(data)
        except msgspec.ValidationError as exc:
            return None, f"invalid event: {exc}"
        except msgspec.DecodeError as exc:
            return None, f"malformed payload: {exc}"
        if accepts and not isinstance(event, accepts):
            names = ", ".join(t.__struct_config__.tag for t in accepts)  # type: ignore[misc]
            return None, f"unexpected kind {event.kind!r} here; this consumer takes: {names}"
        problem = self.subjects.subject_problem(event, subject) if subject else ""
        return (None, problem) if problem else (event, "")

    async def dead_letter(
        self,
        consumer: str,
        msg: Msg,
        reason: str,
        seq: int | None,
        deliveries: int,
        stream: str = "",
    ) -> DeadLetter:
        """Store a ``DeadLetter`` for ``msg`` on the dead-letter stream, naming ``reason`` and the ``consumer`` (or
        the subscription's label) that refused it; raises when it cannot be stored. A letter for a stream message
        (``seq``) is published under an id of its own, so storing it again (the loop and the max-deliveries
        advisory both see it) stores it once."""
        data = msg.data or b""
        # the letter's subject names its consumer, and so does its body; a core subscription's label (a subject
        # pattern) is no token: its letters go to ``core``, and ``origin_subject`` says where they came from
        safe_consumer = consumer if all(c.isalnum() or c in "-_" for c in consumer) else "core"
        letter = DeadLetter(
            origin_subject=msg.subject,
            reason=reason,
            consumer=safe_consumer,
            stream=stream,
            stream_seq=seq,
            deliveries=deliveries,
            payload_size=len(data),
            payload_sha256=hashlib.sha256(data).hexdigest(),
            payload=data if len(data) <= DEAD_LETTER_PAYLOAD_LIMIT else data[:1024],
            payload_truncated=len(data) > DEAD_LETTER_PAYLOAD_LIMIT,
            source=self.source,
        )
        log.warning(
            "dead-lettered",
            extra={"consumer": consumer, "subject": msg.subject, "reason": reason, "stream_seq": seq},
        )
        self.telemetry.dead_letters.labels(consumer).inc()
        letter_subject = self.subjects.deadletter(safe_consumer)
        msg_id = f"dl-{stream}-{seq}-{consumer}" if seq is not None else letter.event_id
        await self.ensure_stream(self.subjects.deadletter_stream)
        await self._publish_js(letter_subject, codec.encode(letter), msg_id)
        return letter
