"""Losing Redis is survived: the embedded Redis keeps what it acknowledged across a SIGKILL (AOF in its data
folder), and the simulation and the services reconnect and read again when it comes back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
import redis
import redis.asyncio

from services.driver.agent import bus_node_drivers
from services.driver.coordinator import UpgradeCoordinator
from services.driver.lease import RedisDrainVerdicts, RedisLeaderLease
from services.driver.ports import StaleLeader
from services.driver.upgrade import EXTERNAL_DRAIN_ANNOTATION, FENCE_ANNOTATION
from shared.contract.base import Event
from shared.contract.configdocs import DriverPolicy
from shared.contract.node import DrainRequested
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, ConfigWatcher, redis_client
from shared.plumbing.devservers import RedisServer, free_port
from shared.plumbing.settings import Settings
from shared.ports.kube import KubeCluster
from tests.fake_kube_api import FakeKubeApi, node
from tests.helpers import eventually, with_redis


def test_a_persistent_redis_killed_with_sigkill_comes_back_with_what_it_acknowledged(tmp_path: Path) -> None:
    server = RedisServer(dir=tmp_path / "redis", persistent=True).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("gw:probe", "kept")
        client.hset("gw:config:driver", mapping={"version": 3, "doc": "{}"})
        client.close()
        server.kill()
        server.start()  # the same port and the same folder
        client = redis.Redis.from_url(server.url)
        assert client.get("gw:probe") == b"kept"
        assert client.hget("gw:config:driver", "version") == b"3"
        client.close()
    finally:
        server.cleanup()
    assert (tmp_path / "redis").is_dir(), "cleanup keeps a persistent server's data"


async def test_the_config_watcher_reads_everything_again_when_redis_comes_back(
    tmp_path: Path, settings: Settings, subjects: Subjects
) -> None:
    """Redis comes back holding a version nobody announced to this watcher (here: another data folder on the same
    port, as after a failover or a restore). Pub/sub says nothing of it and the timer is an hour away: only a
    full read on reconnect finds it."""
    port = free_port()
    restored = RedisServer(port=port, dir=tmp_path / "restored", persistent=True).start()
    client = redis.asyncio.Redis.from_url(restored.url)
    store = ConfigStore(client, subjects)
    await store.write("driver", DriverPolicy(desired_version="550.54.15"), 0, "admin")
    await store.write("driver", DriverPolicy(desired_version="560.35.03"), 1, "admin")
    await client.aclose()
    restored.stop()
    live = RedisServer(port=port, dir=tmp_path / "live", persistent=True).start()
    client = redis.asyncio.Redis.from_url(live.url)
    await ConfigStore(client, subjects).write("driver", DriverPolicy(desired_version="550.54.15"), 0, "admin")
    await client.aclose()
    watcher = ConfigWatcher(with_redis(settings, live.url).redis, subjects, ["driver"], reread_s=3600)
    await watcher.start()
    try:
        assert _desired(watcher) == "550.54.15"
        live.kill()
        await eventually(lambda: not watcher.connected)
        restored.start()  # the same port, the other folder
        await eventually(lambda: _desired(watcher) == "560.35.03")
        assert watcher.connected and watcher.current("driver").version == 2  # type: ignore[union-attr]
    finally:
        await watcher.stop()
        live.cleanup()
        restored.cleanup()


def _desired(watcher: ConfigWatcher) -> str:
    found = watcher.current("driver")
    return found.doc.desired_version if found is not None and isinstance(found.doc, DriverPolicy) else ""


# -- fencing tokens outlive the lease's counter -------------------------------------------------------------------
class Coordination:
    """The upgrade coordinator against a Kubernetes API server (the fake one: the nodes and their annotations live
    there, not in Redis) and a Redis this test may kill. No driver agent answers: the nodes' versions are unknown,
    which only keeps the coordinator from upgrading; cordons by others still make it write."""

    def __init__(self, api: FakeKubeApi, redis_url: str, settings: Settings, bus: Bus) -> None:
        self.cluster = KubeCluster.from_host(api.url, token="t0ken")
        self.client = redis_client(with_redis(settings, redis_url).redis)
        self.subjects = bus.subjects
        self.fence_key = self.subjects.redis_key("driver", "fence")
        self.requested: list[DrainRequested] = []
        self.coordinator = UpgradeCoordinator(
            self.cluster,
            bus_node_drivers(bus, 1.0),
            RedisLeaderLease(self.client, self.subjects, "coordinator-1", ttl_s=30.0),
            RedisDrainVerdicts(self.client, self.subjects),
            self.publish,
            DriverPolicy,
        )

    async def publish(self, event: Event) -> None:
        if isinstance(event, DrainRequested):
            self.requested.append(event)

    async def annotations(self, name: str) -> Mapping[str, str]:
        found = await self.cluster.node(name)
        assert found is not None
        return found.annotations

    async def close(self) -> None:
        await self.cluster.close()
        await self.client.aclose()


@pytest.fixture
async def coordination(own_redis: RedisServer, settings: Settings, bus: Bus) -> AsyncIterator[Coordination]:
    async with FakeKubeApi() as api:
        api.add("nodes", node("gpu-a", gpus=8))
        api.add("nodes", node("gpu-b", gpus=8))
        made = Coordination(api, own_redis.url, settings, bus)
        yield made
        await made.close()


async def test_a_coordinator_takes_a_token_above_those_on_the_nodes_after_redis_comes_back_empty(
    coordination: Coordination, own_redis: RedisServer
) -> None:
    c = coordination
    await c.client.set(c.fence_key, 40)  # tokens 1..40 were handed out long ago
    await c.cluster.cordon("gpu-a")  # someone else cordons: the coordinator asks for a drain, stamping its token
    assert await c.coordinator.reconcile_once() and c.coordinator.token == 41
    assert (await c.annotations("gpu-a"))[FENCE_ANNOTATION] == "41"
    assert EXTERNAL_DRAIN_ANNOTATION in await c.annotations("gpu-a")

    own_redis.kill()
    own_redis.start()  # no persistence: the lease and its counter are gone, the nodes keep token 41
    assert await c.client.dbsize() == 0
    await c.cluster.uncordon("gpu-a")
    await c.cluster.cordon("gpu-b")
    assert await c.coordinator.reconcile_once()  # the same process, its lease lost with Redis: no StaleLeader
    token = c.coordinator.token
    assert token > 41
    a, b = await c.annotations("gpu-a"), await c.annotations("gpu-b")
    assert EXTERNAL_DRAIN_ANNOTATION not in a and a[FENCE_ANNOTATION] == str(token)  # its writes land
    assert EXTERNAL_DRAIN_ANNOTATION in b and b[FENCE_ANNOTATION] == str(token)
    assert [r.node for r in c.requested] == ["gpu-a", "gpu-b"]
    assert int(await c.client.get(c.fence_key) or 0) == token  # the counter goes on from there


async def test_a_lease_whose_counter_went_back_is_given_up_and_taken_above_the_nodes(
    coordination: Coordination,
) -> None:
    """A failover that lost the last writes: the lease still names this coordinator, but with an older token than
    the one it stamped since. It gives the lease up and takes a token above the stamp, instead of stalling."""
    c = coordination
    await c.client.set(c.fence_key, 40)
    await c.cluster.cordon("gpu-a")
    assert await c.coordinator.reconcile_once() and c.coordinator.token == 41
    await c.client.hset(c.subjects.redis_key("driver", "leader"), "token", 3)
    await c.client.set(c.fence_key, 3)
    await c.cluster.cordon("gpu-b")
    stale = 0
    for _ in range(4):
        try:
            if await c.coordinator.reconcile_once() and EXTERNAL_DRAIN_ANNOTATION in await c.annotations("gpu-b"):
                break
        except StaleLeader:
            stale += 1
    else:
        raise AssertionError("the coordinator never wrote gpu-b again")
    assert stale >= 1 and c.coordinator.token > 41
    assert (await c.annotations("gpu-b"))[FENCE_ANNOTATION] == str(c.coordinator.token)
