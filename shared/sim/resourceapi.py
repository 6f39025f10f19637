"""The simulated cluster's DRA objects (``resource.k8s.io/v1``): each node's ResourceSlices and the ResourceClaims,
in Redis hashes beside the cluster (``<root>:sim:cluster:resourceslices`` by slice name, ``...:resourceclaims`` by
``namespace/name``), so the device service of each simulated node publishes its slice as it would to an API
server, and every process attached to the root reads the same ones. A slice has one writer (its node's device
service), so a read, compare and write needs no transaction. ``SimCluster`` answers the cluster port's DRA calls
from here. SIMULATED.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.contract.subjects import Subjects
from shared.ports.cluster import ClusterError, ResourceClaimInfo, ResourceSlice

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
