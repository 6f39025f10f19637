"""Adapters of the metrics service: the aggregates in Redis, and pod owners from the simulated cluster."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import msgspec
import redis.asyncio as aioredis

from shared.contract.metrics import UtilisationRecord
from shared.contract.subjects import Subjects
from shared.ports.cluster import ClusterError
from shared.sim.cluster import SimCluster

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(UtilisationRecord).decode


def record_key(subjects: Subjects, scope: str, namespace: str, name: str) -> str:
    """``<root>:metrics:deployment:<ns>:<name>`` or ``<root>:metrics:pod:<ns>:<pod>``."""
    return subjects.redis_key("metrics", scope, namespace, name)


class RedisUtilisationStore:
    def __init__(self, client: aioredis.Redis, subjects: Subjects, *, owns_client: bool = False) -> None:
        self.client = client
        self.subjects = subjects
        self.owns_client = owns_client

    async def put(self, records: Sequence[UtilisationRecord], ttl_s: float) -> None:
        """One pipeline per interval; a record outlives its writer by ``ttl_s`` (readers still check
        ``sampled_at``)."""
        if not records:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for r in records:
                pipe.set(record_key(self.subjects, r.scope, r.namespace, r.name), _encode(r), ex=max(int(ttl_s), 1))
            await pipe.execute()

    async def get(self, scope: str, namespace: str, name: str) -> UtilisationRecord | None:
        raw = await self.client.get(record_key(self.subjects, scope, namespace, name))
        return None if raw is None else _decode(raw)

    async def close(self) -> None:
        if self.owns_client:
            with contextlib.suppress(Exception):
                await self.client.aclose()


class SimPodOwners:
    """Pod -> deployment from the SIMULATED cluster in Redis."""

    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.cluster = SimCluster(client, subjects)

    async def owners(self) -> Mapping[tuple[str, str], str]:
        try:
            return {(p.namespace, p.name): p.deployment for p in await self.cluster.pods()}
        except ClusterError:
            return {}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
