"""The router killed mid-drain: the simulated gateway asks the endpoint picker for every request (Envoy ext_proc over
gRPC); when the replica it asks first is gone, the next one answers; when none is left, the gateway fails open (the
workload's own choice, counted). Either way every request is served, no session is lost, every moved session is
restored where its next request lands, and the invariant checker finds nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared.console import operations
from shared.plumbing.settings import Settings
from tests.faults.fleet import Fleet, fleet
from tests.helpers import eventually


async def keep_talking(f: Fleet, sessions: list[str], until: asyncio.Future[object]) -> None:
    """A turn of every session each second until ``until`` is done."""
    while not until.done():
        for sid in sessions:
            await f.bus.publish(f.turn(sid))
        await asyncio.wait([until], timeout=1.0)


@pytest.mark.parametrize(("replicas", "killed"), [(2, 1), (1, 1)], ids=["next-replica", "fail-open"])
async def test_the_router_killed_mid_drain_loses_nothing(
    replicas: int, killed: int, settings: Settings, tmp_path: Path
) -> None:
    async with fleet(settings, tmp_path, drivers=False, routers=replicas) as f:
        gateway = f.workload.gateway
        assert gateway is not None
        sessions = await f.begin(8)
        on = {
            n.name: [s.session_id for s in await f.checkpoint.registry.sessions_on_node(n.name)] for n in f.spec.nodes
        }
        node = max(on, key=lambda n: len(on[n]))
        drain_id = f"router-killed-{replicas}"
        f.store.gate.clear()  # the drain's savers wait at the store: it is surely under way when the router dies
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
        await eventually(lambda: f.store.held > 0 or draining.done(), timeout=30)
        assert not draining.done(), draining.result().reason
        for index in range(killed):
            await f.kill_router(index)
        f.store.gate.set()
        talking = asyncio.ensure_future(keep_talking(f, sessions, draining))
        result = await draining
        await talking
        assert result.ok and result.verdict == "completed", result.reason
        assert all(m.new_node != node for m in result.sessions if m.outcome == "restored")

        await f.talk(sessions)
        f.sessions_intact(sessions)
        stats, landed = gateway.client.stats, gateway.landings
        assert stats.replica_failures > 0  # the killed replica was asked, and passed over
        if killed < replicas:
            survivor = gateway.client.replicas[killed]
            assert stats.by_replica.get(survivor, 0) > 0 and landed.fell_back == 0
        else:
            assert landed.fell_back > 0  # no router left: the gateway failed open
        await f.one_verdict_each([drain_id])
        await f.check(min_checkpoints=len(on[node]), drains=[drain_id])
