"""Simulated pods that serve with vLLM (``model.engine: vllm``): each pod runs its own vLLM engine process (vLLM's
CPU build, ``shared.sim.vllmproc``) with gpuwarden's KV connector in it; the pod's side is here.

The engine decodes: each turn is one vLLM request whose prompt is the whole conversation so far (token ids, as a
chat client sends its messages again), decoded greedily, under the session's name (``kv_transfer_params``), so the
connector copies every block vLLM fills out of its paged cache. After each turn the pod takes the connector's
copies into its own KV agent (``blocks``), the agent that answers the checkpoint service: a drain, a periodic save
or a preStop writes what vLLM computed. A restore goes the other way: the agent restores and verifies the
checkpoint, the pod checks it against the conversation replayed (below) and hands it to the engine (``put``), and
the session's next request loads it through the connector into vLLM's paged cache, as a restore in a real vLLM
does. A pod that goes stops its engine; a pod killed kills it (``close``).

Reference runs: vLLM computes the same bits for the same requests in the same order (one engine configuration,
greedy, float32, one CPU build), so replaying a conversation's requests in an engine, under a scratch session,
gives the KV an uninterrupted run holds. A restored checkpoint is verified against that replay position by
position (every position it holds, block by block); a preempted session is recomputed by the same replay, so its
blocks come out the same bits. A checkpoint older than the conversation (a pod killed between journal entries) is
taken up to the whole blocks the first request it lacks loaded, and the requests from there run again
(``_resume_point``): the session then holds what an uninterrupted run holds, bit for bit.

The engines' processes run in the vLLM virtualenv (``GPUWARDEN_SIM_VLLM_DIR``, by default ``.venv-vllm`` of this
checkout, made by ``make install``). Each takes tens of seconds to start on a shared CPU: a pod's first request
waits for its engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from shared.kv.agent import KvAgent, RestoredSession
from shared.kv.buffers import as_block
from shared.kv.engines import SessionCheck, blocks_for, prompt_ids
from shared.kv.engines.vllm_core.layout import _WEIGHT_FILES, files_digest
from shared.kv.engines.vllm_server import EngineProcess
from shared.kv.manifest import KvLayout, tokens_digest_of
from shared.plumbing.settings import any_path, documented, setting, settings_from_env
from shared.sim.spec import ModelShape, SpecError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
BOS = 1
"""The prompt of a conversation's first turn when it brings no prompt tokens (vLLM needs one)."""
T = TypeVar("T")


@dataclass(frozen=True)
class VllmSettings:
    """Where the simulation finds vLLM."""

    venv: Path | None = setting(
        "GPUWARDEN_SIM_VLLM_DIR",
        None,
        "sim: the virtualenv with vLLM's CPU build that `model.engine: vllm` pods run their engines in",
        parse=any_path(),
        shown="`.venv-vllm` of this checkout (`make install` makes it)",
    )


