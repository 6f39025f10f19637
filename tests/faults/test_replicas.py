"""The checkpoint service scales out: replicas share the pods' periodic saves (each live pod goes to one replica),
no pod is asked twice within an interval, and when a replica is SIGKILLed its share moves to the others within
its membership lease; every change keeps being saved."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

from shared.contract.checkpoint import CheckpointSaved, SaveSessions, SaveSessionsReport
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, redis_client
from shared.plumbing.settings import Settings
from tests.faults.checker import check_invariants
from tests.faults.conftest import Runner
from tests.helpers import eventually, fetch
from tests.kvkit import LAYOUT, block_content

INTERVAL_S = 1.5
PODS = 12


async def share(runner: Runner) -> int | None:
    """How many live pods this replica saves periodically (its gauge), or None when it does not answer."""
    try:
        status, body = await fetch(runner.port, "/metrics")
    except OSError:
        return None
    found = re.search(rb"^gpuwarden_checkpoint_periodic_pods (\S+)$", body, re.M)
    return int(float(found.group(1))) if status == 200 and found else None


async def test_replicas_share_periodic_saves_and_a_killed_ones_share_moves(
    settings: Settings,
    subjects: Subjects,
    bus: Bus,
    tmp_path: Path,
    runners: list[Runner],
) -> None:
    store_dir = tmp_path / "store"
    for _ in range(3):
        runners.append(Runner(settings, store_dir))
    for runner in runners:
        await eventually(runner.ready, timeout=60)
    client = redis_client(settings.redis)
    await ConfigStore(client, subjects).write("checkpoint", CheckpointPolicy(periodic_interval_s=INTERVAL_S), 0, "t")
    store = FileStore(store_dir)
    saved: dict[str, int] = {}

    async def on_saved(event: CheckpointSaved) -> None:
        saved[event.session_id] = saved.get(event.session_id, 0) + 1

    await bus.subscribe(subjects.pattern("checkpoint.saved"), on_saved, (CheckpointSaved,))
    asked: dict[str, int] = {}
    agents: list[KvAgent] = []
    endpoints: list[AgentEndpoint] = []
    buses: list[Bus] = []
    for i in range(PODS):
        pod_bus = await Bus.connect(settings.nats, subjects, f"agent/pod-{i}")
        agent = KvAgent(
            store, pod=f"pod-{i}", node=f"node-{i % 3 + 1}", namespace="llm", deployment="llama", layout=LAYOUT
        )
        endpoint = AgentEndpoint(agent, pod_bus, announce_s=0.5)
        answer = endpoint.on_save

        async def counted(command: SaveSessions, answer=answer, pod=f"pod-{i}") -> SaveSessionsReport:  # type: ignore[no-untyped-def]
            asked[pod] = asked.get(pod, 0) + 1
            return await answer(command)

        endpoint.on_save = counted  # type: ignore[method-assign]
        await endpoint.start_session(f"s{i}")
        agent.append_block(f"s{i}", block_content(f"s{i}", 0, LAYOUT.block_bytes))
        await endpoint.start()
        agents.append(agent)
        endpoints.append(endpoint)
        buses.append(pod_bus)
    started = time.monotonic()
    try:
        await eventually(lambda: len(saved) == PODS, timeout=30)
        await eventually(lambda: _shares_sum(runners, PODS), timeout=30)  # each live pod is one replica's
        # a round of changes: each is saved, by one replica
        for i, agent in enumerate(agents):
            agent.append_block(f"s{i}", block_content(f"s{i}", 1, LAYOUT.block_bytes))
        await eventually(lambda: all(saved.get(f"s{i}", 0) >= 2 for i in range(PODS)), timeout=30)
        # one replica dies without a word: within its lease the others take its pods
        runners[0].kill()
        await eventually(lambda: _shares_sum(runners[1:], PODS), timeout=30)
        before = dict(saved)
        for i, agent in enumerate(agents):
            agent.append_block(f"s{i}", block_content(f"s{i}", 2, LAYOUT.block_bytes))
        await eventually(lambda: all(saved.get(f"s{i}", 0) > before[f"s{i}"] for i in range(PODS)), timeout=30)
    finally:
        elapsed = time.monotonic() - started
        for endpoint, pod_bus in zip(endpoints, buses, strict=True):
            await endpoint.stop()
            await pod_bus.close(1)
        for runner in runners:
            runner.kill()
    # a pod's turn is taken for 0.95 of an interval, whichever replica takes it: never asked more often
    most = math.ceil(elapsed / (0.95 * INTERVAL_S)) + 1
    assert max(asked.values()) <= most, (asked, most)
    for i in range(PODS):
        assert len(await store.checkpoints(f"s{i}")) >= 3  # every change committed
    found = await check_invariants(store, client, subjects, min_checkpoints=3 * PODS)
    await client.aclose()
    assert found, "\n".join(found.problems)


async def _shares_sum(runners: list[Runner], total: int) -> bool:
    return sum(s or 0 for s in [await share(r) for r in runners]) == total
