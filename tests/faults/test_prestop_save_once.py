"""A drained pod's preStop saves once: what the drain just committed is confirmed, not written or recorded again;
what changed since is saved; and a checkpoint whose first report never reached the checkpoint service is recorded by
the preStop's confirmation, so nothing rolls back. The hook runs as a pod runs it (``shared.kv.prestop``, over NATS)."""

from __future__ import annotations

from shared.contract.checkpoint import CheckpointSaved, SaveSessions, SaveSessionsReport
from shared.contract.node import DrainCompleted, DrainRequested
from shared.kv.prestop import final_save, prestop_command
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually


async def _prestop(mesh: Mesh, pod: str) -> SaveSessionsReport:
    env = {"GPUWARDEN_NATS_URL": mesh.settings.nats.servers[0], "GPUWARDEN_ROOT": mesh.subjects.root}
    reply = await final_save(prestop_command(pod, 10), env)
    assert isinstance(reply, SaveSessionsReport), reply
    return reply


async def _drain(mesh: Mesh, node: str, drain_id: str, sessions: int) -> None:
    await mesh.bus.publish(DrainRequested(node=node, drain_id=drain_id, deadline_s=10))
    await eventually(lambda: any(v.drain_id == drain_id for v in mesh.verdicts))
    verdict = next(v for v in mesh.verdicts if v.drain_id == drain_id)
    assert isinstance(verdict, DrainCompleted) and verdict.sessions_committed == sessions, verdict


async def _recorded(mesh: Mesh, sid: str) -> list[str]:
    return [r["checkpoint_id"] for r in await mesh.service.registry.checkpoints(sid)]


async def test_a_drain_then_the_pods_prestop_records_each_session_once(mesh: Mesh) -> None:
    saved = await mesh.heard("checkpoint.saved", CheckpointSaved)
    sessions = ["s1", "s2", "s3"]
    await mesh.add_pod("llama-1", "node-1", sessions, blocks=2)
    await _drain(mesh, "node-1", "d1", 3)
    await eventually(lambda: len(saved) == 3)
    drained = {sid: await _recorded(mesh, sid) for sid in sessions}
    assert all(len(ids) == 1 for ids in drained.values()), drained

    report = await _prestop(mesh, "llama-1")
    assert not report.committed and not report.failed and report.unchanged == 3
    assert {c.session_id: [c.checkpoint_id] for c in report.kept} == drained
    for sid in sessions:  # nothing written, nothing recorded again
        assert await _recorded(mesh, sid) == drained[sid]
        assert await mesh.store.checkpoints(sid) == drained[sid]
    await _prestop(mesh, "llama-1")  # a hook run twice changes nothing either
    saved_after = await mesh.heard("checkpoint.saved", CheckpointSaved)
    await mesh.add_pod("llama-2", "node-2", ["marker"], blocks=1)
    await mesh.bus.publish(DrainRequested(node="node-2", drain_id="d2", deadline_s=10))
    await eventually(lambda: len(saved_after) == 1)  # the marker's save: published after anything the hooks caused
    assert len(saved) == 4 and saved[-1].session_id == "marker"
    await mesh.check(min_checkpoints=4, drains=["d1", "d2"])


async def test_a_session_with_new_tokens_after_the_drain_is_saved_at_prestop(mesh: Mesh) -> None:
    pod = await mesh.add_pod("llama-1", "node-1", ["s1", "s2"], blocks=2)
    await _drain(mesh, "node-1", "d1", 2)
    pod.grow("s1", 1)  # a request served between the drain's save and the eviction
    report = await _prestop(mesh, "llama-1")
    assert [c.session_id for c in report.committed] == ["s1"] and not report.failed
    assert [c.session_id for c in report.kept] == ["s2"]
    assert len(await _recorded(mesh, "s1")) == 2 and len(await _recorded(mesh, "s2")) == 1
    await mesh.evict(pod)
    new = await mesh.add_pod("llama-2", "node-2")
    assert [bytes(b) for b in (await new.endpoint.restore("s1")).blocks] == expected("s1", 3)
    assert [bytes(b) for b in (await new.endpoint.restore("s2")).blocks] == expected("s2", 2)
    await mesh.check(min_checkpoints=3, drains=["d1"])


async def test_a_save_whose_report_was_lost_is_recorded_by_the_prestop(mesh: Mesh) -> None:
    """The agent committed s1's checkpoint to the store but its report never reached the checkpoint service (the
    asker timed out): the preStop writes nothing new, and its confirmation records that checkpoint, so the session
    restores as it is rather than as it was."""
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    assert await mesh.periodic_turn() == 1
    pod.grow("s1", 1)
    lost = await pod.endpoint.on_save(SaveSessions(pod="llama-1", reason="periodic", changed_only=True))
    assert [c.session_id for c in lost.committed] == ["s1"]  # answered to nobody: not recorded
    assert lost.committed[0].checkpoint_id not in await _recorded(mesh, "s1")
    report = await _prestop(mesh, "llama-1")
    assert not report.committed and [c.checkpoint_id for c in report.kept] == [lost.committed[0].checkpoint_id]
    assert (await _recorded(mesh, "s1"))[0] == lost.committed[0].checkpoint_id
    await mesh.evict(pod)
    new = await mesh.add_pod("llama-2", "node-2")
    assert [bytes(b) for b in (await new.endpoint.restore("s1")).blocks] == expected("s1", 3)
