"""A checkpoint mesh for fault scenarios: the real checkpoint service, a file store, KV agents that take their
sessions from the service (each under its own generation), and the invariant checker over all of it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.base import Event
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted, DrainFailed
from shared.contract.subjects import Subjects
from shared.host.devservers import free_port
from shared.host.runner import RunningService, start_service
from shared.kv.agent import KvAgent
from shared.kv.crypto import ChunkCipher
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, redis_client
from shared.plumbing.consumer import ConsumerSpec, consume
from shared.plumbing.settings import Settings
from shared.wiring import Wiring
from tests.faults.checker import Findings, check_invariants
from tests.helpers import eventually, get, with_redis
from tests.kvkit import LAYOUT, block_content
from tests.servers import ReplicatedRedis

E = TypeVar("E", bound=Event)


@dataclass
class Pod:
    name: str
    agent: KvAgent
    endpoint: AgentEndpoint
    bus: Bus

    def grow(self, session_id: str, blocks: int) -> None:
        """The engine appends ``blocks`` full blocks to the session (content fixed by session and index)."""
        have = len(self.agent.blocks(session_id))
        for i in range(have, have + blocks):
            self.agent.append_block(session_id, block_content(session_id, i, LAYOUT.block_bytes))
        self.endpoint.sessions_changed()


def expected(session_id: str, blocks: int) -> list[bytes]:
    return [block_content(session_id, i, LAYOUT.block_bytes).tobytes() for i in range(blocks)]


@dataclass
class Mesh:
    settings: Settings
    subjects: Subjects
    store: FileStore
    service: CheckpointService
    running: RunningService
    client: aioredis.Redis
    bus: Bus
    pods: list[Pod] = field(default_factory=list)
    verdicts: list[DrainCompleted | DrainFailed] = field(default_factory=list)
    cipher: ChunkCipher | None = None
    """The key the mesh's pods encrypt their checkpoints with (None: not encrypted)."""

    async def add_pod(
        self, name: str, node: str, sessions: list[str] = (), blocks: int = 3, announce_s: float = 30.0
    ) -> Pod:  # type: ignore[assignment]
        bus = await Bus.connect(self.settings.nats, self.subjects, f"agent/{name}")
        agent = KvAgent(
            self.store, pod=name, node=node, namespace="llm", deployment="llama", layout=LAYOUT, cipher=self.cipher
        )
        endpoint = AgentEndpoint(agent, bus, announce_s=announce_s)
        pod = Pod(name, agent, endpoint, bus)
        for sid in sessions:
            await endpoint.start_session(sid)
            pod.grow(sid, blocks)
        await endpoint.start()
        self.pods.append(pod)
        await eventually(lambda: self._registered(name))  # the service has heard its first announcement
        return pod

    async def evict(self, pod: Pod) -> None:
        """The pod goes away as an evicted pod does: its agent stops, and the registry hears it is leaving (its
        sessions may then be taken by other pods)."""
        await pod.endpoint.stop()

    async def announce(self, pod: Pod) -> None:
        """The pod announces what it holds; returns once the service has applied the announcement."""
        key = self.subjects.redis_key("kv", "alive", pod.name)
        before = await self.client.get(key)
        await pod.endpoint.announce()
        await eventually(lambda: self._changed(key, before))

    async def _changed(self, key: str, before: bytes | None) -> bool:
        return await self.client.get(key) != before

    async def _registered(self, pod: str) -> bool:
        return pod in await self.service.registry.pods()

    async def sessions_on(self, node: str) -> set[str]:
        return {s.session_id for s in await self.service.registry.sessions_on_node(node)}

    async def periodic_turn(self) -> int:
        """One round of periodic saves now (every pod's turn taken afresh); how many pods saved."""
        turns = [k async for k in self.client.scan_iter(match=self.subjects.redis_key("kv", "turn", "*"))]
        if turns:
            await self.client.delete(*turns)
        return await self.service.periodic.periodic_saves(3600)

    async def heard(self, kind: str, event_type: type[E]) -> list[E]:
        """The events of ``kind`` published from now on (every node, session or pod), as they arrive."""
        seen: list[E] = []

        async def on_event(event: E) -> None:
            seen.append(event)

        await self.bus.subscribe(self.subjects.pattern(kind), on_event, (event_type,))
        return seen

    async def dead_letters(self, durable: str) -> list[DeadLetter]:
        """The dead letters stored from now on, as they arrive (a durable consumer of this test's own)."""
        letters: list[DeadLetter] = []

        async def on_letter(event: DeadLetter) -> None:
            letters.append(event)

        await consume(
            self.bus,
            ConsumerSpec(
                durable=durable,
                filter_subjects=(f"{self.subjects.root}.deadletter.>",),
                accepts=(DeadLetter,),
                stream=self.subjects.deadletter_stream,
            ),
            on_letter,
        )
        return letters

    async def check(self, *, min_checkpoints: int, **kwargs: Any) -> Findings:
        """The invariant checker over the mesh (``check_invariants``): ``min_checkpoints``, the recorded checkpoints
        the scenario made at least; every verdict the mesh saw published is checked against the recorded one; the
        mesh's key decrypts what its pods encrypted."""
        kwargs.setdefault("verdicts", self.verdicts)
        kwargs.setdefault("ciphers", [self.cipher] if self.cipher is not None else [])
        found = await check_invariants(
            self.store, self.client, self.subjects, min_checkpoints=min_checkpoints, **kwargs
        )
        assert found, "\n".join(found.problems)
        return found


