"""``python -m bench.crash``: what an unplanned loss costs. A pod decoding several conversations is killed at
seeded random moments (no preStop, its memory gone); each conversation goes on on a new pod from its newest
checkpoint committed before the kill, and the tokens after it are computed again. Run twice on the same seeds:
with the KV journal on (``shared.kv.journal``: each full block written behind the engine) and off (periodic
checkpoints only, the floor both runs share).

The model is ``bench.resume``'s seeded Llama (a config with random weights, no download; ``--quick``: a tiny
one). Each pod is a ``KvAgent`` on a file store with a ``TransformersEngine`` tracking its caches, decoding the
conversations round-robin one greedy token each, in a worker thread (as the conversation engine does), while the
journal and the periodic saves run on the event loop. At a kill the pod's tasks are cancelled on the spot and
only checkpoints committed by then count (a half-written pack is invisible; a flush that lands later is
ignored). The next pod restores each conversation (``KvAgent.restore``, every digest verified), rebuilds its cache
and runs the positions after the checkpoint again from the conversation's tokens (as the client holds them).

With the journal on, each pod logs its blocks to the node's tier (``shared.kv.nodetier``: a directory every pod
of the node shares) and spills them to the shared store every ``spill_s``; the next pod runs on the same node and
reads the dead pod's log on top of the store's newest checkpoint.

Figures: ``lost_tokens_p99`` / ``_mean`` (positions recomputed per conversation per kill) with the journal and
``lost_tokens_p99_periodic`` / ``_mean_periodic`` without; ``lost_tokens_p99_node`` (had the node been lost with
its tier: the shared store's newest checkpoint only, at most ``spill_s`` of decoding; no target);
``journal_decode_slowdown`` (decode tokens/s off / on); ``journal_write_amplification`` (bytes the journal-on
run wrote to the shared store, journal spills and periodic saves, / the KV bytes its engine produced) and
``node_write_amplification`` (the node tier's local writes / the same); ``resume_after_kill_vs_recompute_4k`` (a 4k
conversation re-prefilled whole / its restore from the journal plus the recompute of its tail).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import BenchOptions, Target, exit_code, finish, machine_info, parse_args, percentile
from bench.resume import FULL, TINY, ModelShape, build_model

BLOCK_TOKENS = 16
"""Positions per KV block, as vLLM's default."""
LONG = 4096

TARGETS = [
    Target("lost_tokens_p99", "<=", BLOCK_TOKENS, "tokens recomputed per conversation after a kill, journal on (p99)"),
    Target("journal_decode_slowdown", "<=", 1.05, "decode tokens/s with the journal off / on"),
    Target("journal_write_amplification", "<=", 1.2, "bytes written to the store / KV bytes produced, journal on"),
    Target("resume_after_kill_vs_recompute_4k", ">=", 10.0, "re-prefill of 4k / journal restore + tail recompute"),
]


@dataclass(frozen=True)
class Sizes:
    conversations: int
    prompt: int
    kills: int
    segment_s: tuple[float, float]
    periodic_s: float
    journal_s: float
    spill_s: float
    """The node tier's spill period: how often the journal's blocks go on from the node to the shared store."""


FULL_SIZES = Sizes(
    conversations=4, prompt=128, kills=20, segment_s=(0.5, 4.0), periodic_s=2.0, journal_s=0.05, spill_s=2.0
)
QUICK_SIZES = Sizes(
    conversations=2, prompt=24, kills=3, segment_s=(0.1, 0.4), periodic_s=0.25, journal_s=0.02, spill_s=0.2
)


@dataclass
class Talk:
    """A conversation as its client holds it: every token id in the cache, and the pending reply token."""

    session_id: str
    ids: list[int]
    pending: int


@dataclass
class Run:
    lost: list[int] = field(default_factory=list)
    lost_node: list[int] = field(default_factory=list)
    """Per conversation and kill: the positions recomputed had the node been lost with its tier (the shared
    store's newest checkpoint only)."""
    node_blocks: int = 0
    """Blocks the resumes took from the dead pod's node-tier log."""
    node_bytes_written: int = 0
    decoded: int = 0
    decode_s: float = 0.0
    produced_tokens: int = 0
    bytes_written: int = 0
    journal_bytes_written: int = 0
    journal_entries: int = 0
    periodic_saves: int = 0


