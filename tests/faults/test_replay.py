"""Every message a pod or service sends, sent again byte for byte at the worst moments: after the sessions moved to
another pod, after the new holder saved under its new generation, after retention deleted what the first holder
saved, after a session ended. A duplicate or a replay changes nothing the second time (the registry's ownership,
generations, seals, records and drain verdicts, and the store's checkpoints, are as they were), and above all a
refusal never deletes what someone else committed (issue #30: a replayed save report once deleted the checkpoints
a new holder had just restored from).

The messages are captured off the wire as the agents, the CLI and the checkpoint service sent them (a plain NATS
subscription under the test's root) and replayed with the same subject, payload and headers; events stored in
JetStream are replayed once as they were and once without their message id, as a replay past the server's
duplicate window would arrive."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import redis.asyncio as aioredis
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from services.checkpoint.audit import RegistryAudit
from services.checkpoint.service import CheckpointService
from shared.contract.checkpoint import SaveSessionsReport
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import Subjects
from shared.kv.filestore import FileStore
from shared.plumbing.configsync import ConfigStore
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually

MSG_ID = "Nats-Msg-Id"


@dataclass(frozen=True)
class Sent:
    subject: str
    data: bytes
    headers: dict[str, str] | None
    asked: bool
    """A request (it had a reply subject): replayed as one, the answer awaited."""

    @property
    def kind(self) -> str:
        return self.subject.split(".", 1)[1]


class Wire:
    """What pods, the CLI and the services sent under the test's root (answers to inboxes excluded)."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []

    async def heard(self, msg: Msg) -> None:
        self.sent.append(Sent(msg.subject, bytes(msg.data), dict(msg.headers or {}) or None, bool(msg.reply)))

    def kinds(self) -> set[str]:
        return {kind_of(s) for s in self.sent}


