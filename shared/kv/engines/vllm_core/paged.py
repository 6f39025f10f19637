"""vLLM's paged layer tensors, whatever the attention backend's shape, as agent blocks ``[layers, 2, kv_heads,
block_size, head_dim]`` and back."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from shared.kv.engines.vllm_core.layout import dtype_name, layer_index
from shared.kv.manifest import KvLayout

CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""An attention backend's own cache writer: ``write(key, value, page, slots)`` stores ``key`` and ``value``
(``[tokens, kv_heads, head_dim]``) at ``slots`` of ``page`` (one block of the backend's layer tensor)."""

_PROBE_BASE = 16
"""A cache writer is probed with digits below 16 (plus one): exact in every float KV dtype, fp8 included."""


@dataclass(frozen=True)
class PagedLayout:
    """Where a paged layer tensor keeps K/V, blocks, tokens and heads.

    Five-dimensional tensors (vLLM until its ``KVCacheLayout`` descriptor; the backend's ``get_kv_cache_shape``
    says which): ``kv_first_nhd``: ``[2, blocks, block_size, heads, head_dim]`` (FlashAttention);
    ``blocks_first_nhd``: ``[blocks, 2, block_size, heads, head_dim]`` (FlashInfer, Triton); ``kv_first_hnd`` and
    ``blocks_first_hnd``: the same with heads before tokens.

    Four-dimensional pages (vLLM 0.32: every backend's layer tensor is the logical page ``[blocks, heads,
    block_size, K|V content]``, its memory order given by the engine's ``KVCacheLayout``); how K and V lie inside
    a page is the backend's own, in its kernels. ``blocks_hnc``: each token's content is its K then its V (what
    vLLM 0.32's FlashAttention, FlashInfer, Triton and FlexAttention kernels read, by name in ``BACKEND_KINDS``).
    ``mapped``: any arrangement, learnt by asking the backend's own cache writer where each K and V element goes
    (``from_cache_writer``; ``page_map``): the CPU backend's pages hold a head's K transposed (``[head_dim,
    block_size]``, depending on the CPU's instruction set) then its V.

    The tensor may be a permuted view of vLLM's allocation: only its logical shape matters, and for ``mapped``
    that each block's page is contiguous."""

    kind: str
    block_size: int
    kv_heads: int
    head_dim: int
    page_map: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """``mapped``: ``page_map[i]`` is where, in a block's page, element ``i`` of the agent's ``[2, kv_heads,
    block_size, head_dim]`` block lies."""

    KINDS = ("kv_first_nhd", "blocks_first_nhd", "kv_first_hnd", "blocks_first_hnd")
    PAGE_KINDS = ("blocks_hnc",)
    """Four-dimensional pages a setting (``kv_layout``) may name; ``mapped`` is learnt, never named."""

    BACKEND_KINDS: ClassVar[dict[str, str]] = {
        "CPU_ATTN": "mapped",
        "FLASH_ATTN": "blocks_hnc",
        "FLASHINFER": "blocks_hnc",
        "TRITON_ATTN": "blocks_hnc",
        "FLEX_ATTENTION": "blocks_hnc",
    }
    """vLLM 0.32's attention backends (``get_name``) the connector knows: the CPU one's pages are probed (and run in
    this project's tests); the GPU ones are read as their kernels split a page, not yet run (docs/checkpoints.md)."""

    @classmethod
    def infer(cls, shape: Sequence[int], block_size: int, kv_heads: int, head_dim: int, hint: str = "") -> PagedLayout:
        """The layout of a layer tensor of ``shape``; ``hint`` settles a shape that fits several (e.g. exactly two
        blocks, or as many heads as tokens per block). ``ValueError`` naming the shape when none fits. A 4-D page
        is never guessed: only the backend (or ``hint``) says how K and V lie in it."""
        shape = tuple(int(s) for s in shape)
        fits = []
        if len(shape) == 4 and shape[1:] == (kv_heads, block_size, 2 * head_dim) and shape[0] > 0:
            fits = [*cls.PAGE_KINDS, "mapped"]
        if len(shape) == 5:
            for kind in cls.KINDS:
                kv_axis, block_axis = (0, 1) if kind.startswith("kv_first") else (1, 0)
                inner = (block_size, kv_heads) if kind.endswith("nhd") else (kv_heads, block_size)
                if shape[kv_axis] == 2 and shape[2:4] == inner and shape[4] == head_dim and shape[block_axis] > 0:
                    fits.append(kind)
        if hint:
            if hint not in fits:
                raise ValueError(f"a paged KV tensor of shape {shape} is not {hint!r} (it fits {fits or 'nothing'})")
            return cls(hint, block_size, kv_heads, head_dim)
        if not fits:
            raise ValueError(
                f"a paged KV tensor of shape {shape} matches no known layout for block_size={block_size}, "
                f"kv_heads={kv_heads}, head_dim={head_dim} (MLA caches are not supported)"
            )
        if len(fits) > 1:
            raise ValueError(
                f"a paged KV tensor of shape {shape} is ambiguous ({fits}): the attention backend says which "
                "(it could not be asked), or set 'kv_layout'"
            )
        return cls(fits[0], block_size, kv_heads, head_dim)

    @classmethod
    def from_backend(
        cls,
        name: str,
        get_kv_cache_shape: Callable[..., Sequence[int]] | None,
        writer: CacheWriter | None,
        page: torch.Tensor,
        block_size: int,
        kv_heads: int,
        head_dim: int,
    ) -> PagedLayout:
        """The layout the attention backend ``name`` declares: its ``get_kv_cache_shape`` where it has one (vLLM
        before 0.32), else its name (``BACKEND_KINDS``), and for ``mapped`` what its cache ``writer`` does to a
        page like ``page`` (one block of its layer tensor). ``ValueError`` for a backend the connector does not
        know: a guess would checkpoint K as V."""
        if get_kv_cache_shape is not None:
            return cls.from_backend_shape(get_kv_cache_shape, block_size, kv_heads, head_dim)
        kind = cls.BACKEND_KINDS.get(name)
        if kind is None:
            raise ValueError(
                f"the attention backend {name!r} declares no cache shape and the gpuwarden connector does not know "
                f"how it lays K and V out in a page (known: {sorted(cls.BACKEND_KINDS)}); set 'kv_layout'"
            )
        if kind == "mapped":
            if writer is None:
                raise ValueError(f"the attention backend {name!r} could not be asked where it writes K and V")
            return cls.from_cache_writer(writer, page, block_size, kv_heads, head_dim)
        return cls(kind, block_size, kv_heads, head_dim)

    @classmethod
    def from_cache_writer(
        cls, write: CacheWriter, page: torch.Tensor, block_size: int, kv_heads: int, head_dim: int
    ) -> PagedLayout:
        """``mapped``: where the backend's own cache writer puts each K and V element of a block, learnt by having
        it write, into a zeroed page like ``page``, the digits (base 16, plus one) of each element's place in the
        agent's block, one digit a pass. ``ValueError`` unless every element lands in its own place and the page
        holds nothing else (a page with scales or padding is not a plain K/V page)."""
        shape = (1, *page.shape[1:])
        size = 2 * kv_heads * block_size * head_dim
        if int(np.prod(shape)) != size:
            raise ValueError(f"a page of shape {tuple(page.shape[1:])} is not {size} K/V elements")
        place = torch.arange(size, dtype=torch.long).view(2, kv_heads, block_size, head_dim)
        located = torch.zeros(size, dtype=torch.long)
        scale, passes = 1, 1
        while _PROBE_BASE**passes < size:
            passes += 1
        for _ in range(passes):
            digit = (place // scale) % _PROBE_BASE + 1
            probe = torch.zeros(shape, dtype=page.dtype, device=page.device)
            key = digit[0].transpose(0, 1).to(page.dtype)  # [tokens, heads, head_dim]
            value = digit[1].transpose(0, 1).to(page.dtype)
            slots = torch.arange(block_size, dtype=torch.long)
            write(key.to(page.device), value.to(page.device), probe, slots.to(page.device))
            got = probe.reshape(-1).to("cpu", torch.float32).round().to(torch.long) - 1
            if bool(((got < 0) | (got >= _PROBE_BASE)).any()):
                raise ValueError("the attention backend's cache writer leaves part of a page unwritten or altered")
            located += got * scale
            scale *= _PROBE_BASE
        page_map = torch.empty(size, dtype=torch.long)
        page_map[located] = torch.arange(size, dtype=torch.long)
        if not torch.equal(torch.sort(located).values, torch.arange(size, dtype=torch.long)):
            raise ValueError("the attention backend's cache writer puts two K/V elements in one place")
        return cls("mapped", block_size, kv_heads, head_dim, page_map)

    @classmethod
    def from_backend_shape(
        cls, get_kv_cache_shape: Callable[..., Sequence[int]], block_size: int, kv_heads: int, head_dim: int
    ) -> PagedLayout:
        """The layout an attention backend declares: its ``get_kv_cache_shape`` asked for an odd, unmistakable
        number of blocks, so the answer is never ambiguous."""
        probe = 1_000_003
        heads = kv_heads if kv_heads != block_size else block_size + 1  # tokens and heads told apart
        shape = tuple(get_kv_cache_shape(probe, block_size, heads, head_dim))
        if probe not in shape or len(shape) != 5:
            raise ValueError(f"the attention backend's cache shape {shape} is not a paged K/V layout")
        kind = "kv_first" if shape.index(probe) == 1 else "blocks_first"
        order = "nhd" if shape[2] == block_size else "hnd"
        return cls(f"{kind}_{order}", block_size, kv_heads, head_dim)

    @property
    def block_axis(self) -> int:
        return 1 if self.kind.startswith("kv_first") else 0

    def blocks_view(self, layer: torch.Tensor) -> torch.Tensor:
        """``layer`` as ``[blocks, 2, heads, block_size, head_dim]`` (a view: writes go to vLLM's memory); not for
        ``mapped`` pages, which no view can reorder (``take`` and ``put`` copy)."""
        if self.kind == "blocks_hnc":  # [B, H, N, 2D] -> [B, H, N, 2, D] -> [B, 2, H, N, D]
            return layer.unflatten(3, (2, self.head_dim)).permute(0, 3, 1, 2, 4)
        if self.kind == "mapped":
            raise ValueError("a mapped page has no view as agent blocks")
        view = layer.transpose(0, 1) if self.kind.startswith("kv_first") else layer
        return view if self.kind.endswith("hnd") else view.transpose(2, 3)

    def _pages(self, layer: torch.Tensor) -> torch.Tensor:
        try:
            return layer.view(layer.shape[0], -1)  # a view: writes go to vLLM's memory
        except RuntimeError:
            raise ValueError(f"a mapped page must be contiguous within a block; strides {layer.stride()}") from None

    def take(self, layer: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` of ``layer`` as ``[n, 2, heads, block_size, head_dim]`` (a copy)."""
        if self.page_map is None:
            return self.blocks_view(layer).index_select(0, ids)
        rows = self._pages(layer).index_select(0, ids)
        shape = (len(ids), 2, self.kv_heads, self.block_size, self.head_dim)
        return rows[:, self.page_map.to(rows.device)].view(shape)

    def put(self, layer: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write ``blocks`` (``[n, 2, heads, block_size, head_dim]``) into blocks ``ids`` of ``layer``."""
        if self.page_map is None:
            self.blocks_view(layer).index_copy_(0, ids, blocks)
            return
        pages = self._pages(layer)
        rows = torch.empty((len(ids), pages.shape[1]), dtype=pages.dtype, device=pages.device)
        rows[:, self.page_map.to(rows.device)] = blocks.reshape(len(ids), -1)
        pages.index_copy_(0, ids, rows)


class PagedCache:
    """One engine's (one tensor-parallel rank's) paged layers, in layer order, as agent blocks and back."""

    def __init__(self, layers: Mapping[str, torch.Tensor], layout: KvLayout, hint: str | PagedLayout = "") -> None:
        if not layers:
            raise ValueError("vLLM registered no KV cache layers")
        names = sorted(layers, key=layer_index)
        if len(names) != layout.layers:
            raise ValueError(f"vLLM registered {len(names)} KV cache layers, the model has {layout.layers}")
        first = layers[names[0]]
        kind = hint.kind if isinstance(hint, PagedLayout) else hint  # a declared layout must fit the shape too
        self.paged = PagedLayout.infer(first.shape, layout.block_tokens, layout.kv_heads, layout.head_dim, kind)
        if isinstance(hint, PagedLayout):
            self.paged = hint
        if self.paged.kind == "mapped" and self.paged.page_map is None:
            raise ValueError("a mapped page layout is learnt from the attention backend, never named")
        dtype = dtype_name(first.dtype)
        if dtype != layout.dtype:
            raise ValueError(f"the paged KV cache holds {dtype}, the layout says {layout.dtype}")
        for name in names:
            if layers[name].shape != first.shape or layers[name].dtype != first.dtype:
                raise ValueError(f"layer {name} is {tuple(layers[name].shape)} {layers[name].dtype}, unlike the first")
        self.names = names
        self.tensors = [layers[n] for n in names]
        self.views = [] if self.paged.kind == "mapped" else [self.paged.blocks_view(t) for t in self.tensors]
        """The layers as ``[blocks, 2, heads, block_size, head_dim]`` views (none for mapped pages)."""
        self.layout = layout
        self.device = first.device
        self.dtype = first.dtype
        self.num_blocks = int(first.shape[self.paged.block_axis])

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        lay = self.layout
        return (lay.layers, 2, lay.kv_heads, lay.block_tokens, lay.head_dim)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"block ids {bad[:5]} outside the paged cache's {self.num_blocks} blocks")
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], tokens: Sequence[int] | None = None) -> list[torch.Tensor]:
        """vLLM blocks ``block_ids`` as new contiguous host tensors of ``block_shape`` (one copy to the host for
        all of them). ``tokens[i]``: how many positions of block ``i`` hold the session's KV; the rest are zeroed,
        so a partial block's bytes do not depend on what vLLM left there."""
        if not block_ids:
            return []
        ids = self._ids(block_ids)
        stacked = torch.stack([self.paged.take(t, ids) for t in self.tensors], dim=1)  # [n, L, 2, H, bs, D]
        host = stacked.to("cpu").contiguous()
        out = list(host.unbind(0))
        bs = self.layout.block_tokens
        for i, block in enumerate(out):
            n = bs if tokens is None else tokens[i]
            if n < bs:
                block[:, :, :, n:].zero_()
        return out

    def scatter(self, block_ids: Sequence[int], blocks: Sequence[Any]) -> None:
        """Write whole agent blocks (host or device tensors of ``block_shape``) into vLLM blocks ``block_ids``."""
        if len(block_ids) != len(blocks):
            raise ValueError(f"{len(blocks)} blocks for {len(block_ids)} block ids")
        if not blocks:
            return
        ids = self._ids(block_ids)
        data = torch.stack([self.as_tensor(b) for b in blocks]).to(self.device)  # [n, L, 2, H, bs, D]
        for i, tensor in enumerate(self.tensors):
            self.paged.put(tensor, ids, data[:, i])

    def as_tensor(self, block: Any) -> torch.Tensor:
        """A block as the agent holds it (a host tensor it was given, or the byte array a restore returned)."""
        if isinstance(block, np.ndarray):
            block = torch.from_numpy(block)
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"a KV block is a {type(block).__name__}, not a tensor or an array")
        if block.dtype != self.dtype or tuple(block.shape) != self.block_shape:
            block = block.contiguous().reshape(-1).view(torch.uint8).view(self.dtype).reshape(self.block_shape)
        return block
