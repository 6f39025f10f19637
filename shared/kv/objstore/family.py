"""``nats://<bucket>``: one Object Store bucket per pod, so that a pod can write and delete only its own checkpoints.

    <bucket>-<owner>     a pod's bucket (``owner``: ``permissions.bucket_owner(pod)``): its packs and manifests,
                         laid out as any bucket (``shared.kv.objstore``); only that pod writes or purges it
    OBJIDX_<bucket>      the family's index: ``$O.<bucket>.I.<session>.<checkpoint>.<owner>``, one empty message per
                         committed manifest, naming the bucket it is in; a pod may add entries ending with its own
                         owner token and remove none (the checkpoint service purges them with the manifest)
    <bucket>             the single bucket of earlier versions: still read (its packs and manifests restore),
                         never written

A pack's id ends with its owner (``<32 hex>-<owner>``): a manifest whose blocks are partly another pod's (a new
holder's incremental save references what the old holder wrote) says in each ``ChunkRef.pack`` which bucket the
bytes are in. A pack id of 32 hex digits alone is the single bucket's.

A manifest is found through the index with one request whatever the size of the fleet (the entries of one session,
or of one checkpoint), then read from the bucket the entry names; it must say it was written by that bucket's pod
(the bucket proves the writer: nobody else can write there), else it is refused as corrupt.

Every read is a JetStream direct get (``$JS.API.DIRECT.GET.<stream>``): no consumer, so a pod needs no right to
pull from any consumer (see ``shared.contract.permissions``, where the rights are). A store opened with ``pod``
writes (``open_pack``, ``commit_manifests``) into that pod's bucket, created on first use where the pod's user may
(a trusted setup; on a secured server it may not); one opened without (the checkpoint service) reads, lists and
deletes in every bucket of the family, found by listing the streams, and makes each pod's bucket when it first
hears the pod (``provision``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.contract.base import id_problem
from shared.contract.permissions import INDEX_TOKEN, bucket_owner, index_stream, pod_bucket
from shared.kv.manifest import CheckpointManifest, ChunkRef, newest_first
from shared.kv.objstore.codec import PACK_PREFIX, ObjectMeta, manifest_name, meta_subject
from shared.kv.objstore.store import NatsObjectStore
from shared.kv.objstore.stream import STREAM_NOT_FOUND, ApiError, ObjectStream
from shared.kv.objstore.writer import ObjectWriter
from shared.kv.store import (
    CheckpointNotFound,
    ManifestCorrupt,
    PackInfo,
    StoreError,
    checked_ids,
    checked_pack,
)

_OWNED_PACK = re.compile(r"^[0-9a-f]{32}-(?P<owner>[A-Za-z0-9_-]+)$")
LEGACY_ABSENT_S = 60.0
"""How long the store believes the single bucket of earlier versions absent once it found no such stream."""
META_READS_AT_ONCE = 16

T = TypeVar("T")


def pack_owner(pack_id: str) -> str:
    """The owner token a pack id ends with; '' for a pack of the single bucket (32 hex digits alone)."""
    match = _OWNED_PACK.match(checked_pack(pack_id))
    return match["owner"] if match else ""


def _stamp_ns(text: str) -> int:
    """Nanoseconds since the epoch of a direct get's ``Nats-Time-Stamp`` (RFC 3339 with nanoseconds)."""
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", text.strip())
    if match is None:
        return 0
    whole = datetime.fromisoformat(match[1] + ("+00:00" if match[3] == "Z" else match[3]))
    fraction = (match[2] or "0")[:9].ljust(9, "0")
    return int(whole.timestamp()) * 1_000_000_000 + int(fraction)