class CrashBench:
    def __init__(self, shape: ModelShape, sizes: Sizes, directory: Path, seed: int) -> None:
        import torch

        from shared.kv.engines.huggingface import TransformersEngine

        self.torch = torch
        self.sizes = sizes
        self.directory = directory
        self.seed = seed
        self.engine = TransformersEngine(build_model(shape, LONG + 64, "cpu"), block_tokens=BLOCK_TOKENS)
        self.layout = self.engine.layout
        self.bytes_per_token = self.layout.block_bytes // BLOCK_TOKENS

    def _agent(self, store: Any, pod: str) -> Any:
        from shared.kv.agent import KvAgent

        return KvAgent(store, pod=pod, node="node-1", namespace="bench", deployment="llama", layout=self.layout)

    def _forward(self, cache: Any, ids: list[int]) -> int:
        with self.torch.inference_mode():
            out = self.engine.model(
                input_ids=self.torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1
            )
        return int(out.logits[0, -1].argmax())

    async def run(self, journal: bool) -> Run:
        """Every kill of the seeded schedule, with the journal on or off."""
        from shared.kv.filestore import FileStore
        from shared.kv.journal import KvJournal
        from shared.kv.nodetier import NodeTier

        store = FileStore(self.directory / ("journal" if journal else "periodic"))
        node_root = self.directory / "node"
        rng = random.Random(self.seed)
        result = Run()
        talks: list[Talk] = []
        caches: dict[str, Any] = {}
        agent = self._agent(store, "llama-0")
        pod_tier = NodeTier(node_root, agent.pod) if journal else None
        for n in range(self.sizes.conversations):  # the first pod: prompts prefilled
            sid = f"chat-{n}"
            ids = [rng.randrange(2, self.engine.model.config.vocab_size) for _ in range(self.sizes.prompt + 5 * n)]
            agent.register_session(sid, generation=1)
            cache = self.engine.new_cache()
            pending = await asyncio.to_thread(self._forward, cache, ids)
            self.engine.track(agent, sid, cache)
            talks.append(Talk(sid, ids, pending))
            caches[sid] = cache
            result.produced_tokens += len(ids)
        for kill in range(self.sizes.kills + 1):
            segment = rng.uniform(*self.sizes.segment_s)
            tasks: list[asyncio.Task[Any]] = []
            kv_journal = (
                KvJournal(agent, self.sizes.journal_s, node=pod_tier, spill_s=self.sizes.spill_s) if journal else None
            )
            if kv_journal is not None:
                kv_journal.start()
            tasks.append(asyncio.create_task(self._periodic(agent, result, kv_journal)))
            decoding = asyncio.create_task(self._decode(agent, talks, caches, result))
            await asyncio.sleep(segment)
            decoding.cancel()  # the kill: the step under way finishes in its thread, unseen
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await decoding
            truth = {t.session_id: len(t.ids) for t in talks}
            committed = {t.session_id: await store.checkpoints(t.session_id) for t in talks}
            logged = _sizes(node_root)  # what the node's page cache holds at the kill
            if kv_journal is not None:
                await kv_journal.stop()  # a flush under way ends (shielded); what it adds after the kill is undone
                _cut_to(node_root, logged)
                result.bytes_written += kv_journal.stats.bytes_written
                result.journal_bytes_written += kv_journal.stats.bytes_written
                result.journal_entries += kv_journal.stats.entries
                result.node_bytes_written += kv_journal.stats.node_bytes_written
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if kill == self.sizes.kills:
                break
            came_from = agent.pod
            agent = self._agent(store, f"llama-{kill + 1}")  # the next pod: restores, recomputes what is missing
            pod_tier = NodeTier(node_root, agent.pod) if journal else None
            for talk in talks:
                lost, cache, lost_node = await self._resume(
                    agent, talk, committed[talk.session_id], kill + 2, pod_tier, came_from, result
                )
                caches[talk.session_id] = cache
                result.lost.append(lost)
                result.lost_node.append(lost_node)
                result.produced_tokens += lost
                assert len(talk.ids) == truth[talk.session_id]
        return result

    async def _decode(self, agent: Any, talks: list[Talk], caches: dict[str, Any], result: Run) -> None:
        while True:
            for talk in talks:
                cache = caches[talk.session_id]
                started = time.perf_counter()
                token = talk.pending
                nxt = await asyncio.to_thread(self._forward, cache, [token])
                result.decode_s += time.perf_counter() - started
                talk.ids.append(token)
                talk.pending = nxt
                self.engine.track(agent, talk.session_id, cache)
                result.decoded += 1
                result.produced_tokens += 1

    async def _periodic(self, agent: Any, result: Run, kv_journal: Any) -> None:
        """The checkpoint service's periodic saves, as the pod's endpoint runs them (``shared.kv.endpoint``): the
        tail blocks left to the journal's bound while it keeps up."""
        from shared.contract.checkpoint import PERIODIC_REASON
        from shared.kv.journal import journal_covers

        while True:
            await asyncio.sleep(self.sizes.periodic_s)
            report = await agent.save(
                reason=PERIODIC_REASON, changed_only=True, full_blocks_only=journal_covers(kv_journal)
            )
            result.bytes_written += report.bytes_written
            result.periodic_saves += 1

    async def _resume(
        self,
        agent: Any,
        talk: Talk,
        candidates: list[str],
        generation: int,
        tier: Any = None,
        came_from: str = "",
        result: Run | None = None,
    ) -> tuple[int, Any, int]:
        """The conversation on the new pod: its newest checkpoint committed before the kill, then (with a node
        tier, the new pod on the dead pod's node) the blocks the dead pod logged after it, then the positions after
        those run again. Returns the positions recomputed, the cache, and the positions a lost node would have cost
        (the shared store's checkpoint only)."""
        from shared.kv.manifest import checkpoint_order
        from shared.kv.store import CheckpointNotFound

        newest = sorted(candidates, key=checkpoint_order, reverse=True)
        count = stored = 0
        try:
            restored = await agent.restore(talk.session_id, candidates=newest, generation=generation)
            count = stored = restored.manifest.token_count
            blocks = restored.blocks
            if tier is not None:
                tail = await tier.continue_session(
                    agent, talk.session_id, restored.manifest, generation, came_from, generation - 1
                )
                if tail.blocks:
                    count, blocks = agent.tokens(talk.session_id), agent.blocks(talk.session_id)
                    if result is not None:
                        result.node_blocks += len(tail.blocks)
            cache = self.engine.rebuild(blocks, count)
        except CheckpointNotFound:
            agent.register_session(talk.session_id, generation=generation)
            cache = self.engine.new_cache()
        missing = talk.ids[count:]
        if missing:
            await asyncio.to_thread(self._forward, cache, missing)
        self.engine.track(agent, talk.session_id, cache)
        return len(missing), cache, len(talk.ids) - stored

    async def long_resume(self) -> dict[str, float]:
        """A 4k conversation journaled as it was made, its pod killed a few positions past a block: restored and
        its tail recomputed, against a re-prefill of all of it."""
        from shared.kv.filestore import FileStore
        from shared.kv.journal import KvJournal

        store = FileStore(self.directory / "long")
        rng = random.Random(self.seed + 1)
        ids = [rng.randrange(2, self.engine.model.config.vocab_size) for _ in range(LONG)]
        agent = self._agent(store, "long-0")
        agent.register_session("long", generation=1)
        journal = KvJournal(agent, 1.0)
        cache = self.engine.new_cache()
        await asyncio.to_thread(self._forward, cache, ids[: LONG - 5])
        self.engine.track(agent, "long", cache)
        await journal.flush()  # what the journal holds by the time the pod dies
        for token in ids[LONG - 5 :]:
            await asyncio.to_thread(self._forward, cache, [token])
        recompute = []
        resume = []
        for attempt in range(3):
            started = time.perf_counter()
            await asyncio.to_thread(self._forward, self.engine.new_cache(), ids)
            recompute.append(time.perf_counter() - started)
            other = self._agent(store, f"long-{attempt + 1}")
            started = time.perf_counter()
            await self._resume(other, Talk("long", ids, 0), await store.checkpoints("long"), attempt + 2)
            resume.append(time.perf_counter() - started)
        return {"recompute_4k_s": percentile(recompute, 50), "resume_after_kill_4k_s": percentile(resume, 50)}


