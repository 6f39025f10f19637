"""The one drain client (``shared.clients.drains``): a drain is named, asked over the real bus, its verdict read
from its record (the checkpoint service's, played here by a responder on the real bus) whenever a verdict event or
a reconnect wakes the caller and at the end of its wait, asked again by a restarted process, and cleared."""

from __future__ import annotations

import asyncio

import pytest

from shared.clients.drains import MAX_ID_CHARS, DrainClient, RecordReader, VerdictUnknown
from shared.contract.base import Event
from shared.contract.node import DrainCompleted, DrainFailed, DrainQuery, DrainRecord, DrainRequested, DrainVerdict
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from tests.helpers import eventually, with_nats
from tests.servers import NatsServer


async def _requests(bus: Bus, subjects: Subjects) -> list[DrainRequested]:
    await bus.ensure_streams()
    seen: list[DrainRequested] = []

    async def on(event: DrainRequested) -> None:
        seen.append(event)

    await bus.subscribe(subjects.pattern("node.drain.requested"), on, (DrainRequested,))
    return seen


class Record:
    """The checkpoint service's part: the verdicts it recorded, answered by drain id to ``node.drain.query``, and
    how many times it was asked."""

    def __init__(self) -> None:
        self.verdicts: dict[str, DrainVerdict] = {}
        self.asked = 0

    async def serve(self, bus: Bus) -> None:
        async def on_query(query: DrainQuery) -> DrainRecord:
            self.asked += 1
            return DrainRecord(drain_id=query.drain_id, verdict=self.verdicts.get(query.drain_id))

        await bus.serve(bus.subjects.command("checkpoint", "drain"), on_query, (DrainQuery,))


async def _record(bus: Bus) -> Record:
    record = Record()
    await record.serve(bus)
    return record


def test_new_ids_are_readable_bounded_and_never_repeat() -> None:
    first, second = DrainClient.new_id("mig-node-1-all-1g-v3"), DrainClient.new_id("mig-node-1-all-1g-v3")
    assert first.startswith("mig-node-1-all-1g-v3-") and first != second
    assert DrainClient.new_id("upgrade-node-1-7", "1700000000000") == "upgrade-node-1-7-1700000000000"
    long = DrainClient.new_id("x" * 400)
    assert len(long) == MAX_ID_CHARS + 9 and long.startswith("x" * MAX_ID_CHARS + "-")


async def test_ask_publishes_and_the_verdict_is_read_from_the_record_once(bus: Bus, subjects: Subjects) -> None:
    seen = await _requests(bus, subjects)
    record = await _record(bus)
    now = [100.0]
    client = DrainClient(bus.publish, "device/mig", RecordReader(bus), clock=lambda: now[0])
    drain = client.follow("mig-node-1-a", "node-1")
    assert not client.asked("mig-node-1-a") and not drain.published
    await client.ask("mig-node-1-a", "node-1", "MIG layout 'a'", deadline_s=12.0)
    await eventually(lambda: len(seen) == 1)
    assert seen[0].node == "node-1" and seen[0].drain_id == "mig-node-1-a"
    assert seen[0].requested_by == "device/mig" and seen[0].deadline_s == 12.0 and seen[0].reason == "MIG layout 'a'"
    assert client.asked("mig-node-1-a")
    now[0] = 107.5
    assert client.waited_s(drain) == 7.5
    assert await client.verdict("mig-node-1-a", "node-1") is None  # running: the record has no verdict yet
    record.verdicts["mig-node-1-a"] = DrainCompleted(node="node-2", drain_id="mig-node-1-a", sessions_committed=1)
    assert await client.verdict("mig-node-1-a", "node-1") is None  # another node's: not this drain's
    verdict = DrainCompleted(node="node-1", drain_id="mig-node-1-a", sessions_committed=3)
    record.verdicts["mig-node-1-a"] = verdict
    assert await client.verdict("mig-node-1-a", "node-1") == verdict and drain.verdict == verdict
    asked = record.asked
    assert await client.verdict("mig-node-1-a", "node-1") == verdict and record.asked == asked  # kept once read


