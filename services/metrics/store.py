"""The metrics service's own adapter: the aggregates in Redis, where the scaler reads them."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import msgspec
import redis.asyncio as aioredis

from shared.contract.metrics import UtilisationRecord
from shared.contract.subjects import Subjects

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