def kind_of(sent: Sent) -> str:
    """The message kind: the subject less its root and the pod or node it names."""
    parts = sent.subject.split(".")[1:]
    if parts[:2] == ["cmd", "checkpoint"] and len(parts) == 4:
        return f"cmd.checkpoint.{parts[3]}"
    try:
        return str(msgspec.json.decode(sent.data)["kind"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return ".".join(parts)


class Scene(Protocol):
    """What the replay checks read: the open mesh of tests/faults/conftest.py, or the secured one."""

    client: aioredis.Redis
    subjects: Subjects
    store: FileStore
    service: CheckpointService


def source_of(sent: Sent) -> str:
    """Who sent it, as its body says (``agent/<pod>``, ``checkpoint/<node>``, ...); '' for a body without one."""
    try:
        return str(msgspec.json.decode(sent.data).get("source", ""))
    except (msgspec.DecodeError, AttributeError):
        return ""


async def state_of(mesh: Scene, sessions: Iterable[str], pods: Iterable[str], drains: Iterable[str]) -> dict[str, Any]:
    """What a replay must not change: per session its holder and generation, the generation counter, its seal, its
    recorded checkpoints and the checkpoints the store holds; per pod whether it counts as alive (a replayed
    heartbeat must not bring back a pod that left); per drain its recorded verdict."""
    r = mesh.client
    key = mesh.subjects.redis_key
    out: dict[str, Any] = {}
    for sid in sessions:
        place = await RegistryAudit(r, mesh.subjects).session_record(sid)
        out[sid] = {
            "holder": (place.pod, place.generation) if place else None,
            "counter": await mesh.service.registry.generation(sid),
            "seal": await r.hgetall(key("kv", "sealed", sid)),
            "recorded": sorted(str(c["checkpoint_id"]) for c in await mesh.service.registry.checkpoints(sid, 1000)),
            "stored": sorted(await mesh.store.checkpoints(sid)),
        }
    for pod in pods:
        alive = await r.exists(key("kv", "alive", pod))
        leaving = await r.hget(key("kv", "podinfo", pod), "leaving")
        out[f"pod {pod}"] = (alive, leaving)
    for drain_id in drains:
        out[f"drain {drain_id}"] = await mesh.service.leases.drain_verdict(drain_id)
    return out


async def replay(wire: Wire, sender: Callable[[Sent], Client]) -> list[str]:
    """Send every captured message again, as it was (stored events a second time without their message id too),
    each on the connection ``sender`` names for it; returns the answers' kinds, for the record."""
    answers: list[str] = []
    used: set[Client] = set()
    for sent in list(wire.sent):
        nc = sender(sent)
        used.add(nc)
        variants = [sent.headers]
        if sent.headers and MSG_ID in sent.headers:
            variants.append({k: v for k, v in sent.headers.items() if k != MSG_ID} or None)
        for headers in variants:
            if sent.asked:
                try:
                    reply = await nc.request(sent.subject, sent.data, timeout=10, headers=headers)
                except NoRespondersError:  # asked of a pod that is gone
                    answers.append("no responder")
                    continue
                except TimeoutError as exc:
                    raise AssertionError(
                        f"{kind_of(sent)} on {sent.subject} from {source_of(sent)} sent again: no answer {sent.headers}"
                    ) from exc
                answers.append(str(msgspec.json.decode(reply.data).get("kind", "?")))
            else:
                await nc.publish(sent.subject, sent.data, headers=headers)
    for nc in used:
        await nc.flush(timeout=5)
    return answers


async def settled(mesh: Scene, before: dict[str, Any], sessions: list[str], pods: list[str], drains: list[str]) -> None:
    """The state equals ``before`` once the service has handled what was replayed (it may still be handling stored
    events: wait for the equality, failing with the difference when it does not come)."""
    after: dict[str, Any] = {}

    async def same() -> bool:
        nonlocal after
        after = await state_of(mesh, sessions, pods, drains)
        return after == before

    try:
        await eventually(same, timeout=5)
    except AssertionError:
        diff = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
        raise AssertionError(f"a replay changed the state: {diff}") from None


async def test_every_message_sent_again_changes_nothing_and_deletes_nothing(mesh: Mesh) -> None:
    """The issue's case and its family: a drain moves llama-1's sessions to llama-2 (which restores them from the
    checkpoints llama-1 committed at the drain: the seals of llama-2's generations); then every message of the
    scenario so far is sent again, after the move, after llama-2 saved under its generation, after retention
    deleted llama-1's checkpoints, and after a session ended. Each time nothing changes and the fault checker is
    clean (every recorded checkpoint restores)."""
    wire = Wire()
    sub = await mesh.bus.nc.subscribe(f"{mesh.subjects.root}.>", cb=wire.heard)
    sessions, pods, drains = ["s1", "s2", "s3"], ["llama-1", "llama-2"], ["d1"]
    old = await mesh.add_pod("llama-1", "node-1", sessions, blocks=2)
    assert await mesh.periodic_turn() == 1
    # the drain: its request (as the CLI sends it), the save command, the agent's report, the verdict
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=10))
    await eventually(lambda: any(v.drain_id == "d1" for v in mesh.verdicts))
    assert isinstance(mesh.verdicts[-1], DrainCompleted) and mesh.verdicts[-1].sessions_committed == 3
    # the evicted pod's preStop save (nothing new since the drain: confirmed, via `record`); then it leaves
    await old.endpoint.final_save(deadline_s=10)
    await mesh.evict(old)
    # llama-2 takes every session (`locate`), restores it from the drain's checkpoint, and says so (`restored`)
    new = await mesh.add_pod("llama-2", "node-2")
    seals = {}
    for sid in sessions:
        restored = await new.endpoint.restore(sid)
        assert [bytes(b) for b in restored.blocks] == expected(sid, 2)
        seals[sid] = restored.manifest.checkpoint_id
    await eventually(lambda: all(_restored_reported(mesh, wire, sid) for sid in sessions))
    await new.endpoint.follow_serving_version()  # the rollouts' `serving` question
    where = WhereIsSession(session_id="s1")  # a router's question
    assert isinstance(await mesh.bus.request(mesh.subjects.for_event(where), where, timeout=10), SessionLocation)
    await sub.unsubscribe()
    kinds = wire.kinds()
    for kind in (
        "checkpoint.agent.sessions",
        "cmd.checkpoint.locate",
        "cmd.checkpoint.restored",
        "cmd.checkpoint.record",
        "cmd.checkpoint.serving",
        "kv.session.where",
        "checkpoint.save.command",
        "node.drain.requested",
        "node.drain.completed",
        "checkpoint.saved",
        "kv.session.location",
    ):
        assert kind in kinds, f"the scenario sent no {kind}: {sorted(kinds)}"

    # 1. after the move
    before = await state_of(mesh, sessions, pods, drains)
    assert all(seals[sid] in before[sid]["recorded"] and seals[sid] in before[sid]["stored"] for sid in sessions)
    await replay(wire, lambda _: mesh.bus.nc)
    await settled(mesh, before, sessions, pods, drains)
    await mesh.check(min_checkpoints=6, drains=drains)  # the preStop found nothing new: 3 periodic, 3 drained
    for sid in sessions:  # what llama-2 restored is still there and still restores
        assert (await new.endpoint.restore(sid)).manifest.checkpoint_id == seals[sid]

    # 2. after the new holder saved under its generation
    new.grow("s1", 1)
    assert await mesh.periodic_turn() == 1
    before = await state_of(mesh, sessions, pods, drains)
    assert before["s1"]["recorded"][-1] != seals["s1"]
    await replay(wire, lambda _: mesh.bus.nc)
    await settled(mesh, before, sessions, pods, drains)
    await mesh.check(min_checkpoints=9, drains=drains)

    # 3. after retention deleted what llama-1 saved of s1 (one checkpoint a session kept: the new holder's)
    policy = CheckpointPolicy(periodic_interval_s=0, keep_per_session=1)
    await ConfigStore(mesh.client, mesh.subjects).write("checkpoint", policy, 1, "replay")
    await eventually(lambda: mesh.service.policy().keep_per_session == 1)
    await mesh.service.retention.collect_garbage()
    before = await state_of(mesh, sessions, pods, drains)
    assert len(before["s1"]["stored"]) == 1 and seals["s1"] not in before["s1"]["stored"]
    await replay(wire, lambda _: mesh.bus.nc)
    await settled(mesh, before, sessions, pods, drains)
    await mesh.check(min_checkpoints=3, drains=drains)

    # 4. after a session ended (its checkpoints retired)
    new.endpoint.end_session("s3")
    await eventually(lambda: _gone(mesh, "s3"))
    before = await state_of(mesh, sessions, pods, drains)
    await replay(wire, lambda _: mesh.bus.nc)
    await settled(mesh, before, sessions, pods, drains)
    await mesh.check(min_checkpoints=2, drains=drains)
    for sid in ("s1", "s2"):
        assert len((await new.endpoint.restore(sid)).blocks) == (3 if sid == "s1" else 2)


