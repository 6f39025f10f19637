"""Redis behind Sentinel: ``GPUWARDEN_REDIS_URL=redis+sentinel://...`` is read and refused like every setting, and
the one Redis client every service and the CLI use follows a real failover (a primary, a replica and three
Sentinels on loopback, tests/servers.py), including one that loses the writes the replica had not received."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.exceptions

from shared.contract.configdocs import DriverPolicy
from shared.contract.subjects import Subjects
from shared.plumbing.configsync import ConfigStore, ConfigWatcher, VersionedConfig, redis_client
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Settings, load_settings, public_url, sentinel_url
from tests.helpers import eventually, with_redis
from tests.servers import ReplicatedRedis, free_port


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_database() -> None:
    found = sentinel_url("redis+sentinel://10.0.0.1:26379,sentinel-b:26380,[::1]:26381/gw-primary/3")
    assert found is not None
    assert found.sentinels == (("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381))
    assert (found.service, found.db, found.tls, found.username, found.password) == ("gw-primary", 3, False, None, None)
    secure = sentinel_url("rediss+sentinel://gw:s%40cret@s1:26379/main")
    assert secure is not None and secure.tls and secure.db == 0 and secure.username == "gw"
    assert secure.password is not None and secure.password.reveal() == "s@cret"
    assert sentinel_url("redis://127.0.0.1:6379/0") is None
    settings = load_settings({"GPUWARDEN_REDIS_URL": "redis+sentinel://s1:26379,s2:26379/gw-primary/0"})
    assert settings.redis.url.startswith("redis+sentinel://")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+sentinel://s1:26379", "master name"),
        ("redis+sentinel://s1/gw-primary", "host:port"),
        ("redis+sentinel://s1:26379,s2/gw-primary", "'s2'"),
        ("redis+sentinel://s1:26379/gw-primary/zero", "must be a number"),
        ("sentinel://s1:26379/gw-primary", "redis+sentinel://"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_naming_the_variable(url: str, words: str) -> None:
    with pytest.raises(SettingsError, match="GPUWARDEN_REDIS_URL") as refused:
        load_settings({"GPUWARDEN_REDIS_URL": url})
    assert words in str(refused.value)


def test_a_password_in_a_sentinel_url_is_never_shown() -> None:
    url = "redis+sentinel://gw:hunter2@s1:26379/gw-primary/0"
    assert "hunter2" not in public_url(url) and "***" in public_url(url)
    with pytest.raises(SettingsError) as refused:
        load_settings({"GPUWARDEN_REDIS_URL": "redis+sentinel://gw:hunter2@s1:26379"})
    assert "hunter2" not in str(refused.value)


async def test_the_client_follows_a_failover_that_loses_the_last_writes(
    replicated_redis: ReplicatedRedis, settings: Settings, subjects: Subjects
) -> None:
    """Writes the replica received survive the failover; those it had not are gone, and the client and the config
    watcher both go on against the promoted replica without being told anything but the Sentinels' address."""
    ha = replicated_redis
    sentinel_settings = with_redis(settings, ha.url)
    client = redis_client(sentinel_settings.redis)
    store = ConfigStore(client, subjects)
    watcher = ConfigWatcher(sentinel_settings.redis, subjects, ["driver"], reread_s=3600)
    try:
        await store.write("driver", DriverPolicy(desired_version="550.54.15"), 0, "test")
        await asyncio.to_thread(ha.wait_synced)
        await watcher.start()
        assert _desired(watcher) == "550.54.15"
        await asyncio.to_thread(ha.cut_replica)
        await store.write("driver", DriverPolicy(desired_version="560.35.03"), 1, "test")  # only the primary has it
        await eventually(lambda: _desired(watcher) == "560.35.03")
        await asyncio.to_thread(ha.fail_over)
        # the client asks the Sentinels again: the promoted replica, without the last write
        found = await eventually(lambda: _read(store), timeout=30)
        assert found.version == 1 and isinstance(found.doc, DriverPolicy)
        assert found.doc.desired_version == "550.54.15"
        # the watcher read everything again on reconnecting, and follows the store back
        await eventually(lambda: _desired(watcher) == "550.54.15", timeout=30)
        assert await store.write("driver", DriverPolicy(desired_version="570.86.10"), 1, "test") == 2
        await eventually(lambda: _desired(watcher) == "570.86.10", timeout=10)
        assert (await client.info("replication"))["role"] == "master"
        # the CLI, given only the Sentinels, reads from the promoted replica too
        env = dict(os.environ, GPUWARDEN_REDIS_URL=ha.url, GPUWARDEN_ROOT=subjects.root)
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "shared.cli", "config", "get", "driver"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        shown = json.loads(done.stdout)
        assert shown["version"] == 2 and shown["doc"]["desired_version"] == "570.86.10"
    finally:
        await watcher.stop()
        await client.aclose()


async def _read(store: ConfigStore) -> VersionedConfig | None:
    try:
        return await store.read("driver")
    except redis.exceptions.ConnectionError:  # the failover is under way: no primary named yet
        return None


def _desired(watcher: ConfigWatcher) -> str:
    found = watcher.current("driver")
    return found.doc.desired_version if found is not None and isinstance(found.doc, DriverPolicy) else ""


def test_a_cli_command_says_in_one_line_that_the_sentinels_do_not_answer(tmp_path: Path) -> None:
    port = free_port()  # no Sentinel listens there
    env = dict(
        os.environ,
        GPUWARDEN_HOME=str(tmp_path),
        GPUWARDEN_REDIS_URL=f"redis+sentinel://gw:s3cret@127.0.0.1:{port}/gw-primary/0",
    )
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli", "config", "get", "driver"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].endswith(f"Redis at redis+sentinel://gw:***@127.0.0.1:{port}/gw-primary/0 is unreachable")
    assert "s3cret" not in done.stderr + done.stdout
