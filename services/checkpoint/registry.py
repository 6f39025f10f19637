"""The session registry and checkpoint records in Redis (an adapter: the only module here that imports redis).

Keys, all under the root (``Subjects.redis_key``):

- ``kv:session:<sid>``        hash: pod, node, namespace, deployment, updated_at
- ``kv:node:<node>``          set of session ids on the node
- ``kv:pod:<pod>``            set of session ids the pod announced last
- ``kv:checkpoints:<sid>``    sorted set of committed checkpoint ids, scored by commit time
- ``kv:checkpoint:<cid>``     the committed checkpoint's summary (JSON)
- ``kv:drain:<drain_id>``     hash: node, state (running/completed/failed), verdict (JSON), started
- ``kv:drain:<drain_id>:lease`` who is running the drain now (expires, so a crashed runner's drain resumes)
- ``kv:restores``             stream of restore records
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.contract.checkpoint import AgentSessions, CommittedCheckpoint
from shared.contract.subjects import Subjects

# One announcement applied atomically. A session that moved to another pod (restored elsewhere) is not removed
# by its old pod's later announcement: only the pod that holds it may drop it.
_ANNOUNCE = """
local prefix, pod, node, ns, dep, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local podkey = prefix .. ':kv:pod:' .. pod
local fresh = {}
for i = 7, #ARGV do fresh[ARGV[i]] = true end
for _, sid in ipairs(redis.call('SMEMBERS', podkey)) do
  if not fresh[sid] then
    local skey = prefix .. ':kv:session:' .. sid
    if redis.call('HGET', skey, 'pod') == pod then
      local oldnode = redis.call('HGET', skey, 'node')
      redis.call('DEL', skey)
      if oldnode then redis.call('SREM', prefix .. ':kv:node:' .. oldnode, sid) end
    end
    redis.call('SREM', podkey, sid)
  end
end
for i = 7, #ARGV do
  local sid = ARGV[i]
  local skey = prefix .. ':kv:session:' .. sid
  local oldnode = redis.call('HGET', skey, 'node')
  if oldnode and oldnode ~= node then redis.call('SREM', prefix .. ':kv:node:' .. oldnode, sid) end
  local oldpod = redis.call('HGET', skey, 'pod')
  if oldpod and oldpod ~= pod then redis.call('SREM', prefix .. ':kv:pod:' .. oldpod, sid) end
  redis.call('HSET', skey, 'pod', pod, 'node', node, 'namespace', ns, 'deployment', dep, 'updated_at', now)
  redis.call('SADD', prefix .. ':kv:node:' .. node, sid)
  redis.call('SADD', podkey, sid)
end
return #ARGV - 6
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class SessionLocation:
    session_id: str
    pod: str
    node: str
    namespace: str
    deployment: str


class SessionRegistry:
    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.subjects = subjects
        self._announce = client.register_script(_ANNOUNCE)

    def _key(self, *parts: str) -> str:
        return self.subjects.redis_key("kv", *parts)

    async def apply_announcement(self, event: AgentSessions) -> None:
        await self._announce(
            keys=[self._key("pod", event.pod)],
            args=[
                self.subjects.root,
                event.pod,
                event.node,
                event.namespace,
                event.deployment,
                time.time(),
                *event.sessions,
            ],
        )

    async def sessions_on_node(self, node: str) -> list[SessionLocation]:
        sids = sorted(_text(s) for s in await self.client.smembers(self._key("node", node)))
        out = []
        for sid in sids:
            fields = await self.client.hgetall(self._key("session", sid))
            if fields and _text(fields.get(b"node", b"")) == node:
                out.append(
                    SessionLocation(
                        sid,
                        _text(fields[b"pod"]),
                        node,
                        _text(fields.get(b"namespace", b"")),
                        _text(fields.get(b"deployment", b"")),
                    )
                )
        return out

    async def record_checkpoint(self, committed: CommittedCheckpoint, store: str, pod: str, node: str) -> None:
        summary = {
            "session_id": committed.session_id,
            "checkpoint_id": committed.checkpoint_id,
            "bytes_total": committed.bytes_total,
            "bytes_written": committed.bytes_written,
            "token_count": committed.token_count,
            "store": store,
            "pod": pod,
            "node": node,
            "recorded_at": time.time(),
        }
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self._key("checkpoint", committed.checkpoint_id), json.dumps(summary))
            pipe.zadd(self._key("checkpoints", committed.session_id), {committed.checkpoint_id: time.time()})
            await pipe.execute()

    async def newest_checkpoint(self, session_id: str) -> dict[str, object] | None:
        newest = await self.client.zrevrange(self._key("checkpoints", session_id), 0, 0)
        if not newest:
            return None
        raw = await self.client.get(self._key("checkpoint", _text(newest[0])))
        return json.loads(raw) if raw else None

    async def forget_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zrem(self._key("checkpoints", session_id), checkpoint_id)
            pipe.delete(self._key("checkpoint", checkpoint_id))
            await pipe.execute()

    async def record_restore(self, session_id: str, checkpoint_id: str, pod: str, node: str) -> None:
        await self.client.xadd(
            self._key("restores"),
            {"session_id": session_id, "checkpoint_id": checkpoint_id, "pod": pod, "node": node},
            maxlen=100_000,
            approximate=True,
        )

    # -- drains ---------------------------------------------------------------------------------------------------
    async def drain_verdict(self, drain_id: str) -> dict[str, object] | None:
        raw = await self.client.hget(self._key("drain", drain_id), "verdict")
        return json.loads(raw) if raw else None

    async def take_drain(self, drain_id: str, node: str, owner: str, lease_s: float) -> bool:
        """Take the lease on running a drain; False while another runner holds it."""
        taken = await self.client.set(self._key("drain", drain_id, "lease"), owner, nx=True, px=int(lease_s * 1000))
        if taken:
            await self.client.hset(
                self._key("drain", drain_id), mapping={"node": node, "state": "running", "started": time.time()}
            )
        return bool(taken)

    async def finish_drain(self, drain_id: str, verdict: dict[str, object]) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(
                self._key("drain", drain_id), mapping={"state": str(verdict["state"]), "verdict": json.dumps(verdict)}
            )
            pipe.delete(self._key("drain", drain_id, "lease"))
            await pipe.execute()
