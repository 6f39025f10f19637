"""Hugging Face transformers: a causal LM's cache per session (``DynamicCache`` or ``StaticCache``), as the agent's
blocks and back.

transformers keeps one ``[batch, kv_heads, tokens, head_dim]`` tensor per layer for K and for V, not pages: a
``DynamicCache`` grows it, a ``StaticCache`` allocates ``max_cache_len`` positions up front and counts how many are
filled. Either way the adapter keeps its own copy in blocks: each full block is copied out of the cache once, the
partial tail again each time it grows (at most ``block_tokens - 1`` positions). A restore writes the blocks back
into a new cache of the engine's kind (static when the engine was made with ``max_cache_len``), which
``model(...)`` and ``model.generate(...)`` take as ``past_key_values``. One session is one sequence: a cache of
batch size 1.

Copies are bulk: the blocks that filled since the last ``track`` are one new tensor (the full ones; the tail is a
tensor of its own, as it is replaced when it grows), written by one strided copy per layer for K and for V, however
many blocks or positions that is. A restore reads straight into blocks the engine allocated as one tensor
(``restore_targets``); a dynamic cache rebuilt from them copies nothing until its first forward, which gathers
the blocks into the one new tensor per layer that ``DynamicLayer`` makes on every update anyway. Otherwise a
rebuild allocates the cache's tensors at their final size once and fills them with one strided copy, or one copy
per block from separate arrays; it never grows a cache by concatenation.

Only full-attention layers are supported: a sliding-window layer keeps only the last positions, which would not
map to a session's token positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
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


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A new tensor for KV bytes. On the host its memory comes from numpy, which asks the kernel for transparent
    huge pages for large buffers: first touch then costs one fault per 2 MiB, not per 4 KiB (several times faster
    on virtual machines), and a restore or a track touches every byte of it once."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    count = 1
    for size in shape:
        count *= size
    flat = np.empty(count * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(flat).view(dtype).reshape(shape)


class RestoredLayer(DynamicLayer):
    """A ``DynamicLayer`` whose positions still sit in the restored blocks until first needed. ``DynamicLayer``
    concatenates into a new tensor on every update, so the first forward after a restore makes that one tensor
    straight from the blocks (and the new positions): the restore itself copies nothing. Reading ``keys`` or
    ``values`` before that gathers them first; either way the blocks are read once and the layer is then an
    ordinary ``DynamicLayer``."""

    def __init__(self, gather: Callable[[torch.Tensor, int], None], length: int, like: torch.Tensor) -> None:
        self._pending: tuple[Callable[[torch.Tensor, int], None], int] | None = None
        super().__init__()
        self.lazy_initialization(like, like)
        self._like = like  # [1, kv_heads, 0, head_dim] of the cache's dtype, on its device
        self._pending = (gather, length)

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        self._gather()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys = value

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        self._gather()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value

    def _gather(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        """The positions from the blocks, then ``keys``/``values`` (new positions) after them, as the layer's
        tensors; nothing when already gathered."""
        if self.__dict__.get("_pending") is None:
            return
        gather, length = self._pending  # type: ignore[misc]
        self._pending = None
        extra = 0 if keys is None else keys.shape[-2]
        like = self._like
        assert values is None or keys is not None
        both = _empty((2, 1, like.shape[1], length + extra, like.shape[-1]), like.dtype, like.device)
        gather(both[:, 0], length)
        if keys is not None and values is not None:
            both[0, :, :, length:].copy_(keys)
            both[1, :, :, length:].copy_(values)
        self._keys, self._values = both[0], both[1]

    def get_seq_length(self) -> int:
        pending = self.__dict__.get("_pending")
        return pending[1] if pending is not None else super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.__dict__.get("_pending") is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self._gather(key_states, value_states)
        assert self._keys is not None and self._values is not None
        return self._keys, self._values


FULL_LAYERS = (DynamicLayer, StaticLayer, RestoredLayer)
"""The layer kinds whose positions are a session's (subclasses such as sliding-window layers keep only the last)."""


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
            if not isinstance(layer, DynamicLayer | StaticLayer) or type(layer) not in FULL_LAYERS:
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

    def blocks_of(self, layers: list[tuple[torch.Tensor, torch.Tensor]], start: int, end: int) -> torch.Tensor:
        """Positions ``start:end`` of every layer's K and V as new blocks ``[count, *block_shape]`` (``start`` on a
        block boundary; zeros past ``end`` in a partial last block): one tensor, filled by one copy per layer for K
        and one for V (two more when the last block is partial)."""
        bt = self._layout.block_tokens
        if start % bt:
            raise ValueError(f"blocks start on a multiple of {bt} positions, not at {start}")
        count = blocks_for(end - start, bt)
        out = _empty((count, *self.block_shape), self.dtype, layers[0][0].device)
        full, tail = divmod(end - start, bt)
        if tail:
            out[full, :, :, :, tail:].zero_()
        for i, kv in enumerate(layers):
            for j, tensor in enumerate(kv):
                positions = tensor[0, :, start:end]  # [kv_heads, end - start, head_dim]
                if full:
                    out[:full, i, j].copy_(positions[:, : full * bt].unflatten(1, (full, bt)).transpose(0, 1))
                if tail:
                    out[full, i, j, :, :tail].copy_(positions[:, full * bt :])
        return out

    def block(self, layers: list[tuple[torch.Tensor, torch.Tensor]], start: int, end: int) -> torch.Tensor:
        """Positions ``start:end`` (at most one block) as one new contiguous block (zeros past ``end``)."""
        if end - start > self._layout.block_tokens:
            raise ValueError(f"a block holds {self._layout.block_tokens} positions, not {end - start}")
        return self.blocks_of(layers, start, end)[0]

    def track(self, agent: KvAgent, session_id: str, cache: Cache) -> None:
        """Append the blocks that filled since the last call, hand over the tail again if it grew. Full blocks the
        agent already holds are never copied again. A cache that shrank (cropped) is refused: its checkpointed
        positions would no longer be the session's.

        The newly full blocks are views of one new tensor (it lives as long as any of them), the tail a tensor of
        its own, so that replacing it as it grows frees it."""
        if agent.session_layout(session_id) != self._layout:
            raise ValueError(f"pod {agent.pod} holds session {session_id!r} on another layout than this engine's")
        layers = self.layers_of(cache)
        length = layers[0][0].shape[-2] if layers else 0
        held = agent.tokens(session_id)
        if length < held:
            raise ValueError(f"session {session_id!r}: the cache holds {length} positions, the agent {held}")
        bt = self._layout.block_tokens
        count = len(agent.blocks(session_id))
        first, full_end = held // bt, length // bt
        new: list[tuple[int, torch.Tensor, int]] = []  # (block index, block, positions up to its end)
        if full_end > first:
            whole = self.blocks_of(layers, first * bt, full_end * bt)
            new += [(first + k, whole[k], (first + k + 1) * bt) for k in range(full_end - first)]
        if length > full_end * bt and length > held:
            new.append((full_end, self.block(layers, full_end * bt, length), length))
        for index, block, end in new:
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

    def restore_targets(self, block_count: int) -> list[torch.Tensor]:
        """``block_count`` blocks for ``KvAgent.restore(into=...)`` to read into, on the model's device: consecutive
        views of one new tensor, so that ``rebuild`` fills the cache from them with one copy."""
        whole = _empty((block_count, *self.block_shape), self.dtype, self.model.device)
        return list(whole.unbind(0))

    def _joined(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The blocks as one ``[count, *block_shape]`` view when they are consecutive in one storage, else None."""
        first = tensors[0]
        step = first.numel()
        storage = first.untyped_storage().data_ptr()
        base = first.storage_offset()
        for k, t in enumerate(tensors):
            if t.untyped_storage().data_ptr() != storage or t.storage_offset() != base + k * step:
                return None
        return first.as_strided((len(tensors), *self.block_shape), (step, *first.stride()), base)

    def _fill(self, dst: torch.Tensor, blocks: torch.Tensor | list[torch.Tensor], count: int) -> None:
        """``dst[..., :count, :]`` (``[layers, 2, kv_heads, positions, head_dim]``, or a slice of its leading
        dimensions matching the blocks') from the blocks: one strided copy from joined blocks (one more for a
        partial last block), else one copy per block."""
        bt = self._layout.block_tokens
        full, tail = divmod(count, bt)
        if isinstance(blocks, torch.Tensor):
            if full:
                order = (*range(1, blocks.dim() - 2), 0, blocks.dim() - 2, blocks.dim() - 1)
                dst[..., : full * bt, :].unflatten(-2, (full, bt)).copy_(blocks[:full].permute(order))
            if tail:
                dst[..., full * bt : count, :].copy_(blocks[full, ..., :tail, :])
            return
        for k, block in enumerate(blocks[: blocks_for(count, bt)]):
            end = min((k + 1) * bt, count)
            dst[..., k * bt : end, :].copy_(block[..., : end - k * bt, :])

    def rebuild(self, blocks: Sequence[Any], token_count: int) -> Cache:
        """The engine's cache of ``token_count`` positions from restored blocks, on the model's device. A dynamic
        cache from blocks in one tensor (``restore_targets``, or any on another device) is made of ``RestoredLayer``s:
        its first forward gathers the blocks into the tensors it makes anyway. Otherwise the cache's tensors are
        allocated once at their final size (a dynamic cache: exactly ``token_count`` positions, contiguous; a static
        one: its own ``max_cache_len``) and filled in one pass over the blocks."""
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
        tensors = [self.as_tensor(b) for b in blocks]
        joined = self._joined(tensors)
        source: torch.Tensor | list[torch.Tensor]
        if joined is not None:
            source = joined.to(device)
        elif tensors[0].device != device:
            source = torch.stack(tensors).to(device)  # one host-to-device transfer, not one per block
        else:
            source = tensors
        lay = self._layout
        empty = torch.empty((1, lay.kv_heads, 0, lay.head_dim), dtype=self.dtype, device=device)
        if self.max_cache_len is None and isinstance(source, torch.Tensor):
            joined_source = source
            for i in range(lay.layers):

                def gather(dst: torch.Tensor, count: int, i: int = i) -> None:
                    self._fill(dst, joined_source[:, i], count)  # K and V: [2, kv_heads, positions, head_dim]

                cache.layers[i] = RestoredLayer(gather, token_count, empty)
            return cache
        if self.max_cache_len is None:
            kv = _empty((lay.layers, 2, lay.kv_heads, token_count, lay.head_dim), self.dtype, device)
            self._fill(kv, source, token_count)
            for i, layer in enumerate(cache.layers):
                assert isinstance(layer, DynamicLayer)
                layer.lazy_initialization(empty, empty)
                layer.keys, layer.values = kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)
            return cache
        if isinstance(source, list):
            source = torch.stack(source)
        for i, layer in enumerate(cache.layers):
            assert isinstance(layer, StaticLayer)
            layer.lazy_initialization(empty, empty)  # the static tensors, max_cache_len positions
            assert layer.keys is not None and layer.values is not None
            self._fill(layer.keys[0], source[:, i, 0], token_count)
            self._fill(layer.values[0], source[:, i, 1], token_count)
            layer.cumulative_length.fill_(token_count)
        return cache
