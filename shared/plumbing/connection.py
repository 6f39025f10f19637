"""A NATS connection as the bus opens it (``open_connection``): the servers and credentials of ``NatsSettings``
(user and password, a token, one read again from its file at each reconnect, an nkey seed, a creds file; TLS; the
inbox prefix its permissions allow), reconnecting for ever, and what the connection tells the bus over it: the
subjects the server refused it (a permissions violation on a publish, which no ack ever says), and each
reconnection (``Relinks``), on which what waits for a reply sends again. Credentials NATS refuses at the start are
said at once (``ConnectionRefusedError``), a server that cannot be reached as ``ServerUnreachable``; a refusal on an
established connection sends it back to reconnecting (``_ReconnectingClient``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.client import AUTHORIZATION_VIOLATION
from nats.aio.client import Client as NatsClient

from shared.contract.permissions import inbox_prefix
from shared.plumbing.errors import ServerUnreachable
from shared.plumbing.settings import NatsSettings, Secret, public_url
from shared.plumbing.telemetry import Telemetry

log = logging.getLogger(__name__)


class Relinks:
    """The reconnections of one NATS connection (to the same server or, in a cluster, to another one), for what
    waits on a reply that may have been lost with the server it went to: ``next()`` is set on the next one."""

    def __init__(self) -> None:
        self._next = asyncio.Event()
        self.count = 0

    def happened(self) -> None:
        self.count += 1
        done, self._next = self._next, asyncio.Event()
        done.set()

    def next(self) -> asyncio.Event:
        return self._next


def _token_reader(path: Path, first: Secret | None) -> Callable[[], str]:
    """The token as the file holds it at each (re)connect (a projected service-account token is rewritten by the
    kubelet before it expires); the last good read when the file cannot be read at that moment."""
    last = [first.reveal() if first is not None else ""]

    def read() -> str:
        try:
            last[0] = path.read_text().strip() or last[0]
        except OSError as exc:
            log.warning("NATS token file unreadable; using the last token read", extra={"error": exc.strerror})
        return last[0]

    return read


class _ReconnectingClient(NatsClient):
    """nats-py's client, except that an authorization error on an established connection sends it back to
    reconnecting (presenting its credentials afresh) instead of closing it for good. On a mesh secured by the auth
    callout a server that restarts before the callout is back refuses the clients that reconnect first; nats-py
    closes such a connection and never opens it again, which leaves a service running without a bus. The error is
    still reported (``error_cb``) on every refusal, and bad credentials keep the service unready, never dead."""

    async def _process_err(self, err_msg: str) -> None:
        if AUTHORIZATION_VIOLATION in err_msg and self.is_connected and self.options["allow_reconnect"]:
            self._err = nats.errors.AuthorizationError()
            await self._error_cb(self._err)
            await self._process_op_err(self._err)
            return
        await super()._process_err(err_msg)


@dataclass
class Connection:
    """An open NATS connection, with the subjects its server refused it a publish on (-> when, monotonic) and its
    reconnections."""

    nc: NatsClient
    refused: dict[str, float]
    relinks: Relinks


async def open_connection(
    settings: NatsSettings,
    source: str,
    telemetry: Telemetry,
    connect_timeout: float = 5.0,
    on_error: Callable[[Exception], None] | None = None,
) -> Connection:
    """Connect to the servers ``settings`` name, as ``source`` (the name the server shows); ``telemetry`` counts
    the connection up or down. Waits up to twice ``connect_timeout``."""
    up = telemetry.connection_up.labels("nats")
    refused: dict[str, float] = {}
    relinks = Relinks()
    auth_failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def error_cb(exc: Exception) -> None:
        text = str(exc)
        log.warning("nats error", extra={"error": text})
        lowered = text.lower()
        if "permissions violation for publish to" in lowered:
            refused[text.split('"')[1] if '"' in text else ""] = time.monotonic()
        if "authorization violation" in lowered and not auth_failed.done():
            auth_failed.set_result(text)
        if on_error:
            on_error(exc)

    async def disconnected_cb() -> None:
        up.set(0)
        if not nc.is_closed:  # close() sets CLOSED before it calls back: a deliberate close is no outage
            log.warning("nats disconnected; reconnecting")

    async def reconnected_cb() -> None:
        up.set(1)
        relinks.happened()
        url = nc.connected_url.geturl() if nc.connected_url else ""
        log.info("nats reconnected", extra={"server": public_url(url)})

    options: dict[str, Any] = {
        "servers": list(settings.servers),
        "name": source,
        "connect_timeout": connect_timeout,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "allow_reconnect": True,
        "error_cb": error_cb,
        "disconnected_cb": disconnected_cb,
        "reconnected_cb": reconnected_cb,
    }
    if settings.user:
        options["user"] = settings.user
        options["password"] = settings.password.reveal() if settings.password else ""
    if settings.token_file is not None:
        options["token"] = _token_reader(settings.token_file, settings.token)
    elif settings.token:
        options["token"] = settings.token.reveal()
    inbox = settings.inbox_prefix or (inbox_prefix(settings.user) if settings.user else "")
    if inbox:
        options["inbox_prefix"] = inbox
    if settings.nkey_seed_file:
        options["nkeys_seed"] = str(settings.nkey_seed_file)
    if settings.creds_file:
        options["user_credentials"] = str(settings.creds_file)
    if settings.tls.enabled:
        options["tls"] = settings.tls.context()
    nc = _ReconnectingClient()
    connecting = asyncio.ensure_future(nc.connect(**options))
    await asyncio.wait((connecting, auth_failed), timeout=connect_timeout * 2, return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done() or connecting.exception() is not None:
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        with contextlib.suppress(Exception):
            await nc.close()
        if auth_failed.done():
            raise ConnectionRefusedError(f"NATS refused the credentials: {auth_failed.result()}")
        detail = str(connecting.exception()) if not connecting.cancelled() and connecting.done() else ""
        raise ServerUnreachable("NATS", ", ".join(public_url(s) for s in settings.servers), detail)
    up.set(1)
    return Connection(nc, refused, relinks)
