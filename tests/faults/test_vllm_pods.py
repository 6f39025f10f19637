"""kill -9 of a simulated pod that serves with vLLM (``model.engine: vllm``, ``deploy/sim/vllm.yaml``'s model), mid
decode, the KV journal on: the pod's vLLM engine process is killed with it, and every session it held goes on on
another pod from its newest journal entry (blocks the connector copied out of vLLM's paged cache), checked against
the conversation replayed in vLLM and bit for bit what an uninterrupted run holds; none lost; the fault checker
finds the store and the registry consistent. Long: each vLLM engine takes tens of seconds to start here."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.sim.faults import KillPodFault, apply_fault
from shared.sim.spec import load_spec
from shared.sim.vllmpods import VllmPod
from tests.helpers import eventually
from tests.meshkit import gpuwarden, status, until, up_detached
from tests.workloadkit import Mesh, check_store, mesh, spec_of, turn

pytestmark = [pytest.mark.long, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = load_spec(str(ROOT / "deploy" / "sim" / "vllm.yaml")).deployments[0].model
NEW_DRIVER = "560.35.03"
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


def test_a_rolling_driver_upgrade_of_a_mesh_serving_with_vllm_loses_no_session(tmp_path: Path) -> None:
    """``GPUWARDEN_SIM_SPEC=deploy/sim/vllm.yaml gpuwarden up`` (3 nodes, 2 pods each serving with a vLLM engine of
    its own) with traffic, then ``gpuwarden upgrade-driver --max-parallel 1 --wait``, as a user runs them: every node
    is drained, upgraded and uncordoned; each evicted pod's sessions were saved out of vLLM's paged cache by the
    connector (the drain's save, then its preStop) and restored into another pod's vLLM engine, whose continuation
    is checked against the conversation replayed in vLLM; none lost."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env.update(
        GPUWARDEN_HOME=str(tmp_path / "home"),
        GPUWARDEN_SIM_SPEC=str(ROOT / "deploy" / "sim" / "vllm.yaml"),
        PYTHONPATH=str(ROOT),
    )
    try:
        up = up_detached(env, "--rate", "2", "--sessions", "6")
        assert up.returncode == 0, up.stdout + up.stderr

        def serving() -> dict[str, Any] | None:
            now = status(env, sample=0)
            held = [s for s in now["sessions"] if s["state"] == "held"]
            return now if len(held) >= 3 and now["simulation"]["served"] >= 6 else None

        before = until(serving, 900, "vLLM pods serving at least 3 held sessions", every=2.0)
        nodes_with_pods = {s["node"] for s in before["sessions"] if s["state"] == "held"}

        command = ("upgrade-driver", NEW_DRIVER, "--max-parallel", "1", "--wait", "--timeout", "1200", "--json")
        upgrade = gpuwarden(env, *command, timeout=1260)
        assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
        assert json.loads(upgrade.stdout)["ok"]

        def checked() -> dict[str, Any] | None:
            now = status(env, sample=0)
            checks = now["simulation"]["restore_checks"]
            return now if checks["verified"] >= 1 and now["simulation"]["restored"] >= 1 else None

        after = until(checked, 900, "a session restored into another vLLM engine and checked against vLLM", every=2.0)
        assert [(n["driver_version"], n["upgrade_state"], n["schedulable"]) for n in after["nodes"]] == [
            (NEW_DRIVER, "upgrade-done", True)
        ] * 3
        sim = after["simulation"]
        assert sim["lost"] == 0 and sim["lost_sessions"] == [], sim
        assert sim["restore_checks"]["failed"] == 0, sim
        assert sim["prestop_saves"] >= len(nodes_with_pods), sim  # every pod evicted said its last save
        assert all(engine.startswith("gpuwarden/tiny-llama-vllm") for engine in sim["engines"].values()), sim
        print(  # what the upgrade did, for the record (pytest -s shows it)
            "vllm upgrade:",
            json.dumps({k: sim[k] for k in ("served", "restored", "prestop_saves", "restore_checks", "lost")}),
            f"held before: {len(before['sessions'])} on {sorted(nodes_with_pods)}",
        )
        drained = gpuwarden(env, "events", "--kind", "node.drain.completed", "--limit", "50", "--json")
        assert {json.loads(line)["node"] for line in drained.stdout.splitlines()} >= nodes_with_pods
    finally:
        gpuwarden(env, "down", timeout=120)
