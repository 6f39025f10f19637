"""A Redis split brain (issue #30): two primaries at once, each with a checkpoint service writing to it, one store.

A network partition cuts the primary (``P``) off from its replica (``R``) and from the Sentinels, which promote
``R``; a checkpoint service replica on P's side of the cut keeps its connection to ``P``, the others reach ``R``.
Both registries go on from the same data and diverge: each hands out the next generation of a session to a pod of
its own side, so one generation is handed out twice, and both pods commit checkpoints under it. When the
partition heals, the Sentinels turn ``P`` into a replica of ``R``: P's side of the history is gone from the
registry, its checkpoints are still in the store.

What must hold then: the surviving registry's history wins. The pod P's side placed is refused when it announces or
saves the session again (the pod placed first on the surviving side keeps it); a restore takes the surviving
holder's newest checkpoint, never the other side's, even where that one sorts after it (the store is the last word
only on what no live claim contradicts); nothing the surviving side committed is deleted; the fault checker is
clean.

The partition is made with the servers themselves (``REPLICAOF NO ONE`` on ``R``: a primary of its own with what
it had; ``REPLICAOF`` R on ``P`` at the heal, as the Sentinels do), and the services are started and stopped so
that each pod's requests reach the side the scenario names."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from services.checkpoint.audit import RegistryAudit
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.periodic import REPLICA_LEASE_S
from services.checkpoint.service import CheckpointService
from shared.contract.checkpoint import AgentSessions, SaveSessionsReport
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.subjects import Subjects
from shared.host.devservers import RedisServer
from shared.host.runner import start_service
from shared.kv.filestore import FileStore
from shared.kv.manifest import checkpoint_order
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, redis_client
from shared.plumbing.settings import Settings
from shared.wiring import Wiring
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually, with_redis

pytestmark = pytest.mark.timeout(120)

QUIET = 600.0
"""Pods announce when the scenario says (``Mesh.announce``), not on a timer."""


@pytest.fixture
def two_redis() -> Iterator[tuple[RedisServer, RedisServer]]:
    """``P`` and ``R``, a replica of it."""
    primary = RedisServer().start()
    replica = RedisServer(replica_of=primary.port)
    try:
        replica.start()
        yield primary, replica
    finally:
        replica.cleanup()
        primary.cleanup()


def _synced(primary: RedisServer, replica: RedisServer) -> bool:
    with redis.Redis(port=primary.port) as p, redis.Redis(port=replica.port) as r:
        offset = int(p.info("replication")["master_repl_offset"])
        info = r.info("replication")
        return info.get("master_link_status") == "up" and int(info.get("slave_repl_offset", -1)) >= offset


class Side:
    """One side of the split: its Redis, and the checkpoint service on it while the scenario runs one there."""

    def __init__(
        self, name: str, server: RedisServer, settings: Settings, subjects: Subjects, store: FileStore
    ) -> None:
        self.name = name
        self.settings = with_redis(settings, server.url)
        self.subjects = subjects
        self.store = store
        self.client = redis_client(self.settings.redis, timeout=10.0)

    async def serve(self, bus: Bus, pods: Mesh | None = None) -> Mesh:
        """The checkpoint service on this side's Redis, the only one the pods reach until ``stop``."""
        service = CheckpointService(CheckpointSettings(gc_interval_s=0, drain_lease_s=2.0), store=self.store)
        running = await start_service(service, self.settings, Wiring)
        mesh = Mesh(self.settings, self.subjects, self.store, service, running, self.client, bus)
        if pods is not None:
            mesh.pods = pods.pods
        return mesh


@pytest.fixture
async def sides(
    two_redis: tuple[RedisServer, RedisServer], settings: Settings, subjects: Subjects, tmp_path: Path
) -> AsyncIterator[tuple[Side, Side]]:
    store = FileStore(tmp_path / "store")
    p, r = (Side(n, s, settings, subjects, store) for n, s in zip(("P", "R"), two_redis, strict=True))
    try:
        yield p, r
    finally:
        await p.client.aclose()
        await r.client.aclose()


async def _stop(mesh: Mesh) -> None:
    await mesh.running.stop(grace=1)


