"""The invariants every fault scenario must leave standing, checked by walking the store and the registry.

- Every checkpoint the registry recorded is in the store, its manifest verifies (its own digest, session, id),
  and every chunk it references reads back with the digest it claims: nothing acknowledged is unrestorable.
- A recorded checkpoint was made by the pod the registry recorded for it, under the generation it names, and no
  generation is above the session's generation counter (generations only grow; none handed out twice).
- The session a node set lists has its hash on that node, held under a generation the counter has handed out.
- Every drain the scenario started has exactly one recorded verdict.
- No temporary file older than the grace period is left in a file store.

A mesh may still run while it checks: a checkpoint the registry forgets meanwhile (retention forgets the record,
then deletes the file) is not a problem; one it still records after its file is gone is.

``corrupted``: checkpoint ids a scenario damaged on purpose; the checker expects those, and only those, to fail.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.checkpoint.registry import SessionRegistry
from shared.contract.subjects import Subjects
from shared.kv.filestore import FileStore
from shared.kv.manifest import digest
from shared.kv.store import CheckpointStore, StoreError

CONCURRENCY = 32
"""Sessions checked at once."""
ALL = 1_000_000
"""Checkpoints read per session: all of them."""


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    recorded: int = 0
    verified_bytes: int = 0

    def __bool__(self) -> bool:
        return not self.problems


async def check_invariants(
    store: CheckpointStore,
    client: aioredis.Redis,
    subjects: Subjects,
    *,
    drains: Iterable[str] = (),
    corrupted: Iterable[str] = (),
    temp_grace_s: float | None = None,
) -> Findings:
    """Reads the registry through its own audit and read methods (``SessionRegistry``): the key layout is the
    registry's alone."""
    found = Findings()
    damaged = set(corrupted)
    registry = SessionRegistry(client, subjects)

    async def still_recorded(sid: str, cid: str) -> bool:
        return any(str(r["checkpoint_id"]) == cid for r in await registry.checkpoints(sid, limit=ALL))

    async def check_session(sid: str) -> None:
        counter = await registry.generation(sid)
        for summary in await registry.checkpoints(sid, limit=ALL):
            cid = str(summary["checkpoint_id"])
            found.recorded += 1
            try:
                manifest = await store.manifest(sid, cid)
                buffers = [memoryview(bytearray(ref.length)) for ref in manifest.blocks]
                await store.read_chunks(manifest.blocks, buffers)
            except StoreError as exc:
                if not await still_recorded(sid, cid):  # retention forgot it, then deleted it, while this read
                    found.recorded -= 1
                    continue
                if cid not in damaged:
                    found.problems.append(f"recorded checkpoint {cid} of {sid} does not restore: {exc}")
                continue
            if manifest.key_id == "":
                bad = [
                    i for i, (r, b) in enumerate(zip(manifest.blocks, buffers, strict=True)) if digest(b) != r.digest
                ]
                if bad and cid not in damaged:
                    found.problems.append(f"recorded checkpoint {cid} of {sid}: blocks {bad} do not verify")
            found.verified_bytes += manifest.bytes_total
            if "pod" in summary and (summary.get("pod"), summary.get("generation")) != (
                manifest.pod,
                manifest.generation,
            ):
                found.problems.append(
                    f"recorded checkpoint {cid} of {sid}: the registry says pod {summary.get('pod')} generation "
                    f"{summary.get('generation')}, the manifest pod {manifest.pod} generation {manifest.generation}"
                )
            if manifest.generation > counter:
                found.problems.append(f"checkpoint {cid} of {sid} has generation {manifest.generation} > {counter}")

    # sessions checked CONCURRENCY at a time (a scale run's store holds 100,000+ of them)
    pending: set[asyncio.Task[None]] = set()
    async for sid in registry.audit_checkpointed_sessions():
        if len(pending) >= CONCURRENCY:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure of the checker itself is raised, not lost
        pending.add(asyncio.create_task(check_session(sid)))
    for finished in asyncio.as_completed(pending):
        await finished
    pods: dict[str, dict[str, int]] = {}

    async def index_of(pod: str) -> dict[str, int]:  # each pod's index, read once
        if pod not in pods:
            pods[pod] = await registry.sessions_of_pod(pod)
        return pods[pod]

    async for node in registry.audit_nodes():
        for sid, pod in (await registry.node_index(node)).items():
            held = await registry.session_record(sid)
            if held is None or (held.node, held.pod) != (node, pod):
                said = "nothing" if held is None else f"node {held.node} pod {held.pod}"
                found.problems.append(f"node {node} lists session {sid} on {pod}, whose record says {said}")
            elif held.generation > await registry.generation(sid):
                found.problems.append(f"session {sid} is held under a generation never handed out")
            elif sid not in await index_of(pod):
                found.problems.append(f"session {sid} is on node {node} but not in pod {pod}'s index")
    for drain_id in drains:
        if await registry.drain_verdict(drain_id) is None:
            state = await registry.drain_state(drain_id) or "never taken"
            found.problems.append(f"drain {drain_id} has no verdict ({state})")
    if temp_grace_s is not None and isinstance(store, FileStore):
        cutoff = time.time() - temp_grace_s
        for folder, _, files in os.walk(store.root):
            for name in files:
                path = os.path.join(folder, name)
                if name.startswith(".tmp-") and os.stat(path).st_mtime < cutoff:
                    found.problems.append(f"temporary file left behind: {path}")
    return found
