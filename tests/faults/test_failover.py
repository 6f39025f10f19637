"""Failovers of the production topology, as an adversary runs them.

Redis: a primary, its replica and three Sentinels (``ReplicatedRedis`` in tests/servers.py; the checkpoint service
and the checker reach it through the Sentinels). The replica is cut off, sessions grow and are checkpointed on the
primary alone, the primary is SIGKILLed and the Sentinels promote the replica: the registry comes back without its
last writes (the newest checkpoints, the generations handed out since). The store is the last word: every
session restores its newest committed checkpoint, not an older one the registry still names; no generation is
handed out at or below one a stored checkpoint carries; every drain gets one verdict; the checker is clean.

NATS (the ``test_nats_*`` scenarios): a 3-server cluster on loopback (``NatsCluster``) with every stream replicated
on all three (R3, ``GPUWARDEN_NATS_REPLICAS=3``), every client given every server's URL. A server is SIGKILLed: the
one a request or a CLI command is connected to, the leader of the events stream, or the JetStream meta leader;
mid-drain and mid-upgrade. Every drain ends with one verdict, every session is restored byte for byte, and the
invariant checker finds nothing. Scenarios marked ``long`` run in ``make faults`` only (``make test`` has a time
budget).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.common import Counting
from shared.console import operations
from shared.contract.checkpoint import SessionRestored
from shared.contract.configdocs import DriverPolicy
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import Subjects
from shared.kv.agent import SaveReport
from shared.kv.manifest import checkpoint_order
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.settings import NatsSettings, Settings
from tests.faults.conftest import Mesh, Pod, expected
from tests.faults.fleet import NEW_DRIVER, Fleet, fleet
from tests.helpers import eventually
from tests.servers import NatsCluster, ReplicatedRedis

pytestmark = pytest.mark.timeout(240)

QUIET = 600.0
"""Pods announce when what they hold changes, not on a timer, so that the registry after a failover is exactly
what the promoted replica had."""


async def _newest_recorded(mesh: Mesh, sessions: list[str]) -> dict[str, str]:
    found = {}
    for sid in sessions:
        newest = await mesh.service.registry.newest_checkpoint(sid)
        found[sid] = str(newest["checkpoint_id"]) if newest else ""
    return found


async def _registry_answers(mesh: Mesh) -> bool:
    try:
        await mesh.client.ping()
        await mesh.service.registry.pods()
    except Exception:  # the failover is under way
        return False
    return True


async def _fail_over(ha: ReplicatedRedis, mesh: Mesh) -> None:
    """SIGKILL the primary, the Sentinels promote the replica, the service's registry answers again."""
    await asyncio.to_thread(ha.fail_over)
    await eventually(lambda: _registry_answers(mesh), timeout=30, interval=0.1)


async def _restore_all(
    mesh: Mesh, pod: Pod, sessions: list[str], newest: dict[str, str], blocks: dict[str, int]
) -> dict[str, int]:
    """Restore every session on ``pod``: each from its newest committed checkpoint, byte for byte, under a
    generation above every one its stored checkpoints carry. Returns the generations taken."""
    taken = {}
    for sid in sessions:
        stored = await mesh.store.checkpoints(sid)
        restored = await pod.endpoint.restore(sid)
        assert restored.manifest.checkpoint_id == newest[sid], (sid, restored.manifest.checkpoint_id, newest[sid])
        assert [bytes(b) for b in restored.blocks] == expected(sid, blocks[sid]), sid
        assert restored.fell_back_from == [], restored.fell_back_from
        taken[sid] = pod.agent.generation(sid)
        assert taken[sid] > max(checkpoint_order(c)[0] for c in stored), (sid, taken[sid], stored)
    return taken


