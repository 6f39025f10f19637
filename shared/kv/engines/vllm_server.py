"""A vLLM engine in a process of its own, driven over its stdin and stdout: tests/test_kv_vllm.py, bench/resume.py
and the simulation's vLLM pods (``shared.sim.vllmpods``) run gpuwarden's connector inside real vLLM engines through
it (vLLM's CPU build, in ``.venv-vllm``).

    .venv-vllm/bin/python -m shared.kv.engines.vllm_server --model DIR [--store file:///DIR] [--pod P] [--nats]

The model is a Llama built from a config with seeded weights (``build_model``; nothing is downloaded), loaded by
path without a tokenizer: prompts are token ids. Each line read is a JSON request; each answer is one line on stdout
starting with ``RESULT`` (vLLM's own logging goes to stderr)::

    {"prompt": [ids], "max_tokens": 8, "session": "chat-1", "end": false}
    RESULT {"tokens": [...], "logprobs": [...], "cached": 64, "seconds": 0.12}

``session`` names the gpuwarden session (``kv_transfer_params``); without it the request is served as vLLM serves
any other. Greedy decoding (temperature 0, EOS ignored); ``logprobs`` are those of the chosen tokens. A request
``{"stop": true}`` ends the engine (the connector's ``shutdown`` runs); a request ``{"op": NAME, ...}`` is answered
by the ``ops`` handler of that name that ``serve`` was given (the simulation's pods use them,
``shared.sim.vllmproc``). The connector's settings beyond these flags come from ``GPUWARDEN_*`` variables
(``ConnectorConfig``): with ``--nats`` it answers the checkpoint service.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
"""The interpreter of the second virtualenv (``make install``), where vLLM's CPU build lies."""

BLOCK_SIZE = 32
"""vLLM's block size here: the CPU attention backend accepts only multiples of 32."""


