"""Hugging Face transformers for real on the CPU: a tiny Llama's DynamicCache saved mid-conversation through the agent
and a file store, restored in another process, and decoding goes on exactly as if nothing had happened.

Exact equality holds because the restored K/V tensors are the very bytes, and the next forward runs the same CPU
kernels on the same shapes; both processes use one thread so that no reduction is split differently.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import DynamicCache, PreTrainedTokenizerFast

from shared.kv.agent import KvAgent
from shared.kv.engines import restore_cache
from shared.kv.engines.huggingface import RestoredLayer, TransformersEngine, weights_digest
from shared.kv.filestore import FileStore
from shared.kv.manifest import (
    IncompatibleCheckpoint,
    KvLayout,
    ManifestInvalid,
    check_compatible,
    decode_manifest,
    encode_manifest,
    manifest_digest,
    verify_manifest,
)
from tests.kv_transformers_worker import BLOCK_TOKENS, greedy, tiny_llama

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def same(these: list, those: list) -> bool:
    """The very same objects: nothing copied."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those, strict=True))


def make_agent(store: FileStore, layout: KvLayout, pod: str = "llama-0") -> KvAgent:
    return KvAgent(store, pod=pod, node="node-1", namespace="llm", deployment="llama", layout=layout)


async def test_a_conversation_saved_mid_way_goes_on_in_another_process_exactly(tmp_path: Path) -> None:
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS)
    prompt, reply = tokens(1, 13), tokens(2, 5)

    cache = engine.new_cache()  # the uninterrupted run: two turns on one cache
    first, _ = greedy(engine.model, prompt, cache, 7)
    turn2 = torch.cat([first, reply], dim=1)
    expected, expected_logits = greedy(engine.model, turn2, cache, 9)

    cache = engine.new_cache()  # the interrupted one: turn 1 here, saved, turn 2 on another pod
    again, _ = greedy(engine.model, prompt, cache, 7)
    assert torch.equal(again, first)
    store = FileStore(tmp_path / "store")
    agent = make_agent(store, engine.layout)
    agent.register_session("s-1")
    engine.track(agent, "s-1", cache)
    assert agent.tokens("s-1") == 19  # 13 + 7 generated, less the last one (its KV comes with the next forward)
    report = await agent.save(reason="drain")
    assert not report.failed and report.bytes_total == 3 * engine.layout.block_bytes

    out = tmp_path / "turn2.pt"
    ids = ",".join(str(t) for t in turn2[0].tolist())
    result = subprocess.run(
        [sys.executable, "-m", "tests.kv_transformers_worker", str(store.root), "s-1", ids, "9", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restored 19" in result.stdout
    resumed = torch.load(out, weights_only=True)
    assert torch.equal(resumed["sequences"], expected)
    assert torch.equal(resumed["logits"], expected_logits)  # bit for bit, not merely close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
async def test_full_blocks_are_copied_once_and_the_tail_again_as_it_grows(tmp_path: Path, dtype: torch.dtype) -> None:
    engine = TransformersEngine(tiny_llama(dtype=dtype), block_tokens=BLOCK_TOKENS)
    cache = engine.new_cache()
    ids, _ = greedy(engine.model, tokens(3, 12), cache, 5)  # 16 positions cached: two full blocks
    agent = make_agent(FileStore(tmp_path / "store"), engine.layout)
    agent.register_session("s")
    engine.track(agent, "s", cache)
    full = agent.blocks("s")
    assert len(full) == 2 and all(b.is_contiguous() and b.dtype == dtype for b in full)
    assert (await agent.save()).bytes_written == 2 * engine.layout.block_bytes

    ids, _ = greedy(engine.model, ids, cache, 3)  # 19 positions: a partial tail of 3
    engine.track(agent, "s", cache)
    engine.track(agent, "s", cache)  # idempotent
    held = agent.blocks("s")
    assert same(held[:2], full) and agent.tokens("s") == 19  # full blocks never copied again
    second = await agent.save()
    assert second.bytes_written == engine.layout.block_bytes  # only the new tail block is written

    greedy(engine.model, ids, cache, 2)  # 21 positions: the same tail block grew
    engine.track(agent, "s", cache)
    assert same(agent.blocks("s")[:2], full) and agent.blocks("s")[2] is not held[2]
    assert (await agent.save()).bytes_written == engine.layout.block_bytes

    other = TransformersEngine(tiny_llama(dtype=dtype), block_tokens=BLOCK_TOKENS)
    rebuilt, restored = await restore_cache(make_agent(agent.store, other.layout, "llama-1"), other, "s")
    assert restored.manifest.token_count == 21 and rebuilt.get_seq_length() == 21
    for mine, theirs in zip(cache.layers, rebuilt.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


async def test_a_static_cache_session_resumes_exactly_in_another_engine(tmp_path: Path) -> None:
    """A ``StaticCache`` (preallocated, as for torch.compile) is tracked from its filled positions only and restored
    into a static cache of the same size; decoding goes on bit for bit."""
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS, max_cache_len=64)
    prompt, reply = tokens(6, 11), tokens(7, 4)
    cache = engine.new_cache()
    first, _ = greedy(engine.model, prompt, cache, 6)
    turn2 = torch.cat([first, reply], dim=1)
    expected, expected_logits = greedy(engine.model, turn2, cache, 8)

    cache = engine.new_cache()
    greedy(engine.model, prompt, cache, 6)
    agent = make_agent(FileStore(tmp_path / "store"), engine.layout)
    agent.register_session("s")
    engine.track(agent, "s", cache)
    assert agent.tokens("s") == 16 and len(agent.blocks("s")) == 2  # 64 allocated, 16 filled
    assert (await agent.save()).bytes_written == 2 * engine.layout.block_bytes

    other = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS, max_cache_len=64)
    rebuilt, _ = await restore_cache(make_agent(agent.store, other.layout, "llama-1"), other, "s")
    assert type(rebuilt).__name__ == "StaticCache" and int(rebuilt.get_seq_length()) == 16
    resumed, logits = greedy(other.model, turn2, rebuilt, 8)
    assert torch.equal(resumed, expected) and torch.equal(logits, expected_logits)

    small = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS, max_cache_len=12)
    with pytest.raises(ValueError, match="16 positions do not fit in this engine's static cache of 12"):
        await restore_cache(make_agent(agent.store, small.layout, "llama-2"), small, "s")


