"""Losing Redis is survived: the embedded Redis keeps what it acknowledged across a SIGKILL (AOF in its data
folder), and the simulation and the services reconnect and read again when it comes back."""

from __future__ import annotations

from pathlib import Path

import redis

from shared.plumbing.devservers import RedisServer


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
