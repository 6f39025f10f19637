"""KV events for routers: every move of a session's KV cache is published once, in order, by the checkpoint
service, and "which pod holds session S now" is answered over the bus and HTTP, from the registry itself."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from itertools import pairwise
from pathlib import Path

import msgspec
from nats.js import api as js_api

from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.registry import codec
from shared.contract.sessions import SessionLocation, WhereIsSession
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually, fetch


class Router:
    """What a KV-aware router keeps: per session, the newest location seen (by sequence), nothing else."""

    def __init__(self) -> None:
        self.seen: list[SessionLocation] = []
        self.table: dict[str, SessionLocation] = {}

    async def on_location(self, event: SessionLocation) -> None:
        self.seen.append(event)
        self.follow(event)

    def follow(self, event: SessionLocation) -> None:
        known = self.table.get(event.session_id)
        if known is None or event.supersedes(known):
            self.table[event.session_id] = event

    def of(self, session_id: str) -> list[SessionLocation]:
        return [e for e in self.seen if e.session_id == session_id]

    def story(self, session_id: str) -> list[tuple[str, bool, str, int, str]]:
        return [(e.reason, e.held, e.pod, e.generation, e.previous_pod) for e in self.of(session_id)]


async def follow(mesh: Mesh) -> Router:
    router = Router()
    await mesh.bus.subscribe(mesh.subjects.pattern("kv.session.location"), router.on_location, (SessionLocation,))
    return router


async def where(mesh: Mesh, session_id: str) -> SessionLocation:
    answer = await mesh.bus.request(
        mesh.subjects.command("checkpoint", "where"), WhereIsSession(session_id=session_id), 5
    )
    assert isinstance(answer, SessionLocation), answer
    return answer


async def http_where(mesh: Mesh, path: str) -> tuple[int, dict[str, object]]:
    status, body = await fetch(mesh.running.http_port, path)
    return status, json.loads(body)


async def test_a_session_drained_and_restored_elsewhere_is_followed_in_order(mesh: Mesh) -> None:
    router = await follow(mesh)
    # pod A on node-1 starts s1 and s2 and announces every 0.2 s: ticks that change nothing publish nothing
    a = await mesh.add_pod("llama-a", "node-1", ["s1", "s2"], blocks=3, announce_s=0.2)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=10))
    await eventually(lambda: any(v.drain_id == "d1" for v in mesh.verdicts))
    assert isinstance(mesh.verdicts[-1], DrainCompleted) and mesh.verdicts[-1].sessions_committed == 2
    await eventually(lambda: [e.reason for e in router.of("s1")] == ["placed", "saved"])
    saved = router.of("s1")[-1]
    # pod B on node-2 restores s1; A keeps announcing its stale copy of s1, which moves nothing
    b = await mesh.add_pod("llama-b", "node-2")
    restored = await b.endpoint.restore("s1")
    assert [bytes(x) for x in restored.blocks] == expected("s1", 3)
    await eventually(lambda: len(router.of("s1")) == 4)
    await mesh.announce(a)
    await mesh.announce(b)

    # the locate query answers B, over the bus and over HTTP, with the checkpoint it restored
    now = await where(mesh, "s1")
    assert (now.held, now.pod, now.node, now.namespace, now.deployment) == (True, "llama-b", "node-2", "llm", "llama")
    assert now.generation == b.agent.generation("s1") == 2
    assert now.checkpoint_id == saved.checkpoint_id and now.token_count == a.agent.tokens("s1") > 0
    # with the model version that built it (a router sends it only to a pod holding that version)
    assert now.model_version == saved.model_version == a.agent.layout.model_version != ""
    assert (now.sequence, now.reason) == (router.of("s1")[-1].sequence, "restored")
    status, body = await http_where(mesh, "/sessions/s1")
    assert status == 200 and body["pod"] == "llama-b" and body["node"] == "node-2" and body["generation"] == 2
    assert body["kind"] == "kv.session.location" and body["checkpoint_id"] == saved.checkpoint_id

    # A's pod goes away without a word; the next drain of node-1 finds it gone: s2 is held by nothing
    await a.endpoint.stop()
    await eventually(lambda: _silent(mesh, "llama-a"))
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d2", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "d2" for v in mesh.verdicts))
    # B ends the conversation s1
    b.endpoint.end_session("s1")
    await mesh.announce(b)
    await eventually(lambda: router.of("s1")[-1].reason == "ended" and router.of("s2")[-1].reason == "forgotten")

    assert router.story("s1") == [
        ("placed", True, "llama-a", 1, ""),
        ("saved", True, "llama-a", 1, ""),
        ("placed", True, "llama-b", 2, "llama-a"),
        ("restored", True, "llama-b", 2, ""),
        ("ended", False, "", 2, "llama-b"),
    ]
    assert router.story("s2") == [
        ("placed", True, "llama-a", 1, ""),
        ("saved", True, "llama-a", 1, ""),
        ("forgotten", False, "", 1, "llama-a"),
    ]
    for sid in ("s1", "s2"):
        events = router.of(sid)
        assert all(later.sequence > earlier.sequence for earlier, later in pairwise(events))
        assert all(later.generation >= earlier.generation for earlier, later in pairwise(events))
    assert router.of("s1")[3].checkpoint_id == saved.checkpoint_id  # restored from what A saved
    assert router.of("s2")[-1].checkpoint_id  # restorable: a pod that takes s2 restores it from there

    # stale events cannot pass for newer ones: a router that gets them in any order ends where the registry is
    late = Router()
    for event in reversed(router.seen):
        late.follow(event)
    assert late.table == router.table
    assert not router.of("s1")[1].supersedes(router.of("s1")[2])  # A's save does not move s1 back to A

    # an ended session: no pod holds it (404), its last change says why; a session never seen is unknown
    gone = await where(mesh, "s1")
    assert (gone.held, gone.reason, gone.pod, gone.previous_pod, gone.checkpoint_id) == (
        False,
        "ended",
        "",
        "llama-b",
        "",
    )
    status, body = await http_where(mesh, "/sessions/s1")
    assert status == 404 and body["reason"] == "ended" and body["held"] is False
    status, body = await http_where(mesh, "/sessions/s2")
    assert status == 404 and body["reason"] == "forgotten" and body["checkpoint_id"]
    never = await where(mesh, "never-seen")
    assert (never.held, never.reason, never.sequence) == (False, "unknown", 0)
    assert (await http_where(mesh, "/sessions/never-seen"))[0] == 404
    # a router starting now reads the newest location of every session from the stream, then follows
    catch_up = await mesh.bus.js.pull_subscribe(
        mesh.subjects.pattern("kv.session.location"),
        config=js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.LAST_PER_SUBJECT),
    )
    newest = {e.session_id: e for e in (codec.decode(m.data) for m in await catch_up.fetch(2, timeout=5))}
    assert newest == router.table
    await mesh.check(min_checkpoints=1, drains=["d1", "d2"])


async def test_a_session_its_engine_dropped_is_held_by_nothing(mesh: Mesh) -> None:
    router = await follow(mesh)
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"])
    pod.agent.forget_session("s1")  # preempted by the engine: not ended, just no longer on the pod
    await mesh.announce(pod)
    await mesh.announce(pod)
    await eventually(lambda: [e.reason for e in router.of("s1")] == ["placed", "dropped"])
    dropped = router.of("s1")[-1]
    assert (dropped.held, dropped.previous_pod, dropped.namespace, dropped.deployment) == (
        False,
        "llama-1",
        "llm",
        "llama",
    )
    assert (await where(mesh, "s1")).reason == "dropped"
    assert (await http_where(mesh, "/sessions/s1"))[0] == 404
    # taken again on another pod: placed there
    other = await mesh.add_pod("llama-2", "node-2")
    await other.endpoint.start_session("s1")
    await eventually(lambda: len(router.of("s1")) == 3)
    assert router.story("s1")[-1] == ("placed", True, "llama-2", 2, "llama-1")
    assert len(router.seen) == 3  # announcements that change nothing publish nothing


async def test_bad_where_requests_get_a_clear_answer_and_a_dead_letter(mesh: Mesh) -> None:
    letters = await mesh.dead_letters("t-where-dl")
    subject = mesh.subjects.command("checkpoint", "where")
    bad = [b"{", b'{"kind":"kv.session.where"}', b'{"kind":"kv.session.where","session_id":"a b"}']
    for data in bad:
        reply = codec.decode((await mesh.bus.nc.request(subject, data, timeout=5)).data)
        assert isinstance(reply, DeadLetter)
    reply = codec.decode((await mesh.bus.nc.request(subject, bad[2], timeout=5)).data)
    assert isinstance(reply, DeadLetter) and "session_id" in reply.reason
    await eventually(lambda: len(letters) >= len(bad) + 1)
    for path, word in (("/sessions/a%20b", "not valid"), ("/sessions/", "no session id"), ("/sessions/x/y", "x/y")):
        status, body = await http_where(mesh, path)
        assert status == 400 and word in str(body["error"]), (path, body)
    assert (await fetch(mesh.running.http_port, "/sessions"))[0] == 404  # not a route: the probes' 404
    assert (await where(mesh, "still-answering")).reason == "unknown"


async def test_a_checkpoint_recorded_twice_is_one_event(mesh: Mesh) -> None:
    router = await follow(mesh)
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"])
    report = await pod.endpoint.final_save(deadline_s=10)
    assert [c.session_id for c in report.committed] == ["s1"]
    again = await mesh.service.saves.on_record(msgspec.structs.replace(report, event_id="again"))
    assert [c.session_id for c in again.committed] == ["s1"]
    pod.endpoint.end_session("s1")  # a later change: once its event is in, any from the second record would be
    await mesh.announce(pod)
    await eventually(lambda: router.of("s1") and router.of("s1")[-1].reason == "ended")
    assert [e.reason for e in router.seen] == ["placed", "saved", "ended"]


async def test_gpuwarden_where_prints_one_line(mesh: Mesh, tmp_path: Path) -> None:
    pod = await mesh.add_pod("llama-1", "node-1", ["s1", "s2"])
    pod.endpoint.end_session("s2")
    await mesh.announce(pod)
    env = dict(
        os.environ,
        GPUWARDEN_HOME=str(tmp_path),
        GPUWARDEN_NATS_URL=mesh.settings.nats.servers[0],
        GPUWARDEN_REDIS_URL=mesh.settings.redis.url,
        GPUWARDEN_ROOT=mesh.subjects.root,
    )

    async def where_cli(session: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.cli", "where", session, env=env, stdout=-1, stderr=-1
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()

    assert await where_cli("s1") == (0, "s1: pod llama-1 on node node-1, generation 1\n", "")
    assert await where_cli("s2") == (1, "s2: held by no pod (ended, last on pod llama-1)\n", "")
    code, out, err = await where_cli("nope")  # a lookup that matches nothing: one line on stderr (issue #35)
    assert (
        (code, out) == (1, "")
        and err.startswith("gpuwarden where: no session 'nope' is known")
        and err.count("\n") == 1
    )
    code, out, err = await where_cli("a b")
    assert (code, out) == (2, "") and "argument session: session id 'a b' is not valid" in err


async def _silent(mesh: Mesh, pod: str) -> bool:
    return pod in await mesh.service.registry.silent_pods()
