"""gpuwarden's connector inside real vLLM engines: vLLM's CPU build (``.venv-vllm``, made by ``make install``), a
Llama built from a config with seeded weights, two engine processes (pods ``vllm-a`` on node-a and ``vllm-b`` on
node-b) that talk to a real checkpoint service over real NATS and share a file store.

One pair of engines serves the whole module (each start costs tens of seconds on a shared CPU), so the module runs
in one pytest-xdist worker (``xdist_group``; ``make test`` distributes by group) and its tests share one event loop.
Every conversation has a session of its own. What is checked:

- a conversation decoded on A, saved at a drain of node-a (the checkpoint service asks A's agent over the bus), goes
  on on B, which never saw it: B loads the checkpoint's whole blocks through the connector and its greedy tokens and
  logprobs equal those of the same conversation never interrupted on A;
- the checkpoint holds K and V where the agent's block layout says, read out of vLLM's CPU pages as that backend
  lays them out: layer 0's V of every position of the first block, and K of the first position, equal what the
  weights give by hand;
- a checkpoint of another model is refused: B computes the conversation itself, exactly as without a session;
- a checkpoint that fails verification is never served: the load is reported through
  ``get_block_ids_with_load_errors`` and vLLM's policy (``fail``) fails the request; the session then starts anew.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from bench.vllm_engine import BLOCK_SIZE, VLLM_PYTHON, EngineProcess, build_model
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.sessions import PrefetchSessions, SessionsPrefetched
from shared.contract.subjects import Subjects
from shared.host.runner import RunningService, start_service
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.kv.manifest import CheckpointManifest, KvLayout
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import NatsSettings, RedisSettings, Settings
from shared.sim.cluster import SimCluster
from shared.sim.spec import NodeSpec, SimSpec
from shared.wiring import Wiring
from tests.conftest import Servers
from tests.helpers import eventually
from tests.kvkit import flip_byte

pytestmark = [
    pytest.mark.xdist_group("vllm"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),
]

NODES = ("node-a", "node-b", "node-c")
TURN1, REPLY1, TURN2, REPLY2 = 70, 30, 20, 16
"""Turn 1: a prompt of 70 tokens and a reply of 30 (99 positions computed: 3 whole blocks of 32); turn 2 adds 20."""


@dataclass
class Mesh:
    a: EngineProcess
    b: EngineProcess
    model: Path
    store: FileStore
    bus: Bus
    service: CheckpointService
    running: RunningService
    cluster: SimCluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make install` makes the vLLM virtualenv these tests run engines in")
    work = tmp_path_factory.mktemp("vllm")
    model = build_model(work / "model")
    store_dir = work / "store"
    store_dir.mkdir()
    root = "t" + uuid.uuid4().hex[:10]
    settings = Settings(
        nats=NatsSettings(servers=(servers.nats_url,)),
        redis=RedisSettings(url=servers.redis_url),
        root=root,
        node="node-1",
        config_reread_s=0.5,
    )
    subjects = Subjects(root)
    client = redis_client(settings.redis)
    cluster = await SimCluster.create(client, subjects, SimSpec(nodes=[NodeSpec(name=n) for n in NODES]))
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=FileStore(store_dir))
    running = await start_service(service, settings, Wiring)
    bus = await Bus.connect(settings.nats, subjects, "test")
    env = {"GPUWARDEN_NATS_URL": servers.nats_url, "GPUWARDEN_ROOT": root}
    engines = [
        EngineProcess(
            model,
            work / f"vllm-{x}.log",
            store=f"file://{store_dir}",
            pod=f"vllm-{x}",
            nats=True,
            env={**env, "GPUWARDEN_NODE": f"node-{x}"},
            extra_args=["--announce-s", "1"],
        )
        for x in ("a", "b")
    ]
    try:
        for engine in engines:
            engine.wait_ready()
        yield Mesh(engines[0], engines[1], model, FileStore(store_dir), bus, service, running, cluster)
    finally:
        for engine in engines:
            engine.stop()
        for spec in subjects.streams:
            try:
                await bus.js.delete_stream(spec.name)
            except Exception:
                pass
        await bus.close(1)
        await running.stop(grace=1)
        await cluster.close()
        await client.aclose()


async def ask(engine: EngineProcess, prompt: list[int], max_tokens: int, session: str = "") -> dict[str, Any]:
    """One request, in a thread: the checkpoint service the engines talk to runs on this test's event loop."""
    return await asyncio.to_thread(engine.generate, prompt, max_tokens, session)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


