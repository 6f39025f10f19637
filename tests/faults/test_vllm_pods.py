"""kill -9 of a simulated pod that serves with vLLM (``model.engine: vllm``, ``deploy/sim/vllm.yaml``'s model), mid
decode, the KV journal on: the pod's vLLM engine process is killed with it, and every session it held goes on on
another pod from its newest journal entry (blocks the connector copied out of vLLM's paged cache), checked against
the conversation replayed in vLLM and bit for bit what an uninterrupted run holds; none lost; the fault checker
finds the store and the registry consistent. Long: each vLLM engine takes tens of seconds to start here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.sim.faults import KillPodFault, apply_fault
from shared.sim.spec import load_spec
from shared.sim.vllmpods import VllmPod
from tests.helpers import eventually
from tests.workloadkit import Mesh, check_store, mesh, spec_of, turn

pytestmark = [pytest.mark.long, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]

MODEL = load_spec(str(Path(__file__).resolve().parents[2] / "deploy" / "sim" / "vllm.yaml")).deployments[0].model
SESSIONS = 4


def engines(m: Mesh) -> list[VllmPod]:
    return [e for r in m.workload.runtimes.values() for e in r.engines.values() if isinstance(e, VllmPod)]


async def _turns(m: Mesh) -> int:
    """A turn of every session (20 tokens in, 24 out); the request count once they are all served."""
    target = m.workload.stats.requests + SESSIONS
    for i in range(SESSIONS):
        await m.bus.publish(turn(f"chat-{i}", 20, 24))
    return target


async def test_a_vllm_pod_killed_mid_decode_loses_no_session(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    spec = spec_of(2, 64, MODEL)
    async with mesh(settings, subjects, bus, tmp_path, spec, journal_s=0.1) as m:
        w = m.workload
        await asyncio.wait_for(asyncio.gather(*(e.ready() for e in engines(m))), timeout=900)
        for i in range(SESSIONS):  # spread over both pods: each new session to the pod with fewer
            await m.bus.publish(turn(f"chat-{i}", 20, 24))
            await eventually(lambda n=i + 1: w.stats.served == n, timeout=300)

        target = await _turns(m)
        await eventually(lambda: w.stats.requests >= target - SESSIONS + 1, timeout=300)  # decoding has begun
        pod = max(w.runtimes.values(), key=lambda r: len(r.agent.sessions()))
        victims = sorted(pod.agent.sessions())
        assert victims
        client = redis_client(settings.redis)
        try:
            await apply_fault(client, subjects, KillPodFault(pod=pod.info.name, namespace="llm"))
        finally:
            await client.aclose()
        await eventually(lambda: pod.info.name not in w.runtimes, timeout=120)
        await eventually(lambda: w.stats.requests >= target, timeout=600)

        target = await _turns(m)  # each session's next turn, wherever it is now
        await eventually(lambda: w.stats.requests >= target and not w.killed and w.tracked()["locks"] == 0, timeout=900)
        stats = w.stats
        assert stats.lost == 0, w.status()
        assert stats.pods_killed == 1 and stats.continued_after_kill >= len(victims), w.status()
        # no turn ends at a block boundary (43 and 87 positions): every journal entry is older than its session,
        # so each restore took the resume path (the whole blocks, then the requests it lacked run again)
        assert stats.tokens_recomputed_after_kill > 0, w.status()
        assert stats.restore_check_failed == 0 and stats.restore_verified >= 1, w.status()
        for sid in victims:
            assert w.home[sid] != pod.info.name
            check = await w.check_session(sid)
            assert check.verified is True, (sid, check.detail)
        await check_store(w, settings, subjects, min_checkpoints=SESSIONS)