async def test_redis_failover_between_checkpoints_restores_every_session_from_its_newest_checkpoint(
    replicated_redis: ReplicatedRedis, redis_failover_mesh: Mesh
) -> None:
    """The issue's scenario: nine sessions checkpointed at 64 tokens on both servers, then grown to 128 tokens and
    checkpointed again while the replica was cut off (two of them moved to another pod first, under a new
    generation). After the failover the registry names the 64-token checkpoints and generation 1; every session
    restores its 128-token checkpoint, ``checkpoint.restored`` says it came from the store, the registry is
    repaired, and the moved sessions get generation 3, never 2 again."""
    ha, mesh = replicated_redis, redis_failover_mesh
    # pods the cluster does not run (their agents answer on): the mover may take sessions from them
    first = await mesh.add_pod("gone-1", "node-1", [f"a{i}" for i in range(5)], blocks=4, announce_s=QUIET)
    second = await mesh.add_pod("gone-2", "node-2", [f"b{i}" for i in range(4)], blocks=4, announce_s=QUIET)
    sessions = [*first.agent.sessions(), *second.agent.sessions()]
    assert len(sessions) == 9
    assert await mesh.periodic_turn() == 2
    recorded = await _newest_recorded(mesh, sessions)
    assert all(recorded.values())
    await asyncio.to_thread(ha.wait_synced)

    await asyncio.to_thread(ha.cut_replica)
    mover = await mesh.add_pod("llama-3", "node-3", announce_s=QUIET)
    moved = ["a0", "b0"]
    for sid in moved:
        await mover.endpoint.restore(sid)  # generation 2, on the primary alone
        mover.grow(sid, 4)
    for pod in (first, second):
        for sid in pod.agent.sessions():
            if sid not in moved:
                pod.grow(sid, 4)
    assert await mesh.periodic_turn() == 3
    newest = await _newest_recorded(mesh, sessions)
    for sid in sessions:
        manifest = await mesh.store.manifest(sid, newest[sid])
        assert newest[sid] != recorded[sid] and manifest.token_count == 128
    assert {sid: await mesh.service.registry.generation(sid) for sid in moved} == {"a0": 2, "b0": 2}

    await _fail_over(ha, mesh)
    # the registry lost the last writes: it names the 64-token checkpoints, and generation 1 for the moved ones
    assert await _newest_recorded(mesh, sessions) == recorded
    assert {sid: await mesh.service.registry.generation(sid) for sid in moved} == {"a0": 1, "b0": 1}

    for pod in (first, second, mover):  # their nodes went down with the primary: every session restores elsewhere
        await pod.endpoint.stop()
    events = await mesh.heard("checkpoint.restored", SessionRestored)
    rescuer = await mesh.add_pod("llama-4", "node-3", announce_s=QUIET)
    mesh.service.store = counting = Counting(mesh.store)  # type: ignore[assignment]
    taken = await _restore_all(mesh, rescuer, sessions, newest, dict.fromkeys(sessions, 8))
    # what the repair cost: one listing per restore, one manifest read per checkpoint only the store knew, one look
    # at its packs
    assert counting.calls == {"checkpoints": 9, "manifest": 9, "pack_sizes": 9}, counting.calls
    assert {sid: taken[sid] for sid in moved} == {"a0": 3, "b0": 3}
    await eventually(lambda: {e.session_id for e in events} == set(sessions))
    for event in events:
        assert event.checkpoint_id == newest[event.session_id] and newest[event.session_id] in event.from_store
    assert await _newest_recorded(mesh, sessions) == newest  # repaired
    await mesh.check(min_checkpoints=18)


async def test_a_restore_asks_the_store_for_one_listing_of_its_session_when_the_registry_is_whole(mesh: Mesh) -> None:
    """The price of taking the store as the last word, without a failover: one listing of the session's own
    checkpoints in the store per restore (sessions/<id>/ in the file store, the session's index in the Object
    Store), no manifest read."""
    pod = await mesh.add_pod("llama-1", "node-1", ["s1", "s2", "s3"], blocks=2, announce_s=QUIET)
    for _ in range(2):
        assert await mesh.periodic_turn() == 1
        for sid in pod.agent.sessions():
            pod.grow(sid, 1)
    assert await mesh.periodic_turn() == 1
    newest = await _newest_recorded(mesh, pod.agent.sessions())
    await mesh.evict(pod)
    rescuer = await mesh.add_pod("llama-2", "node-2", announce_s=QUIET)
    mesh.service.store = counting = Counting(mesh.store)  # type: ignore[assignment]
    await _restore_all(mesh, rescuer, pod.agent.sessions(), newest, dict.fromkeys(pod.agent.sessions(), 4))
    assert counting.calls == {"checkpoints": 3}, counting.calls
    await mesh.check(min_checkpoints=9)