def test_the_layout_is_read_from_the_model() -> None:
    model = tiny_llama()
    layout = TransformersEngine(model, block_tokens=BLOCK_TOKENS).layout
    config = model.config
    assert (layout.layers, layout.kv_heads, layout.head_dim) == (2, 2, config.hidden_size // 4)
    assert (layout.dtype, layout.model_id, layout.tp_rank, layout.tp_size) == ("float32", "llama", 0, 1)
    assert layout.weights_digest == weights_digest(tiny_llama())  # the same seed builds the same weights
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    assert weights_digest(model) != layout.weights_digest


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, "a")))


@pytest.mark.parametrize(
    ("changed", "field"),
    [
        ({"model": lambda: tiny_llama(seed=1)}, "weights_digest"),
        ({"model": lambda: tiny_llama(dtype=torch.bfloat16)}, "dtype"),
        ({"block_tokens": 4}, "block_tokens"),
        ({"tp_rank": 1}, "tp_rank"),
        ({"tokenizer": word_tokenizer(["a", "b", "c"])}, "tokenizer_id"),
    ],
)
async def test_a_restore_into_other_weights_dtype_or_layout_is_refused_by_name(
    tmp_path: Path, changed: dict, field: str
) -> None:
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS, tokenizer=word_tokenizer(["a", "b"]))
    cache = engine.new_cache()
    greedy(engine.model, tokens(4, 10), cache, 3)
    agent = make_agent(FileStore(tmp_path / "store"), engine.layout)
    agent.register_session("s")
    engine.track(agent, "s", cache)
    assert not (await agent.save()).failed

    kwargs = {"block_tokens": BLOCK_TOKENS, "tokenizer": word_tokenizer(["a", "b"])}
    kwargs.update({k: v for k, v in changed.items() if k != "model"})
    model = changed["model"]() if "model" in changed else tiny_llama()
    other = TransformersEngine(model, **kwargs)
    with pytest.raises(IncompatibleCheckpoint, match=f"{field}: checkpoint has"):
        await restore_cache(make_agent(agent.store, other.layout, "llama-1"), other, "s")


