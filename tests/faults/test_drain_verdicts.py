"""Every drain gets exactly one verdict, quickly: a runner SIGKILLed mid-drain hands it on within its lease,
whatever the deadline; a verdict too big for one event summarises; a re-sent drain id is answered with the
recorded verdict; a node the cluster does not have fails with that reason."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from shared.clients.drains import recorded_verdict
from shared.contract.checkpoint import SaveSessions, SaveSessionsReport
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from tests.faults.checker import check_invariants
from tests.faults.conftest import Mesh, Runner
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content


async def test_a_runner_killed_mid_drain_hands_the_drain_on_and_it_gets_one_verdict(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path, runners: list[Runner]
) -> None:
    store_dir = tmp_path / "store"
    runners.append(Runner(settings, store_dir))
    await eventually(runners[0].ready, timeout=30)
    store = FileStore(store_dir)
    pod_bus = await Bus.connect(settings.nats, subjects, "agent/llama-1")
    agent = KvAgent(store, pod="llama-1", node="node-1", namespace="llm", deployment="llama", layout=LAYOUT)
    endpoint = AgentEndpoint(agent, pod_bus, announce_s=0.5)
    asked: list[SaveSessions] = []
    gate = asyncio.Event()
    answer = endpoint.on_save

    async def slow_save(command: SaveSessions) -> SaveSessionsReport:
        asked.append(command)
        await gate.wait()  # the save takes as long as the test says
        return await answer(command)

    endpoint.on_save = slow_save  # type: ignore[method-assign]
    for sid in ("s1", "s2"):
        await endpoint.start_session(sid)
        for i in range(3):
            agent.append_block(sid, block_content(sid, i, LAYOUT.block_bytes))
    await endpoint.start()
    seen: list[DrainCompleted | DrainFailed] = []

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        seen.append(event)

    await bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
    await bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
    await eventually(lambda: _registered(settings, subjects, 2))
    # a long deadline: the old lease (deadline + 15 s) outlived every redelivery, and the drain never got a verdict
    await bus.publish(DrainRequested(node="node-1", drain_id="dk", deadline_s=120, grace_period_s=150))
    await eventually(lambda: asked, timeout=30)
    runners[0].kill()
    killed_at = time.monotonic()
    runners.append(Runner(settings, store_dir))
    gate.set()
    await eventually(lambda: any(v.drain_id == "dk" for v in seen), timeout=60)
    handed_on_s = time.monotonic() - killed_at
    verdict = next(v for v in seen if v.drain_id == "dk")
    assert isinstance(verdict, DrainCompleted) and verdict.sessions_committed == 2, verdict
    print(f"verdict {handed_on_s:.1f} s after the runner was killed (lease 2 s)")
    # a later drain is a barrier: by its verdict, a second verdict of dk would have come
    await bus.publish(DrainRequested(node="node-3", drain_id="dz", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "dz" for v in seen), timeout=30)
    assert [v.drain_id for v in seen].count("dk") == 1
    client = aioredis.Redis.from_url(settings.redis.url)
    try:
        found = await check_invariants(store, client, subjects, drains=["dk", "dz"], min_checkpoints=2)
        assert found, found.problems
    finally:
        await client.aclose()
        await endpoint.stop()
        await pod_bus.close(1)


async def _registered(settings: Settings, subjects: Subjects, count: int) -> bool:
    client = aioredis.Redis.from_url(settings.redis.url)
    try:
        return await client.hlen(subjects.redis_key("kv", "onnode", "node-1")) == count
    finally:
        await client.aclose()


async def test_a_verdict_with_thousands_of_failures_summarises_and_keeps_the_list(mesh: Mesh) -> None:
    pod = await mesh.add_pod("mute-1", "node-1")
    await pod.endpoint.stop()  # it holds sessions and answers nothing
    sids = [f"s{i:05d}" for i in range(8000)]
    for sid in sids:
        pod.agent.register_session(sid)
    await mesh.announce(pod)
    # a cheap count of the node's index (reading 8,000 records every 20 ms would slow what it waits for)
    await eventually(lambda: _registered(mesh.settings, mesh.subjects, 8000), timeout=60, interval=0.2)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="big", deadline_s=1, grace_period_s=5))
    await eventually(lambda: any(v.drain_id == "big" for v in mesh.verdicts), timeout=60)
    verdict = next(v for v in mesh.verdicts if v.drain_id == "big")
    assert isinstance(verdict, DrainFailed)
    assert verdict.failed_total == 8000 and len(verdict.failed_sessions) == 100
    assert len(msgspec.json.encode(verdict)) < 1024 * 1024
    kept = await mesh.client.lrange(verdict.failed_ref, 0, -1)
    assert sorted(json.loads(k)["session_id"] for k in kept) == sids
    await mesh.check(min_checkpoints=0, drains=["big"])


async def test_a_re_sent_drain_id_is_answered_with_its_recorded_verdict(mesh: Mesh) -> None:
    await mesh.add_pod("llama-1", "node-1", ["s1"])
    env = dict(
        os.environ,
        GPUWARDEN_NATS_URL=mesh.settings.nats.servers[0],
        GPUWARDEN_REDIS_URL=mesh.settings.redis.url,
        GPUWARDEN_ROOT=mesh.subjects.root,
    )
    command = [
        sys.executable,
        "-m",
        "shared.cli",
        "checkpoint",
        "node-1",
        "--drain-id",
        "again",
        "--wait",
        "--deadline",
        "5",
    ]
    outputs = []
    for _ in range(2):
        done = await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        outputs.append(json.loads(done.stdout.splitlines()[-1]))
    first, second = outputs
    assert first["kind"] == "node.drain.completed" and first["sessions_committed"] == 1
    assert second == first  # both read from the drain's one record: the same verdict, event id and all
    # the second request was answered by publishing the recorded verdict again (what wakes a waiting caller)
    await eventually(lambda: _verdicts_of(mesh, "again", 2))
    again = [v for v in mesh.verdicts if v.drain_id == "again"]
    assert again[0].event_id == first["event_id"] and again[1].event_id != first["event_id"]
    # run once: one checkpoint of s1, not two
    assert len(await mesh.service.registry.checkpoints("s1")) == 1
    await mesh.check(min_checkpoints=1, drains=["again"])


async def test_a_drain_whose_verdict_redis_lost_is_answered_from_the_events_stream(mesh: Mesh) -> None:
    """Redis fails over after a drain was decided and loses its record; the drain id is sent again (the driver's
    retry, a redelivery). The verdict the events stream kept is recorded again and answered again: the drain is not
    run a second time (s1 grew meanwhile, and is not saved again)."""
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"])
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="lost", deadline_s=10))
    await eventually(lambda: _verdicts_of(mesh, "lost", 1))
    first = next(v for v in mesh.verdicts if v.drain_id == "lost")
    await mesh.client.delete(mesh.subjects.redis_key("kv", "drain", "lost"))
    pod.grow("s1", 1)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="lost", deadline_s=10))
    await eventually(lambda: _verdicts_of(mesh, "lost", 2))
    second = [v for v in mesh.verdicts if v.drain_id == "lost"][1]
    assert isinstance(first, DrainCompleted) and isinstance(second, DrainCompleted)
    assert second.sessions_committed == first.sessions_committed == 1 and second.event_id != first.event_id
    assert len(await mesh.service.registry.checkpoints("s1")) == 1  # not run again
    assert await mesh.service.leases.drain_verdict("lost") is not None  # recorded again
    await mesh.check(min_checkpoints=1, drains=["lost"])


async def test_a_verdict_redis_lost_is_found_by_a_query_that_names_the_node(mesh: Mesh) -> None:
    """The driver's coordinator asks for the verdict of the drain it named, with the node: a verdict Redis lost
    in a failover comes from the events stream (and is recorded again); without the node it is "none yet"."""
    await mesh.add_pod("llama-1", "node-1", ["s1"])
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="asked", deadline_s=10))
    await eventually(lambda: _verdicts_of(mesh, "asked", 1))
    await mesh.client.delete(mesh.subjects.redis_key("kv", "drain", "asked"))
    assert await recorded_verdict(mesh.bus, "asked") is None
    assert await recorded_verdict(mesh.bus, "asked", node="node-2") is None  # not that node's newest verdict
    found = await recorded_verdict(mesh.bus, "asked", node="node-1")
    assert isinstance(found, DrainCompleted) and found.drain_id == "asked" and found.sessions_committed == 1
    assert await recorded_verdict(mesh.bus, "asked") == found  # recorded again
    await mesh.check(min_checkpoints=1, drains=["asked"])


async def _verdicts_of(mesh: Mesh, drain_id: str, count: int) -> bool:
    return len([v for v in mesh.verdicts if v.drain_id == drain_id]) >= count


async def test_a_drain_of_a_node_the_cluster_lacks_fails_with_that_reason(mesh: Mesh) -> None:
    await mesh.bus.publish(DrainRequested(node="node-99", drain_id="nowhere", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "nowhere" for v in mesh.verdicts))
    verdict = next(v for v in mesh.verdicts if v.drain_id == "nowhere")
    assert isinstance(verdict, DrainFailed) and "node-99 is not in the cluster" in verdict.reason
    await mesh.check(min_checkpoints=0, drains=["nowhere"])


async def test_the_recorded_verdict_is_what_the_service_answers_for_a_drain_id(mesh: Mesh) -> None:
    """One stored verdict: the checkpoint service answers ``node.drain.query`` from its record (what the driver's
    coordinator reads), the same event it published; None for a drain it never decided."""
    assert await recorded_verdict(mesh.bus, "nowhere") is None
    await mesh.bus.publish(DrainRequested(node="node-99", drain_id="nowhere", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "nowhere" for v in mesh.verdicts))
    heard = next(v for v in mesh.verdicts if v.drain_id == "nowhere")
    recorded = await recorded_verdict(mesh.bus, "nowhere")
    assert isinstance(recorded, DrainFailed) and recorded.event_id == heard.event_id
    assert recorded.reason == heard.reason and recorded.node == "node-99"
    assert await recorded_verdict(mesh.bus, "never-asked") is None
