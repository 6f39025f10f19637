"""The session registry at fleet scale: announcements are deltas, a heartbeat renews one lease, what a change
costs does not grow with what the pod holds, an agent resyncs in full when the registry lost what a delta builds
on, long announcements and reports go in parts, and counts and pages cost what they name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.checkpoint.registry import SessionRegistry
from shared.contract.checkpoint import AgentSessions, CommittedCheckpoint, SaveSessions, SaveSessionsReport
from shared.contract.sessions import FleetQuery, FleetSummary, SessionsPage, SessionsQuery
from shared.contract.subjects import Subjects
from shared.kv import endpoint as endpoint_module
from shared.kv import reports as reports_module
from shared.kv.manifest import new_checkpoint_id
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually
from tests.servers import RedisServer


@pytest.fixture
async def own_redis() -> AsyncIterator[aioredis.Redis]:
    """A Redis nobody else uses: its command counts are this test's alone."""
    server = RedisServer().start()
    client = aioredis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        await client.aclose()
        server.cleanup()


async def commands(client: aioredis.Redis) -> int:
    """Commands the server ran so far, those inside scripts included."""
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config"))


def announcement(pod: str, seq: int, **fields: object) -> AgentSessions:
    return AgentSessions(
        pod=pod, node="node-1", namespace="llm", deployment="llama", incarnation="i1", seq=seq, ttl_s=30, **fields
    )  # type: ignore[arg-type]


async def test_a_change_and_a_heartbeat_cost_the_same_whatever_the_pod_holds(own_redis: aioredis.Redis) -> None:
    registry = SessionRegistry(own_redis, Subjects("t"))
    costs: dict[int, tuple[int, int, int]] = {}
    for held in (1, 10, 2000):  # the first round loads the scripts into Redis
        pod = f"pod-{held}"
        sessions = [f"{pod}-s{i}" for i in range(held)]
        await registry.apply_announcement(announcement(pod, 1, full=True, sessions=sessions, generations=[1] * held))
        before = await commands(own_redis)
        await registry.apply_announcement(announcement(pod, 1, full=False))  # a heartbeat
        heartbeat = await commands(own_redis) - before
        before = await commands(own_redis)
        claim = await registry.claim(f"{pod}-new", pod, "node-1", "llm", "llama", 0)
        await registry.apply_announcement(
            announcement(pod, 2, full=False, sessions=[f"{pod}-new"], generations=[claim.generation])
        )
        start = await commands(own_redis) - before
        before = await commands(own_redis)
        await registry.apply_announcement(announcement(pod, 3, full=False, ended=[f"{pod}-new"]))
        end = await commands(own_redis) - before
        costs[held] = (heartbeat, start, end)
    assert costs[10] == costs[2000], costs  # the same commands, whatever the pod holds
    assert costs[10][0] <= 10, costs


async def test_a_delta_that_does_not_follow_is_answered_resync_and_the_full_announcement_repairs(
    mesh: Mesh,
) -> None:
    pod = await mesh.add_pod("llama-1", "node-1", ["s1", "s2"])
    await pod.endpoint.start_session("s3")
    await mesh.announce(pod)
    assert await mesh.sessions_on("node-1") == {"s1", "s2", "s3"}
    # Redis fails over and loses the last writes: s3's placement and the pod's announcement number with them
    key = mesh.subjects.redis_key
    await mesh.client.hset(key("kv", "podinfo", "llama-1"), "seq", 0)
    await mesh.client.delete(key("kv", "session", "s3"))
    await mesh.client.hdel(key("kv", "onnode", "node-1"), "s3")
    await mesh.client.hdel(key("kv", "held", "llama-1"), "s3")
    await pod.endpoint.start_session("s4")  # the next delta names only s4, and does not follow: resync
    await mesh.announce(pod)
    await eventually(lambda: _sessions_are(mesh, "node-1", {"s1", "s2", "s3", "s4"}))
    await mesh.check(min_checkpoints=0)


