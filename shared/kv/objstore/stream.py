"""One bucket's JetStream stream on a connection the caller owns: API requests, creating the bucket on first use,
purges, and ephemeral pull consumers. The writer, the reader and the store all talk to NATS through this."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.nuid import NUID

from shared.kv.objstore.codec import BUCKET_RE, MAX_CHUNK_SIZE, READ_CONCURRENCY, WINDOW_BYTES
from shared.kv.store import StoreError


class ApiError(StoreError):
    def __init__(self, what: str, code: int, err_code: int, description: str) -> None:
        super().__init__(f"{what}: {description} (JetStream error {err_code})")
        self.code = code
        self.err_code = err_code


NO_MESSAGE = 10037
STREAM_NOT_FOUND = 10059


class ObjectStream:
    """The stream ``OBJ_<bucket>`` behind one Object Store bucket, with the tunables every reader and writer of it
    shares. The bucket is created (file storage, ``replicas``) on first use when it does not exist."""

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

    def next_nuid(self) -> str:
        """A fresh object id (the chunk subject of one write)."""
        return self._nuid.next().decode()

    # -- plumbing -----------------------------------------------------------------------------------------------
    async def api(
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
            raise ApiError(what, error.get("code", 0), error.get("err_code", 0), error.get("description", ""))
        return resp

    async def ensure(self) -> None:
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            try:
                await self.api(f"opening {self.stream}", f"STREAM.INFO.{self.stream}")
            except ApiError as exc:
                if exc.err_code != STREAM_NOT_FOUND or not self.create:
                    raise
                await self._create()
            self._ready = True

    async def _create(self) -> None:
        """Make the stream that ``ensure`` found missing: here the Object Store bucket."""
        try:
            await self.js.create_object_store(
                self.bucket,
                description="gpuwarden KV cache checkpoints",
                storage=js_api.StorageType.FILE,
                replicas=self.replicas,
            )
        except Exception as exc:
            raise StoreError(f"creating object store {self.bucket}: {exc}") from exc

    async def purge(self, subject: str, timeout: float | None = None) -> None:
        await self.api(f"purging {subject}", f"STREAM.PURGE.{self.stream}", {"filter": subject}, timeout=timeout)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _delete_consumer(self, name: str) -> None:
        with contextlib.suppress(StoreError):
            await self.api("deleting a read consumer", f"CONSUMER.DELETE.{self.stream}.{name}")

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
        info = await self.api(
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

    async def close(self) -> None:
        """Finish background consumer deletions; the connection belongs to the caller."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.api_timeout)