async def test_a_record_that_does_not_answer_is_an_unknown_verdict_never_none(bus: Bus) -> None:
    client = DrainClient(bus.publish, "driver", RecordReader(bus, timeout_s=0.2))
    with pytest.raises(VerdictUnknown):
        await client.verdict("upgrade-node-1-1-5", "node-1")
    with pytest.raises(VerdictUnknown):
        await DrainClient(bus.publish, "cli", None).verdict("upgrade-node-1-1-5", "node-1")


async def test_a_restarted_process_asks_a_named_drain_again_and_a_cleared_one_is_no_longer_followed(
    bus: Bus, subjects: Subjects
) -> None:
    seen = await _requests(bus, subjects)
    before = DrainClient(bus.publish, "driver", RecordReader(bus))
    await before.ask("upgrade-node-1-1-5", "node-1", "driver-upgrade", deadline_s=20.0)
    after = DrainClient(bus.publish, "driver", RecordReader(bus))  # the same drain, named on the node, found anew
    assert not after.asked("upgrade-node-1-1-5")
    await after.ask("upgrade-node-1-1-5", "node-1", "driver-upgrade", deadline_s=20.0)
    await eventually(lambda: [e.drain_id for e in seen] == ["upgrade-node-1-1-5"] * 2)
    after.forget("upgrade-node-1-1-5")
    assert not after.asked("upgrade-node-1-1-5")


async def test_a_request_that_cannot_be_sent_stays_unasked(bus: Bus, subjects: Subjects) -> None:
    async def refuse(event: Event) -> None:
        raise ConnectionError("NATS is away")

    await bus.ensure_streams()
    client = DrainClient(refuse, "device/mig", None)
    try:
        await client.ask("mig-node-1-b", "node-1", "layout", deadline_s=5.0)
    except ConnectionError:
        pass
    else:
        raise AssertionError("ask must raise what publishing raised")
    assert not client.asked("mig-node-1-b")
    client.publish = bus.publish
    await client.ask("mig-node-1-b", "node-1", "layout", deadline_s=5.0)
    assert client.asked("mig-node-1-b")


def test_ids_made_from_a_dns_node_name_are_valid_and_a_long_suffix_still_fits() -> None:
    from shared.contract.base import id_problem

    made = DrainClient.new_id("drain-gpu-1.rack-2.example.com")
    assert made.startswith("drain-gpu-1_rack-2_example_com-") and not id_problem("drain", made)
    long = DrainClient.new_id("upgrade-" + "n" * 300, "1700000000000")
    assert len(long) == 128 and long.endswith("-1700000000000") and not id_problem("drain", long)


def test_a_request_the_checkpoint_service_would_refuse_is_refused_before_it_is_sent() -> None:
    import pytest

    from shared.clients.drains import InvalidDrain, drain_request

    request = drain_request("node-1", "drain-node-1-ab", "maintenance", "cli", 20.0)
    assert (request.node, request.drain_id, request.requested_by, request.deadline_s) == (
        "node-1",
        "drain-node-1-ab",
        "cli",
        20.0,
    )
    with pytest.raises(InvalidDrain, match="grace period"):
        drain_request("node-1", "d", "maintenance", "cli", 40.0)
    with pytest.raises(InvalidDrain, match="positive"):
        drain_request("node-1", "d", "maintenance", "cli", 0.0)
    with pytest.raises(InvalidDrain, match="drain_id"):
        drain_request("node-1", "no/slashes", "maintenance", "cli", 20.0)


async def test_a_watch_is_woken_by_its_drains_verdict_event_and_reads_the_verdict_from_the_record(
    bus: Bus, subjects: Subjects
) -> None:
    seen = await _requests(bus, subjects)
    record = await _record(bus)
    client = DrainClient(bus.publish, "cli", RecordReader(bus))
    async with client.watch(bus, "drain-node-1-w", "node-1") as watch:
        drain = await client.ask("drain-node-1-w", "node-1", "maintenance", deadline_s=20.0)
        await eventually(lambda: [e.drain_id for e in seen] == ["drain-node-1-w"])
        waiting = asyncio.create_task(watch.wait(60))
        await eventually(lambda: record.asked == 1)  # asked on entry: nothing yet
        record.verdicts["another"] = DrainCompleted(node="node-1", drain_id="another", sessions_committed=9)
        await bus.publish(record.verdicts["another"])  # another drain's event wakes nobody here
        recorded = DrainFailed(node="node-1", drain_id="drain-node-1-w", reason="deadline passed")
        record.verdicts["drain-node-1-w"] = recorded
        # the event the subscription hears is not what the watch returns: it only wakes it to ask the record
        await bus.publish(DrainFailed(node="node-1", drain_id="drain-node-1-w", reason="as the event said"))
        verdict = await asyncio.wait_for(waiting, 30)
    assert verdict == recorded and drain.verdict == recorded
    assert record.asked == 2


