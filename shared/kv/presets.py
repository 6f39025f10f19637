"""KV layouts of known models, typed once: the example, the benchmarks, the tests and the simulation's default
model take theirs from here (``msgspec.structs.replace`` for a smaller slice of one)."""

from __future__ import annotations

from shared.kv.manifest import KvLayout

LLAMA_3_8B = KvLayout(
    model_id="meta-llama/Meta-Llama-3-8B",
    model_version="1",
    tokenizer_id="llama3",
    dtype="float16",
    block_tokens=16,
    layers=32,
    kv_heads=8,
    head_dim=128,
)
"""Llama 3 8B in float16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 128 KiB per token, 2 MiB per block."""

LLAMA_3_8B_WEIGHTS_MIB = 15316
"""Its weights in MiB: 8.03 B parameters x 2 bytes."""

LLAMA_3_8B_MAX_MODEL_LEN = 8192
"""Its context: the longest session, prompt and output, in tokens."""
