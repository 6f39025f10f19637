"""Versioned configuration in Redis: compare-and-set writes, change notification, and a watcher that keeps the
last good document.

Each document lives in a hash ``<root>:config:<name>`` (``version``, ``doc``, ``updated_at``, ``updated_by``).
A write names the version it read; a Lua script compares and writes atomically, so two writers racing on one
version end with exactly one winner and one ``ConfigConflict``. The script also announces the change on a
pub/sub channel. Pub/sub loses messages while a subscriber is disconnected, so the watcher also re-reads
everything on every (re)connect and on a slow timer. A document that does not validate is refused at write time
and, should one be found at read time anyway, logged and never applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff, NoBackoff

from shared.contract.configdocs import CONFIG_DOCUMENTS, ConfigDocument
from shared.contract.subjects import Subjects
from shared.plumbing.errors import ConfigConflict, InvalidConfig
from shared.plumbing.replies import as_text
from shared.plumbing.settings import RedisSettings, sentinel_url
from shared.plumbing.telemetry import Telemetry

log = logging.getLogger(__name__)

_CAS = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if current ~= tonumber(ARGV[1]) then
  return {0, current}
end
local nextv = current + 1
redis.call('HSET', KEYS[1], 'version', nextv, 'doc', ARGV[2], 'updated_at', ARGV[3], 'updated_by', ARGV[4])
redis.call('PUBLISH', KEYS[2], ARGV[5] .. ' ' .. nextv)
return {1, nextv}
"""


class SentinelManagedRedis(aioredis.Redis):
    """A client of whichever server the Sentinels name as the primary now; closing it closes its connections to
    the Sentinels too."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for client in self.sentinel_manager.sentinels if self.sentinel_manager is not None else ():
            with contextlib.suppress(Exception):
                await client.aclose()


RECONNECTS = 3
"""How many times a client sends a command again over a fresh connection (``redis_client``)."""


@dataclass(frozen=True)
class _SharedPool:
    settings: RedisSettings
    client: aioredis.Redis


_SHARED: contextvars.ContextVar[_SharedPool | None] = contextvars.ContextVar("gpuwarden_redis_pool", default=None)
SERVICE_TIMEOUT_S = 2.0
"""A service's Redis timeout: it must notice quickly that Redis is gone and fall back."""
COMMAND_TIMEOUT_S = 10.0
"""A person's command's (``gpuwarden drain``, ``status``...): a busy machine's Redis answering in 3 s is slow, not
gone; a Redis that refuses is said at once whatever the timeout."""
_TIMEOUT: contextvars.ContextVar[float] = contextvars.ContextVar("gpuwarden_redis_timeout", default=SERVICE_TIMEOUT_S)


@contextlib.contextmanager
def command_timeouts() -> Iterator[None]:
    """Clients made within (a ``gpuwarden`` command, and what it runs) wait ``COMMAND_TIMEOUT_S`` for Redis."""
    token = _TIMEOUT.set(COMMAND_TIMEOUT_S)
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def share_redis_pool(settings: RedisSettings, max_connections: int) -> aioredis.Redis:
    """From now on in the current context, and in every task started from it (asyncio copies the context into
    each new task), ``redis_client(settings)`` gives a client over one pool of at most ``max_connections``
    connections: the process's one pool however many agents ask for a client. The hollow host calls it in a task
    of its own, which every node's tasks descend from. Closing a client over it closes nothing shared; the
    client returned owns the pool (``aclose`` it last)."""
    client = redis_client(settings, max_connections=max_connections)
    _SHARED.set(_SharedPool(settings, client))
    return client


async def warm_pool(client: aioredis.Redis, connections: int) -> int:
    """Open up to ``connections`` connections of the client's pool now, one after another, and put them back: a
    process about to start many agents at once connects while it is quiet, not while each connect competes with
    the agents for the event loop. Returns how many are open; stops at the first that fails (Redis down: the
    agents connect later, as usual)."""
    pool = client.connection_pool
    opened: list[Any] = []
    try:
        for _ in range(connections):
            opened.append(await pool.get_connection())
    except (redis.exceptions.RedisError, OSError):
        pass
    finally:
        for connection in opened:
            await pool.release(connection)
    return len(opened)


DEFAULT_CONNECTIONS = 256
"""A client's connections at most (commands beyond wait for one), unless the caller caps its pool lower."""


