"""The vLLM connector's vLLM-free core on the CPU: paged caches shaped as vLLM's backends shape them (torch CPU
tensors), the scheduler's and the worker's books driven step by step as vLLM drives a connector, and sessions saved
and restored through a real KvAgent and FileStore.

A small "engine" here stands in for vLLM's scheduling loop only (block allocation with scattered ids, prefill then
one token per step, request finish); every KV value it writes is a function of the token and its position, so a
block restored into another engine, another layout and other block ids can be checked value by value.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from shared.kv.agent import KvAgent, RestoredSession
from shared.kv.engines.vllm_core.config import ConfigError, ConnectorConfig, session_of
from shared.kv.engines.vllm_core.layout import cache_dtype_name, files_digest, layer_index
from shared.kv.engines.vllm_core.loop import AgentLoop
from shared.kv.engines.vllm_core.paged import PagedCache, PagedLayout
from shared.kv.engines.vllm_core.plan import (
    ClaimSpec,
    CopySpec,
    FinishSpec,
    LoadSpec,
    StepPlan,
    TruncateSpec,
    decode_plan,
    encode_plan,
)
from shared.kv.engines.vllm_core.scheduler import SchedulerBook, checkpoint_tokens, common_prefix
from shared.kv.engines.vllm_core.worker import SessionPort, WorkerBook
from shared.kv.filestore import FileStore
from shared.kv.manifest import IncompatibleCheckpoint, KvLayout

BS = 4  # vLLM's block_size in these tests: small, so a short conversation spans several blocks
LAYERS, HEADS, DIM = 3, 2, 8


def layout(**changes: object) -> KvLayout:
    base = KvLayout(
        model_id="tiny",
        model_version="r1",
        tokenizer_id="tok@abc",
        dtype="float32",
        block_tokens=BS,
        layers=LAYERS,
        kv_heads=HEADS,
        head_dim=DIM,
        weights_digest="w" * 64,
    )
    return msgspec.structs.replace(base, **changes)


def shape(kind: str, blocks: int, bs: int = BS, heads: int = HEADS, dim: int = DIM) -> tuple[int, ...]:
    inner = (bs, heads) if kind.endswith("nhd") else (heads, bs)
    return (2, blocks, *inner, dim) if kind.startswith("kv_first") else (blocks, 2, *inner, dim)


def paged(kind: str, blocks: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape(kind, blocks), dtype=dtype) for i in range(LAYERS)}


def kv_value(token: int, position: int, layer: int, kv: int) -> torch.Tensor:
    """What a "forward" writes for one position: [heads, head_dim], from the token, its position, layer and K/V."""
    base = (token * 131 + position * 17 + layer * 7 + kv * 3) % 1009
    return torch.arange(HEADS * DIM, dtype=torch.float32).reshape(HEADS, DIM) / 64 + base


def write_position(cache: PagedCache, block_ids: list[int], position: int, token: int) -> None:
    block, offset = block_ids[position // BS], position % BS
    for layer, view in enumerate(cache.views):  # [blocks, 2, heads, bs, dim]
        for kv in (0, 1):
            view[block, kv, :, offset] = kv_value(token, position, layer, kv)


def read_position(cache: PagedCache, block_ids: list[int], position: int) -> list[torch.Tensor]:
    block, offset = block_ids[position // BS], position % BS
    return [view[block, kv, :, offset].clone() for view in cache.views for kv in (0, 1)]


def expected_position(token: int, position: int) -> list[torch.Tensor]:
    return [kv_value(token, position, layer, kv) for layer in range(LAYERS) for kv in (0, 1)]


# -- the paged layouts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", PagedLayout.KINDS)
def test_each_backend_layout_is_recognised_from_its_shape(kind: str) -> None:
    found = PagedLayout.infer(shape(kind, 37), BS, HEADS, DIM)
    assert found.kind == kind


def test_an_ambiguous_shape_needs_the_hint_and_a_wrong_hint_is_refused() -> None:
    square = shape("kv_first_nhd", 2, bs=4, heads=4)  # two blocks, and as many heads as tokens per block
    with pytest.raises(ValueError, match="ambiguous"):
        PagedLayout.infer(square, 4, 4, DIM)
    assert PagedLayout.infer(square, 4, 4, DIM, "blocks_first_hnd").kind == "blocks_first_hnd"
    with pytest.raises(ValueError, match="is not 'kv_first_nhd'"):
        PagedLayout.infer(shape("blocks_first_nhd", 9), BS, HEADS, DIM, "kv_first_nhd")
    with pytest.raises(ValueError, match="MLA"):
        PagedLayout.infer((100, BS, 576), BS, HEADS, DIM)  # an MLA cache: [blocks, block_size, latent]


def test_the_backend_declared_shape_settles_the_layout() -> None:
    def flash(num_blocks: int, block_size: int, heads: int, dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, heads, dim)

    def flashinfer_hnd(num_blocks: int, block_size: int, heads: int, dim: int) -> tuple[int, ...]:
        return (num_blocks, 2, heads, block_size, dim)

    assert PagedLayout.from_backend_shape(flash, 4, 4, DIM).kind == "kv_first_nhd"
    assert PagedLayout.from_backend_shape(flashinfer_hnd, 4, 4, DIM).kind == "blocks_first_hnd"


@pytest.mark.parametrize("kind", PagedLayout.KINDS)
def test_blocks_round_trip_through_every_layout_with_scattered_ids_and_a_partial_tail(kind: str) -> None:
    torch.manual_seed(3)
    layers = {name: torch.randn(t.shape) for name, t in paged(kind, 23).items()}
    cache = PagedCache(layers, layout())
    ids = [17, 2, 9, 21]
    blocks = cache.gather(ids, [BS, BS, BS, 1])
    assert all(b.shape == (LAYERS, 2, HEADS, BS, DIM) and b.is_contiguous() and b.device.type == "cpu" for b in blocks)
    # block i of the agent is vLLM block ids[i]: every layer, K then V, heads before tokens
    name = sorted(layers, key=layer_index)[1]
    raw = layers[name]
    k_first_token = raw[0, 9, 0] if kind == "kv_first_nhd" else None
    if k_first_token is not None:
        assert torch.equal(blocks[2][1, 0, :, 0], k_first_token)
    assert torch.equal(blocks[3][:, :, :, 1:], torch.zeros_like(blocks[3][:, :, :, 1:]))  # past the tail: zeros

    other = PagedCache(paged(kind, 23), layout())
    other.scatter([4, 0, 22], blocks[:3])
    for src, dst in zip(ids[:3], [4, 0, 22], strict=True):
        for a, b in zip(cache.views, other.views, strict=True):
            assert torch.equal(a[src], b[dst])
    assert torch.count_nonzero(other.views[0][1]) == 0  # untouched blocks stay as they were


def test_blocks_move_between_layouts_and_from_restored_bytes() -> None:
    torch.manual_seed(5)
    source = PagedCache({n: torch.randn(t.shape) for n, t in paged("kv_first_nhd", 8).items()}, layout())
    target = PagedCache(paged("blocks_first_hnd", 8), layout())
    blocks = source.gather([5, 6])
    as_bytes = [b.numpy().view("uint8").reshape(-1).copy() for b in blocks]  # what a restore hands back
    target.scatter([1, 3], as_bytes)
    for src, dst in ((5, 1), (6, 3)):
        for a, b in zip(source.views, target.views, strict=True):
            assert torch.equal(a[src], b[dst])


def cpu_like_writer(key: torch.Tensor, value: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
    """A cache writer laid out as vLLM's CPU backend lays a page out ([1, heads, block_size, 2 * head_dim] in
    shape; in memory each head's K transposed, [head_dim, block_size], then its V, [block_size, head_dim])."""
    heads_pages = page.view(page.shape[0], page.shape[1], 2, -1)  # [1, H, K|V, bs * D]
    bs = page.shape[2]
    for i, slot in enumerate(slots.tolist()):
        for h in range(key.shape[1]):
            heads_pages[0, h, 0].view(-1, bs)[:, slot] = key[i, h]  # K as [D, bs]
            heads_pages[0, h, 1].view(bs, -1)[slot] = value[i, h]  # V as [bs, D]


