"""The retry policies' module (``shared.plumbing.retries``): stamina's waits, doubling to their ceiling without
jitter where a policy has none, and the give-up points the sites rely on (attempts, a deadline never waited past,
failures not tried again)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shared.plumbing import retries
from shared.plumbing.retries import JETSTREAM_API, JETSTREAM_PUBLISH, LOOP_RESTART, NODE_LABELS, RetryPolicy


class Flaky:
    """Fails with ``error`` the first ``failures`` calls, then answers ``"ok"``."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or ValueError("not yet")
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


async def test_the_waits_double_up_to_the_ceiling_and_a_success_ends_the_tries() -> None:
    waits: list[float] = []
    flaky = Flaky(5)
    policy = RetryPolicy(on=(ValueError,), first_s=0.001, max_s=0.004)
    assert await policy.call(flaky, note=lambda exc, wait: waits.append(wait)) == "ok"
    assert flaky.calls == 6
    assert waits == [0.001, 0.002, 0.004, 0.004, 0.004]


async def test_the_shipped_policies_wait_as_before() -> None:
    """The waits the hand-written loops had: the sites' tests and the docs count on them."""
    assert (JETSTREAM_API.first_s, JETSTREAM_API.max_s, JETSTREAM_API.jitter_s) == (0.1, 1.0, 0.0)
    assert (JETSTREAM_PUBLISH.first_s, JETSTREAM_PUBLISH.max_s, JETSTREAM_PUBLISH.jitter_s) == (0.05, 1.0, 0.0)
    assert (LOOP_RESTART.first_s, LOOP_RESTART.max_s, LOOP_RESTART.attempts) == (0.5, 30.0, None)
    assert (NODE_LABELS.first_s, NODE_LABELS.max_s, NODE_LABELS.attempts) == (1.0, 60.0, None)


async def test_attempts_give_up_with_the_last_failure() -> None:
    flaky = Flaky(10)
    noted: list[float] = []
    with pytest.raises(ValueError, match="not yet"):
        await RetryPolicy(on=(ValueError,), first_s=0.001, max_s=0.001, attempts=3).call(
            flaky, note=lambda exc, wait: noted.append(wait)
        )
    assert flaky.calls == 3 and len(noted) == 2


async def test_failures_of_another_kind_or_refused_by_when_are_not_tried_again() -> None:
    policy = RetryPolicy(on=(ValueError,), first_s=0.001, max_s=0.001)
    other = Flaky(1, KeyError("other"))
    with pytest.raises(KeyError):
        await policy.call(other)
    refused = Flaky(1, ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        await policy.call(refused, when=lambda exc: "refused" not in str(exc))
    assert other.calls == refused.calls == 1


async def test_a_jetstream_create_the_cluster_cannot_place_yet_is_tried_again_and_no_other_refusal() -> None:
    """A cluster just started, or one that lost a server, answers a stream's create with 400 "no suitable peers for
    placement" until its peers are current (seen as a flake of the fault suite's fresh 3-server cluster): tried
    again within the deadline. Any other 400 is a refusal, answered at once."""
    import nats.js.errors

    fast = RetryPolicy(on=JETSTREAM_API.on, first_s=0.001, max_s=0.001, only=JETSTREAM_API.only)
    no_peers = nats.js.errors.BadRequestError(
        code=400, err_code=retries.NO_PEERS_FOR_PLACEMENT, description="peer offline"
    )
    placing = Flaky(3, no_peers)
    assert await fast.call(placing) == "ok" and placing.calls == 4
    refused = Flaky(1, nats.js.errors.BadRequestError(code=400, err_code=10058, description="stream name in use"))
    with pytest.raises(nats.js.errors.BadRequestError):
        await fast.call(refused)
    assert refused.calls == 1


async def test_a_cancellation_is_never_tried_again() -> None:
    flaky = Flaky(1, asyncio.CancelledError())  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await RetryPolicy(on=(Exception,), first_s=0.001, max_s=0.001).call(flaky)
    assert flaky.calls == 1


async def test_a_deadline_is_never_waited_past(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock the test moves by each wait taken (no wall-clock margin): with 0.1 s waits (and 0.01 s of
    jitter) before a deadline 0.25 s away, the third failure is raised rather than waited on, since its wait would
    end at 0.31 s."""
    now = [0.0]
    monkeypatch.setattr(retries, "time", SimpleNamespace(monotonic=lambda: now[0]))
    flaky = Flaky(100)
    policy = RetryPolicy(on=(ValueError,), first_s=0.1, max_s=0.1, jitter_s=0.01)
    waits: list[tuple[float, float]] = []

    def waited(_: Exception, wait: float) -> None:
        waits.append((now[0], wait))
        now[0] += wait + policy.jitter_s

    with pytest.raises(ValueError):
        await policy.call(flaky, deadline=0.25, note=waited)
    assert flaky.calls == 3 and [w for _, w in waits] == [0.1, 0.1]
    assert all(at + wait + policy.jitter_s <= 0.25 for at, wait in waits)


async def test_tries_as_a_block() -> None:
    flaky = Flaky(2)
    answers = []
    async for attempt in RetryPolicy(on=(ValueError,), first_s=0.001, max_s=0.001).tries():
        with attempt:
            answers.append(await flaky())
    assert answers == ["ok"] and flaky.calls == 3
