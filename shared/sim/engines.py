"""The engines the simulated pods run: what turns a request into KV blocks, and a restored checkpoint back into a
session that goes on.

Three kinds, chosen per deployment by the spec (``model.engine``):

- ``synthetic``: blocks sized like the model's and filled deterministically from the session id and block index
  (``expected_block``), so any copy anywhere can be verified byte for byte. Cheap at any model size: the kind for
  capacity and scale simulations of real models (a Llama-3-8B's 2 MiB blocks).
- ``transformers``: a real tiny causal LM (a Llama built from the spec's shape with a fixed seed: no download) that
  prefills each prompt and decodes greedily, its cache tracked into the agent's blocks
  (``shared.kv.engines.chat``). A restored session is checked by continuing it beside a reference run that
  recomputes the conversation from its tokens: the same tokens and bit-identical logits, or the check fails.

- ``vllm``: the same tiny Llama served by vLLM's CPU build, one engine process per pod with gpuwarden's KV
  connector in it (``shared.sim.vllmpods``); a restored session is checked against the conversation replayed in
  vLLM.

Only ``engine_for`` reaches the transformers engine, through a function-level import, so the simulation runs
without torch unless a deployment asks for a real model (the import contract allows exactly that import).
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import msgspec
import numpy as np

from shared.kv.agent import KvAgent, RestoredSession
from shared.kv.engines import SessionCheck
from shared.kv.manifest import KvLayout
from shared.sim.spec import DeploymentSpec, ModelShape, SpecError


class PodEngine(Protocol):
    """One pod's engine as the workload drives it. The workload keeps the agent's session list (registering,
    forgetting, ending); the engine produces and consumes the blocks. Sessions are serialised by the workload: no
    two calls for one session overlap."""

    @property
    def layout(self) -> KvLayout: ...

    def tokens_after(self, session_id: str, prompt_tokens: int, new_tokens: int) -> int:
        """The session's cached positions once a turn of ``prompt_tokens`` in and ``new_tokens`` out is served."""
        ...

    async def start(self, session_id: str) -> bool:
        """Begin serving a session this pod holds no KV for (the agent already holds it, empty). Returns True when
        the engine recomputed its context from the conversation so far, False when it starts empty."""
        ...

    async def serve(self, session_id: str, prompt_tokens: int, new_tokens: int) -> None:
        """One turn: the session's cache grows and the agent's blocks follow it."""
        ...

    async def recompute(self, session_id: str, tokens: int) -> None:
        """Rebuild the KV of a preempted session (``tokens`` positions) from its tokens, into the agent."""
        ...

    async def adopt(self, session_id: str, restored: RestoredSession) -> SessionCheck:
        """Take a session the agent just restored, and check it against the reference; a checkpoint older than
        the conversation (a pod killed between its journal entries) is caught up by recomputing what it lacks."""
        ...

    def tokens_known(self, session_id: str) -> int | None:
        """How many positions the conversation has reached, as its tokens are known to the deployment (the
        client's side), whichever pod served them; None when unknown."""
        ...

    async def check(self, session_id: str) -> SessionCheck:
        """Compare what the pod holds for the session now with the reference."""
        ...

    def release(self, session_id: str) -> None:
        """The pod's engine memory of the session is gone (preempted, ended, moved, pod stopped)."""
        ...

    async def close(self, kill: bool = False) -> None:
        """The pod is gone (``kill``: without a preStop): what the engine runs apart from the simulation ends."""
        ...


class DeploymentEngine(Protocol):
    """One deployment's model, shared by its pods (one set of weights in the simulation's memory)."""

    @property
    def layout(self) -> KvLayout: ...

    def for_pod(self, agent: KvAgent) -> PodEngine: ...

    def end(self, session_id: str) -> None:
        """The conversation is over: forget what the engine kept of it beyond the pods (its tokens)."""
        ...

    def tracked(self) -> int:
        """How many conversations the engine remembers (bounded by the live sessions)."""
        ...


def layout_of(model: ModelShape) -> KvLayout:
    return KvLayout(
        model_id=model.model_id,
        model_version=model.model_version,
        tokenizer_id=model.tokenizer_id,
        dtype=model.dtype,
        block_tokens=model.block_tokens,
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
    )


def expected_block(session_id: str, index: int, nbytes: int) -> np.ndarray:
    """The content of a session's block ``index``: the same in every process, on every machine."""
    seed = int.from_bytes(hashlib.blake2b(f"{session_id}/{index}".encode(), digest_size=8).digest(), "little")
    return np.random.Generator(np.random.PCG64(seed)).integers(0, 256, nbytes, dtype=np.uint8)