def test_a_page_the_backend_writes_its_own_way_is_mapped_by_asking_its_writer() -> None:
    torch.manual_seed(7)
    pages = {f"model.layers.{i}.self_attn.attn": torch.zeros(6, HEADS, BS, 2 * DIM) for i in range(LAYERS)}
    first = next(iter(pages.values()))
    mapped = PagedLayout.from_backend("CPU_ATTN", None, cpu_like_writer, first[:1], BS, HEADS, DIM)
    assert mapped.kind == "mapped"
    cache = PagedCache(pages, layout(), mapped)
    key, value = torch.randn(BS, HEADS, DIM), torch.randn(BS, HEADS, DIM)
    for name in pages:  # the "engine" writes block 4 of every layer through its own writer
        block = pages[name][4:5]
        cpu_like_writer(key, value, block, torch.arange(BS))
    [got] = cache.gather([4])
    assert torch.equal(got[1, 0], key.transpose(0, 1)) and torch.equal(got[1, 1], value.transpose(0, 1))
    other = PagedCache({n: torch.zeros_like(t) for n, t in pages.items()}, layout(), mapped)
    other.scatter([2], [got])
    assert all(torch.equal(a[4], b[2]) for a, b in zip(pages.values(), other.tensors, strict=True))
    # a 4-D page is never guessed from its shape, nor named as mapped
    with pytest.raises(ValueError, match="ambiguous"):
        PagedCache(pages, layout())
    hnc = PagedCache(pages, layout(), "blocks_hnc")
    assert hnc.paged.kind == "blocks_hnc" and hnc.views[0].shape == (6, 2, HEADS, BS, DIM)