async def _direct_get(stream: ObjectStream, what: str, body: dict[str, Any]) -> Msg | None:
    """One message by a direct get (``last_by_subj``, or ``seq`` with ``next_by_subj``); None when there is none.
    The message's ``reply`` is made the acknowledgement subject a consumer would have delivered it with, so the
    codec reads its stream sequence and time as for a consumer's (``stream_seq``, ``stream_time``)."""
    try:
        msg = await stream.nc.request(
            f"{stream.api_prefix}.DIRECT.GET.{stream.stream}", json.dumps(body).encode(), timeout=stream.api_timeout
        )
    except nats.errors.NoRespondersError:
        raise StoreError(f"{what}: JetStream is not available on this connection") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise StoreError(f"{what}: no answer from the server within {stream.api_timeout:g}s") from None
    except nats.errors.Error as exc:
        raise StoreError(f"{what}: {exc or type(exc).__name__}") from exc
    headers = msg.headers or {}
    status = headers.get("Status", "")
    if status == "404":
        return None
    if status:
        raise StoreError(f"{what}: the server answered {status} {headers.get('Description', '')}".rstrip())
    if msg.data[:1] == b"{" and not headers.get("Nats-Sequence"):  # an API error, not a message
        error = json.loads(msg.data).get("error") or {}
        raise ApiError(what, error.get("code", 0), error.get("err_code", 0), error.get("description", ""))
    seq = int(headers.get("Nats-Sequence") or 0)
    stamp = _stamp_ns(headers.get("Nats-Time-Stamp") or "")
    reply = f"$JS.ACK.{stream.stream}.direct.1.{seq}.1.{stamp}.0"
    return Msg(stream.nc, subject=headers.get("Nats-Subject", ""), reply=reply, data=msg.data, headers=headers)


class DirectObjectStore(NatsObjectStore):
    """One bucket of the family, read through direct gets only (metas, chunks, listings); written as any bucket."""

    async def _last_meta(self, name: str) -> bytes | None:
        await self.ensure()
        msg = await _direct_get(self, f"reading {name}", {"last_by_subj": meta_subject(self.bucket, name)})
        return None if msg is None else msg.data

    async def consume(
        self,
        what: str,
        config: dict[str, Any],
        count_from_pending: Callable[[int], int],
        on_msg: Callable[[int, Msg], Any],
        window_bytes: int,
        msg_bytes: int,
        short: Callable[[int], StoreError] | None = None,
    ) -> None:
        """The messages a consumer of ``config`` (``filter_subject``, from ``opt_start_seq`` or the first) would
        deliver, one direct get each, in order. How many the subject holds is not asked first: the caller's count
        is read, and a subject that ends before it is ``short``."""
        subject = config["filter_subject"]
        if config.get("deliver_policy", "all") not in ("all", "by_start_sequence"):
            raise ValueError(f"{what}: a direct read cannot deliver {config.get('deliver_policy')}")
        seq = int(config.get("opt_start_seq") or 1)
        total = count_from_pending(1 << 62)
        for k in range(max(total, 0)):
            msg = await _direct_get(self, what, {"seq": seq, "next_by_subj": subject})
            if msg is None:
                raise short(k) if short is not None else StoreError(f"{what}: the server ran out of messages")
            result = on_msg(k, msg)
            if result is not None:
                await result
            seq = int((msg.headers or {}).get("Nats-Sequence") or seq) + 1

    async def _scan_metas(self, strict: bool = False) -> list[ObjectMeta]:
        """Every object's current meta: the meta subjects from the subject index, each one's last message read."""
        prefix = f"$O.{self.bucket}.M."
        subjects = await self._subjects(prefix + ">")
        gate = asyncio.Semaphore(META_READS_AT_ONCE)

        async def one(subject: str) -> ObjectMeta | None:
            async with gate:
                msg = await _direct_get(self, f"listing {self.bucket}", {"last_by_subj": subject})
            if msg is None:
                return None
            try:
                return ObjectMeta.parse(msg.data)
            except (ValueError, KeyError, TypeError) as exc:
                if strict:
                    raise StoreError(f"listing {self.bucket}: unreadable meta on {subject}: {exc}") from exc
                return None

        return [m for m in await asyncio.gather(*(one(s) for s in subjects)) if m is not None]


