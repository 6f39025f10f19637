"""One connection to a running mesh for a command: the bus, Redis, the cluster port, and the run's state file
(``open_mesh``); or the bus alone (``command_bus``).

A command that only reads (``status``, ``events``, ``where``, ``deadletters``) opens them ``read_only``: it looks
the streams up and creates none, so pointed at a NATS that is not a mesh's it says so and leaves nothing behind.
A command that acts creates the streams when they are missing, as every service does at its start."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.console.state import CommandError, command_settings, read_state, state_file
from shared.contract.registry import codec
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.newest import newest_messages
from shared.plumbing.settings import Settings, public_url
from shared.ports.cluster import ClusterError, ClusterPort

__all__ = ["CommandError", "MeshClient", "command_bus", "open_mesh", "read_state"]


@dataclass
class MeshClient:
    """What a command talks to. ``services``: the health URLs the run's state file lists (empty for a mesh this
    machine did not start, e.g. one in Kubernetes)."""

    settings: Settings
    bus: Bus
    redis: Any
    cluster: ClusterPort | None
    services: dict[str, str] = field(default_factory=dict)
    simulated: bool = True

    @property
    def subjects(self) -> Subjects:
        return self.bus.subjects

    @classmethod
    async def open(
        cls, settings: Settings, state: dict[str, Any], source: str = "cli", *, read_only: bool = False
    ) -> MeshClient:
        bus = await command_bus(settings, source, read_only=read_only)
        from shared.wiring import Wiring  # the adapters and the simulation: not for the commands of the bus alone

        redis = redis_client(settings.redis)
        wiring = Wiring(settings, Subjects(settings.root), bus)
        cluster: ClusterPort | None = wiring.attached_cluster()  # the simulation's, never created by a command
        if cluster is None:
            with contextlib.suppress(ClusterError):
                cluster = await wiring.cluster()
        services = state.get("services") if isinstance(state.get("services"), dict) else {}
        return cls(settings, bus, redis, cluster, dict(services or {}), settings.backend == "sim")

    def need_cluster(self) -> ClusterPort:
        if self.cluster is None:
            raise CommandError("no cluster to act on: GPUWARDEN_BACKEND=real and no Kubernetes configuration found")
        return self.cluster

    async def last_event(self, subject: str) -> Any | None:
        """The newest lifecycle event stored under ``subject`` (a JetStream direct read), or None."""
        try:
            raw = await self.bus.js.get_last_msg(self.subjects.events_stream.name, subject)
        except Exception:
            return None
        try:
            return codec.decode(raw.data or b"")
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None

    async def last_events(self, subjects: Iterable[str]) -> dict[str, Any]:
        """Subject -> the newest lifecycle event stored under it, for each of ``subjects`` that has a readable one:
        a few batched reads whatever their number (``shared.plumbing.newest``)."""
        found = await newest_messages(self.bus.nc, self.bus.js, self.subjects.events_stream.name, subjects)
        events: dict[str, Any] = {}
        for subject, stored in found.items():
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
                events[subject] = codec.decode(stored.data)
        return events

    async def close(self) -> None:
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                await self.cluster.close()
        with contextlib.suppress(Exception):
            await self.redis.aclose()
        await self.bus.close(1)


async def open_mesh(*, read_only: bool = False) -> MeshClient:
    """The mesh a command acts on, found through ``command_settings`` and the run's state file."""
    settings = command_settings()
    return await MeshClient.open(settings, read_state(state_file(os.environ)), read_only=read_only)


async def command_bus(settings: Settings, source: str = "cli", *, read_only: bool = False) -> Bus:
    """A bus for a command that needs nothing else of the mesh: the streams made sure of first, or with
    ``read_only`` looked up (``NoStreams`` when any is missing)."""
    bus = await Bus.connect(settings.nats, Subjects(settings.root), source, connect_timeout=3.0)
    try:
        if not read_only:
            await bus.ensure_streams()
        elif missing := await bus.missing_streams():
            where = ", ".join(public_url(s) for s in settings.nats.servers)
            raise CommandError(
                f"no gpuwarden mesh with root {settings.root!r} at NATS {where}: its stream(s) {', '.join(missing)} "
                "are missing (another program's NATS, another GPUWARDEN_ROOT, or streams deleted); nothing was "
                "created; `gpuwarden up --detach` starts a mesh"
            )
    except BaseException:
        await bus.close(1)
        raise
    return bus