def verify_blocks(session_id: str, blocks: list[Any]) -> bool:
    return all(
        bytes(memoryview(b).cast("B")) == expected_block(session_id, i, memoryview(b).nbytes).tobytes()
        for i, b in enumerate(blocks)
    )


class SyntheticPod:
    def __init__(self, agent: KvAgent, layout: KvLayout, reached: dict[str, int] | None = None) -> None:
        self.agent = agent
        self._layout = layout
        self.reached = reached if reached is not None else {}
        """Positions each session reached, shared by the deployment's pods (what its client sent)."""

    @property
    def layout(self) -> KvLayout:
        return self._layout

    def tokens_after(self, session_id: str, prompt_tokens: int, new_tokens: int) -> int:
        return self.agent.tokens(session_id) + prompt_tokens + new_tokens

    async def start(self, session_id: str) -> bool:
        return False

    async def serve(self, session_id: str, prompt_tokens: int, new_tokens: int) -> None:
        tokens = self.tokens_after(session_id, prompt_tokens, new_tokens)
        self._fill(session_id, tokens)

    async def recompute(self, session_id: str, tokens: int) -> None:
        self._fill(session_id, tokens)

    def _fill(self, session_id: str, tokens: int) -> None:
        nbytes = self.layout.block_bytes
        for index in range(len(self.agent.blocks(session_id)), -(-tokens // self.layout.block_tokens)):
            self.agent.append_block(session_id, expected_block(session_id, index, nbytes))
        self.agent.set_tokens(session_id, tokens)
        self.reached[session_id] = tokens

    async def adopt(self, session_id: str, restored: RestoredSession) -> SessionCheck:
        check = self._verify(session_id, restored.blocks)
        reached = self.reached.get(session_id, 0)
        if check.verified and reached > restored.tokens:
            self._fill(session_id, reached)  # the positions after the checkpoint, computed again
        return check

    def tokens_known(self, session_id: str) -> int | None:
        return self.reached.get(session_id)

    async def check(self, session_id: str) -> SessionCheck:
        return self._verify(session_id, self.agent.blocks(session_id))

    @staticmethod
    def _verify(session_id: str, blocks: list[Any]) -> SessionCheck:
        if verify_blocks(session_id, blocks):
            return SessionCheck(True)
        return SessionCheck(False, "a block differs from the session's deterministic content")

    def release(self, session_id: str) -> None:
        return None

    async def close(self, kill: bool = False) -> None:
        return None


class SyntheticEngine:
    def __init__(self, model: ModelShape) -> None:
        self._layout = layout_of(model)
        self.reached: dict[str, int] = {}

    @property
    def layout(self) -> KvLayout:
        return self._layout

    def for_pod(self, agent: KvAgent) -> PodEngine:
        return SyntheticPod(agent, self._layout, self.reached)

    def end(self, session_id: str) -> None:
        self.reached.pop(session_id, None)

    def tracked(self) -> int:
        return len(self.reached)


def model_at(model: ModelShape, version: str) -> ModelShape:
    """The deployment's model at ``version``: the same shape, other weights (a seed drawn from the version, so a
    real engine's weights digest differs from every other version's). The spec's own version is the spec's."""
    if version == model.model_version:
        return model
    seed = int.from_bytes(hashlib.blake2b(f"{model.model_id}@{version}".encode(), digest_size=4).digest(), "little")
    return msgspec.structs.replace(model, model_version=version, seed=seed)


def engine_for(deployment: DeploymentSpec, version: str = "") -> DeploymentEngine:
    """The engine the spec names for ``deployment``'s pods, at model ``version`` (default: the spec's)."""
    model = model_at(deployment.model, version or deployment.model.model_version)
    if model.engine == "transformers":
        try:
            from shared.kv.engines.chat import ChatModel  # torch and transformers only when a real model is asked for
        except ImportError as exc:
            raise SpecError(
                f"deployment {deployment.namespace}/{deployment.name}: model.engine transformers needs torch and "
                f"transformers ({exc}); install them (make install does) or use model.engine: synthetic "
                "(deploy/sim/synthetic.yaml)"
            ) from None

        chat: DeploymentEngine = ChatModel.tiny(
            model_id=model.model_id,
            model_version=model.model_version,
            layers=model.layers,
            kv_heads=model.kv_heads,
            attention_heads=model.attention_heads or 2 * model.kv_heads,
            head_dim=model.head_dim,
            vocab_size=model.vocab_size,
            max_model_len=model.max_model_len,
            dtype=model.dtype,
            block_tokens=model.block_tokens,
            seed=model.seed,
        )
        return chat
    if model.engine == "vllm":
        from shared.sim.vllmpods import VllmEngine  # vLLM runs in engine processes of its own: none imported here

        return VllmEngine(model)
    return SyntheticEngine(model)
