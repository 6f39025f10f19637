"""Who runs what among the checkpoint service's replicas, in Redis (an adapter, beside the session registry): a
drain's lease and its one recorded verdict, the turns that let one replica act per interval (periodic saves, the
scrub, retention, rollouts), and the replicas' membership. The keys are ``keyspace.RegistryKeys``'s; the scripts
below are these leases' own.

A drain's record and its lease go together: the script that records the verdict drops the lease in the same step,
so a verdict is recorded once, by whoever held the lease or, when the events stream kept a verdict Redis lost, by
the replica that reads it back (``recover_drain``)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from shared.contract.node import DrainOutcome
from shared.contract.subjects import Subjects
from shared.plumbing.replies import as_text

from .keyspace import RegistryKeys, redis_may_be_down

# KEYS = [the lease], ARGV = owner, lease_ms: extend the lease while ``owner`` holds it. 1 when extended.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS = [the drain's record, its lease], ARGV = state, verdict, duration_s: the drain's one verdict, and its lease
# dropped. 0 (nothing written) when it has one already.
FINISH = """
if redis.call('HEXISTS', KEYS[1], 'verdict') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'verdict', ARGV[2], 'duration_s', ARGV[3])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS = [the turn], ARGV = owner: give the turn back while ``owner`` holds it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS = [replicas], ARGV = owner, lease_ms: renew the owner's membership, drop the lapsed, list who is left.
REPLICAS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


class ReplicaLeases:
    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.keys = RegistryKeys(subjects)
        self._renew = client.register_script(RENEW)
        self._finish = client.register_script(FINISH)
        self._release = client.register_script(RELEASE)
        self._replicas = client.register_script(REPLICAS)

    # -- drains ---------------------------------------------------------------------------------------------------
    @redis_may_be_down
    async def drain_verdict(self, drain_id: str) -> bytes | None:
        """The recorded verdict event (JSON), or None while the drain has none."""
        raw = await self.client.hget(self.keys.drain(drain_id), "verdict")
        return raw.encode() if isinstance(raw, str) else raw or None

    @redis_may_be_down
    async def drain_node(self, drain_id: str) -> str | None:
        """The node a drain was recorded for (running or decided), or None when no drain of that id is known."""
        raw = await self.client.hget(self.keys.drain(drain_id), "node")
        return None if raw is None else as_text(raw)

    @redis_may_be_down
    async def take_drain(self, drain_id: str, node: str, owner: str, lease_s: float) -> bool:
        """Take the lease on running a drain; False while another runner holds it."""
        taken = await self.client.set(self.keys.drain_lease(drain_id), owner, nx=True, px=int(lease_s * 1000))
        if taken:
            await self.client.hset(
                self.keys.drain(drain_id), mapping={"node": node, "state": "running", "started": time.time()}
            )
        return bool(taken)

    @redis_may_be_down
    async def renew_drain(self, drain_id: str, owner: str, lease_s: float) -> bool:
        """Extend the lease while ``owner`` still holds it; False when it was lost."""
        renewed = await self._renew(keys=[self.keys.drain_lease(drain_id)], args=[owner, int(lease_s * 1000)])
        return bool(renewed)

    @redis_may_be_down
    async def keep_failures(self, drain_id: str, failures: list[bytes], ttl_s: float) -> str:
        """Keep every failure of a verdict too big for one event; returns the key the verdict references."""
        key = self.keys.drain_failed(drain_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            for start in range(0, len(failures), 1000):
                pipe.rpush(key, *failures[start : start + 1000])
            pipe.expire(key, int(ttl_s))
            await pipe.execute()
        return key

    @redis_may_be_down
    async def finish_drain(self, drain_id: str, state: DrainOutcome, verdict: bytes, duration_s: float) -> bool:
        """Record the drain's one verdict; False (nothing written) when it already has one."""
        first = await self._finish(
            keys=[self.keys.drain(drain_id), self.keys.drain_lease(drain_id)],
            args=[state, verdict, duration_s],
        )
        return bool(first)

    @redis_may_be_down
    async def recover_drain(self, drain_id: str, node: str, state: DrainOutcome, verdict: bytes) -> bool:
        """Record again a verdict the events stream kept and Redis lost (a failover); False when it has one."""
        await self.client.hsetnx(self.keys.drain(drain_id), "node", node)
        return await self.finish_drain(drain_id, state, verdict, 0.0)

    # -- turns ----------------------------------------------------------------------------------------------------
    @redis_may_be_down
    async def take_turn_or_wait(self, what: str, pod: str, owner: str, interval_s: float) -> int:
        """Take the turn (0), or how many milliseconds the turn someone else took still runs."""
        key = self.keys.turn(what, pod)
        if await self.client.set(key, owner, nx=True, px=max(1, int(interval_s * 1000))):
            return 0
        return max(1, int(await self.client.pttl(key)))

    @redis_may_be_down
    async def release_turn(self, what: str, pod: str, owner: str) -> None:
        """Give back a turn ``owner`` took (its work did not happen): the next caller may take it at once."""
        await self._release(keys=[self.keys.turn(what, pod)], args=[owner])

    @redis_may_be_down
    async def take_turn(self, what: str, pod: str, owner: str, interval_s: float) -> bool:
        """True for one caller per ``interval_s`` and pod (periodic saves across replicas and restarts)."""
        taken = await self.client.set(self.keys.turn(what, pod), owner, nx=True, px=max(1, int(interval_s * 1000)))
        return bool(taken)

    # -- the replicas' membership ---------------------------------------------------------------------------------
    @redis_may_be_down
    async def replicas(self, owner: str, lease_s: float) -> list[str]:
        """Renew this replica's membership lease and return every replica whose lease stands (this one too)."""
        return [
            as_text(m) for m in await self._replicas(keys=[self.keys.replicas()], args=[owner, int(lease_s * 1000)])
        ]

    @redis_may_be_down
    async def leave_replicas(self, owner: str) -> None:
        await self.client.zrem(self.keys.replicas(), owner)
