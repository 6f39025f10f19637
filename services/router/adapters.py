"""The router's adapters: where sessions are, from the bus, and the pool's pods, from the cluster port.

Locations: the router hears every ``kv.session.location`` as it is published (a core subscription on the subject,
which the events stream also stores), and at start, and again after a reconnect (a gap in what it heard), reads back
the newest location of every session from the events stream: the stream's subjects of that kind (one per
session, listed by ``STREAM.INFO`` with a subject filter, a page of 100,000 at a time) and, for each, the last
message with a JetStream direct get on exactly that subject. Both feed ``EndpointPicker.on_location``, which keeps
the newest per session whatever order they come in. Nothing here asks the checkpoint service, and nothing reads
any other event or creates a consumer (docs/security.md: the router's user).

Pods: the pool's namespace is listed once per change the cluster's watch reports (changes that come together are
one listing) and every ``pods_resync_s`` besides: the level the picker is set to, never a replay of changes. The
nodes the pool's pods are on are read as they change (a cordoned node's pods are ``leaving``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from shared.contract.sessions import SessionLocation
from shared.plumbing.bus import DEFAULT_MAX_EVENT_BYTES, Bus
from shared.ports.cluster import ClusterPort

from .picker import EndpointPicker
from .prefetch import Prefetcher

log = logging.getLogger(__name__)

READ_WINDOW = 512
"""Direct gets in flight at once while reading back the newest locations."""


class LocationReader:
    """Reads back the newest ``kv.session.location`` of every session from the events stream."""

    def __init__(self, bus: Bus, picker: EndpointPicker) -> None:
        self.bus = bus
        self.picker = picker
        self.read = 0
        self.refused = 0

    async def _subjects(self) -> list[str]:
        s = self.bus.subjects
        stream, pattern = s.events_stream.name, s.pattern("kv.session.location")
        found: list[str] = []
        while True:
            request = json.dumps({"subjects_filter": pattern, "offset": len(found)}).encode()
            reply = await self.bus.nc.request(f"$JS.API.STREAM.INFO.{stream}", request, timeout=10)
            info = json.loads(reply.data)
            if "error" in info:
                raise RuntimeError(f"stream info {stream}: {info['error'].get('description', info['error'])}")
            page = list((info.get("state") or {}).get("subjects") or {})
            found += page
            if not page or len(found) >= int(info.get("total") or 0):
                return found

    async def _last(self, subject: str) -> None:
        stream = self.bus.subjects.events_stream.name
        reply = await self.bus.nc.request(f"$JS.API.DIRECT.GET.{stream}.{subject}", b"", timeout=10)
        if not reply.data:  # a status (404: purged since it was listed), no message
            return
        event, reason = self.bus.decode(reply.data, (SessionLocation,), DEFAULT_MAX_EVENT_BYTES, subject)
        if not isinstance(event, SessionLocation):
            self.refused += 1
            log.warning("stored location refused", extra={"subject": subject, "reason": reason[:200]})
            return
        self.picker.on_location(event)
        self.read += 1

    async def read_newest(self) -> int:
        """Every session's newest stored location into the picker; returns how many were read."""
        subjects = await self._subjects()
        window = asyncio.Semaphore(READ_WINDOW)

        async def one(subject: str) -> None:
            async with window:
                await self._last(subject)

        before = self.read
        await asyncio.gather(*(one(subject) for subject in subjects))
        return self.read - before


async def follow_reconnects(bus: Bus, reread: Callable[[], Awaitable[int]], poll_s: float = 1.0) -> None:
    """Read the newest locations again each time the connection to NATS comes back: what was published while it
    was down was not heard. A loop for ``ctx.spawn``."""
    was_connected = bus.connected
    while True:
        await asyncio.sleep(poll_s)
        connected = bus.connected
        if connected and not was_connected:
            count = await reread()
            log.info("locations read again after a reconnect", extra={"sessions": count})
        was_connected = connected


class PodFollower:
    """The pool's pods from the cluster port into the picker, level-triggered, and whether their nodes are cordoned
    (a pod on a cordoned node is ``leaving``). A node is read when a pool pod is first seen on it, when the watch
    reports a change of it, and at every resync: what changes, never the whole cluster."""

    def __init__(
        self,
        cluster: ClusterPort,
        picker: EndpointPicker,
        resync_s: float,
        prefetcher: Prefetcher | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.cluster = cluster
        self.picker = picker
        self.prefetcher = prefetcher
        self.clock = clock
        self.resync_s = resync_s
        self.changed = asyncio.Event()
        self.listings = 0
        self.node_reads = 0
        self.cordoned: set[str] = set()
        self._nodes: set[str] = set()
        """The nodes the pool's pods are on, as last listed (a change of one of them wakes the listing)."""
        self._nodes_changed: set[str] = set()

    async def list_once(self, every_node: bool = False) -> None:
        """List the pool's pods; read the nodes new to the pool, those the watch said changed (all of the pool's
        with ``every_node``); set the picker; prefetch for the pods that stopped serving."""
        changed, self._nodes_changed = self._nodes_changed, set()
        try:
            pods = await self.cluster.pods(namespace=self.picker.namespace)
            nodes = {p.node for p in pods if p.node and p.deployment == self.picker.deployment}
            for name in sorted(nodes if every_node else (nodes - self._nodes) | (changed & nodes)):
                node = await self.cluster.node(name)
                self.node_reads += 1
                if node is not None and not node.schedulable:
                    self.cordoned.add(name)
                else:
                    self.cordoned.discard(name)
        except BaseException:
            self._nodes_changed |= changed  # read again on the next listing
            raise
        self._nodes = nodes
        self.cordoned &= nodes
        before = self.prefetcher.serving() if self.prefetcher is not None else {}
        self.picker.set_pods(pods, self.cordoned)
        self.listings += 1
        if self.prefetcher is not None and self.clock is not None:  # pods that stopped serving: their sessions
            self.prefetcher.on_listing(before, self.clock())

    async def watch(self) -> None:
        """Wake the listing loop on each change of a pod of the pool's namespace or of a node one of the pool's
        pods is on (a loop for ``ctx.spawn``)."""
        async for change in self.cluster.watch():
            if change.kind == "pod" and change.namespace in ("", self.picker.namespace):
                self.changed.set()
            elif change.kind == "node" and change.name in self._nodes:
                self._nodes_changed.add(change.name)
                self.changed.set()

    async def relist(self) -> None:
        """List on each wake-up, or every ``resync_s`` with every node read again (a loop for ``ctx.spawn``)."""
        while True:
            try:
                await asyncio.wait_for(self.changed.wait(), self.resync_s)
                every_node = False
            except TimeoutError:
                every_node = True
            self.changed.clear()
            await self.list_once(every_node)