class FamilyIndex(ObjectStream):
    """The stream ``OBJIDX_<bucket>``: one empty message per committed manifest, on
    ``$O.<bucket>.I.<session>.<checkpoint>.<owner>`` (one per subject; no roll-ups, no message deletes)."""

    def __init__(self, nc: Client, bucket: str, *, replicas: int = 1, create: bool = True) -> None:
        super().__init__(nc, bucket, replicas=replicas, create=create)
        self.stream = index_stream(bucket)
        self.root = f"$O.{bucket}.{INDEX_TOKEN}"

    async def _create(self) -> None:
        """The index stream: one entry per checkpoint (its subject names the owning pod), read by direct gets."""
        config = {
            "name": self.stream,
            "description": "gpuwarden: which pod's bucket holds each checkpoint",
            "subjects": [f"{self.root}.>"],
            "storage": "file",
            "num_replicas": self.replicas,
            "retention": "limits",
            "discard": "old",
            "max_msgs_per_subject": 1,
            "allow_direct": True,
            "deny_delete": True,
            "allow_rollup_hdrs": False,
        }
        try:
            await self.api(f"creating {self.stream}", f"STREAM.CREATE.{self.stream}", config)
        except ApiError as exc:
            if "already in use" not in str(exc):
                raise

    def entry(self, session_id: str, checkpoint_id: str, owner: str) -> str:
        checked_ids(session_id, checkpoint_id)
        return f"{self.root}.{session_id}.{checkpoint_id}.{owner}"

    async def entries(self, session_id: str = "", checkpoint_id: str = "") -> list[tuple[str, str, str]]:
        """(session, checkpoint, owner) of the entries of one checkpoint, one session, or all; none when the index
        does not exist yet. One request (the server pages a long answer)."""
        if session_id:
            checked_ids(session_id, checkpoint_id or None)
        pattern = f"{self.root}.{session_id or '*'}.{checkpoint_id or '*'}.*"
        try:
            await self.ensure()
        except ApiError as exc:
            if exc.err_code == STREAM_NOT_FOUND:
                return []
            raise
        found: list[tuple[str, str, str]] = []
        offset = 0
        while True:
            resp = await self.api(
                f"listing {self.stream}", f"STREAM.INFO.{self.stream}", {"subjects_filter": pattern, "offset": offset}
            )
            subjects: dict[str, int] = (resp.get("state") or {}).get("subjects") or {}
            for subject in subjects:
                parts = subject[len(self.root) + 1 :].split(".")
                if len(parts) == 3 and not id_problem("session", parts[0]) and not id_problem("checkpoint", parts[1]):
                    found.append((parts[0], parts[1], parts[2]))
            offset += len(subjects)
            if not subjects or offset >= int(resp.get("total") or 0):
                return found

    async def add(self, entries: Sequence[str]) -> None:
        await self.ensure()
        try:
            acks = [await self.js.publish_async(subject, b"") for subject in entries]
            await asyncio.wait_for(asyncio.gather(*acks), self.ack_timeout)
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreError(f"indexing {len(entries)} checkpoint(s): {exc or type(exc).__name__}") from exc

    async def stamp(self, subject: str) -> float | None:
        """When the entry was written (seconds since the epoch); None when it is gone."""
        msg = await _direct_get(self, f"reading {subject}", {"last_by_subj": subject})
        return None if msg is None else _stamp_ns((msg.headers or {}).get("Nats-Time-Stamp") or "") / 1e9