def test_a_writer_that_leaves_gaps_or_overlaps_and_an_unknown_backend_are_refused() -> None:
    page = torch.zeros(1, HEADS, BS, 2 * DIM)

    def keys_only(key: torch.Tensor, value: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
        page.view(1, HEADS, BS, 2, DIM)[0, :, :, 0] = key.transpose(0, 1)

    def keys_twice(key: torch.Tensor, value: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
        page.view(1, HEADS, BS, 2, DIM)[0, :, :, 0] = key.transpose(0, 1)
        page.view(1, HEADS, BS, 2, DIM)[0, :, :, 1] = key.transpose(0, 1)

    with pytest.raises(ValueError, match="unwritten"):
        PagedLayout.from_cache_writer(keys_only, page, BS, HEADS, DIM)
    with pytest.raises(ValueError, match="two K/V elements in one place"):
        PagedLayout.from_cache_writer(keys_twice, page, BS, HEADS, DIM)
    with pytest.raises(ValueError, match="does not know"):
        PagedLayout.from_backend("SOME_NEW_ATTN", None, None, page, BS, HEADS, DIM)
    with pytest.raises(ValueError, match="could not be asked"):
        PagedLayout.from_backend("CPU_ATTN", None, None, page, BS, HEADS, DIM)
    assert PagedLayout.from_backend("FLASH_ATTN", None, None, page, BS, HEADS, DIM).kind == "blocks_hnc"


def test_a_paged_cache_unlike_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="2 KV cache layers, the model has 3"):
        PagedCache(dict(list(paged("kv_first_nhd", 4).items())[:2]), layout())
    with pytest.raises(ValueError, match="holds float16"):
        PagedCache(paged("kv_first_nhd", 4, torch.float16), layout())
    with pytest.raises(ValueError, match="matches no known layout"):
        PagedCache(paged("kv_first_nhd", 4), layout(block_tokens=8))
    with pytest.raises(IndexError, match="outside"):
        PagedCache(paged("kv_first_nhd", 4), layout()).gather([4])


# -- metadata, config, small pieces -----------------------------------------------------------------------------


def test_the_step_plan_round_trips_and_garbage_is_refused() -> None:
    plan = StepPlan(
        claims=[ClaimSpec("s1")],
        truncates=[TruncateSpec("s2", 3)],
        loads=[LoadSpec("r1", "s2", 0, [5, 9, 1], True)],
        copies=[CopySpec("r1", "s2", 3, [7])],
        finishes=[FinishSpec("r0", "s3", 13, [2, 4, 6, 8], end=True)],
    )
    assert decode_plan(encode_plan(plan)) == plan
    assert decode_plan(encode_plan(StepPlan())).empty
    with pytest.raises(ValueError, match="not a gpuwarden step plan"):
        decode_plan(b"\x93garbage")


def test_the_session_comes_from_kv_transfer_params() -> None:
    assert session_of(None) is None
    assert session_of({"other": 1}) is None
    assert session_of({"gpuwarden_session": "chat-42"}) == ("chat-42", False)
    assert session_of({"gpuwarden_session": "chat-42", "gpuwarden_end": True}) == ("chat-42", True)
    with pytest.raises(ValueError, match="a session id: letters"):
        session_of({"gpuwarden_session": "../etc/passwd"})
    with pytest.raises(ValueError, match="must be a string"):
        session_of({"gpuwarden_session": 42})
    for refused in ("chat.42", "chat:42", "x" * 129):  # what the contract refuses, the connector refuses first
        with pytest.raises(ValueError, match="a session id: letters"):
            session_of({"gpuwarden_session": refused})


def test_the_connector_config_says_what_is_wrong() -> None:
    config = ConnectorConfig.parse({"store": "file:///ckpt", "pod": "p-1"}, env={})
    assert config.store == "file:///ckpt" and config.pod == "p-1" and not config.nats and config.save_on_finish
    with_nats = ConnectorConfig.parse({}, env={"GPUWARDEN_CHECKPOINT_STORE": "nats://kv", "GPUWARDEN_NATS_URL": "x"})
    assert with_nats.nats and not with_nats.save_on_finish
    for extra, message in (
        ({}, "no checkpoint store"),
        ({"store": "s3://bucket"}, "expected file:///"),
        ({"store": "nats://kv"}, "needs 'nats': true"),
        ({"store": "file:///c", "colour": 1}, "unknown keys"),
        ({"store": "file:///c", "kv_layout": "diagonal"}, "kv_layout"),
        ({"store": "file:///c", "save_on_finish": "maybe"}, "expected true or false"),
        ({"store": "file:///c", "lookup_timeout_s": "soon"}, "are numbers"),
    ):
        with pytest.raises(ConfigError, match=message):
            ConnectorConfig.parse(extra, env={})


def test_small_pieces(tmp_path: Path) -> None:
    assert cache_dtype_name("auto", torch.bfloat16) == "bfloat16"
    assert cache_dtype_name("fp8", torch.bfloat16) == "float8_e4m3fn"
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ValueError, match="no layer number"):
        layer_index("lm_head")
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert files_digest(tmp_path, ["*.safetensors"]) == ""  # a hub id, or a folder without weights
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    first = files_digest(tmp_path, ["*.safetensors"])
    (tmp_path / "model.safetensors").write_bytes(b"weightz")
    assert first and files_digest(tmp_path, ["*.safetensors"]) != first


