"""Config sync against real Redis: compare-and-set races, notification, and life without Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from shared.contract.configdocs import DriverPolicy
from shared.contract.subjects import Subjects
from shared.plumbing.configsync import ConfigStore, ConfigWatcher
from shared.plumbing.errors import ConfigConflict, InvalidConfig
from shared.plumbing.settings import Settings
from tests.helpers import eventually, with_redis
from tests.servers import RedisServer


async def test_two_writers_race_exactly_one_wins_and_subscriber_sees_final_version(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis
) -> None:
    watcher = ConfigWatcher(settings.redis, subjects, ["driver"], reread_s=60)
    await watcher.start()
    try:
        store = ConfigStore(redis_client, subjects)
        assert await store.write("driver", DriverPolicy(desired_version="550.54"), 0, "admin") == 1
        other = ConfigStore(aioredis.Redis.from_url(settings.redis.url), subjects)
        results = await asyncio.gather(
            store.write("driver", DriverPolicy(desired_version="560.1"), 1, "alice"),
            other.write("driver", DriverPolicy(desired_version="570.2"), 1, "bob"),
            return_exceptions=True,
        )
        await other.client.aclose()
        winners = [r for r in results if r == 2]
        conflicts = [r for r in results if isinstance(r, ConfigConflict)]
        assert len(winners) == 1 and len(conflicts) == 1
        assert conflicts[0].expected == 1 and conflicts[0].actual == 2
        assert "read it again" in str(conflicts[0])
        stored = await store.read("driver")
        assert stored is not None and stored.version == 2
        # the watcher learns of it through pub/sub (the slow re-read is 60 s away)
        seen = await eventually(lambda: (c := watcher.current("driver")) and c.version == 2 and c)
        assert seen.doc == stored.doc
    finally:
        await watcher.stop()


async def test_invalid_documents_are_refused_at_write_and_ignored_at_read(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis
) -> None:
    store = ConfigStore(redis_client, subjects)
    with pytest.raises(InvalidConfig, match="unknown field `desird_version`"):
        await store.write_raw("driver", b'{"desird_version": "1"}', 0, "typo")
    with pytest.raises(InvalidConfig, match="max_unavailable"):
        await store.write_raw("driver", b'{"max_unavailable": "lots"}', 0, "x")
    with pytest.raises(InvalidConfig, match="unknown configuration document 'nope'"):
        await store.write_raw("nope", b"{}", 0, "x")
    assert await store.read("driver") is None
    await store.write("driver", DriverPolicy(desired_version="550.54.15"), 0, "admin")
    watcher = ConfigWatcher(settings.redis, subjects, ["driver"], reread_s=0.2)
    applied: list[int] = []
    watcher.on_change(lambda found: applied.append(found.version))
    await watcher.start()
    try:
        assert watcher.current("driver").version == 1  # type: ignore[union-attr]
        # something bypasses the store and writes garbage as version 2: never applied
        await redis_client.hset(subjects.config_key("driver"), mapping={"version": 2, "doc": b'{"bad": 1}'})
        await redis_client.publish(subjects.config_channel, "driver 2")
        # a valid version 3 written after it is applied, so the watcher has surely read (and refused) version 2
        await store.write("driver", DriverPolicy(desired_version="560.35.03"), 2, "admin")
        await eventually(lambda: watcher.current("driver").version == 3)  # type: ignore[union-attr]
        assert 2 not in applied
        assert watcher.current("driver").doc.desired_version == "560.35.03"  # type: ignore[union-attr]
    finally:
        await watcher.stop()


async def test_redis_down_keeps_last_good_config_then_catches_up(
    settings: Settings, subjects: Subjects, own_redis: RedisServer
) -> None:
    settings = with_redis(settings, own_redis.url)
    client = aioredis.Redis.from_url(own_redis.url)
    store = ConfigStore(client, subjects)
    await store.write("driver", DriverPolicy(desired_version="550.54.15"), 0, "admin")
    watcher = ConfigWatcher(settings.redis, subjects, ["driver"], reread_s=0.3)
    await watcher.start()
    try:
        assert watcher.connected and watcher.current("driver").version == 1  # type: ignore[union-attr]
        own_redis.stop()
        await eventually(lambda: not watcher.connected)
        assert watcher.last_error
        assert watcher.current("driver").doc.desired_version == "550.54.15"  # type: ignore[union-attr]
        await asyncio.get_running_loop().run_in_executor(None, own_redis.start)
        await eventually(lambda: watcher.connected)
        # Redis restarted empty (no persistence): a writer sets it again; the watcher catches up
        client2 = aioredis.Redis.from_url(own_redis.url)
        await ConfigStore(client2, subjects).write("driver", DriverPolicy(desired_version="560.35.03"), 0, "admin")
        await client2.aclose()
        await eventually(lambda: watcher.current("driver").doc.desired_version == "560.35.03")  # type: ignore[union-attr]
    finally:
        await watcher.stop()
        await client.aclose()


def test_a_command_waits_longer_for_redis_than_a_service_does() -> None:
    """A service's client times out after ``SERVICE_TIMEOUT_S`` (it must fall back quickly); what ``gpuwarden``'s
    commands make within ``command_timeouts`` waits ``COMMAND_TIMEOUT_S`` (a busy machine's Redis is slow, not
    gone); a timeout given is kept."""
    from shared.plumbing import configsync
    from shared.plumbing.settings import RedisSettings

    settings = RedisSettings(url="redis://127.0.0.1:1/0")

    def timeouts() -> tuple[float, float]:
        kwargs = configsync.redis_client(settings).connection_pool.connection_kwargs
        return kwargs["socket_timeout"], kwargs["socket_connect_timeout"]

    assert timeouts() == (configsync.SERVICE_TIMEOUT_S,) * 2

    with configsync.command_timeouts():
        assert timeouts() == (configsync.COMMAND_TIMEOUT_S,) * 2
        given = configsync.redis_client(settings, timeout=0.5).connection_pool.connection_kwargs["socket_timeout"]
        assert given == 0.5
    assert timeouts() == (configsync.SERVICE_TIMEOUT_S,) * 2  # within the command only
