"""The HTTP server of probes, scrapes and simulated exporters: aiohttp's low-level server, GET routes answered by a
function, on kept-alive connections as HTTP/1.1 clients expect (a scraper asking every second reuses its
connection; an idle one is closed after ``idle_s``)."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

Response = tuple[str, str, bytes]  # status line ("200 OK"), content type, body
Route = Callable[[str, str], Awaitable[Response]]  # (method, path without the query) -> response


class SmallHttpServer:
    """``route`` answers every request; one that raises answers 500 (aiohttp logs it)."""

    def __init__(self, route: Route, idle_s: float = 30.0) -> None:
        self.route = route
        self.idle_s = idle_s
        self.runner: web.ServerRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int, fd: int = -1) -> int:
        """Listen on ``host:port``, or on the listening socket ``fd`` when one was inherited (``fd`` >= 0): a
        parent that bound the port keeps it for every restart of this process, so nobody else takes it."""
        sock = None
        if fd >= 0:
            try:
                sock = socket.socket(fileno=fd)
            except OSError as exc:
                raise OSError(f"GPUWARDEN_HTTP_FD={fd}: not a socket this process inherited: {exc}") from None
        server = web.Server(self._answer, keepalive_timeout=self.idle_s, access_log=None)
        runner = web.ServerRunner(server, shutdown_timeout=2.0)
        await runner.setup()
        site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.runner = runner
        self.port = runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()
            self.runner = None

    async def _answer(self, request: web.BaseRequest) -> web.Response:
        status, content_type, body = await self.route(request.method, request.rel_url.raw_path)
        code, _, reason = status.partition(" ")
        return web.Response(
            status=int(code), reason=reason or None, body=body, headers={hdrs.CONTENT_TYPE: content_type}
        )
