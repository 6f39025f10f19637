from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import NatsSettings, RedisSettings, Settings
from tests.servers import NatsCluster, NatsServer, RedisServer, ReplicatedRedis, shared_servers


@dataclass(frozen=True)
class Servers:
    nats_url: str
    redis_url: str


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    with shared_servers() as (nats_url, redis_url):
        yield Servers(nats_url, redis_url)


@pytest.fixture
def root() -> str:
    """A subject root, stream prefix and Redis key prefix of this test's own."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def subjects(root: str) -> Subjects:
    return Subjects(root)


@pytest.fixture
def settings(servers: Servers, root: str) -> Settings:
    return Settings(
        nats=NatsSettings(servers=(servers.nats_url,)),
        redis=RedisSettings(url=servers.redis_url),
        root=root,
        node="node-1",
        config_reread_s=0.5,
    )


async def _delete_streams(bus: Bus, subjects: Subjects) -> None:
    for spec in subjects.streams:
        try:
            await bus.js.delete_stream(spec.name)
        except Exception:
            pass


@pytest.fixture
async def bus(settings: Settings, subjects: Subjects) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings.nats, subjects, "test")
    yield b
    await _delete_streams(b, subjects)
    await b.close(grace=1.0)


@pytest.fixture
async def redis_client(settings: Settings, root: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(settings.redis.url)
    yield client
    keys = [k async for k in client.scan_iter(match=f"{root}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
def own_nats() -> Iterator[NatsServer]:
    """A NATS server this test may kill and restart."""
    server = NatsServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def nats_cluster() -> Iterator[NatsCluster]:
    """A 3-server NATS cluster with JetStream (the production topology) this test may kill servers of."""
    cluster = NatsCluster().start()
    yield cluster
    cluster.cleanup()


@pytest.fixture
def cluster_settings(nats_cluster: NatsCluster, servers: Servers, root: str) -> Settings:
    """Settings as in production: every NATS server listed, streams replicated on three (R3)."""
    return Settings(
        nats=NatsSettings(servers=nats_cluster.urls, replicas=3),
        redis=RedisSettings(url=servers.redis_url),
        root=root,
        node="node-1",
        config_reread_s=0.5,
    )


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def replicated_redis() -> Iterator[ReplicatedRedis]:
    """A Redis primary, a replica and three Sentinels of this test's own (``url`` is ``redis+sentinel://``): it may
    cut the replica off and fail over (tests/servers.py)."""
    servers = ReplicatedRedis().start()
    yield servers
    servers.cleanup()


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    """The kubelet's device-plugins folder of one test. Short on purpose: a unix socket path must fit in 107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="gw-dp-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[Any]:
    """A kubelet's Registration service on ``plugin_dir/kubelet.sock`` (tests/test_device_plugin.py FakeKubelet)."""
    from tests.fake_kubelet import FakeKubelet

    fake = FakeKubelet(plugin_dir)
    await fake.start()
    yield fake
    await fake.stop()
