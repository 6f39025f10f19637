"""Inference engines' KV caches as the agent's blocks: the port every engine adapter implements.

A block is ``block_tokens`` consecutive token positions of one session, for every layer, K and V, as one
contiguous tensor ``[layers, 2, kv_heads, block_tokens, head_dim]`` in the model's dtype. A session's full blocks
never change once written; only its partial tail block does, so an adapter appends each newly full block once and
hands the agent the tail again whenever it grows. The layout (model, weights digest, tokenizer, dtype, shape,
tensor-parallel rank) is read from the engine itself, never typed by hand, so a checkpoint can only be restored
into an engine that would compute the very same cache.

One module per engine (``shared.kv.engines.huggingface``); only those modules import torch or the engine, so the
rest of ``shared.kv`` imports without them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shared.kv.agent import KvAgent, RestoredSession
from shared.kv.manifest import CheckpointManifest, KvLayout
from shared.kv.store import StoreError


@dataclass(frozen=True)
class SessionCheck:
    """What a check of a session's KV cache against its reference found: ``verified`` True (the same), False (not
    the same: ``detail`` says where), or None (nothing to compare with: ``detail`` says why)."""

    verified: bool | None
    detail: str = ""


class EngineCache(Protocol):
    """What the agent needs from an engine: its layout, its cache as blocks, and its cache back from blocks."""

    @property
    def layout(self) -> KvLayout: ...

    def track(self, agent: KvAgent, session_id: str, cache: Any) -> None:
        """Bring the agent's blocks of the session up to date with the engine's ``cache``: append each block that
        is new, hand over the tail again if it changed, set the token count. Idempotent: a second call with the
        same cache changes nothing."""
        ...

    def rebuild(self, blocks: Sequence[Any], token_count: int) -> Any:
        """The engine's own cache object holding ``token_count`` positions, from blocks as a restore returns
        them (host byte arrays or the engine's tensors)."""
        ...


def blocks_for(token_count: int, block_tokens: int) -> int:
    """How many blocks hold ``token_count`` positions (the last one may be partial)."""
    return -(-token_count // block_tokens)


async def _newest(agent: KvAgent, session_id: str, restore: dict[str, Any]) -> CheckpointManifest | None:
    """The manifest ``KvAgent.restore`` would try first with these arguments (None: none to read)."""
    candidates = restore.get("candidates")
    checkpoint_id = candidates[0] if candidates else restore.get("checkpoint_id")
    try:
        if not checkpoint_id:
            ids = await agent.store.checkpoints(session_id)
            checkpoint_id = ids[0] if ids else None
        return await agent.store.manifest(session_id, checkpoint_id) if checkpoint_id else None
    except (StoreError, ValueError):
        return None


async def restore_cache(
    agent: KvAgent, engine: EngineCache, session_id: str, **restore: Any
) -> tuple[Any, RestoredSession]:
    """Restore a session through ``agent`` (``restore`` is passed on to ``KvAgent.restore``: checkpoint id,
    candidates, generation) and rebuild the engine's cache object from it. A checkpoint of another model,
    weights, tokenizer, dtype or layout is refused by the agent, naming each field that differs.

    An engine with ``restore_targets(block_count)`` has the newest checkpoint read straight into blocks it
    allocated (so its rebuild is one bulk copy); if that checkpoint is unusable, the agent's own restore passes
    over it to an older one as always, and says why."""
    if agent.layout != engine.layout:
        raise ValueError(
            f"the agent of pod {agent.pod} serves layout {agent.layout}, the engine computes {engine.layout}"
        )
    targets = getattr(engine, "restore_targets", None)
    if targets is not None and restore.get("into") is None:
        newest = await _newest(agent, session_id, restore)
        if newest is not None:
            try:
                restored = await agent.restore(
                    session_id,
                    into=targets(len(newest.blocks)),
                    candidates=[newest.checkpoint_id],
                    fall_back=False,
                    generation=restore.get("generation", 0),
                )
            except StoreError:
                pass
            else:
                return engine.rebuild(restored.blocks, restored.tokens), restored
    restored = await agent.restore(session_id, **restore)
    return engine.rebuild(restored.blocks, restored.tokens), restored


def prompt_ids(session_id: str, turn: int, count: int, vocab_size: int) -> list[int]:
    """The prompt of turn ``turn`` of a session: ``count`` token ids, the same in every process."""
    seed = int.from_bytes(hashlib.blake2b(f"{session_id}#{turn}".encode(), digest_size=8).digest(), "little")
    ids = np.random.Generator(np.random.PCG64(seed)).integers(2, vocab_size, count)
    return [int(t) for t in ids]
