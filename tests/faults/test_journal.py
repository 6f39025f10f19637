"""kill -9 of a simulated inference pod mid-decode, the KV journal on, the pods running the real tiny Llama: every
session of the killed pod goes on on another pod (from its newest journal entry, or recomputed from its tokens
when it had no full block yet), each restored conversation equal to its reference run, the positions recomputed
counted, none lost; the fault checker finds the store and the registry consistent (no rollback, no generation
handed out twice). The same when the pod's GPU falls off the bus (``lose_gpu``: its memory unreadable, the pod
dies with it, nothing saved from it after) and when its node is lost (``lose_node``: NotReady, its pods dead).
The long form kills pods again and again while the conversations go on. With the journal's node tier, a pod killed
goes on on its node from the dead pod's log, and a node lost goes on from the store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.sim.faults import KillPodFault, LoseGpuFault, LoseNodeFault, apply_fault
from shared.sim.spec import TINY_LLAMA, GpuSpec, NodeSpec
from tests.helpers import eventually
from tests.workloadkit import Mesh, check_store, mesh, spec_of, turn

SESSIONS = 6


async def _turns(m: Mesh) -> int:
    """A turn of every session (20 tokens in, 24 out); the request count once they are all served."""
    target = m.workload.stats.requests + SESSIONS
    for i in range(SESSIONS):
        await m.bus.publish(turn(f"chat-{i}", 20, 24))
    return target


async def _kill_mid_decode(
    m: Mesh,
    settings: Settings,
    subjects: Subjects,
    how: str = "kill_pod",
    pods: int = 2,
    ready: Callable[[], bool] | None = None,
) -> list[str]:
    """Send every session a turn and kill the busiest pod while it serves them (``kill_pod``, or ``lose_gpu``: the
    GPU it holds falls off the bus). The killed pod's sessions."""
    w = m.workload
    target = await _turns(m)
    await eventually(lambda: w.stats.requests >= target - SESSIONS + 1, timeout=60)  # decoding has begun
    if ready is not None:
        await eventually(ready, timeout=60)
    pod = max(w.runtimes.values(), key=lambda r: len(r.agent.sessions()))
    victims = sorted(pod.agent.sessions())
    client = redis_client(settings.redis)
    try:
        if how == "lose_gpu":
            holders = await m.cluster.gpu_holders(pod.info.node)
            index = next(i for i, pods in holders.items() if f"llm/{pod.info.name}" in pods)
            done = await apply_fault(client, subjects, LoseGpuFault(node=pod.info.node, gpu=index), m.workload.spec)
            assert f"llm/{pod.info.name}" in done, done  # the pod died with the GPU's memory
        elif how == "lose_node":
            done = await apply_fault(client, subjects, LoseNodeFault(node=pod.info.node))
            assert f"llm/{pod.info.name}" in done, done
        else:
            await apply_fault(client, subjects, KillPodFault(pod=pod.info.name, namespace="llm"))
    finally:
        await client.aclose()
    await eventually(lambda: pod.info.name not in w.runtimes and len(w.runtimes) == pods, timeout=30)
    await eventually(lambda: w.stats.served >= target - SESSIONS + 1, timeout=120)
    return victims


async def _run(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path, kills: int, how: str = "kill_pod"
) -> None:
    spec = spec_of(2, 256, TINY_LLAMA)  # room for every session: none preempted
    if how == "lose_node":  # a third node for the pod the lost one held
        spec = msgspec.structs.replace(spec, nodes=[*spec.nodes, NodeSpec(name="node-3", gpus=[GpuSpec(count=1)])])
    async with mesh(settings, subjects, bus, tmp_path, spec, journal_s=0.1) as m:
        w = m.workload
        target = await _turns(m)
        await eventually(lambda: w.stats.served >= target, timeout=120)
        moved: set[str] = set()
        for _ in range(kills):
            moved.update(await _kill_mid_decode(m, settings, subjects, how))
            target = await _turns(m)  # each session's next turn, wherever it is now
            await eventually(lambda t=target: w.stats.requests >= t and not w.killed, timeout=120)
        stats = w.stats
        assert stats.lost == 0, w.status()
        assert stats.pods_killed == kills and stats.continued_after_kill >= len(moved) > 0, w.status()
        assert stats.restore_check_failed == 0 and stats.preemptions == 0, w.status()
        for sid in sorted(moved):
            check = await w.check_session(sid)
            assert check.verified is True, (sid, check.detail)
        await check_store(w, settings, subjects, min_checkpoints=SESSIONS)


