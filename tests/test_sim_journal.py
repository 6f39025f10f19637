"""A pod killed outright (``kill_pod``: no preStop, its memory gone) on the simulated cluster: with the KV journal
on, every session of the pod goes on elsewhere from its newest journal entry, recomputing only the positions of
its last (partial) block; with it off and no periodic checkpoint, the same sessions are lost. The simulation counts
only sessions that could not go on as lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.sim.faults import FaultError, KillPodFault, apply_fault, fault_from_fields, parse_fault
from tests.helpers import eventually
from tests.workloadkit import SMALL_MODEL, Mesh, mesh, spec_of, turn

SESSIONS = 8
PROMPT, NEW = 40, 10  # 50 positions: 3 full blocks of 16 and a tail of 2
TAIL = (PROMPT + NEW) % SMALL_MODEL.block_tokens


async def _kill_busiest(m: Mesh, settings: Settings, subjects: Subjects) -> tuple[str, list[str]]:
    pod = max(m.workload.runtimes.values(), key=lambda r: len(r.agent.sessions()))
    victims = sorted(pod.agent.sessions())
    client = redis_client(settings.redis)
    try:
        done = await apply_fault(client, subjects, KillPodFault(pod=pod.info.name))
    finally:
        await client.aclose()
    assert "killed" in done
    name = pod.info.name
    await eventually(
        lambda: name not in m.workload.runtimes and len(m.workload.runtimes) == 2 and m.workload.stats.pods_killed == 1,
        timeout=20,
    )
    return name, victims


async def _serve_and_kill(m: Mesh, settings: Settings, subjects: Subjects, journaled: bool) -> list[str]:
    for i in range(SESSIONS):
        await m.bus.publish(turn(f"chat-{i}", PROMPT, NEW))
    await eventually(lambda: m.workload.stats.served >= SESSIONS, timeout=20)
    if journaled:  # each session's full blocks journaled and recorded, without any save asked for

        async def all_journaled() -> bool:
            for i in range(SESSIONS):
                newest = await m.service.registry.newest_checkpoint(f"chat-{i}")
                if newest is None:
                    return False
            return True

        await eventually(all_journaled, timeout=20)
    killed, victims = await _kill_busiest(m, settings, subjects)
    assert victims, "the killed pod held no session"
    before = m.workload.stats.served
    for sid in victims:
        await m.bus.publish(turn(sid, 5))
    await eventually(lambda: m.workload.stats.served >= before + len(victims), timeout=30)
    for sid in victims:
        assert m.workload.home[sid] != killed
    return victims


async def test_a_killed_pods_sessions_go_on_from_the_journal(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    async with mesh(settings, subjects, bus, tmp_path, spec_of(2, 64), journal_s=0.1) as m:
        victims = await _serve_and_kill(m, settings, subjects, journaled=True)
        stats = m.workload.stats
        assert stats.lost == 0, m.workload.status()
        assert stats.continued_after_kill == len(victims)
        assert stats.tokens_recomputed_after_kill == TAIL * len(victims)  # the tail block of each, no more
        assert stats.restore_verified == len(victims)
        for sid in victims:
            assert (await m.workload.check_session(sid)).verified is True
            assert m.workload.runtimes[m.workload.home[sid]].agent.tokens(sid) == PROMPT + NEW + 5
        assert not m.workload.killed and m.workload.tracked()["killed"] == 0


async def test_without_the_journal_and_any_checkpoint_a_killed_pods_sessions_are_lost(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    async with mesh(settings, subjects, bus, tmp_path, spec_of(2, 64)) as m:
        victims = await _serve_and_kill(m, settings, subjects, journaled=False)
        stats = m.workload.stats
        assert stats.lost == len(victims) and stats.continued_after_kill == 0
        assert sorted(stats.lost_sessions) == victims


def test_kill_pod_requests_are_validated() -> None:
    assert parse_fault('{"kind": "kill_pod", "pod": "llama-2"}') == KillPodFault(pod="llama-2")
    assert fault_from_fields({"kind": "kill_pod", "pod": "llama-2", "namespace": "llm"}).namespace == "llm"
    with pytest.raises(FaultError, match=r"\$.pod"):
        parse_fault('{"kind": "kill_pod", "pod": "Not_A_Pod"}')
    with pytest.raises(FaultError, match="node"):
        parse_fault('{"kind": "xid", "gpu": 0, "code": 79}')  # the GPU faults still name their node


async def test_killing_a_pod_that_is_not_there_is_refused(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    async with mesh(settings, subjects, bus, tmp_path, spec_of(1, 16)):
        client = redis_client(settings.redis)
        try:
            with pytest.raises(FaultError, match="no running pod 'llama-99'"):
                await apply_fault(client, subjects, KillPodFault(pod="llama-99"))
        finally:
            await client.aclose()
