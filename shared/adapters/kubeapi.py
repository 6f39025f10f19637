"""Reading the Kubernetes API: one call's answer, and a watch of whole collections (``shared.adapters.kube`` makes
its calls and watches through these).

Bodies are read as the JSON the API server sends rather than as the client's generated models: a newer server's
unknown fields or enum values can never fail a read, and a refusal's ``Status`` body is there to be reported
(``KubeApiError``).

A watch lists, then watches from the list's resourceVersion; a dropped connection (or a server-side timeout)
resumes from the last version seen, and a 410 Gone (history compacted) lists again and reports the difference
from what it knew as ADDED / MODIFIED / DELETED, so a consumer misses no object's latest state and sees no
duplicate.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import aiohttp

from shared.plumbing.retries import KUBE_WATCH
from shared.ports.cluster import ClusterChange, ClusterError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Kind = Literal["node", "pod", "deployment"]
ChangeType = Literal["ADDED", "MODIFIED", "DELETED"]

_WATCH_TIMEOUT_S = 290
"""Server-side end of one watch request (the API server's own default lies between 30 and 60 minutes); the
client gives up on a silent connection 30 s later. Either way the watch resumes from the last version seen."""
_PERMANENT = frozenset({400, 401, 403, 404, 405, 415, 422})


class KubeApiError(ClusterError):
    """The API server refused a request: ``code`` is the HTTP status, ``reason`` the Status reason."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"Kubernetes API: {code} {reason}: {message}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Collection:
    """One watchable collection: how to list or watch it, and how to name its objects in a change."""

    kind: Kind
    list_all: Callable[..., Awaitable[aiohttp.ClientResponse]]


class ClusterWatch(AsyncIterator[ClusterChange]):
    """The changes of the watched kinds, as an async iterator; ``aclose()`` (or the cluster's ``close``) stops it.

    One task per kind lists, then watches; each keeps the resourceVersion of every object it knows, which both
    drops a duplicate (an event for a version already seen) and gives the difference to report after a re-list.
    """

    def __init__(self, resources: list[Collection], forget: Callable[[ClusterWatch], None]) -> None:
        self._resources = resources
        self._forget = forget
        self._queue: asyncio.Queue[ClusterChange | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._synced = 0
        self._ready: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._closed = False

    def __aiter__(self) -> ClusterWatch:
        return self

    async def __anext__(self) -> ClusterChange:
        if self._closed:
            raise StopAsyncIteration
        self._start()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        return item

    async def ready(self) -> None:
        """Return once every kind is listed (changes after that are all reported); raise what stopped a kind."""
        self._start()
        assert self._ready is not None
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure

    async def aclose(self) -> None:
        self._closed = True
        self._forget(self)
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self) -> None:
        if self._ready is None:
            self._ready = asyncio.Event()
            if not self._resources:
                self._ready.set()
            self._tasks = [asyncio.create_task(self._follow(resource)) for resource in self._resources]

    def _emit(self, kind: Kind, type_: ChangeType, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name", "")
        node = name if kind == "node" else (obj.get("spec") or {}).get("nodeName", "") if kind == "pod" else ""
        change = ClusterChange(
            kind, type_, name, meta.get("namespace", ""), meta.get("resourceVersion", ""), node=node or ""
        )
        self._queue.put_nowait(change)

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        self._queue.put_nowait(exc)
        assert self._ready is not None
        self._ready.set()

    async def _follow(self, resource: Collection) -> None:
        """Watch ``resource`` until closed, resuming as ``retries.KUBE_WATCH`` says; a watch request that brought
        events starts the waits over, and a refusal retrying cannot cure ends the watch with it."""
        cursor = _Cursor()

        def resuming(exc: Exception, wait_s: float) -> None:
            if not isinstance(exc, _Quiet):
                log.warning("watch of %ss: %s; resuming in %.2f s", resource.kind, exc, wait_s)

        try:
            while True:
                async for attempt in KUBE_WATCH.tries(when=_curable, note=resuming):
                    with attempt:
                        await self._watch(resource, cursor)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    async def _watch(self, resource: Collection, cursor: _Cursor) -> None:
        """List ``resource`` when there is no version to resume from, then follow one watch request to its end; a
        version gone from the server's history is listed again at once. Raises ``_Quiet`` when the request
        brought no event, and ``ClusterError`` for what the API server or the connection did."""
        try:
            while True:
                if cursor.version is None:
                    await self._relist(resource, cursor, report=cursor.listed)
                    if not cursor.listed:
                        cursor.listed = True
                        self._synced += 1
                        if self._synced == len(self._resources):
                            assert self._ready is not None
                            self._ready.set()
                try:
                    events = await self._stream(resource, cursor)
                except _Gone:
                    log.info("watch of %ss: version %s is gone; listing again", resource.kind, cursor.version)
                    cursor.version = None
                    continue
                if not events:
                    raise _Quiet(f"watch of {resource.kind}s: the request ended with no event")
                return
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise ClusterError(f"Kubernetes API unreachable or unreadable: {exc!r}") from exc

    async def _relist(self, resource: Collection, cursor: _Cursor, report: bool) -> None:
        """List ``resource`` afresh into ``cursor``; with ``report``, emit how the listing differs from before."""
        listing = await read_json(resource.list_all())
        version = str(listing["metadata"]["resourceVersion"])
        fresh: dict[tuple[str, str], Obj] = {_key(obj): obj for obj in listing["items"]}
        known = cursor.known
        if report:
            for key, obj in fresh.items():
                if key not in known:
                    self._emit(resource.kind, "ADDED", obj)
                elif known[key] != obj["metadata"]["resourceVersion"]:
                    self._emit(resource.kind, "MODIFIED", obj)
            for key in known.keys() - fresh.keys():
                gone = {"metadata": {"namespace": key[0], "name": key[1], "resourceVersion": version}}
                self._emit(resource.kind, "DELETED", gone)
        cursor.known = {key: obj["metadata"]["resourceVersion"] for key, obj in fresh.items()}
        cursor.version = version

    async def _stream(self, resource: Collection, cursor: _Cursor) -> int:
        """Follow one watch request from ``cursor.version`` to its end, moving the cursor with each event; how
        many events came."""
        response = await resource.list_all(
            watch=True,
            resource_version=cursor.version,
            allow_watch_bookmarks=True,
            timeout_seconds=_WATCH_TIMEOUT_S,
            _request_timeout=float(_WATCH_TIMEOUT_S + 30),
        )
        events = 0
        try:
            if response.status == 410:
                raise _Gone
            if response.status != 200:
                await _body(response)
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                events += 1
                type_, obj = event.get("type"), event.get("object") or {}
                if type_ == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone
                    raise KubeApiError(int(obj.get("code") or 500), obj.get("reason", ""), obj.get("message", ""))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or cursor.version)
                key = _key(obj)
                if type_ == "DELETED":
                    if cursor.known.pop(key, None) is not None:
                        self._emit(resource.kind, "DELETED", obj)
                elif type_ in ("ADDED", "MODIFIED") and cursor.known.get(key) != version:
                    seen_before = key in cursor.known
                    cursor.known[key] = version
                    self._emit(resource.kind, "MODIFIED" if seen_before else "ADDED", obj)
                cursor.version = version
            return events
        finally:
            response.close()


@dataclass(slots=True)
class _Cursor:
    """Where a watch of one kind stands: the version to resume from (None: list first) and the version of every
    object it knows, which drops duplicates and gives the difference to report after a re-list."""

    version: str | None = None
    known: dict[tuple[str, str], str] = field(default_factory=dict)
    listed: bool = False
    """Listed once: a listing after the first reports how it differs from what was known."""


class _Gone(Exception):
    """The watch's resourceVersion is older than the server's history: list again."""


class _Quiet(ClusterError):
    """A watch request that ended with no event (a server that closes it at once): resumed after a wait."""


def _curable(exc: Exception) -> bool:
    """Whether a watch that failed with ``exc`` may be resumed: after what the API server or the connection did,
    but not after a refusal retrying cannot cure."""
    return isinstance(exc, ClusterError) and not (isinstance(exc, KubeApiError) and exc.code in _PERMANENT)


async def read_json(call: Awaitable[aiohttp.ClientResponse]) -> Obj:
    """The JSON body of a call; a non-2xx answer raises ``KubeApiError`` with the Status' reason and message."""
    try:
        response = await call
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ClusterError(f"Kubernetes API unreachable: {exc!r}") from exc
    return await _body(response)


async def _body(response: aiohttp.ClientResponse) -> Obj:
    try:
        raw = await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ClusterError(f"Kubernetes API unreachable: {exc!r}") from exc
    finally:
        response.release()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {"message": raw[:200].decode(errors="replace")}
    if not 200 <= response.status < 300:
        if not isinstance(body, dict):
            body = {}
        raise KubeApiError(response.status, body.get("reason", response.reason or ""), body.get("message", ""))
    return cast(Obj, body)


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


__all__ = ["ChangeType", "ClusterWatch", "Collection", "Kind", "KubeApiError", "Obj", "read_json"]
