"""A real engine serving conversations: a transformers causal LM that prefills each turn's prompt and decodes
greedily, one cache per session, tracked into the pod's KV agent (``TransformersEngine``).

Each conversation's tokens are kept as its requests carried them (the prompts, and the replies the model
generated), the way a chat client keeps its messages and sends them again: precisely, the input of every forward
pass, in order. With them:

- a session whose KV a pod dropped (preempted) is recomputed by the same forward passes, so its blocks come out
  the same bits;
- a restored checkpoint older than the conversation (a pod that died between checkpoints) is caught up by the
  passes it lacks;
- a restored cache is checked against a reference run: the conversation recomputed from its tokens on a fresh
  cache, compared position by position, then both continued by the same tokens: the same greedy tokens and
  bit-identical logits, or the check fails and says where.

Bit-identical holds because a replay runs the very same forward passes (same inputs, same cache lengths, same
kernels) and the model uses one intra-op thread (set when a ``ChatModel`` is made; the setting is the process's).
Prompt tokens are drawn from the session id and turn number, so every process draws the same conversation.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache

from shared.kv.agent import KvAgent, RestoredSession
from shared.kv.engines import SessionCheck as Check
from shared.kv.engines import blocks_for, prompt_ids
from shared.kv.engines.huggingface import TransformersEngine
from shared.kv.manifest import KvLayout, tokens_digest_of

BOS = 1
"""The first input of a conversation that starts with neither a prompt nor a pending reply token."""
PROBE_TOKENS = 4
"""Greedy steps both copies take when a check continues a session beside its reference."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

T = TypeVar("T")


@dataclass
class Conversation:
    """A session's tokens: ``chunks`` holds the input ids of every forward pass since position ``base`` (0: the
    whole conversation is known here); ``pending`` the newest generated token, part of the reply but not yet in the
    cache (it is the next pass's first input)."""

    base: int = 0
    chunks: list[list[int]] = field(default_factory=list)
    pending: int | None = None
    turns: int = 0

    @property
    def tokens(self) -> int:
        """Positions the session's cache holds once every pass so far has run."""
        return self.base + sum(len(c) for c in self.chunks)

    def token_ids(self, passes: int | None = None) -> list[int]:
        """The input ids of the first ``passes`` passes (all by default), in order: the tokens the cache holds."""
        return [t for chunk in self.chunks[:passes] for t in chunk]

    def boundary_below(self, tokens: int) -> tuple[int, int]:
        """The last pass that ends at or before position ``tokens``: ``(passes, positions)``, the number of passes
        up to it and where it ends (``(0, base)`` when even the first pass goes past)."""
        at, passes = self.base, 0
        for count, chunk in enumerate(self.chunks, start=1):
            if at + len(chunk) > tokens:
                break
            at += len(chunk)
            passes = count
        return passes, at

    def boundary(self, tokens: int) -> int | None:
        """How many of the passes make up exactly ``tokens`` positions (None: no pass ends there)."""
        at = self.base
        if at == tokens:
            return 0
        for count, chunk in enumerate(self.chunks, start=1):
            at += len(chunk)
            if at == tokens:
                return count
            if at > tokens:
                break
        return None


