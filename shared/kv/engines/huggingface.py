"""Hugging Face transformers: a causal LM's cache per session (``DynamicCache`` or ``StaticCache``), as the agent's
blocks and back.

transformers keeps one ``[batch, kv_heads, tokens, head_dim]`` tensor per layer for K and for V, not pages: a
``DynamicCache`` grows it, a ``StaticCache`` allocates ``max_cache_len`` positions up front and counts how many are
filled. Either way the adapter keeps its own copy in blocks: each full block is copied out of the cache once, the
partial tail again each time it grows (at most ``block_tokens - 1`` positions). A restore writes the blocks back
into a new cache of the engine's kind (static when the engine was made with ``max_cache_len``), which
``model(...)`` and ``model.generate(...)`` take as ``past_key_values``. One session is one sequence: a cache of
batch size 1.

Only full-attention layers are supported: a sliding-window layer keeps only the last positions, which would not
map to a session's token positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from shared.kv.agent import KvAgent
from shared.kv.engines import blocks_for
from shared.kv.manifest import KvLayout


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the model's state dict, tensor by tensor in name order (name, dtype, shape, then bytes): two
    models compute the same KV cache for the same tokens only if this matches."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def tokenizer_id(tokenizer: Any) -> str:
    """``<name>@<sha256 of the vocabulary, 16 hex>``: the same name with another vocabulary is another tokenizer."""
    vocab = sorted(tokenizer.get_vocab().items())
    fingerprint = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in vocab).encode()).hexdigest()[:16]
    return f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}@{fingerprint}"


class TransformersEngine:
    """One model's sessions: the layout read from the model (and its tokenizer, when given), the weights digest
    computed once here. With ``max_cache_len`` the engine's caches are ``StaticCache`` of that many positions (as
    for ``torch.compile``), else ``DynamicCache``; either kind is tracked, and a restore builds the engine's kind."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        block_tokens: int = 16,
        tokenizer: Any = None,
        tp_rank: int | None = None,
        max_cache_len: int | None = None,
    ) -> None:
        config = model.config.get_text_config(decoder=True)
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(f"only full-attention layers map to session positions; this model has {sorted(kinds)}")
        tp_size = int(getattr(model, "tp_size", None) or 1)
        if tp_rank is None:
            distributed = tp_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
            tp_rank = torch.distributed.get_rank() if distributed else 0
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be at least 1, not {max_cache_len}")
        heads = config.num_attention_heads
        self.model = model
        self.max_cache_len = max_cache_len
        self.dtype: torch.dtype = model.dtype
        self._layout = KvLayout(
            model_id=model.name_or_path or config.model_type,
            model_version=getattr(model.config, "_commit_hash", None) or "unversioned",
            tokenizer_id=tokenizer_id(tokenizer) if tokenizer is not None else f"vocab-{config.vocab_size}",
            dtype=str(self.dtype).removeprefix("torch."),
            block_tokens=block_tokens,
            layers=config.num_hidden_layers,
            kv_heads=(getattr(config, "num_key_value_heads", None) or heads) // tp_size,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            weights_digest=weights_digest(model),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        lay = self._layout
        return (lay.layers, 2, lay.kv_heads, lay.block_tokens, lay.head_dim)

    def new_cache(self) -> Cache:
        """An empty cache of the engine's kind for a new session."""
        if self.max_cache_len is not None:
            return StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        return DynamicCache(config=self.model.config)

    def layers_of(self, cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's filled positions ``[1, kv_heads, length, head_dim]`` (views, nothing copied); ``[]`` for a
        cache nothing was written to yet."""
        lay = self._layout
        if len(cache.layers) != lay.layers:
            raise ValueError(f"the cache has {len(cache.layers)} layers, the model {lay.layers}")
        out = []
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, DynamicLayer | StaticLayer) or type(layer) not in (DynamicLayer, StaticLayer):
                raise ValueError(
                    f"layer {i} of the cache is a {type(layer).__name__}, not a DynamicLayer or StaticLayer"
                )
            keys, values = layer.keys, layer.values
            if not layer.is_initialized or keys is None or values is None or keys.numel() == 0:
                return []
            if isinstance(layer, StaticLayer):
                length = int(layer.get_seq_length())
                keys, values = keys[:, :, :length], values[:, :, :length]
            expected = (1, lay.kv_heads, keys.shape[-2], lay.head_dim)
            if tuple(keys.shape) != expected or tuple(values.shape) != expected or keys.dtype != self.dtype:
                raise ValueError(
                    f"layer {i} holds {tuple(keys.shape)} {keys.dtype}; a session's cache is {expected} {self.dtype}"
                )
            out.append((keys, values))
        return out

    def length(self, cache: Cache) -> int:
        """Positions the cache holds."""
        layers = self.layers_of(cache)
        return int(layers[0][0].shape[-2]) if layers else 0

    def block(self, layers: list[tuple[torch.Tensor, torch.Tensor]], start: int, end: int) -> torch.Tensor:
        """Positions ``start:end`` of every layer's K and V as one new contiguous block (zeros past ``end``)."""
        block = torch.zeros(self.block_shape, dtype=self.dtype, device=layers[0][0].device)
        n = end - start
        for i, (keys, values) in enumerate(layers):
            block[i, 0, :, :n].copy_(keys[0, :, start:end])
            block[i, 1, :, :n].copy_(values[0, :, start:end])
        return block

    def track(self, agent: KvAgent, session_id: str, cache: Cache) -> None:
        """Append the blocks that filled since the last call, hand over the tail again if it grew. Full blocks the
        agent already holds are never copied again. A cache that shrank (cropped) is refused: its checkpointed
        positions would no longer be the session's."""
        if agent.session_layout(session_id) != self._layout:
            raise ValueError(f"pod {agent.pod} holds session {session_id!r} on another layout than this engine's")
        layers = self.layers_of(cache)
        length = layers[0][0].shape[-2] if layers else 0
        held = agent.tokens(session_id)
        if length < held:
            raise ValueError(f"session {session_id!r}: the cache holds {length} positions, the agent {held}")
        bt = self._layout.block_tokens
        count = len(agent.blocks(session_id))
        for index in range(held // bt, blocks_for(length, bt)):
            end = min((index + 1) * bt, length)
            block = self.block(layers, index * bt, end)
            if index < count:
                agent.update_block(session_id, index, block)
            else:
                agent.append_block(session_id, block, tokens=end)
        agent.set_tokens(session_id, length)

    def as_tensor(self, block: Any) -> torch.Tensor:
        """A restored block (host bytes or a tensor) as a ``block_shape`` tensor of the model's dtype."""
        if isinstance(block, np.ndarray):
            block = torch.from_numpy(block)
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"a restored block is a {type(block).__name__}, not bytes or a tensor")
        return block.reshape(-1).view(torch.uint8).view(self.dtype).reshape(self.block_shape)

    def rebuild(self, blocks: Sequence[Any], token_count: int) -> Cache:
        bt = self._layout.block_tokens
        if len(blocks) != blocks_for(token_count, bt):
            raise ValueError(f"{len(blocks)} blocks cannot hold exactly {token_count} positions of {bt}")
        if self.max_cache_len is not None and token_count > self.max_cache_len:
            raise ValueError(
                f"{token_count} positions do not fit in this engine's static cache of {self.max_cache_len}"
            )
        cache = self.new_cache()
        if token_count == 0:
            return cache
        device = self.model.device
        whole = torch.cat([self.as_tensor(b) for b in blocks], dim=3)[:, :, :, :token_count].to(device)
        for i in range(self._layout.layers):
            cache.update(whole[i, 0].unsqueeze(0).contiguous(), whole[i, 1].unsqueeze(0).contiguous(), i)
        return cache