@pytest.mark.parametrize("how", ["kill_pod", "lose_gpu", "lose_node"])
async def test_a_pod_killed_mid_decode_costs_its_sessions_at_most_a_block(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path, how: str
) -> None:
    await _run(settings, subjects, bus, tmp_path, kills=1, how=how)


@pytest.mark.long
async def test_pods_killed_again_and_again_while_conversations_go_on(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    await _run(settings, subjects, bus, tmp_path, kills=4)


@pytest.mark.parametrize("how", ["kill_pod", "lose_node"])
async def test_with_a_node_tier_a_pod_killed_goes_on_on_its_node_and_a_node_lost_from_the_store(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path, how: str
) -> None:
    """The journal's node tier (``shared.kv.nodetier``), the shared store written only every minute: a pod killed
    goes on on its node (its replacement) from the store's checkpoint plus the dead pod's log on the node; a node
    lost takes its logs with it, and its sessions go on elsewhere from the store; every conversation equal to its
    reference run either way. (The conversation engine recomputes from the start of the pass a restored block
    ends in, so the positions recomputed here follow the turns; ``bench.crash`` measures the cost per kill.)"""
    if how == "kill_pod":  # one pod, on a node with room for its replacement: its sessions go on on the node
        spec = spec_of(1, 512, TINY_LLAMA)
        spec = msgspec.structs.replace(spec, nodes=[NodeSpec(name="node-1", gpus=[GpuSpec(count=2)])])
    else:  # one pod on each node: the lost node's sessions go on on the other
        nodes = [NodeSpec(name=f"node-{i}", gpus=[GpuSpec(count=2)]) for i in (1, 2)]
        spec = msgspec.structs.replace(spec_of(2, 256, TINY_LLAMA), nodes=nodes)
    pods = spec.deployments[0].replicas
    options = {"journal_s": 0.1, "node_dir": tmp_path / "nodes", "spill_s": 60.0}  # the store: once a minute
    async with mesh(settings, subjects, bus, tmp_path, spec, **options) as m:
        w = m.workload
        target = await _turns(m)
        await eventually(lambda: w.stats.served >= target, timeout=120)

        def logged() -> bool:  # the node's tier holds blocks the store lacks (else the kill would test nothing)
            journal = next(iter(w.runtimes.values())).endpoint.journal
            assert journal is not None and journal.node is not None
            # every session's first blocks went to the store at once; what the tier holds now is beyond them
            return journal.stats.entries >= SESSIONS and journal.node.bytes_held > 0

        moved = await _kill_mid_decode(m, settings, subjects, how, pods, logged if how == "kill_pod" else None)
        target = await _turns(m)
        await eventually(lambda t=target: w.stats.served >= t and not w.killed, timeout=120)
        stats = w.stats
        assert stats.lost == 0 and stats.continued_after_kill >= len(moved) > 0, w.status()
        assert stats.restore_check_failed == 0 and stats.preemptions == 0, w.status()
        if how == "kill_pod":  # blocks the store lacked came from the dead pod's log (what they save: bench.crash)
            assert stats.node_tier_blocks > 0, w.status()
        else:
            assert stats.node_tier_blocks == 0 and not (tmp_path / "nodes" / "node-1").exists(), w.status()
        for sid in sorted(moved):
            check = await w.check_session(sid)
            assert check.verified is True, (sid, check.detail)
        await check_store(w, settings, subjects, min_checkpoints=SESSIONS)
