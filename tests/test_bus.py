"""The bus against a real NATS server: delivery, deduplication, retries, dead letters, restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json

import msgspec
import pytest

from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.registry import codec
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.consumer import ConsumerSpec, consume, watch_exhausted
from shared.plumbing.errors import PermanentError, TemporaryError
from shared.plumbing.settings import Settings
from tests.helpers import eventually, with_nats
from tests.servers import NatsServer


def drain_spec(subjects: Subjects, durable: str = "checkpoint-drain", **kw: object) -> ConsumerSpec:
    return ConsumerSpec(
        durable=durable,
        filter_subjects=(subjects.pattern("node.drain.requested"),),
        accepts=(DrainRequested,),
        stream=subjects.events_stream,
        **kw,  # type: ignore[arg-type]
    )


async def collect_dead_letters(bus: Bus, subjects: Subjects) -> list[DeadLetter]:
    letters: list[DeadLetter] = []

    async def on_letter(event: DeadLetter) -> None:
        letters.append(event)

    spec = ConsumerSpec(
        durable="test-deadletters",
        filter_subjects=(f"{subjects.root}.deadletter.>",),
        accepts=(DeadLetter,),
        stream=subjects.deadletter_stream,
    )
    await consume(bus, spec, on_letter)
    return letters


async def test_event_from_one_process_handled_once_by_durable_consumer_in_another(
    settings: Settings, subjects: Subjects, bus: Bus
) -> None:
    consumer_bus = await Bus.connect(settings.nats, subjects, "checkpoint")
    try:
        seen: list[DrainRequested] = []

        async def handle(event: DrainRequested) -> None:
            seen.append(event)

        await consume(consumer_bus, drain_spec(subjects), handle)
        event = DrainRequested(node="node-1", drain_id="d1")
        await bus.publish(event)
        await bus.publish(event)  # a retried publish: same event_id, deduplicated by the stream
        await bus.publish(DrainRequested(node="node-2", drain_id="d2"))
        await eventually(lambda: len(seen) >= 2)
        # a last event after them: once it is handled, a duplicate of d1 would have been handled before it
        await bus.publish(DrainRequested(node="node-3", drain_id="d3"))
        await eventually(lambda: any(e.drain_id == "d3" for e in seen))
        assert sorted(e.drain_id for e in seen) == ["d1", "d2", "d3"]
        assert seen[0].source == "test"

        async def all_acked() -> bool:
            info = await bus.js.consumer_info(subjects.events_stream.name, "checkpoint-drain")
            return info.num_ack_pending == 0 and info.num_pending == 0

        await eventually(all_acked)  # d3's ack follows its handler
    finally:
        await consumer_bus.close(grace=1)


async def test_temporary_error_redelivers_after_its_delay(bus: Bus, subjects: Subjects) -> None:
    attempts: list[float] = []

    async def handle(event: DrainRequested) -> None:
        attempts.append(asyncio.get_running_loop().time())
        if len(attempts) == 1:
            raise TemporaryError("store not reachable yet", delay=0.4)

    await consume(bus, drain_spec(subjects), handle)
    await bus.publish(DrainRequested(node="n1", drain_id="d1"))
    await eventually(lambda: len(attempts) == 2)
    assert attempts[1] - attempts[0] >= 0.35


async def test_unexpected_exception_retries_then_dead_letters_when_deliveries_run_out(
    bus: Bus, subjects: Subjects
) -> None:
    letters = await collect_dead_letters(bus, subjects)
    attempts = 0

    async def handle(event: DrainRequested) -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("boom")

    await consume(bus, drain_spec(subjects, max_deliver=3, backoff=(0.05,)), handle)
    await bus.publish(DrainRequested(node="n1", drain_id="d1"))
    await eventually(lambda: letters)
    assert attempts == 3
    assert "exhausted 3 deliveries" in letters[0].reason and "boom" in letters[0].reason
    assert letters[0].deliveries == 3


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{not json", "malformed payload"),
        (b'{"kind":"node.exploded","node":"n1"}', "invalid event"),
        (b'{"kind":"node.drain.requested","node":42,"drain_id":"d"}', "Expected `str`, got `int`"),
        (b'{"kind":"node.drain.requested","drain_id":"d"}', "missing required field `node`"),
        (b'{"kind":"node.drain.requested","node":"a*b","drain_id":"d"}', "invalid event"),
    ],
)
async def test_bad_payloads_are_dead_lettered_with_a_reason_and_the_consumer_keeps_going(
    bus: Bus, subjects: Subjects, payload: bytes, reason: str
) -> None:
    letters = await collect_dead_letters(bus, subjects)
    seen: list[DrainRequested] = []

    async def handle(event: DrainRequested) -> None:
        seen.append(event)

    await consume(bus, drain_spec(subjects), handle)
    await bus.js.publish(f"{subjects.root}.node.n1.drain.requested", payload)
    await bus.publish(DrainRequested(node="n1", drain_id="after"))
    await eventually(lambda: letters and seen)
    assert reason in letters[0].reason
    assert letters[0].payload == payload
    assert letters[0].origin_subject == f"{subjects.root}.node.n1.drain.requested"
    assert letters[0].stream_seq is not None
    assert [e.drain_id for e in seen] == ["after"]


async def test_oversized_and_wrong_kind_messages_are_dead_lettered(bus: Bus, subjects: Subjects) -> None:
    letters = await collect_dead_letters(bus, subjects)

    async def handle(event: DrainRequested) -> None:
        pass

    await consume(bus, drain_spec(subjects, max_event_bytes=2048), handle)
    big = DrainRequested(node="n1", drain_id="big", reason="x" * 4096)
    await bus.js.publish(f"{subjects.root}.node.n1.drain.requested", codec.encode(big))
    wrong = DrainCompleted(node="n1", drain_id="d")
    await bus.js.publish(f"{subjects.root}.node.n1.drain.requested", codec.encode(wrong))
    await eventually(lambda: len(letters) == 2)
    reasons = sorted(letter.reason for letter in letters)
    assert reasons[0].startswith("oversized: ")
    assert "unexpected kind 'node.drain.completed'" in reasons[1]


async def test_permanent_error_dead_letters_without_retry(bus: Bus, subjects: Subjects) -> None:
    letters = await collect_dead_letters(bus, subjects)
    attempts = 0

    async def handle(event: DrainRequested) -> None:
        nonlocal attempts
        attempts += 1
        raise PermanentError("node n1 is not a GPU node")

    await consume(bus, drain_spec(subjects), handle)
    await bus.publish(DrainRequested(node="n1", drain_id="d1"))
    await eventually(lambda: letters)
    # a second event after it: once its letter is in, a redelivery of the first would have come before it
    await bus.publish(DrainRequested(node="n2", drain_id="d2"))
    await eventually(lambda: len(letters) >= 2)
    assert attempts == 2 and [letter_id(x) for x in letters] == ["d1", "d2"]
    assert letters[0].reason == "permanent: node n1 is not a GPU node"
    decoded = msgspec.json.decode(letters[0].payload)
    assert decoded["drain_id"] == "d1"


def letter_id(letter: DeadLetter) -> str:
    return str(msgspec.json.decode(letter.payload)["drain_id"])


async def test_long_handler_is_kept_alive_with_in_progress(bus: Bus, subjects: Subjects) -> None:
    attempts = 0

    async def handle(event: DrainRequested) -> None:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(1.6)  # four times ack_wait: only in_progress() keeps the message from redelivery

    consumer = await consume(bus, drain_spec(subjects, ack_wait=0.4), handle)
    await bus.publish(DrainRequested(node="n1", drain_id="d1"))
    await eventually(lambda: consumer.stats.handled == 1, timeout=10)
    assert attempts == 1


async def test_core_subscription_and_request_reply(bus: Bus, subjects: Subjects) -> None:
    async def answer(event: DrainRequested) -> DrainCompleted:
        return DrainCompleted(node=event.node, drain_id=event.drain_id, sessions_committed=3)

    subject = subjects.command("checkpoint", "drain")
    await bus.serve(subject, answer, accepts=(DrainRequested,))
    reply = await bus.request(subject, DrainRequested(node="n1", drain_id="d1"))
    assert isinstance(reply, DrainCompleted) and reply.sessions_committed == 3
    raw = await bus.nc.request(subject, b'{"kind":"node.drain.requested"}', timeout=2)
    letter = codec.decode(raw.data)
    assert isinstance(letter, DeadLetter) and "missing required field `node`" in letter.reason


async def test_an_answer_over_the_payload_limit_is_an_error_to_the_caller_never_silence(
    bus: Bus, subjects: Subjects
) -> None:
    from shared.contract.node import DrainFailed, SessionFailure

    async def answer(event: DrainRequested) -> DrainFailed:
        failures = [SessionFailure(session_id=f"s{i}", reason="x" * 200) for i in range(10_000)]
        return DrainFailed(node=event.node, drain_id=event.drain_id, reason="many", failed_sessions=failures)

    subject = subjects.command("checkpoint", "huge")
    await bus.serve(subject, answer, accepts=(DrainRequested,))
    reply = await bus.request(subject, DrainRequested(node="n1", drain_id="d1"), 5)
    assert isinstance(reply, DeadLetter) and "over the bus's" in reply.reason and "node.drain.failed" in reply.reason


async def test_a_command_whose_body_names_another_pod_than_its_subject_is_refused(bus: Bus, subjects: Subjects) -> None:
    from shared.contract.checkpoint import CheckpointLocation, LocateCheckpoint

    async def answer(event: LocateCheckpoint) -> CheckpointLocation:
        return CheckpointLocation(session_id=event.session_id, found=False)

    await bus.serve(subjects.agent_commands("locate"), answer, (LocateCheckpoint,), scope_field="pod")
    ok = await bus.request(subjects.agent_command("locate", "p1"), LocateCheckpoint(session_id="s", pod="p1"), 5)
    assert isinstance(ok, CheckpointLocation)
    refused = await bus.request(subjects.agent_command("locate", "p1"), LocateCheckpoint(session_id="s", pod="p2"), 5)
    assert isinstance(refused, DeadLetter) and ".p1." in refused.reason and "'p2'" in refused.reason


async def test_nats_restart_loses_no_acked_event_and_consumers_resume(
    settings: Settings, subjects: Subjects, own_nats: NatsServer
) -> None:
    settings = with_nats(settings, own_nats.url)
    publisher = await Bus.connect(settings.nats, subjects, "driver")
    consumer_bus = await Bus.connect(settings.nats, subjects, "checkpoint")
    seen: set[str] = set()

    async def handle(event: DrainRequested) -> None:
        seen.add(event.drain_id)

    try:
        await consume(consumer_bus, drain_spec(subjects), handle)
        for i in range(50):
            await publisher.publish(DrainRequested(node="n1", drain_id=f"a{i}"))
        await eventually(lambda: len(seen) == 50)
        own_nats.stop()
        restarted = asyncio.get_running_loop().run_in_executor(None, own_nats.start)
        # published while the server is down: retried with the same id until the restarted server acks
        for i in range(50):
            await publisher.publish(DrainRequested(node="n1", drain_id=f"b{i}"))
        await restarted
        await eventually(lambda: len(seen) == 100, timeout=30)
        assert seen == {f"a{i}" for i in range(50)} | {f"b{i}" for i in range(50)}
    finally:
        await publisher.close(grace=1)
        await consumer_bus.close(grace=1)


def test_dead_letter_json_is_readable() -> None:
    letter = DeadLetter(origin_subject="gw.node.n1.drain.requested", reason="malformed payload: x", payload=b"{")
    doc = json.loads(codec.encode(letter))
    assert doc["kind"] == "deadletter" and doc["reason"] == "malformed payload: x"


async def test_a_message_whose_handler_never_answers_is_dead_lettered_from_the_advisory(
    bus: Bus, subjects: Subjects
) -> None:
    """A consumer that takes a message and dies (here: a raw fetch that never acks) on every delivery: the
    server gives up after max_deliver and the bus dead-letters it from the advisory."""
    from nats.js import api as js_api

    letters = await collect_dead_letters(bus, subjects)
    spec = drain_spec(subjects, durable="crashy", max_deliver=2, ack_wait=0.3)
    await bus.ensure_stream(spec.stream)
    await bus.js.add_consumer(
        spec.stream.name,
        js_api.ConsumerConfig(
            durable_name="crashy",
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=0.3,
            max_deliver=2,
            filter_subject=spec.filter_subjects[0],
        ),
    )
    await watch_exhausted(bus, spec)
    psub = await bus.js.pull_subscribe_bind(durable="crashy", stream=spec.stream.name)
    await bus.publish(DrainRequested(node="n1", drain_id="lost-cause"))
    for _ in range(2):  # take it and never answer, twice
        await psub.fetch(1, timeout=5)
    with contextlib.suppress(Exception):  # a waiting pull is what makes the server look at it again
        await psub.fetch(1, timeout=1.5)
    await eventually(lambda: letters, timeout=10)
    assert letters[0].consumer == "crashy"
    assert "exhausted 2 deliveries without an answer" in letters[0].reason
    assert msgspec.json.decode(letters[0].payload)["drain_id"] == "lost-cause"
