"""The simulated cluster's DRA objects (``resource.k8s.io/v1``): each node's ResourceSlices and the ResourceClaims,
in Redis hashes beside the cluster (``<root>:sim:cluster:resourceslices`` by slice name, ``...:resourceclaims`` by
``namespace/name``), so the device service of each simulated node publishes its slice as it would to an API
server, and every process attached to the root reads the same ones. A slice has one writer (its node's device
service), so a read, compare and write needs no transaction. ``SimCluster`` answers the cluster port's DRA calls
from here. SIMULATED.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from shared.contract.subjects import Subjects
from shared.ports.cluster import ClusterError, ResourceClaimInfo, ResourceSlice
from shared.sim.drasched import DeviceRequest, allocate

_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


class StoredSlice(msgspec.Struct, frozen=True):
    generation: int
    slice: ResourceSlice


_SLICE = msgspec.json.Decoder(StoredSlice)
_CLAIM = msgspec.json.Decoder(ResourceClaimInfo)


class SimResourceApi:
    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self._client = client
        self._slices = subjects.redis_key("sim", "cluster", "resourceslices")
        self._claims = subjects.redis_key("sim", "cluster", "resourceclaims")

    async def publish_slice(self, resource_slice: ResourceSlice) -> bool:
        """Create or replace (generation one higher) unless the stored devices are these; True when it wrote."""
        try:
            raw = await self._client.hget(self._slices, resource_slice.name)  # type: ignore[misc]
            current = _SLICE.decode(raw) if raw is not None else None
            if current is not None and current.slice == resource_slice:
                return False
            stored = StoredSlice(current.generation + 1 if current else 1, resource_slice)
            await self._client.hset(self._slices, resource_slice.name, msgspec.json.encode(stored))  # type: ignore[misc]
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc
        return True

    @property
    def slices_key(self) -> str:
        return self._slices

    @staticmethod
    def by_node(raw: Mapping[Any, Any]) -> dict[str, ResourceSlice]:
        """The slices of a raw read of the hash (``HGETALL slices_key``), by node."""
        return {stored.slice.node: stored.slice for stored in (_SLICE.decode(v) for v in raw.values())}

    async def slices(self) -> dict[str, StoredSlice]:
        """Every slice by name, with its pool generation."""
        try:
            raw = await self._client.hgetall(self._slices)  # type: ignore[misc]
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc
        return {(k.decode() if isinstance(k, bytes) else k): _SLICE.decode(v) for k, v in raw.items()}

    async def put_claim(self, claim: ResourceClaimInfo) -> None:
        """Create or replace a claim, its allocation included (what the scheduler writes). (Simulation only.)"""
        try:
            await self._client.hset(self._claims, f"{claim.namespace}/{claim.name}", msgspec.json.encode(claim))  # type: ignore[misc]
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc

    async def claim(self, namespace: str, name: str) -> ResourceClaimInfo | None:
        try:
            raw = await self._client.hget(self._claims, f"{namespace}/{name}")  # type: ignore[misc]
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc
        return _CLAIM.decode(raw) if raw is not None else None

    async def allocate_claim(
        self, namespace: str, name: str, uid: str, requests: Sequence[DeviceRequest], node: str | None = None
    ) -> tuple[str, ResourceClaimInfo]:
        """Allocate a claim as the scheduler does (``shared.sim.drasched.allocate``: by class, CEL selectors and
        taints, free devices of one node; ``node``: the pod's, when it is placed already) and store it allocated.
        The node and the claim; an allocated claim of that name is answered as it is (allocating twice changes
        nothing). ``Unschedulable`` when no node can. Two schedulers allocating at once never share a device: the
        read of the claims and the write are one transaction (WATCH), tried again when another wrote between."""
        key = f"{namespace}/{name}"
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(self._claims)
                        raw_claims = await pipe.hgetall(self._claims)  # type: ignore[misc]
                        claims = {
                            (k.decode() if isinstance(k, bytes) else k): _CLAIM.decode(v) for k, v in raw_claims.items()
                        }
                        held = claims.get(key)
                        if held is not None and held.allocated:
                            await pipe.reset()
                            return _node_of(held, await self.slices()), held
                        taken = {(d.driver, d.pool, d.device) for c in claims.values() for d in c.devices}
                        slices = [s.slice for s in (await self.slices()).values()]
                        where, devices = allocate(requests, slices, taken, node=node)
                        claim = ResourceClaimInfo(namespace, name, uid, allocated=True, devices=devices)
                        pipe.multi()
                        pipe.hset(self._claims, key, msgspec.json.encode(claim))
                        await pipe.execute()
                        return where, claim
                    except WatchError:
                        continue
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc

    async def release_claim(self, namespace: str, name: str) -> bool:
        """Delete a claim (its pod gone): its devices are free for the next. True when there was one."""
        try:
            return bool(await self._client.hdel(self._claims, f"{namespace}/{name}"))  # type: ignore[misc]
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc


def _node_of(claim: ResourceClaimInfo, slices: dict[str, StoredSlice]) -> str:
    """The node whose slice holds the claim's devices ('' when none does any more)."""
    for stored in slices.values():
        pool = stored.slice
        names = {d.name for d in pool.devices}
        if any(d.driver == pool.driver and d.pool == pool.pool and d.device in names for d in claim.devices):
            return pool.node
    return ""