async def _sessions_are(mesh: Mesh, node: str, want: set[str]) -> bool:
    await mesh.announce(mesh.pods[0])
    return await mesh.sessions_on(node) == want


async def test_long_announcements_and_reports_go_in_parts(mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_module, "ANNOUNCE_PART", 3)
    monkeypatch.setattr(reports_module, "REPORT_PART", 4)
    names = [f"s{i}" for i in range(10)]
    pod = await mesh.add_pod("llama-1", "node-1", names)
    assert await mesh.sessions_on("node-1") == set(names)  # the full announcement came in four parts
    report = await pod.endpoint.final_save(deadline_s=10)
    assert sorted(c.session_id for c in report.committed) == sorted(names) and not report.failed
    for sid in names:
        assert len(await mesh.service.registry.checkpoints(sid)) == 1, sid
    for sid in names[:7]:
        pod.grow(sid, 1)
    command = SaveSessions(pod="llama-1", changed_only=True)
    last = await mesh.bus.request(mesh.subjects.for_event(command), command, 10)
    assert isinstance(last, SaveSessionsReport) and last.unchanged == 3 and last.parts_recorded == 1
    for sid in names[:7]:
        assert len(await mesh.service.registry.checkpoints(sid)) >= 1
    # a pod restarted (a new incarnation) announces in full, in parts, and forgets what it no longer holds
    await pod.endpoint.stop()
    pod.agent.forget_session("s9")
    restarted = endpoint_module.AgentEndpoint(pod.agent, pod.bus, announce_s=30)
    await restarted.start()
    await eventually(lambda: _no("s9", mesh))
    assert await mesh.sessions_on("node-1") == set(names) - {"s9"}
    await restarted.stop()
    # the last part of the second save's report was the reply to this test, not to the service: s4..s6's newest
    # checkpoints are in the store and never recorded (the next restore of each records it again)
    await mesh.check(min_checkpoints=14, unrecorded=names[4:7])


async def _no(sid: str, mesh: Mesh) -> bool:
    return sid not in await mesh.sessions_on("node-1")


async def test_counts_and_pages_cost_what_they_name(mesh: Mesh) -> None:
    await mesh.add_pod("llama-1", "node-1", [f"a{i}" for i in range(7)])
    await mesh.add_pod("llama-2", "node-2", [f"b{i}" for i in range(5)])
    summary = await mesh.bus.request(mesh.subjects.command("checkpoint", "fleet"), FleetQuery(), 5)
    assert isinstance(summary, FleetSummary)
    assert summary.sessions_total == 12 and summary.by_node == {"node-1": 7, "node-2": 5}
    assert summary.by_deployment == {"llm/llama": 12} and sorted(summary.alive) == ["llama-1", "llama-2"]
    seen: list[str] = []
    cursor = ""
    while True:
        page = await mesh.bus.request(
            mesh.subjects.command("checkpoint", "sessions"), SessionsQuery(node="node-1", cursor=cursor, limit=3), 5
        )
        assert isinstance(page, SessionsPage) and page.total == 7 and len(page.sessions) <= 7
        seen += [r.session_id for r in page.sessions]
        cursor = page.next_cursor
        if not cursor:
            break
    assert sorted(set(seen)) == [f"a{i}" for i in range(7)]
    page = await mesh.bus.request(
        mesh.subjects.command("checkpoint", "sessions"), SessionsQuery(namespace="llm", deployment="llama"), 5
    )
    assert isinstance(page, SessionsPage) and page.total == 12 and len({r.session_id for r in page.sessions}) == 12