async def test_a_verdict_whose_wake_up_was_missed_is_learned_by_asking_the_record_at_the_end(bus: Bus) -> None:
    """A verdict event lost (published while the connection failed over, or never published) wakes nobody; the
    watch asks the record once more when its time is up, and finds the verdict there."""
    record = await _record(bus)
    client = DrainClient(bus.publish, "cli", RecordReader(bus))
    async with client.watch(bus, "d-missed", "node-1") as watch:
        waiting = asyncio.create_task(watch.wait(1.0))
        await eventually(lambda: record.asked == 1)
        record.verdicts["d-missed"] = DrainCompleted(node="node-1", drain_id="d-missed", sessions_committed=4)
        found = await asyncio.wait_for(waiting, 30)
    assert isinstance(found, DrainCompleted) and found.sessions_committed == 4 and record.asked == 2
    async with client.watch(bus, "d-never", "node-1") as watch:
        with pytest.raises(TimeoutError):
            await watch.wait(0.3)


async def test_a_watch_asks_the_record_again_after_its_connection_reconnects(
    settings: Settings, subjects: Subjects, own_nats: NatsServer
) -> None:
    """The verdict is decided while the server is away: its event is lost with it. The watch's connection comes
    back, and the reconnect alone makes it ask the record (its own wait runs far longer than this test)."""
    settings = with_nats(settings, own_nats.url)
    watcher = await Bus.connect(settings.nats, subjects, "cli")
    service = await Bus.connect(settings.nats, subjects, "checkpoint")
    try:
        record = await _record(service)
        client = DrainClient(watcher.publish, "cli", RecordReader(watcher))
        async with client.watch(watcher, "d-relinked", "node-1") as watch:
            waiting = asyncio.create_task(watch.wait(600))
            await eventually(lambda: record.asked == 1)
            own_nats.stop()
            record.verdicts["d-relinked"] = DrainCompleted(node="node-1", drain_id="d-relinked")
            await asyncio.get_running_loop().run_in_executor(None, own_nats.start)
            found = await asyncio.wait_for(waiting, 30)
        assert found == record.verdicts["d-relinked"] and record.asked >= 2
    finally:
        await watcher.close(grace=1)
        await service.close(grace=1)


async def test_the_newest_drain_of_a_node_and_its_verdict_are_looked_up_in_the_stream(
    bus: Bus, subjects: Subjects
) -> None:
    from shared.clients.drains import newest_drain

    await bus.ensure_streams()
    assert await newest_drain(bus, "node-1") is None
    client = DrainClient(bus.publish, "cli", None)
    await client.ask("first", "node-1", "maintenance", deadline_s=20.0)
    await bus.publish(DrainCompleted(node="node-1", drain_id="first", sessions_committed=2))
    await client.ask("second", "node-1", "maintenance", deadline_s=20.0)
    await client.ask("elsewhere", "node-2", "maintenance", deadline_s=20.0)
    running = await newest_drain(bus, "node-1")
    assert running is not None and running.request.drain_id == "second" and running.verdict is None
    await bus.publish(DrainCompleted(node="node-2", drain_id="second", sessions_committed=7))  # not node-1's
    await bus.publish(DrainFailed(node="node-1", drain_id="second", reason="deadline passed"))
    decided = await newest_drain(bus, "node-1")
    assert decided is not None and isinstance(decided.verdict, DrainFailed)
    assert decided.verdict.drain_id == "second" and decided.verdict.node == "node-1"
