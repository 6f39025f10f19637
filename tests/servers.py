"""Real NATS and Redis servers for tests: given by URL, from testcontainers when a Docker engine answers, or
started here (see ``shared.plumbing.devservers``) on free ports with temporary directories."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from shared.plumbing.devservers import NatsCluster, NatsServer, RedisServer, free_port

__all__ = ["NatsCluster", "NatsServer", "RedisServer", "docker_answers", "free_port", "shared_servers"]


def docker_answers(timeout: float = 1.0) -> bool:
    """True when a Docker engine answers on its socket within ``timeout`` (never hangs on a missing engine)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return False
    path = host[len("unix://") :]
    if not os.path.exists(path):
        return False
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"OK" in s.recv(256)
    except OSError:
        return False


@contextlib.contextmanager
def shared_servers() -> Iterator[tuple[str, str]]:
    """NATS and Redis URLs for a whole test session, by the order the README gives."""
    nats_url = os.environ.get("GPUWARDEN_NATS_URL")
    redis_url = os.environ.get("GPUWARDEN_REDIS_URL")
    owned: list[NatsServer | RedisServer] = []
    containers: list[object] = []
    try:
        if (not nats_url or not redis_url) and docker_answers():
            from testcontainers.core.container import DockerContainer
            from testcontainers.redis import RedisContainer

            if not nats_url:
                nats_c = DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222)
                nats_c.start()
                containers.append(nats_c)
                nats_url = f"nats://{nats_c.get_container_host_ip()}:{nats_c.get_exposed_port(4222)}"
            if not redis_url:
                redis_c = RedisContainer("redis:7")
                redis_c.start()
                containers.append(redis_c)
                redis_url = f"redis://{redis_c.get_container_host_ip()}:{redis_c.get_exposed_port(6379)}/0"
        if not nats_url:
            server = NatsServer().start()
            owned.append(server)
            nats_url = server.url
        if not redis_url:
            rserver = RedisServer().start()
            owned.append(rserver)
            redis_url = rserver.url
        yield nats_url, redis_url
    finally:
        for s in owned:
            s.cleanup()
        for c in containers:
            with contextlib.suppress(Exception):
                c.stop()  # type: ignore[attr-defined]
