"""One simulated pod's vLLM engine: the process ``shared.sim.vllmpods`` starts per pod, run by the vLLM virtualenv's
interpreter (``GPUWARDEN_SIM_VLLM_DIR``, by default ``.venv-vllm``) with this checkout on its path.

    .venv-vllm/bin/python -m shared.sim.vllmproc --model DIR --store file:///POD-DIR --pod llama-0 [--build-only]

It is ``shared.kv.engines.vllm_server``'s engine (vLLM's CPU build, gpuwarden's connector loaded through
``kv_transfer_config``, requests as token ids over stdin and answers on stdout) with the pod's side of the KV
handed to the simulation: the simulated pod's own KV agent answers the checkpoint service, so the connector here
keeps its sessions in host memory and in a store of this engine's own (``--store``, a folder of the pod's), and
three requests move blocks between the two:

- ``{"op": "blocks", "session": S, "first": i}``: the connector's host copy of session S from block ``i`` on, as
  the connector copied it out of vLLM's paged cache (``{"tokens": n, "blocks": [base64, ...]}``);
- ``{"op": "put", "session": S, "tokens": n, "blocks": [base64, ...]}``: a restored checkpoint of S (verified by
  the simulation), committed to this engine's store, so that S's next request loads it through the connector into
  vLLM's paged cache (the connector's restore path: the scheduler's lookup, the worker's verified load);
- ``{"op": "forget", "session": S}``: the engine lets go of S (the pod's memory of it is gone: preempted, ended,
  moved): the connector's host copy, what the scheduler knew it held, and this engine's checkpoints of it.

``{"op": "layout"}`` answers the layout the connector computes in (the simulation checks it against its own).
vLLM's engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so both halves of the connector
are reachable here. ``--build-only`` builds the model folder (a Llama of the spec's shape, seeded weights) and exits.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np

from shared.kv.buffers import as_block
from shared.kv.engines.vllm_server import build_model, engine_environment, parser, serve, settle


def _connectors(llm: Any) -> tuple[Any, Any]:
    """The connector's scheduler half and worker half (both in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return scheduler, get_kv_transfer_group()


def _worker(llm: Any) -> Any:
    settle(llm)
    worker = _connectors(llm)[1]
    worker.worker.flush(60)
    return worker


def op_layout(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    scheduler, worker = _connectors(llm)
    return {"scheduler": msgspec.to_builtins(scheduler.layout), "worker": msgspec.to_builtins(worker.layout)}


def op_blocks(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    worker = _worker(llm)
    agent, session = worker.worker.agent, str(request["session"])
    if session not in agent.sessions():
        return {"tokens": 0, "blocks": []}
    blocks = agent.blocks(session)[int(request.get("first", 0)) :]
    encoded = []
    for block in blocks:
        host = as_block(block).host
        assert host is not None  # the connector's copies are in host memory
        encoded.append(base64.b64encode(host).decode())
    return {"tokens": agent.tokens(session), "blocks": encoded}


def op_put(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    session, tokens = str(request["session"]), int(request["tokens"])
    op_forget(llm, {"session": session})
    worker = _worker(llm)
    agent = worker.worker.agent
    blocks = [np.frombuffer(base64.b64decode(b), dtype=np.uint8).copy() for b in request["blocks"]]

    async def commit() -> int:
        agent.register_session(session)
        for block in blocks:
            agent.append_block(session, block)
        agent.set_tokens(session, tokens)
        try:
            report = await agent.save([session], reason="restore")
        finally:
            agent.forget_session(session)  # the next request loads it from the store, as any restore does
        if report.failed:
            raise RuntimeError(f"could not commit session {session}: {report.failed}")
        return len(report.committed)

    committed = worker.loop.call(commit(), timeout=60)
    return {"committed": committed}


def op_forget(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    session = str(request["session"])
    scheduler = _connectors(llm)[0]
    scheduler.book.held.pop(session, None)
    worker = _worker(llm)
    worker.worker.held_full.pop(session, None)
    agent, store = worker.worker.agent, worker.store

    async def drop() -> None:
        agent.forget_session(session)
        for cid in await store.checkpoints(session):
            await store.delete_checkpoint(session, cid)

    worker.loop.call(drop(), timeout=60)
    return {}


OPS = {"layout": op_layout, "blocks": op_blocks, "put": op_put, "forget": op_forget}


def main() -> None:
    args_parser = parser()
    args_parser.add_argument("--build-only", action="store_true", help="build the model folder and exit")
    for name in ("layers", "hidden", "heads", "kv-heads", "vocab", "seed", "max-positions"):
        args_parser.add_argument(f"--{name}", type=int, required=True)
    args = args_parser.parse_args()
    engine_environment()
    build_model(
        args.model,
        args.seed,
        layers=args.layers,
        hidden=args.hidden,
        intermediate=2 * args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        max_positions=args.max_positions,
    )
    if not args.build_only:
        serve(args, OPS)


if __name__ == "__main__":
    main()
