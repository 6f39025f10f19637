"""Real NATS and Redis servers for tests: given by URL, from testcontainers when a Docker engine answers, or
started here (see ``shared.host.devservers``) on free ports with temporary directories."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis

from shared.host.devservers import NatsCluster, NatsServer, RedisSentinel, RedisServer, free_port

__all__ = [
    "NatsCluster",
    "NatsServer",
    "RedisSentinel",
    "RedisServer",
    "ReplicatedRedis",
    "docker_answers",
    "free_port",
    "shared_servers",
]


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


def _until(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except redis.exceptions.RedisError as exc:
            last = exc
        if last:
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:g}s (last: {last!r})")


@dataclass
class ReplicatedRedis:
    """The production topology on loopback: a Redis primary, one replica (asynchronous replication) and three
    Sentinels (quorum 2) that promote the replica when the primary dies. Clients reach it by ``url``
    (``redis+sentinel://...``), as services are configured in production.

    ``cut_replica`` then ``fail_over`` is the failover that loses the last writes: the replica stops receiving
    (it is pointed at a port where nothing listens, as if the network between the two had failed), writes go on
    on the primary, the primary is SIGKILLed, and the Sentinels promote the replica with what it had. The methods
    block (subprocesses, a synchronous client): from async code call them in a thread, so that services running
    in the same event loop go on meanwhile."""

    service: str = "gw-primary"
    primary: RedisServer = field(default_factory=RedisServer)
    replica: RedisServer = field(init=False)
    sentinels: list[RedisSentinel] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.replica = RedisServer(replica_of=self.primary.port)

    @property
    def url(self) -> str:
        hosts = ",".join(s.address for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self, timeout: float = 30.0) -> ReplicatedRedis:
        self.primary.start()
        self.replica.start()
        peers = [(free_port(), secrets.token_hex(20)) for _ in range(3)]
        self.sentinels = [
            RedisSentinel(
                self.primary.port,
                self.service,
                failover_timeout_ms=30_000,
                known_replicas=(self.replica.port,),
                known_sentinels=tuple(p for p in peers if p != (port, myid)),
                port=port,
                myid=myid,
            ).start()
            for port, myid in peers
        ]
        _until(self._sentinels_see_everyone, timeout, "the Sentinels know the replica and each other")
        self.wait_synced(timeout)
        return self

    def _sentinels_see_everyone(self) -> bool:
        for sentinel in self.sentinels:
            with redis.Redis(port=sentinel.port, socket_timeout=2) as client:
                master = client.sentinel_master(self.service)
                if int(master["num-slaves"]) < 1 or int(master["num-other-sentinels"]) < 2:
                    return False
        return True

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Until the replica holds every write the primary has acknowledged so far."""

        def synced() -> bool:
            with self.client(self.primary.port) as primary, self.client(self.replica.port) as replica:
                offset = int(primary.info("replication")["master_repl_offset"])
                info = replica.info("replication")
                return info.get("master_link_status") == "up" and int(info.get("slave_repl_offset", -1)) >= offset

        _until(synced, timeout, "the replica caught up with the primary")

    def cut_replica(self) -> None:
        """From now on the replica receives nothing; it keeps what it has. Fail over within 30 s (the Sentinels'
        ``failover-timeout``): after that the Sentinels point the replica back at the primary."""
        with self.client(self.replica.port) as replica:
            replica.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))

    def fail_over(self, timeout: float = 90.0) -> None:
        """SIGKILL the primary and wait until every Sentinel names the replica as the primary and the replica
        says so itself. The replica is pointed back at its old (dead) primary first, as if the network came back
        as the primary died, and with its link-down time reset (``REPLICAOF NO ONE`` first): a replica cut off
        longer than ten times ``down-after-milliseconds`` is no candidate for promotion. ``timeout`` covers a
        second election (the Sentinels try again after twice their ``failover-timeout`` when a vote was split)."""
        self.primary.kill()
        with self.client(self.replica.port) as replica:
            replica.execute_command("REPLICAOF", "NO", "ONE")
            replica.execute_command("REPLICAOF", "127.0.0.1", str(self.primary.port))

        def promoted() -> bool:
            for sentinel in self.sentinels:
                with redis.Redis(port=sentinel.port, socket_timeout=2) as client:
                    address = client.sentinel_get_master_addr_by_name(self.service)
                    if address is None or int(address[1]) != self.replica.port:
                        return False
            with self.client(self.replica.port) as replica:
                return bool(replica.info("replication")["role"] == "master")

        try:
            _until(promoted, timeout, "the Sentinels promoted the replica")
        except AssertionError as exc:
            logs = [(s.dir / "sentinel.log").read_text(errors="replace")[-1500:] for s in self.sentinels]
            raise AssertionError(f"{exc}; the Sentinels said:\n" + "\n---\n".join(logs)) from None

    def cleanup(self) -> None:
        for sentinel in self.sentinels:
            sentinel.cleanup()
        self.replica.cleanup()
        self.primary.cleanup()