def test_a_cache_that_shrank_is_refused(tmp_path: Path) -> None:
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS)
    cache = engine.new_cache()
    greedy(engine.model, tokens(5, 10), cache, 3)
    agent = make_agent(FileStore(tmp_path / "store"), engine.layout)
    agent.register_session("s")
    engine.track(agent, "s", cache)
    cache.crop(-4)  # 12 positions less 4, as assisted decoding does when drafts are rejected
    with pytest.raises(ValueError, match="the cache holds 8 positions, the agent 12"):
        engine.track(agent, "s", cache)


OLD_MANIFEST = (  # committed before KvLayout had weights_digest, tp_rank and tp_size
    b'{"checkpoint_id":"g0000000001-s0000000001-0123456789ab","session_id":"s","namespace":"llm","deployment":'
    b'"llama","pod":"p","node":"n","layout":{"model_id":"llama","model_version":"1","tokenizer_id":"t","dtype":'
    b'"float16","block_tokens":16,"layers":2,"kv_heads":2,"head_dim":64},"token_count":20,"blocks":[["ddddddddd'
    b'ddddddddddddddddddddddd",16384,"pk",0,16384,""],["dddddddddddddddddddddddddddddddd",16384,"pk",0,16384,""]'
    b'],"created_at":"2025-01-02T03:04:05Z","digest_algorithm":"xxh3-128","parent_id":"","key_id":"","bytes_wr'
    b'itten":0,"reason":"","generation":1,"sequence":1,"manifest_digest":"33d8bf7a7c95c36962599615b067d43f832561'
    b'ce59aa480aacbb58ecc863070c"}'
)


def test_an_older_manifest_still_decodes_verifies_and_means_one_unsharded_rank() -> None:
    manifest = decode_manifest(OLD_MANIFEST)
    verify_manifest(manifest, "s", manifest.checkpoint_id)  # its digest still covers what it re-encodes to
    assert encode_manifest(manifest) == OLD_MANIFEST
    assert manifest.tokens_digest == "" and b"tokens_digest" not in encode_manifest(manifest)
    said = msgspec.structs.replace(manifest, tokens_digest="ab" * 32)
    said = msgspec.structs.replace(said, manifest_digest=manifest_digest(said))
    verify_manifest(decode_manifest(encode_manifest(said)), "s", said.checkpoint_id)  # carried, and covered
    with pytest.raises(ManifestInvalid, match="does not match its content"):
        verify_manifest(msgspec.structs.replace(said, tokens_digest="cd" * 32), "s", said.checkpoint_id)
    assert (manifest.layout.weights_digest, manifest.layout.tp_rank, manifest.layout.tp_size) == ("", 0, 1)
    sharded = msgspec.structs.replace(manifest.layout, tp_rank=1, tp_size=2)
    with pytest.raises(IncompatibleCheckpoint, match="tp_rank: checkpoint has 0, this pod has 1; tp_size"):
        check_compatible(manifest, sharded)


def reference_block(cache: DynamicCache, engine: TransformersEngine, start: int, end: int) -> torch.Tensor:
    """Positions ``start:end`` of the cache as a block, position by position (zeros past ``end``)."""
    block = torch.zeros(engine.block_shape, dtype=engine.dtype)
    for i, layer in enumerate(cache.layers):
        for p in range(start, end):
            block[i, 0, :, p - start] = layer.keys[0, :, p]
            block[i, 1, :, p - start] = layer.values[0, :, p]
    return block


def test_one_track_copies_many_blocks_in_bulk_exactly_as_the_cache_holds_them(tmp_path: Path) -> None:
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS)
    cache = engine.new_cache()
    with torch.no_grad():
        engine.model(tokens(8, 45), cache=cache, use_cache=True)  # 5 full blocks of 8 and a tail of 5
    agent = make_agent(FileStore(tmp_path / "store"), engine.layout)
    agent.register_session("s")
    engine.track(agent, "s", cache)
    blocks = agent.blocks("s")
    assert len(blocks) == 6 and agent.tokens("s") == 45
    for index, block in enumerate(blocks):
        start = index * BLOCK_TOKENS
        assert torch.equal(block, reference_block(cache, engine, start, min(start + BLOCK_TOKENS, 45))), index
    full = {b.untyped_storage().data_ptr() for b in blocks[:5]}
    assert len(full) == 1 and blocks[5].untyped_storage().data_ptr() not in full  # one tensor; the tail its own
    with pytest.raises(ValueError, match="blocks start on a multiple of 8"):
        engine.blocks_of(engine.layers_of(cache), 3, 20)