# -- the books, driven as vLLM drives a connector ---------------------------------------------------------------


class Engine:
    """One "vLLM" engine: a paged cache, a block allocator with scattered ids, the scheduler's book and the
    worker's book over a real agent and store. No prefix caching: every turn starts from nothing computed."""

    def __init__(self, store: FileStore, lay: KvLayout, kind: str, pod: str, seed: int, blocks: int = 64) -> None:
        self.cache = PagedCache(paged(kind, blocks), lay)
        self.free = list(range(blocks))
        random.Random(seed).shuffle(self.free)
        self.agent = KvAgent(store, pod=pod, node="n1", namespace="llm", deployment="tiny", layout=lay)
        self.loop = AgentLoop(f"test-{pod}")
        self.worker = WorkerBook(self.agent, self.loop, SessionPort(self.agent), save_on_finish=True)
        self.worker.register(self.cache)
        self.store = store
        self.sched = SchedulerBook(BS, lambda s: self.loop.call(checkpoint_tokens(store, lay, s), 5))
        self.load_errors: set[int] = set()
        self.loaded_tokens = 0

    def close(self) -> None:
        self.loop.close()

    def turn(self, req: str, session: str | None, prompt: list[int], generate: int, end: bool = False) -> list[int]:
        """Run one request to its end; returns the generated tokens (each the next of a fixed rule)."""
        external, asynchronous = self.sched.matched(req, session, prompt, 0)
        assert not asynchronous
        self.loaded_tokens = external
        ids = [self.free.pop() for _ in range(-(-(len(prompt) + generate) // BS))]
        self.sched.allocated(req, ids, external)
        self.sched.new_request(req, session, end, prompt, ids, external, len(prompt) - external)
        tokens = list(prompt)
        plan = decode_plan(encode_plan(self.sched.build()))
        report = self.worker.before_forward(plan)
        self.load_errors = self.worker.take_load_errors()
        assert report.load_errors == self.load_errors
        first = external
        if self.load_errors:  # vLLM recomputes from the first block that failed
            first = min(ids.index(b) for b in self.load_errors) * BS
        for position in range(first, len(prompt)):
            write_position(self.cache, ids, position, tokens[position])
        self.worker.after_forward(plan)
        computed = len(prompt)
        tokens.append(sum(tokens[-3:]) % 251)
        for _ in range(generate - 1):  # one token per step
            self.sched.cached_request(req, None, False, computed, 1)
            plan = decode_plan(encode_plan(self.sched.build()))
            self.worker.before_forward(plan)
            write_position(self.cache, ids, computed, tokens[computed])
            self.worker.after_forward(plan)
            computed += 1
            tokens.append(sum(tokens[-3:]) % 251)
        hold = self.sched.finished(req, ids, computed, tokens)
        plan = decode_plan(encode_plan(self.sched.build()))
        self.worker.before_forward(plan)
        self.worker.after_forward(plan)
        done = self.worker.finished({req})
        if session is not None:
            assert hold and done == {req}, "a session's blocks are held until the worker copied them"
            self.sched.released(done)
        else:
            assert not hold and not done
        self.worker.flush(10)
        self.free.extend(ids)
        return tokens[len(prompt) :]


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def expected_kv(tokens: list[int], count: int) -> list[list[torch.Tensor]]:
    return [expected_position(tokens[p], p) for p in range(count)]


def assert_blocks_hold(engine: Engine, session: str, conversation: list[int], blocks: int) -> None:
    """The first ``blocks`` of the session's blocks in the engine's agent hold each position's K and V of
    ``conversation``."""
    for block_index, block in enumerate(engine.agent.blocks(session)[:blocks]):
        t = engine.cache.as_tensor(block)
        for offset in range(BS):
            p = block_index * BS + offset
            want = expected_position(conversation[p], p)
            got = [t[layer, kv, :, offset] for layer in range(LAYERS) for kv in (0, 1)]
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), f"position {p}"


async def test_a_conversation_saved_on_one_engine_is_loaded_into_another(tmp_path: Path, engines: list[Engine]) -> None:
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "kv_first_nhd", "pod-a", seed=1)
    engines.append(a)
    prompt = list(range(10, 21))  # 11 tokens
    reply = a.turn("r1", "chat-1", prompt, generate=6)
    # the agent holds the session's 16 computed positions (the last generated token has no KV yet): 4 full blocks
    assert a.agent.tokens("chat-1") == len(prompt) + 6 - 1 == 16
    assert len(a.agent.blocks("chat-1")) == 4
    checkpoints = await store.checkpoints("chat-1")
    assert checkpoints, "save_on_finish committed a checkpoint"

    b = Engine(store, layout(), "blocks_first_hnd", "pod-b", seed=2)
    engines.append(b)
    conversation = prompt + reply + [7, 8, 9]  # the next turn: the whole conversation and a new user message
    b.turn("r2", "chat-1", conversation, generate=2)
    assert b.loaded_tokens == 16 and not b.load_errors
    assert_blocks_hold(b, "chat-1", conversation, 4)


class _RestoringEndpoint:
    """What ``SessionPort`` asks of the pod's ``AgentEndpoint`` to restore a session, over the agent alone (the
    checkpoint service's part, the claim, is tested with it in tests/test_kv_vllm.py); each call recorded."""

    def __init__(self, agent: KvAgent) -> None:
        self.agent = agent
        self.calls: list[tuple[str, bool]] = []

    async def restore(self, session_id: str, timeout: float = 10.0, prefetch: bool = False) -> RestoredSession:
        self.calls.append((session_id, prefetch))
        return await self.agent.restore(session_id)


async def test_a_prefetched_session_is_loaded_from_the_workers_copy_without_reading_the_store_again(
    tmp_path: Path, engines: list[Engine]
) -> None:
    """The router's prefetch (``SessionPort.prefetch``, the engine's ``SessionHost``) restores the session into
    engine B's agent before its request; the request's load then takes those blocks (no second restore) and they
    land in the blocks vLLM allocated, position for position. A second prefetch finds it held."""
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "kv_first_nhd", "pod-a", seed=5)
    engines.append(a)
    prompt = list(range(50, 61))
    reply = a.turn("r1", "chat-9", prompt, generate=6)
    b = Engine(store, layout(), "blocks_first_hnd", "pod-b", seed=6)
    engines.append(b)
    port = b.worker.port
    endpoint = _RestoringEndpoint(b.agent)
    port.endpoint = endpoint
    assert b.loop.call(port.prefetch("chat-9"), 10) is True
    assert b.agent.tokens("chat-9") == 16 and port.prefetched == {"chat-9"}
    assert b.loop.call(port.prefetch("chat-9"), 10) is False  # held already
    assert endpoint.calls == [("chat-9", True)]

    conversation = prompt + reply + [4, 5]
    b.turn("r2", "chat-9", conversation, generate=2)
    assert b.loaded_tokens == 16 and not b.load_errors
    assert endpoint.calls == [("chat-9", True)] and port.loaded_from_prefetch == 1 and not port.prefetched
    assert_blocks_hold(b, "chat-9", conversation, 4)


