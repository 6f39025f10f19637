"""Bad input anywhere on the checkpoint path gets a clear answer or a dead letter and crashes nothing; temporary
files a killed writer left are collected after their grace period, young ones are not."""

from __future__ import annotations

import os
import time

import pytest

from shared.contract.checkpoint import AgentSessions, CheckpointLocation, LocateCheckpoint
from shared.contract.node import DrainCompleted, DrainRequested
from shared.kv.endpoint import LocateRefused
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually

GARBAGE = [b"", b"{", b"null", b'{"kind":"checkpoint.locate"}', b'{"kind":"nope"}', b"\xff" * 64, b"[" * 10_000]


async def test_garbage_on_every_checkpoint_subject_is_refused_and_the_service_goes_on(mesh: Mesh) -> None:
    letters = await mesh.dead_letters("t-faults-dl")
    s = mesh.subjects
    commands = [s.agent_command(c, "llama-9") for c in ("locate", "restored", "record")]
    for subject in commands:
        for data in GARBAGE:
            reply = await mesh.bus.nc.request(subject, data, timeout=5)
            assert b"checkpoint" in reply.data or b"deadletter" in reply.data  # a DeadLetter naming the reason
    await mesh.add_pod("llama-1", "node-1", ["s1"])
    announcements = s.for_event(AgentSessions(pod="llama-1", node="node-1"))
    drains = s.for_event(DrainRequested(node="node-1", drain_id="x"))
    for data in GARBAGE:
        await mesh.bus.nc.publish(announcements, data)
        await mesh.bus.nc.publish(drains, data)
    await eventually(lambda: len(letters) >= len(GARBAGE))
    # still answering, still draining
    answer = await mesh.bus.request(
        s.agent_command("locate", "llama-9"), LocateCheckpoint(session_id="s1", pod="llama-9"), 5
    )
    assert isinstance(answer, CheckpointLocation)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="after", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "after" for v in mesh.verdicts))
    assert isinstance(mesh.verdicts[-1], DrainCompleted) and mesh.verdicts[-1].sessions_committed == 1
    await mesh.evict(mesh.pods[0])
    other = await mesh.add_pod("llama-2", "node-2")
    assert [bytes(b) for b in (await other.endpoint.restore("s1")).blocks] == expected("s1", 3)
    await mesh.check(min_checkpoints=1, drains=["after"])


async def test_a_locate_the_service_refuses_is_a_refusal_not_a_timeout(mesh: Mesh) -> None:
    """A session id the contract does not take is refused by the service at once (a dead letter): the pod hears
    ``LocateRefused`` with the reason, not a ``TimeoutError`` as if nobody had answered, and takes nothing."""
    pod = await mesh.add_pod("llama-1", "node-1")
    started = time.monotonic()
    with pytest.raises(LocateRefused, match=r"refused to locate session 'a b': .*session_id") as refused:
        await pod.endpoint.start_session("a b", timeout=30)
    assert not isinstance(refused.value, TimeoutError) and time.monotonic() - started < 10
    assert pod.agent.sessions() == []


async def test_temporary_files_older_than_the_grace_period_are_collected(mesh: Mesh) -> None:
    await mesh.add_pod("llama-1", "node-1", ["s1"])
    assert await mesh.periodic_turn() == 1
    store = mesh.store
    old = [store.packs_dir / ".tmp-dead.pack", store.sessions_dir / "s1" / ".tmp-dead.json"]
    young = store.packs_dir / ".tmp-writing.pack"
    for path in [*old, young]:
        path.write_bytes(b"x" * 100)
    an_hour_ago = time.time() - 3600
    for path in old:
        os.utime(path, (an_hour_ago, an_hour_ago))
    mesh.service.settings = type(mesh.service.settings)(gc_interval_s=0, gc_grace_s=600)
    await mesh.service.retention.collect_garbage()
    assert not any(p.exists() for p in old) and young.exists()
    await mesh.check(min_checkpoints=1, temp_grace_s=600)
