"""The vLLM case of ``bench.resume``: the same seeded Llama served by two vLLM engines (vLLM's CPU build, in
``.venv-vllm``; ``bench.vllm_engine``), gpuwarden's connector in both, a file store between them.

For each context and round, engine A prefills a conversation of that many tokens and picks its reply token; its
connector commits the session's checkpoint as the request finishes (``save_on_finish``: the same ``KvAgent.save``
a drain's command runs). Then on engine B, which never held the conversation, its next turn (the conversation and
the reply token) is served twice, one token each time (which goes first alternates between rounds):

- **resume**: as a request of the session: B's connector finds the checkpoint, restores it from the store (every
  chunk verified; the store's files dropped from the page cache first) into the blocks vLLM allocated, and vLLM
  computes only what the checkpoint does not hold (less than a block) and the next token;
- **recompute**: as a request without a session: vLLM prefills the whole conversation.

Times are vLLM's own ``generate`` calls, medians over the rounds; ``vllm_resume_vs_recompute_<ctx>`` is the ratio
of the medians. ``vllm_resume_exact``: every resume gave the same next token as its recompute;
``vllm_resume_logprobs_identical``: with the same log-probability, bit for bit.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import drop_cache, median
from bench.vllm_engine import BLOCK_SIZE, VLLM_PYTHON, EngineProcess, build_model


def _conversation(seed: int, tokens: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(tokens)]


def _wait_for_checkpoint(store: Path, session: str, timeout: float = 120.0) -> None:
    """A's save runs on its connector's loop after the request returned: wait for its manifest (loudly)."""
    deadline = time.monotonic() + timeout
    while not list((store / "sessions" / session).glob("*.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint of {session} in {timeout:.0f} s")
        time.sleep(0.05)


def measure_vllm(
    shape: Any, contexts: Sequence[int], rounds: int, directory: Path | None = None, label: Any = str
) -> dict[str, Any]:
    """The vLLM figures (``vllm_*`` keys) for a model of ``shape`` (``bench.resume.ModelShape``); empty when the
    vLLM virtualenv is missing (the report then lacks them: missing, never 0)."""
    if not VLLM_PYTHON.exists():
        return {"vllm_missing": f"{VLLM_PYTHON} not found: `make install` makes it"}
    work = Path(tempfile.mkdtemp(prefix="gw-resume-vllm-", dir=directory))
    store = work / "store"
    store.mkdir()
    model = build_model(
        work / "model",
        layers=shape.layers,
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        vocab=shape.vocab,
        max_positions=max(contexts) + 64,
    )
    common = {"store": f"file://{store}", "extra_args": ["--max-model-len", str(max(contexts) + 64)]}
    a = EngineProcess(model, work / "vllm-a.log", pod="bench-a", save_on_finish=True, **common)  # type: ignore[arg-type]
    b = EngineProcess(model, work / "vllm-b.log", pod="bench-b", **common)  # type: ignore[arg-type]
    results: dict[str, Any] = {}
    try:
        started = time.monotonic()
        a.wait_ready()
        b.wait_ready()
        results["vllm_engines_ready_s"] = round(time.monotonic() - started, 2)
        exact, identical, detail = True, True, []
        for ctx in contexts:
            got: dict[str, list[float]] = {"resume": [], "recompute": []}
            for r in range(rounds):
                session = f"bench-{ctx}-{r}"
                prompt = _conversation(ctx * 1000 + r, ctx, shape.vocab)
                reply = a.generate(prompt, 1, session=session)["tokens"]
                _wait_for_checkpoint(store, session)
                turn = prompt + reply
                answers: dict[str, dict[str, Any]] = {}
                for way in ("resume", "recompute") if r % 2 == 0 else ("recompute", "resume"):
                    if way == "resume":
                        drop_cache(store)
                    answers[way] = b.generate(turn, 1, session=session if way == "resume" else "")
                    got[way].append(answers[way]["seconds"])
                resume, recompute = answers["resume"], answers["recompute"]
                expected = (len(turn) - 1) // BLOCK_SIZE * BLOCK_SIZE
                if resume["cached"] != expected:
                    raise RuntimeError(
                        f"{session}: resume loaded {resume['cached']} tokens, not {expected}; engine B's {b.tail()}"
                    )
                exact = exact and resume["tokens"] == recompute["tokens"]
                identical = identical and resume["logprobs"] == recompute["logprobs"]
                detail.append({"context": ctx, "round": r, "resume": resume, "recompute": recompute})
            lab = label(ctx)
            results[f"vllm_resume_s_{lab}"] = median(got["resume"])
            results[f"vllm_recompute_s_{lab}"] = median(got["recompute"])
            results[f"vllm_resume_vs_recompute_{lab}"] = median(got["recompute"]) / median(got["resume"])
        results["vllm_resume_exact"] = 1 if exact else 0
        results["vllm_resume_logprobs_identical"] = 1 if identical else 0
        results["vllm_detail"] = detail
    finally:
        a.stop()
        b.stop()
        shutil.rmtree(work, ignore_errors=True)
    return results
