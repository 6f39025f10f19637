"""The simulated workload's test kit: a small model, a spec of one-GPU nodes serving one deployment, the checkpoint
service and a workload that checks every pod's pool after each request, on the bus (``mesh``), and the requests a
test sends (rounds of conversations, single turns).

Shared by the capacity and model rollout tests; a test module imports from here, never from another test module.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.conversations import Conversations
from shared.sim.spec import DeploymentSpec, GpuSpec, ModelShape, NodeSpec, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import Wiring
from tests.faults.checker import check_invariants
from tests.helpers import eventually

SMALL_MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16, max_model_len=256)  # 16 KiB blocks


def spec_of(replicas: int, kv_blocks: int, model: ModelShape = SMALL_MODEL) -> SimSpec:
    return SimSpec(
        nodes=[NodeSpec(name=f"node-{i}", gpus=[GpuSpec(count=1)]) for i in range(1, replicas + 1)],
        deployments=[
            DeploymentSpec(
                name="llama", namespace="llm", replicas=replicas, max_unavailable=1, kv_blocks=kv_blocks, model=model
            )
        ],
    )


@dataclass
class Mesh:
    workload: CheckedWorkload
    service: CheckpointService
    cluster: SimCluster
    bus: Bus


class CheckedWorkload(SimWorkload):
    """Checks after every request that each pod's agent holds exactly what its pool counts, within capacity."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.violations: list[str] = []
        self.checks = 0

    async def on_request(self, request: InferenceRequest) -> None:
        await super().on_request(request)
        self.checks += 1
        for name, runtime in list(self.runtimes.items()):
            async with runtime.lock:  # between engine steps, as a real engine's scheduler sees its pool
                held = {s: len(runtime.agent.blocks(s)) for s in runtime.agent.sessions()}
                counted = {s: runtime.pool.held(s) for s in runtime.pool.sessions()}
            if sum(held.values()) > runtime.pool.capacity or held != counted:
                self.violations.append(f"{name}: agent {held}, pool {counted}")


@contextlib.asynccontextmanager
async def mesh(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path, spec: SimSpec, **options: Any
) -> AsyncIterator[Mesh]:
    client = redis_client(settings.redis)
    cluster = await SimCluster.create(client, subjects, spec)
    store = FileStore(tmp_path / "checkpoints")
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    workload = CheckedWorkload(workload_bus, cluster, store, spec, announce_s=1.0, tick_s=0.1, **options)
    try:
        await workload.start()
        await eventually(lambda: len(workload.runtimes) == spec.deployments[0].replicas)
        yield Mesh(workload, service, cluster, bus)
    finally:
        await workload.stop()
        await workload_bus.close(1)
        await running.stop(grace=1)
        await cluster.close()
        await client.aclose()


async def send_rounds(bus: Bus, talks: Conversations, rounds: int) -> int:
    """Publish ``rounds`` rounds of the conversations' next requests; how many were sent."""
    sent = 0
    for _ in range(rounds):
        for request in talks.next_requests():
            await bus.publish(request)
            sent += 1
    return sent


def turn(sid: str, prompt: int, new: int = 0) -> InferenceRequest:
    return InferenceRequest(
        namespace="llm", deployment="llama", session_id=sid, prompt_tokens=prompt, max_new_tokens=new
    )


async def check_store(workload: SimWorkload, settings: Settings, subjects: Subjects, min_checkpoints: int) -> None:
    """The fault checker over the workload's store and the registry (``check_invariants``): any problem fails."""
    client = redis_client(settings.redis)
    try:
        found = await check_invariants(workload.store, client, subjects, min_checkpoints=min_checkpoints)
    finally:
        await client.aclose()
    assert found, found.problems