async def test_a_live_pod_keeps_its_sessions_until_it_leaves(mesh: Mesh) -> None:
    holder = await mesh.add_pod("llama-1", "node-1", ["s1"])
    assert await mesh.periodic_turn() == 1
    other = await mesh.add_pod("llama-2", "node-2")
    with pytest.raises(endpoint_module.SessionHeld) as refused:
        await other.endpoint.restore("s1")
    assert refused.value.holder == "llama-1"
    assert await mesh.sessions_on("node-1") == {"s1"}
    await mesh.evict(holder)  # its agent stops: the registry hears it is leaving
    restored = await other.endpoint.restore("s1")
    assert [bytes(b) for b in restored.blocks] == expected("s1", 3)
    await mesh.check(min_checkpoints=1)


async def test_a_periodic_save_that_did_not_happen_is_asked_again_soon_not_an_interval_later(mesh: Mesh) -> None:
    from shared.contract.configdocs import CheckpointPolicy
    from shared.plumbing.configsync import ConfigStore
    from shared.plumbing.errors import PermanentError

    pod = await mesh.add_pod("llama-1", "node-1", ["s1"])
    asked: list[str] = []
    answer = pod.endpoint.on_save

    async def refuse_once(command: SaveSessions) -> SaveSessionsReport:
        asked.append(command.reason)
        if len(asked) == 1:
            raise PermanentError("not now")  # answered at once with a refusal: the save did not happen
        return await answer(command)

    assert pod.endpoint._serving is not None  # the pod answers its save commands with refuse_once from now on
    await pod.endpoint._serving.unsubscribe()
    subject = mesh.subjects.for_event(SaveSessions(pod="llama-1"))
    pod.endpoint._serving = await pod.bus.serve(subject, refuse_once, (SaveSessions,))
    current = await ConfigStore(mesh.client, mesh.subjects).read("checkpoint")
    assert current is not None
    await ConfigStore(mesh.client, mesh.subjects).write(
        "checkpoint", CheckpointPolicy(periodic_interval_s=20), current.version, "test"
    )
    await eventually(lambda: len(asked) >= 1, timeout=40)  # the pod's first periodic save, at its own time
    # asked again within a tenth of the interval (2 s), long before its next own time (20 s on) would come round
    await eventually(lambda: len(asked) >= 2, timeout=10)
    await eventually(lambda: _recorded(mesh, "s1"), timeout=30)
    await mesh.check(min_checkpoints=1)


async def _recorded(mesh: Mesh, sid: str) -> bool:
    return bool(await mesh.service.registry.checkpoints(sid))


def _committed(sid: str, generation: int, sequence: int) -> CommittedCheckpoint:
    return CommittedCheckpoint(
        session_id=sid,
        checkpoint_id=new_checkpoint_id(generation, sequence),
        generation=generation,
        sequence=sequence,
        bytes_total=4096,
    )


async def _lose_claim(client: aioredis.Redis, subjects: Subjects, sid: str, pod: str, node: str) -> None:
    """What a Redis failover does to a claim the replica had not received yet: every trace of it is gone."""
    key = subjects.redis_key
    await client.delete(
        key("kv", "generation", sid), key("kv", "session", sid), key("kv", "owner", sid), key("kv", "last", sid)
    )
    await client.hdel(key("kv", "held", pod), sid)
    await client.hdel(key("kv", "onnode", node), sid)


