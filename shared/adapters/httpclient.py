"""The scrapers' HTTP client: aiohttp's, one session per source, its connection kept alive between scrapes."""

from __future__ import annotations

from urllib.parse import urlsplit

import aiohttp

from shared.ports.metrics import MetricsSourceError


async def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """One GET on a connection of its own, closed after (``HttpClient`` for a source read again and again).
    Raises ``MetricsSourceError``."""
    client = HttpClient(url, timeout)
    try:
        return await client.get()
    finally:
        await client.close()


class HttpClient:
    """GETs to one origin over one kept-alive connection, as Prometheus scrapes: a scrape every second costs no
    TCP handshake and no teardown. aiohttp opens the connection on first use and again after the server closed
    it, and sends a GET once more on a new connection when a reused one turns out closed (GET is idempotent).
    One request at a time: a second waits for the connection. Every failure is a ``MetricsSourceError`` that
    says what went wrong."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MetricsSourceError(f"{url}: expected an http:// or https:// URL")
        self.url = url
        self.timeout = timeout
        self.session: aiohttp.ClientSession | None = None
        self.connections = 0  # opened so far

    def _session(self) -> aiohttp.ClientSession:
        """Made on first use: a session belongs to the event loop it was made in."""
        if self.session is None or self.session.closed:
            opened = aiohttp.TraceConfig()
            opened.on_connection_create_end.append(self._opened)
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=120.0),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers={"Accept": "text/plain", "Accept-Encoding": "identity"},
                trace_configs=[opened],
            )
        return self.session

    async def get(self) -> tuple[int, bytes]:
        try:
            async with self._session().get(self.url, allow_redirects=False) as response:
                return response.status, await response.read()
        except TimeoutError:
            raise MetricsSourceError(f"{self.url}: no complete answer within {self.timeout:g}s") from None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            raise MetricsSourceError(f"{self.url}: the connection closed mid-answer") from None
        except aiohttp.ClientResponseError as exc:
            raise MetricsSourceError(f"{self.url}: not an HTTP response ({' '.join(exc.message.split())})") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise MetricsSourceError(f"{self.url}: {type(exc).__name__}: {exc}") from None

    async def _opened(self, *_: object) -> None:
        self.connections += 1

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        self.session = None
