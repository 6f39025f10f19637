"""A small HTTP/1.1 server for probes, scrapes and simulated exporters: GET routes answered by a function, on
kept-alive connections as HTTP/1.1 clients expect (a scraper asking every second reuses its connection; an idle
one is closed after ``idle_s``). No framework is needed for a handful of read-only routes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

Response = tuple[str, str, bytes]  # status line ("200 OK"), content type, body
Route = Callable[[str, str], Awaitable[Response]]  # (method, path without the query) -> response


class SmallHttpServer:
    def __init__(self, route: Route, idle_s: float = 30.0) -> None:
        self.route = route
        self.idle_s = idle_s
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int, fd: int = -1) -> int:
        """Listen on ``host:port``, or on the listening socket ``fd`` when one was inherited (``fd`` >= 0): a
        parent that bound the port keeps it for every restart of this process, so nobody else takes it."""
        if fd >= 0:
            try:
                sock = socket.socket(fileno=fd)
            except OSError as exc:
                raise OSError(f"GPUWARDEN_HTTP_FD={fd}: not a socket this process inherited: {exc}") from None
            self.server = await asyncio.start_server(self._serve, sock=sock)
        else:
            self.server = await asyncio.start_server(self._serve, host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)
            self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await asyncio.wait_for(reader.readline(), self.idle_s)
                if not request:
                    return
                keep = request.rstrip().endswith(b"HTTP/1.1")
                while (line := await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"connection" and value.strip().lower() == b"close":
                        keep = False
                parts = request.decode("latin-1").split()
                path = parts[1].split("?")[0] if len(parts) >= 2 else ""
                status, content_type, body = await self.route(parts[0] if parts else "", path)
                head = (
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                    f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
                )
                writer.write(head.encode() + body)
                await writer.drain()
                if not keep:
                    return
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
