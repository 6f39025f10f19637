"""Writing one object: chunk messages under a bounded window of outstanding acknowledgements, hashed in a worker
thread, then the meta message that commits it (or a purge when aborted)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from nats.js import api as js_api

from shared.kv.objstore.codec import (
    INLINE_HASH_BYTES,
    PACK_PREFIX,
    SEQUENCES_HEADER,
    byte_view,
    chunk_subject,
    encode_sequences,
    meta_subject,
    sha_digest,
    update_all,
)
from shared.kv.objstore.stream import ObjectStream
from shared.kv.store import StoreError

log = logging.getLogger("shared.kv.objstore")


class ObjectWriter:
    """One object being written: chunk messages now, the meta message at ``commit``."""

    def __init__(self, store: ObjectStream, name: str, pack_id: str = "") -> None:
        self.store = store
        self.name = name
        self.pack_id = pack_id
        self.nuid = store.next_nuid()
        self.subject = chunk_subject(store.bucket, self.nuid)
        self.meta_subject = meta_subject(store.bucket, name)
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
        views = [byte_view(c) for c in chunks]
        offsets = []
        for view in views:
            offsets.append(self.size)
            self.size += len(view)
        try:
            await self.store.ensure()
            await self._append(views, offsets, last)
        except BaseException as exc:  # a failed or interrupted append leaves the object unusable
            self._fail(str(exc) or type(exc).__name__)
            raise
        return offsets

    async def _append(self, views: list[memoryview], offsets: list[int], last: bool) -> None:
        total = self.size - offsets[0] if offsets else 0
        if total < INLINE_HASH_BYTES:
            update_all(self._sha, views)  # small (manifests): a thread hop costs more than the hash
            for i, view in enumerate(views):
                await self._feed(view, last and i == len(views) - 1)
            return
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="objstore-sha")
        hashing = asyncio.get_running_loop().run_in_executor(self._hasher, update_all, self._sha, views)
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
            await self.finish_chunks()
            await self.settle_meta(await self.send_meta())
        except BaseException as exc:
            self._fail(str(exc) or type(exc).__name__)
            raise

    async def finish_chunks(self) -> None:
        self._check_open()
        await self.store.ensure()
        if self._fill:
            assert self._stage is not None
            await self._send(memoryview(self._stage)[: self._fill])
            self._fill = 0
        while self._pending:
            await self._settle_oldest()
        if len(self.seqs) != -(-self.size // self.chunk_size):
            self._fail(f"{len(self.seqs)} chunks acknowledged for {self.size} bytes")
            raise StoreError(f"writing {self.name}: {self._failed}")

    async def send_meta(self) -> asyncio.Future[Any]:
        self._check_open()
        info = js_api.ObjectInfo(
            name=self.name,
            bucket=self.store.bucket,
            nuid=self.nuid,
            size=self.size,
            chunks=len(self.seqs),
            digest=sha_digest(self._sha),
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

    async def settle_meta(self, future: asyncio.Future[Any]) -> None:
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
                await self.store.purge(self.meta_subject, timeout=self.store.abort_timeout)
            if self._published:
                await self.store.purge(self.subject, timeout=self.store.abort_timeout)
        except StoreError as exc:
            log.warning("could not purge an aborted object", extra={"object": self.name, "error": str(exc)})

    def _close_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=False)
            self._hasher = None


class NatsPackWriter(ObjectWriter):
    def __init__(self, store: ObjectStream) -> None:
        pack_id = uuid.uuid4().hex
        super().__init__(store, PACK_PREFIX + pack_id, pack_id)
