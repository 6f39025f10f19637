"""The checkpoint service with real NATS, Redis and files: drains commit every session before the verdict,
restores land elsewhere byte for byte, and bad or duplicate input changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import redis.asyncio as aioredis

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.checkpoint import CheckpointSaved, SaveProgress
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.consumer import ConsumerSpec, consume
from shared.plumbing.settings import Settings
from shared.wiring import Wiring
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content


@dataclass
class Pod:
    agent: KvAgent
    endpoint: AgentEndpoint
    bus: Bus
    blocks: dict[str, list[np.ndarray]]


@pytest.fixture
async def mesh(settings: Settings, subjects: Subjects, tmp_path: Path) -> AsyncIterator[dict[str, object]]:
    store = FileStore(tmp_path / "store")
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    pods: list[Pod] = []

    async def add_pod(name: str, node: str, sessions: int, blocks: int = 4, serve: bool = True) -> Pod:
        bus = await Bus.connect(settings.nats, subjects, f"agent/{name}")
        agent = KvAgent(store, pod=name, node=node, namespace="llm", deployment="llama", layout=LAYOUT)
        contents: dict[str, list[np.ndarray]] = {}
        for i in range(sessions):
            sid = f"{name}-s{i}"
            agent.register_session(sid)
            contents[sid] = [block_content(sid, b, LAYOUT.block_bytes) for b in range(blocks)]
            for array in contents[sid]:
                agent.append_block(sid, array)
        endpoint = AgentEndpoint(agent, bus, announce_s=30)
        if serve:
            await endpoint.start()
        else:
            await endpoint.announce()
        pod = Pod(agent, endpoint, bus, contents)
        pods.append(pod)
        return pod

    yield {"running": service, "store": store, "add_pod": add_pod}
    for pod in pods:
        await pod.endpoint.stop()
        await pod.bus.close(1)
    await running.stop(grace=1)


async def verdicts(bus: Bus, subjects: Subjects) -> list[DrainCompleted | DrainFailed]:
    seen: list[DrainCompleted | DrainFailed] = []

    async def on(event: DrainCompleted | DrainFailed) -> None:
        seen.append(event)

    await bus.subscribe(subjects.pattern("node.drain.completed"), on, (DrainCompleted,))
    await bus.subscribe(subjects.pattern("node.drain.failed"), on, (DrainFailed,))
    return seen


async def _count(service: CheckpointService, node: str, count: int) -> bool:
    return len(await service.registry.sessions_on_node(node)) == count


async def test_drain_commits_every_session_then_they_restore_elsewhere(
    mesh: dict[str, object], bus: Bus, subjects: Subjects
) -> None:
    add_pod = mesh["add_pod"]
    running: CheckpointService = mesh["running"]  # type: ignore[assignment]
    seen = await verdicts(bus, subjects)
    saved: list[CheckpointSaved] = []

    async def on_saved(event: CheckpointSaved) -> None:
        saved.append(event)

    await bus.subscribe(subjects.pattern("checkpoint.saved"), on_saved, (CheckpointSaved,))
    progress: list[SaveProgress] = []

    async def on_progress(event: SaveProgress) -> None:
        progress.append(event)

    await bus.subscribe(subjects.pattern("checkpoint.save.progress"), on_progress, (SaveProgress,))
    p1 = await add_pod("llama-1", "node-1", 6)  # type: ignore[operator]
    p2 = await add_pod("llama-2", "node-1", 5)  # type: ignore[operator]
    await add_pod("llama-3", "node-2", 3)  # type: ignore[operator]
    await eventually(lambda: _count(running, "node-1", 11))
    await bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=20))
    await eventually(lambda: seen)
    verdict = seen[0]
    assert isinstance(verdict, DrainCompleted), verdict
    assert verdict.sessions_committed == 11
    assert verdict.bytes_saved == 11 * 4 * LAYOUT.block_bytes
    await eventually(lambda: len(saved) == 11)
    assert {e.drain_id for e in saved} == {"d1"}
    await eventually(
        lambda: {(p.pod, p.sessions_done, p.sessions_total) for p in progress} >= {("llama-1", 6, 6), ("llama-2", 5, 5)}
    )
    assert {p.drain_id for p in progress} == {"d1"}
    # the drained node's pods are evicted (their agents stop); a new pod on another node restores each session,
    # asking the service where it is
    for pod in (p1, p2):
        await pod.endpoint.stop()
    newcomer = await add_pod("llama-9", "node-2", 0)  # type: ignore[operator]
    for pod in (p1, p2):
        for sid, blocks in pod.blocks.items():
            restored = await newcomer.endpoint.restore(sid)
            assert [bytes(b) for b in restored.blocks] == [b.tobytes() for b in blocks]
    # a re-sent d1 is not run again: it is answered with the recorded verdict; a later drain is decided normally
    await bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=20))
    await bus.publish(DrainRequested(node="node-2", drain_id="d2", deadline_s=20))
    await eventually(lambda: any(v.drain_id == "d2" for v in seen))
    await eventually(lambda: [v.drain_id for v in seen].count("d1") == 2)
    again = [v for v in seen if v.drain_id == "d1"][1]
    assert again.event_id != verdict.event_id
    assert msgspec.structs.replace(again, event_id=verdict.event_id, occurred_at=verdict.occurred_at) == verdict


async def test_an_agent_that_does_not_answer_fails_the_drain_by_session_name(
    mesh: dict[str, object], bus: Bus, subjects: Subjects
) -> None:
    add_pod = mesh["add_pod"]
    running: CheckpointService = mesh["running"]  # type: ignore[assignment]
    seen = await verdicts(bus, subjects)
    await add_pod("llama-1", "node-1", 2)  # type: ignore[operator]
    await add_pod("llama-silent", "node-1", 2, serve=False)  # type: ignore[operator]
    await eventually(lambda: _count(running, "node-1", 4))
    await bus.publish(DrainRequested(node="node-1", drain_id="d-silent", deadline_s=1.0, grace_period_s=30))
    await eventually(lambda: seen, timeout=15)
    verdict = seen[0]
    assert isinstance(verdict, DrainFailed)
    assert verdict.sessions_committed == 2
    assert sorted(f.session_id for f in verdict.failed_sessions) == ["llama-silent-s0", "llama-silent-s1"]
    assert all("did not answer" in f.reason for f in verdict.failed_sessions)


async def test_a_drain_with_an_impossible_deadline_is_dead_lettered(
    mesh: dict[str, object], bus: Bus, subjects: Subjects
) -> None:
    letters: list[DeadLetter] = []

    async def on_letter(event: DeadLetter) -> None:
        letters.append(event)

    await consume(
        bus,
        ConsumerSpec(
            durable="t-dl",
            filter_subjects=(f"{subjects.root}.deadletter.>",),
            accepts=(DeadLetter,),
            stream=subjects.deadletter_stream,
        ),
        on_letter,
    )
    await bus.publish(DrainRequested(node="node-1", drain_id="bad", deadline_s=60, grace_period_s=30))
    await eventually(lambda: letters)
    assert "beyond the pods' grace period (grace_period_s=30)" in letters[0].reason
    await asyncio.sleep(0)


async def test_agent_killed_mid_save_leaves_no_partial_checkpoint_and_the_drain_names_what_is_missing(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    import signal
    import subprocess
    import sys

    from tests.kv_agent_worker import layout

    store_dir = tmp_path / "store"
    store = FileStore(store_dir)
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    seen = await verdicts(bus, subjects)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.kv_agent_worker",
            settings.nats.servers[0],
            subjects.root,
            str(store_dir),
            "doomed",
            "node-1",
            "3",
            "8",
            "24",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert worker.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, worker.stdout.readline)
        assert line.strip() == b"ready"
        first = {sid: await store.checkpoints(sid) for sid in ("doomed-s0", "doomed-s1", "doomed-s2")}
        assert all(len(ids) == 1 for ids in first.values())
        await eventually(lambda: _count(service, "node-1", 3))
        await bus.publish(DrainRequested(node="node-1", drain_id="d-kill", deadline_s=4, grace_period_s=30))
        await eventually(lambda: any(p.name.startswith(".tmp-") for p in store.packs_dir.iterdir()), timeout=10)
        worker.send_signal(signal.SIGKILL)  # mid-save: its pack is half written, no manifest yet
        worker.wait(10)
        await eventually(lambda: seen, timeout=15)
        verdict = seen[0]
        assert isinstance(verdict, DrainFailed)
        assert sorted(f.session_id for f in verdict.failed_sessions) == ["doomed-s0", "doomed-s1", "doomed-s2"]
        assert all("did not answer" in f.reason for f in verdict.failed_sessions)
        for sid, ids in first.items():
            assert await store.checkpoints(sid) == ids  # nothing partial became visible
            restorer = KvAgent(store, pod="p2", node="node-2", namespace="llm", deployment="llama", layout=layout(8))
            restored = await restorer.restore(sid)
            s = int(sid[-1])
            assert all(bytes(b) == bytes([(s * 31 + i) % 251]) * len(b) for i, b in enumerate(restored.blocks))
    finally:
        if worker.poll() is None:
            worker.kill()
        await running.stop(grace=1)


async def test_periodic_and_prestop_saves_are_recorded(
    mesh: dict[str, object], bus: Bus, subjects: Subjects, settings: Settings, redis_client: aioredis.Redis
) -> None:
    import os
    import subprocess
    import sys

    saved: list[CheckpointSaved] = []

    async def on_saved(event: CheckpointSaved) -> None:
        saved.append(event)

    await bus.subscribe(subjects.pattern("checkpoint.saved"), on_saved, (CheckpointSaved,))
    # periodic checkpoints follow the checkpoint document: the service asks each announcing pod in turn
    await ConfigStore(redis_client, subjects).write("checkpoint", CheckpointPolicy(periodic_interval_s=0.3), 0, "t")
    pod = await mesh["add_pod"]("llama-7", "node-1", 2)  # type: ignore[operator]
    await eventually(lambda: len({e.session_id for e in saved}) == 2)
    # an interval later only what changed is saved again: a session with nothing new writes nothing
    pod.agent.append_block("llama-7-s1", block_content("llama-7-s1", 4, LAYOUT.block_bytes))
    await eventually(lambda: [e.session_id for e in saved].count("llama-7-s1") == 2)
    assert [e.session_id for e in saved].count("llama-7-s0") == 1
    assert [e.bytes_written for e in saved if e.session_id == "llama-7-s1"][-1] == LAYOUT.block_bytes
    assert all(e.drain_id == "" for e in saved)
    # the preStop hook, as a pod runs it: a separate process asks the agent for a final save; s0 changed since its
    # last checkpoint and is saved (by the hook, or by a periodic save just before it), s1 did not and is confirmed
    # (kept), not saved or recorded twice
    pod.agent.append_block("llama-7-s0", block_content("llama-7-s0", 4, LAYOUT.block_bytes))
    env = dict(os.environ, GPUWARDEN_NATS_URL=settings.nats.servers[0], GPUWARDEN_ROOT=subjects.root)
    result = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: subprocess.run(
            [sys.executable, "-m", "shared.cli", "agent", "final-save", "--pod", "llama-7", "--deadline", "10"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ),
    )
    assert result.returncode == 0, result.stderr
    assert '"kind":"checkpoint.save.report"' in result.stdout and '"failed":[]' in result.stdout
    import json

    final = json.loads(result.stdout)
    final_ids = {c["checkpoint_id"] for c in final["committed"]}
    last_s1 = [e.checkpoint_id for e in saved if e.session_id == "llama-7-s1"][-1]
    assert ("llama-7-s1", last_s1) in {(c["session_id"], c["checkpoint_id"]) for c in final["kept"]}
    assert sorted(c["session_id"] for c in final["committed"] + final["kept"]) == ["llama-7-s0", "llama-7-s1"]
    await eventually(lambda: final_ids <= {e.checkpoint_id for e in saved})  # the final save was recorded too