async def test_a_generation_handed_out_twice_after_a_lost_claim_keeps_one_holder(own_redis: aioredis.Redis) -> None:
    subjects = Subjects("t")
    registry = SessionRegistry(own_redis, subjects)
    for pod in ("pod-a", "pod-b"):  # both alive
        await registry.apply_announcement(announcement(pod, 1, full=True))
    first = await registry.claim("chat", "pod-a", "node-1", "llm", "llama", 0)
    await _lose_claim(own_redis, subjects, "chat", "pod-a", "node-1")
    second = await registry.claim("chat", "pod-b", "node-1", "llm", "llama", 0)
    assert first.generation == second.generation == 1  # the same generation, twice: what the failover allows
    await registry.apply_announcement(announcement("pod-b", 2, full=False, sessions=["chat"], generations=[1]))
    # pod-a announces the generation it was given: pod-b, alive, holds that generation, so pod-a's copy is stale
    applied = await registry.apply_announcement(
        announcement("pod-a", 2, full=False, sessions=["chat"], generations=[1])
    )
    assert applied.stale == ["chat"] and not applied.changes
    assert (await registry.where("chat")).pod == "pod-b"
    refused = await registry.record_checkpoint(_committed("chat", 1, 1), "file:///s", "pod-a", "node-1")
    assert "pod-b" in refused.refused and refused.deletable  # pod-b holds generation 1: pod-a's save is stale
    recorded = await registry.record_checkpoint(_committed("chat", 1, 2), "file:///s", "pod-b", "node-1")
    assert recorded.refused == "" and recorded.first_time
    # once pod-b is gone (its lease ran out), the same generation announced by pod-a is placed again
    await own_redis.delete(subjects.redis_key("kv", "alive", "pod-b"))
    applied = await registry.apply_announcement(
        announcement("pod-a", 3, full=False, sessions=["chat"], generations=[1])
    )
    assert not applied.stale and (await registry.where("chat")).pod == "pod-a"


async def test_a_heartbeat_after_a_lost_last_delta_is_answered_resync(own_redis: aioredis.Redis) -> None:
    """The pod's last delta was applied and confirmed, then lost in a failover (the registry applied one number
    less): the pod has nothing new to say, so its heartbeat repeats that number. The registry must not adopt it
    without the data: resync, and the full announcement places the session again."""
    subjects = Subjects("t")
    registry = SessionRegistry(own_redis, subjects)
    await registry.apply_announcement(announcement("pod-a", 1, full=True, sessions=["s1"], generations=[1]))
    assert not (
        await registry.apply_announcement(announcement("pod-a", 1, full=False))
    ).resync  # a heartbeat that follows
    claim = await registry.claim("s2", "pod-a", "node-1", "llm", "llama", 0)
    await registry.apply_announcement(
        announcement("pod-a", 2, full=False, sessions=["s2"], generations=[claim.generation])
    )
    await _lose_claim(own_redis, subjects, "s2", "pod-a", "node-1")
    await own_redis.hset(subjects.redis_key("kv", "podinfo", "pod-a"), "seq", 1)
    assert (await registry.apply_announcement(announcement("pod-a", 2, full=False))).resync
    await registry.apply_announcement(
        announcement("pod-a", 3, full=True, sessions=["s1", "s2"], generations=[1, claim.generation])
    )
    assert (await registry.where("s2")).pod == "pod-a"
    assert not (await registry.apply_announcement(announcement("pod-a", 3, full=False))).resync


