"""The checkpoint service with real NATS, Redis and files: drains commit every session before the verdict,
restores land elsewhere byte for byte, and bad or duplicate input changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.handlers import CheckpointService
from shared.contract.checkpoint import CheckpointSaved
from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus, ConsumerSpec
from shared.plumbing.runner import start_service
from shared.plumbing.settings import Settings
from tests.helpers import eventually
from tests.test_kv_agent import LAYOUT, block_content


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
    running = await start_service(service, settings)
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
    # a new pod on another node restores each session, asking the service where it is
    newcomer = await add_pod("llama-9", "node-2", 0)  # type: ignore[operator]
    for pod in (p1, p2):
        for sid, blocks in pod.blocks.items():
            restored = await newcomer.endpoint.restore(sid)
            assert [bytes(b) for b in restored.blocks] == [b.tobytes() for b in blocks]
    # duplicates and late copies of d1 change nothing; a later drain is decided normally
    await bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=20))
    await bus.publish(DrainRequested(node="node-2", drain_id="d2", deadline_s=20))
    await eventually(lambda: any(v.drain_id == "d2" for v in seen))
    assert [v.drain_id for v in seen].count("d1") == 1


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

    await bus.consume(
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
    assert "must be positive and shorter than grace_period_s=30" in letters[0].reason
    await asyncio.sleep(0)