def redis_client(
    settings: RedisSettings,
    timeout: float | None = None,
    *,
    reconnects: int = RECONNECTS,
    max_connections: int | None = None,
) -> aioredis.Redis:
    """A client with short timeouts: a service must notice quickly that Redis is gone and fall back
    (``SERVICE_TIMEOUT_S``; a command's clients wait ``COMMAND_TIMEOUT_S``, ``command_timeouts``).

    A command that finds its connection dead (Redis restarted since the connection was last used) connects again
    and is sent again, up to ``reconnects`` times with a short backoff, so a Redis that came back costs no caller
    an error; one that stays down raises ``ConnectionError`` within about a second. A command that timed out is
    not sent again. ``reconnects=0``: every lost connection reaches the caller (the config watcher wants that, to
    read everything again).

    Behind Sentinel (``redis+sentinel://`` in the URL) every new connection asks the Sentinels which server is
    the primary now, so after a failover the next command reaches the promoted replica; while none is named
    (the failover is under way) commands raise ``ConnectionError`` (``MasterNotFoundError``), as for a Redis
    that is down. This is the one place Redis clients are made.

    ``max_connections``: a pool of at most that many connections, shared by everything the process runs (the
    hollow host's nodes): a burst of commands waits for a free connection instead of opening one each (behind
    Sentinel, redis-py's pool does not wait: the cap is left to it). Called after ``share_redis_pool`` for the
    same settings (and the default ``reconnects``), the client is one over that pool."""
    shared = _SHARED.get()
    if shared is not None and shared.settings == settings and reconnects == RECONNECTS and max_connections is None:
        return aioredis.Redis(connection_pool=shared.client.connection_pool)
    if timeout is None:
        timeout = _TIMEOUT.get()
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 10,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), reconnects, (redis.exceptions.ConnectionError,)),
        "retry_on_error": [redis.exceptions.ConnectionError],
    }
    tls: dict[str, Any] = {}
    if settings.tls.enabled:
        if settings.tls.ca:
            tls["ssl_ca_certs"] = str(settings.tls.ca)
        if settings.tls.cert:
            tls["ssl_certfile"] = str(settings.tls.cert)
            tls["ssl_keyfile"] = str(settings.tls.key)
    options.update(tls)
    address = sentinel_url(settings.url)
    username = address.username if address and address.username else settings.username
    password = address.password if address and address.password else settings.password
    if username:
        options["username"] = username
    if password:
        options["password"] = password.reveal()
    if address is None:
        # a burst waits for a free connection: redis-py's plain pool fails the command past 100 connections
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.url, max_connections=max_connections or DEFAULT_CONNECTIONS, timeout=max(timeout, 5.0), **options
        )
        return aioredis.Redis.from_pool(pool)
    if address.tls:
        options["ssl"] = True
    # one try per Sentinel and question: the connection's own retries above ask them all again (redis-py's
    # default for these clients backs off for seconds, which kept a CLI facing dead Sentinels waiting 15 s)
    sentinel_options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        **tls,
    }
    if address.tls:
        sentinel_options["ssl"] = True
    if settings.sentinel_password:
        sentinel_options["password"] = settings.sentinel_password.reveal()
    sentinel = Sentinel(address.sentinels, sentinel_kwargs=sentinel_options)
    client = sentinel.master_for(address.service, redis_class=SentinelManagedRedis, db=address.db, **options)
    client.sentinel_manager = sentinel
    return client


