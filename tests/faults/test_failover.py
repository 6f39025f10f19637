"""The production topology under failover.

NATS (this part): a 3-server cluster on loopback with every stream replicated on all three (R3,
``GPUWARDEN_NATS_REPLICAS=3``), every client given every server's URL. A server is SIGKILLed: the one a request or a
CLI command is connected to, the leader of the events stream, or the JetStream meta leader; mid-drain and
mid-upgrade. Every drain ends with one verdict, every session is restored byte for byte, and the invariant checker
finds nothing. Scenarios marked ``long`` run in ``make faults`` only (``make test`` has a time budget).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.console import operations
from shared.contract.configdocs import DriverPolicy
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.settings import NatsSettings, Settings
from tests.faults.fleet import NEW_DRIVER, Fleet, fleet
from tests.helpers import eventually
from tests.servers import NatsCluster

pytestmark = pytest.mark.timeout(300)


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


async def busiest_node(f: Fleet) -> tuple[str, list[str]]:
    on = {n.name: [s.session_id for s in await f.checkpoint.registry.sessions_on_node(n.name)] for n in f.spec.nodes}
    node = max(on, key=lambda n: len(on[n]))
    return node, sorted(on[node])


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
        node, moving = await busiest_node(f)
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
        await f.check(drains=["cli-failover"])


# -- NATS: leaders SIGKILLed mid-drain and mid-upgrade ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["stream", pytest.param("meta", marks=pytest.mark.long)])
async def test_nats_a_leader_killed_mid_drain_leaves_one_verdict_and_every_session_restored(
    kind: str, nats_cluster: NatsCluster, cluster_settings: Settings, tmp_path: Path
) -> None:
    async with fleet(cluster_settings, tmp_path, drivers=False) as f:
        sessions = await f.begin(12)
        node, moving = await busiest_node(f)
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
        await f.check(drains=[drain_id])


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
        drains = sorted(f.verdicts)
        assert len(drains) >= len(f.spec.nodes)  # one per node at least: the upgrade's own
        await f.one_verdict_each(drains)
        await f.check(drains=drains)
