"""vLLM's paged KV cache as the agent's blocks, and the connector's state on both sides, without importing vLLM.

``shared.kv.engines.vllm`` (the ``KVConnectorBase_V1`` subclass vLLM loads) is a thin shell over this module: it
reads fields off vLLM's objects and calls in here, so everything that can be checked without a GPU is checked on
the CPU (``tests/test_kv_vllm_core.py``).

How a vLLM block maps to an agent block: vLLM keeps one paged tensor per attention layer. Its logical shape depends
on the attention backend: ``[2, num_blocks, block_size, kv_heads, head_dim]`` (FlashAttention), ``[num_blocks, 2,
block_size, kv_heads, head_dim]`` (FlashInfer, Triton) or either with heads before tokens (``HND``). vLLM block
``b`` of a request, across every layer, is one agent block ``[layers, 2, kv_heads, block_size, head_dim]``: agent
block ``i`` of a session is the session's ``i``-th vLLM block, so ``block_tokens`` is vLLM's ``block_size``.

Sessions: a request belongs to a session when its ``kv_transfer_params`` (the OpenAI API's ``kv_transfer_params``
field, or ``SamplingParams.extra_args["kv_transfer_params"]`` offline) carry ``{"gpuwarden_session": "<id>"}``;
``"gpuwarden_end": true`` on a request ends the session once it finishes (its checkpoints are retired). Each turn
of a conversation is one request whose prompt is the whole conversation so far. Requests without a session are
not touched.

What happens, step by step:

* Scheduler side (``SchedulerBook``): for a request of session S it offers the tokens a checkpoint holds. When this
  engine already holds S (an earlier turn ran here), the agent's host copy is the source and the prompt is checked
  against the tokens it holds (a rewritten conversation truncates the session where it differs). Otherwise the
  newest checkpoint in the store (through the checkpoint service when NATS is configured) is the source, and the
  prompt is trusted to continue the conversation: manifests carry no token ids. Only whole blocks are loaded, and
  never the prompt's last token (vLLM must compute at least one). Each step it tells the workers which blocks of
  which session became full (``CopySpec``), which to load (``LoadSpec``), which sessions to claim (``ClaimSpec``)
  and which requests finished (``FinishSpec``); a finished request's blocks are held until its worker copied them.
* Worker side (``WorkerBook``): copies each block of a session to host memory once, when it becomes full (vLLM
  never changes a full block), and the partial tail when the request finishes; the agent keeps those host copies as
  the session's blocks, so a drain, periodic or preStop save (the checkpoint service's commands through
  ``AgentEndpoint``) writes them to the store at any time, even after vLLM reused the GPU blocks. A load restores the
  session (verified chunk by chunk by the agent) and copies its blocks into the blocks vLLM allocated; blocks that
  could not be restored or failed verification are reported to vLLM, which recomputes them.

Not supported (refused at start): more than one KV cache group (hybrid or sliding-window models), MLA caches,
speculative decoding (it writes KV for tokens it may reject, so a full block could still change).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch

from shared.kv.agent import KvAgent
from shared.kv.manifest import KvLayout, check_compatible, newest_first
from shared.kv.store import CheckpointNotFound, CheckpointStore, StoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

SESSION_KEY = "gpuwarden_session"
END_KEY = "gpuwarden_end"

# -- configuration -----------------------------------------------------------------------------------------------


DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_NAMESPACE": "vLLM connector: the pod's namespace unless its extra config names one (default default)",
    "GPUWARDEN_DEPLOYMENT": "vLLM connector: the pod's deployment unless its extra config names one (default vllm)",
}
"""Variables only the vLLM connector reads (tools.envdoc); the others it shares with the agents."""


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` value (or its environment default) that cannot work, named."""


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of ``--kv-transfer-config``; each key falls back to an environment variable.

    ``store``: where checkpoints go (``GPUWARDEN_CHECKPOINT_STORE``: ``file:///path`` or ``nats://<bucket>``).
    ``nats``: answer the checkpoint service over NATS (drain, periodic and preStop saves; generation claims); the
    connection settings are gpuwarden's own (``GPUWARDEN_NATS_URL`` and friends). Default: on when
    ``GPUWARDEN_NATS_URL`` is set. ``pod``/``node``/``namespace``/``deployment``: the agent's identity
    (``GPUWARDEN_POD_NAME``, ``GPUWARDEN_NODE``, ``GPUWARDEN_NAMESPACE``, ``GPUWARDEN_DEPLOYMENT``).
    ``save_on_finish``: commit a checkpoint of a session each time one of its requests finishes (default: on
    without NATS, where nothing else would save; off with NATS, where the service decides). ``kv_layout``: the
    paged cache's layout when its shape alone is ambiguous (see ``PagedLayout``). ``lookup_timeout_s``: how long
    the scheduler waits for the store or the service when it asks what a checkpoint holds."""

    store: str
    nats: bool = False
    pod: str = "vllm-0"
    node: str = ""
    namespace: str = "default"
    deployment: str = "vllm"
    save_on_finish: bool = True
    kv_layout: str = ""
    lookup_timeout_s: float = 5.0
    announce_s: float = 5.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        env = os.environ if env is None else env
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        store = str(extra.get("store") or env.get("GPUWARDEN_CHECKPOINT_STORE", ""))
        if not store:
            raise ConfigError(
                "kv_connector_extra_config: no checkpoint store: set 'store' (file:///path or nats://<bucket>) "
                "or GPUWARDEN_CHECKPOINT_STORE"
            )
        from shared.kv.stores import parse_store_url

        try:
            kind, _, _ = parse_store_url(store)
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config 'store': {exc}") from None
        nats = _flag(extra, "nats", bool(env.get("GPUWARDEN_NATS_URL")))
        if kind == "nats" and not nats:
            raise ConfigError(f"kv_connector_extra_config: store {store!r} needs 'nats': true")
        layout = str(extra.get("kv_layout", ""))
        if layout and layout not in PagedLayout.KINDS:
            raise ConfigError(f"kv_connector_extra_config 'kv_layout'={layout!r}: expected one of {PagedLayout.KINDS}")
        try:
            timeout = float(extra.get("lookup_timeout_s", 5.0))
            announce = float(extra.get("announce_s", 5.0))
        except (TypeError, ValueError):
            raise ConfigError("kv_connector_extra_config: lookup_timeout_s and announce_s are numbers") from None
        if timeout <= 0 or announce <= 0:
            raise ConfigError("kv_connector_extra_config: lookup_timeout_s and announce_s must be positive")
        return cls(
            store=store,
            nats=nats,
            pod=str(extra.get("pod") or env.get("GPUWARDEN_POD_NAME") or "vllm-0"),
            node=str(extra.get("node") or env.get("GPUWARDEN_NODE") or os.uname().nodename.split(".")[0]),
            namespace=str(extra.get("namespace") or env.get("GPUWARDEN_NAMESPACE") or "default"),
            deployment=str(extra.get("deployment") or env.get("GPUWARDEN_DEPLOYMENT") or "vllm"),
            save_on_finish=_flag(extra, "save_on_finish", not nats),
            kv_layout=layout,
            lookup_timeout_s=timeout,
            announce_s=announce,
        )


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"kv_connector_extra_config {key!r}={value!r}: expected true or false")


def session_of(kv_transfer_params: Mapping[str, Any] | None) -> tuple[str, bool] | None:
    """``(session id, ends)`` of a request, from its ``kv_transfer_params``; None when it names no session.
    A session id that is not a short plain token is refused with a one-line ``ValueError``."""
    if not kv_transfer_params or SESSION_KEY not in kv_transfer_params:
        return None
    sid = kv_transfer_params[SESSION_KEY]
    if not isinstance(sid, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}", sid):
        raise ValueError(f"{SESSION_KEY}={sid!r}: a session id is 1-128 letters, digits, '_', '.', ':' or '-'")
    return sid, bool(kv_transfer_params.get(END_KEY, False))


# -- the layout, from vLLM's configuration ------------------------------------------------------------------------

_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)


def files_digest(folder: str | Path, patterns: Iterable[str]) -> str:
    """SHA-256 over the files of ``folder`` matching ``patterns`` (name, size, bytes, in name order); "" when the
    folder holds none (a hub id rather than a local path)."""
    root = Path(folder)
    if not root.is_dir():
        return ""
    names = sorted({p.name for pattern in patterns for p in root.glob(pattern) if p.is_file()})
    if not names:
        return ""
    h = hashlib.sha256()
    for name in names:
        path = root / name
        h.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


_digests: dict[tuple[str, tuple[str, ...]], str] = {}
_digests_lock = threading.Lock()


def cached_files_digest(folder: str, patterns: tuple[str, ...]) -> str:
    """``files_digest`` once per process (the scheduler and the worker of one engine share it)."""
    with _digests_lock:
        key = (folder, patterns)
        if key not in _digests:
            _digests[key] = files_digest(folder, patterns)
        return _digests[key]


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def cache_dtype_name(cache_dtype: str | None, model_dtype: Any) -> str:
    """The dtype vLLM stores KV in: ``cache_config.cache_dtype`` ("auto" follows the model)."""
    if not cache_dtype or cache_dtype == "auto":
        return dtype_name(model_dtype)
    return {
        "fp8": "float8_e4m3fn",
        "fp8_e4m3": "float8_e4m3fn",
        "fp8_e5m2": "float8_e5m2",
        "half": "float16",
        "float": "float32",
        "bf16": "bfloat16",
        "fp16": "float16",
    }.get(cache_dtype, cache_dtype)


def layout_from_vllm_config(vllm_config: Any, tp_rank: int) -> KvLayout:
    """The layout a vLLM engine computes its KV cache in, read from its ``VllmConfig``: model (served name, else
    the path or hub id) and revision, a digest of the weight files when the model is a local folder (else the
    revision stands for them), the tokenizer (name, revision and a digest of its files), the KV dtype, the layers,
    KV heads per tensor-parallel rank and head size, vLLM's block size, and the rank."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    served = getattr(model, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    revision = getattr(model, "revision", None) or getattr(model, "code_revision", None) or "unversioned"
    tokenizer = str(getattr(model, "tokenizer", None) or model.model)
    tok_digest = cached_files_digest(tokenizer, _TOKENIZER_FILES)[:16]
    tok_revision = getattr(model, "tokenizer_revision", None) or revision
    return KvLayout(
        model_id=str(served or model.model),
        model_version=str(revision),
        tokenizer_id=f"{Path(tokenizer).name or tokenizer}@{tok_digest or tok_revision}",
        dtype=cache_dtype_name(getattr(cache, "cache_dtype", "auto"), model.dtype),
        block_tokens=int(cache.block_size),
        layers=int(model.get_num_layers(parallel)),
        kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        weights_digest=cached_files_digest(str(model.model), _WEIGHT_FILES),
        tp_rank=int(tp_rank),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
    )


def refuse_unsupported(vllm_config: Any, kv_cache_groups: int) -> None:
    """``ValueError`` for what the connector cannot checkpoint faithfully."""
    if kv_cache_groups > 1:
        raise ValueError(
            f"this model has {kv_cache_groups} KV cache groups (hybrid or sliding-window attention); the gpuwarden "
            "connector maps only one group of full-attention layers"
        )
    if getattr(vllm_config.model_config, "use_mla", False):
        raise ValueError("MLA (latent) KV caches are not supported by the gpuwarden connector")
    tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if tp_size > 1 or pp_size > 1:
        raise ValueError(
            f"tensor_parallel_size={tp_size}, pipeline_parallel_size={pp_size}: the gpuwarden connector checkpoints "
            "one rank's cache per session so far (each rank would need its own session in the store)"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(
            "speculative decoding writes KV of tokens it may reject, so a full block may still change: not "
            "supported by the gpuwarden connector"
        )


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer's name (``model.layers.7.self_attn.attn`` -> 7)."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise ValueError(f"no layer number in the attention layer name {name!r}")
    return int(numbers[0])


# -- the paged cache ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedLayout:
    """Where a paged layer tensor keeps K/V, blocks, tokens and heads.

    ``kv_first_nhd``: ``[2, blocks, block_size, heads, head_dim]`` (FlashAttention). ``blocks_first_nhd``:
    ``[blocks, 2, block_size, heads, head_dim]`` (FlashInfer, Triton). ``kv_first_hnd`` and ``blocks_first_hnd``:
    the same with heads before tokens. The tensor may be a permuted view of vLLM's allocation; only its logical
    shape matters here."""

    kind: str
    block_size: int
    kv_heads: int
    head_dim: int

    KINDS = ("kv_first_nhd", "blocks_first_nhd", "kv_first_hnd", "blocks_first_hnd")

    @classmethod
    def infer(cls, shape: Sequence[int], block_size: int, kv_heads: int, head_dim: int, hint: str = "") -> PagedLayout:
        """The layout of a layer tensor of ``shape``; ``hint`` settles a shape that fits several (e.g. exactly two
        blocks, or as many heads as tokens per block). ``ValueError`` naming the shape when none fits."""
        shape = tuple(int(s) for s in shape)
        fits = []
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
            raise ValueError(f"a paged KV tensor of shape {shape} is ambiguous ({fits}): set 'kv_layout'")
        return cls(fits[0], block_size, kv_heads, head_dim)

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

    def blocks_view(self, layer: torch.Tensor) -> torch.Tensor:
        """``layer`` as ``[blocks, 2, heads, block_size, head_dim]`` (a view: writes go to vLLM's memory)."""
        view = layer.transpose(0, 1) if self.kind.startswith("kv_first") else layer
        return view if self.kind.endswith("hnd") else view.transpose(2, 3)


class PagedCache:
    """One engine's (one tensor-parallel rank's) paged layers, in layer order, as agent blocks and back."""

    def __init__(self, layers: Mapping[str, torch.Tensor], layout: KvLayout, hint: str | PagedLayout = "") -> None:
        if not layers:
            raise ValueError("vLLM registered no KV cache layers")
        names = sorted(layers, key=layer_index)
        if len(names) != layout.layers:
            raise ValueError(f"vLLM registered {len(names)} KV cache layers, the model has {layout.layers}")
        first = layers[names[0]]
        self.paged = (
            hint
            if isinstance(hint, PagedLayout)
            else PagedLayout.infer(first.shape, layout.block_tokens, layout.kv_heads, layout.head_dim, hint)
        )
        dtype = dtype_name(first.dtype)
        if dtype != layout.dtype:
            raise ValueError(f"the paged KV cache holds {dtype}, the layout says {layout.dtype}")
        for name in names:
            if layers[name].shape != first.shape or layers[name].dtype != first.dtype:
                raise ValueError(f"layer {name} is {tuple(layers[name].shape)} {layers[name].dtype}, unlike the first")
        self.names = names
        self.views = [self.paged.blocks_view(layers[n]) for n in names]
        self.layout = layout
        self.device = first.device
        self.dtype = first.dtype
        self.num_blocks = int(self.views[0].shape[0])

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
        stacked = torch.stack([view.index_select(0, ids) for view in self.views], dim=1)  # [n, L, 2, H, bs, D]
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
        for i, view in enumerate(self.views):
            view.index_copy_(0, ids, data[:, i])

    def as_tensor(self, block: Any) -> torch.Tensor:
        """A block as the agent holds it (a host tensor it was given, or the byte array a restore returned)."""
        if isinstance(block, np.ndarray):
            block = torch.from_numpy(block)
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"a KV block is a {type(block).__name__}, not a tensor or an array")
        if block.dtype != self.dtype or tuple(block.shape) != self.block_shape:
            block = block.contiguous().reshape(-1).view(torch.uint8).view(self.dtype).reshape(self.block_shape)
        return block


# -- scheduler -> worker metadata ---------------------------------------------------------------------------------


class ClaimSpec(msgspec.Struct, frozen=True, array_like=True):
    """A new session on this engine: take it (its next generation from the checkpoint service)."""

    session: str


class TruncateSpec(msgspec.Struct, frozen=True, array_like=True):
    """The conversation was rewritten: keep only the session's first ``blocks`` blocks."""

    session: str
    blocks: int


class LoadSpec(msgspec.Struct, frozen=True, array_like=True):
    """Load session blocks ``first .. first + len(block_ids)`` into vLLM blocks ``block_ids``; from the store
    (``from_store``: restore the session, verified) or from the agent's host copy."""

    req_id: str
    session: str
    first: int
    block_ids: list[int]
    from_store: bool


class CopySpec(msgspec.Struct, frozen=True, array_like=True):
    """vLLM blocks ``block_ids`` are the session's full blocks ``first ..``: copy each the agent lacks."""

    req_id: str
    session: str
    first: int
    block_ids: list[int]


class FinishSpec(msgspec.Struct, frozen=True, array_like=True):
    """The request finished with ``tokens`` positions computed in ``block_ids``: copy what the agent lacks (the
    partial tail too), then report the request so vLLM frees its blocks. ``end``: the conversation is over."""

    req_id: str
    session: str
    tokens: int
    block_ids: list[int]
    end: bool = False


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker does in one engine step, in this order: claims, truncates, loads (before the forward),
    copies, finishes (after it)."""

    claims: list[ClaimSpec] = msgspec.field(default_factory=list)
    truncates: list[TruncateSpec] = msgspec.field(default_factory=list)
    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    copies: list[CopySpec] = msgspec.field(default_factory=list)
    finishes: list[FinishSpec] = msgspec.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.claims or self.truncates or self.loads or self.copies or self.finishes)


_plan_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)


def encode_plan(plan: StepPlan) -> bytes:
    return _plan_encoder.encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    """``ValueError`` (one line) for bytes that are not a plan."""
    try:
        return _plan_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"connector metadata is not a gpuwarden step plan: {exc}") from None


# -- scheduler side -----------------------------------------------------------------------------------------------


@dataclass
class _Request:
    session: str
    block_ids: list[int]
    told_full: int = 0
    end: bool = False


@dataclass
class _Offer:
    session: str
    from_store: bool
    num_computed: int
    external: int


class SchedulerBook:
    """The scheduler side's state. ``lookup(session)`` answers how many tokens the newest usable checkpoint of a
    session holds (0: none, or refused); it is asked at most once per request."""

    def __init__(self, block_size: int, lookup: Callable[[str], int]) -> None:
        self.block_size = block_size
        self.lookup = lookup
        self.held: dict[str, list[int]] = {}  # sessions this engine's agents hold: the tokens they hold
        self.requests: dict[str, _Request] = {}
        self.live: dict[str, str] = {}  # session -> the request running it
        self.offers: dict[str, _Offer] = {}
        self.store_tokens: dict[str, int] = {}  # req_id -> what lookup answered
        self.holding: set[str] = set()  # finished requests whose blocks wait for the worker's copy
        self._claims: list[ClaimSpec] = []
        self._truncates: list[TruncateSpec] = []
        self._loads: list[LoadSpec] = []
        self._finishes: list[FinishSpec] = []
        self._copy_specs: list[CopySpec] = []

    def matched(self, req_id: str, session: str | None, prompt: Sequence[int], num_computed: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: tokens beyond ``num_computed`` this connector loads (whole blocks, never
        the prompt's last token), and False (loads are synchronous). Side-effect free but for remembering the
        answer until the request is allocated."""
        if session is None or (session in self.live and self.live[session] != req_id):
            return 0, False  # no session, or another request of it is running: it cannot be copied twice
        limit = max(0, len(prompt) - 1)
        if session in self.held:
            available, from_store = common_prefix(self.held[session], prompt), False
        else:
            if req_id not in self.store_tokens:
                self.store_tokens[req_id] = max(0, int(self.lookup(session)))
            available, from_store = self.store_tokens[req_id], True
        loadable = min(available, limit) // self.block_size * self.block_size
        external = max(0, loadable - num_computed)
        self.offers[req_id] = _Offer(session, from_store, num_computed, external)
        return external, False

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """``update_state_after_alloc``: ``block_ids`` are all the request's blocks (its prefix-cached ones, then
        the new ones); the external tokens follow the locally computed ones."""
        offer = self.offers.pop(req_id, None)
        self.store_tokens.pop(req_id, None)
        if offer is None or num_external <= 0:
            return
        first = offer.num_computed // self.block_size
        count = num_external // self.block_size
        ids = list(block_ids[first : first + count])
        if len(ids) != count:
            log.warning("fewer blocks allocated than tokens offered", extra={"req": req_id, "blocks": len(ids)})
            return
        self._loads.append(LoadSpec(req_id, offer.session, first, ids, offer.from_store))
        if offer.from_store:
            self.held[offer.session] = []  # tokens unknown until the request runs: nothing to compare with
        self.live[offer.session] = req_id

    def new_request(
        self,
        req_id: str,
        session: str | None,
        end: bool,
        prompt: Sequence[int],
        block_ids: Sequence[int],
        num_computed: int,
        num_scheduled: int,
    ) -> None:
        """A request scheduled for the first time (``scheduled_new_reqs``)."""
        if session is None or (session in self.live and self.live[session] != req_id):
            return
        self.live[session] = req_id
        held = self.held.get(session)
        if held is None:
            self._claims.append(ClaimSpec(session))
            self.held[session] = []
        elif held:
            same = common_prefix(held, prompt)
            if same < len(held):
                self._truncates.append(TruncateSpec(session, same // self.block_size))
        self.requests[req_id] = _Request(session, list(block_ids), end=end)
        self._copies_for(req_id, num_computed, num_scheduled)

    def cached_request(
        self, req_id: str, new_block_ids: Sequence[int] | None, resumed: bool, num_computed: int, num_scheduled: int
    ) -> None:
        """A request scheduled again (``scheduled_cached_reqs``): its new blocks are appended, or replace its
        blocks when it resumed from preemption."""
        request = self.requests.get(req_id)
        if request is None:
            return
        if resumed:
            request.block_ids = list(new_block_ids or [])
        elif new_block_ids:
            request.block_ids.extend(new_block_ids)
        self._copies_for(req_id, num_computed, num_scheduled)

    def _copies_for(self, req_id: str, num_computed: int, num_scheduled: int) -> None:
        request = self.requests[req_id]
        # a rollback (preemption, or blocks that failed to load and are recomputed) re-tells what is computed again
        request.told_full = min(request.told_full, num_computed // self.block_size)
        full = min((num_computed + num_scheduled) // self.block_size, len(request.block_ids))
        if full > request.told_full:
            spec = CopySpec(req_id, request.session, request.told_full, request.block_ids[request.told_full : full])
            request.told_full = full
            self._copy_specs.append(spec)

    def finished(self, req_id: str, block_ids: Sequence[int], num_computed: int, tokens: Sequence[int]) -> bool:
        """``request_finished``: True when the worker must first copy the request's blocks (vLLM then holds them
        until the worker reports the request done)."""
        request = self.requests.pop(req_id, None)
        self.offers.pop(req_id, None)
        self.store_tokens.pop(req_id, None)
        if request is None:
            return False
        if self.live.get(request.session) == req_id:
            del self.live[request.session]
        if request.end:
            self.held.pop(request.session, None)
        else:
            self.held[request.session] = list(tokens[:num_computed])
        self._finishes.append(FinishSpec(req_id, request.session, num_computed, list(block_ids), request.end))
        if num_computed <= 0 or not block_ids:
            return False
        self.holding.add(req_id)
        return True

    def released(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests' copies done (``KVConnectorOutput.finished_sending``)."""
        self.holding.difference_update(req_ids)

    def build(self) -> StepPlan:
        """``build_connector_meta``: everything since the last step; the book starts the next step empty."""
        plan = StepPlan(
            claims=self._claims,
            truncates=self._truncates,
            loads=self._loads,
            copies=self._copy_specs,
            finishes=self._finishes,
        )
        self._claims, self._truncates, self._loads, self._copy_specs, self._finishes = [], [], [], [], []
        return plan


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    arr_a = np.asarray(a[:n], dtype=np.int64)
    arr_b = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(arr_a != arr_b)
    return int(diff[0]) if diff.size else n


# -- the agent's event loop ---------------------------------------------------------------------------------------


class AgentLoop:
    """An asyncio loop in a daemon thread: vLLM's hooks are synchronous, the agent, its store and NATS are not.
    ``ordered`` work runs one item at a time in submission order (a block copied before the session is claimed
    would otherwise be lost); ``call`` waits for a coroutine's result."""

    def __init__(self, name: str = "gpuwarden-kv") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._queue: asyncio.Queue[tuple[Callable[[], Coroutine[Any, Any, Any]], concurrent.futures.Future[Any]]]
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._queue = asyncio.Queue()
        self._worker = self.loop.create_task(self._drain())
        self._ready.set()
        self.loop.run_forever()

    async def _drain(self) -> None:
        while True:
            make, future = await self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(await make())
                except BaseException as exc:  # handed to whoever waits
                    future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise

    def ordered(self, make: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._queue.put_nowait, (make, future))
        return future

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Cancel what is left (the queue's worker, any pending work), then stop the loop and its thread."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop)
        self._thread.join(timeout=5)
        with contextlib.suppress(RuntimeError):
            self.loop.close()


# -- worker side --------------------------------------------------------------------------------------------------


class SessionPort:
    """How a worker takes and restores sessions: through the checkpoint service (``AgentEndpoint``, which hands
    out generations) or, without one, the agent alone (generation 0)."""

    def __init__(self, agent: KvAgent, endpoint: Any = None, claim_timeout_s: float = 10.0) -> None:
        self.agent = agent
        self.endpoint = endpoint
        self.claim_timeout_s = claim_timeout_s

    async def claim(self, session: str) -> None:
        if session in self.agent.sessions():
            return
        if self.endpoint is not None:
            from shared.kv.endpoint import LocateRefused  # the endpoint's module, loaded with it

            try:
                await self.endpoint.start_session(session, self.claim_timeout_s)
                return
            except (TimeoutError, LocateRefused, StoreError, OSError) as exc:
                log.warning("could not claim the session; held under generation 0", extra={"error": str(exc)})
        self.agent.register_session(session)

    async def restore(self, session: str) -> int:
        """Restore the session's newest good checkpoint into the agent; its token count (0: none usable, the
        session is then held fresh)."""
        try:
            if self.endpoint is not None:
                restored = await self.endpoint.restore(session, timeout=self.claim_timeout_s)
            else:
                restored = await self.agent.restore(session)
        except StoreError as exc:  # CheckpointNotFound, ChunkCorrupt, ManifestCorrupt: nothing usable
            log.warning("restore found nothing usable", extra={"session": session, "error": str(exc)})
            if session not in self.agent.sessions():
                self.agent.register_session(session)
            return 0
        if restored.fell_back_from:
            log.warning("restored an older checkpoint", extra={"session": session, "skipped": restored.fell_back_from})
        return restored.manifest.token_count

    def end(self, session: str) -> None:
        if self.endpoint is not None:
            self.endpoint.end_session(session)
        else:
            self.agent.forget_session(session)


@dataclass
class StepReport:
    """What a worker step did, for the connector's hooks and for tests."""

    loaded_blocks: int = 0
    copied_blocks: int = 0
    load_errors: set[int] = field(default_factory=set)


class WorkerBook:
    """The worker side: executes step plans against the paged cache and the agent (through ``loop``, in order).

    ``held_full[s]``: how many full blocks of session ``s`` the agent has (or will have, once the ordered work
    queued so far ran); copies fill it up one block at a time and never leave a gap."""

    def __init__(
        self,
        agent: KvAgent,
        loop: AgentLoop,
        port: SessionPort,
        save_on_finish: bool = False,
        load_timeout_s: float = 120.0,
    ) -> None:
        self.agent = agent
        self.loop = loop
        self.port = port
        self.save_on_finish = save_on_finish
        self.load_timeout_s = load_timeout_s
        self.cache: PagedCache | None = None
        self.held_full: dict[str, int] = {}
        self._tainted: dict[str, int] = {}  # req_id -> first block whose load failed in this step
        self._done: set[str] = set()  # finished requests whose blocks are copied
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()
        self._saves: list[concurrent.futures.Future[Any]] = []

    @property
    def bs(self) -> int:
        return self.agent.layout.block_tokens

    def register(self, cache: PagedCache) -> None:
        if cache.layout != self.agent.layout:
            raise ValueError("the paged cache and the agent disagree on the layout")
        self.cache = cache

    def _paged(self) -> PagedCache:
        if self.cache is None:
            raise RuntimeError("register_kv_caches was not called before the first step")
        return self.cache

    # before the forward pass
    def before_forward(self, plan: StepPlan) -> StepReport:
        report = StepReport()
        self._tainted.clear()
        for claim in plan.claims:
            if claim.session not in self.held_full:
                self.held_full[claim.session] = 0
                self.loop.ordered(lambda s=claim.session: self.port.claim(s))  # type: ignore[misc]
        for cut in plan.truncates:
            self.held_full[cut.session] = min(self.held_full.get(cut.session, 0), cut.blocks)
            self.loop.ordered(lambda c=cut: self._truncate(c.session, c.blocks))  # type: ignore[misc]
        for load in plan.loads:
            self._load(load, report)
        self._load_errors |= report.load_errors
        return report

    async def _truncate(self, session: str, blocks: int) -> None:
        if session in self.agent.sessions():
            self.agent.truncate(session, blocks)

    def _load(self, load: LoadSpec, report: StepReport) -> None:
        cache = self._paged()
        want = len(load.block_ids)

        async def fetch() -> list[Any]:
            if load.from_store:
                tokens = await self.port.restore(load.session)
            else:
                tokens = self.agent.tokens(load.session) if load.session in self.agent.sessions() else 0
            full = tokens // self.bs
            self.held_full[load.session] = full
            blocks = self.agent.blocks(load.session) if load.session in self.agent.sessions() else []
            return list(blocks[load.first : min(full, load.first + want)])

        try:
            blocks = self.loop.ordered(fetch).result(self.load_timeout_s)
        except Exception as exc:  # a failed load is recomputed by vLLM, never a crash
            log.warning("loading a session failed", extra={"session": load.session, "error": str(exc)})
            blocks = []
        try:
            cache.scatter(load.block_ids[: len(blocks)], blocks)
        except (TypeError, ValueError, RuntimeError) as exc:
            log.warning(
                "restored blocks do not fit the paged cache", extra={"session": load.session, "error": str(exc)}
            )
            blocks = []
        report.loaded_blocks += len(blocks)
        if len(blocks) < want:
            failed = load.block_ids[len(blocks) :]
            report.load_errors.update(failed)
            first_bad = load.first + len(blocks)
            self._tainted[load.req_id] = first_bad
            self.held_full[load.session] = min(self.held_full.get(load.session, 0), first_bad)
            self.loop.ordered(lambda: self._truncate(load.session, first_bad))

    # after the forward pass
    def after_forward(self, plan: StepPlan) -> StepReport:
        report = StepReport()
        for copy in plan.copies:
            report.copied_blocks += self._copy(copy.req_id, copy.session, copy.first, copy.block_ids, None)
        for finish in plan.finishes:
            report.copied_blocks += self._finish(finish)
        return report

    def _copy(self, req_id: str, session: str, first: int, block_ids: Sequence[int], tail: int | None) -> int:
        """Copy the blocks the agent lacks among ``first ..`` (the last one partial, ``tail`` positions, when given);
        returns how many were copied."""
        held = self.held_full.get(session)
        if held is None:
            return 0  # never claimed here (a request of a session that another request runs)
        limit = self._tainted.get(req_id, len(block_ids) + first)
        indexes = [first + i for i in range(len(block_ids)) if held <= first + i < limit]
        if not indexes or indexes[0] != held:
            return 0  # nothing new, or a gap the agent cannot hold: recomputed blocks are told again later
        ids = [block_ids[i - first] for i in indexes]
        full_count = len(ids) if tail is None else len(ids) - 1
        tokens = [self.bs] * full_count + ([] if tail is None else [tail])
        host = self._paged().gather(ids, tokens)
        self.held_full[session] = held + full_count
        end_tokens = (held + full_count) * self.bs + (0 if tail is None else tail)
        self.loop.ordered(lambda: self._put(session, held, host, end_tokens))
        return len(host)

    async def _put(self, session: str, first: int, blocks: list[torch.Tensor], tokens: int) -> None:
        if session not in self.agent.sessions():
            self.agent.register_session(session)
        count = len(self.agent.blocks(session))
        if first > count:
            log.warning("a gap in a session's blocks; not kept", extra={"session": session, "first": first})
            return
        for i, block in enumerate(blocks, first):
            if i < count:
                self.agent.update_block(session, i, block)
            else:
                self.agent.append_block(session, block, tokens=min(tokens, (i + 1) * self.bs))
        self.agent.truncate(session, first + len(blocks))  # a stale tail beyond what was just written
        self.agent.set_tokens(session, tokens)

    def _finish(self, finish: FinishSpec) -> int:
        copied = 0
        full, tail = divmod(finish.tokens, self.bs)
        if finish.session in self.held_full and finish.tokens > 0:
            held = self.held_full[finish.session]
            ids = list(finish.block_ids[held : full + (1 if tail else 0)])
            if ids and held <= full:
                copied = self._copy(finish.req_id, finish.session, held, ids, tail if tail else None)
        session = finish.session
        if finish.end:
            self.held_full.pop(session, None)
            self.loop.ordered(lambda: self._end(session))
        elif self.save_on_finish and session in self.held_full:
            self._saves.append(self.loop.ordered(lambda: self.agent.save([session], reason="finish")))
        self._done.add(finish.req_id)
        return copied

    async def _end(self, session: str) -> None:
        self.port.end(session)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """``get_finished``'s sending half: finished requests whose blocks were copied; each once."""
        self._finished_seen.update(finished_req_ids)
        ready = self._done & self._finished_seen
        self._done -= ready
        self._finished_seen -= ready
        return ready

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self, timeout: float | None = None) -> list[Any]:
        """Wait for the ordered work queued so far (and the saves it started); returns the save reports."""
        self.loop.ordered(_nothing).result(timeout)
        saves, self._saves = self._saves, []
        return [s.result(timeout) for s in saves]


async def _nothing() -> None:
    return None


# -- what a checkpoint holds (scheduler side) ---------------------------------------------------------------------


async def checkpoint_tokens(
    store: CheckpointStore, layout: KvLayout, session: str, bus: Any = None, pod: str = ""
) -> int:
    """Tokens the newest checkpoint of ``session`` holds (0 when there is none, or it is of another layout, which
    is refused and logged). With ``bus``, the checkpoint service says which checkpoints count (newest first),
    asked as ``pod`` (the credentials' pod)."""
    ids: list[str]
    if bus is not None:
        from shared.contract.checkpoint import CheckpointLocation, LocateCheckpoint

        answer = await bus.request(
            bus.subjects.agent_command("locate", pod),
            LocateCheckpoint(session_id=session, pod=pod, take_session=False),
            5.0,
        )
        if not isinstance(answer, CheckpointLocation) or not answer.found:
            return 0
        ids = list(answer.candidates) or [answer.checkpoint_id]
    else:
        ids = newest_first(await store.checkpoints(session))
    for cid in ids[:1]:
        try:
            manifest = await store.manifest(session, cid)
        except CheckpointNotFound:
            return 0
        try:
            check_compatible(manifest, layout)
        except ValueError as exc:
            log.warning("checkpoint refused", extra={"session": session, "error": str(exc)})
            return 0
        return manifest.token_count
    return 0