DOCUMENTED = documented(VllmSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def vllm_python(env: dict[str, str] | None = None) -> Path:
    """The vLLM virtualenv's interpreter, or ``SpecError`` saying how to get one."""
    venv = settings_from_env(VllmSettings, env).venv or ROOT / ".venv-vllm"
    python = venv / "bin" / "python"
    if not python.exists():
        raise SpecError(
            f"model.engine vllm needs vLLM's CPU build in a virtualenv: {python} is missing (`make install` makes "
            ".venv-vllm; or set GPUWARDEN_SIM_VLLM_DIR), or use model.engine: transformers"
        )
    return python


def shape_args(model: ModelShape) -> list[str]:
    """The model's shape as ``shared.sim.vllmproc``'s arguments."""
    heads = model.attention_heads or 2 * model.kv_heads
    return [
        *("--layers", str(model.layers), "--hidden", str(heads * model.head_dim), "--heads", str(heads)),
        *("--kv-heads", str(model.kv_heads), "--vocab", str(model.vocab_size), "--seed", str(model.seed)),
        *("--max-positions", str(model.max_model_len), "--block-size", str(model.block_tokens)),
        *("--max-model-len", str(model.max_model_len), "--served-name", model.model_id),
        *("--revision", model.model_version),
    ]


@dataclass
class Exchange:
    """One request as it was served: the prompt was the conversation's first ``prompt_len`` tokens."""

    prompt_len: int
    max_tokens: int


@dataclass
class Talk:
    """A conversation: every token so far (prompts and replies) and the requests that made it; the last reply's
    tokens and logprobs as the engine answered them."""

    tokens: list[int] = field(default_factory=list)
    requests: list[Exchange] = field(default_factory=list)
    turns: int = 0
    last: dict[str, Any] = field(default_factory=dict)

    @property
    def positions(self) -> int:
        """Positions the cache holds after the last request: all tokens but the last reply's last (not computed)."""
        return max(0, len(self.tokens) - 1) if self.requests else 0


class VllmEngine:
    """One deployment's model at one version, served by vLLM: its weights in a folder every pod's engine loads,
    and the conversations (shared by the deployment's pods, as the clients hold them)."""

    def __init__(self, model: ModelShape, python: Path | None = None, folder: Path | None = None) -> None:
        self.model = model
        self.python = python or vllm_python()
        self.folder = folder or model_folder(model)
        if not (self.folder / "config.json").is_file():
            build_model(self.python, self.folder, model)
        self.work = Path(tempfile.mkdtemp(prefix="gpuwarden-sim-vllm-"))
        """Each pod's engine log and store, a folder each (removed with the last of them)."""
        self._layout = KvLayout(
            model_id=model.model_id,
            model_version=model.model_version,
            tokenizer_id=f"{self.folder.name}@{model.model_version}",
            dtype=model.dtype,
            block_tokens=model.block_tokens,
            layers=model.layers,
            kv_heads=model.kv_heads,
            head_dim=model.head_dim,
            weights_digest=files_digest(self.folder, _WEIGHT_FILES),
        )
        self.conversations: dict[str, Talk] = {}

    @property
    def layout(self) -> KvLayout:
        return self._layout

    def for_pod(self, agent: KvAgent) -> VllmPod:
        return VllmPod(self, agent)

    def end(self, session_id: str) -> None:
        self.conversations.pop(session_id, None)

    def tracked(self) -> int:
        return len(self.conversations)


def model_folder(model: ModelShape) -> Path:
    """Where a model of this shape and seed is kept: built once per machine, shared by every run."""
    shape = msgspec.json.encode(msgspec.structs.replace(model, model_id="", model_version="", tokenizer_id=""))
    tag = hashlib.blake2b(shape, digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / "gpuwarden-sim-vllm-models" / f"llama-{tag}"


def build_model(python: Path, folder: Path, model: ModelShape) -> None:
    """Build the model folder in the vLLM virtualenv (its transformers writes what its vLLM reads), into a
    temporary folder renamed into place: concurrent builders never see half a model."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    command = [str(python), "-m", "shared.sim.vllmproc", "--model", str(staging), "--build-only", *shape_args(model)]
    try:
        done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SpecError(f"building the vLLM model failed ({done.returncode}): {done.stderr[-2000:]}")
        with contextlib.suppress(OSError):  # another builder got there first: its folder is the same model
            staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


class VllmPod:
    """One pod's vLLM engine process and the pod's side of it (``PodEngine``). Calls to the process go one at a
    time (``_lock``), in a worker thread."""

    def __init__(self, engine: VllmEngine, agent: KvAgent) -> None:
        self.engine = engine
        self.agent = agent
        engine.work.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix=f"{agent.pod}-", dir=engine.work))
        self.process = EngineProcess(
            engine.folder,
            self.folder / "vllm.log",
            store=f"file://{self.folder / 'store'}",
            pod=agent.pod,
            extra_args=[*shape_args(engine.model), "--lookup-timeout-s", "60"],
            python=engine.python,
            module="shared.sim.vllmproc",
        )
        self._started: asyncio.Future[None] | None = None
        self._lock = asyncio.Lock()
        self._forget: set[str] = set()
        self._scratch = 0

    @property
    def layout(self) -> KvLayout:
        return self.engine.layout

    @property
    def bs(self) -> int:
        return self.engine.layout.block_tokens

    # -- the process ------------------------------------------------------------------------------------------------
    async def ready(self) -> None:
        """Wait until the engine serves (started once; its layout checked against the deployment's)."""
        if self._started is None:
            self._started = asyncio.ensure_future(asyncio.to_thread(self._start))
        await asyncio.shield(self._started)

    def _start(self) -> None:
        self.process.wait_ready(timeout=900)
        said = self.process.call("layout")
        mine = msgspec.to_builtins(self.engine.layout)
        for side in ("scheduler", "worker"):
            if said[side] != mine:
                raise RuntimeError(f"the vLLM engine's {side} computes in {said[side]}, the deployment in {mine}")
        log.info("SIMULATED pod's vLLM engine ready", extra={"pod": self.agent.pod, "simulated": True})

    async def _call(self, work: Callable[[], T]) -> T:
        async with self._lock:
            await self.ready()
            forget, self._forget = sorted(self._forget), set()
            for sid in forget:
                await asyncio.to_thread(self.process.call, "forget", session=sid)
            return await asyncio.to_thread(work)

    async def close(self, kill: bool = False) -> None:
        """The pod is gone: its engine stops (killed at once when the pod was)."""
        if kill:
            await asyncio.to_thread(self.process.kill)
        else:
            await asyncio.to_thread(self.process.stop, 30.0)
        if self._started is not None and not self._started.done():
            self._started.cancel()
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # the last pod's engine gone: the deployment's folder too
            self.engine.work.rmdir()

    def _generate(self, session: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        answer = self.process.generate(prompt, max_tokens, session=session)
        if answer.get("finish_reason") == "error":
            raise RuntimeError(f"session {session!r}: the vLLM engine failed the request: {answer}")
        return answer

    def _replay(self, session: str, talk: Talk, upto: int) -> dict[str, Any]:
        """The conversation's requests again, in order, under ``session``, until ``upto`` positions are computed;
        the connector's copy of them."""
        for exchange in talk.requests:
            self._generate(session, talk.tokens[: exchange.prompt_len], exchange.max_tokens)
            if exchange.prompt_len + exchange.max_tokens - 1 >= upto:
                break
        return self.process.call("blocks", session=session, first=0)

    def _scratch_session(self, session_id: str) -> str:
        self._scratch += 1
        return f"{session_id[:100]}-ref{self._scratch}"

    # -- the agent follows the engine -----------------------------------------------------------------------------
    def _track(self, session_id: str, first: int, exported: dict[str, Any]) -> None:
        """The agent's blocks from ``first`` on become the engine's (``exported``)."""
        talk = self.engine.conversations.get(session_id)
        self.agent.truncate(session_id, first)
        for block in exported["blocks"]:
            self.agent.append_block(session_id, np.frombuffer(base64.b64decode(block), dtype=np.uint8).copy())
        tokens = int(exported["tokens"])
        digest = tokens_digest_of(talk.tokens[:tokens]) if talk is not None else ""
        self.agent.set_tokens(session_id, tokens, digest)

    def tokens_after(self, session_id: str, prompt_tokens: int, new_tokens: int) -> int:
        talk = self.engine.conversations.get(session_id) or Talk()
        prompt = prompt_tokens or (0 if talk.tokens else 1)
        return len(talk.tokens) + prompt + max(new_tokens, 1) - 1

    async def start(self, session_id: str) -> bool:
        self._forget.add(session_id)
        talk = self.engine.conversations.get(session_id)
        if talk is None or not talk.requests:
            self.engine.conversations[session_id] = Talk()
            return False
        exported = await self._call(lambda: self._replay(session_id, talk, talk.positions))
        self._track(session_id, 0, exported)
        return True

    async def serve(self, session_id: str, prompt_tokens: int, new_tokens: int) -> None:
        talk = self.engine.conversations.setdefault(session_id, Talk())
        ids = prompt_ids(session_id, talk.turns, prompt_tokens, int(self.engine.model.vocab_size))
        prompt = talk.tokens + (ids or ([] if talk.tokens else [BOS]))
        max_tokens = max(new_tokens, 1)
        first = min(len(self.agent.blocks(session_id)), self.agent.tokens(session_id) // self.bs)

        def turn() -> tuple[dict[str, Any], dict[str, Any]]:
            answer = self._generate(session_id, prompt, max_tokens)
            return answer, self.process.call("blocks", session=session_id, first=first)

        answer, exported = await self._call(turn)
        talk.tokens = prompt + list(answer["tokens"])
        talk.requests.append(Exchange(len(prompt), max_tokens))
        talk.turns += 1
        talk.last = answer
        if int(exported["tokens"]) != talk.positions:
            raise RuntimeError(
                f"session {session_id!r}: the connector holds {exported['tokens']} positions, the conversation "
                f"{talk.positions}"
            )
        self._track(session_id, first, exported)

    async def recompute(self, session_id: str, tokens: int) -> None:
        talk = self.engine.conversations.get(session_id)
        if talk is None or talk.positions != tokens:
            known = "nothing" if talk is None else f"{talk.positions} positions"
            raise ValueError(f"session {session_id!r}: cannot recompute {tokens} positions, its tokens give {known}")
        self._forget.add(session_id)
        exported = await self._call(lambda: self._replay(session_id, talk, tokens))
        self._track(session_id, 0, exported)

    async def adopt(self, session_id: str, restored: RestoredSession) -> SessionCheck:
        count = restored.tokens
        talk = self.engine.conversations.get(session_id)
        if talk is None or not talk.requests:
            raise ValueError(f"session {session_id!r}: its tokens are not known here, and vLLM needs them to go on")
        check = await self._compare(session_id, talk, restored.blocks, count)
        self._forget.add(session_id)
        if not check.verified:  # never serve on from a wrong cache: the conversation computed again, as it first was
            exported = await self._call(lambda: self._replay(session_id, talk, talk.positions))
            self._track(session_id, 0, exported)
            return check
        keep, rest = self._resume_point(talk, count)
        blocks = [base64.b64encode(_bytes(b)).decode() for b in restored.blocks[: blocks_for(keep, self.bs)]]

        def resume() -> dict[str, Any] | None:
            if keep:
                self.process.call("put", session=session_id, tokens=keep, blocks=blocks)
            if not rest:
                return None
            for exchange in rest:
                self._generate(session_id, talk.tokens[: exchange.prompt_len], exchange.max_tokens)
            return self.process.call("blocks", session=session_id, first=0)

        resumed = await self._call(resume)
        if resumed is not None:
            self._track(session_id, 0, resumed)
        return check

    def _resume_point(self, talk: Talk, count: int) -> tuple[int, list[Exchange]]:
        """How much of a checkpoint of ``count`` positions the engine takes, and the requests it then runs again,
        so that the session holds the very bits of an uninterrupted run. Each request of that run took from the
        ones before it only their whole blocks (``floor(positions / block) x block``, all the connector loads) and
        computed the rest itself; so a checkpoint of the whole conversation is taken whole (the next request loads
        what it would have), and an older one (a pod killed between journal entries) gives the whole blocks the
        first request it lacks took, that request and those after it then run again as they first ran."""
        if count >= talk.positions:
            return count, []
        took = [0] + [(e.prompt_len + e.max_tokens - 1) // self.bs * self.bs for e in talk.requests[:-1]]
        start = max(index for index, loaded in enumerate(took) if loaded <= count)
        return took[start], talk.requests[start:]

    async def _compare(self, session_id: str, talk: Talk, blocks: list[Any], count: int) -> SessionCheck:
        """``blocks`` (``count`` positions) against the conversation replayed in this engine, position by position."""
        if count > talk.positions:
            return SessionCheck(False, f"it holds {count} positions, the conversation {talk.positions}")
        if count == 0:
            return SessionCheck(None, "it holds no position")
        scratch = self._scratch_session(session_id)
        reference = await self._call(lambda: self._replay(scratch, talk, count))
        self._forget.add(scratch)
        lay = self.layout
        shape = (lay.layers, 2, lay.kv_heads, lay.block_tokens, lay.head_dim)
        for index in range(blocks_for(count, self.bs)):
            if index >= len(blocks) or index >= len(reference["blocks"]):
                return SessionCheck(False, f"block {index} is missing")
            held = min(self.bs, count - index * self.bs)
            mine = np.frombuffer(_bytes(blocks[index]), dtype=np.float32).reshape(shape)[..., :held, :]
            theirs = np.frombuffer(base64.b64decode(reference["blocks"][index]), dtype=np.float32).reshape(shape)
            if not np.array_equal(mine, theirs[..., :held, :]):
                return SessionCheck(False, f"block {index} differs from the conversation replayed in vLLM")
        return SessionCheck(True)

    async def uninterrupted_reply(self, session_id: str) -> dict[str, Any]:
        """The conversation's last reply (tokens, logprobs) as an uninterrupted run in this engine gives it: every
        request replayed, in order, under a scratch session."""
        talk = self.engine.conversations[session_id]
        scratch = self._scratch_session(session_id)

        def replay() -> dict[str, Any]:
            answer: dict[str, Any] = {}
            for exchange in talk.requests:
                answer = self._generate(scratch, talk.tokens[: exchange.prompt_len], exchange.max_tokens)
            return answer

        try:
            return await self._call(replay)
        finally:
            self._forget.add(scratch)

    def tokens_known(self, session_id: str) -> int | None:
        talk = self.engine.conversations.get(session_id)
        return talk.positions if talk is not None else None

    async def check(self, session_id: str) -> SessionCheck:
        talk = self.engine.conversations.get(session_id)
        if talk is None or session_id not in self.agent.sessions():
            return SessionCheck(None, f"this pod serves no session {session_id!r}")
        return await self._compare(session_id, talk, self.agent.blocks(session_id), self.agent.tokens(session_id))

    def release(self, session_id: str) -> None:
        self._forget.add(session_id)


def _bytes(block: Any) -> bytes:
    host = as_block(block).host
    if host is None:
        raise TypeError("a simulated pod's block is in host memory")
    return host.tobytes()
