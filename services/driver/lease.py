"""The driver service's leader lease with fencing, in Redis.

The lease is a hash ``<root>:driver:leader`` (holder, token) with a TTL; every new holder takes the next value of
the counter ``<root>:driver:fence``, so tokens only grow. Taking and renewing are one Lua script each, atomic in
Redis. A lease does not by itself guarantee one actor (a paused holder may wake after its lease expired), so the
coordinator checks its token is still current before every write, stamps the token on the nodes it writes, and
writes a node only as a compare-and-set on the revision it read (``services.driver.coordinator``).

Redis can lose the counter (restarted without persistence, flushed, a failover that lost the last writes) while
the nodes keep the tokens stamped on them; a counter starting again from 1 would make every write of the new
leader look stale, for ever. So a new token is taken above a floor the caller reads from the cluster (the
highest token stamped on any node), and the counter is raised to it: a token is never handed out twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
import redis.exceptions

from shared.contract.subjects import Subjects
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import RedisSettings

from .ports import LeaseUnavailable, TokenFloor

# The holder renews and gets its token back; another holder's lease answers -1.
_HELD = """
local holder = redis.call('HGET', KEYS[1], 'holder')
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('HGET', KEYS[1], 'token'))
end
if holder then
  return -1
end
"""

_RENEW = _HELD + "return 0\n"

_TAKE = (
    _HELD
    + """
local token = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if token <= floor then
  token = floor + 1
  redis.call('SET', KEYS[2], token)
end
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"""
)

_RELEASE = """
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@contextmanager
def _answering() -> Iterator[None]:
    """Redis not answering is ``LeaseUnavailable``: temporary, the coordinator's next pass tries again."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise LeaseUnavailable(f"Redis does not answer: {type(exc).__name__}: {exc}") from exc


class RedisLeaderLease:
    """``LeaderLease`` in Redis. ``ttl_s`` should be a few times the renewal interval."""

    def __init__(self, client: aioredis.Redis, subjects: Subjects, holder: str, ttl_s: float = 10.0) -> None:
        self.client = client
        self.holder = holder
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._key = subjects.redis_key("driver", "leader")
        self._fence = subjects.redis_key("driver", "fence")
        self._renew = client.register_script(_RENEW)
        self._take = client.register_script(_TAKE)
        self._release = client.register_script(_RELEASE)

    async def acquire(self, floor: TokenFloor | None = None) -> int | None:
        """Renew the lease while this holder has it; when nobody does, read ``floor()`` and take a new token above
        it and above every token the counter gave before."""
        with _answering():
            token = int(await self._renew(keys=[self._key], args=[self.holder, self.ttl_ms]))
            if token != 0:
                return None if token < 0 else token
            least = await floor() if floor is not None else 0
            token = int(await self._take(keys=[self._key, self._fence], args=[self.holder, self.ttl_ms, least]))
        return None if token < 0 else token

    async def current_token(self) -> int:
        with _answering():
            raw = await self.client.hget(self._key, "token")
        return int(raw) if raw is not None else 0

    async def release(self) -> None:
        with _answering():
            await self._release(keys=[self._key], args=[self.holder])


def open_redis(settings: RedisSettings) -> aioredis.Redis:
    return redis_client(settings)