@pytest.mark.parametrize("release", ["after-promotion", "during-failover"])
async def test_redis_failover_mid_drain_gives_one_verdict_and_every_session_its_newest_checkpoint(
    replicated_redis: ReplicatedRedis, redis_failover_mesh: Mesh, release: str
) -> None:
    """A drain of node-1 is under way (its pod is saving) when the primary is SIGKILLed; the replica had missed
    the last periodic checkpoints of node-1 and node-2. The pod's save goes on after the promotion, or during the
    failover (its report is then recorded against a Redis with no primary: the drain is retried and run again).
    Either way the drain gets exactly one verdict, completed; then both nodes' sessions restore elsewhere, node-1's
    from the drain's checkpoints, node-2's from the periodic ones only the store still knew."""
    ha, mesh = replicated_redis, redis_failover_mesh
    draining = await mesh.add_pod("llama-1", "node-1", [f"c{i}" for i in range(4)], blocks=4, announce_s=QUIET)
    other = await mesh.add_pod("llama-2", "node-2", [f"d{i}" for i in range(3)], blocks=4, announce_s=QUIET)
    sessions = [*draining.agent.sessions(), *other.agent.sessions()]
    assert await mesh.periodic_turn() == 2
    await asyncio.to_thread(ha.wait_synced)
    before = {sid: await mesh.service.registry.generation(sid) for sid in sessions}

    await asyncio.to_thread(ha.cut_replica)
    for pod in (draining, other):
        for sid in pod.agent.sessions():
            pod.grow(sid, 2)
    assert await mesh.periodic_turn() == 2
    asked: list[str] = []
    gate = asyncio.Event()
    save = draining.agent.save

    async def held_save(*args: Any, **kwargs: Any) -> SaveReport:
        asked.append("drain")
        await gate.wait()  # the pod is saving for as long as the test says
        return await save(*args, **kwargs)

    draining.agent.save = held_save  # type: ignore[method-assign]
    for sid in draining.agent.sessions():
        draining.grow(sid, 1)  # what only the drain's checkpoint holds
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="failover", deadline_s=25, grace_period_s=30))
    await eventually(lambda: asked, timeout=30)
    if release == "during-failover":
        ha.primary.kill()
        gate.set()
    await _fail_over(ha, mesh)
    gate.set()
    await eventually(lambda: any(v.drain_id == "failover" for v in mesh.verdicts), timeout=90)
    # a later drain is a barrier: by its verdict, a second verdict of the first would have come
    await mesh.bus.publish(DrainRequested(node="node-3", drain_id="after", deadline_s=5))
    await eventually(lambda: any(v.drain_id == "after" for v in mesh.verdicts), timeout=30)
    verdicts = [v for v in mesh.verdicts if v.drain_id == "failover"]
    assert len(verdicts) == 1 and isinstance(verdicts[0], DrainCompleted), verdicts
    assert verdicts[0].sessions_committed == 4

    newest = {sid: (await mesh.store.checkpoints(sid))[0] for sid in sessions}
    blocks = {sid: 7 if sid.startswith("c") else 6 for sid in sessions}
    for pod in (draining, other):  # node-1 is evicted, node-2 went down
        await pod.endpoint.stop()
    rescuer = await mesh.add_pod("llama-3", "node-3", announce_s=QUIET)
    taken = await _restore_all(mesh, rescuer, sessions, newest, blocks)
    assert all(taken[sid] > before[sid] for sid in sessions), (before, taken)
    await mesh.check(min_checkpoints=14, drains=["failover", "after"])


# -- NATS: helpers ------------------------------------------------------------------------------------------------
async def leader(kind: str, f: Fleet, cluster: NatsCluster) -> str:
    """The server leading the events stream (``stream``: drain requests and verdicts live there) or the JetStream
    meta group (``meta``: every stream and consumer change goes through it)."""
    if kind == "meta":
        return cluster.wait_for_meta_leader()
    info = await f.bus.js.stream_info(f.subjects.events_stream.name)
    assert info.cluster is not None and info.cluster.leader, info.cluster
    assert len(info.cluster.replicas or []) == 2, "the events stream is not R3"
    return str(info.cluster.leader)