async def test_what_is_loaded_lands_in_the_blocks_vllm_allocated(tmp_path: Path, engines: list[Engine]) -> None:
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "blocks_first_nhd", "pod-a", seed=3)
    engines.append(a)
    prompt = list(range(30, 43))
    reply = a.turn("r1", "chat-2", prompt, generate=4)
    b = Engine(store, layout(), "kv_first_hnd", "pod-b", seed=4)
    engines.append(b)
    conversation = prompt + reply + [1]
    # look at the paged cache right after the load: drive the first step by hand
    external, _ = b.sched.matched("r2", "chat-2", conversation, 0)
    assert external == 16
    ids = [b.free.pop() for _ in range(6)]
    b.sched.allocated("r2", ids, external)
    b.sched.new_request("r2", "chat-2", False, conversation, ids, external, len(conversation) - external)
    plan = b.sched.build()
    assert [load.block_ids for load in plan.loads] == [ids[:4]]
    b.worker.before_forward(plan)
    for p in range(16):
        assert all(
            torch.equal(x, y)
            for x, y in zip(read_position(b.cache, ids, p), expected_position(conversation[p], p), strict=True)
        )


async def test_the_same_engine_loads_from_its_own_copy_and_a_rewritten_conversation_is_cut(
    tmp_path: Path, engines: list[Engine]
) -> None:
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "kv_first_nhd", "pod-a", seed=5)
    engines.append(a)
    prompt = list(range(50, 59))
    reply = a.turn("r1", "chat-3", prompt, generate=4)
    assert a.sched.held["chat-3"] == (prompt + reply)[:12]
    # same conversation: offered from the agent's host copy, not the store
    external, _ = a.sched.matched("r2", "chat-3", prompt + reply + [1, 2], 0)
    assert external == 12 and a.sched.offers["r2"].from_store is False
    a.sched.allocated("r2", [], 0)
    # a rewritten conversation: only the shared prefix is offered, the agent is cut back to its whole blocks
    rewritten = prompt[:6] + [99] * 8
    external, _ = a.sched.matched("r3", "chat-3", rewritten, 0)
    assert external == 4
    a.turn("r3", "chat-3", rewritten, generate=2)
    assert a.loaded_tokens == 4 and not a.load_errors
    blocks = a.agent.blocks("chat-3")
    assert a.agent.tokens("chat-3") == len(rewritten) + 1
    t = a.cache.as_tensor(blocks[1])  # block 1 holds positions 4..7: recomputed for the new tokens
    assert torch.equal(t[0, 0, :, 2], kv_value(rewritten[6], 6, 0, 0))


