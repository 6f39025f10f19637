"""The invariants every fault scenario must leave standing, checked by walking the store itself and the registry,
and comparing the two both ways.

The walk: every session the store holds (``store.sessions()``) and every session the registry records checkpoints
of; for each, every checkpoint the store lists (``store.checkpoints``) and every one the registry records. Each is
read as a restore reads it: its manifest (which verifies its own digest, session and id), every chunk it references,
decrypted when the manifest names a key (``key_id``), and every chunk's digest compared.

- Registry -> store: every checkpoint the registry records is in the store and restores (manifest, chunks,
  decryption, digests): nothing acknowledged is unrestorable. It was made by the pod the registry recorded for it,
  under the generation it names, and no generation is above the session's generation counter (generations only
  grow; none handed out twice).
- Store -> registry: a checkpoint only the store holds is legitimate when it is
  (a) older (generation, sequence) than the session's newest recorded checkpoint: retention forgets the record
      before it deletes the file, and a refused save that is not stale is kept (it may be what someone else
      committed);
  (b) fenced, by the fences a restore's repair applies (``REPAIR`` in ``services/checkpoint/registry_scripts.py``): a
      checkpoint of the generation the session's holder has now made by another pod, one of a generation another pod
      took on the registry's history (a split brain's discarded side), or one of an older generation than the
      session's counter sorting after that generation's seal: a stale save, refused and not deleted yet;
  (c) of a session the scenario names in ``unrecorded``: Redis lost its newest records (a failover) and no restore
      or scrub has repaired them since (the store is the last word; the next restore records them again);
  (d) damaged so that a restore would pass over it (its manifest, a pack or a digest): it was never acknowledged.
  Any other, one newer than everything the registry records for its session that restores and passes the fences,
  is a problem: a restore would take it, so the registry lost (or never recorded) what the store committed. Such a
  checkpoint is read again from the registry until ``SETTLE_S`` has passed (a save whose manifest is committed and
  whose report is being recorded right now), then reported.
- Encrypted checkpoints are decrypted with the scenario's keys (``ciphers``); one whose key the checker was not
  given is a problem, never a pass.
- ``min_checkpoints``: the scenario made checkpoints: fewer recorded checkpoints than that found restorable is a
  problem (a walk that finds nothing proves nothing).
- ``corrupted``: checkpoint ids a scenario damaged on purpose: they may fail to restore, and each that is still in
  the store and restores cleanly is a problem (the damage did not take, or the reader missed it).
- The session a node set lists has its hash on that node, held under a generation the counter has handed out.
- Every drain in ``drains`` has a recorded verdict; for every drain id, every verdict the scenario saw published
  (``verdicts``) is that one recorded verdict (sent again under a new event id, it says the same): a second,
  different verdict for one drain id is a problem.
- No temporary file older than ``temp_grace_s`` is left in a file store.

A mesh may still run while it checks: a checkpoint the registry forgets meanwhile (retention forgets the record,
then deletes the file) is not a problem; one it still records after its file is gone is.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis

from services.checkpoint.audit import RegistryAudit
from services.checkpoint.leases import ReplicaLeases
from services.checkpoint.registry import SessionRegistry
from shared.contract.node import DrainCompleted, DrainFailed
from shared.contract.registry import codec
from shared.contract.subjects import Subjects
from shared.kv.crypto import ChunkCipher
from shared.kv.filestore import FileStore
from shared.kv.manifest import CheckpointManifest, checkpoint_order, digest
from shared.kv.store import CheckpointNotFound, CheckpointStore, StoreError

CONCURRENCY = 32
"""Sessions checked at once."""
ALL = 1_000_000
"""Checkpoints read per session: all of them."""
SETTLE_S = 10.0
"""How long a checkpoint only the store holds, newer than what the registry records, is given to be recorded (its
save's report in flight) before it is a problem."""

Verdict = DrainCompleted | DrainFailed


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    recorded: int = 0
    """Recorded checkpoints found in the store that restore (every chunk read, decrypted and verified)."""
    stored: int = 0
    """Checkpoints the store lists."""
    store_only: int = 0
    """Of those, the ones the registry does not record (legitimately: see the module's rule)."""
    fenced: int = 0
    """Of those, stale saves not deleted yet (the repair's fences)."""
    encrypted: int = 0
    """Checkpoints decrypted and verified."""
    verified_bytes: int = 0

    def __bool__(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Read:
    """A checkpoint read as a restore reads it: its manifest (None when it does not verify), and why it does not
    restore ('' when it does); ``gone``: not in the store at all."""

    manifest: CheckpointManifest | None
    why: str
    gone: bool = False


async def read_checkpoint(store: CheckpointStore, sid: str, cid: str, ciphers: dict[str, ChunkCipher]) -> Read:
    """Manifest, chunks, decryption with the key the manifest names, every digest: what a restore checks."""
    try:
        manifest = await store.manifest(sid, cid)
    except CheckpointNotFound as exc:
        return Read(None, str(exc), gone=True)
    except StoreError as exc:
        return Read(None, str(exc))
    buffers = [memoryview(bytearray(ref.length)) for ref in manifest.blocks]
    try:
        await store.read_chunks(manifest.blocks, buffers)
    except StoreError as exc:
        return Read(manifest, str(exc))
    cipher = ciphers.get(manifest.key_id) if manifest.key_id else None
    if manifest.key_id and cipher is None:
        return Read(manifest, f"encrypted with key {manifest.key_id!r}, which the checker was not given")
    bad: list[int] = []
    for i, (ref, data) in enumerate(zip(manifest.blocks, buffers, strict=True)):
        plain: memoryview | bytes = data
        if cipher is not None:
            try:
                plain = cipher.open(data, ref.nonce, ref.digest)
            except ValueError:
                bad.append(i)
                continue
        if len(plain) != ref.size or digest(plain) != ref.digest:
            bad.append(i)
    if bad:
        return Read(manifest, f"blocks {bad} do not verify")
    return Read(manifest, "")


def is_stale(
    cid: str,
    generation: int,
    pod: str,
    holder: tuple[str, int] | None,
    counter: int,
    seal: str | None,
    takers: Mapping[int, str],
) -> bool:
    """The fences of a restore's repair (``REPAIR``), written out again: a checkpoint of the generation the
    session's holder has now made by another pod, one of a generation another pod took on this history (``takers``:
    generation -> pod), or one of an older generation than the counter sorting after the seal of the counter's
    generation ('' when the store held none then: everything after it)."""
    if holder is not None and generation == holder[1] and pod != holder[0]:
        return True
    if takers.get(generation, pod) != pod:
        return True
    return seal is not None and generation < counter and cid > seal


async def check_invariants(
    store: CheckpointStore,
    client: aioredis.Redis,
    subjects: Subjects,
    *,
    min_checkpoints: int,
    drains: Iterable[str] = (),
    verdicts: Iterable[Verdict] = (),
    corrupted: Iterable[str] = (),
    ciphers: Iterable[ChunkCipher] = (),
    unrecorded: Iterable[str] = (),
    temp_grace_s: float | None = None,
) -> Findings:
    """Reads the registry through its own read methods (``SessionRegistry``, ``ReplicaLeases``) and its audit
    (``RegistryAudit``): the key layout is the registry package's alone. The store is listed by the store's own
    methods, as a restore lists it."""
    found = Findings()
    damaged = set(corrupted)
    keys = {c.key_id: c for c in ciphers}
    lagging = set(unrecorded)
    registry = SessionRegistry(client, subjects)
    audit = RegistryAudit(client, subjects)
    suspects: list[tuple[str, str]] = []

    async def still_recorded(sid: str, cid: str) -> bool:
        return any(str(r["checkpoint_id"]) == cid for r in await registry.checkpoints(sid, limit=ALL))

    async def check_session(sid: str) -> None:
        rows = {str(r["checkpoint_id"]): r for r in await registry.checkpoints(sid, limit=ALL)}
        try:
            stored = await store.checkpoints(sid)
        except StoreError as exc:
            found.problems.append(f"the store does not list session {sid}: {exc}")
            return
        found.stored += len(stored)
        counter = await registry.generation(sid)
        for cid in [c for c in rows if c not in stored] + stored:
            read = await read_checkpoint(store, sid, cid, keys)
            if cid in rows:
                await check_recorded(sid, cid, rows[cid], read, counter)
            elif not read.gone:
                found.store_only += 1
                if not read.why and cid in damaged:
                    found.problems.append(f"checkpoint {cid} of {sid} was damaged on purpose and restores cleanly")
        newest = max((checkpoint_order(c) for c in rows), default=None)
        ahead = [c for c in stored if c not in rows and (newest is None or checkpoint_order(c) > newest)]
        if ahead and sid not in lagging:
            record = await audit.session_record(sid)
            holder = (record.pod, record.generation) if record is not None else None
            seal = await audit.seal(sid)
            sealed = seal[1] if seal is not None and seal[0] == counter else None
            takers = await audit.takers(sid)
            for cid in ahead:
                read = await read_checkpoint(store, sid, cid, keys)
                if read.gone or read.why or read.manifest is None:
                    continue  # deleted meanwhile, or damaged: a restore passes over it, and it was never acknowledged
                m = read.manifest
                if is_stale(cid, m.generation, m.pod, holder, counter, sealed, takers):
                    found.fenced += 1
                    continue
                suspects.append((sid, cid))

    async def check_recorded(sid: str, cid: str, summary: dict[str, object], read: Read, counter: int) -> None:
        if read.why:
            if not await still_recorded(sid, cid):  # retention (or the scrub) forgot it, then it went, while this read
                return
            if cid not in damaged:
                found.problems.append(f"recorded checkpoint {cid} of {sid} does not restore: {read.why}")
            return
        assert read.manifest is not None
        manifest = read.manifest
        if cid in damaged:
            found.problems.append(f"recorded checkpoint {cid} of {sid} was damaged on purpose and restores cleanly")
        found.recorded += 1
        found.encrypted += manifest.key_id != ""
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

    sessions = set(await store.sessions())
    async for sid in audit.checkpointed_sessions():
        sessions.add(sid)
    # sessions checked CONCURRENCY at a time (a scale run's store holds 100,000+ of them)
    pending: set[asyncio.Task[None]] = set()
    for sid in sorted(sessions):
        if len(pending) >= CONCURRENCY:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure of the checker itself is raised, not lost
        pending.add(asyncio.create_task(check_session(sid)))
    for finished in asyncio.as_completed(pending):
        await finished
    deadline = time.monotonic() + SETTLE_S
    while suspects:
        suspects = [(sid, cid) for sid, cid in suspects if not await still_recorded(sid, cid)]
        if not suspects or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    for sid, cid in suspects:
        found.problems.append(
            f"the store holds checkpoint {cid} of {sid}, newer than anything the registry records for it, which "
            "restores and is no stale save: a restore would take it, and the registry lost it"
        )
    if found.recorded < min_checkpoints:
        found.problems.append(
            f"found {found.recorded} recorded checkpoint(s) that restore, the scenario made at least {min_checkpoints}"
        )
    await check_locations(registry, audit, found)
    await check_verdicts(ReplicaLeases(client, subjects), audit, found, list(drains), list(verdicts))
    if temp_grace_s is not None and isinstance(store, FileStore):
        cutoff = time.time() - temp_grace_s
        for folder, _, files in os.walk(store.root):
            for name in files:
                path = os.path.join(folder, name)
                if name.startswith(".tmp-") and os.stat(path).st_mtime < cutoff:
                    found.problems.append(f"temporary file left behind: {path}")
    return found


async def check_locations(registry: SessionRegistry, audit: RegistryAudit, found: Findings) -> None:
    """Every node's index agrees with each session's record and its pod's index. The indexes and the record are
    read one after the other on a mesh that may still be moving sessions, so a disagreement is read again once:
    a session that moved between two reads (its record or index changed meanwhile) is no problem; one that
    disagrees twice over the same state is."""
    pods: dict[str, dict[str, int]] = {}

    async def index_of(pod: str) -> dict[str, int]:  # each pod's index, read once while everything agrees
        if pod not in pods:
            pods[pod] = await registry.sessions_of_pod(pod)
        return pods[pod]

    async def problem(node: str, sid: str, pod: str, *, fresh: bool) -> str:
        node_index = await audit.node_index(node) if fresh else None
        if node_index is not None and node_index.get(sid) != pod:
            return ""  # it left the node (or its pod) since the node's index was read: a move, not a disagreement
        held = await audit.session_record(sid)
        if held is None or (held.node, held.pod) != (node, pod):
            said = "nothing" if held is None else f"node {held.node} pod {held.pod}"
            return f"node {node} lists session {sid} on {pod}, whose record says {said}"
        if held.generation > await registry.generation(sid):
            return f"session {sid} is held under a generation never handed out"
        index = await registry.sessions_of_pod(pod) if fresh else await index_of(pod)
        if sid not in index:
            return f"session {sid} is on node {node} but not in pod {pod}'s index"
        return ""

    async for node in audit.nodes():
        for sid, pod in (await audit.node_index(node)).items():
            if await problem(node, sid, pod, fresh=False) and (said := await problem(node, sid, pod, fresh=True)):
                found.problems.append(said)


def _said(verdict: Verdict) -> bytes:
    """What a verdict says: the event without what a copy sent again changes (its event id and source)."""
    return codec.encode(msgspec.structs.replace(verdict, event_id="", source=""))


async def check_verdicts(
    leases: ReplicaLeases, audit: RegistryAudit, found: Findings, drains: list[str], seen: list[Verdict]
) -> None:
    by_id: dict[str, set[bytes]] = {}
    for verdict in seen:
        by_id.setdefault(verdict.drain_id, set()).add(_said(verdict))
    for drain_id in sorted(set(drains) | set(by_id)):
        raw = await leases.drain_verdict(drain_id)
        if raw is None:
            if drain_id in drains:
                state = await audit.drain_state(drain_id) or "never taken"
                found.problems.append(f"drain {drain_id} has no verdict ({state})")
            recorded = None
        else:
            event = codec.decode(raw)
            recorded = _said(event) if isinstance(event, DrainCompleted | DrainFailed) else None
            if recorded is None:
                found.problems.append(f"drain {drain_id}: the recorded verdict is no verdict: {raw[:200]!r}")
        said = by_id.get(drain_id, set())
        if len(said) > 1:
            found.problems.append(f"drain {drain_id} has {len(said)} different verdicts: {sorted(said)}")
        elif said and recorded is not None and said != {recorded}:
            found.problems.append(f"drain {drain_id}: the verdict published is not the one recorded: {said}")
