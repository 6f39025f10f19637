"""Losing Redis is survived: the embedded Redis keeps what it acknowledged across a SIGKILL (AOF in its data
folder), and the simulation and the services reconnect and read again when it comes back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from services.checkpoint.registry import SessionRegistry
from services.driver.agent import bus_node_drivers
from services.driver.coordinator import UpgradeCoordinator
from services.driver.lease import RedisLeaderLease
from services.driver.ports import StaleLeader
from shared.adapters.kube import KubeCluster
from shared.clients.drains import RecordReader
from shared.contract.annotations import CORDON_DRAIN_ANNOTATION, UPGRADE_FENCE_ANNOTATION
from shared.contract.base import Event
from shared.contract.configdocs import DriverPolicy
from shared.contract.node import DrainRequested
from shared.contract.subjects import Subjects
from shared.host.devservers import RedisServer, free_port
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, ConfigWatcher, redis_client
from shared.plumbing.settings import Settings
from shared.ports.cluster import ClusterError
from shared.sim.cluster import SimCluster
from shared.sim.exporter import find_exporter
from shared.sim.spec import NodeSpec, SimSpec
from tests.fake_kube_api import FakeKubeApi, node
from tests.helpers import eventually, with_redis


def test_a_persistent_redis_killed_with_sigkill_comes_back_with_what_it_acknowledged(tmp_path: Path) -> None:
    server = RedisServer(dir=tmp_path / "redis", persistent=True).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("gw:probe", "kept")
        client.hset("gw:config:driver", mapping={"version": 3, "doc": "{}"})
        # appendfsync everysec: a write may wait up to about a second (longer while the disk is slow to fsync)
        # before it reaches the AOF; the promise is about what reached it, so wait until nothing is pending
        deadline = time.monotonic() + 30
        while True:
            info = client.info("persistence")
            if info.get("aof_buffer_length", 0) == 0 and info.get("aof_pending_bio_fsync", 0) == 0:
                break
            assert time.monotonic() < deadline, f"the AOF still had writes pending after 30 s: {info}"
            time.sleep(0.05)
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


async def test_the_config_watcher_reads_everything_again_when_redis_comes_back(
    tmp_path: Path, settings: Settings, subjects: Subjects
) -> None:
    """Redis comes back holding a version nobody announced to this watcher (here: another data folder on the same
    port, as after a failover or a restore). Pub/sub says nothing of it and the timer is an hour away: only a
    full read on reconnect finds it."""
    port = free_port()
    restored = RedisServer(port=port, dir=tmp_path / "restored", persistent=True).start()
    client = redis.asyncio.Redis.from_url(restored.url)
    store = ConfigStore(client, subjects)
    await store.write("driver", DriverPolicy(desired_version="550.54.15"), 0, "admin")
    await store.write("driver", DriverPolicy(desired_version="560.35.03"), 1, "admin")
    await client.aclose()
    restored.stop()
    live = RedisServer(port=port, dir=tmp_path / "live", persistent=True).start()
    client = redis.asyncio.Redis.from_url(live.url)
    await ConfigStore(client, subjects).write("driver", DriverPolicy(desired_version="550.54.15"), 0, "admin")
    await client.aclose()
    watcher = ConfigWatcher(with_redis(settings, live.url).redis, subjects, ["driver"], reread_s=3600)
    await watcher.start()
    try:
        assert _desired(watcher) == "550.54.15"
        live.kill()
        await eventually(lambda: not watcher.connected)
        restored.start()  # the same port, the other folder
        await eventually(lambda: _desired(watcher) == "560.35.03")
        assert watcher.connected and watcher.current("driver").version == 2  # type: ignore[union-attr]
    finally:
        await watcher.stop()
        live.cleanup()
        restored.cleanup()


def _desired(watcher: ConfigWatcher) -> str:
    found = watcher.current("driver")
    return found.doc.desired_version if found is not None and isinstance(found.doc, DriverPolicy) else ""


# -- the simulation and the services, as processes, through a Redis crash ----------------------------------------
SPEC = """
nodes:
  - name: node-1
  - name: node-2