@pytest.mark.parametrize("static", [False, True])
async def test_a_rebuild_from_one_tensor_or_from_separate_blocks_is_the_same_cache(
    tmp_path: Path, static: bool
) -> None:
    """``restore_cache`` reads into the engine's ``restore_targets`` (consecutive views of one tensor, one copy to
    rebuild); blocks restored one array each (as ``AgentEndpoint.restore`` returns them) rebuild the same."""
    kind = {"max_cache_len": 64} if static else {}
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS, **kind)  # type: ignore[arg-type]
    cache = engine.new_cache()
    greedy(engine.model, tokens(9, 30), cache, 6)  # 35 positions: a partial last block
    agent = make_agent(FileStore(tmp_path / "store"), engine.layout)
    agent.register_session("s")
    engine.track(agent, "s", cache)
    assert not (await agent.save()).failed

    other = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS, **kind)  # type: ignore[arg-type]
    step = torch.tensor([[7]])
    with torch.no_grad():
        want = engine.model(step, cache=copy.deepcopy(cache)).logits
    if not static:  # a dynamic cache's positions are gathered by its first forward, into the tensor it makes anyway
        lazy, _ = await restore_cache(make_agent(agent.store, other.layout, "llama-3"), other, "s")
        assert all(type(layer) is RestoredLayer for layer in lazy.layers) and lazy.get_seq_length() == 35
        with torch.no_grad():
            assert torch.equal(other.model(step, cache=lazy).logits, want)
        assert type(lazy.layers[0]) is RestoredLayer and lazy.get_seq_length() == 36
        (k, v), (rk, rv) = engine.layers_of(cache)[0], other.layers_of(lazy)[0]
        assert torch.equal(rk[:, :, :35], k) and torch.equal(rv[:, :, :35], v) and rk.is_contiguous()
    joined, restored = await restore_cache(make_agent(agent.store, other.layout, "llama-1"), other, "s")
    first = restored.blocks[0]
    assert isinstance(first, torch.Tensor) and all(
        b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for b in restored.blocks
    )  # read straight into the engine's blocks
    separate = await make_agent(agent.store, other.layout, "llama-2").restore("s")
    assert all(isinstance(b, np.ndarray) for b in separate.blocks)
    apart = other.rebuild(separate.blocks, 35)
    for rebuilt in (joined, apart):
        assert int(rebuilt.get_seq_length()) == 35 and type(rebuilt) is type(cache)
        for mine, theirs in zip(engine.layers_of(cache), other.layers_of(rebuilt), strict=True):
            assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    with torch.no_grad():
        assert torch.equal(other.model(step, cache=joined).logits, want)
        assert torch.equal(other.model(step, cache=apart).logits, want)


async def test_a_corrupt_newest_checkpoint_falls_back_when_restored_into_the_engines_blocks(tmp_path: Path) -> None:
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS)
    cache = engine.new_cache()
    ids, _ = greedy(engine.model, tokens(10, 12), cache, 5)  # 16 positions
    store = FileStore(tmp_path / "store")
    agent = make_agent(store, engine.layout)
    agent.register_session("s")
    engine.track(agent, "s", cache)
    older = (await agent.save()).committed[0]
    kept = [(k.clone(), v.clone()) for k, v in engine.layers_of(cache)]
    greedy(engine.model, ids, cache, 4)  # 20 positions: a new tail block, in a new pack
    engine.track(agent, "s", cache)
    newest = (await agent.save()).committed[0]
    pack = store.packs_dir / f"{newest.blocks[-1].pack}.pack"
    data = bytearray(pack.read_bytes())
    data[newest.blocks[-1].offset] ^= 0xFF
    pack.write_bytes(bytes(data))

    other = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS)
    rebuilt, restored = await restore_cache(make_agent(store, other.layout, "llama-1"), other, "s")
    assert restored.manifest.checkpoint_id == older.checkpoint_id and int(rebuilt.get_seq_length()) == 16
    assert len(restored.fell_back_from) == 1 and newest.checkpoint_id in restored.fell_back_from[0]
    for (k, v), (rk, rv) in zip(kept, other.layers_of(rebuilt), strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
