"""A Redis that stops answering for a few seconds (``CLIENT PAUSE`` on a Redis the test owns: its clients' commands
wait, time out, and are dropped when the client gives up) is survived. Retention never leaves a recorded checkpoint
without its file: the registry forgets a checkpoint before its file goes, so a pause mid-retention deletes nothing
the registry still names. ``gpuwarden upgrade-driver --wait`` follows an upgrade through a pause instead of
failing, and the checker is clean after the upgrade (retention running all along)."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.device.config import DeviceSettings
from services.device.service import DeviceService
from services.driver.config import DriverSettings
from services.driver.service import DriverService
from shared.contract.annotations import UPGRADE_STATE_LABEL
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.host.runner import RunningService, start_service
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, redis_client
from shared.plumbing.errors import TemporaryError
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.gpus import SimGpus
from shared.sim.spec import DeploymentSpec, ModelShape, NodeSpec, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.faults.checker import check_invariants
from tests.faults.conftest import expected, open_mesh
from tests.helpers import eventually, with_redis
from tests.servers import RedisServer

pytestmark = pytest.mark.timeout(240)

PAUSE_MS = 4000
"""Longer than the services' 2 s Redis timeout: every command sent meanwhile times out."""


async def pause(url: str, ms: int = PAUSE_MS) -> None:
    """Every client's commands wait ``ms`` (a command whose client gave up meanwhile is dropped, never run)."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.execute_command("CLIENT", "PAUSE", ms, "ALL")
    finally:
        await client.aclose()


async def answers(url: str) -> bool:
    client = aioredis.Redis.from_url(url, socket_timeout=0.5)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


class PausingStore(FileStore):
    """A file store that pauses Redis right after it deletes its first checkpoint: mid-retention."""

    redis_url = ""
    deleted = 0

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        await super().delete_checkpoint(session_id, checkpoint_id)
        self.deleted += 1
        if self.deleted == 1:
            await pause(self.redis_url)


async def test_a_redis_pause_mid_retention_leaves_no_recorded_checkpoint_without_its_file(
    own_redis: RedisServer, settings: Settings, subjects: Subjects, tmp_path: Path, bus: Bus
) -> None:
    store = PausingStore(tmp_path / "store")
    store.redis_url = own_redis.url
    async with open_mesh(with_redis(settings, own_redis.url), subjects, store, bus) as mesh:
        pod = await mesh.add_pod("llama-1", "node-1", [f"s{i}" for i in range(4)], blocks=3)
        assert await mesh.periodic_turn() == 1
        for sid in pod.agent.sessions():
            pod.grow(sid, 1)
        assert await mesh.periodic_turn() == 1
        await ConfigStore(mesh.client, subjects).write("checkpoint", CheckpointPolicy(keep_per_session=1), 1, "test")
        await eventually(lambda: mesh.service.policy().keep_per_session == 1)

        with pytest.raises(TemporaryError, match="Redis unreachable"):
            await mesh.service.retention.collect_garbage()  # one checkpoint went, then Redis stopped answering
        assert store.deleted == 1
        await eventually(lambda: answers(own_redis.url), timeout=15)
        await mesh.check(min_checkpoints=7)  # every recorded checkpoint has its file
        assert sum([len(await mesh.store.checkpoints(sid)) for sid in pod.agent.sessions()]) == 7

        assert (await mesh.service.retention.collect_garbage())[0] == 3  # the next turn finishes the job
        for sid in pod.agent.sessions():
            assert len(await mesh.store.checkpoints(sid)) == len(await mesh.service.registry.checkpoints(sid)) == 1
        await mesh.check(min_checkpoints=4)
        await mesh.evict(pod)
        other = await mesh.add_pod("llama-2", "node-2")
        for sid in pod.agent.sessions():
            assert [bytes(b) for b in (await other.endpoint.restore(sid)).blocks] == expected(sid, 4)


async def test_a_redis_pause_mid_retention_of_an_ended_session_leaves_no_recorded_checkpoint_without_its_file(
    own_redis: RedisServer, settings: Settings, subjects: Subjects, tmp_path: Path, bus: Bus
) -> None:
    store = PausingStore(tmp_path / "store")
    store.redis_url = own_redis.url
    async with open_mesh(with_redis(settings, own_redis.url), subjects, store, bus) as mesh:
        pod = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
        for _ in range(3):
            pod.grow("s1", 1)
            assert await mesh.periodic_turn() == 1
        with pytest.raises(TemporaryError):
            await mesh.service.retention.retire_session("s1")
        await eventually(lambda: answers(own_redis.url), timeout=15)
        await mesh.check(min_checkpoints=2)
        await mesh.service.retention.retire_session("s1")
        assert await mesh.store.checkpoints("s1") == [] and await mesh.service.registry.checkpoints("s1") == []
        await mesh.check(min_checkpoints=0)


# -- a rolling driver upgrade, followed by the CLI, through a Redis pause -------------------------------------------
SPEC = SimSpec(
    nodes=[NodeSpec(name=f"node-{i}") for i in (1, 2, 3)],
    deployments=[
        DeploymentSpec(
            name="llama",
            namespace="llm",
            replicas=3,
            max_unavailable=1,
            model=ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16),
        )
    ],
)
NEW = "560.35.03"


async def test_upgrade_driver_wait_follows_the_upgrade_through_a_redis_pause(
    own_redis: RedisServer, settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    """The driver, device and checkpoint services and the simulated workload in-process on a Redis the test owns;
    ``gpuwarden upgrade-driver --wait`` as a user runs it. Redis is paused while a node is being upgraded: the
    command says it waits for Redis and ends with every node upgraded (exit 0), every drain has its one verdict, and
    the checker is clean (retention ran every half second throughout, keeping one checkpoint per session)."""
    settings = with_redis(settings, own_redis.url)
    client = redis_client(settings.redis, timeout=10.0)
    cluster = await SimCluster.create(client, subjects, SPEC)
    store = FileStore(tmp_path / "checkpoints")
    checkpoint = CheckpointService(CheckpointSettings(gc_interval_s=0.5, gc_grace_s=5), store=store)
    await ConfigStore(client, subjects).write("checkpoint", CheckpointPolicy(keep_per_session=1), 0, "test")
    running: list[RunningService] = [await start_service(checkpoint, settings, Wiring)]
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    workload = SimWorkload(workload_bus, cluster, store, SPEC, announce_s=1.0, tick_s=0.1)
    drains: list[str] = []
    verdicts: list[DrainCompleted | DrainFailed] = []

    async def on_drain(event: DrainRequested) -> None:
        drains.append(event.drain_id)

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        verdicts.append(event)

    await bus.subscribe(subjects.pattern("node.drain.requested"), on_drain, (DrainRequested,))
    await bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
    await bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
    cli: asyncio.subprocess.Process | None = None
    try:
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == 3)
        for i in range(9):
            await bus.publish(
                InferenceRequest(namespace="llm", deployment="llama", session_id=f"chat-{i}", prompt_tokens=40 + 7 * i)
            )
        await eventually(lambda: workload.stats.served >= 9, timeout=30)
        for node in SPEC.nodes:
            gpus = SimGpus(client, subjects, SPEC, node.name)
            node_settings = replace(settings, node=node.name)
            device = DeviceService(DeviceSettings(inventory_s=0.2, plugin="off"), gpus=gpus, cluster=cluster)
            running.append(await start_service(device, node_settings, Wiring))
            driver = DriverService(
                DriverSettings(reconcile_s=0.2, lease_ttl_s=5, agent_timeout_s=2), cluster=cluster, gpu=gpus
            )
            running.append(await start_service(driver, node_settings, Wiring))
        env = dict(
            os.environ,
            GPUWARDEN_NATS_URL=settings.nats.servers[0],
            GPUWARDEN_REDIS_URL=own_redis.url,
            GPUWARDEN_ROOT=subjects.root,
            GPUWARDEN_BACKEND="sim",
            GPUWARDEN_HOME=str(tmp_path / "home"),
        )
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "shared.cli", "upgrade-driver", NEW, "--max-parallel", "1", "--wait", "--timeout", "150"),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

        async def upgrading() -> bool:
            states = [n.labels.get(UPGRADE_STATE_LABEL, "") for n in await cluster.nodes()]
            return any(s not in ("", "upgrade-required", "upgrade-done") for s in states)

        await eventually(upgrading, timeout=60, interval=0.05)
        await pause(own_redis.url)
        out, err = await asyncio.wait_for(cli.communicate(), 180)
        assert cli.returncode == 0, (out.decode(), err.decode())
        assert f"every node runs driver {NEW}" in out.decode()
        assert "waiting for Redis" in err.decode() and "Traceback" not in err.decode(), err.decode()
        # every drain the upgrade asked for has its one verdict, recorded; the invariants hold
        await eventually(lambda: len(drains) == 3 and {v.drain_id for v in verdicts} == set(drains), timeout=30)
        assert sorted(v.drain_id for v in verdicts) == sorted(drains)
        found = await check_invariants(store, client, subjects, drains=drains, min_checkpoints=9)
        assert found and found.recorded > 0, found.problems
    finally:
        if cli is not None and cli.returncode is None:
            cli.kill()
            await cli.wait()
        for service in reversed(running):
            await service.stop(grace=1)
        await workload.stop()
        await workload_bus.close(1)
        await cluster.close()
        await client.aclose()
