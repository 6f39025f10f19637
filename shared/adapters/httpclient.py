"""The scrapers' HTTP/1.1 client: GETs to one origin over one kept-alive connection.

Hand-written on purpose, where everything else speaks HTTP through aiohttp: ``bench.metrics`` (1,000 nodes x 8 GPUs
scraped each second, parsed and aggregated on one core; target at most 0.5 of a core) measured 0.487 of a core with
this client against the aiohttp server, and 0.722 / 0.737 with aiohttp's client (a ``ClientSession`` per source,
one kept-alive connection, identity encoding), on 2026-12-04 on the same quiet machine. The parse and the
aggregation alone take 0.32-0.35 of that: aiohttp's client roughly triples what the HTTP part costs (0.14 -> 0.40;
170-210 us of CPU per GET of a 47 kB page against 70-110 us, one source read back to back). Try aiohttp again when
the bench says it fits.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

from shared.ports.metrics import MetricsSourceError


async def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """One HTTP/1.1 GET on a connection of its own, closed after (``HttpClient`` for a source read again and
    again). Raises ``MetricsSourceError``."""
    client = HttpClient(url, timeout)
    try:
        return await client.get()
    finally:
        client.close()


class _Response(asyncio.Protocol):
    """Bytes of one connection as they come; ``wait`` until there are more or the peer closed."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.closed = False
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        if self.closed:
            raise asyncio.IncompleteReadError(bytes(self.buffer), None)
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


class HttpClient:
    """HTTP/1.1 GETs to one origin over one kept-alive connection, as Prometheus scrapes: a scrape every second
    costs no TCP handshake and no teardown. The connection is opened on first use and again after the server
    closed it; a request on a reused connection that the server had already closed is sent once more on a new
    one (GET is idempotent). Not for concurrent use: one request at a time."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MetricsSourceError(f"{url}: expected an http:// or https:// URL")
        self.url = url
        self.timeout = timeout
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: text/plain\r\nAccept-Encoding: identity\r\n\r\n"
        ).encode("latin-1")
        self._conn: _Response | None = None
        self.connections = 0  # opened so far

    async def get(self) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.timeout):  # no task of its own, unlike wait_for
                return await self._get()
        except TimeoutError:
            self.close()
            raise MetricsSourceError(f"{self.url}: no complete answer within {self.timeout:g}s") from None
        except asyncio.IncompleteReadError:
            self.close()
            raise MetricsSourceError(f"{self.url}: the connection closed mid-answer") from None
        except (OSError, ValueError) as exc:
            self.close()
            raise MetricsSourceError(f"{self.url}: {type(exc).__name__}: {exc}") from None

    async def _get(self) -> tuple[int, bytes]:
        conn = self._conn
        if conn is not None and not conn.closed:
            try:
                return await self._exchange(conn)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:  # the server closed in the middle of an answer: no retry
                    raise
                self.close()  # closed while idle, before answering: ask again on a new connection
        return await self._exchange(await self._connect())

    async def _connect(self) -> _Response:
        _, conn = await asyncio.get_running_loop().create_connection(_Response, self.host, self.port, ssl=self.tls)
        self._conn = conn
        self.connections += 1
        return conn

    async def _exchange(self, conn: _Response) -> tuple[int, bytes]:
        assert conn.transport is not None
        conn.buffer.clear()
        conn.transport.write(self._request)
        buffer = conn.buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            await conn.wait()
        head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        del buffer[: end + 4]
        fields = head[0].split(None, 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/"):
            raise ValueError(f"not an HTTP response: {head[0][:80]!r}")
        status = int(fields[1])
        headers: dict[str, str] = {}
        for line in head[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        keep = fields[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._chunked(conn)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            while len(buffer) < length:
                await conn.wait()
            body = bytes(buffer[:length])
            del buffer[:length]
        else:  # the body ends with the connection
            while not conn.closed:
                await conn.wait()
            body, keep = bytes(buffer), False
        if not keep:
            self.close()
        return status, body

    @staticmethod
    async def _chunked(conn: _Response) -> bytes:
        buffer = conn.buffer
        chunks: list[bytes] = []
        while True:
            while (end := buffer.find(b"\r\n")) < 0:
                await conn.wait()
            size = int(bytes(buffer[:end]).split(b";")[0].strip() or b"0", 16)
            del buffer[: end + 2]
            if size == 0:
                while (end := buffer.find(b"\r\n")) != 0:  # trailers, then the blank line
                    if end > 0:
                        del buffer[: end + 2]
                    else:
                        await conn.wait()
                del buffer[:2]
                return b"".join(chunks)
            while len(buffer) < size + 2:
                await conn.wait()
            chunks.append(bytes(buffer[:size]))
            del buffer[: size + 2]

    def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None
