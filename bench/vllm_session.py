"""The vLLM connector on a real GPU: a conversation saved by one vLLM process continues in another, token for token.

    python -m bench.vllm_session --out results.json [--work DIR] [--tokens 24]

1. Builds a tiny Llama with random weights from a fixed seed (4 layers, 8 heads, 4 KV heads, head size 64, vocab
   512; a word-level tokenizer), saved as safetensors to a local folder: nothing is downloaded, vLLM loads it by path.
2. Process A serves it with the gpuwarden connector (``kv_connector_module_path``: ``shared.kv.engines.vllm``; a file
   store; ``save_on_finish``, which stands in for the checkpoint service's drain command: the very same
   ``KvAgent.save``), runs turn 1 of session ``bench-1`` greedily and exits.
3. Process B (a second server, nothing cached) runs turn 2: the conversation so far plus a new message. The connector
   finds the checkpoint, loads it into the blocks vLLM allocated, and vLLM computes only the rest.
4. Process C runs turn 2 without the connector (the reference: everything computed from the prompt).

The results JSON (``--out``, also printed) says how many tokens B took from the checkpoint (vLLM's
``num_cached_tokens`` of B's request; C's is 0), the continuations of B and C, whether they are equal token for
token, and the first position where they differ if not. Each process is a fresh interpreter
(``python -m bench.vllm_session --role ...``), as a second server would be.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SESSION = "bench-1"


def build_model(folder: Path, seed: int = 1234) -> None:
    """A tiny Llama (random weights from ``seed``) and a word-level tokenizer, saved where vLLM can load them."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.bfloat16()
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def prompt_ids(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run_role(args: argparse.Namespace) -> None:
    """One vLLM process: generate greedily for ``--prompt`` (a JSON list of token ids) and print the result."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if args.store:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="GpuwardenConnector",
            kv_connector_module_path="shared.kv.engines.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"store": f"file://{args.store}", "pod": f"bench-{args.role}", "nats": False},
        )
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        block_size=16,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=1024,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": {"gpuwarden_session": SESSION}} if args.store else None,
    )
    prompt = json.loads(args.prompt)
    started = time.monotonic()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)
    seconds = time.monotonic() - started
    completion = out[0].outputs[0]
    print(
        "RESULT "
        + json.dumps(
            {
                "role": args.role,
                "tokens": list(completion.token_ids),
                "seconds": round(seconds, 4),
                "num_cached_tokens": getattr(out[0], "num_cached_tokens", None),
            }
        ),
        flush=True,
    )
    del llm


def child(role: str, model: Path, prompt: list[int], tokens: int, store: Path | None, log: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.vllm_session", "--role", role, "--model", str(model)]
    command += ["--prompt", json.dumps(prompt), "--tokens", str(tokens)]
    if store is not None:
        command += ["--store", str(store)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"role {role} failed (exit {proc.returncode}); see {log}: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["process_seconds"] = round(time.monotonic() - started, 2)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("vllm-session.json"))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--role", default="")
    parser.add_argument("--model", default="")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--store", default="")
    args = parser.parse_args()
    if args.role:
        run_role(args)
        return 0

    work = args.work or Path(tempfile.mkdtemp(prefix="gpuwarden-vllm-"))
    model, store, logs = work / "model", work / "store", work
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"session": SESSION, "ok": False}
    try:
        import vllm

        results["vllm"] = vllm.__version__
        build_model(model)
        turn1 = prompt_ids(1, 45)
        a = child("a", model, turn1, args.tokens, store, logs / "vllm-a.log")
        checkpoints = sorted(p.name for p in (store / "sessions" / SESSION).glob("*.json"))
        turn2 = turn1 + a["tokens"] + prompt_ids(2, 13)
        b = child("b", model, turn2, args.tokens, store, logs / "vllm-b.log")
        c = child("c", model, turn2, args.tokens, None, logs / "vllm-c.log")
        same = b["tokens"] == c["tokens"]
        first_diff = next((i for i, (x, y) in enumerate(zip(b["tokens"], c["tokens"], strict=False)) if x != y), None)
        # turn 1 computed len(turn1) + tokens - 1 positions: whole blocks of 16 are what B may load
        expected_loaded = (len(turn1) + args.tokens - 1) // 16 * 16
        results.update(
            turn1_prompt_tokens=len(turn1),
            turn2_prompt_tokens=len(turn2),
            checkpoints_after_a=checkpoints,
            a=a,
            b_restored=b,
            c_reference=c,
            expected_loaded_tokens=expected_loaded,
            loaded_as_expected=b.get("num_cached_tokens") == expected_loaded and not c.get("num_cached_tokens"),
            continuation_equal=same,
            first_difference=first_diff,
            ok=bool(checkpoints) and same and b.get("num_cached_tokens") == expected_loaded,
        )
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k not in ("a", "b_restored", "c_reference")}, indent=2))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
