"""Failovers of the production topology, as an adversary runs them.

Redis: a primary, its replica and three Sentinels (``ReplicatedRedis`` in tests/servers.py; the checkpoint service
and the checker reach it through the Sentinels). The replica is cut off, sessions grow and are checkpointed on the
primary alone, the primary is SIGKILLed and the Sentinels promote the replica: the registry comes back without its
last writes (the newest checkpoints, the generations handed out since). The store is the last word: every
session restores its newest committed checkpoint, not an older one the registry still names; no generation is
handed out at or below one a stored checkpoint carries; every drain gets one verdict; the checker is clean.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from shared.contract.checkpoint import SessionRestored
from shared.contract.node import DrainCompleted, DrainRequested
from shared.kv.agent import SaveReport
from shared.kv.manifest import checkpoint_order
from tests.faults.conftest import Mesh, Pod, expected
from tests.helpers import eventually
from tests.servers import ReplicatedRedis

pytestmark = pytest.mark.timeout(240)

QUIET = 600.0
"""Pods announce when what they hold changes, not on a timer, so that the registry after a failover is exactly
what the promoted replica had."""


class CountingStore:
    """The service's view of the store, counting what it asks (the agents keep the store itself)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


async def _restored_events(mesh: Mesh) -> list[SessionRestored]:
    seen: list[SessionRestored] = []

    async def on_restored(event: SessionRestored) -> None:
        seen.append(event)

    await mesh.bus.subscribe(mesh.subjects.pattern("checkpoint.restored"), on_restored, (SessionRestored,))
    return seen


async def _newest_recorded(mesh: Mesh, sessions: list[str]) -> dict[str, str]:
    found = {}
    for sid in sessions:
        newest = await mesh.service.registry.newest_checkpoint(sid)
        found[sid] = str(newest["checkpoint_id"]) if newest else ""
    return found


async def _registry_answers(mesh: Mesh) -> bool:
    try:
        await mesh.client.ping()
        await mesh.service.registry.pods()
    except Exception:  # the failover is under way
        return False
    return True


async def _fail_over(ha: ReplicatedRedis, mesh: Mesh) -> None:
    """SIGKILL the primary, the Sentinels promote the replica, the service's registry answers again."""
    await asyncio.to_thread(ha.fail_over)
    await eventually(lambda: _registry_answers(mesh), timeout=30, interval=0.1)


async def _restore_all(
    mesh: Mesh, pod: Pod, sessions: list[str], newest: dict[str, str], blocks: dict[str, int]
) -> dict[str, int]:
    """Restore every session on ``pod``: each from its newest committed checkpoint, byte for byte, under a
    generation above every one its stored checkpoints carry. Returns the generations taken."""
    taken = {}
    for sid in sessions:
        stored = await mesh.store.checkpoints(sid)
        restored = await pod.endpoint.restore(sid)
        assert restored.manifest.checkpoint_id == newest[sid], (sid, restored.manifest.checkpoint_id, newest[sid])
        assert [bytes(b) for b in restored.blocks] == expected(sid, blocks[sid]), sid
        assert restored.fell_back_from == [], restored.fell_back_from
        taken[sid] = pod.agent.generation(sid)
        assert taken[sid] > max(checkpoint_order(c)[0] for c in stored), (sid, taken[sid], stored)
    return taken


async def test_redis_failover_between_checkpoints_restores_every_session_from_its_newest_checkpoint(
    replicated_redis: ReplicatedRedis, redis_failover_mesh: Mesh
) -> None:
    """The issue's scenario: nine sessions checkpointed at 64 tokens on both servers, then grown to 128 tokens and
    checkpointed again while the replica was cut off (two of them moved to another pod first, under a new
    generation). After the failover the registry names the 64-token checkpoints and generation 1; every session
    restores its 128-token checkpoint, ``checkpoint.restored`` says it came from the store, the registry is
    repaired, and the moved sessions get generation 3, never 2 again."""
    ha, mesh = replicated_redis, redis_failover_mesh
    # pods the cluster does not run (their agents answer on): the mover may take sessions from them
    first = await mesh.add_pod("gone-1", "node-1", [f"a{i}" for i in range(5)], blocks=4, announce_s=QUIET)
    second = await mesh.add_pod("gone-2", "node-2", [f"b{i}" for i in range(4)], blocks=4, announce_s=QUIET)
    sessions = [*first.agent.sessions(), *second.agent.sessions()]
    assert len(sessions) == 9
    assert await mesh.periodic_turn() == 2
    recorded = await _newest_recorded(mesh, sessions)
    assert all(recorded.values())
    await asyncio.to_thread(ha.wait_synced)

    await asyncio.to_thread(ha.cut_replica)
    mover = await mesh.add_pod("llama-3", "node-3", announce_s=QUIET)
    moved = ["a0", "b0"]
    for sid in moved:
        await mover.endpoint.restore(sid)  # generation 2, on the primary alone
        mover.grow(sid, 4)
    for pod in (first, second):
        for sid in pod.agent.sessions():
            if sid not in moved:
                pod.grow(sid, 4)
    assert await mesh.periodic_turn() == 3
    newest = await _newest_recorded(mesh, sessions)
    for sid in sessions:
        manifest = await mesh.store.manifest(sid, newest[sid])
        assert newest[sid] != recorded[sid] and manifest.token_count == 128
    assert {sid: await mesh.service.registry.generation(sid) for sid in moved} == {"a0": 2, "b0": 2}

    await _fail_over(ha, mesh)
    # the registry lost the last writes: it names the 64-token checkpoints, and generation 1 for the moved ones
    assert await _newest_recorded(mesh, sessions) == recorded
    assert {sid: await mesh.service.registry.generation(sid) for sid in moved} == {"a0": 1, "b0": 1}

    for pod in (first, second, mover):  # their nodes went down with the primary: every session restores elsewhere
        await pod.endpoint.stop()
    events = await _restored_events(mesh)
    rescuer = await mesh.add_pod("llama-4", "node-3", announce_s=QUIET)
    mesh.service.store = counting = CountingStore(mesh.store)  # type: ignore[assignment]
    taken = await _restore_all(mesh, rescuer, sessions, newest, dict.fromkeys(sessions, 8))
    # what the repair cost: one listing per restore, one manifest read per checkpoint only the store knew
    assert counting.calls == {"checkpoints": 9, "manifest": 9}, counting.calls
    assert {sid: taken[sid] for sid in moved} == {"a0": 3, "b0": 3}
    await eventually(lambda: {e.session_id for e in events} == set(sessions))
    for event in events:
        assert event.checkpoint_id == newest[event.session_id] and newest[event.session_id] in event.from_store
    assert await _newest_recorded(mesh, sessions) == newest  # repaired
    await mesh.check()