@contextlib.asynccontextmanager
async def open_mesh(
    settings: Settings,
    subjects: Subjects,
    store: FileStore,
    bus: Bus,
    service_settings: CheckpointSettings | None = None,
    cipher: ChunkCipher | None = None,
) -> AsyncIterator[Mesh]:
    """The checkpoint service on ``settings`` (its Redis may be this test's own, or Sentinels) and ``store``;
    periodic checkpoints off unless a scenario asks for them: scenarios take their turns explicitly. ``cipher``:
    the key the pods encrypt their checkpoints with."""
    service = CheckpointService(service_settings or CheckpointSettings(gc_interval_s=0, drain_lease_s=2.0), store=store)
    running = await start_service(service, settings, Wiring)
    client = redis_client(settings.redis, timeout=10.0)
    await ConfigStore(client, subjects).write("checkpoint", CheckpointPolicy(periodic_interval_s=0), 0, "faults")
    await eventually(lambda: service.policy().periodic_interval_s == 0)
    m = Mesh(settings, subjects, store, service, running, client, bus, cipher=cipher)

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        m.verdicts.append(event)

    await bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
    await bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
    try:
        yield m
    finally:
        for pod in m.pods:
            await pod.endpoint.stop()
            await pod.bus.close(1)
        await running.stop(grace=1)
        with contextlib.suppress(redis.exceptions.RedisError):
            keys = [k async for k in client.scan_iter(match=f"{subjects.root}:*")]
            if keys:
                await client.delete(*keys)
        await client.aclose()


@pytest.fixture
async def mesh(settings: Settings, subjects: Subjects, tmp_path: Path, bus: Bus) -> AsyncIterator[Mesh]:
    async with open_mesh(settings, subjects, FileStore(tmp_path / "store"), bus) as m:
        yield m


@pytest.fixture
async def encrypted_mesh(settings: Settings, subjects: Subjects, tmp_path: Path, bus: Bus) -> AsyncIterator[Mesh]:
    """The mesh whose pods encrypt every chunk (AES-256-GCM, a key of this test's own)."""
    cipher = ChunkCipher(os.urandom(32))
    async with open_mesh(settings, subjects, FileStore(tmp_path / "store"), bus, cipher=cipher) as m:
        yield m


@pytest.fixture
async def redis_failover_mesh(
    replicated_redis: ReplicatedRedis, settings: Settings, subjects: Subjects, tmp_path: Path, bus: Bus
) -> AsyncIterator[Mesh]:
    """The checkpoint mesh on a Redis primary, its replica and three Sentinels (``replicated_redis``): the service
    and the checker reach Redis through the Sentinels, as in production, and follow its failovers."""
    async with open_mesh(with_redis(settings, replicated_redis.url), subjects, FileStore(tmp_path / "store"), bus) as m:
        yield m


class Runner:
    """The checkpoint service as its own process, to be killed with SIGKILL."""

    def __init__(self, settings: Settings, store: Path) -> None:
        self.port = free_port()
        self.env = dict(
            os.environ,
            GPUWARDEN_NATS_URL=settings.nats.servers[0],
            GPUWARDEN_REDIS_URL=settings.redis.url,
            GPUWARDEN_ROOT=settings.root,
            GPUWARDEN_HTTP_ADDR=f"127.0.0.1:{self.port}",
            GPUWARDEN_CHECKPOINT_STORE=f"file://{store}",
            GPUWARDEN_CHECKPOINT_DRAIN_LEASE_S="2",
            GPUWARDEN_CHECKPOINT_GC_S="0",
        )
        self.proc = subprocess.Popen([sys.executable, "-m", "services.checkpoint"], env=self.env)

    def ready(self) -> bool:
        try:
            return get(self.port, "/readyz")[0] == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def runners() -> Iterator[list[Runner]]:
    started: list[Runner] = []
    yield started
    for runner in started:
        runner.kill()


__all__ = ["Mesh", "Pod", "Runner", "expected", "np", "open_mesh"]


# The secured mesh's fixtures (tests/faults/secured.py), for every test here; imported last, as that kit builds on
# ``Pod`` above.
from tests.faults.secured import secrets_of_the_mesh, secured, secured_mesh  # noqa: E402, F401
