"""A second inference pod in its own process: it builds the same tiny Llama, restores a session's cache from the
store and goes on with the conversation.

Usage: python -m tests.kv_transformers_worker STORE_DIR SESSION TOKEN_IDS NEW_TOKENS OUT
TOKEN_IDS: the conversation so far (comma-separated), whose KV the checkpoint holds up to the last token. Writes
the generated sequence and each step's logits to OUT (``torch.save``) and prints "restored <tokens>".
"""

from __future__ import annotations

import asyncio
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.kv.agent import KvAgent
from shared.kv.engines import restore_cache
from shared.kv.engines.huggingface import TransformersEngine
from shared.kv.filestore import FileStore

BLOCK_TOKENS = 8


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A 2-layer Llama with grouped-query attention (4 heads, 2 KV heads), random weights from ``seed``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def greedy(
    model: LlamaForCausalLM, ids: torch.Tensor, cache: object, new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding through ``generate`` with the session's cache: the sequence and every step's logits."""
    with torch.no_grad():
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences, torch.stack(out.logits)


async def main(store_dir: str, session: str, token_ids: str, new_tokens: int, out: str) -> None:
    torch.set_num_threads(1)
    engine = TransformersEngine(tiny_llama(), block_tokens=BLOCK_TOKENS)
    agent = KvAgent(
        FileStore(store_dir), pod="llama-1", node="node-2", namespace="llm", deployment="llama", layout=engine.layout
    )
    cache, restored = await restore_cache(agent, engine, session)
    print(f"restored {restored.manifest.token_count}", flush=True)
    ids = torch.tensor([[int(t) for t in token_ids.split(",")]])
    sequences, logits = greedy(engine.model, ids, cache, new_tokens)
    torch.save({"sequences": sequences, "logits": logits}, out)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], int(a[3]), a[4]))