async def test_a_restore_asks_the_store_for_one_listing_of_its_session_when_the_registry_is_whole(mesh: Mesh) -> None:
    """The price of taking the store as the last word, without a failover: one listing of the session's own
    checkpoints in the store per restore (sessions/<id>/ in the file store, the session's index in the Object
    Store), no manifest read."""
    pod = await mesh.add_pod("llama-1", "node-1", ["s1", "s2", "s3"], blocks=2, announce_s=QUIET)
    for _ in range(2):
        assert await mesh.periodic_turn() == 1
        for sid in pod.agent.sessions():
            pod.grow(sid, 1)
    assert await mesh.periodic_turn() == 1
    newest = await _newest_recorded(mesh, pod.agent.sessions())
    await mesh.evict(pod)
    rescuer = await mesh.add_pod("llama-2", "node-2", announce_s=QUIET)
    mesh.service.store = counting = CountingStore(mesh.store)  # type: ignore[assignment]
    await _restore_all(mesh, rescuer, pod.agent.sessions(), newest, dict.fromkeys(pod.agent.sessions(), 4))
    assert counting.calls == {"checkpoints": 3}, counting.calls
    await mesh.check()


@pytest.mark.parametrize("release", ["after-promotion", "during-failover"])
async def test_redis_failover_mid_drain_gives_one_verdict_and_every_session_its_newest_checkpoint(
    replicated_redis: ReplicatedRedis, redis_failover_mesh: Mesh, release: str
) -> None:
    """A drain of node-1 is under way (its pod is saving) when the primary is SIGKILLed; the replica had missed
    the last periodic checkpoints of node-1 and node-2. The pod's save goes on after the promotion, or during the
    failover (its report is then recorded against a Redis with no primary: the drain is retried and run again).
    Either way the drain gets exactly one verdict, completed; then both nodes' sessions restore elsewhere, node-1's
    from the drain's checkpoints, node-2's from the periodic ones only the store still knew."""
    ha, mesh = replicated_redis, redis_failover_mesh
    draining = await mesh.add_pod("llama-1", "node-1", [f"c{i}" for i in range(4)], blocks=4, announce_s=QUIET)
    other = await mesh.add_pod("llama-2", "node-2", [f"d{i}" for i in range(3)], blocks=4, announce_s=QUIET)
    sessions = [*draining.agent.sessions(), *other.agent.sessions()]
    assert await mesh.periodic_turn() == 2
    await asyncio.to_thread(ha.wait_synced)
    before = {sid: await mesh.service.registry.generation(sid) for sid in sessions}

    await asyncio.to_thread(ha.cut_replica)
    for pod in (draining, other):
        for sid in pod.agent.sessions():
            pod.grow(sid, 2)
    assert await mesh.periodic_turn() == 2
    asked: list[str] = []
    gate = asyncio.Event()
    save = draining.agent.save

    async def held_save(*args: Any, **kwargs: Any) -> SaveReport:
        asked.append("drain")
        await gate.wait()  # the pod is saving for as long as the test says
        return await save(*args, **kwargs)

    draining.agent.save = held_save  # type: ignore[method-assign]
    for sid in draining.agent.sessions():
        draining.grow(sid, 1)  # what only the drain's checkpoint holds
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="failover", deadline_s=25, grace_period_s=30))
    await eventually(lambda: asked, timeout=30)
    if release == "during-failover":
        ha.primary.kill()
        gate.set()
    await _fail_over(ha, mesh)
    gate.set()
    await eventually(lambda: any(v.drain_id == "failover" for v in mesh.verdicts), timeout=90)
    # a later drain is a barrier: by its verdict, a second verdict of the first would have come
    await mesh.bus.publish(DrainRequested(node="node-3", drain_id="after", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "after" for v in mesh.verdicts), timeout=30)
    verdicts = [v for v in mesh.verdicts if v.drain_id == "failover"]
    assert len(verdicts) == 1 and isinstance(verdicts[0], DrainCompleted), verdicts
    assert verdicts[0].sessions_committed == 4

    newest = {sid: (await mesh.store.checkpoints(sid))[0] for sid in sessions}
    blocks = {sid: 7 if sid.startswith("c") else 6 for sid in sessions}
    for pod in (draining, other):  # node-1 is evicted, node-2 went down
        await pod.endpoint.stop()
    rescuer = await mesh.add_pod("llama-3", "node-3", announce_s=QUIET)
    taken = await _restore_all(mesh, rescuer, sessions, newest, blocks)
    assert all(taken[sid] > before[sid] for sid in sessions), (before, taken)
    await mesh.check(drains=["failover", "after"])
