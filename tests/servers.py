"""Real NATS and Redis servers for tests: given by URL, from testcontainers when a Docker engine answers, or
started here (see ``shared.plumbing.devservers``) on free ports with temporary directories."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.plumbing.devservers import NatsServer, RedisServer, free_port

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


@dataclass
class NatsCluster:
    """The production topology's NATS on loopback: ``size`` nats-servers with JetStream, each on its own client
    port, route port and store, every one routed to the others under one cluster name. Streams created through
    it with ``GPUWARDEN_NATS_REPLICAS=3`` are Raft-replicated on all three, so a SIGKILLed server (a stream
    leader, the meta leader) loses nothing that was acknowledged."""

    size: int = 3
    servers: list[NatsServer] = field(default_factory=list)

    def start(self) -> NatsCluster:
        cluster_name = "gw-" + uuid.uuid4().hex[:6]
        ports = [free_port() for _ in range(self.size)]
        for i, port in enumerate(ports):
            others = tuple(f"nats://127.0.0.1:{p}" for p in ports if p != port)
            self.servers.append(
                NatsServer(
                    name=f"n{i + 1}",
                    cluster_port=port,
                    routes=others,
                    cluster_name=cluster_name,
                    monitor_port=free_port(),
                )
            )
        for server in self.servers:
            server.start()
        self.wait_for_meta_leader()
        return self

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)

    def by_name(self, name: str) -> NatsServer:
        return next(s for s in self.servers if s.name == name)

    def alive(self) -> list[NatsServer]:
        return [s for s in self.servers if s.proc is not None and s.proc.poll() is None]

    def jsz(self, server: NatsServer | None = None) -> dict[str, object]:
        """The ``/jsz`` monitoring document of ``server`` (default: the first one alive)."""
        server = server or self.alive()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/jsz", timeout=2) as answer:
            found: dict[str, object] = json.loads(answer.read())
        return found

    def meta_leader(self) -> str:
        """The name of the server that leads the JetStream meta group now, as a live server reports it ("" while
        an election runs)."""
        for server in self.alive():
            with contextlib.suppress(OSError, ValueError):
                meta = self.jsz(server).get("meta_cluster")
                leader = meta.get("leader", "") if isinstance(meta, dict) else ""
                if leader and leader in {s.name for s in self.alive()}:
                    return str(leader)
        return ""

    def serving(self, client_name: str) -> list[str]:
        """The servers a client connection named ``client_name`` is connected to now (``/connz``)."""
        found = []
        for server in self.alive():
            with contextlib.suppress(OSError, ValueError):
                url = f"http://127.0.0.1:{server.monitor_port}/connz?limit=1024"
                with urllib.request.urlopen(url, timeout=2) as answer:
                    connz = json.loads(answer.read())
                if any(c.get("name") == client_name for c in connz.get("connections") or []):
                    found.append(server.name)
        return found

    def wait_for_meta_leader(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.meta_leader()
            if leader:
                return leader
            time.sleep(0.1)
        raise RuntimeError(f"no JetStream meta leader among {[s.name for s in self.alive()]} within {timeout}s")

    def kill(self, name: str) -> NatsServer:
        """SIGKILL one server: no shutdown, no goodbye to its clients or peers."""
        server = self.by_name(name)
        server.kill()
        return server

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()
