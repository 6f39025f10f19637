"""Attacks on the checkpoint path by a party that may publish only some subjects: a body that names another node,
pod or session than its subject, identifiers built to break paths or subscriptions, drain fields out of range.
Each is refused with its reason (a dead letter; a drain request its failed verdict), changes nothing, and the
service goes on serving; the invariant checker runs after each."""

from __future__ import annotations

import msgspec

from shared.contract.base import Event
from shared.contract.checkpoint import AgentSessions, CheckpointLocation, LocateCheckpoint, SaveSessionsReport
from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.registry import codec
from shared.kv.store import InvalidId
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually, fetch


def forged(event: Event, **fields: object) -> bytes:
    """``event`` as JSON with ``fields`` written over it, past every check the sender's own code makes."""
    raw = msgspec.json.decode(codec.encode(event))
    raw.update(fields)
    return msgspec.json.encode(raw)


async def test_an_announcement_naming_another_pod_is_refused_and_changes_nothing(mesh: Mesh) -> None:
    letters = await mesh.dead_letters("t-attack-announce")
    victim = await mesh.add_pod("llama-2", "node-2", ["s1", "s2"])
    attacker_subject = mesh.subjects.for_event(AgentSessions(pod="llama-1", node="node-1"))
    await mesh.bus.nc.publish(attacker_subject, codec.encode(AgentSessions(pod="llama-2", node="node-2")))
    await eventually(lambda: any("llama-2" in letter.reason for letter in letters))
    assert "does not name what the body does" in letters[-1].reason
    assert await mesh.sessions_on("node-2") == {"s1", "s2"}  # the victim's sessions stand
    await mesh.announce(victim)  # and its own announcements still count
    assert await mesh.sessions_on("node-2") == {"s1", "s2"}
    await mesh.check(min_checkpoints=0)


async def test_a_drain_request_naming_another_node_than_its_subject_fails_and_drains_nothing(mesh: Mesh) -> None:
    await mesh.add_pod("llama-2", "node-2", ["s1"])
    request = DrainRequested(node="node-2", drain_id="forged-1", deadline_s=5)
    subject = mesh.subjects.for_event(DrainRequested(node="node-1", drain_id="forged-1"))
    await mesh.bus.js.publish(subject, codec.encode(request))
    await eventually(lambda: any(v.drain_id == "forged-1" for v in mesh.verdicts))
    verdict = next(v for v in mesh.verdicts if v.drain_id == "forged-1")
    assert isinstance(verdict, DrainFailed) and verdict.node == "node-1" and "node-2" in verdict.reason
    assert await mesh.store.checkpoints("s1") == []  # node-2 was never drained
    await mesh.check(min_checkpoints=0)


async def test_a_forged_copy_never_decides_another_nodes_drain(mesh: Mesh) -> None:
    await mesh.add_pod("llama-2", "node-2", ["s1"])
    await mesh.bus.publish(DrainRequested(node="node-2", drain_id="real-1", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "real-1" for v in mesh.verdicts))
    # the same drain id, with a field out of range, on the subject of a node the attacker may publish on
    bad = forged(DrainRequested(node="node-1", drain_id="real-1"), deadline_s=-5)
    await mesh.bus.js.publish(mesh.subjects.for_event(DrainRequested(node="node-1", drain_id="x")), bad)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="after-1", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "after-1" for v in mesh.verdicts))
    verdicts = [v for v in mesh.verdicts if v.drain_id == "real-1"]
    assert [(type(v), v.node) for v in verdicts] == [(DrainCompleted, "node-2")]
    await mesh.check(min_checkpoints=1, drains=["real-1", "after-1"])


async def test_every_drain_request_gets_one_verdict_whatever_its_fields(mesh: Mesh) -> None:
    await mesh.add_pod("llama-1", "node-1", ["s1"])
    subject = mesh.subjects.for_event(DrainRequested(node="node-1", drain_id="x"))
    cases = {"late": {"deadline_s": 40.0}, "zero": {"deadline_s": 0.0}, "negative": {"deadline_s": -5.0}}
    cases["not-a-number"] = {"deadline_s": "soon"}
    for drain_id, fields in cases.items():
        await mesh.bus.js.publish(subject, forged(DrainRequested(node="node-1", drain_id=drain_id), **fields))
    await eventually(lambda: {v.drain_id for v in mesh.verdicts} >= set(cases))
    for drain_id in cases:
        verdicts = [v for v in mesh.verdicts if v.drain_id == drain_id]
        assert len(verdicts) == 1 and isinstance(verdicts[0], DrainFailed), drain_id
        assert "deadline_s" in verdicts[0].reason, verdicts[0].reason
    await mesh.check(min_checkpoints=0)