def tiny_llama(
    *,
    layers: int,
    kv_heads: int,
    attention_heads: int,
    head_dim: int,
    vocab_size: int,
    max_model_len: int,
    dtype: str,
    seed: int,
) -> LlamaForCausalLM:
    """A Llama of the given shape with random weights from ``seed``: a real model with no download, the same
    weights in every process."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: a transformers engine here runs {', '.join(DTYPES)}")
    if attention_heads % kv_heads:
        raise ValueError(f"attention_heads ({attention_heads}) must be a multiple of kv_heads ({kv_heads})")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=attention_heads * head_dim,
        intermediate_size=2 * attention_heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_model_len,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    torch.nn.Module.to(model, DTYPES[dtype])  # (transformers' typed wrapper of ``to`` confuses mypy)
    return model.eval()


class ChatModel:
    """One deployment's model and its conversations, shared by the deployment's pods (``for_pod``)."""

    def __init__(self, engine: TransformersEngine) -> None:
        torch.set_num_threads(1)  # every pass computes the same bits as its replay, whatever runs beside it
        self.engine = engine
        self.vocab_size = int(engine.model.config.vocab_size)
        self.conversations: dict[str, Conversation] = {}

    @classmethod
    def tiny(cls, *, model_id: str, model_version: str, block_tokens: int, **shape: Any) -> ChatModel:
        """A ``tiny_llama`` of ``shape`` published as ``model_id`` at ``model_version`` (as a model loaded from a
        hub carries its name and revision)."""
        model = tiny_llama(**shape)
        model.name_or_path = model.config.name_or_path = model_id
        model.config._commit_hash = model_version
        return cls(TransformersEngine(model, block_tokens=block_tokens))

    @property
    def layout(self) -> KvLayout:
        return self.engine.layout

    def for_pod(self, agent: KvAgent) -> ChatPod:
        return ChatPod(self, agent)

    def end(self, session_id: str) -> None:
        self.conversations.pop(session_id, None)

    def tracked(self) -> int:
        return len(self.conversations)

    # -- forward passes (run in a worker thread; nothing here touches an agent) -------------------------------------
    def forward(self, cache: Cache, ids: list[int]) -> torch.Tensor:
        """One pass over ``ids``; the logits after the last of them, as float32."""
        with torch.no_grad():
            out = self.engine.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        return out.logits[0, -1].float()

    def replay(self, chunks: list[list[int]], cache: Cache | None = None) -> Cache:
        cache = self.engine.new_cache() if cache is None else cache
        for chunk in chunks:
            self.forward(cache, chunk)
        return cache

    def turn(self, cache: Cache, talk: Conversation, session_id: str, prompt_tokens: int, new_tokens: int) -> list[int]:
        """Serve a turn on ``cache`` and add its passes to ``talk``: the prompt (after the pending token of the
        last reply) in one pass, then one pass per generated token but the last. Returns the reply's tokens."""
        first = [talk.pending] if talk.pending is not None else []
        first += prompt_ids(session_id, talk.turns, prompt_tokens, self.vocab_size)
        chunks = [first or [BOS]]
        logits = self.forward(cache, chunks[0])
        reply: list[int] = []
        for step in range(new_tokens):
            reply.append(int(torch.argmax(logits)))
            if step < new_tokens - 1:
                chunks.append([reply[-1]])
                logits = self.forward(cache, chunks[-1])
        talk.chunks.extend(chunks)
        talk.pending = reply[-1] if reply else None
        talk.turns += 1
        return reply

    def continue_greedy(self, cache: Cache, first: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """``first`` then ``steps`` greedy passes: the tokens chosen and every pass's logits."""
        logits = [self.forward(cache, first)]
        tokens: list[int] = []
        for _ in range(steps):
            tokens.append(int(torch.argmax(logits[-1])))
            logits.append(self.forward(cache, [tokens[-1]]))
        return tokens, torch.stack(logits)

    def compare(self, cache: Cache, talk: Conversation, passes: int, session_id: str) -> Check:
        """``cache`` against the reference: the conversation's first ``passes`` passes on a fresh cache, compared
        position by position, then both continued alike (by the conversation's next pass when there is one, else
        by the pending token and a probe prompt) for ``PROBE_TOKENS`` greedy steps."""
        if talk.base:
            return Check(None, f"the conversation's first {talk.base} positions are not known here")
        reference = self.replay(talk.chunks[:passes])
        mine, theirs = self.engine.layers_of(cache), self.engine.layers_of(reference)
        if len(mine) != len(theirs) or (mine and mine[0][0].shape != theirs[0][0].shape):
            return Check(False, f"the cache holds {self.engine.length(cache)} positions, the reference {passes} passes")
        for index, ((k, v), (rk, rv)) in enumerate(zip(mine, theirs, strict=True)):
            for name, a, b in (("K", k, rk), ("V", v, rv)):
                if not torch.equal(a, b):
                    differs = (a != b).flatten(start_dim=0, end_dim=1).any(dim=0).any(dim=-1)
                    position = int(torch.nonzero(differs)[0])
                    return Check(False, f"layer {index} {name} differs from the reference at position {position}")
        if passes < len(talk.chunks):
            probe = talk.chunks[passes]
        else:
            probe = [talk.pending] if talk.pending is not None else []
            probe += prompt_ids(session_id, -1, 3, self.vocab_size)
        got = self.continue_greedy(copy.deepcopy(cache), probe, PROBE_TOKENS)
        want = self.continue_greedy(reference, probe, PROBE_TOKENS)
        if got[0] != want[0]:
            return Check(False, f"continued, it chose {got[0]}; the reference run chose {want[0]}")
        if not torch.equal(got[1], want[1]):
            return Check(False, "continued, its logits differ from the reference run's")
        return Check(True)


class ChatPod:
    """One pod's sessions on a ``ChatModel``: a cache each, tracked into the pod's agent after every change."""

    def __init__(self, chat: ChatModel, agent: KvAgent) -> None:
        self.chat = chat
        self.agent = agent
        self.caches: dict[str, Cache] = {}

    @property
    def layout(self) -> KvLayout:
        return self.chat.layout

    async def _compute(self, work: Callable[[], T]) -> T:
        return await asyncio.to_thread(work)

    def _track(self, session_id: str, cache: Cache) -> None:
        """The agent's blocks follow the cache, and its token count carries the digest of the conversation's tokens
        (so its checkpoints say whose KV they hold)."""
        self.caches[session_id] = cache
        self.chat.engine.track(self.agent, session_id, cache)
        talk = self.chat.conversations.get(session_id)
        if talk is not None and not talk.base and talk.tokens == self.agent.tokens(session_id):
            self.agent.set_tokens(session_id, talk.tokens, tokens_digest_of(talk.token_ids()))

    def _reset(self, session_id: str) -> None:
        """The agent forgets the session's blocks (not the session): a recompute replaces all of them."""
        generation, layout = self.agent.generation(session_id), self.agent.session_layout(session_id)
        self.agent.forget_session(session_id)
        self.agent.register_session(session_id, generation=generation, layout=layout)

    def tokens_after(self, session_id: str, prompt_tokens: int, new_tokens: int) -> int:
        talk = self.chat.conversations.get(session_id) or Conversation()
        first = (talk.pending is not None) + prompt_tokens
        return self.agent.tokens(session_id) + max(first, 1) + max(new_tokens - 1, 0)

    async def start(self, session_id: str) -> bool:
        talk = self.chat.conversations.get(session_id)
        if talk is None or talk.base or not talk.chunks:
            self.chat.conversations[session_id] = Conversation()
            self.caches[session_id] = self.chat.engine.new_cache()
            return False
        cache = await self._compute(lambda: self.chat.replay(talk.chunks))
        self._track(session_id, cache)
        return True

    async def serve(self, session_id: str, prompt_tokens: int, new_tokens: int) -> None:
        talk = self.chat.conversations.setdefault(session_id, Conversation())
        cache = self.caches.get(session_id)
        if cache is None:
            cache = self.chat.engine.new_cache()
        if self.chat.engine.length(cache) != self.agent.tokens(session_id):
            raise RuntimeError(
                f"session {session_id!r}: the engine's cache holds {self.chat.engine.length(cache)} positions, "
                f"the agent {self.agent.tokens(session_id)}"
            )
        await self._compute(lambda: self.chat.turn(cache, talk, session_id, prompt_tokens, new_tokens))
        self._track(session_id, cache)

    async def recompute(self, session_id: str, tokens: int) -> None:
        talk = self.chat.conversations.get(session_id)
        if talk is None or talk.base or talk.tokens != tokens:
            known = "nothing" if talk is None else f"{talk.tokens} positions from {talk.base}"
            raise ValueError(f"session {session_id!r}: cannot recompute {tokens} positions, its tokens give {known}")
        cache = await self._compute(lambda: self.chat.replay(talk.chunks))
        self._reset(session_id)
        self._track(session_id, cache)

    async def adopt(self, session_id: str, restored: RestoredSession) -> Check:
        count = restored.tokens
        talk = self.chat.conversations.get(session_id)
        if talk is None:  # a conversation this process never saw begin: serve it on, nothing to compare with
            talk = self.chat.conversations[session_id] = Conversation(base=count)
        passes = talk.boundary(count)
        blocks = restored.blocks
        if passes is None and not talk.base and count <= talk.tokens:
            # a journal entry ends at a block, inside a pass (a prompt): keep the KV up to the pass before it and
            # run the rest again whole, so every position comes out of the very passes the reference ran
            passes, count = talk.boundary_below(count)
            blocks = blocks[: blocks_for(count, self.layout.block_tokens)]
            self.agent.truncate(session_id, count // self.layout.block_tokens)
        cache = await self._compute(lambda: self.chat.engine.rebuild(blocks, count))
        said = "" if restored.node_blocks else restored.manifest.tokens_digest  # the checkpoint's tokens, not the log's
        if passes is None:
            check = Check(False, f"the checkpoint holds {count} positions, where no pass of the conversation ends")
        elif said and not talk.base and said != tokens_digest_of(talk.token_ids(passes)):
            check = Check(False, f"the checkpoint holds the KV of other tokens than the conversation's first {count}")
        else:
            check = await self._compute(lambda: self.chat.compare(cache, talk, passes, session_id))
        if check.verified is False:  # never serve on from a wrong cache: recompute the whole conversation
            if talk.base:
                raise ValueError(f"session {session_id!r}: {check.detail}, and its start is not known here")
            cache = await self._compute(lambda: self.chat.replay(talk.chunks))
            self._reset(session_id)
        elif passes is not None and passes < len(talk.chunks):  # an older checkpoint: run the passes it lacks
            missing = talk.chunks[passes:]
            await self._compute(lambda: self.chat.replay(missing, cache))
        self._track(session_id, cache)
        return check

    def tokens_known(self, session_id: str) -> int | None:
        talk = self.chat.conversations.get(session_id)
        return talk.tokens if talk is not None else None

    async def check(self, session_id: str) -> Check:
        talk = self.chat.conversations.get(session_id)
        cache = self.caches.get(session_id)
        if talk is None or cache is None:
            return Check(None, f"this pod serves no session {session_id!r}")
        passes = len(talk.chunks)
        return await self._compute(lambda: self.chat.compare(cache, talk, passes, session_id))

    def release(self, session_id: str) -> None:
        self.caches.pop(session_id, None)

    async def close(self, kill: bool = False) -> None:
        self.caches.clear()
