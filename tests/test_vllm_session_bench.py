"""bench.vllm_session (the GPU kit's vLLM script) where vLLM is absent: the script still runs and writes its JSON
saying why it could not go on, and the model it builds (what vLLM would load by path) loads and runs in transformers
with its tokenizer."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vllm_session

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the GPU kit runs it")
def test_without_vllm_the_script_writes_its_json_and_fails_plainly(tmp_path: Path) -> None:
    out = tmp_path / "vllm-session.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.vllm_session", "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 1
    results = json.loads(out.read_text())
    assert results["ok"] is False and results["session"] == vllm_session.SESSION
    assert "No module named 'vllm'" in results["error"]


def test_the_model_it_builds_loads_and_answers_in_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    vllm_session.build_model(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = vllm_session.prompt_ids(1, 12)
    assert ids == vllm_session.prompt_ids(1, 12) and all(3 <= i < 512 for i in ids)
    assert tokenizer(" ".join(f"w{i}" for i in ids), add_special_tokens=False)["input_ids"] == ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 12, 512) and bool(torch.isfinite(logits.float()).all())