async def test_a_pod_may_ask_only_as_itself(mesh: Mesh) -> None:
    letters = await mesh.dead_letters("t-attack-scope")
    victim = await mesh.add_pod("llama-2", "node-2", ["s1"])
    generation = await mesh.service.registry.generation("s1")
    claim = LocateCheckpoint(session_id="s1", pod="llama-2", node="node-2", take_session=True)
    reply = await mesh.bus.request(mesh.subjects.agent_command("locate", "llama-1"), claim, 5)
    assert isinstance(reply, DeadLetter) and "llama-1" in reply.reason and "llama-2" in reply.reason
    report = SaveSessionsReport(pod="llama-2", node="node-2")
    reply = await mesh.bus.request(mesh.subjects.agent_command("record", "llama-1"), report, 5)
    assert isinstance(reply, DeadLetter)
    assert await mesh.service.registry.generation("s1") == generation  # nothing claimed
    await eventually(lambda: len(letters) >= 2)
    answer = await victim.bus.request(
        mesh.subjects.agent_command("locate", "llama-2"), LocateCheckpoint(session_id="s1", pod="llama-2"), 5
    )
    assert isinstance(answer, CheckpointLocation)  # the service still serves the pod that asks as itself
    await mesh.check(min_checkpoints=0)


BAD_IDS = ["", "../../x", "\x00", "x" * 10_000, "*", "a b", "s1\n", "../../../../tmp"]


async def test_identifiers_that_break_paths_or_subjects_are_refused_everywhere(mesh: Mesh) -> None:
    letters = await mesh.dead_letters("t-attack-ids")
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"])
    assert await mesh.periodic_turn() == 1
    announcements = mesh.subjects.for_event(AgentSessions(pod="llama-1", node="node-1"))
    for bad in BAD_IDS:
        await mesh.bus.nc.publish(
            announcements, forged(AgentSessions(pod="llama-1", node="node-1"), sessions=["s1", bad], generations=[1, 1])
        )
    claims = mesh.subjects.agent_command("locate", "llama-1")
    for bad in BAD_IDS:
        reply = await mesh.bus.nc.request(
            claims,
            forged(LocateCheckpoint(session_id="s1", pod="llama-1"), session_id=bad, take_session=True),
            timeout=5,
        )
        assert isinstance(codec.decode(reply.data), DeadLetter)
    record = mesh.subjects.agent_command("record", "llama-1")
    report = SaveSessionsReport(pod="llama-1", node="node-1")
    raw = msgspec.json.decode(codec.encode(report))
    raw["committed"] = [{"session_id": "../../../../tmp", "checkpoint_id": "x"}]
    reply = await mesh.bus.nc.request(record, msgspec.json.encode(raw), timeout=5)
    assert isinstance(codec.decode(reply.data), DeadLetter)
    await eventually(lambda: len(letters) >= 2 * len(BAD_IDS))
    assert await mesh.sessions_on("node-1") == {"s1"}  # nothing stored under a bad id
    for bad in BAD_IDS:
        for call in (mesh.store.checkpoints(bad), mesh.store.manifest("s1", bad), mesh.store.manifest(bad, "c")):
            try:
                await call
            except InvalidId:
                continue
            raise AssertionError(f"the store built a path from {bad!r}")
    for path in ("/sessions/..%2F..%2Fx", "/sessions/%2A", "/sessions/a%00b"):
        status, _ = await fetch(mesh.running.http_port, path)
        assert status == 400, path
    await pod.endpoint.stop()
    await mesh.service.registry.forget_pod("llama-1")  # its pod is gone: the session restores elsewhere
    restored = await (await mesh.add_pod("llama-2", "node-2")).endpoint.restore("s1")
    assert [bytes(b) for b in restored.blocks] == expected("s1", 3)
    await mesh.check(min_checkpoints=1)


async def test_a_pod_cannot_take_and_end_another_live_pods_session(mesh: Mesh) -> None:
    """The issue's attack: with pod llama-1's credentials, claim a session llama-2 holds, then announce it ended.
    The claim is refused (llama-2 is alive and runs), so the end is a stale holder's: nothing is deleted."""
    victim = await mesh.add_pod("llama-2", "node-2", ["s1"])
    assert await mesh.periodic_turn() == 1
    checkpoints = await mesh.store.checkpoints("s1")
    attacker = await mesh.add_pod("llama-1", "node-1")
    claim = LocateCheckpoint(
        session_id="s1", pod="llama-1", node="node-1", take_session=True, namespace="llm", deployment="llama"
    )
    answer = await attacker.bus.request(mesh.subjects.agent_command("locate", "llama-1"), claim, 5)
    assert isinstance(answer, CheckpointLocation) and answer.refused and answer.holder == "llama-2"
    ended = AgentSessions(pod="llama-1", node="node-1", full=False, ended=["s1"], incarnation="x", seq=0)
    await attacker.bus.request(mesh.subjects.for_event(ended), ended, 5)
    assert await mesh.store.checkpoints("s1") == checkpoints  # every checkpoint stands
    assert await mesh.sessions_on("node-2") == {"s1"}
    victim.grow("s1", 1)  # the victim's own announcements and saves still count
    assert await mesh.periodic_turn() == 1
    assert len(await mesh.service.registry.checkpoints("s1")) == 2
    # nor may a pod of another deployment take a session that is no longer held
    await mesh.evict(victim)
    other = LocateCheckpoint(
        session_id="s1", pod="llama-1", node="node-1", take_session=True, namespace="llm", deployment="mistral"
    )
    answer = await attacker.bus.request(mesh.subjects.agent_command("locate", "llama-1"), other, 5)
    assert isinstance(answer, CheckpointLocation) and "llm/llama" in answer.refused
    await mesh.check(min_checkpoints=2)
