"""The NATS JetStream Object Store (``nats://<bucket>``): checkpoints reachable from every node.

The bucket is a normal Object Store, so ``nats obj ls/get`` and every client library read it:

    stream     OBJ_<bucket>
    chunks     $O.<bucket>.C.<nuid>              one message per ``chunk_size`` bytes, in order
    meta       $O.<bucket>.M.<base64url(name)>   the ObjectInfo JSON (name, nuid, size, chunks, SHA-256 digest,
                                                 mtime, options.max_chunk_size), rolled up per subject
    objects    packs/<pack_id>                   chunk bytes of one save round
               sessions/<session_id>/<checkpoint_id>.json   one manifest per committed checkpoint

As in the Object Store protocol, the meta message is the commit: chunks are published and acknowledged first,
then the meta message makes the object visible. Packs are committed before the manifests that reference them,
and a manifest is the last thing written, so a save that fails anywhere leaves no visible checkpoint.

Throughput path:

- writes publish chunk messages with ``publish_async`` under a bounded window of outstanding acknowledgements;
  blocks that are at least a chunk long are published straight from the caller's memory, only the seams
  between blocks go through a one-chunk staging buffer; the object's SHA-256 is computed in a worker thread
  while the event loop publishes;
- reads compute which chunks hold the wanted byte ranges and fetch exactly those messages through an ephemeral
  pull consumer that starts at the first wanted chunk's stream sequence, with large batches, copying each
  payload straight into the caller's preallocated targets (no per-object accumulation; nats-py's own ``get()``
  concatenates ``bytes`` and is quadratic in the object size).

The stream sequence of every chunk comes from its publish acknowledgement and is recorded, run-length
encoded, in the meta's ``headers`` (``Gpuwarden-Chunk-Sequences``), which other tools carry along and ignore.
Objects without it (written by another client) are read from their first chunk. Every delivered chunk's
stream sequence and length are checked against the meta, so a deleted or short chunk is reported as a
truncated pack, never silently shifted bytes. The object's SHA-256 is verified whenever a whole object is
read (manifests always; packs when a restore reads all of one). Per-block integrity stays with the caller's
digests (``ChunkRef.digest``), which also catch corruption that happened before the bytes reached NATS.

Deleting an object purges its meta subject first (it disappears at once), then its chunks. A write aborted
while the server was unreachable leaves chunks without a meta; ``sweep_orphans`` purges them once old enough.

Durability is the server's: use replicas 3 and ``sync_interval: always`` for checkpoints that must survive
power loss (by default the server fsyncs every 2 minutes).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.nuid import NUID

from shared.kv.manifest import CheckpointManifest, ChunkRef, encode_manifest, newest_first
from shared.kv.store import CheckpointNotFound, PackInfo, StoreError, load_manifest

log = logging.getLogger(__name__)

BUCKET_RE = re.compile(r"^[A-Za-z0-9_-]+$")
SEQUENCES_HEADER = "Gpuwarden-Chunk-Sequences"
PACK_PREFIX = "packs/"
SESSION_PREFIX = "sessions/"

MAX_CHUNK_SIZE = 1024 * 1024  # 256 KiB..1 MiB measured alike; 1 MiB: fewer messages, 2 MiB blocks align
WINDOW_BYTES = 16 * 1024 * 1024  # outstanding publish acks, and bytes per pull request pair, per object
READ_CONCURRENCY = 2  # chunk runs read at once (each with its own consumer)
HASH_BACKLOG = 16  # chunk payloads queued for the hashing thread before the reader waits
INLINE_HASH_BYTES = 256 * 1024  # appends smaller than this are hashed on the event loop


def _b64name(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


def _name_from_b64(token: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def _byte_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _parse_mtime(text: str | None) -> float:
    if not text:
        return 0.0
    value = text.replace("Z", "+00:00")
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", value)
    if match and match.group(2) and len(match.group(2)) > 7:  # Go writes nanoseconds; Python reads micro
        value = match.group(1) + match.group(2)[:7] + match.group(3)
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return 0.0


def encode_sequences(seqs: Sequence[int]) -> str:
    """Chunk stream sequences, ascending, as runs: ``start+count`` then ``gap+count`` (gap from the previous
    run's last sequence). One run when no other publisher interleaved: ``1024+256``."""
    runs: list[str] = []
    prev_end = 0
    i = 0
    while i < len(seqs):
        j = i
        while j + 1 < len(seqs) and seqs[j + 1] == seqs[j] + 1:
            j += 1
        runs.append(f"{seqs[i] - prev_end}+{j - i + 1}")
        prev_end = seqs[j]
        i = j + 1
    return ",".join(runs)


def decode_sequences(text: str) -> list[int]:
    seqs: list[int] = []
    prev_end = 0
    for run in text.split(","):
        gap, count = run.split("+")
        start = prev_end + int(gap)
        seqs.extend(range(start, start + int(count)))
        prev_end = seqs[-1]
    return seqs


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What the meta message says about one object."""

    name: str
    nuid: str
    size: int
    chunks: int
    digest: str
    chunk_size: int
    modified: float
    seqs: list[int] | None
    deleted: bool = False

    def chunk_length(self, index: int) -> int:
        return self.chunk_size if index < self.chunks - 1 else self.size - self.chunk_size * (self.chunks - 1)

    @classmethod
    def parse(cls, data: bytes) -> ObjectMeta:
        info = json.loads(data)
        options = info.get("options") or {}
        headers = info.get("headers") or {}
        seqs = None
        raw = headers.get(SEQUENCES_HEADER)
        if isinstance(raw, list) and raw:
            raw = raw[0]
        size = int(info.get("size") or 0)
        chunks = int(info.get("chunks") or 0)
        if isinstance(raw, str) and raw:
            try:
                seqs = decode_sequences(raw)
            except ValueError:
                seqs = None
            if seqs is not None and len(seqs) != chunks:
                seqs = None
        chunk_size = int(options.get("max_chunk_size") or 0)
        if chunks > 1 and chunk_size <= 0:
            raise ValueError("multi-chunk object without options.max_chunk_size")
        if chunks == 1:
            chunk_size = chunk_size or size
        return cls(
            name=info["name"],
            nuid=info.get("nuid") or "",
            size=size,
            chunks=chunks,
            digest=info.get("digest") or "",
            chunk_size=chunk_size,
            modified=_parse_mtime(info.get("mtime")),
            seqs=seqs,
            deleted=bool(info.get("deleted")),
        )


def _sha_digest(h: Any) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(h.digest()).decode()


def _digest_bytes(text: str) -> bytes | None:
    if not text.upper().startswith("SHA-256="):
        return None
    try:
        return base64.urlsafe_b64decode(text[len("SHA-256=") :])
    except ValueError:
        return None


def _update_all(h: Any, views: Sequence[memoryview]) -> None:
    for view in views:
        h.update(view)


class _ApiError(StoreError):
    def __init__(self, what: str, code: int, err_code: int, description: str) -> None:
        super().__init__(f"{what}: {description} (JetStream error {err_code})")
        self.code = code
        self.err_code = err_code


_NO_MESSAGE = 10037
_STREAM_NOT_FOUND = 10059


class ObjectWriter:
    """One object being written: chunk messages now, the meta message at ``commit``."""

    def __init__(self, store: NatsObjectStore, name: str, pack_id: str = "") -> None:
        self.store = store
        self.name = name
        self.pack_id = pack_id
        self.nuid = store._nuid.next().decode()
        self.subject = f"$O.{store.bucket}.C.{self.nuid}"
        self.meta_subject = f"$O.{store.bucket}.M.{_b64name(name)}"
        self.chunk_size = store.chunk_size
        self.size = 0
        self.seqs: list[int] = []
        self._sha = hashlib.sha256()
        self._hasher: ThreadPoolExecutor | None = None
        self._stage: bytearray | None = None  # one chunk, for the seams between appended buffers
        self._fill = 0
        self._pending: deque[asyncio.Future[Any]] = deque()
        self._window = max(1, store.window_bytes // self.chunk_size)
        self._published = False
        self._meta_sent = False
        self._failed: str | None = None
        self._done = False
        self._sealed = False

    # -- writing ------------------------------------------------------------------------------------------------
    async def append(self, chunks: Sequence[Any], last: bool = False) -> list[int]:
        """Append buffers in order; returns each one's offset in the object. The buffers are hashed and handed
        to the connection (copied) before this returns, so the caller may reuse them afterwards. ``last``: no
        more appends follow, so the final short chunk goes out now, without staging."""
        self._check_open()
        if self._sealed:
            raise StoreError(f"writing {self.name}: append after the last one")
        self._sealed = last
        views = [_byte_view(c) for c in chunks]
        offsets = []
        for view in views:
            offsets.append(self.size)
            self.size += len(view)
        try:
            await self.store._ensure()
            await self._append(views, offsets, last)
        except BaseException as exc:  # a failed or interrupted append leaves the object unusable
            self._fail(str(exc) or type(exc).__name__)
            raise
        return offsets

    async def _append(self, views: list[memoryview], offsets: list[int], last: bool) -> None:
        total = self.size - offsets[0] if offsets else 0
        if total < INLINE_HASH_BYTES:
            _update_all(self._sha, views)  # small (manifests): a thread hop costs more than the hash
            for i, view in enumerate(views):
                await self._feed(view, last and i == len(views) - 1)
            return
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="objstore-sha")
        hashing = asyncio.get_running_loop().run_in_executor(self._hasher, _update_all, self._sha, views)
        try:
            for i, view in enumerate(views):
                await self._feed(view, last and i == len(views) - 1)
        finally:
            await asyncio.shield(hashing)

    def _check_open(self) -> None:
        if self._failed is not None:
            raise StoreError(f"writing {self.name}: {self._failed}")
        if self._done:
            raise StoreError(f"writing {self.name}: already committed or aborted")

    async def _feed(self, view: memoryview, last: bool = False) -> None:
        cs = self.chunk_size
        pos = 0
        n = len(view)
        if self._fill:
            assert self._stage is not None
            take = min(cs - self._fill, n)
            self._stage[self._fill : self._fill + take] = view[:take]
            self._fill += take
            pos = take
            if self._fill == cs:
                await self._send(memoryview(self._stage))
                self._fill = 0
        while n - pos >= cs:
            await self._send(view[pos : pos + cs])
            pos += cs
        if pos < n:
            if last and not self._fill:
                await self._send(view[pos:])
                return
            if self._stage is None:
                self._stage = bytearray(cs)
            rest = n - pos
            self._stage[:rest] = view[pos:]
            self._fill = rest

    async def _send(self, payload: memoryview) -> None:
        while len(self._pending) >= self._window:
            await self._settle_oldest()
        try:
            # publish copies the payload into the outgoing command before it returns
            future = await self.store.js.publish_async(self.subject, payload)  # type: ignore[arg-type]
        except Exception as exc:
            self._fail(f"publishing a chunk failed: {exc or type(exc).__name__}")
            raise StoreError(f"writing {self.name}: {self._failed}") from exc
        self._published = True
        self._pending.append(future)

    async def _settle_oldest(self) -> None:
        future = self._pending.popleft()
        try:
            ack = await asyncio.wait_for(future, self.store.ack_timeout)
        except TimeoutError:
            future.cancel()
            self._fail(f"no acknowledgement from the server within {self.store.ack_timeout:g}s")
            raise StoreError(f"writing {self.name}: {self._failed}") from None
        except Exception as exc:
            self._fail(f"the server refused a chunk: {exc or type(exc).__name__}")
            raise StoreError(f"writing {self.name}: {self._failed}") from exc
        self.seqs.append(ack.seq)

    def _fail(self, why: str) -> None:
        if self._failed is None:
            self._failed = why
        for future in self._pending:
            future.cancel()
        self._pending.clear()

    # -- commit / abort -----------------------------------------------------------------------------------------
    async def commit(self) -> None:
        """Await every chunk's acknowledgement, then publish the meta message: only now is the object visible."""
        if self.pack_id and self.size == 0 and self._failed is None and not self._done:
            self._done = True  # nothing to reference: no empty pack object
            self._close_hasher()
            return
        try:
            await self._finish_chunks()
            await self._settle_meta(await self._send_meta())
        except BaseException as exc:
            self._fail(str(exc) or type(exc).__name__)
            raise

    async def _finish_chunks(self) -> None:
        self._check_open()
        await self.store._ensure()
        if self._fill:
            assert self._stage is not None
            await self._send(memoryview(self._stage)[: self._fill])
            self._fill = 0
        while self._pending:
            await self._settle_oldest()
        if len(self.seqs) != -(-self.size // self.chunk_size):
            self._fail(f"{len(self.seqs)} chunks acknowledged for {self.size} bytes")
            raise StoreError(f"writing {self.name}: {self._failed}")

    async def _send_meta(self) -> asyncio.Future[Any]:
        self._check_open()
        info = js_api.ObjectInfo(
            name=self.name,
            bucket=self.store.bucket,
            nuid=self.nuid,
            size=self.size,
            chunks=len(self.seqs),
            digest=_sha_digest(self._sha),
            mtime=datetime.now(UTC).isoformat(),
            headers={SEQUENCES_HEADER: [encode_sequences(self.seqs)]} if self.seqs else None,
            options=js_api.ObjectMetaOptions(max_chunk_size=self.chunk_size),
        )
        self._meta_sent = True
        try:
            return await self.store.js.publish_async(
                self.meta_subject, json.dumps(info.as_dict()).encode(), headers={js_api.Header.ROLLUP: "sub"}
            )
        except Exception as exc:
            self._fail(f"publishing the meta message failed: {exc or type(exc).__name__}")
            raise StoreError(f"committing {self.name}: {self._failed}") from exc

    async def _settle_meta(self, future: asyncio.Future[Any]) -> None:
        try:
            await asyncio.wait_for(future, self.store.ack_timeout)
        except TimeoutError:
            future.cancel()
            self._fail(f"no acknowledgement of the meta message within {self.store.ack_timeout:g}s")
            raise StoreError(f"committing {self.name}: {self._failed}") from None
        except Exception as exc:
            self._fail(f"the server refused the meta message: {exc or type(exc).__name__}")
            raise StoreError(f"committing {self.name}: {self._failed}") from exc
        self._done = True
        self._close_hasher()

    async def abort(self) -> None:
        """Forget the object: purge its chunks (and its meta, when a commit was attempted). Never raises; when
        the server is unreachable the chunks stay as orphans that ``sweep_orphans`` removes later."""
        if self._done and not self._meta_sent:
            return
        committed = self._done
        self._done = True
        self._fail("aborted")
        self._close_hasher()
        if committed:
            return  # a committed object is deleted through the store, not by its writer
        try:
            if self._meta_sent:
                await self.store._purge(self.meta_subject, timeout=self.store.abort_timeout)
            if self._published:
                await self.store._purge(self.subject, timeout=self.store.abort_timeout)
        except StoreError as exc:
            log.warning("could not purge an aborted object", extra={"object": self.name, "error": str(exc)})

    def _close_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=False)
            self._hasher = None


class NatsPackWriter(ObjectWriter):
    def __init__(self, store: NatsObjectStore) -> None:
        pack_id = uuid.uuid4().hex
        super().__init__(store, PACK_PREFIX + pack_id, pack_id)


@dataclass
class _Run:
    """Chunks ``first..last`` of one object, read by one consumer."""

    meta: ObjectMeta
    first: int
    last: int
    ops: dict[int, list[tuple[int, int, memoryview]]]
    verify_digest: bool = False


class NatsObjectStore:
    """``CheckpointStore`` on a JetStream Object Store bucket. Takes a connected client it does not own.

    The bucket is created (file storage, ``replicas``) on first use when it does not exist."""

    def __init__(
        self,
        nc: Client,
        bucket: str,
        *,
        replicas: int = 1,
        create: bool = True,
        chunk_size: int | None = None,
        window_bytes: int = WINDOW_BYTES,
        read_concurrency: int = READ_CONCURRENCY,
        api_timeout: float = 5.0,
        ack_timeout: float = 10.0,
        read_timeout: float = 10.0,
        abort_timeout: float = 2.0,
        api_prefix: str = "$JS.API",
    ) -> None:
        if not BUCKET_RE.match(bucket):
            raise ValueError(f"object store bucket {bucket!r}: only letters, digits, '_' and '-' are allowed")
        self.nc = nc
        self.bucket = bucket
        self.stream = f"OBJ_{bucket}"
        self.url = f"nats://{bucket}"
        self.replicas = replicas
        self.create = create
        max_payload = nc.max_payload if nc.max_payload and nc.max_payload > 0 else MAX_CHUNK_SIZE
        if chunk_size is None:
            chunk_size = 1 << (min(max_payload, MAX_CHUNK_SIZE).bit_length() - 1)  # a power of two: blocks align
        if not 0 < chunk_size <= max_payload:
            raise ValueError(f"chunk_size {chunk_size} must be between 1 and the server's max payload {max_payload}")
        self.chunk_size = chunk_size
        self.window_bytes = max(window_bytes, chunk_size)
        self.read_concurrency = max(1, read_concurrency)
        self.api_timeout = api_timeout
        self.ack_timeout = ack_timeout
        self.read_timeout = read_timeout
        self.abort_timeout = abort_timeout
        self.api_prefix = api_prefix
        self.js = nc.jetstream(prefix=api_prefix, timeout=api_timeout)
        self._nuid = NUID()
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()

    # -- plumbing -----------------------------------------------------------------------------------------------
    async def _api(
        self, what: str, subject: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        try:
            msg = await self.nc.request(
                f"{self.api_prefix}.{subject}",
                json.dumps(body).encode() if body is not None else b"",
                timeout=timeout or self.api_timeout,
            )
        except nats.errors.NoRespondersError:
            raise StoreError(f"{what}: JetStream is not available on this connection") from None
        except (TimeoutError, nats.errors.TimeoutError):
            raise StoreError(f"{what}: no answer from the server within {timeout or self.api_timeout:g}s") from None
        except nats.errors.Error as exc:
            raise StoreError(f"{what}: {exc or type(exc).__name__}") from exc
        resp: dict[str, Any] = json.loads(msg.data)
        error = resp.get("error")
        if error:
            raise _ApiError(what, error.get("code", 0), error.get("err_code", 0), error.get("description", ""))
        return resp

    async def _ensure(self) -> None:
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            what = f"opening object store {self.bucket}"
            try:
                await self._api(what, f"STREAM.INFO.{self.stream}")
            except _ApiError as exc:
                if exc.err_code != _STREAM_NOT_FOUND or not self.create:
                    raise
                try:
                    await self.js.create_object_store(
                        self.bucket,
                        description="gpuwarden KV cache checkpoints",
                        storage=js_api.StorageType.FILE,
                        replicas=self.replicas,
                    )
                except Exception as create_exc:
                    raise StoreError(f"creating object store {self.bucket}: {create_exc}") from create_exc
            self._ready = True

    async def _purge(self, subject: str, timeout: float | None = None) -> None:
        await self._api(f"purging {subject}", f"STREAM.PURGE.{self.stream}", {"filter": subject}, timeout=timeout)

    async def _meta(self, name: str) -> ObjectMeta | None:
        """The object's current meta, from the stream leader (consistent); None when absent or deleted."""
        try:
            resp = await self._api(
                f"reading {name}",
                f"STREAM.MSG.GET.{self.stream}",
                {"last_by_subj": f"$O.{self.bucket}.M.{_b64name(name)}"},
            )
        except _ApiError as exc:
            if exc.err_code == _NO_MESSAGE:
                return None
            raise
        try:
            meta = ObjectMeta.parse(base64.b64decode(resp["message"].get("data") or ""))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{name}: meta message unreadable: {exc}") from exc
        return None if meta.deleted else meta

    async def _names(self) -> list[str]:
        """Every object name with a meta message, from the stream's subject index (no message is read)."""
        await self._ensure()
        names: list[str] = []
        offset = 0
        prefix = f"$O.{self.bucket}.M."
        while True:
            resp = await self._api(
                f"listing {self.bucket}",
                f"STREAM.INFO.{self.stream}",
                {"subjects_filter": prefix + ">", "offset": offset},
            )
            subjects: dict[str, int] = (resp.get("state") or {}).get("subjects") or {}
            for subject in subjects:
                name = _name_from_b64(subject[len(prefix) :])
                if name is not None:
                    names.append(name)
            offset += len(subjects)
            if not subjects or offset >= int(resp.get("total") or 0):
                return names

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _delete_consumer(self, name: str) -> None:
        with contextlib.suppress(StoreError):
            await self._api("deleting a read consumer", f"CONSUMER.DELETE.{self.stream}.{name}")

    async def _consume(
        self,
        what: str,
        config: dict[str, Any],
        count_from_pending: Callable[[int], int],
        on_msg: Callable[[int, Msg], Any],
        window_bytes: int,
        msg_bytes: int,
        short: Callable[[int], StoreError] | None = None,
    ) -> None:
        """Read messages through an ephemeral pull consumer: ``count_from_pending(num_pending)`` says how many
        (or raises); ``on_msg(k, msg)`` gets each in order (may raise StoreError, or return an awaitable)."""
        name = self._nuid.next().decode()
        config = {
            "name": name,
            "ack_policy": "none",
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": int(max(self.read_timeout, 5.0) * 3 * 1e9),
            "replay_policy": "instant",
            **config,
        }
        info = await self._api(
            what,
            f"CONSUMER.CREATE.{self.stream}.{name}",
            {"stream_name": self.stream, "config": config},
        )
        try:
            total = count_from_pending(int(info.get("num_pending") or 0))
        except BaseException:
            self._spawn(self._delete_consumer(name))
            raise
        if total <= 0:
            self._spawn(self._delete_consumer(name))
            return
        batch = max(1, window_bytes // 2 // max(msg_bytes, 1))
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        received = 0
        requested = 0
        inbox = self.nc.new_inbox()
        next_subject = f"{self.api_prefix}.CONSUMER.MSG.NEXT.{self.stream}.{name}"

        async def request_more() -> None:
            nonlocal requested
            # at most two batches (``window_bytes``) outstanding: the server drops a client that falls more than
            # its max_pending (64 MiB by default) behind
            while requested < total and requested - received + min(batch, total - requested) <= 2 * batch:
                n = min(batch, total - requested)
                requested += n
                await self.nc.publish(next_subject, b'{"batch":%d,"no_wait":true}' % n, reply=inbox)

        async def handle(msg: Msg) -> None:
            nonlocal received
            if done.done():
                return
            if not msg.reply:
                status = (msg.headers or {}).get(js_api.Header.STATUS, "")
                if status == "100":
                    return
                description = (msg.headers or {}).get(js_api.Header.DESCRIPTION, "")
                if status in ("404", "408"):
                    done.set_exception(
                        short(received)
                        if short is not None
                        else StoreError(f"{what}: the server ran out of messages ({received} of {total})")
                    )
                else:
                    done.set_exception(StoreError(f"{what}: the server answered {status} {description}".rstrip()))
                return
            k = received
            received += 1
            try:
                result = on_msg(k, msg)
                if result is not None:
                    await result
                if received == total:
                    if not done.done():
                        done.set_result(None)
                else:
                    await request_more()
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc if isinstance(exc, StoreError) else StoreError(f"{what}: {exc!r}"))

        pending_bytes = 8 * window_bytes + 16 * 1024 * 1024
        try:
            sub = await self.nc.subscribe(
                inbox, cb=handle, pending_msgs_limit=1 << 20, pending_bytes_limit=pending_bytes
            )
        except nats.errors.Error as exc:
            self._spawn(self._delete_consumer(name))
            raise StoreError(f"{what}: {exc or type(exc).__name__}") from exc
        try:
            try:
                await request_more()
            except nats.errors.Error as exc:
                raise StoreError(f"{what}: {exc or type(exc).__name__}") from exc
            while not done.done():
                seen = received
                await asyncio.wait([done], timeout=self.read_timeout)
                if not done.done() and received == seen:
                    raise StoreError(f"{what}: no data from the server for {self.read_timeout:g}s")
            done.result()
        finally:
            if not done.done():
                done.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            self._spawn(self._delete_consumer(name))

    async def _read_run(self, run: _Run) -> None:
        meta = run.meta
        what = f"reading {meta.name}"
        subject = f"$O.{self.bucket}.C.{meta.nuid}"
        config: dict[str, Any] = {"filter_subject": subject}
        seqs = meta.seqs
        if seqs is not None:
            config.update(deliver_policy="by_start_sequence", opt_start_seq=seqs[run.first])
            skip = 0
        else:
            config.update(deliver_policy="all")
            skip = run.first
        count = run.last - run.first + 1 + skip
        label = _label(meta.name)

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
                sseq = _stream_seq(msg.reply)
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
            await self._consume(
                what,
                config,
                check_pending,
                on_msg,
                self.window_bytes,
                meta.chunk_size,
                short=lambda got: StoreError(
                    f"{label} is truncated: the server could not deliver chunk {first_index + got} "
                    f"(chunks {run.first}..{run.last} of {meta.chunks} wanted)"
                ),
            )
            if h is not None:
                for future in hashing:
                    await future
                if _digest_bytes(meta.digest) not in (None, h.digest()):
                    raise StoreError(f"{label} is corrupt: its bytes do not match the object's SHA-256 digest")
        finally:
            if hasher is not None:
                hasher.shutdown(wait=False)

    def _plan(self, meta: ObjectMeta, refs: Iterable[tuple[int, int, memoryview]]) -> list[_Run]:
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
        runs: list[_Run] = []
        for c in indexes:
            if runs and c - runs[-1].last <= 2:  # reading a skipped chunk is cheaper than a new consumer
                runs[-1].last = c
            else:
                runs.append(_Run(meta, c, c, ops))
        if len(runs) == 1 and runs[0].first == 0 and runs[0].last == meta.chunks - 1:
            runs[0].verify_digest = True  # every chunk passes by: check the object's own digest on the way
        return runs

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
        writers = [ObjectWriter(self, _manifest_name(m.session_id, m.checkpoint_id)) for m in manifests]
        try:
            for writer, manifest in zip(writers, manifests, strict=True):
                await writer.append([memoryview(encode_manifest(manifest))], last=True)
            for writer in writers:
                await writer._finish_chunks()
            metas = [await writer._send_meta() for writer in writers]
            for writer, meta in zip(writers, metas, strict=True):
                await writer._settle_meta(meta)
        except StoreError as exc:
            for writer in writers:
                await writer.abort()
            which = manifests[0].checkpoint_id if len(manifests) == 1 else f"{len(manifests)} checkpoints"
            raise StoreError(f"committing {which}: {exc}") from exc

    async def read_object(self, name: str) -> bytes:
        """A whole object's bytes, SHA-256 verified."""
        await self._ensure()
        meta = await self._meta(name)
        if meta is None:
            raise StoreError(f"{name} is missing")
        buffer = bytearray(meta.size)
        for run in self._plan(meta, [(0, meta.size, memoryview(buffer))]):
            await self._read_run(run)
        return bytes(buffer)

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest:
        name = _manifest_name(session_id, checkpoint_id)
        await self._ensure()
        meta = await self._meta(name)
        if meta is None:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id} for session {session_id}")
        buffer = bytearray(meta.size)
        try:
            for run in self._plan(meta, [(0, meta.size, memoryview(buffer))]):
                await self._read_run(run)
        except StoreError as exc:
            raise StoreError(f"checkpoint {checkpoint_id}: manifest unreadable: {exc}") from exc
        return load_manifest(bytes(buffer), session_id, checkpoint_id)

    async def checkpoints(self, session_id: str) -> list[str]:
        prefix = f"{SESSION_PREFIX}{session_id}/"
        names = [n for n in await self._names() if n.startswith(prefix) and n.endswith(".json")]
        candidates = [n[len(prefix) : -5] for n in names if "/" not in n[len(prefix) :]]
        # a meta subject can hold a deletion marker written by another tool (nats obj rm)
        metas = await asyncio.gather(*(self._meta(prefix + c + ".json") for c in candidates))
        return newest_first([c for c, m in zip(candidates, metas, strict=True) if m is not None])

    async def sessions(self) -> list[str]:
        found = set()
        for name in await self._names():
            if name.startswith(SESSION_PREFIX) and name.endswith(".json") and "/" in name[len(SESSION_PREFIX) :]:
                found.add(name[len(SESSION_PREFIX) :].rsplit("/", 1)[0])
        return sorted(found)

    async def read_chunks(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        await self._ensure()
        by_pack: dict[str, list[tuple[int, int, memoryview]]] = {}
        for ref, target in zip(refs, targets, strict=True):
            view = _byte_view(target)
            if len(view) != ref.length:
                raise ValueError(f"target for a chunk of pack {ref.pack} has {len(view)} bytes, not {ref.length}")
            by_pack.setdefault(ref.pack, []).append((ref.offset, ref.length, view))
        packs = list(by_pack)
        metas = await asyncio.gather(*(self._meta(PACK_PREFIX + p) for p in packs))
        runs: list[_Run] = []
        for pack, meta in zip(packs, metas, strict=True):
            if meta is None:
                raise StoreError(f"pack {pack} is missing")
            for offset, length, _ in by_pack[pack]:
                if offset + length > meta.size:
                    raise StoreError(
                        f"pack {pack} is truncated: wanted {length} bytes at {offset}, it holds {meta.size}"
                    )
            runs.extend(self._plan(meta, by_pack[pack]))
        if len(runs) == 1 or self.read_concurrency == 1:
            for run in runs:
                await self._read_run(run)
            return
        gate = asyncio.Semaphore(self.read_concurrency)

        async def one(run: _Run) -> None:
            async with gate:
                await self._read_run(run)

        tasks = [asyncio.ensure_future(one(r)) for r in runs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _delete_object(self, name: str) -> None:
        """Purge the meta first (the object disappears at once), then its chunks."""
        await self._ensure()
        meta = await self._meta_any(name)
        await self._purge(f"$O.{self.bucket}.M.{_b64name(name)}")
        if meta is not None and meta.nuid:
            await self._purge(f"$O.{self.bucket}.C.{meta.nuid}")

    async def _meta_any(self, name: str) -> ObjectMeta | None:
        try:
            resp = await self._api(
                f"reading {name}",
                f"STREAM.MSG.GET.{self.stream}",
                {"last_by_subj": f"$O.{self.bucket}.M.{_b64name(name)}"},
            )
            return ObjectMeta.parse(base64.b64decode(resp["message"].get("data") or ""))
        except _ApiError as exc:
            if exc.err_code == _NO_MESSAGE:
                return None
            raise
        except (ValueError, KeyError, TypeError):
            return None

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        await self._delete_object(_manifest_name(session_id, checkpoint_id))

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
        await self._ensure()
        metas: list[ObjectMeta] = []

        def on_msg(k: int, msg: Msg) -> None:
            try:
                metas.append(ObjectMeta.parse(msg.data))
            except (ValueError, KeyError, TypeError) as exc:
                if strict:
                    raise StoreError(f"listing {self.bucket}: unreadable meta on {msg.subject}: {exc}") from exc
                log.warning("skipping an unreadable object meta", extra={"subject": msg.subject, "error": str(exc)})

        await self._consume(
            f"listing {self.bucket}",
            {"filter_subject": f"$O.{self.bucket}.M.>", "deliver_policy": "last_per_subject"},
            lambda pending: pending,
            on_msg,
            window_bytes=4 * 1024 * 1024,
            msg_bytes=16 * 1024,  # metas are ~0.5 KiB, more when interleaved writers fragment the sequences
        )
        return metas

    async def delete_pack(self, pack_id: str) -> None:
        await self._delete_object(PACK_PREFIX + pack_id)

    async def sweep_orphans(self, grace_s: float = 3600.0) -> int:
        """Purge chunk subjects that no meta references and whose first chunk is older than ``grace_s``
        (writes that were aborted while the server was unreachable). Returns how many were purged."""
        await self._ensure()
        live = {m.nuid for m in await self._scan_metas(strict=True)}
        prefix = f"$O.{self.bucket}.C."
        offset = 0
        orphans: list[str] = []
        while True:
            resp = await self._api(
                f"listing {self.bucket}",
                f"STREAM.INFO.{self.stream}",
                {"subjects_filter": prefix + ">", "offset": offset},
            )
            subjects: dict[str, int] = (resp.get("state") or {}).get("subjects") or {}
            orphans.extend(s for s in subjects if s[len(prefix) :] not in live)
            offset += len(subjects)
            if not subjects or offset >= int(resp.get("total") or 0):
                break
        purged = 0
        now = time.time()
        for subject in orphans:
            stamps: list[float] = []

            def on_msg(k: int, msg: Msg, stamps: list[float] = stamps) -> None:
                stamps.append(_stream_time(msg.reply))

            await self._consume(
                f"checking {subject}",
                {"filter_subject": subject, "deliver_policy": "all", "headers_only": True},
                lambda pending: min(pending, 1),
                on_msg,
                window_bytes=64 * 1024,
                msg_bytes=1024,
            )
            if stamps and now - stamps[0] >= grace_s:
                await self._purge(subject)
                purged += 1
        return purged

    async def close(self) -> None:
        """Finish background consumer deletions; the connection belongs to the caller."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.api_timeout)


def _label(name: str) -> str:
    return f"pack {name[len(PACK_PREFIX) :]}" if name.startswith(PACK_PREFIX) else f"object {name}"


def _manifest_name(session_id: str, checkpoint_id: str) -> str:
    return f"{SESSION_PREFIX}{session_id}/{checkpoint_id}.json"


def _ack_tokens(reply: str) -> list[str]:
    tokens = reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>
        return tokens
    if len(tokens) >= 11:  # with <domain>.<account hash> after ACK, and a random token at the end
        return tokens[:2] + tokens[4:11]
    raise StoreError(f"unexpected JetStream reply subject {reply!r}")


def _stream_seq(reply: str) -> int:
    return int(_ack_tokens(reply)[5])


def _stream_time(reply: str) -> float:
    return int(_ack_tokens(reply)[7]) / 1e9