def redis_unreachable(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, says that Redis did not answer (refused, lost, timed
    out); a refused password or a busy server are answers, not silence."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)) and not isinstance(
            exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class VersionedConfig:
    name: str
    version: int
    doc: ConfigDocument
    updated_at: float
    updated_by: str


def document_type(name: str) -> type[ConfigDocument]:
    try:
        return CONFIG_DOCUMENTS[name]
    except KeyError:
        known = ", ".join(sorted(CONFIG_DOCUMENTS))
        raise InvalidConfig(f"unknown configuration document {name!r}; known: {known}") from None


def parse_document(name: str, raw: bytes | str) -> ConfigDocument:
    """Validate raw JSON as the document ``name``, or raise ``InvalidConfig`` saying which field is wrong."""
    try:
        doc = msgspec.json.decode(raw, type=document_type(name))
    except msgspec.ValidationError as exc:
        raise InvalidConfig(f"config {name!r}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidConfig(f"config {name!r}: not valid JSON: {exc}") from None
    return doc


class ConfigStore:
    """Reads and compare-and-set writes of configuration documents."""

    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.subjects = subjects
        self._cas = client.register_script(_CAS)

    async def read(self, name: str) -> VersionedConfig | None:
        """The stored document, or None when there is none. Raises ``InvalidConfig`` for a stored document that
        does not validate (written by something that bypassed this store)."""
        fields = await self.client.hgetall(self.subjects.config_key(name))
        if not fields:
            return None
        doc = parse_document(name, fields[b"doc"])
        return VersionedConfig(
            name=name,
            version=int(fields[b"version"]),
            doc=doc,
            updated_at=float(fields.get(b"updated_at", b"0")),
            updated_by=as_text(fields.get(b"updated_by", b"")),
        )

    async def write(self, name: str, doc: ConfigDocument, expected_version: int, by: str) -> int:
        """Store ``doc`` as the next version if the stored version is still ``expected_version`` (0: absent).
        Returns the new version; raises ``ConfigConflict`` when another writer got there first."""
        expected_type = document_type(name)
        if not isinstance(doc, expected_type):
            raise InvalidConfig(f"config {name!r} must be a {expected_type.__name__}, not {type(doc).__name__}")
        return await self.write_raw(name, msgspec.json.encode(doc), expected_version, by)

    async def write_raw(self, name: str, raw: bytes, expected_version: int, by: str) -> int:
        doc = parse_document(name, raw)  # refuse anything that would not validate for its readers
        ok, version = await self._cas(
            keys=[self.subjects.config_key(name), self.subjects.config_channel],
            args=[expected_version, msgspec.json.encode(doc), time.time(), by, name],
        )
        if not ok:
            raise ConfigConflict(name, expected_version, int(version))
        return int(version)


ConfigListener = Callable[[VersionedConfig], Awaitable[None] | None]


class ConfigWatcher:
    """Keeps the newest valid version of each watched document, and keeps it while Redis is away.

    ``current(name)`` never blocks; a document is replaced only by a valid one, never by an absence.
    ``connected`` says whether Redis answered last time;
    the runner reports it as degraded health when not.
    """

    def __init__(
        self,
        settings: RedisSettings,
        subjects: Subjects,
        names: Iterable[str],
        telemetry: Telemetry | None = None,
        reread_s: float = 15.0,
    ) -> None:
        self.settings = settings
        self.subjects = subjects
        self.names = tuple(names)
        for name in self.names:
            document_type(name)
        self.telemetry = telemetry or Telemetry("config")
        self.reread_s = reread_s
        self.connected = False
        self.last_error = ""
        self._docs: dict[str, VersionedConfig] = {}
        self._listeners: list[ConfigListener] = []
        self._loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: aioredis.Redis | None = None

    def current(self, name: str) -> VersionedConfig | None:
        return self._docs.get(name)

    def on_change(self, listener: ConfigListener) -> None:
        self._listeners.append(listener)

    async def start(self, wait: float = 5.0) -> None:
        """Start watching; waits up to ``wait`` seconds for the first full read (Redis may be down: then the
        service starts on defaults and catches up when Redis answers)."""
        self._task = asyncio.create_task(self._run(), name="config-watcher")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._loaded.wait(), timeout=wait)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=3.0)
        if self._client:
            with contextlib.suppress(Exception):
                await self._client.aclose()

    async def _apply(self, name: str, store: ConfigStore) -> None:
        try:
            found = await store.read(name)
        except InvalidConfig as exc:
            log.error("ignoring invalid configuration document", extra={"config": name, "error": str(exc)})
            return
        if found is None:
            return
        held = self._docs.get(name)
        if held is not None and (held.version, held.updated_at) == (found.version, found.updated_at):
            return
        if held is not None and found.version <= held.version:
            # The store went back (Redis restarted empty, or a failover lost a write): the store is the
            # truth every service converges on, so follow it, loudly.
            log.warning(
                "configuration version went back in the store; following it",
                extra={"config": name, "held": held.version, "stored": found.version},
            )
        self._docs[name] = found
        self.telemetry.config_version.labels(name).set(found.version)
        log.info("configuration applied", extra={"config": name, "version": found.version})
        for listener in self._listeners:
            try:
                result = listener(found)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("configuration listener failed", extra={"config": name})

    async def reread(self, store: ConfigStore) -> None:
        for name in self.names:
            await self._apply(name, store)

    def _set_connected(self, up: bool, error: str = "") -> None:
        if up != self.connected:
            if up:
                log.info("redis reachable; configuration in sync")
            else:
                log.warning("redis unreachable; running on the last good configuration", extra={"error": error})
        self.connected = up
        self.last_error = error
        self.telemetry.connection_up.labels("redis").set(1 if up else 0)

    async def _run(self) -> None:
        failures = 0
        while True:
            client = redis_client(self.settings, reconnects=0)  # a lost connection must end up here: read again
            self._client = client
            pubsub = client.pubsub()
            try:
                store = ConfigStore(client, self.subjects)
                await pubsub.subscribe(self.subjects.config_channel)
                await self.reread(store)  # after subscribing, so nothing between the two is missed
                self._set_connected(True)
                self._loaded.set()
                failures = 0
                next_full = time.monotonic() + self.reread_s
                while True:
                    timeout = max(0.0, next_full - time.monotonic())
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
                    if message and message.get("type") == "message":
                        name = bytes(message["data"]).decode().split(" ")[0]
                        if name in self.names:
                            await self._apply(name, store)
                    if time.monotonic() >= next_full:
                        await self.reread(store)
                        next_full = time.monotonic() + self.reread_s
            except asyncio.CancelledError:
                raise
            except (redis.exceptions.RedisError, OSError) as exc:
                failures += 1
                self._set_connected(False, f"{type(exc).__name__}: {exc}")
                self._loaded.set()
                await asyncio.sleep(min(0.2 * failures, 2.0))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()