def _restored_reported(mesh: Mesh, wire: Wire, sid: str) -> bool:
    return any(kind_of(s) == "cmd.checkpoint.restored" and sid.encode() in s.data for s in wire.sent)


async def _gone(mesh: Mesh, sid: str) -> bool:
    return not await mesh.store.checkpoints(sid) and not await mesh.service.registry.checkpoints(sid)


async def test_a_replayed_save_report_of_the_old_holder_is_answered_and_deletes_nothing(mesh: Mesh) -> None:
    """The issue's exact reproduction, on its own: llama-1's preStop report is sent again after llama-2 restored
    from the checkpoints it names. The answer says they are committed (they are), and they stay in the store and
    the registry: llama-2's newest checkpoint is not lost."""
    old = await mesh.add_pod("llama-1", "node-1", ["s1", "s2"], blocks=2)
    final = await old.endpoint.final_save(deadline_s=10)
    assert {c.session_id for c in final.committed} == {"s1", "s2"}
    report = SaveSessionsReport(pod="llama-1", node="node-1", store=final.store, committed=final.committed)
    await mesh.evict(old)
    new = await mesh.add_pod("llama-2", "node-2")
    for sid in ("s1", "s2"):
        await new.endpoint.restore(sid)
    subject = mesh.subjects.agent_command("record", "llama-1")
    for _ in range(2):
        answer = await mesh.bus.request(subject, report, timeout=10)
        assert isinstance(answer, SaveSessionsReport)
        assert {c.checkpoint_id for c in answer.committed} == {c.checkpoint_id for c in final.committed}
        assert not answer.failed
    for c in final.committed:
        assert c.checkpoint_id in await mesh.store.checkpoints(c.session_id)
        assert (await mesh.service.registry.newest_checkpoint(c.session_id) or {}).get("checkpoint_id") == (
            c.checkpoint_id
        )
    await mesh.check(min_checkpoints=2)