def server_of(bus: Bus, cluster: NatsCluster) -> str:
    """The server ``bus`` is connected to now."""
    url = bus.nc.connected_url
    assert url is not None
    return next(s.name for s in cluster.servers if s.port == url.port)


async def keep_talking(f: Fleet, sessions: list[str], until: asyncio.Future[object]) -> None:
    """A turn of every session each second until ``until`` is done: a session whose pod was evicted is restored
    where its next request lands."""
    while not until.done():
        for sid in sessions:
            await f.bus.publish(f.turn(sid))
        await asyncio.wait([until], timeout=1.0)


# -- NATS: a request, and the CLI, fail over ----------------------------------------------------------------------
async def test_nats_a_request_in_flight_when_its_server_dies_is_answered_through_another(
    nats_cluster: NatsCluster, cluster_settings: Settings
) -> None:
    """The request is lost with the server it went to (the responder never sees it answered); the requester's
    connection fails over and the request is sent again there, within its timeout."""
    requester = await Bus.connect(cluster_settings.nats, Subjects(cluster_settings.root), "requester")
    home = server_of(requester, nats_cluster)
    elsewhere = NatsSettings(servers=tuple(s.url for s in nats_cluster.servers if s.name != home))
    responder = await Bus.connect(elsewhere, Subjects(cluster_settings.root), "responder")
    asked: list[WhereIsSession] = []
    first = asyncio.Event()

    async def answer(query: WhereIsSession) -> SessionLocation | None:
        asked.append(query)
        if len(asked) == 1:
            first.set()
            return None  # as if the request had gone down with its server
        return SessionLocation(session_id=query.session_id, sequence=0, held=False, reason="unknown")

    try:
        subject = requester.subjects.command("checkpoint", "where")
        await responder.serve(subject, answer, (WhereIsSession,))
        pending = asyncio.ensure_future(requester.request(subject, WhereIsSession(session_id="s1"), timeout=20))
        await asyncio.wait_for(first.wait(), 10)
        nats_cluster.kill(home)
        reply = await pending
        assert isinstance(reply, SessionLocation) and reply.session_id == "s1"
        assert len(asked) == 2 and server_of(requester, nats_cluster) != home
    finally:
        await responder.close(1)
        await requester.close(1)


async def test_nats_the_cli_fails_over_when_its_server_dies_mid_drain(
    nats_cluster: NatsCluster, cluster_settings: Settings, tmp_path: Path
) -> None:
    """``gpuwarden drain`` with every server in GPUWARDEN_NATS_URL; the server it is connected to is SIGKILLed
    as soon as it has connected. The drain completes; ``status`` answers with that server still listed (and
    dead); ``where`` answers although the server it sent its request through dies before the answer (the first
    server killed is started again before: two of three, a quorum, are always up)."""
    settings = cluster_settings
    env = dict(
        os.environ,
        GPUWARDEN_HOME=str(tmp_path / "home"),
        GPUWARDEN_NATS_URL=",".join(settings.nats.servers),
        GPUWARDEN_REDIS_URL=settings.redis.url,
        GPUWARDEN_ROOT=settings.root,
    )
    async with fleet(settings, tmp_path, drivers=False) as f:
        sessions = await f.begin(8)
        node, moving = await f.busiest_node()
        f.store.gate.clear()  # the drain waits at the store until the server is gone
        cli = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "drain", node, "--json", "--drain-id", "cli-failover"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            served_by = await eventually(lambda: nats_cluster.serving("cli"), timeout=60, interval=0.05)
            down = nats_cluster.kill(served_by[0])
            f.store.gate.set()
            out, err = await asyncio.to_thread(cli.communicate, timeout=120)
        finally:
            if cli.poll() is None:
                cli.kill()
        assert cli.returncode == 0, (out, err)
        result = json.loads(out)
        assert result["ok"] and result["verdict"] == "completed" and result["sessions_committed"] >= len(moving)

        status = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "shared.cli", "status", "--json", "--sample", "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert {n["name"]: n["schedulable"] for n in json.loads(status.stdout)["nodes"]}[node] is False
        down.start()  # back, on its port and store: the cluster is whole again before the next kill
        # `where` with its request in flight (the service has it and has not answered) when its server dies
        f.checkpoint.release.clear()
        where = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "where", moving[0]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            await asyncio.wait_for(f.checkpoint.asked.wait(), 60)
            for name in nats_cluster.serving("cli"):
                nats_cluster.kill(name)
            f.checkpoint.release.set()
            out, err = await asyncio.to_thread(where.communicate, timeout=60)
        finally:
            if where.poll() is None:
                where.kill()
        assert out.startswith(f"{moving[0]}: ") and not err, (where.returncode, out, err)

        await f.one_verdict_each(["cli-failover"])
        await f.talk(sessions)
        f.sessions_intact(sessions)
        assert f.workload.stats.restored >= len(moving)
        await f.check(min_checkpoints=len(moving), drains=["cli-failover"])


