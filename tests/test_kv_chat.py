"""The conversation engine on a real tiny Llama (CPU): turns served, saved through the agent and a file store,
restored on another pod and checked against a reference run; older checkpoints caught up, a wrong cache caught
and recomputed, a preempted session recomputed to the same bits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from shared.kv.agent import KvAgent, RestoredSession
from shared.kv.engines.chat import ChatModel, ChatPod, Conversation, prompt_ids
from shared.kv.filestore import FileStore
from shared.kv.manifest import tokens_digest_of

SHAPE = {
    "layers": 2,
    "kv_heads": 2,
    "attention_heads": 4,
    "head_dim": 8,
    "vocab_size": 128,
    "max_model_len": 512,
    "dtype": "float32",
    "seed": 3,
}


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def chat() -> ChatModel:
    return ChatModel.tiny(model_id="test/tiny", model_version="7", block_tokens=8, **SHAPE)


def pod(model: ChatModel, store: FileStore, name: str) -> ChatPod:
    agent = KvAgent(store, pod=name, node="n", namespace="llm", deployment="llama", layout=model.layout)
    return model.for_pod(agent)


async def serve(p: ChatPod, sid: str, turns: list[tuple[int, int]]) -> None:
    for prompt, new in turns:
        if sid not in p.agent.sessions():
            p.agent.register_session(sid)
            await p.start(sid)
        assert p.tokens_after(sid, prompt, new) == p.agent.tokens(sid) + max(
            prompt + (p.chat.conversations.get(sid, Conversation()).pending is not None), 1
        ) + max(new - 1, 0)
        await p.serve(sid, prompt, new)


def uninterrupted(store: Path) -> ChatPod:
    """The reference: one pod of another model instance (same seed) that is never saved nor moved."""
    return pod(chat(), FileStore(store), "ref")


async def restore(p: ChatPod, sid: str) -> RestoredSession:
    return await p.agent.restore(sid)


def same_cache(a: ChatPod, b: ChatPod, sid: str) -> bool:
    mine, theirs = a.chat.engine.layers_of(a.caches[sid]), b.chat.engine.layers_of(b.caches[sid])
    return len(mine) == len(theirs) and all(
        torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(mine, theirs, strict=True)
    )


def test_the_layout_names_the_model_and_its_weights() -> None:
    layout = chat().layout
    assert (layout.model_id, layout.model_version, layout.dtype) == ("test/tiny", "7", "float32")
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.block_tokens) == (2, 2, 8, 8)
    assert layout.weights_digest == chat().layout.weights_digest  # the seed makes the weights
    other = ChatModel.tiny(model_id="test/tiny", model_version="7", block_tokens=8, **{**SHAPE, "seed": 4})
    assert other.layout.weights_digest != layout.weights_digest


def test_prompts_are_the_same_everywhere_and_differ_by_turn() -> None:
    assert prompt_ids("s", 0, 5, 128) == prompt_ids("s", 0, 5, 128)
    assert prompt_ids("s", 0, 5, 128) != prompt_ids("s", 1, 5, 128) != prompt_ids("t", 1, 5, 128)
    assert all(2 <= t < 128 for t in prompt_ids("s", 3, 200, 128))


async def test_a_session_restored_on_another_pod_goes_on_as_if_never_moved(tmp_path: Path) -> None:
    turns = [(13, 6), (5, 4), (0, 7), (9, 0), (4, 5)]
    model = chat()
    store = FileStore(tmp_path / "store")
    a, b = pod(model, store, "pod-a"), pod(model, store, "pod-b")
    await serve(a, "s", turns[:3])
    assert a.agent.tokens("s") == model.conversations["s"].tokens == (13 + 6 - 1) + (1 + 5 + 3) + (1 + 6)
    assert not (await a.agent.save(reason="drain")).failed
    a.release("s")
    a.agent.forget_session("s")

    b.agent.register_session("s")
    check = await b.adopt("s", await restore(b, "s"))
    assert check.verified is True, check.detail
    await serve(b, "s", turns[3:])

    ref = uninterrupted(tmp_path / "unused")
    await serve(ref, "s", turns)
    assert ref.chat.conversations["s"] == model.conversations["s"]  # the same replies, token for token
    assert same_cache(b, ref, "s")  # and the same cache, bit for bit
    assert (await b.check("s")).verified is True


async def test_an_older_checkpoint_is_caught_up_from_the_conversation(tmp_path: Path) -> None:
    model = chat()
    store = FileStore(tmp_path / "store")
    a, b = pod(model, store, "pod-a"), pod(model, store, "pod-b")
    await serve(a, "s", [(10, 5)])
    await a.agent.save(reason="periodic")
    saved = a.agent.tokens("s")
    await serve(a, "s", [(6, 6), (3, 2)])  # then the pod dies: these two turns were never checkpointed
    b.agent.register_session("s")
    restored = await restore(b, "s")
    assert restored.manifest.token_count == saved
    check = await b.adopt("s", restored)
    assert check.verified is True, check.detail  # the checkpointed prefix equals the reference
    assert b.agent.tokens("s") == a.agent.tokens("s") and same_cache(a, b, "s")


async def test_a_wrong_cache_is_caught_named_and_recomputed(tmp_path: Path) -> None:
    model = chat()
    store = FileStore(tmp_path / "store")
    a, b = pod(model, store, "pod-a"), pod(model, store, "pod-b")
    await serve(a, "s", [(20, 4)])
    await a.agent.save()
    b.agent.register_session("s")
    restored = await restore(b, "s")
    blocks = [np.array(x, copy=True) for x in restored.blocks]
    as_floats = blocks[1].view(np.float32).reshape(b.chat.engine.block_shape)
    as_floats[1, 0, 0, 2, 0] += 0.5  # layer 1, K, head 0, position 8 + 2 = 10
    tampered = msgspec.structs.replace(restored.manifest)  # the manifest is unchanged
    check = await b.adopt("s", RestoredSession(tampered, blocks))
    assert check.verified is False
    assert check.detail == "layer 1 K differs from the reference at position 10"
    assert same_cache(a, b, "s")  # recomputed from the conversation, not served on from the wrong bytes
    assert all(
        np.array_equal(np.asarray(x).view(np.uint8).reshape(-1), np.asarray(y).view(np.uint8).reshape(-1))
        for x, y in zip(
            [t.cpu().numpy() if isinstance(t, torch.Tensor) else t for t in b.agent.blocks("s")],
            [t.cpu().numpy() if isinstance(t, torch.Tensor) else t for t in a.agent.blocks("s")],
            strict=True,
        )
    )


async def test_a_preempted_session_is_recomputed_to_the_same_bits(tmp_path: Path) -> None:
    model = chat()
    a = pod(model, FileStore(tmp_path / "store"), "pod-a")
    await serve(a, "s", [(17, 9), (4, 4)])
    before = [t.clone() for t in a.agent.blocks("s")]
    tokens = a.agent.tokens("s")
    a.release("s")
    a.agent.forget_session("s")
    a.agent.register_session("s", generation=2)
    await a.recompute("s", tokens)
    assert a.agent.tokens("s") == tokens and a.agent.generation("s") == 2
    after = a.agent.blocks("s")
    assert len(after) == len(before) and all(torch.equal(x, y) for x, y in zip(after, before, strict=True))
    with pytest.raises(ValueError, match="cannot recompute 5 positions"):
        await a.recompute("s", 5)


async def test_a_conversation_never_seen_begin_is_served_on_unchecked(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    first = chat()
    a = pod(first, store, "pod-a")
    await serve(a, "s", [(12, 3)])
    await a.agent.save()
    stranger = pod(chat(), store, "pod-b")  # another process: it never saw the conversation start
    stranger.agent.register_session("s")
    check = await stranger.adopt("s", await restore(stranger, "s"))
    assert check.verified is None and "first 14 positions are not known here" in check.detail
    await stranger.serve("s", 4, 2)
    assert stranger.agent.tokens("s") == 14 + 4 + 1
    with pytest.raises(ValueError, match="cannot recompute"):
        await stranger.recompute("s", stranger.agent.tokens("s"))


async def test_checkpoints_say_whose_tokens_they_hold_and_another_conversation_is_refused_by_that(
    tmp_path: Path,
) -> None:
    model = chat()
    store = FileStore(tmp_path / "store")
    a, b = pod(model, store, "pod-a"), pod(model, store, "pod-b")
    await serve(a, "s", [(12, 4), (3, 3)])
    await a.agent.save()
    talk = model.conversations["s"]
    (cid,) = await store.checkpoints("s")
    manifest = await store.manifest("s", cid)
    assert manifest.tokens_digest == tokens_digest_of(talk.token_ids()) and manifest.token_count == talk.tokens

    talk.chunks[0][0] = (talk.chunks[0][0] + 1) % 128 or 2  # the client's conversation is not the one saved
    b.agent.register_session("s")
    check = await b.adopt("s", await restore(b, "s"))
    assert check.verified is False
    assert check.detail == f"the checkpoint holds the KV of other tokens than the conversation's first {talk.tokens}"
    assert b.agent.tokens("s") == talk.tokens  # recomputed from the conversation as the client has it
    assert b.agent.session_tokens_digest("s") == tokens_digest_of(talk.token_ids())
