"""The KV journal inside a real vLLM engine (``GPUWARDEN_KV_JOURNAL_S``): the connector's worker copies each full
block out of vLLM's pages into the agent, the journal writes it to the store behind the engine and the checkpoint
service records it; the engine is then SIGKILLed (no drain, no preStop) and another engine goes on with the
conversation from the journal's entry, loading its full blocks through the connector, its tokens and logprobs
those of the conversation never interrupted. Two engine starts: in ``make faults`` (``long``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.vllm_engine import BLOCK_SIZE, VLLM_PYTHON, EngineProcess, build_model
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import NatsSettings, RedisSettings, Settings
from shared.sim.cluster import SimCluster
from shared.sim.spec import NodeSpec, SimSpec
from shared.wiring import Wiring
from tests.conftest import Servers
from tests.helpers import eventually
from tests.test_kv_vllm import REPLY1, REPLY2, TURN1, TURN2, ask, tokens

pytestmark = [pytest.mark.long, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]


@pytest.fixture
async def journaled(
    servers: Servers, tmp_path: Path
) -> AsyncIterator[tuple[EngineProcess, EngineProcess, FileStore, CheckpointService]]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make install` makes the vLLM virtualenv these tests run engines in")
    model = build_model(tmp_path / "model")
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    root = "t" + uuid.uuid4().hex[:10]
    settings = Settings(
        nats=NatsSettings(servers=(servers.nats_url,)), redis=RedisSettings(url=servers.redis_url), root=root
    )
    subjects = Subjects(root)
    client = redis_client(settings.redis)
    cluster = await SimCluster.create(client, subjects, SimSpec(nodes=[NodeSpec(name=n) for n in ("node-a", "node-b")]))
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=FileStore(store_dir))
    running = await start_service(service, settings, Wiring)
    bus = await Bus.connect(settings.nats, subjects, "test")
    env = {"GPUWARDEN_NATS_URL": servers.nats_url, "GPUWARDEN_ROOT": root}
    a = EngineProcess(
        model, tmp_path / "vllm-a.log", store=f"file://{store_dir}", pod="vllm-a", nats=True,
        env={**env, "GPUWARDEN_NODE": "node-a", "GPUWARDEN_KV_JOURNAL_S": "0.2"}, extra_args=["--announce-s", "1"],
    )  # fmt: skip
    b = EngineProcess(
        model, tmp_path / "vllm-b.log", store=f"file://{store_dir}", pod="vllm-b", nats=True,
        env={**env, "GPUWARDEN_NODE": "node-b"}, extra_args=["--announce-s", "1"],
    )  # fmt: skip
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, FileStore(store_dir), service
    finally:
        a.kill()
        b.stop()
        await bus.close(1)
        await running.stop(grace=1)
        await cluster.close()
        await client.aclose()


async def test_a_killed_vllm_engine_s_conversation_goes_on_elsewhere_from_its_journal(
    journaled: tuple[EngineProcess, EngineProcess, FileStore, CheckpointService],
) -> None:
    a, b, store, service = journaled
    turn1 = tokens(21, TURN1)
    ref1 = await ask(b, turn1, REPLY1, session="ref")  # the conversation never interrupted, on B
    turn2 = turn1 + ref1["tokens"] + tokens(22, TURN2)
    ref2 = await ask(b, turn2, REPLY2, session="ref")
    first = await ask(a, turn1, REPLY1, session="killed")
    assert first["tokens"] == ref1["tokens"]
    whole = (TURN1 + REPLY1 - 1) // BLOCK_SIZE * BLOCK_SIZE

    async def journaled_whole() -> bool:  # the journal's entry of every full block, recorded
        newest = await service.registry.newest_checkpoint("killed")
        return newest is not None and int(newest["token_count"]) == whole

    await eventually(journaled_whole, timeout=60)
    newest = await service.registry.newest_checkpoint("killed")
    assert newest is not None and newest["pod"] == "vllm-a"
    manifest = await store.manifest("killed", str(newest["checkpoint_id"]))
    assert manifest.reason == "journal"
    await asyncio.to_thread(a.kill)  # no drain, no preStop: what the journal wrote is what is left
    moved = await ask(b, turn2, REPLY2, session="killed")
    assert moved["cached"] == whole  # loaded through the connector from the journal's entry, not computed
    assert moved["tokens"] == ref2["tokens"] and moved["logprobs"] == ref2["logprobs"]
