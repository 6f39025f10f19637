"""``NatsObjectStore``: the ``CheckpointStore`` on one Object Store bucket. Packs and manifests are objects;
listing, reading, deleting and sweeping orphaned chunks go through the stream's subject index and consumers."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Iterable, Sequence

import nats.errors
from nats.aio.msg import Msg

from shared.contract.base import id_problem
from shared.kv.manifest import CheckpointManifest, ChunkRef, encode_manifest, newest_first
from shared.kv.objstore.codec import (
    PACK_PREFIX,
    SESSION_PREFIX,
    ObjectMeta,
    byte_view,
    chunk_subject,
    index_prefix,
    index_subject,
    manifest_name,
    meta_subject,
    name_from_b64,
    stream_time,
)
from shared.kv.objstore.reader import ChunkRun, plan_runs, read_run
from shared.kv.objstore.stream import NO_MESSAGE, ApiError, ObjectStream
from shared.kv.objstore.writer import NatsPackWriter, ObjectWriter
from shared.kv.store import CheckpointNotFound, PackInfo, StoreError, checked_pack, load_manifest

log = logging.getLogger("shared.kv.objstore")


class NatsObjectStore(ObjectStream):
    """``CheckpointStore`` on a JetStream Object Store bucket. Takes a connected client it does not own.

    The bucket is created (file storage, ``replicas``) on first use when it does not exist."""

    reindex = True
    """Whether ``sweep_orphans`` indexes manifests that have no index entry (it publishes into the bucket): off for
    a pod's bucket read by the checkpoint service, whose writer indexes every manifest itself."""

    async def _last_meta(self, name: str) -> bytes | None:
        """The last message on the object's meta subject, from the stream leader (consistent); None when there is
        none."""
        try:
            resp = await self.api(
                f"reading {name}",
                f"STREAM.MSG.GET.{self.stream}",
                {"last_by_subj": meta_subject(self.bucket, name)},
            )
        except ApiError as exc:
            if exc.err_code == NO_MESSAGE:
                return None
            raise
        try:
            return base64.b64decode(resp["message"].get("data") or "")
        except (ValueError, KeyError, TypeError):
            return b""  # unreadable: ``ObjectMeta.parse`` says why

    async def _meta(self, name: str) -> ObjectMeta | None:
        """The object's current meta; None when absent or deleted."""
        data = await self._last_meta(name)
        if data is None:
            return None
        try:
            meta = ObjectMeta.parse(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{name}: meta message unreadable: {exc}") from exc
        return None if meta.deleted else meta

    async def _subjects(self, subjects_filter: str) -> list[str]:
        """The stream's subjects matching ``subjects_filter`` that hold a message, from the server's subject index
        (no message is read; the server pages long answers)."""
        await self.ensure()
        found: list[str] = []
        offset = 0
        while True:
            resp = await self.api(
                f"listing {self.bucket}",
                f"STREAM.INFO.{self.stream}",
                {"subjects_filter": subjects_filter, "offset": offset},
            )
            subjects: dict[str, int] = (resp.get("state") or {}).get("subjects") or {}
            found.extend(subjects)
            offset += len(subjects)
            if not subjects or offset >= int(resp.get("total") or 0):
                return found

    async def _names(self) -> list[str]:
        """Every object name with a meta message (the whole bucket: retention only, never a restore)."""
        prefix = f"$O.{self.bucket}.M."
        names = (name_from_b64(subject[len(prefix) :]) for subject in await self._subjects(prefix + ">"))
        return [name for name in names if name is not None]

    async def _index(self, manifests: Sequence[CheckpointManifest]) -> None:
        """Publish each manifest's index entry (an empty message, the only one on its subject), before the
        manifest commits: the index may name a checkpoint that never committed (listing checks each meta, and
        the sweep purges such entries), it never misses one that did."""
        await self.ensure()
        try:
            acks = [
                await self.js.publish_async(
                    index_subject(self.bucket, m.session_id, m.checkpoint_id), b"", headers={"Nats-Rollup": "sub"}
                )
                for m in manifests
            ]
            await asyncio.wait_for(asyncio.gather(*acks), self.ack_timeout)
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreError(f"indexing {len(manifests)} checkpoint(s): {exc or type(exc).__name__}") from exc

    # -- CheckpointStore ----------------------------------------------------------------------------------------
    def open_pack(self) -> NatsPackWriter:
        return NatsPackWriter(self)

    async def commit_manifest(self, manifest: CheckpointManifest) -> None:
        await self.commit_manifests([manifest])

    async def commit_manifests(self, manifests: Sequence[CheckpointManifest]) -> None:
        """Each manifest is its own object whose meta message commits it; all chunks are published, then all
        metas, so a batch costs about two round trips. On error the uncommitted ones are purged."""
        if not manifests:
            return
        writers = [ObjectWriter(self, manifest_name(m.session_id, m.checkpoint_id)) for m in manifests]
        try:
            await self._index(manifests)
            for writer, manifest in zip(writers, manifests, strict=True):
                await writer.append([memoryview(encode_manifest(manifest))], last=True)
            for writer in writers:
                await writer.finish_chunks()
            metas = [await writer.send_meta() for writer in writers]
            for writer, meta in zip(writers, metas, strict=True):
                await writer.settle_meta(meta)
        except StoreError as exc:
            for writer in writers:
                await writer.abort()
            which = manifests[0].checkpoint_id if len(manifests) == 1 else f"{len(manifests)} checkpoints"
            raise StoreError(f"committing {which}: {exc}") from exc

    async def read_object(self, name: str) -> bytes:
        """A whole object's bytes, SHA-256 verified."""
        await self.ensure()
        meta = await self._meta(name)
        if meta is None:
            raise StoreError(f"{name} is missing")
        buffer = bytearray(meta.size)
        for run in plan_runs(meta, [(0, meta.size, memoryview(buffer))]):
            await read_run(self, run)
        return bytes(buffer)

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest:
        name = manifest_name(session_id, checkpoint_id)
        await self.ensure()
        meta = await self._meta(name)
        if meta is None:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id} for session {session_id}")
        buffer = bytearray(meta.size)
        try:
            for run in plan_runs(meta, [(0, meta.size, memoryview(buffer))]):
                await read_run(self, run)
        except StoreError as exc:
            raise StoreError(f"checkpoint {checkpoint_id}: manifest unreadable: {exc}") from exc
        return load_manifest(bytes(buffer), session_id, checkpoint_id)

    async def checkpoints(self, session_id: str) -> list[str]:
        """From the session's index (``index_prefix``): one request for the entries, one meta read per entry
        (an entry may name a manifest that never committed or was deleted by another tool, ``nats obj rm``),
        whatever the size of the bucket. Manifests written before the index existed are indexed by
        ``sweep_orphans``."""
        prefix = index_prefix(self.bucket, session_id)
        candidates = [s[len(prefix) :] for s in await self._subjects(prefix + "*")]
        candidates = [c for c in candidates if not id_problem("checkpoint", c)]
        metas = await asyncio.gather(*(self._meta(manifest_name(session_id, c)) for c in candidates))
        return newest_first([c for c, m in zip(candidates, metas, strict=True) if m is not None])

    async def sessions(self) -> list[str]:
        found = set()
        for name in await self._names():
            if name.startswith(SESSION_PREFIX) and name.endswith(".json") and "/" in name[len(SESSION_PREFIX) :]:
                found.add(name[len(SESSION_PREFIX) :].rsplit("/", 1)[0])
        return sorted(found)

    async def read_chunks(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        await self.ensure()
        by_pack: dict[str, list[tuple[int, int, memoryview]]] = {}
        for ref, target in zip(refs, targets, strict=True):
            view = byte_view(target)
            if len(view) != ref.length:
                raise ValueError(f"target for a chunk of pack {ref.pack} has {len(view)} bytes, not {ref.length}")
            by_pack.setdefault(ref.pack, []).append((ref.offset, ref.length, view))
        packs = list(by_pack)
        metas = await asyncio.gather(*(self._meta(PACK_PREFIX + p) for p in packs))
        runs: list[ChunkRun] = []
        for pack, meta in zip(packs, metas, strict=True):
            if meta is None:
                raise StoreError(f"pack {pack} is missing")
            for offset, length, _ in by_pack[pack]:
                if offset + length > meta.size:
                    raise StoreError(
                        f"pack {pack} is truncated: wanted {length} bytes at {offset}, it holds {meta.size}"
                    )
            runs.extend(plan_runs(meta, by_pack[pack]))
        if len(runs) == 1 or self.read_concurrency == 1:
            for run in runs:
                await read_run(self, run)
            return
        gate = asyncio.Semaphore(self.read_concurrency)

        async def one(run: ChunkRun) -> None:
            async with gate:
                await read_run(self, run)

        tasks = [asyncio.ensure_future(one(r)) for r in runs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _delete_object(self, name: str) -> None:
        """Purge the meta first (the object disappears at once), then its chunks."""
        await self.ensure()
        meta = await self._meta_any(name)
        await self.purge(meta_subject(self.bucket, name))
        if meta is not None and meta.nuid:
            await self.purge(chunk_subject(self.bucket, meta.nuid))

    async def _meta_any(self, name: str) -> ObjectMeta | None:
        data = await self._last_meta(name)
        if data is None:
            return None
        try:
            return ObjectMeta.parse(data)
        except (ValueError, KeyError, TypeError):
            return None

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        """The manifest first, then its index entry (an entry left behind names nothing: listing checks)."""
        await self._delete_object(manifest_name(session_id, checkpoint_id))
        await self.purge(index_subject(self.bucket, session_id, checkpoint_id))

    async def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]:
        """The size of each named pack that exists: one meta read each, never a scan of the bucket."""
        ids = sorted(set(pack_ids))
        metas = await asyncio.gather(*(self._meta(PACK_PREFIX + checked_pack(p)) for p in ids))
        return {p: m.size for p, m in zip(ids, metas, strict=True) if m is not None}

    async def manifests_present(self, checkpoints: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """One meta read each, never a listing of a session's index."""
        await self.ensure()
        wanted = sorted(
            (s, c) for s, c in set(checkpoints) if not id_problem("session", s) and not id_problem("checkpoint", c)
        )
        metas = await asyncio.gather(*(self._meta(manifest_name(s, c)) for s, c in wanted))
        return {pair for pair, meta in zip(wanted, metas, strict=True) if meta is not None}

    async def packs(self) -> list[PackInfo]:
        metas = await self._scan_metas()
        return [
            PackInfo(m.name[len(PACK_PREFIX) :], m.size, m.modified)
            for m in metas
            if m.name.startswith(PACK_PREFIX) and not m.deleted
        ]

    async def _scan_metas(self, strict: bool = False) -> list[ObjectMeta]:
        """Every object's current meta, through one consumer (last message per meta subject). ``strict``: a
        meta that cannot be read fails the scan instead of being skipped (the sweep must never take a live
        object's chunks for orphans)."""
        await self.ensure()
        metas: list[ObjectMeta] = []

        def on_msg(k: int, msg: Msg) -> None:
            try:
                metas.append(ObjectMeta.parse(msg.data))
            except (ValueError, KeyError, TypeError) as exc:
                if strict:
                    raise StoreError(f"listing {self.bucket}: unreadable meta on {msg.subject}: {exc}") from exc
                log.warning("skipping an unreadable object meta", extra={"subject": msg.subject, "error": str(exc)})

        await self.consume(
            f"listing {self.bucket}",
            {"filter_subject": f"$O.{self.bucket}.M.>", "deliver_policy": "last_per_subject"},
            lambda pending: pending,
            on_msg,
            window_bytes=4 * 1024 * 1024,
            msg_bytes=16 * 1024,  # metas are ~0.5 KiB, more when interleaved writers fragment the sequences
        )
        return metas

    async def _index_missing(self, subjects: list[str]) -> None:
        for start in range(0, len(subjects), 256):
            try:
                acks = [
                    await self.js.publish_async(subject, b"", headers={"Nats-Rollup": "sub"})
                    for subject in subjects[start : start + 256]
                ]
                await asyncio.wait_for(asyncio.gather(*acks), self.ack_timeout)
            except (TimeoutError, nats.errors.Error) as exc:
                raise StoreError(f"indexing {len(subjects)} manifest(s): {exc or type(exc).__name__}") from exc
        if subjects:
            log.info("manifests indexed", extra={"bucket": self.bucket, "count": len(subjects)})

    async def delete_pack(self, pack_id: str) -> None:
        await self._delete_object(PACK_PREFIX + pack_id)

    async def sweep_orphans(self, grace_s: float = 3600.0) -> int:
        """Purge chunk subjects that no meta references and whose first chunk is older than ``grace_s``
        (writes that were aborted while the server was unreachable), and index entries older than that whose
        manifest is gone; index the manifests that have no entry (written before the index existed, or by
        another client). Returns how many subjects were purged."""
        await self.ensure()
        metas = await self._scan_metas(strict=True)
        live = {m.nuid for m in metas}
        prefix = f"$O.{self.bucket}.C."
        entries = set(await self._subjects(index_prefix(self.bucket) + ">"))
        orphans = [s for s in await self._subjects(prefix + "*") if s[len(prefix) :] not in live]
        manifests = {
            index_subject(self.bucket, *m.name[len(SESSION_PREFIX) : -5].split("/"))
            for m in metas
            if _is_manifest(m.name)
        }
        if self.reindex:
            await self._index_missing(sorted(manifests - entries))
        orphans += sorted(entries - manifests)
        purged = 0
        now = time.time()
        for subject in orphans:
            stamps: list[float] = []

            def on_msg(k: int, msg: Msg, stamps: list[float] = stamps) -> None:
                stamps.append(stream_time(msg.reply))

            await self.consume(
                f"checking {subject}",
                {"filter_subject": subject, "deliver_policy": "all", "headers_only": True},
                lambda pending: min(pending, 1),
                on_msg,
                window_bytes=64 * 1024,
                msg_bytes=1024,
            )
            if stamps and now - stamps[0] >= grace_s:
                await self.purge(subject)
                purged += 1
        return purged


def _is_manifest(name: str) -> bool:
    """``sessions/<session>/<checkpoint>.json`` with valid ids (the only names an index entry is made for)."""
    if not (name.startswith(SESSION_PREFIX) and name.endswith(".json")):
        return False
    parts = name[len(SESSION_PREFIX) : -5].split("/")
    return len(parts) == 2 and not id_problem("session", parts[0]) and not id_problem("checkpoint", parts[1])