@pytest.mark.parametrize("holder_gone", [False, True], ids=["holder-recorded", "holder-forgotten"])
async def test_after_a_split_brain_the_surviving_history_wins_and_the_checker_is_clean(
    two_redis: tuple[RedisServer, RedisServer], sides: tuple[Side, Side], bus: Bus, holder_gone: bool
) -> None:
    """``holder_gone``: the surviving holder leaves the registry (its lease lapsed, the pod forgotten) before the
    discarded side's pod announces and saves again and before the next pod restores: the fences must not need it
    (who took the generation on the surviving side is kept apart from who holds the session now)."""
    primary, replica = two_redis
    p, r = sides
    a = await p.serve(bus)
    await ConfigStore(p.client, p.subjects).write("checkpoint", CheckpointPolicy(periodic_interval_s=0), 0, "split")
    await eventually(lambda: a.service.policy().periodic_interval_s == 0)
    # before the partition: llama-x holds s1 and s2 under generation 1, checkpointed, and leaves
    x = await a.add_pod("llama-x", "node-1", ["s1", "s2"], blocks=2, announce_s=QUIET)
    await saved(a)
    await a.evict(x)
    await eventually(lambda: _leaving(a, "llama-x"))
    await eventually(lambda: asyncio.to_thread(_synced, primary, replica), timeout=30)

    # the partition: R is a primary of its own, with everything P had acknowledged so far
    with redis.Redis(port=replica.port) as cut:
        cut.execute_command("REPLICAOF", "NO", "ONE")
    # P's side: llama-y takes s1 (generation 2, on P)
    y = await a.add_pod("llama-y", "node-2", announce_s=QUIET)
    assert [bytes(b) for b in (await y.endpoint.restore("s1")).blocks] == expected("s1", 2)
    assert y.agent.generation("s1") == 2
    await _stop(a)
    # R's side: llama-z takes s1 and s2; R never heard of llama-y's claim: generation 2 again, for s1
    b = await r.serve(bus, a)
    z = await b.add_pod("llama-z", "node-3", announce_s=QUIET)
    for sid in ("s1", "s2"):
        await z.endpoint.restore(sid)
    assert (z.agent.generation("s1"), z.agent.generation("s2")) == (2, 2)
    z.grow("s1", 3)
    z.grow("s2", 1)
    await saved(b)  # once the lease of P's replica (which R still lists) lapses, llama-z is R's replica's to save
    survivor = {
        sid: str((await b.service.registry.newest_checkpoint(sid) or {})["checkpoint_id"]) for sid in ("s1", "s2")
    }
    await _stop(b)
    # P's side again: llama-y commits s1 twice under its generation 2 (its sequence passes llama-z's)
    a = await p.serve(bus, b)
    for _ in range(2):
        y.grow("s1", 1)
        await saved(a)
    other_side = str((await a.service.registry.newest_checkpoint("s1") or {})["checkpoint_id"])
    assert checkpoint_order(other_side) > checkpoint_order(survivor["s1"])  # it sorts after the survivor's
    assert other_side in await p.store.checkpoints("s1")
    await _stop(a)

    # the heal: P becomes a replica of R (its writes since the partition are gone); the services reach R
    with redis.Redis(port=primary.port) as healed:
        healed.execute_command("REPLICAOF", "127.0.0.1", str(replica.port))
    await eventually(lambda: asyncio.to_thread(_synced, replica, primary), timeout=30)
    b = await r.serve(bus, a)
    try:
        # both pods announce s1 under generation 2: llama-z, placed first on this side, keeps it
        await b.announce(y)
        await b.announce(z)
        audit = RegistryAudit(b.client, b.subjects)
        record = await audit.session_record("s1")
        assert record is not None and (record.pod, record.generation) == ("llama-z", 2)
        # llama-y saves s1 again: refused, and only what that save wrote is deleted
        y.grow("s1", 1)
        before = set(await b.store.checkpoints("s1"))
        outcome = await b.service.saves.command("llama-y", 10, "periodic", changed_only=True)
        assert isinstance(outcome, SaveSessionsReport) and len(outcome.committed) == 1
        refused = outcome.committed[0].checkpoint_id
        recorded = await b.service.saves.record(outcome, "")
        assert recorded.committed == set() and [f.session_id for f in recorded.failed] == ["s1"]
        assert "held by pod llama-z" in recorded.failed[0].reason
        assert set(await b.store.checkpoints("s1")) == before and refused not in before
        newest = await b.service.registry.newest_checkpoint("s1")
        assert newest is not None and str(newest["checkpoint_id"]) == survivor["s1"]
        # llama-z goes; llama-w restores its sessions: the survivor's newest, not the other side's
        await b.evict(z)
        if holder_gone:
            await b.service.registry.forget_pod("llama-z")
            assert await audit.session_record("s1") is None
            # llama-y, alive on the discarded side's generation, announces s1 in full (its agent restarted) and
            # saves it again: both refused
            restarted = AgentSessions(
                pod="llama-y", node="node-2", namespace="llm", deployment="llama", incarnation="y-2", seq=1,
                ttl_s=30, full=True, sessions=["s1"], generations=[2],
            )  # fmt: skip
            applied = await b.service.registry.apply_announcement(restarted)
            assert applied.stale == ["s1"] and await audit.session_record("s1") is None
            y.grow("s1", 1)
            outcome = await b.service.saves.command("llama-y", 10, "periodic", changed_only=True)
            assert isinstance(outcome, SaveSessionsReport) and len(outcome.committed) == 1
            recorded = await b.service.saves.record(outcome, "")
            assert recorded.committed == set() and "taken by pod llama-z" in recorded.failed[0].reason
        w = await b.add_pod("llama-w", "node-4", announce_s=QUIET)
        for sid, blocks in (("s1", 5), ("s2", 3)):
            restored = await w.endpoint.restore(sid)
            assert restored.manifest.checkpoint_id == survivor[sid], (sid, restored.manifest.checkpoint_id)
            assert [bytes(blk) for blk in restored.blocks] == expected(sid, blocks)
            assert w.agent.generation(sid) == 3
        found = await b.check(min_checkpoints=4)
        assert found.fenced >= 1  # the other side's checkpoint, known for what it is
    finally:
        for pod in b.pods:
            await pod.endpoint.stop()
            await pod.bus.close(1)
        await _stop(b)


async def saved(mesh: Mesh) -> None:
    """One pod's periodic save, through this side's service, as soon as the pod is its to save."""
    await eventually(mesh.periodic_turn, timeout=REPLICA_LEASE_S * 3)


async def _leaving(mesh: Mesh, pod: str) -> bool:
    return await mesh.client.hget(mesh.subjects.redis_key("kv", "podinfo", pod), "leaving") == b"1"