async def test_an_old_announcement_sent_again_changes_nothing_and_an_agent_that_lost_answers_recovers(
    own_redis: aioredis.Redis,
) -> None:
    """Replay fences of the announcements (issue #30): from an agent that numbers monotonically, one numbered below
    the last applied changes nothing, not even the lease (a replayed empty full announcement once dropped every
    session the pod had taken since); one of an incarnation a later one replaced changes nothing either. An agent
    whose answers were lost (the registry applied 1..3, it knows only 1) is answered resync and its full
    announcement, numbered above all it sent, repairs. Without ``monotonic`` (an older agent) today's rule holds."""
    registry = SessionRegistry(own_redis, Subjects("t"))
    key = Subjects("t").redis_key
    first = announcement("pod-a", 1, full=True, monotonic=True)  # the agent's start: it holds nothing yet
    await registry.apply_announcement(first)
    for seq, sid in ((2, "s1"), (3, "s2")):
        claim = await registry.claim(sid, "pod-a", "node-1", "llm", "llama", 0)
        await registry.apply_announcement(
            announcement("pod-a", seq, full=False, monotonic=True, sessions=[sid], generations=[claim.generation])
        )
    held = {"s1", "s2"}
    assert set(await registry.sessions_of_pod("pod-a")) == held
    await own_redis.delete(key("kv", "alive", "pod-a"))
    replayed = await registry.apply_announcement(first)
    assert replayed.resync and not replayed.changes
    assert set(await registry.sessions_of_pod("pod-a")) == held
    assert not await own_redis.exists(key("kv", "alive", "pod-a")), "a replay renewed the lease"
    # the agent lost the answers of 2 and 3: its next delta is numbered 2 again, answered resync, nothing applied
    again = await registry.apply_announcement(announcement("pod-a", 2, full=False, monotonic=True, dropped=["s1"]))
    assert again.resync and set(await registry.sessions_of_pod("pod-a")) == held
    # its full announcement takes the number after the highest it sent (3): applied, the lease renewed
    repaired = await registry.apply_announcement(
        announcement("pod-a", 4, full=True, monotonic=True, sessions=["s2"], generations=[1])
    )
    assert not repaired.resync and set(await registry.sessions_of_pod("pod-a")) == {"s2"}
    assert await own_redis.exists(key("kv", "alive", "pod-a"))
    # the pod's agent restarts (a new incarnation); the old incarnation's messages change nothing from then on
    restarted = AgentSessions(
        pod="pod-a", node="node-1", namespace="llm", deployment="llama", incarnation="i2", seq=1, ttl_s=30,
        full=True, monotonic=True, sessions=["s2"], generations=[1],
    )  # fmt: skip
    await registry.apply_announcement(restarted)
    old = await registry.apply_announcement(announcement("pod-a", 5, full=True, monotonic=True))
    assert old.resync and set(await registry.sessions_of_pod("pod-a")) == {"s2"}
    # an older agent (not monotonic) keeps today's rule: a delta behind what was applied is applied, answered resync
    await registry.apply_announcement(announcement("pod-b", 3, full=True, sessions=["b1"], generations=[1]))
    legacy = await registry.apply_announcement(announcement("pod-b", 2, full=False, dropped=["b1"]))
    assert legacy.resync and await registry.sessions_of_pod("pod-b") == {}


async def test_a_late_announcement_of_an_older_generation_leaves_its_holder_indexed(own_redis: aioredis.Redis) -> None:
    """A pod that took a session again (a newer generation) and then is heard announcing the generation it held
    before (its delta sent again after a failover, or delayed): the announcement is stale and changes nothing, so
    the session stays in its pod's index beside its record and its node's index (before this fence the stale
    branch took it out of the pod's index only, and the fault checker found the session on its node but not in its
    pod's index: issue #30's replay scenario, seen under load)."""
    subjects = Subjects("t")
    registry = SessionRegistry(own_redis, subjects)
    await registry.apply_announcement(announcement("pod-a", 1, full=True))
    first = await registry.claim("chat", "pod-a", "node-1", "llm", "llama", 0)
    await registry.apply_announcement(
        announcement("pod-a", 2, full=False, sessions=["chat"], generations=[first.generation])
    )
    again = await registry.claim("chat", "pod-a", "node-1", "llm", "llama", 0)  # taken again: a newer generation
    assert again.generation == first.generation + 1
    late = await registry.apply_announcement(
        announcement("pod-a", 2, full=False, sessions=["chat"], generations=[first.generation])
    )
    assert late.stale == ["chat"] and not late.changes
    where = await registry.where("chat")
    assert (where.pod, where.generation) == ("pod-a", again.generation)
    assert "chat" in await registry.sessions_of_pod("pod-a")
    # another pod's stale announcement still leaves that pod's own index
    await registry.apply_announcement(announcement("pod-b", 1, full=True, sessions=["chat"], generations=[1]))
    assert "chat" not in await registry.sessions_of_pod("pod-b")
    assert (await registry.where("chat")).pod == "pod-a"