def build_model(
    folder: Path,
    seed: int = 1234,
    *,
    layers: int = 2,
    hidden: int = 128,
    intermediate: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    max_positions: int = 8192,
) -> Path:
    """A Llama of this shape (by default 2 layers, 128 wide, 4 heads of 32 and 2 KV heads, a vocabulary of 512)
    with weights drawn from ``seed``, saved as safetensors in ``folder`` (once: an existing ``config.json`` is
    kept). Any transformers that knows Llama builds it; vLLM loads it by path."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(state)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


Op = Callable[[Any, dict[str, Any]], dict[str, Any]]
"""A request handler beside generation: given the engine (``vllm.LLM``) and the request, the answer."""


def serve(args: argparse.Namespace, ops: Mapping[str, Op] | None = None) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if args.store:
        from vllm.config import KVTransferConfig

        extra: dict[str, Any] = {
            "store": args.store,
            "pod": args.pod,
            "nats": args.nats,
            "announce_s": args.announce_s,
            "lookup_timeout_s": args.lookup_timeout_s,
        }
        if not args.nats:
            extra["save_on_finish"] = args.save_on_finish
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="GpuwardenConnector",
            kv_connector_module_path="shared.kv.engines.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    if getattr(args, "served_name", ""):
        kwargs["served_model_name"] = args.served_name
    if getattr(args, "revision", ""):
        kwargs["revision"] = kwargs["tokenizer_revision"] = args.revision
    llm = LLM(
        model=str(args.model),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",  # with VLLM_ENABLE_V1_MULTIPROCESSING=0: one process, one vLLM import
        seed=0,
        **kwargs,
    )
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("stop"):
            break
        if request.get("op"):
            handler = (ops or {}).get(str(request["op"]))
            try:
                if handler is None:
                    raise ValueError(f"unknown op {request['op']!r}")
                answer = handler(llm, request)
            except Exception as exc:  # the caller hears why; the engine serves on
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print("RESULT " + json.dumps(answer), flush=True)
            continue
        transfer = None
        if request.get("session"):
            transfer = {"gpuwarden_session": request["session"], "gpuwarden_end": bool(request.get("end"))}
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(request["max_tokens"]),
            ignore_eos=True,
            logprobs=1,
            detokenize=False,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
        )
        started = time.monotonic()
        out = llm.generate([TokensPrompt(prompt_token_ids=list(request["prompt"]))], params, use_tqdm=False)
        seconds = time.monotonic() - started
        settle(llm)
        completion = out[0].outputs[0]
        logprobs = [
            step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs or [], strict=True)
        ]
        answer = {
            "tokens": list(completion.token_ids),
            "logprobs": logprobs,
            "cached": getattr(out[0], "num_cached_tokens", None),
            "finish_reason": completion.finish_reason,
            "seconds": round(seconds, 4),
        }
        print("RESULT " + json.dumps(answer), flush=True)
    llm.llm_engine.engine_core.shutdown()


class EngineProcess:
    """One engine process, from the other side of its pipes (no vLLM here): ``start`` waits for it to be ready,
    ``generate`` sends one request and returns its answer, ``stop`` ends it. Its stderr (vLLM's log) goes to
    ``log``, and the last lines of it are in every error."""

    def __init__(
        self,
        model: Path,
        log: Path,
        store: str = "",
        pod: str = "vllm-0",
        nats: bool = False,
        save_on_finish: bool = False,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        python: Path = VLLM_PYTHON,
        module: str = "shared.kv.engines.vllm_server",
    ) -> None:
        command = [str(python), "-m", module, "--model", str(model), "--pod", pod, *extra_args]
        if store:
            command += ["--store", store]
        if nats:
            command.append("--nats")
        if save_on_finish:
            command.append("--save-on-finish")
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {prefix!r} from the engine in {timeout:.0f} s; {self.tail()}") from None
            if line is None:
                raise RuntimeError(f"the engine exited ({self.proc.wait()}); {self.tail()}")
            if line.startswith(prefix):
                return line[len(prefix) :]

    def tail(self) -> str:
        self._log_file.flush()
        lines = self.log.read_text(errors="replace").splitlines()
        return f"log ({self.log}) ends:\n" + "\n".join(lines[-25:])

    def wait_ready(self, timeout: float = 600.0) -> EngineProcess:
        self._next("READY", timeout)
        return self

    def generate(
        self, prompt: Sequence[int], max_tokens: int, session: str = "", end: bool = False, timeout: float = 300.0
    ) -> dict[str, Any]:
        request = {"prompt": list(prompt), "max_tokens": max_tokens, "session": session, "end": end}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._next("RESULT ", timeout))
        return answer

    def call(self, op: str, timeout: float = 300.0, **fields: Any) -> dict[str, Any]:
        """One ``op`` request (``serve``'s ``ops``); its answer, or ``RuntimeError`` with the reason it failed."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._next("RESULT ", timeout))
        if "error" in answer:
            raise RuntimeError(f"engine op {op}: {answer['error']}")
        return answer

    def kill(self) -> None:
        """End the process at once (SIGKILL): a crash, nothing saved or flushed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log_file.close()

    def stop(self, timeout: float = 60.0) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"stop": True}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._log_file.close()


def settle(llm: Any, steps: int = 1000) -> None:
    """Step an in-process engine while its scheduler still holds finished requests (blocks the connector copies
    before vLLM frees them), as a server's engine-core loop does between requests: ``generate`` returns first."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    for _ in range(steps):
        if core is None or not core.scheduler.has_requests():
            return
        client.get_output()
    raise RuntimeError(f"the engine still holds requests after {steps} steps")


def parser() -> argparse.ArgumentParser:
    """The engine process's arguments (``shared.sim.vllmproc`` adds its own)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--store", default="", help="the connector's checkpoint store (none: vLLM without it)")
    parser.add_argument("--pod", default="vllm-0")
    parser.add_argument("--nats", action="store_true", help="answer the checkpoint service (GPUWARDEN_NATS_URL)")
    parser.add_argument("--save-on-finish", action="store_true", help="without NATS: commit after each request")
    parser.add_argument("--announce-s", type=float, default=5.0, help="how often the agent announces its sessions")
    parser.add_argument(
        "--lookup-timeout-s",
        type=float,
        default=30.0,
        help="how long the scheduler waits to learn what a checkpoint holds (the connector's default is 5 s; the "
        "machines these tests share can be far busier than a server)",
    )
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--served-name", default="", help="the model's name (default: its path)")
    parser.add_argument("--revision", default="", help="the model's version (default: unversioned)")
    return parser


def engine_environment() -> None:
    """vLLM's settings for an engine process here, unless the environment sets them."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the answers
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's default takes far more than needed here
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the cores are shared: pin no thread to one
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one start


def main() -> None:
    args = parser().parse_args()
    engine_environment()
    build_model(args.model)
    serve(args)


if __name__ == "__main__":
    main()
