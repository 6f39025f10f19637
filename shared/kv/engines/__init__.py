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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.kv.agent import KvAgent, RestoredSession
from shared.kv.manifest import KvLayout


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


async def restore_cache(
    agent: KvAgent, engine: EngineCache, session_id: str, **restore: Any
) -> tuple[Any, RestoredSession]:
    """Restore a session through ``agent`` (``restore`` is passed on to ``KvAgent.restore``: checkpoint id,
    candidates, generation) and rebuild the engine's cache object from it. A checkpoint of another model,
    weights, tokenizer, dtype or layout is refused by the agent, naming each field that differs."""
    if agent.layout != engine.layout:
        raise ValueError(
            f"the agent of pod {agent.pod} serves layout {agent.layout}, the engine computes {engine.layout}"
        )
    restored = await agent.restore(session_id, **restore)
    return engine.rebuild(restored.blocks, restored.manifest.token_count), restored
