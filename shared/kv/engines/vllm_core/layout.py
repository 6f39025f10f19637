"""The layout a vLLM engine computes its KV cache in, read from its configuration (model, weights and tokenizer
digests, KV dtype, shape, rank), and what the connector refuses to checkpoint."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.kv.manifest import KvLayout

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
