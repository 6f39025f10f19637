"""The simulation with vLLM pods (``model.engine: vllm``, the spec of ``deploy/sim/vllm.yaml``): each simulated pod
serves with a vLLM engine process of its own (vLLM's CPU build, ``.venv-vllm``) and gpuwarden's connector in it.

A node holding two conversations is drained: the checkpoint service saves them through the pod's agent (the blocks
the connector copied out of vLLM's paged cache), the pod is evicted, and each conversation's next turn runs on the
other node's pod, whose engine loads the checkpoint through the connector: both restores are verified against the
conversation replayed in vLLM, the turn's prompt comes out of the loaded blocks (whole blocks, as the connector
loads), and its greedy tokens and logprobs equal those of the same conversation never interrupted; the fault
checker finds the store and the registry consistent.

Two engines serve the module (each start costs tens of seconds on a shared CPU); it runs in the pytest-xdist group
of the other vLLM tests (``make test`` distributes by group).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.ports.cluster import EvictionOutcome
from shared.sim.spec import load_spec
from shared.sim.vllmpods import VllmPod, vllm_python
from tests.faults.checker import check_invariants
from tests.helpers import eventually
from tests.workloadkit import Mesh, mesh, spec_of, turn

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
VLLM_SPEC = load_spec(str(ROOT / "deploy" / "sim" / "vllm.yaml"))
MODEL = VLLM_SPEC.deployments[0].model
TURN1, REPLY1, TURN2, REPLY2 = 70, 30, 20, 8
"""Turn 1: 99 positions computed (3 whole blocks of 32 and a tail of 3); turn 2 after the move."""


def engines(m: Mesh) -> list[VllmPod]:
    return [e for r in m.workload.runtimes.values() for e in r.engines.values() if isinstance(e, VllmPod)]


async def drain(m: Mesh, node: str, sessions: list[str]) -> DrainCompleted | DrainFailed:
    async def registered() -> bool:
        return set(sessions) <= {s.session_id for s in await m.service.registry.sessions_on_node(node)}

    await eventually(registered, timeout=30)
    verdicts: list[DrainCompleted | DrainFailed] = []

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        verdicts.append(event)

    subjects = m.bus.subjects
    subs = [
        await m.bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,)),
        await m.bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,)),
    ]
    try:
        await m.cluster.cordon(node)
        await m.bus.publish(DrainRequested(node=node, drain_id="vllm-drain", deadline_s=20))
        found = await eventually(lambda: [v for v in verdicts if v.drain_id == "vllm-drain"], timeout=120)
        return found[0]
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def test_a_drained_node_s_conversations_go_on_in_another_vllm_pod_token_for_token(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    try:
        vllm_python()
    except Exception as exc:
        pytest.fail(f"{exc}")
    spec = spec_of(2, 64, MODEL)  # one pod per node
    async with mesh(settings, subjects, bus, tmp_path, spec) as m:
        w = m.workload
        await asyncio.wait_for(asyncio.gather(*(e.ready() for e in engines(m))), timeout=800)
        for i in range(4):  # two conversations per pod: each goes to the pod with fewer, once the last is served
            await bus.publish(turn(f"chat-{i}", TURN1, REPLY1))
            await eventually(lambda n=i + 1: w.stats.served == n, timeout=300)
        home = {sid: w.runtimes[w.home[sid]] for sid in w.home}
        node = "node-1"
        (gone,) = [r for r in w.runtimes.values() if r.info.node == node]
        moving = sorted(gone.agent.sessions())
        assert len(moving) == 2, {s: r.info.name for s, r in home.items()}
        assert all(gone.agent.tokens(s) == TURN1 + REPLY1 - 1 for s in moving)

        verdict = await drain(m, node, moving)
        assert isinstance(verdict, DrainCompleted), verdict
        assert verdict.sessions_committed == 2
        assert await m.cluster.evict("llm", gone.info.name) is EvictionOutcome.EVICTED
        await eventually(lambda: gone.info.name not in w.runtimes, timeout=120)

        for sid in moving:
            await bus.publish(turn(sid, TURN2, REPLY2))
        await eventually(lambda: w.stats.served == 6, timeout=300)
        assert w.stats.restored == 2 and w.stats.restore_verified == 2 and w.stats.lost == 0, w.status()
        for sid in moving:
            runtime = w.runtimes[w.home[sid]]
            assert runtime.info.node != node
            engine = runtime.engines[MODEL.model_version]
            assert isinstance(engine, VllmPod)
            moved = engine.engine.conversations[sid].last
            whole = (TURN1 + REPLY1 - 1) // MODEL.block_tokens * MODEL.block_tokens
            assert moved["cached"] == whole  # loaded through the connector, not computed
            reference = await engine.uninterrupted_reply(sid)
            assert moved["tokens"] == reference["tokens"]
            assert moved["logprobs"] == reference["logprobs"]  # bit for bit
            check = await w.check_session(sid)
            assert check.verified is True, (sid, check.detail)

        client = redis_client(settings.redis)
        try:
            found = await check_invariants(w.store, client, subjects, drains=["vllm-drain"], min_checkpoints=2)
        finally:
            await client.aclose()
        assert found, found.problems


def test_the_vllm_spec_is_refused_where_vllm_cannot_run_it() -> None:
    import msgspec

    from shared.sim.spec import SpecError, parse_spec

    assert MODEL.engine == "vllm" and MODEL.block_tokens % 32 == 0 and MODEL.dtype == "float32"
    with pytest.raises(SpecError, match="multiple of 32"):
        msgspec.structs.replace(MODEL, block_tokens=16)
    with pytest.raises(SpecError, match="float32"):
        parse_spec(
            "nodes: [{name: n1}]\ndeployments: [{name: d, kv_blocks: 64, model: {engine: vllm, dtype: bfloat16, "
            "block_tokens: 32, weights_mib: 1, max_model_len: 512}}]"
        )
    with pytest.raises(SpecError, match="GPUWARDEN_SIM_VLLM_DIR"):
        vllm_python({"GPUWARDEN_SIM_VLLM_DIR": "/nonexistent-venv"})
