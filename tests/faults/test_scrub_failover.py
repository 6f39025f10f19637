"""After a Redis failover, records of ended sessions come back without their files; the scrub finds and forgets them.

Redis: a primary, its replica and three Sentinels (``ReplicatedRedis``; the service and the checker reach it through
the Sentinels). Sessions are checkpointed on both servers, the replica is cut off, some sessions end on the primary
alone (retention forgets their records there and deletes their files), the primary is SIGKILLed and the replica
promoted: it still lists the ended sessions' checkpoints, whose files are gone, and the checker finds them. The
scrub's walk, which starts again once Redis' run id changed, forgets exactly those with a ``checkpoint.forgotten``
event each; every session still held restores its newest checkpoint, and the checker is clean.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.checkpoint.config import CheckpointSettings
from shared.contract.checkpoint import CheckpointForgotten
from shared.contract.subjects import Subjects
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from tests.faults.checker import check_invariants
from tests.faults.conftest import Mesh, Pod, expected, open_mesh
from tests.helpers import eventually, with_redis
from tests.servers import ReplicatedRedis

pytestmark = pytest.mark.timeout(240)

QUIET = 600.0
"""Pods announce when what they hold changes, not on a timer: the registry after the failover is what the promoted
replica had."""


async def _registry_answers(mesh: Mesh) -> bool:
    try:
        await mesh.client.ping()
        await mesh.service.registry.pods()
    except Exception:  # the failover is under way
        return False
    return True


async def _recorded(mesh: Mesh, sessions: list[str]) -> dict[str, list[str]]:
    return {
        sid: [str(r["checkpoint_id"]) for r in await mesh.service.registry.checkpoints(sid, 100)] for sid in sessions
    }


async def _end_on_the_primary_alone(
    ha: ReplicatedRedis, mesh: Mesh, pods: list[Pod], ending: int
) -> tuple[list[str], list[str]]:
    """Every pod's sessions checkpointed on both servers; then the replica cut off and the first ``ending`` of
    each pod's sessions ended: retention retires their checkpoints on the primary alone. Returns (ended, kept)."""
    assert await mesh.periodic_turn() == len(pods)
    await asyncio.to_thread(ha.wait_synced)
    await asyncio.to_thread(ha.cut_replica)
    ended: list[str] = []
    for pod in pods:
        mine = sorted(pod.agent.sessions())[:ending]
        for sid in mine:
            pod.endpoint.end_session(sid)
        await mesh.announce(pod)
        ended += mine
    for sid in ended:  # retired: records forgotten, then files deleted (on the primary alone)
        await eventually(lambda sid=sid: _gone(mesh, sid), timeout=20)
    kept = sorted(s for pod in pods for s in pod.agent.sessions() if s not in ended)
    return ended, kept


async def _gone(mesh: Mesh, sid: str) -> bool:
    return not await mesh.store.checkpoints(sid) and not await mesh.service.registry.checkpoints(sid)


async def _fail_over(ha: ReplicatedRedis, mesh: Mesh) -> None:
    await asyncio.to_thread(ha.fail_over)
    await eventually(lambda: _registry_answers(mesh), timeout=30, interval=0.1)


async def test_records_of_sessions_ended_on_the_old_primary_are_forgotten_by_the_scrub_after_the_failover(
    replicated_redis: ReplicatedRedis, redis_failover_mesh: Mesh
) -> None:
    """One pod, five sessions; two end on the primary alone. After the failover the registry names their
    checkpoints again and the checker fails on each; one scrub walk (it starts again: the run id changed) forgets
    them, and only them, and the checker is clean. The kept sessions restore their newest checkpoints."""
    ha, mesh = replicated_redis, redis_failover_mesh
    # a pod the cluster does not run (its agent answers on): its node went down with the primary
    pod = await mesh.add_pod("gone-1", "node-1", [f"e{i}" for i in range(5)], blocks=3, announce_s=QUIET)
    await mesh.service.scrub.walk()  # a walk kept on the primary: the promoted replica inherits its run id
    ended, kept = await _end_on_the_primary_alone(ha, mesh, [pod], ending=2)
    assert len(ended) == 2 and len(kept) == 3

    await _fail_over(ha, mesh)
    back = await _recorded(mesh, ended)
    assert all(back.values()), back  # the promoted replica lists the ended sessions' checkpoints
    found = await check_invariants(mesh.store, mesh.client, mesh.subjects, min_checkpoints=3)
    assert not found and all(any(sid in p for sid in ended) for p in found.problems), found.problems
    newest = {sid: (await mesh.store.checkpoints(sid))[0] for sid in kept}

    events = await mesh.heard("checkpoint.forgotten", CheckpointForgotten)
    walked = await mesh.service.scrub.walk()
    assert walked.restarted and walked.forgotten == sum(len(c) for c in back.values())
    assert mesh.service.scrub.replica.metrics.scrub_restarts._value.get() == 1
    assert await _recorded(mesh, ended) == {sid: [] for sid in ended}
    await eventually(lambda: len(events) == walked.forgotten)
    assert {e.session_id for e in events} == set(ended) and {e.reason for e in events} == {"manifest"}
    await mesh.check(min_checkpoints=3)
    await pod.endpoint.stop()
    rescuer = await mesh.add_pod("llama-2", "node-2", announce_s=QUIET)
    for sid in kept:
        restored = await rescuer.endpoint.restore(sid)
        assert restored.manifest.checkpoint_id == newest[sid]
        assert [bytes(b) for b in restored.blocks] == expected(sid, 3)
    await mesh.check(min_checkpoints=3)


@pytest.mark.long
async def test_the_scrub_loop_reconciles_a_fleet_after_a_failover_on_its_own(
    replicated_redis: ReplicatedRedis, settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    """Three pods of eight sessions, half of each pod's ended on the primary alone; the service's own scrub loop
    (a turn every 0.2 s, three sessions a turn) notices the promotion by Redis' run id and, within one walk, leaves
    the checker clean, forgetting nothing of the sessions still held."""
    service_settings = CheckpointSettings(gc_interval_s=0, drain_lease_s=2.0, scrub_interval_s=0.2, scrub_sessions=3)
    store = FileStore(tmp_path / "store")
    async with open_mesh(with_redis(settings, replicated_redis.url), subjects, store, bus, service_settings) as mesh:
        pods = [
            await mesh.add_pod(f"llama-{p}", f"node-{p}", [f"f{p}-{i}" for i in range(8)], blocks=2, announce_s=QUIET)
            for p in range(3)
        ]
        events = await mesh.heard("checkpoint.forgotten", CheckpointForgotten)
        ended, kept = await _end_on_the_primary_alone(replicated_redis, mesh, pods, ending=4)
        kept_records = await _recorded(mesh, kept)
        await _fail_over(replicated_redis, mesh)
        assert all((await _recorded(mesh, ended)).values())

        async def clean() -> bool:
            return bool(await check_invariants(mesh.store, mesh.client, mesh.subjects, min_checkpoints=len(kept)))

        await eventually(clean, timeout=60, interval=0.5)
        assert {e.session_id for e in events} == set(ended)
        assert await _recorded(mesh, kept) == kept_records
        await mesh.check(min_checkpoints=len(kept))
