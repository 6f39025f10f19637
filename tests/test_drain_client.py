"""The one drain client (``shared.clients.drains``): a drain is named, asked over the real bus, followed until its
verdict, asked again by a restarted process, and cleared so that a late verdict is never used."""

from __future__ import annotations

from shared.clients.drains import MAX_ID_CHARS, DrainClient
from shared.contract.base import Event
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from tests.helpers import eventually


async def _requests(bus: Bus, subjects: Subjects) -> list[DrainRequested]:
    await bus.ensure_streams()
    seen: list[DrainRequested] = []

    async def on(event: DrainRequested) -> None:
        seen.append(event)

    await bus.subscribe(subjects.pattern("node.drain.requested"), on, (DrainRequested,))
    return seen


def test_new_ids_are_readable_bounded_and_never_repeat() -> None:
    first, second = DrainClient.new_id("mig-node-1-all-1g-v3"), DrainClient.new_id("mig-node-1-all-1g-v3")
    assert first.startswith("mig-node-1-all-1g-v3-") and first != second
    assert DrainClient.new_id("upgrade-node-1-7", "1700000000000") == "upgrade-node-1-7-1700000000000"
    long = DrainClient.new_id("x" * 400)
    assert len(long) == MAX_ID_CHARS + 9 and long.startswith("x" * MAX_ID_CHARS + "-")


async def test_ask_publishes_and_a_verdict_settles_the_drain_once(bus: Bus, subjects: Subjects) -> None:
    seen = await _requests(bus, subjects)
    now = [100.0]
    client = DrainClient(bus.publish, "device/mig", clock=lambda: now[0])
    drain = client.follow("mig-node-1-a", "node-1")
    assert not client.asked("mig-node-1-a") and not drain.published
    await client.ask("mig-node-1-a", "node-1", "MIG layout 'a'", deadline_s=12.0)
    await eventually(lambda: len(seen) == 1)
    assert seen[0].node == "node-1" and seen[0].drain_id == "mig-node-1-a"
    assert seen[0].requested_by == "device/mig" and seen[0].deadline_s == 12.0 and seen[0].reason == "MIG layout 'a'"
    assert client.asked("mig-node-1-a")
    now[0] = 107.5
    assert client.waited_s(drain) == 7.5
    assert client.settle(DrainCompleted(node="node-2", drain_id="mig-node-1-a", sessions_committed=1)) is None
    verdict = DrainCompleted(node="node-1", drain_id="mig-node-1-a", sessions_committed=3)
    assert client.settle(verdict) is drain and drain.verdict == verdict
    assert client.settle(verdict) is None  # seen again: nothing more
    assert client.settle(DrainFailed(node="node-1", drain_id="unknown", reason="x")) is None


async def test_a_restarted_process_asks_a_named_drain_again_and_a_cleared_one_ignores_its_verdict(
    bus: Bus, subjects: Subjects
) -> None:
    seen = await _requests(bus, subjects)
    before = DrainClient(bus.publish, "driver")
    await before.ask("upgrade-node-1-1-5", "node-1", "driver-upgrade", deadline_s=20.0)
    after = DrainClient(bus.publish, "driver")  # the same drain, named on the node, found by a new process
    assert not after.asked("upgrade-node-1-1-5")
    await after.ask("upgrade-node-1-1-5", "node-1", "driver-upgrade", deadline_s=20.0)
    await eventually(lambda: [e.drain_id for e in seen] == ["upgrade-node-1-1-5"] * 2)
    after.forget("upgrade-node-1-1-5")
    late = DrainFailed(node="node-1", drain_id="upgrade-node-1-1-5", reason="deadline passed")
    assert after.settle(late) is None and not after.asked("upgrade-node-1-1-5")


async def test_a_request_that_cannot_be_sent_stays_unasked(bus: Bus, subjects: Subjects) -> None:
    async def refuse(event: Event) -> None:
        raise ConnectionError("NATS is away")

    await bus.ensure_streams()
    client = DrainClient(refuse, "device/mig")
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


async def test_a_watch_hears_the_verdict_of_its_drain_only_and_settles_it(bus: Bus, subjects: Subjects) -> None:
    seen = await _requests(bus, subjects)
    client = DrainClient(bus.publish, "cli")
    async with client.watch(bus, "drain-node-1-w", "node-1") as watch:
        drain = await client.ask("drain-node-1-w", "node-1", "maintenance", deadline_s=20.0)
        await eventually(lambda: [e.drain_id for e in seen] == ["drain-node-1-w"])
        await bus.publish(DrainCompleted(node="node-1", drain_id="another", sessions_committed=9))
        await bus.publish(DrainFailed(node="node-1", drain_id="drain-node-1-w", reason="deadline passed"))
        verdict = await watch.wait(10)
    assert isinstance(verdict, DrainFailed) and verdict.drain_id == "drain-node-1-w"
    assert drain.verdict == verdict  # settled: the client's drain has it


async def test_a_verdict_stored_but_not_heard_is_found_in_the_stream(bus: Bus, subjects: Subjects) -> None:
    """A verdict published while the watcher's connection failed over is not heard; it is stored, and found."""
    import asyncio

    from shared.clients.drains import stream_end, wait_verdict

    await bus.ensure_streams()
    since = await stream_end(bus)
    await bus.publish(DrainCompleted(node="node-2", drain_id="d-other", sessions_committed=1))
    await bus.publish(DrainCompleted(node="node-1", drain_id="d-other", sessions_committed=1))
    await bus.publish(DrainCompleted(node="node-1", drain_id="d-stored", sessions_committed=4))
    never: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    found = await wait_verdict(bus, "node-1", "d-stored", never, timeout=10, since_seq=since)
    assert isinstance(found, DrainCompleted) and found.sessions_committed == 4
    try:
        await wait_verdict(bus, "node-1", "d-never", never, timeout=0.5, since_seq=since)
    except TimeoutError:
        pass
    else:
        raise AssertionError("a drain without a verdict must time out")


async def test_the_newest_drain_of_a_node_and_its_verdict_are_looked_up_in_the_stream(
    bus: Bus, subjects: Subjects
) -> None:
    from shared.clients.drains import newest_drain

    await bus.ensure_streams()
    assert await newest_drain(bus, "node-1") is None
    client = DrainClient(bus.publish, "cli")
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