def _sizes(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in root.rglob("*.log")} if root.is_dir() else {}


def _cut_to(root: Path, sizes: dict[Path, int]) -> None:
    """The node tier as the kill left it: logs cut back to their sizes then, those made after it gone."""
    for path in root.rglob("*.log") if root.is_dir() else []:
        if path not in sizes:
            path.unlink()
        elif path.stat().st_size > sizes[path]:
            os.truncate(path, sizes[path])


def run(options: BenchOptions, seed: int = 7, progress: bool = True) -> dict[str, Any]:
    import torch

    shape = TINY if options.quick else FULL
    sizes = QUICK_SIZES if options.quick else FULL_SIZES
    directory = Path(tempfile.mkdtemp(prefix="gw-crash-", dir=os.environ.get("GPUWARDEN_BENCH_DIR") or None))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench = CrashBench(shape, sizes, directory, seed)

        async def measure() -> tuple[Run, Run, dict[str, float]]:
            on = await bench.run(journal=True)
            if progress:
                print(f"  journal on: {len(on.lost)} conversations resumed, {on.decoded} tokens decoded", flush=True)
            off = await bench.run(journal=False)
            return on, off, await bench.long_resume()

        on, off, long = asyncio.run(measure())
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(directory, ignore_errors=True)
    rate_on = on.decoded / on.decode_s if on.decode_s else float("nan")
    rate_off = off.decoded / off.decode_s if off.decode_s else float("nan")
    results: dict[str, Any] = {
        "kills": sizes.kills,
        "block_tokens": BLOCK_TOKENS,
        "conversations_resumed": len(on.lost),
        "lost_tokens_p99": percentile(on.lost, 99),
        "lost_tokens_mean": sum(on.lost) / len(on.lost),
        "lost_tokens_max": max(on.lost),
        "lost_tokens_p99_node": percentile(on.lost_node, 99),
        "lost_tokens_mean_node": sum(on.lost_node) / len(on.lost_node),
        "node_tier_blocks_restored": on.node_blocks,
        "lost_tokens_p99_periodic": percentile(off.lost, 99),
        "lost_tokens_mean_periodic": sum(off.lost) / len(off.lost),
        "decode_tokens_per_s_journal": rate_on,
        "decode_tokens_per_s_periodic": rate_off,
        "journal_decode_slowdown": rate_off / rate_on,
        "journal_write_amplification": on.bytes_written / (on.produced_tokens * bench.bytes_per_token),
        # the same split: the journal's own writes (full blocks, once each) and the periodic saves beside it (the
        # partial last block written again at each save: how often is sizes.periodic_s, far below the 60 s default)
        "journal_only_write_amplification": on.journal_bytes_written / (on.produced_tokens * bench.bytes_per_token),
        "journal_entries": on.journal_entries,
        # the node tier's local-disk writes (each full block once), beside the shared store's above
        "node_write_amplification": on.node_bytes_written / (on.produced_tokens * bench.bytes_per_token),
        **long,
        "resume_after_kill_vs_recompute_4k": long["recompute_4k_s"] / long["resume_after_kill_4k_s"],
    }
    params = {
        "model": {**asdict(shape), "head_dim": shape.head_dim, "architecture": "LlamaForCausalLM"},
        "model_params": sum(p.numel() for p in bench.engine.model.parameters()),
        "sizes": asdict(sizes),
        "seed": seed,
        "threads": 1,
        "store": "file store (shared.kv.filestore) in a temporary directory; GPUWARDEN_BENCH_DIR chooses where",
        "kill": "the pod's decode, journal and periodic tasks cancelled at a seeded moment; only checkpoints "
        "committed by then are restored",
    }
    return finish(options, results, TARGETS, params, machine_info())


def main(argv: Sequence[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--seed", type=int, default=7)
    known, rest = extra.parse_known_args(argv)
    options = parse_args("crash", __doc__.splitlines()[0] if __doc__ else "", rest)
    return exit_code(options, run(options, seed=known.seed))


if __name__ == "__main__":
    sys.exit(main())