async def test_requests_without_a_session_are_left_alone(tmp_path: Path, engines: list[Engine]) -> None:
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "kv_first_nhd", "pod-a", seed=6)
    engines.append(a)
    a.turn("r1", None, list(range(9)), generate=3)
    assert a.agent.sessions() == [] and await store.sessions() == []


async def test_a_corrupt_chunk_falls_back_and_reports_the_blocks_it_could_not_load(
    tmp_path: Path, engines: list[Engine]
) -> None:
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "kv_first_nhd", "pod-a", seed=7)
    engines.append(a)
    prompt = list(range(60, 69))
    reply = a.turn("r1", "chat-4", prompt, generate=4)  # 12 positions: 3 blocks, checkpoint 1
    first_packs = {p.name for p in (tmp_path / "store" / "packs").iterdir()}
    turn2 = prompt + reply + [5, 6, 7, 8, 9]
    reply2 = a.turn("r2", "chat-4", turn2, generate=3)  # 18 + 3 - 1 = 20 positions, checkpoint 2
    assert a.agent.tokens("chat-4") == len(turn2) + 2
    newest = [p for p in (tmp_path / "store" / "packs").iterdir() if p.name not in first_packs]
    assert newest
    for pack in newest:  # garble what checkpoint 2 wrote (blocks 3 and 4 of the session)
        data = bytearray(pack.read_bytes())
        data[len(data) // 2] ^= 0xFF
        pack.write_bytes(bytes(data))

    b = Engine(store, layout(), "blocks_first_nhd", "pod-b", seed=8)
    engines.append(b)
    turn3 = turn2 + reply2 + [1]
    external, _ = b.sched.matched("r3", "chat-4", turn3, 0)
    assert external == 20  # the newest checkpoint says 20 positions: 5 whole blocks
    ids = [b.free.pop() for _ in range(8)]
    b.sched.allocated("r3", ids, external)
    b.sched.new_request("r3", "chat-4", False, turn3, ids, external, len(turn3) - external)
    b.worker.before_forward(b.sched.build())
    errors = b.worker.take_load_errors()
    assert errors == {ids[3], ids[4]}, "checkpoint 1 restored instead: its 3 blocks load, blocks 3-4 are reported"
    for p in range(12):
        assert all(
            torch.equal(x, y)
            for x, y in zip(read_position(b.cache, ids, p), expected_position(turn3[p], p), strict=True)
        )
    b.worker.flush(10)
    assert b.agent.tokens("chat-4") == 12 and len(b.agent.blocks("chat-4")) == 3


@pytest.mark.parametrize(
    "changes",
    [{"weights_digest": "x" * 64}, {"dtype": "bfloat16"}, {"block_tokens": 8}, {"tp_rank": 1, "tp_size": 2}],
    ids=["weights", "dtype", "block-size", "tp-rank"],
)
async def test_a_checkpoint_of_another_layout_is_never_offered_nor_restored(
    tmp_path: Path, engines: list[Engine], changes: dict[str, object]
) -> None:
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "kv_first_nhd", "pod-a", seed=9)
    engines.append(a)
    a.turn("r1", "chat-5", list(range(9)), generate=4)
    other = layout(**changes)
    assert await checkpoint_tokens(store, other, "chat-5") == 0
    assert await checkpoint_tokens(store, layout(), "chat-5") == 12
    agent = KvAgent(store, pod="pod-c", node="n1", namespace="llm", deployment="tiny", layout=other)
    with pytest.raises(IncompatibleCheckpoint, match=next(iter(changes))):
        await agent.restore("chat-5")