# -- NATS: leaders SIGKILLed mid-drain and mid-upgrade ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["stream", pytest.param("meta", marks=pytest.mark.long)])
async def test_nats_a_leader_killed_mid_drain_leaves_one_verdict_and_every_session_restored(
    kind: str, nats_cluster: NatsCluster, cluster_settings: Settings, tmp_path: Path
) -> None:
    async with fleet(cluster_settings, tmp_path, drivers=False) as f:
        sessions = await f.begin(12)
        node, moving = await f.busiest_node()
        drain_id = f"{kind}-leader-drain"
        f.store.gate.clear()
        draining = asyncio.ensure_future(
            operations.drain(
                f.mesh,
                node,
                wait=True,
                timeout=180,
                deadline_s=25,
                reason="maintenance",
                requested_by="test",
                drain_id=drain_id,
            )
        )
        await eventually(lambda: f.store.held > 0 or draining.done(), timeout=30)  # its savers are committing
        assert not draining.done(), draining.result().reason
        nats_cluster.kill(await leader(kind, f, nats_cluster))
        f.store.gate.set()
        talking = asyncio.ensure_future(keep_talking(f, moving, draining))
        result = await draining
        await talking
        assert result.ok and result.verdict == "completed", result.reason
        assert {m.outcome for m in result.sessions} <= {"restored", "ended"} and result.sessions
        assert all(m.new_node != node for m in result.sessions if m.outcome == "restored")
        await f.one_verdict_each([drain_id])
        await f.talk(sessions)
        f.sessions_intact(sessions)
        await f.check(min_checkpoints=len(moving), drains=[drain_id])


@pytest.mark.long
@pytest.mark.parametrize("kind", ["stream", "meta"])
async def test_nats_a_leader_killed_mid_upgrade_leaves_every_node_upgraded_and_every_session_restored(
    kind: str, nats_cluster: NatsCluster, cluster_settings: Settings, tmp_path: Path
) -> None:
    async with fleet(cluster_settings, tmp_path) as f:
        sessions = await f.begin(12)
        f.store.gate.clear()  # the first node's drain waits at the store
        policy = DriverPolicy(
            desired_version=NEW_DRIVER, auto_upgrade=True, max_parallel_upgrades=1, max_unavailable="1"
        )
        await ConfigStore(f.client, f.subjects).write("driver", policy, 0, "test")
        await eventually(lambda: f.store.held > 0, timeout=60)
        nats_cluster.kill(await leader(kind, f, nats_cluster))
        f.store.gate.set()

        async def done() -> bool:
            return await f.upgraded(NEW_DRIVER) and all(n.schedulable for n in await f.cluster.nodes())

        await eventually(done, timeout=180, interval=0.2)
        await f.talk(sessions, timeout=120)
        assert f.workload.stats.restored >= len(sessions)  # every pod was evicted once: every session moved
        f.sessions_intact(sessions)
        # one verdict per node at least (the upgrade's own), as the test's durable consumer hears them: after a
        # leader's loss it may hear them some seconds after the upgrade ended (they are in the stream), not never
        await eventually(lambda: len(f.verdicts) >= len(f.spec.nodes), timeout=60)
        drains = sorted(f.verdicts)
        await f.one_verdict_each(drains)
        await f.check(min_checkpoints=len(sessions), drains=drains)