class PodBuckets:
    """``CheckpointStore`` over the family ``<bucket>``: see the module's docstring. Takes a connected client it does
    not own. ``pod``: the pod this store writes as (an agent's); empty: read and delete only (the service's)."""

    def __init__(self, nc: Client, bucket: str, *, pod: str = "", replicas: int = 1, **tunables: Any) -> None:
        self.nc = nc
        self.bucket = bucket
        self.url = f"nats://{bucket}"
        self.pod = pod
        self.owner = bucket_owner(pod) if pod else ""
        self.replicas = replicas
        self._tunables = tunables
        self.index = FamilyIndex(nc, bucket, replicas=replicas)
        self._buckets: dict[str, DirectObjectStore] = {}
        self._legacy_absent_until = 0.0

    # -- the buckets ----------------------------------------------------------------------------------------------
    def _store(self, name: str) -> DirectObjectStore:
        store = self._buckets.get(name)
        if store is None:
            own = bool(self.owner) and name == pod_bucket(self.bucket, self.owner)
            store = DirectObjectStore(self.nc, name, replicas=self.replicas, create=own, **self._tunables)
            store.reindex = own or name == self.bucket
            self._buckets[name] = store
        return store

    async def provision(self, pod: str) -> None:
        """Make ``pod``'s bucket when it does not exist yet, with the family's configuration: what the checkpoint
        service does when it first hears a pod, so that no pod needs the right to create a stream (a stream's
        configuration names its subjects: a pod creating its own bucket could claim another pod's). Idempotent;
        raises ``StoreError`` when the server refuses or does not answer."""
        store = self._store(pod_bucket(self.bucket, bucket_owner(pod)))
        store.create = True  # the one bucket this store makes rather than only reads
        await store.ensure()

    def _own(self) -> DirectObjectStore:
        if not self.owner:
            raise StoreError(
                f"{self.url}: this store was opened without a pod, so it writes nowhere (open_store(pod=))"
            )
        return self._store(pod_bucket(self.bucket, self.owner))

    def _of_owner(self, owner: str) -> DirectObjectStore:
        return self._store(pod_bucket(self.bucket, owner) if owner else self.bucket)

    async def _legacy(self) -> DirectObjectStore | None:
        """The single bucket of earlier versions, when it exists."""
        if time.monotonic() < self._legacy_absent_until:
            return None
        store = self._store(self.bucket)
        try:
            await store.ensure()
        except ApiError as exc:
            if exc.err_code != STREAM_NOT_FOUND:
                raise
            self._legacy_absent_until = time.monotonic() + LEGACY_ABSENT_S
            return None
        return store

    async def _family(self) -> list[DirectObjectStore]:
        """Every bucket of the family that exists: the streams are listed (retention's walks only)."""
        names: list[str] = []
        offset = 0
        while True:
            resp = await self._store(self.bucket).api(
                f"listing the buckets of {self.bucket}", "STREAM.NAMES", {"offset": offset}
            )
            page: list[str] = resp.get("streams") or []
            names += page
            offset += len(page)
            if not page or offset >= int(resp.get("total") or 0):
                break
        prefix = f"OBJ_{self.bucket}-"
        found = [self._store(n[len("OBJ_") :]) for n in sorted(names) if n.startswith(prefix)]
        legacy = await self._legacy()
        return [*([legacy] if legacy is not None else []), *found]

    async def _holds(self, owner: str, name: str) -> bool:
        """Whether ``owner``'s bucket holds the object ``name`` (a bucket that is gone holds nothing)."""
        try:
            return await self._of_owner(owner)._meta(name) is not None
        except ApiError as exc:
            if exc.err_code == STREAM_NOT_FOUND:
                return False
            raise

    async def _gather(self, works: Iterable[Awaitable[T]]) -> list[T]:
        return list(await asyncio.gather(*works))

    # -- CheckpointStore ----------------------------------------------------------------------------------------
    def open_pack(self) -> ObjectWriter:
        pack_id = f"{uuid.uuid4().hex}-{self.owner}"
        return ObjectWriter(self._own(), PACK_PREFIX + pack_id, pack_id)

    async def commit_manifest(self, manifest: CheckpointManifest) -> None:
        await self.commit_manifests([manifest])

    async def commit_manifests(self, manifests: Sequence[CheckpointManifest]) -> None:
        """Each manifest is named in the family's index, then committed in this pod's bucket (an entry may name a
        manifest that never committed: readers check; never the reverse)."""
        own = self._own()
        if not manifests:
            return
        await self.index.add([self.index.entry(m.session_id, m.checkpoint_id, self.owner) for m in manifests])
        await own.commit_manifests(manifests)

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest:
        checked_ids(session_id, checkpoint_id)
        for _, _, owner in await self.index.entries(session_id, checkpoint_id):
            try:
                manifest = await self._of_owner(owner).manifest(session_id, checkpoint_id)
            except CheckpointNotFound:
                continue
            except ApiError as exc:
                if exc.err_code == STREAM_NOT_FOUND:  # the pod's bucket itself is gone
                    continue
                raise
            if bucket_owner(manifest.pod) != owner:
                raise ManifestCorrupt(
                    f"checkpoint {checkpoint_id}: found in the bucket of pod {owner}, but written as pod "
                    f"{manifest.pod!r}: refused"
                )
            return manifest
        legacy = await self._legacy()
        if legacy is None:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id} for session {session_id}")
        return await legacy.manifest(session_id, checkpoint_id)

    async def manifests_present(self, checkpoints: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """Each checkpoint's index entries (one request each, all at once), each checked against its bucket (one
        meta read each); what no entry names, in the single bucket when it exists."""
        wanted = sorted(
            (s, c) for s, c in set(checkpoints) if not id_problem("session", s) and not id_problem("checkpoint", c)
        )

        async def present(session_id: str, checkpoint_id: str) -> bool:
            for _, _, owner in await self.index.entries(session_id, checkpoint_id):
                if await self._holds(owner, manifest_name(session_id, checkpoint_id)):
                    return True
            return False

        found = await self._gather(present(s, c) for s, c in wanted)
        held = {pair for pair, ok in zip(wanted, found, strict=True) if ok}
        rest = [pair for pair in wanted if pair not in held]
        legacy = await self._legacy() if rest else None
        if legacy is not None:
            held |= await legacy.manifests_present(rest)
        return held

    async def checkpoints(self, session_id: str) -> list[str]:
        """The session's index entries (one request), each checked against its bucket (one meta read each), and
        the single bucket's (one listing, when it exists)."""
        checked_ids(session_id)
        entries = await self.index.entries(session_id)

        async def present(checkpoint_id: str, owner: str) -> bool:
            return await self._holds(owner, manifest_name(session_id, checkpoint_id))

        found = await self._gather(present(c, o) for _, c, o in entries)
        ids = {c for (_, c, _), ok in zip(entries, found, strict=True) if ok}
        legacy = await self._legacy()
        if legacy is not None:
            ids.update(await legacy.checkpoints(session_id))
        return newest_first(sorted(ids))

    async def sessions(self) -> list[str]:
        found = {s for s, _, _ in await self.index.entries()}
        legacy = await self._legacy()
        if legacy is not None:
            found.update(await legacy.sessions())
        return sorted(found)

    async def read_chunks(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        by_owner: dict[str, tuple[list[ChunkRef], list[memoryview]]] = {}
        for ref, target in zip(refs, targets, strict=True):
            owned = by_owner.setdefault(pack_owner(ref.pack), ([], []))
            owned[0].append(ref)
            owned[1].append(target)
        await self._gather(self._of_owner(o).read_chunks(r, t) for o, (r, t) in by_owner.items())

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        """In every bucket an index entry names, then the entry; and in the single bucket when it exists."""
        checked_ids(session_id, checkpoint_id)
        for _, _, owner in await self.index.entries(session_id, checkpoint_id):
            await self._of_owner(owner).delete_checkpoint(session_id, checkpoint_id)
            await self.index.purge(self.index.entry(session_id, checkpoint_id, owner))
        legacy = await self._legacy()
        if legacy is not None:
            await legacy.delete_checkpoint(session_id, checkpoint_id)

    async def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]:
        by_owner: dict[str, list[str]] = {}
        for pack_id in set(pack_ids):
            by_owner.setdefault(pack_owner(pack_id), []).append(pack_id)
        sizes: dict[str, int] = {}
        for found in await self._gather(self._of_owner(o).pack_sizes(ids) for o, ids in by_owner.items()):
            sizes.update(found)
        return sizes

    async def packs(self) -> list[PackInfo]:
        return [p for store in await self._family() for p in await store.packs()]

    async def delete_pack(self, pack_id: str) -> None:
        await self._of_owner(pack_owner(pack_id)).delete_pack(pack_id)

    async def sweep_orphans(self, grace_s: float = 3600.0) -> int:
        """Each bucket's orphans (``NatsObjectStore.sweep_orphans``), and index entries older than ``grace_s`` whose
        manifest is not in the bucket they name."""
        purged = 0
        for store in await self._family():
            purged += await store.sweep_orphans(grace_s)
        now = time.time()
        for session_id, checkpoint_id, owner in await self.index.entries():
            if await self._holds(owner, manifest_name(session_id, checkpoint_id)):
                continue
            subject = self.index.entry(session_id, checkpoint_id, owner)
            stamp = await self.index.stamp(subject)
            if stamp is not None and now - stamp >= grace_s:
                await self.index.purge(subject)
                purged += 1
        return purged

    async def close(self) -> None:
        for store in self._buckets.values():
            await store.close()
        await self.index.close()
