"""The invariants every fault scenario must leave standing, checked by walking the store and the registry.

- Every checkpoint the registry recorded is in the store, its manifest verifies (its own digest, session, id),
  and every chunk it references reads back with the digest it claims: nothing acknowledged is unrestorable.
- A recorded checkpoint was made by the pod the registry recorded for it, under the generation it names, and no
  generation is above the session's generation counter (generations only grow; none handed out twice).
- The session a node set lists has its hash on that node, held under a generation the counter has handed out.
- Every drain the scenario started has exactly one recorded verdict.
- No temporary file older than the grace period is left in a file store.

``corrupted``: checkpoint ids a scenario damaged on purpose; the checker expects those, and only those, to fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shared.contract.subjects import Subjects
from shared.kv.filestore import FileStore
from shared.kv.manifest import digest
from shared.kv.store import CheckpointStore, StoreError
from shared.plumbing.replies import as_text

CONCURRENCY = 32
"""Sessions checked at once."""


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
    found = Findings()
    damaged = set(corrupted)
    r: Any = client  # redis-py types its replies as unions; these keys hold bytes
    key = lambda *parts: subjects.redis_key("kv", *parts)  # noqa: E731
    prefix = key("checkpoints", "")

    async def check_session(sid: str) -> None:
        counter = int(await r.get(key("generation", sid)) or 0)
        for cid_raw in await r.zrange(key("checkpoints", sid), 0, -1):
            cid = cid_raw.decode()
            found.recorded += 1
            summary = json.loads(await r.get(key("checkpoint", cid)) or b"{}")
            try:
                manifest = await store.manifest(sid, cid)
                buffers = [memoryview(bytearray(ref.length)) for ref in manifest.blocks]
                await store.read_chunks(manifest.blocks, buffers)
            except StoreError as exc:
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
            if summary and (summary.get("pod"), summary.get("generation")) != (manifest.pod, manifest.generation):
                found.problems.append(
                    f"recorded checkpoint {cid} of {sid}: the registry says pod {summary.get('pod')} generation "
                    f"{summary.get('generation')}, the manifest pod {manifest.pod} generation {manifest.generation}"
                )
            if manifest.generation > counter:
                found.problems.append(f"checkpoint {cid} of {sid} has generation {manifest.generation} > {counter}")

    # sessions checked CONCURRENCY at a time (a scale run's store holds 100,000+ of them)
    pending: set[asyncio.Task[None]] = set()
    async for raw in r.scan_iter(match=prefix + "*", count=1000):
        if len(pending) >= CONCURRENCY:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure of the checker itself is raised, not lost
        pending.add(asyncio.create_task(check_session(as_text(raw)[len(prefix) :])))
    for finished in asyncio.as_completed(pending):
        await finished
    node_prefix = key("onnode", "")
    async for raw in r.scan_iter(match=node_prefix + "*"):
        node = raw.decode()[len(node_prefix) :]
        for sid_raw, pod_raw in (await r.hgetall(raw)).items():
            sid, pod = sid_raw.decode(), pod_raw.decode()
            held = await r.hgetall(key("session", sid))
            if (held.get(b"node", b"").decode(), held.get(b"pod", b"").decode()) != (node, pod):
                found.problems.append(
                    f"node {node} lists session {sid} on {pod}, whose record says {held or 'nothing'}"
                )
            elif int(held.get(b"generation", b"0")) > int(await r.get(key("generation", sid)) or 0):
                found.problems.append(f"session {sid} is held under a generation never handed out")
            elif await r.hget(key("held", pod), sid) is None:
                found.problems.append(f"session {sid} is on node {node} but not in pod {pod}'s index")
    for drain_id in drains:
        record = await r.hgetall(key("drain", drain_id))
        if not record.get(b"verdict"):
            found.problems.append(f"drain {drain_id} has no verdict ({record.get(b'state', b'never taken')!r})")
    if temp_grace_s is not None and isinstance(store, FileStore):
        cutoff = time.time() - temp_grace_s
        for folder, _, files in os.walk(store.root):
            for name in files:
                path = os.path.join(folder, name)
                if name.startswith(".tmp-") and os.stat(path).st_mtime < cutoff:
                    found.problems.append(f"temporary file left behind: {path}")
    return found