async def drain(mesh: Mesh, node: str, sessions: list[str]) -> DrainCompleted | DrainFailed:
    """Drain ``node`` once the checkpoint service knows ``sessions`` are there; its verdict."""

    async def there() -> bool:
        on_node = {s.session_id for s in await mesh.service.registry.sessions_on_node(node)}
        return set(sessions) <= on_node

    await eventually(there, timeout=30)
    verdicts: list[DrainCompleted | DrainFailed] = []

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        verdicts.append(event)

    drain_id = f"drain-{uuid.uuid4().hex[:8]}"
    subjects = mesh.bus.subjects
    subs = [
        await mesh.bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,)),
        await mesh.bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,)),
    ]
    try:
        await mesh.bus.publish(DrainRequested(node=node, drain_id=drain_id, deadline_s=25))
        mine = await eventually(lambda: [v for v in verdicts if v.drain_id == drain_id], timeout=120)
        return mine[0]
    finally:
        for sub in subs:
            await sub.unsubscribe()


def newest_manifest(store: FileStore, session: str) -> CheckpointManifest:
    files = sorted((store.root / "sessions" / session).glob("*.json"), key=lambda p: p.stat().st_mtime)
    assert files, f"no checkpoint of {session}"
    return msgspec.json.decode(files[-1].read_bytes(), type=CheckpointManifest)