deployments:
  - {name: llama, namespace: llm, replicas: 2, max_unavailable: 1,
     model: {layers: 2, kv_heads: 2, head_dim: 64, block_tokens: 16}}
"""


class Mesh:
    """The simulation and some services as separate processes (``python -m ...``), as ``gpuwarden run`` starts
    them, each with its own health port and log file."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}

    @classmethod
    def on(cls, folder: Path, settings: Settings, subjects: Subjects, redis_url: str) -> Mesh:
        """A mesh of the test's own (its root, spec, store and logs in ``folder``) on ``redis_url``. The hourly
        full re-read of the configuration leaves pub/sub and the re-read on reconnect to do the work."""
        spec = folder / "spec.yaml"
        spec.write_text(SPEC)
        (folder / "logs").mkdir()
        env = dict(
            os.environ,
            GPUWARDEN_NATS_URL=settings.nats.servers[0],
            GPUWARDEN_REDIS_URL=redis_url,
            GPUWARDEN_ROOT=subjects.root,
            GPUWARDEN_BACKEND="sim",
            GPUWARDEN_NODE="node-1",
            GPUWARDEN_SIM_SPEC=str(spec),
            GPUWARDEN_CHECKPOINT_STORE=f"file://{folder / 'checkpoints'}",
            GPUWARDEN_CHECKPOINT_GC_S="0",
            GPUWARDEN_CONFIG_REREAD_S="3600",
        )
        return cls(env, folder / "logs")

    def start(self, label: str, module: str, *args: str, **extra: str) -> None:
        port = free_port()
        env = dict(self.env, GPUWARDEN_HTTP_ADDR=f"127.0.0.1:{port}", **extra)
        out = open(self.logs / f"{label}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=out, stderr=out)
        out.close()
        self.procs[label] = (proc, port)

    async def health(self, label: str) -> dict[str, Any]:
        """The process's /healthz, or ``{}`` while it does not answer."""
        port = self.procs[label][1]

        def get() -> dict[str, Any]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
                    return dict(json.loads(response.read()))
            except OSError:
                return {}

        return await asyncio.get_running_loop().run_in_executor(None, get)

    async def all_report(self, status: str) -> bool:
        return all([(await self.health(label)).get("status") == status for label in self.procs])

    def exited(self) -> dict[str, int]:
        return {label: code for label, (proc, _) in self.procs.items() if (code := proc.poll()) is not None}

    def assert_unharmed(self) -> None:
        """No process exited and no background loop crashed."""
        assert self.exited() == {}, {label: self.log(label)[-2000:] for label in self.exited()}
        for label in self.procs:
            assert "background loop crashed" not in self.log(label), self.log(label)[-4000:]

    def log(self, label: str) -> str:
        return (self.logs / f"{label}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _pods(mesh: Mesh) -> dict[str, Any]:
    return dict((await mesh.health("sim")).get("simulation", {}).get("pods", {}))


async def _served(mesh: Mesh) -> int:
    return int((await mesh.health("sim")).get("simulation", {}).get("served", 0))


async def _config_version(mesh: Mesh, label: str, name: str) -> int | None:
    versions = (await mesh.health(label)).get("config_versions", {})
    return None if versions.get(name) is None else int(versions[name])


async def _sessions(registry: SessionRegistry) -> set[str]:
    return {s.session_id for node in ("node-1", "node-2") for s in await registry.sessions_on_node(node)}


async def test_the_simulation_and_services_ride_through_a_redis_crash(
    tmp_path: Path, settings: Settings, subjects: Subjects
) -> None:
    """SIGKILL the Redis of a running mesh and start it again on the same port and folder: nothing was lost (AOF),
    every process noticed and came back by itself, the simulation goes on (it serves the sessions it holds while
    Redis is away, and plays a scale-up made afterwards), and configuration written afterwards reaches the
    services, over pub/sub, with the hourly re-read far off."""
    server = RedisServer(dir=tmp_path / "redis", persistent=True).start()
    mesh = Mesh.on(tmp_path, settings, subjects, server.url)
    env = mesh.env
    client = redis_client(with_redis(settings, server.url).redis)  # reconnects after the crash, as services do
    registry = SessionRegistry(client, subjects)
    try:
        # long conversations: the ones held at the crash go on being served while Redis is away
        mesh.start("sim", "shared.sim", "--rate", "5", "--sessions", "4", "--max-turns", "1000", "--prompt-tokens", "8")
        mesh.start("checkpoint", "services.checkpoint")
        mesh.start("driver", "services.driver", GPUWARDEN_DRIVER_RECONCILE_S="1")
        await eventually(lambda: mesh.all_report("ok"), timeout=60, interval=0.2)
        await eventually(lambda: _served(mesh), timeout=30, interval=0.2)
        # every session of the load held and registered: a new session cannot be taken while Redis is away (its
        # generation comes from the registry), the ones held are served throughout
        await eventually(lambda: _at_least(_sessions(registry), 4), timeout=30, interval=0.2)
        before = await _sessions(registry)
        assert len(await _pods(mesh)) == 2

        server.kill()
        await eventually(lambda: mesh.all_report("degraded"), timeout=30, interval=0.2)
        served = await _served(mesh)
        await eventually(lambda: _more_than(_served(mesh), served + 5), timeout=30, interval=0.2)  # Redis-less
        server.start()  # the same port and folder
        await eventually(lambda: mesh.all_report("ok"), timeout=30, interval=0.2)

        # the registry came back from the AOF: every session taken before the crash still has its generation
        # (a session may have left its pod meanwhile: preempted, ended)
        assert all([await registry.generation(sid) > 0 for sid in before]), before
        cluster = SimCluster(client, subjects)
        assert [n.name for n in await cluster.nodes()] == ["node-1", "node-2"]
        served = await _served(mesh)
        await cluster.scale("llm", "llama", 3)  # the simulation must read the cluster again to play this
        await eventually(lambda: _count_is(_pods(mesh), 3), timeout=30, interval=0.2)
        await eventually(lambda: _more_than(_served(mesh), served), timeout=30, interval=0.2)

        cli = await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: subprocess.run(
                [sys.executable, "-m", "shared.cli", "config", "set", "checkpoint", '{"keep_per_session": 3}'],
                env=dict(env, GPUWARDEN_HOME=str(tmp_path)),
                capture_output=True,
                text=True,
                timeout=60,
            ),
        )
        assert cli.returncode == 0, cli.stderr
        version = json.loads(cli.stdout)["version"]
        await eventually(lambda: _is(_config_version(mesh, "checkpoint", "checkpoint"), version), timeout=20)
        await ConfigStore(client, subjects).write("driver", DriverPolicy(desired_version="560.35.03"), 0, "test")
        await eventually(lambda: _is(_config_version(mesh, "driver", "driver"), 1), timeout=20)
        assert (await mesh.health("driver"))["upgrade"]["leader"] is True  # its coordinator loop lives on

        mesh.assert_unharmed()
    finally:
        mesh.stop()
        await client.aclose()
        server.cleanup()


async def test_the_simulation_makes_its_world_again_when_redis_comes_back_empty(
    tmp_path: Path, settings: Settings, subjects: Subjects
) -> None:
    """A Redis that keeps nothing (an external one, or one restarted from scratch): the simulation makes its
    cluster again from the spec and announces its exporters again, and plays on without a restart."""
    server = RedisServer().start()
    mesh = Mesh.on(tmp_path, settings, subjects, server.url)
    client = redis_client(with_redis(settings, server.url).redis)
    cluster = SimCluster(client, subjects)
    try:
        mesh.start("sim", "shared.sim", "--rate", "5", "--sessions", "4")
        mesh.start("checkpoint", "services.checkpoint")  # a session starts once the checkpoint service says it has none
        await eventually(lambda: mesh.all_report("ok"), timeout=60, interval=0.2)
        await eventually(lambda: _count_is(_pods(mesh), 2), timeout=30, interval=0.2)
        await eventually(lambda: _served(mesh), timeout=30, interval=0.2)

        server.kill()
        server.start()  # the same port, nothing in it
        await eventually(lambda: _nodes(cluster), timeout=30, interval=0.2)
        assert await _nodes(cluster) == ["node-1", "node-2"]
        await eventually(lambda: _exporters(client, subjects), timeout=10, interval=0.2)
        await eventually(lambda: mesh.all_report("ok"), timeout=30, interval=0.2)
        served = await _served(mesh)
        await cluster.scale("llm", "llama", 3)
        await eventually(lambda: _count_is(_pods(mesh), 3), timeout=30, interval=0.2)
        await eventually(lambda: _more_than(_served(mesh), served), timeout=30, interval=0.2)
        mesh.assert_unharmed()
    finally:
        mesh.stop()
        await client.aclose()
        server.cleanup()


async def _exporters(client: redis.asyncio.Redis, subjects: Subjects) -> bool:
    return all([await find_exporter(client, subjects, name) for name in ("node-1", "node-2")])


async def _nodes(cluster: SimCluster) -> list[str]:
    try:
        return [n.name for n in await cluster.nodes()]
    except ClusterError:  # not there (yet)
        return []


async def _count_is(pods: Awaitable[dict[str, Any]], count: int) -> bool:
    return len(await pods) == count


async def _at_least(value: Awaitable[set[str]], n: int) -> bool:
    return len(await value) >= n


async def _more_than(value: Awaitable[int], than: int) -> bool:
    return await value > than


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def test_a_cluster_watch_says_so_when_redis_comes_back_without_its_changes(
    own_redis: RedisServer, settings: Settings, subjects: Subjects
) -> None:
    """Revisions start again from 1 in a Redis that lost everything: a watch waiting for the revision after the
    old one would wait for ever. It raises ``ClusterError`` instead, and the next watch starts where the store is."""
    client = redis_client(with_redis(settings, own_redis.url).redis)
    spec = SimSpec(nodes=[NodeSpec(name="node-a"), NodeSpec(name="node-b")])
    try:
        cluster = await SimCluster.create(client, subjects, spec)
        for _ in range(3):
            await cluster.cordon("node-a")
            await cluster.uncordon("node-a")
        follow = cluster.watch()
        waiting = asyncio.ensure_future(anext(follow))
        own_redis.kill()
        own_redis.start()  # keeps nothing
        again = await SimCluster.create(client, subjects, spec)
        assert again.created
        with pytest.raises(ClusterError, match="list again and watch anew"):
            await asyncio.wait_for(waiting, 15)
        follow = cluster.watch()
        await again.cordon("node-b")
        change = await asyncio.wait_for(anext(follow), 5)
        assert (change.kind, change.type, change.name) == ("node", "MODIFIED", "node-b")
    finally:
        await client.aclose()


# -- fencing tokens outlive the lease's counter -------------------------------------------------------------------
class Coordination:
    """The upgrade coordinator against a Kubernetes API server (the fake one: the nodes and their annotations live
    there, not in Redis) and a Redis this test may kill. No driver agent answers: the nodes' versions are unknown,
    which only keeps the coordinator from upgrading; cordons by others still make it write."""

    def __init__(self, api: FakeKubeApi, redis_url: str, settings: Settings, bus: Bus) -> None:
        self.cluster = KubeCluster.from_host(api.url, token="t0ken")
        self.client = redis_client(with_redis(settings, redis_url).redis)
        self.subjects = bus.subjects
        self.fence_key = self.subjects.redis_key("driver", "fence")
        self.requested: list[DrainRequested] = []
        self.coordinator = UpgradeCoordinator(
            self.cluster,
            bus_node_drivers(bus, 1.0),
            RedisLeaderLease(self.client, self.subjects, "coordinator-1", ttl_s=30.0),
            RecordReader(bus),
            self.publish,
            DriverPolicy,
        )

    async def publish(self, event: Event) -> None:
        if isinstance(event, DrainRequested):
            self.requested.append(event)

    async def annotations(self, name: str) -> Mapping[str, str]:
        found = await self.cluster.node(name)
        assert found is not None
        return found.annotations

    async def close(self) -> None:
        await self.cluster.close()
        await self.client.aclose()


@pytest.fixture
async def coordination(own_redis: RedisServer, settings: Settings, bus: Bus) -> AsyncIterator[Coordination]:
    async with FakeKubeApi() as api:
        api.add("nodes", node("gpu-a", gpus=8))
        api.add("nodes", node("gpu-b", gpus=8))
        made = Coordination(api, own_redis.url, settings, bus)
        yield made
        await made.close()


async def test_a_coordinator_takes_a_token_above_those_on_the_nodes_after_redis_comes_back_empty(
    coordination: Coordination, own_redis: RedisServer
) -> None:
    c = coordination
    await c.client.set(c.fence_key, 40)  # tokens 1..40 were handed out long ago
    await c.cluster.cordon("gpu-a")  # someone else cordons: the coordinator asks for a drain, stamping its token
    assert await c.coordinator.reconcile_once() and c.coordinator.token == 41
    assert (await c.annotations("gpu-a"))[UPGRADE_FENCE_ANNOTATION] == "41"
    assert CORDON_DRAIN_ANNOTATION in await c.annotations("gpu-a")

    own_redis.kill()
    own_redis.start()  # no persistence: the lease and its counter are gone, the nodes keep token 41
    assert await c.client.dbsize() == 0
    await c.cluster.uncordon("gpu-a")
    await c.cluster.cordon("gpu-b")
    assert await c.coordinator.reconcile_once()  # the same process, its lease lost with Redis: no StaleLeader
    token = c.coordinator.token
    assert token > 41
    a, b = await c.annotations("gpu-a"), await c.annotations("gpu-b")
    assert CORDON_DRAIN_ANNOTATION not in a and a[UPGRADE_FENCE_ANNOTATION] == str(token)  # its writes land
    assert CORDON_DRAIN_ANNOTATION in b and b[UPGRADE_FENCE_ANNOTATION] == str(token)
    assert [r.node for r in c.requested] == ["gpu-a", "gpu-b"]
    assert int(await c.client.get(c.fence_key) or 0) == token  # the counter goes on from there


async def test_a_lease_whose_counter_went_back_is_given_up_and_taken_above_the_nodes(
    coordination: Coordination,
) -> None:
    """A failover that lost the last writes: the lease still names this coordinator, but with an older token than
    the one it stamped since. It gives the lease up and takes a token above the stamp, instead of stalling."""
    c = coordination
    await c.client.set(c.fence_key, 40)
    await c.cluster.cordon("gpu-a")
    assert await c.coordinator.reconcile_once() and c.coordinator.token == 41
    await c.client.hset(c.subjects.redis_key("driver", "leader"), "token", 3)
    await c.client.set(c.fence_key, 3)
    await c.cluster.cordon("gpu-b")
    stale = 0
    for _ in range(4):
        try:
            if await c.coordinator.reconcile_once() and CORDON_DRAIN_ANNOTATION in await c.annotations("gpu-b"):
                break
        except StaleLeader:
            stale += 1
    else:
        raise AssertionError("the coordinator never wrote gpu-b again")
    assert stale >= 1 and c.coordinator.token > 41
    assert (await c.annotations("gpu-b"))[UPGRADE_FENCE_ANNOTATION] == str(c.coordinator.token)
