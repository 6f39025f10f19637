"""Reading chunks back: which chunks hold the wanted byte ranges (``plan_runs``), and reading one run of them
through an ephemeral pull consumer straight into the caller's targets (``read_run``), checking every chunk's
stream sequence and length against the meta, and the object's SHA-256 when a run covers all of it."""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from shared.kv.objstore.codec import HASH_BACKLOG, ObjectMeta, chunk_subject, digest_bytes, object_label, stream_seq
from shared.kv.objstore.stream import ObjectStream
from shared.kv.store import StoreError


@dataclass
class ChunkRun:
    """Chunks ``first..last`` of one object, read by one consumer."""

    meta: ObjectMeta
    first: int
    last: int
    ops: dict[int, list[tuple[int, int, memoryview]]]
    verify_digest: bool = False


def plan_runs(meta: ObjectMeta, refs: Iterable[tuple[int, int, memoryview]]) -> list[ChunkRun]:
    """Runs of chunks holding the wanted (offset, length, target) ranges, with the copies to make."""
    cs = meta.chunk_size
    ops: dict[int, list[tuple[int, int, memoryview]]] = {}
    for offset, length, target in refs:
        if length == 0:
            continue
        end = offset + length
        for c in range(offset // cs, (end - 1) // cs + 1):
            base = c * cs
            lo = max(offset, base)
            hi = min(end, base + cs)
            ops.setdefault(c, []).append((lo - base, hi - base, target[lo - offset : hi - offset]))
    indexes = sorted(ops)
    runs: list[ChunkRun] = []
    for c in indexes:
        if runs and c - runs[-1].last <= 2:  # reading a skipped chunk is cheaper than a new consumer
            runs[-1].last = c
        else:
            runs.append(ChunkRun(meta, c, c, ops))
    if len(runs) == 1 and runs[0].first == 0 and runs[0].last == meta.chunks - 1:
        runs[0].verify_digest = True  # every chunk passes by: check the object's own digest on the way
    return runs


async def read_run(stream: ObjectStream, run: ChunkRun) -> None:
    meta = run.meta
    what = f"reading {meta.name}"
    subject = chunk_subject(stream.bucket, meta.nuid)
    config: dict[str, Any] = {"filter_subject": subject}
    seqs = meta.seqs
    if seqs is not None:
        config.update(deliver_policy="by_start_sequence", opt_start_seq=seqs[run.first])
        skip = 0
    else:
        config.update(deliver_policy="all")
        skip = run.first
    count = run.last - run.first + 1 + skip
    label = object_label(meta.name)

    def check_pending(pending: int) -> int:
        if pending < count:  # a hole or a cut end: fewer chunks left on the subject than this run needs
            raise StoreError(
                f"{label} is truncated: chunks {run.first}..{run.last} of {meta.chunks} wanted, "
                f"{max(pending - skip, 0)} on the server from chunk {run.first}"
            )
        return count

    h = hashlib.sha256() if run.verify_digest else None
    hasher = ThreadPoolExecutor(1, thread_name_prefix="objstore-sha") if h is not None else None
    hashing: deque[asyncio.Future[Any]] = deque()
    loop = asyncio.get_running_loop()
    ops = run.ops
    first_index = run.first - skip

    def on_msg(k: int, msg: Msg) -> Any:
        index = first_index + k
        data = msg.data
        if seqs is not None:
            sseq = stream_seq(msg.reply)
            if sseq != seqs[index]:
                raise StoreError(f"{label} is truncated: chunk {index} (stream sequence {seqs[index]}) is missing")
        if len(data) != meta.chunk_length(index):
            raise StoreError(
                f"{label} is truncated: chunk {index} has {len(data)} bytes, {meta.chunk_length(index)} recorded"
            )
        if index >= run.first:
            view = memoryview(data)
            for lo, hi, dest in ops.get(index, ()):
                dest[:] = view[lo:hi]
        if h is not None:
            hashing.append(loop.run_in_executor(hasher, h.update, data))
            if len(hashing) > HASH_BACKLOG:
                return hashing.popleft()
        return None

    try:
        await stream.consume(
            what,
            config,
            check_pending,
            on_msg,
            stream.window_bytes,
            meta.chunk_size,
            short=lambda got: StoreError(
                f"{label} is truncated: the server could not deliver chunk {first_index + got} "
                f"(chunks {run.first}..{run.last} of {meta.chunks} wanted)"
            ),
        )
        if h is not None:
            for future in hashing:
                await future
            if digest_bytes(meta.digest) not in (None, h.digest()):
                raise StoreError(f"{label} is corrupt: its bytes do not match the object's SHA-256 digest")
    finally:
        if hasher is not None:
            hasher.shutdown(wait=False)