async def test_ending_a_session_forgets_it(tmp_path: Path, engines: list[Engine]) -> None:
    store = FileStore(str(tmp_path / "store"))
    a = Engine(store, layout(), "kv_first_nhd", "pod-a", seed=10)
    engines.append(a)
    a.turn("r1", "chat-6", list(range(9)), generate=2, end=True)
    assert "chat-6" not in a.agent.sessions() and "chat-6" not in a.sched.held


def test_a_second_request_of_a_running_session_is_not_tracked() -> None:
    book = SchedulerBook(BS, lambda s: 0)
    book.matched("r1", "s", list(range(9)), 0)
    book.allocated("r1", [1, 2, 3], 0)
    book.new_request("r1", "s", False, list(range(9)), [1, 2, 3], 0, 9)
    assert book.matched("r2", "s", list(range(9)), 0) == (0, False)
    book.new_request("r2", "s", False, list(range(9)), [4, 5, 6], 0, 9)
    plan = book.build()
    assert [c.req_id for c in plan.copies] == ["r1"] and plan.claims == [ClaimSpec("s")]
    assert book.finished("r2", [4, 5, 6], 9, list(range(10))) is False


def test_a_rollback_tells_the_worker_the_recomputed_blocks_again() -> None:
    book = SchedulerBook(BS, lambda s: 0)
    book.matched("r1", "s", list(range(12)), 0)
    book.allocated("r1", [7, 8, 9, 10], 0)
    book.new_request("r1", "s", False, list(range(12)), [7, 8, 9, 10], 0, 12)
    assert book.build().copies == [CopySpec("r1", "s", 0, [7, 8, 9])]
    book.cached_request("r1", [7, 11, 12], True, 4, 8)  # preempted, resumed with all its blocks: 4 tokens kept
    assert book.build().copies == [CopySpec("r1", "s", 1, [11, 12])]


def test_the_agent_loop_runs_work_in_order_and_reports_errors() -> None:
    loop = AgentLoop("test-order")
    try:
        seen: list[int] = []

        async def note(i: int) -> int:
            await asyncio.sleep(0.001 * (5 - i))
            seen.append(i)
            return i

        futures = [loop.ordered(lambda i=i: note(i)) for i in range(5)]  # type: ignore[misc]
        assert [f.result(5) for f in futures] == list(range(5)) and seen == list(range(5))

        async def fail() -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            loop.ordered(fail).result(5)
        assert loop.ordered(lambda: note(4)).result(5) == 4  # the loop goes on after an error
    finally:
        loop.close()