async def test_a_drained_conversation_goes_on_in_another_engine_token_for_token(mesh: Mesh) -> None:
    turn1 = tokens(1, TURN1)
    # the conversation never interrupted, on A
    ref1 = await ask(mesh.a, turn1, REPLY1, session="vllm-ref")
    turn2 = turn1 + ref1["tokens"] + tokens(2, TURN2)
    ref2 = await ask(mesh.a, turn2, REPLY2, session="vllm-ref")
    # the same conversation, drained from A after turn 1 and continued on B
    moved1 = await ask(mesh.a, turn1, REPLY1, session="vllm-moved")
    assert moved1["tokens"] == ref1["tokens"] and moved1["logprobs"] == ref1["logprobs"]
    verdict = await drain(mesh, "node-a", ["vllm-moved"])
    assert isinstance(verdict, DrainCompleted), verdict
    manifest = newest_manifest(mesh.store, "vllm-moved")
    assert manifest.pod == "vllm-a" and manifest.reason == "drain"
    assert manifest.token_count == TURN1 + REPLY1 - 1  # the last reply token is not computed yet
    moved2 = await ask(mesh.b, turn2, REPLY2, session="vllm-moved")

    whole = (TURN1 + REPLY1 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert moved2["cached"] == whole  # loaded through the connector, not computed
    assert moved2["tokens"] == ref2["tokens"]
    assert moved2["logprobs"] == ref2["logprobs"]  # bit for bit

    # the checkpoint's blocks hold K and V where the agent's layout says: layer 0 by hand from the weights
    lay = manifest.layout
    agent = KvAgent(mesh.store, pod="reader", node="node-x", namespace="default", deployment="vllm", layout=lay)
    await agent.restore("vllm-moved")
    block0 = np.asarray(agent.blocks("vllm-moved")[0]).view(np.uint8).view(np.float32)
    block0 = block0.reshape(lay.layers, 2, lay.kv_heads, lay.block_tokens, lay.head_dim)
    keys, values = layer0_kv(mesh.model, turn1[: lay.block_tokens])  # [positions, heads, head_dim]
    np.testing.assert_allclose(block0[0, 0], keys.transpose(1, 0, 2), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(block0[0, 1], values.transpose(1, 0, 2), rtol=1e-4, atol=1e-5)


async def test_the_routers_prefetch_restores_a_conversation_before_its_request_token_for_token(mesh: Mesh) -> None:
    """The router's ``kv.session.prefetch.command`` to engine B (its worker's ``SessionHost``): the drained
    conversation is restored into B's agent and claimed by B before its request comes; the request then loads the
    blocks from that copy (not from the store again) and goes on bit for bit as the uninterrupted reference."""
    turn1 = tokens(11, TURN1)
    ref1 = await ask(mesh.a, turn1, REPLY1, session="vllm-pref-ref")
    turn2 = turn1 + ref1["tokens"] + tokens(12, TURN2)
    ref2 = await ask(mesh.a, turn2, REPLY2, session="vllm-pref-ref")
    moved1 = await ask(mesh.a, turn1, REPLY1, session="vllm-pref")
    assert moved1["tokens"] == ref1["tokens"]
    verdict = await drain(mesh, "node-a", ["vllm-pref"])
    assert isinstance(verdict, DrainCompleted), verdict

    command = PrefetchSessions(pod="vllm-b", session_ids=["vllm-pref"], deadline_s=60)
    answer = await mesh.bus.request(mesh.bus.subjects.for_event(command), command, 90)
    assert isinstance(answer, SessionsPrefetched) and answer.restored == ["vllm-pref"], answer
    again = await mesh.bus.request(mesh.bus.subjects.for_event(command), command, 90)
    assert isinstance(again, SessionsPrefetched) and again.held == ["vllm-pref"], again
    where = await mesh.service.registry.where("vllm-pref")
    assert where.held and where.pod == "vllm-b"  # claimed before any request: the router routes it to B

    moved2 = await ask(mesh.b, turn2, REPLY2, session="vllm-pref")
    whole = (TURN1 + REPLY1 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert moved2["cached"] == whole
    assert moved2["tokens"] == ref2["tokens"] and moved2["logprobs"] == ref2["logprobs"]
    log = mesh.b.log.read_text()
    assert "session vllm-pref prefetched" in log and "session vllm-pref: loaded from its prefetched copy" in log


def layer0_kv(model: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's K (rotated by position, as Llama's rotary embedding does) and V of ``ids``, by hand:
    ``[positions, kv_heads, head_dim]``."""
    weights = load_file(str(model / "model.safetensors"))
    config: dict[str, Any] = json.loads((model / "config.json").read_text())
    x = weights["model.embed_tokens.weight"][torch.tensor(ids)].double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    x = x * weights["model.layers.0.input_layernorm.weight"].double()
    heads = config["num_key_value_heads"]
    k = (x @ weights["model.layers.0.self_attn.k_proj.weight"].double().T).reshape(len(ids), heads, -1)
    v = (x @ weights["model.layers.0.self_attn.v_proj.weight"].double().T).reshape(len(ids), heads, -1)
    dim = k.shape[-1]
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.arange(len(ids), dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = torch.cat([-k[..., dim // 2 :], k[..., : dim // 2]], -1)
    return (k * cos + half * sin).numpy(), v.numpy()


async def test_a_checkpoint_of_another_model_is_refused_and_computed_anew(mesh: Mesh) -> None:
    """A pod of another model on node-c holds the session; its checkpoint, saved at a drain, is not for B."""
    theirs = KvLayout(  # the shape of the engines' model (2 layers, 2 KV heads of 32), another model's weights
        model_id="another-llama",
        model_version="unversioned",
        tokenizer_id="another-llama@unversioned",
        dtype="float32",
        block_tokens=BLOCK_SIZE,
        layers=2,
        kv_heads=2,
        head_dim=32,
        weights_digest="f" * 64,
    )
    foreign = KvAgent(mesh.store, pod="llama-c", node="node-c", namespace="default", deployment="llama", layout=theirs)
    endpoint = AgentEndpoint(foreign, mesh.bus, announce_s=1.0)
    await endpoint.start()
    try:
        await endpoint.start_session("vllm-alien", timeout=10)
        for i in range(3):
            foreign.append_block("vllm-alien", np.full(theirs.block_bytes, i + 1, dtype=np.uint8))
        verdict = await drain(mesh, "node-c", ["vllm-alien"])
        assert isinstance(verdict, DrainCompleted), verdict
    finally:
        await endpoint.stop()
    prompt = tokens(3, 100)
    plain = await ask(mesh.b, prompt, REPLY2)
    alien = await ask(mesh.b, prompt, REPLY2, session="vllm-alien")
    assert alien["cached"] == 0
    assert alien["tokens"] == plain["tokens"] and alien["logprobs"] == plain["logprobs"]


async def test_a_checkpoint_that_fails_verification_is_never_served(mesh: Mesh) -> None:
    turn1 = tokens(4, TURN1)
    first = await ask(mesh.a, turn1, REPLY1, session="vllm-broken")
    verdict = await drain(mesh, "node-a", ["vllm-broken"])
    assert isinstance(verdict, DrainCompleted), verdict
    manifest = newest_manifest(mesh.store, "vllm-broken")
    for chunk in manifest.blocks:
        flip_byte(mesh.store, chunk.pack, chunk.offset + 7)
    turn2 = turn1 + first["tokens"] + tokens(5, TURN2)

    failed = await ask(mesh.b, turn2, REPLY2, session="vllm-broken")
    assert failed["finish_reason"] == "error", failed  # vLLM's kv_load_failure_policy "fail": never a wrong cache
    assert failed["tokens"] == []
    again = await ask(mesh.b, turn2, REPLY2, session="vllm-broken")
    plain = await ask(mesh.b, turn2, REPLY2)
    assert again["cached"] == 0
    assert again["tokens"] == plain["tokens"] and again["logprobs"] == plain["logprobs"]
