"""A node lost in the middle of its drain: the drain's savers have written their chunks and wait to commit (the
store's gate held) when the node goes NotReady for good and every pod on it dies (``lose_node``: no preStop, memory
and local disk gone). What must hold: the drain gets exactly one verdict, recorded and published alike (whatever
it is, it never claims a session it did not commit); every session of the node goes on on another pod, from the
newest checkpoint the registry recorded for it (never rolled back past it), none lost, each one's blocks as its
conversation built them; the invariant checker finds the store and the registry consistent.

In the simulation a save already handed to the store when its pod dies still lands (as a write the store had taken
before the crash would): the drain then completes with what those saves committed. A real pod's write cut short
commits nothing; both end the same way here, the sessions going on from the newest committed checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.clients.drains import DrainClient, RecordReader
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.sim.faults import LoseNodeFault, apply_fault
from tests.faults.fleet import fleet
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(300)


async def test_a_node_lost_mid_drain_gets_one_verdict_and_its_sessions_go_on_elsewhere(
    settings: Settings, tmp_path: Path
) -> None:
    async with fleet(settings, tmp_path, drivers=False) as f:
        sessions = await f.begin(9)
        drains = DrainClient(f.mesh.bus.publish, "test", RecordReader(f.mesh.bus))
        saved = [f"saved-{n.name}" for n in f.spec.nodes]  # every session checkpointed (`gpuwarden checkpoint`)
        for drain_id, n in zip(saved, f.spec.nodes, strict=True):
            await drains.ask(drain_id, n.name, "checkpoint before the scenario (test)", 20.0)
        await f.one_verdict_each(saved)
        await f.talk(sessions)  # a turn past those checkpoints: what a loss now costs is recomputed
        node, moving = await f.busiest_node()
        assert moving, "no session on the busiest node"
        before = {sid: await f.checkpoint.registry.where(sid) for sid in moving}
        assert all(b.checkpoint_id for b in before.values()), before
        f.store.gate.clear()  # the drain's savers wait to commit
        async with drains.watch(f.mesh.bus, "lost-mid-drain", node) as watch:
            await drains.cordon(f.cluster, node, "lost-mid-drain", "test")
            await drains.ask("lost-mid-drain", node, "node lost mid-drain (test)", 20.0)
            await eventually(lambda: f.store.held > 0, timeout=30)  # the drain is in flight
            client = redis_client(f.settings.redis)
            try:
                done = await apply_fault(client, f.subjects, LoseNodeFault(node=node))
            finally:
                await client.aclose()
            assert "NotReady" in done, done
            f.store.gate.set()
            verdict = await watch.wait(60)
        assert verdict.node == node and verdict.drain_id == "lost-mid-drain"
        await f.one_verdict_each(["lost-mid-drain"])
        await eventually(lambda: all(r.info.node != node for r in f.workload.runtimes.values()), timeout=30)
        await f.talk(sessions, timeout=120)  # every session goes on, the node's on other pods
        f.sessions_intact(sessions)
        for sid in moving:
            now = await f.checkpoint.registry.where(sid)
            assert now.held and now.node != node, (sid, now)
            assert now.token_count >= before[sid].token_count, (sid, before[sid], now)  # never rolled back
        stats = f.workload.stats
        assert stats.pods_killed >= 1 and stats.continued_after_kill >= len(moving) and stats.lost == 0, stats
        await f.check(min_checkpoints=len(sessions), drains=[*saved, "lost-mid-drain"])
