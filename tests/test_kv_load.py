"""A pod's load reports (``shared.kv.load``): the window's p90 of first-token times, the pool as read when the report
is built, bounded memory, and a report that cannot be sent is dropped without disturbing the server. Sent over a
real NATS server where it is sent at all."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contract.base import Event
from shared.contract.load import PodLoad
from shared.kv.load import MAX_SAMPLES, LoadReporter, p90
from shared.plumbing.bus import Bus
from tests.helpers import eventually


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_p90_is_the_nearest_rank() -> None:
    assert p90([]) is None
    assert p90([0.2]) == 0.2
    assert p90([float(i) for i in range(1, 11)]) == 9.0
    assert p90([float(i) for i in range(1, 21)]) == 18.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=300))
def test_at_least_nine_in_ten_samples_are_at_or_below_the_p90(samples: list[float]) -> None:
    value = p90(samples)
    assert value is not None and value in samples
    assert sum(s <= value for s in samples) >= 0.9 * len(samples)
    assert sum(s < value for s in samples) < 0.9 * len(samples)


async def test_a_report_per_window_with_the_pool_as_it_is_then() -> None:
    sent: list[Event] = []

    async def publish(event: Event) -> None:
        sent.append(event)

    clock, pool = Clock(), [3, 10]
    reporter = LoadReporter(
        publish, lambda: (pool[0], pool[1]), pod="p-1", node="n-1", namespace="llm", deployment="chat", clock=clock
    )
    for ms in range(1, 11):
        reporter.first_token(ms / 1000)
    reporter.first_token(-1.0)  # a clock that stepped back: ignored
    reporter.first_token(float("nan"))
    assert not await reporter.tick()  # not yet due
    clock.now += 5.0
    pool[0] = 7
    assert await reporter.tick()
    first = sent[-1]
    assert isinstance(first, PodLoad)
    assert (first.blocks_used, first.blocks_total, first.ttft_p90_s, first.requests, first.window_s) == (
        7,
        10,
        0.009,
        10,
        5.0,
    )
    clock.now += 5.0
    assert await reporter.tick()
    second = sent[-1]
    assert isinstance(second, PodLoad) and second.ttft_p90_s is None and second.requests == 0  # nothing measured


def test_memory_stays_bounded_under_any_load() -> None:
    async def publish(event: Event) -> None:
        return None

    reporter = LoadReporter(publish, lambda: (0, 1), pod="p", namespace="n", deployment="d", seed=3)
    for i in range(MAX_SAMPLES * 3):
        reporter.first_token(1.0 if i % 10 == 0 else 0.01)
    assert len(reporter._samples) == MAX_SAMPLES
    slow = sum(s == 1.0 for s in reporter._samples) / MAX_SAMPLES
    assert 0.05 < slow < 0.15  # a uniform sample of them: about one in ten is slow, as sent
    report = reporter.report()
    assert report.requests == MAX_SAMPLES * 3 and reporter._samples == []


async def test_a_report_that_cannot_be_sent_is_dropped_and_counted() -> None:
    async def unreachable(event: Event) -> None:
        raise ConnectionError("no NATS")

    reporter = LoadReporter(unreachable, lambda: (1, 2), pod="p", namespace="n", deployment="d")
    assert not await reporter.send()
    assert (reporter.sent, reporter.dropped) == (0, 1)
    with pytest.raises(ValueError, match="interval_s"):
        LoadReporter(unreachable, lambda: (1, 2), pod="p", namespace="n", deployment="d", interval_s=0)


async def test_run_publishes_on_the_bus_every_interval(bus: Bus) -> None:
    heard: list[PodLoad] = []

    async def on_load(event: PodLoad) -> None:
        heard.append(event)

    await bus.subscribe(bus.subjects.pattern("kv.pod.load", pod="chat-7"), on_load, accepts=(PodLoad,))
    versions = {"2": None, "1": None}  # the agent's layouts: the version it serves and one its sessions still run on
    reporter = LoadReporter(
        bus.publish,
        lambda: (5, 8),
        pod="chat-7",
        node="node-2",
        namespace="llm",
        deployment="chat",
        interval_s=0.1,
        versions=versions.keys,
    )
    task = asyncio.create_task(reporter.run())
    try:
        await eventually(lambda: len(heard) >= 2, timeout=5)
    finally:
        task.cancel()
    assert {(e.pod, e.node, e.blocks_used, e.blocks_total) for e in heard} == {("chat-7", "node-2", 5, 8)}
    assert all(e.model_versions == ["1", "2"] for e in heard)
    assert heard[0].source == "test"


def test_an_agent_may_report_only_its_own_pods_load_and_the_scaler_may_hear_every_pod() -> None:
    from shared.contract.permissions import agent_permissions, may_publish, service_permissions, subject_matches
    from shared.contract.subjects import Subjects

    subjects = Subjects("gw")
    own = subjects.for_event(
        PodLoad(pod="llama-1", namespace="llm", deployment="llama", blocks_used=1, blocks_total=2, window_s=1)
    )
    other = own.replace("llama-1", "llama-2")
    perms = agent_permissions(subjects, pod="llama-1")
    assert may_publish(perms, own) and not may_publish(perms, other)
    scaler = service_permissions(subjects, "scaler")["subscribe"]["allow"]
    assert any(subject_matches(pattern, other) for pattern in scaler)
    assert not may_publish(service_permissions(subjects, "scaler"), own)  # the scaler only listens
