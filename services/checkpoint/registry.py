"""The session registry and checkpoint records in Redis (an adapter: the only module here that imports redis).

Keys, all under the root (``Subjects.redis_key``):

- ``kv:session:<sid>``        hash: pod, node, namespace, deployment, generation, updated_at
- ``kv:generation:<sid>``     the session's newest generation handed out; only grows (kept a week after it ends)
- ``kv:sealed:<sid>``        hash: generation, checkpoint: the newest checkpoint the store held when that generation
  was claimed; a checkpoint of an older generation sorting after it was saved by a pod that had lost the session
- ``kv:incarnations:<pod>``  sorted set: the pod's agent's incarnations that a later one replaced (the last 16, a
  week): their announcements, sent again, change nothing
- ``kv:takes:<sid>``          hash: each take id -> the pod that made it and the generation it was given (a take
  sent again is answered the same; kept a week)
- ``kv:owner:<sid>``          the pod that took the newest generation (kept while it holds no blocks: it may end it)
- ``kv:onnode:<node>``        hash: every session placed on the node -> its pod (the node's index)
- ``kv:held:<pod>``           hash: every session the pod holds -> its generation (the pod's index)
- ``kv:pods``                 hash: every pod that announced -> its node
- ``kv:podinfo:<pod>``        hash: node, namespace, deployment, incarnation and seq of its last applied
  announcement, bytes held, leaving (its agent stopped)
- ``kv:alive:<pod>``          the pod's lease: present while its last announcement stands (expires after its
  ``ttl_s``); one key per pod, renewed by a heartbeat that costs the same whatever the pod holds
- ``kv:resync:<pod>:<inc>:<seq>`` the sessions of a full announcement in several parts, until its last part
- ``kv:checkpoints:<sid>``    sorted set of committed checkpoint ids, scored by (generation, sequence)
- ``kv:checkpoint:<cid>``     the committed checkpoint's summary (JSON)
- ``kv:drain:<drain_id>``     hash: node, state (running/completed/failed), started, verdict (the event's JSON)
- ``kv:drain:<drain_id>:lease`` who is running the drain now (short, renewed while it runs)
- ``kv:drain:<drain_id>:failed`` every failed session of a verdict too big for one event (JSON records)
- ``kv:turn:<what>:<pod>``    whose turn it is (periodic saves: one replica per interval and pod)
- ``kv:replicas``             sorted set: the checkpoint service's replicas alive -> when their lease ends (ms)
- ``kv:restores``             stream of restore records
- ``kv:last:<sid>``           hash: the session's last location change: sequence, reason, pod (the holder, or
  the last one), namespace, deployment (kept a week after it ends)
- ``kv:rewrite:<pod>``        set: sessions the pod holds whose next save writes every block again (a checkpoint of
  theirs lost a file: the scrub found it, or a save was refused for it); kept a week unless a full save clears it
- ``kv:scrub``                hash: the scrub's walk: cursor (of SCAN over ``kv:checkpoints:*``), run_id (of the
  Redis it walks: another one, a promotion or a restart, starts the walk again)

Cost follows change: an announcement carries what changed since the last one the registry applied (a delta), and
each script touches only the sessions it names and the indexes of their pod and node; a heartbeat renews one key.
Only a full announcement (an agent's start, or a resync after the registry lost what a delta builds on) walks a
pod's sessions, and only that pod's.

Ownership: a pod takes a session by claiming it (``claim``), which hands out the next generation. Only the
holder of the session's current generation moves it in the registry and gets its checkpoints recorded; an
announcement or a save of an older generation is stale and changes nothing. A claim never takes a session from
a pod that is alive (its lease stands and it is not leaving) unless the service found that pod gone from the
cluster, nor a session of another deployment: one pod cannot take, and then end, another's sessions.

Locations: each script that changes where a session's KV is (claimed, announced unplaced, restored, saved,
dropped, forgotten, ended) takes the session's next location sequence in the same step and returns the
location after the change, which the service publishes as ``kv.session.location``. A script that changes
nothing (a repeated announcement, a stale save, a checkpoint recorded twice) returns none: one event per change.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from shared.contract.checkpoint import AgentSessions, CommittedCheckpoint
from shared.contract.node import DrainOutcome
from shared.contract.sessions import SessionLocation, SessionRecord
from shared.contract.subjects import Subjects
from shared.kv.manifest import CheckpointManifest, checkpoint_order
from shared.plumbing.errors import TemporaryError
from shared.plumbing.replies import as_text

# The session's location, as one flat record (see ``_location``). With a ``reason`` it is a change: the
# session's next sequence is taken (strictly above the last, and at least the registry's clock in microseconds,
# so it keeps growing across a registry that lost its data) and the change remembered in ``kv:last:<sid>``.
# ``cid``: the checkpoint the change is about; '' for the newest recorded, '-' for none (an ended session's
# checkpoints are being retired; a query of an ended session names none either, even while they still exist).
_LOCATED = """
local function located(prefix, sid, reason, cid)
  local skey = prefix .. ':kv:session:' .. sid
  local lastkey = prefix .. ':kv:last:' .. sid
  local genkey = prefix .. ':kv:generation:' .. sid
  local cur = redis.call('HMGET', skey, 'pod', 'node', 'namespace', 'deployment')
  local last = redis.call('HMGET', lastkey, 'sequence', 'reason', 'pod', 'namespace', 'deployment')
  local ns = cur[3] or last[4] or ''
  local dep = cur[4] or last[5] or ''
  local prev = last[3] or ''
  local seq = last[1] or '0'
  if cid == '-' or (not reason and last[2] == 'ended') then
    cid = ''  -- an ended session's checkpoints are being retired: none is offered, even before they are gone
  elseif cid == '' then
    cid = redis.call('ZREVRANGE', prefix .. ':kv:checkpoints:' .. sid, 0, 0)[1] or ''
  end
  local tokens = '0'
  if cid ~= '' then
    local summary = redis.call('GET', prefix .. ':kv:checkpoint:' .. cid)
    if summary then tokens = string.format('%.0f', cjson.decode(summary)['token_count'] or 0) end
  end
  if reason then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    seq = string.format('%.0f', math.max(tonumber(seq) + 1, now))
    redis.call('HSET', lastkey, 'sequence', seq, 'reason', reason, 'pod', cur[1] or prev, 'namespace', ns,
      'deployment', dep)
  else
    reason = last[2]
    if not reason then
      if cur[1] then reason = 'placed'
      elseif cid ~= '' or redis.call('EXISTS', genkey) == 1 then reason = 'dropped'
      else reason = 'unknown' end
    end
  end
  if cur[1] == prev then prev = '' end
  return {sid, reason, seq, cur[1] and '1' or '', cur[1] or '', cur[2] or '', ns, dep,
    redis.call('GET', genkey) or '0', prev, cid, tokens}
end
"""

# Places the session on the pod under ``gen``; returns whether that moved it (another pod, another generation,
# or not placed before). Nothing is written when it is already placed so.
_MOVE = """
local function move(prefix, sid, pod, node, ns, dep, gen, now)
  local skey = prefix .. ':kv:session:' .. sid
  local old = redis.call('HMGET', skey, 'node', 'pod', 'generation')
  local oldnode, oldpod = old[1], old[2]
  if oldpod == pod and oldnode == node and tonumber(old[3]) == tonumber(gen) then return false end
  if oldnode and oldnode ~= node then redis.call('HDEL', prefix .. ':kv:onnode:' .. oldnode, sid) end
  if oldpod and oldpod ~= pod then redis.call('HDEL', prefix .. ':kv:held:' .. oldpod, sid) end
  redis.call('HSET', skey, 'pod', pod, 'node', node, 'namespace', ns, 'deployment', dep, 'generation', gen,
    'updated_at', now)
  redis.call('HSET', prefix .. ':kv:onnode:' .. node, sid, pod)
  redis.call('HSET', prefix .. ':kv:held:' .. pod, sid, gen)
  redis.call('SET', prefix .. ':kv:owner:' .. sid, pod)
  return oldpod ~= pod or tonumber(old[3]) ~= tonumber(gen)
end

-- The pod no longer holds the session: it leaves the pod's index, and the registry when the pod placed it.
local function drop(prefix, sid, pod)
  local skey = prefix .. ':kv:session:' .. sid
  local cur = redis.call('HMGET', skey, 'pod', 'node')
  local held = cur[1] == pod
  if held then
    redis.call('DEL', skey)
    if cur[2] then redis.call('HDEL', prefix .. ':kv:onnode:' .. cur[2], sid) end
  end
  redis.call('HDEL', prefix .. ':kv:held:' .. pod, sid)
  return held
end
"""

# One announcement (full or delta) applied atomically. ARGV = prefix, pod, node, ns, dep, now, ttl_ms, incarnation, seq,
# full, part, parts, leaving, bytes, n_ended, n_dropped, the ended sessions, the dropped ones, then (sid, generation)
# pairs. A session announced under an older generation than the newest handed out has moved on: stale, ignored and
# returned. So is one announced under the current generation while another pod that is alive (its lease stands, it is
# not leaving) holds the session under that same generation: only a claim the registry lost in a Redis failover hands
# one generation out twice, and the pod placed first keeps it. A newer one than the registry knows (it lost its data)
# raises the counter: never handed out again. An ended session whose newest generation the pod took (held now, or
# dropped since, as after a preemption) leaves the registry and is returned as retired. A numbered delta that does not
# follow what the registry applied last for the pod (another incarnation, a gap: writes lost), or a heartbeat whose
# number is not the one applied last (the last delta was lost), is applied and answered ``resync``. Returns (stale,
# retired, the locations that changed, resync).
_ANNOUNCE = (
    _LOCATED
    + _MOVE
    + """
local function held_by_another(prefix, sid, pod, gen)
  local cur = redis.call('HMGET', prefix .. ':kv:session:' .. sid, 'pod', 'generation')
  local holder = cur[1]
  if not holder or holder == pod or tonumber(cur[2]) ~= gen then return false end
  return redis.call('EXISTS', prefix .. ':kv:alive:' .. holder) == 1
    and redis.call('HGET', prefix .. ':kv:podinfo:' .. holder, 'leaving') ~= '1'
end
local prefix, pod, node, ns, dep, now, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local incarnation, seq, full = ARGV[8], tonumber(ARGV[9]), ARGV[10] == '1'
local part, parts, leaving, bytes = tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13] == '1', ARGV[14]
local monotonic = ARGV[17] == '1'
local first_dropped = 18 + tonumber(ARGV[15])
local first_pair = first_dropped + tonumber(ARGV[16])
local infokey = prefix .. ':kv:podinfo:' .. pod
local heldkey = prefix .. ':kv:held:' .. pod
local info = redis.call('HMGET', infokey, 'incarnation', 'seq')
local known = tonumber(info[2] or '-1')
-- a message of an incarnation that a later one replaced, or (from an agent that numbers monotonically) numbered
-- below the last one applied, is a late duplicate or a replay: it changes nothing (not even the lease)
local past = prefix .. ':kv:incarnations:' .. pod
if incarnation ~= '' and redis.call('ZSCORE', past, incarnation) then return {{}, {}, {}, 1} end
if monotonic and seq > 0 and info[1] == incarnation and seq < known then return {{}, {}, {}, 1} end
if incarnation ~= '' and info[1] and info[1] ~= incarnation then
  redis.call('ZADD', past, now, info[1])
  redis.call('ZREMRANGEBYRANK', past, 0, -17)
  redis.call('PEXPIRE', past, 604800000)
end
local resync = 0
-- a delta follows what was applied last (or repeats it: its answer was lost); a heartbeat repeats it exactly
local heartbeat = #ARGV == 17
if seq > 0 and not full and (info[1] ~= incarnation or known < seq - 1 or known > seq or (heartbeat and known ~= seq))
then resync = 1 end
local retired, changes, stale = {}, {}, {}
for i = 18, first_dropped - 1 do
  local sid = ARGV[i]
  local ownerkey = prefix .. ':kv:owner:' .. sid
  if redis.call('GET', ownerkey) == pod then
    drop(prefix, sid, pod)
    redis.call('DEL', ownerkey)
    redis.call('PEXPIRE', prefix .. ':kv:generation:' .. sid, 604800000)
    redis.call('PEXPIRE', prefix .. ':kv:sealed:' .. sid, 604800000)
    table.insert(retired, sid)
    table.insert(changes, located(prefix, sid, 'ended', '-'))
    redis.call('PEXPIRE', prefix .. ':kv:last:' .. sid, 604800000)
  else
    redis.call('HDEL', heldkey, sid)
  end
end
for i = first_dropped, first_pair - 1 do
  if drop(prefix, ARGV[i], pod) then table.insert(changes, located(prefix, ARGV[i], 'dropped', '')) end
end
local fresh = {}
for i = first_pair, #ARGV, 2 do
  local sid, gen = ARGV[i], tonumber(ARGV[i + 1])
  fresh[sid] = true
  local genkey = prefix .. ':kv:generation:' .. sid
  local current = tonumber(redis.call('GET', genkey) or '0')
  if gen < current or (gen == current and held_by_another(prefix, sid, pod, gen)) then
    table.insert(stale, sid)
    redis.call('HDEL', heldkey, sid)
  else
    if gen > current then redis.call('SET', genkey, gen) end
    if move(prefix, sid, pod, node, ns, dep, gen, now) then
      table.insert(changes, located(prefix, sid, 'placed', ''))
    end
  end
end
if full then
  local setkey = prefix .. ':kv:resync:' .. pod .. ':' .. incarnation .. ':' .. seq
  if parts > 1 and first_pair <= #ARGV then
    local sids = {}
    for i = first_pair, #ARGV, 2 do table.insert(sids, ARGV[i]) end
    redis.call('SADD', setkey, unpack(sids))
    redis.call('PEXPIRE', setkey, 600000)
  end
  if part == parts - 1 then
    for _, sid in ipairs(redis.call('HKEYS', heldkey)) do
      if not fresh[sid] and (parts == 1 or redis.call('SISMEMBER', setkey, sid) == 0) and drop(prefix, sid, pod) then
        table.insert(changes, located(prefix, sid, 'dropped', ''))
      end
    end
    redis.call('DEL', setkey)
    if seq > 0 then redis.call('HSET', infokey, 'incarnation', incarnation, 'seq', seq) end
    redis.call('HDEL', infokey, 'leaving')
  end
elseif seq > 0 and resync == 0 and seq > known then
  redis.call('HSET', infokey, 'seq', seq)
end
redis.call('HSET', infokey, 'node', node, 'namespace', ns, 'deployment', dep, 'bytes', bytes)
redis.call('HSET', prefix .. ':kv:pods', pod, node)
if leaving then
  redis.call('HSET', infokey, 'leaving', '1')
  redis.call('DEL', prefix .. ':kv:alive:' .. pod)
else
  redis.call('SET', prefix .. ':kv:alive:' .. pod, now, 'PX', ttl)
end
return {stale, retired, changes, resync}
"""
)

# ARGV = prefix, sid, pod, node, ns, dep, now, floor, force, sealed, seal, take: the next generation, above
# ``floor`` (the newest generation the store holds checkpoints of: a registry that lost its data never hands out a
# generation twice). With ``sealed`` ('1': the store was listed), ``seal`` is the newest checkpoint it held ('' for
# none), kept with the generation in ``kv:sealed:<sid>``. ``take`` ('' for none: an older agent) names the take:
# one this pod made before (``kv:takes:<sid>``) is answered with the generation it was given, changing nothing, so a
# retried, duplicated or replayed take never moves the session on under its holder.
# Refused, with nothing changed, when another pod holds the session and is alive (its lease stands and it is not
# leaving) unless ``force`` (the service found that pod gone from the cluster), or when the session belongs to
# another deployment. Returns (generation or 0, the new location, why refused, the holder, the holder's node).
_CLAIM = (
    _LOCATED
    + _MOVE
    + """
local prefix, sid, pod, node, ns, dep, now, floor = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
  tonumber(ARGV[8])
local force = ARGV[9] == '1'
local take, takes = ARGV[12], prefix .. ':kv:takes:' .. sid
if take ~= '' then
  local given = redis.call('HGET', takes, take)
  if given then
    local sep = string.find(given, ' ', 1, true)
    if string.sub(given, 1, sep - 1) == pod then return {tonumber(string.sub(given, sep + 1)), {}, '', '', ''} end
    return {0, {}, 'take', '', ''}
  end
end
local cur = redis.call('HMGET', prefix .. ':kv:session:' .. sid, 'pod', 'node', 'namespace', 'deployment')
local holder = cur[1]
if holder and holder ~= pod and not force and redis.call('EXISTS', prefix .. ':kv:alive:' .. holder) == 1
  and redis.call('HGET', prefix .. ':kv:podinfo:' .. holder, 'leaving') ~= '1' then
  return {0, {}, 'held', holder, cur[2] or ''}
end
local last = redis.call('HMGET', prefix .. ':kv:last:' .. sid, 'namespace', 'deployment')
local sns, sdep = cur[3] or last[1] or '', cur[4] or last[2] or ''
if dep ~= '' and sdep ~= '' and (sns ~= ns or sdep ~= dep) then
  return {0, {}, 'deployment', sns .. '/' .. sdep, ''}
end
local genkey = prefix .. ':kv:generation:' .. sid
if tonumber(redis.call('GET', genkey) or '0') < floor then redis.call('SET', genkey, floor) end
local gen = redis.call('INCR', genkey)
if ARGV[10] == '1' then
  redis.call('HSET', prefix .. ':kv:sealed:' .. sid, 'generation', gen, 'checkpoint', ARGV[11])
end
if take ~= '' then
  redis.call('HSET', takes, take, pod .. ' ' .. gen)
  redis.call('PEXPIRE', takes, 604800000)
end
move(prefix, sid, pod, node, ns, dep, gen, now)
return {gen, located(prefix, sid, 'placed', ''), '', '', ''}
"""
)

# ARGV = prefix, sid, cid, generation, pod, summary, score. Records a checkpoint only from the holder of the
# session's current generation; otherwise returns why not. Returns (why not, the location when it changed, the
# outcome): 'recorded' (anew), 'duplicate' (recorded before: a report sent again or replayed changes nothing and is
# answered as committed, whoever holds the session now), 'refused' (kept: it may be what someone else committed,
# e.g. the seal of the holder's generation, which a restore may have taken), 'stale' (refused, and provably a save
# nobody may take for committed: of the holder's generation by another pod, or of an older generation sorting
# after the current generation's seal, i.e. saved after that claim by a pod that had lost the session; the same
# two fences as ``_REPAIR``). Only a 'stale' checkpoint may be deleted by the refusal.
_RECORD = (
    _LOCATED
    + """
local prefix, sid, cid, gen, pod = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local zkey = prefix .. ':kv:checkpoints:' .. sid
if redis.call('ZSCORE', zkey, cid) then return {'', {}, 'duplicate'} end
local genkey = prefix .. ':kv:generation:' .. sid
local current = tonumber(redis.call('GET', genkey) or '0')
local skey = prefix .. ':kv:session:' .. sid
local cur = redis.call('HMGET', skey, 'pod', 'generation')
local holder, held = cur[1], tonumber(cur[2] or '-1')
local why = nil
if gen < current then
  why = 'generation ' .. current .. ' of the session is held by pod ' .. (holder or '(none now)')
elseif gen > 0 and gen == current and holder and holder ~= pod and held == gen then
  why = 'generation ' .. gen .. ' of the session is held by pod ' .. holder
end
if why then
  local seal = redis.call('HMGET', prefix .. ':kv:sealed:' .. sid, 'generation', 'checkpoint')
  local sealed = tonumber(seal[1] or '-1') == current and seal[2]
  if (holder and gen == held and pod ~= holder) or (sealed and gen < current and cid > sealed) then
    return {why, {}, 'stale'}
  end
  return {why, {}, 'refused'}
end
if gen > current then redis.call('SET', genkey, gen) end
redis.call('SET', prefix .. ':kv:checkpoint:' .. cid, ARGV[6])
if redis.call('ZADD', zkey, ARGV[7], cid) == 1 then
  redis.call('SADD', prefix .. ':kv:retention:changed', sid)
  return {'', located(prefix, sid, 'saved', cid), 'recorded'}
end
return {'', {}, 'duplicate'}
"""
)

# ARGV = prefix, pod. Forget a pod that is gone: its sessions leave the registry (their checkpoints stay).
# Returns the locations that changed.
_FORGET = (
    _LOCATED
    + _MOVE
    + """
local prefix, pod = ARGV[1], ARGV[2]
local heldkey = prefix .. ':kv:held:' .. pod
local changes = {}
for _, sid in ipairs(redis.call('HKEYS', heldkey)) do
  if drop(prefix, sid, pod) then table.insert(changes, located(prefix, sid, 'forgotten', '')) end
end
redis.call('DEL', heldkey, prefix .. ':kv:podinfo:' .. pod, prefix .. ':kv:alive:' .. pod,
  prefix .. ':kv:rewrite:' .. pod)
redis.call('HDEL', prefix .. ':kv:pods', pod)
return changes
"""
)

# ARGV = prefix, sid, pod, generation, cid: the holder of ``generation`` restored ``cid``; a change when the pod
# still holds that generation (after a later claim the report is stale) and had not reported it (a repeat).
_RESTORED = (
    _LOCATED
    + """
local prefix, sid, pod, gen, cid = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local f = redis.call('HMGET', prefix .. ':kv:session:' .. sid, 'pod', 'generation')
if f[1] ~= pod or tonumber(f[2]) ~= gen then return {} end
if redis.call('HGET', prefix .. ':kv:last:' .. sid, 'reason') == 'restored' then return {} end
return located(prefix, sid, 'restored', cid)
"""
)

# ARGV = prefix, sid: the session's location now (no change).
_WHERE = (
    _LOCATED
    + """
return located(ARGV[1], ARGV[2], nil, '')
"""
)

# KEYS = [replicas], ARGV = owner, lease_ms: renew the owner's membership, drop the lapsed, list who is left.
_REPLICAS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

# ARGV = prefix, sid, then (cid, score, generation, pod, summary) for each checkpoint: records checkpoints the
# store holds and the registry lost (a Redis failover), without the fence of ``_RECORD`` (the store is the last
# word on what was committed), and raises the generation counter to the newest of them. Two fences are kept, for
# saves refused as stale whose files are not deleted yet: a checkpoint of the generation the session's holder has
# now written by another pod (or by the other holder of a generation a lost claim handed out twice), and one of an
# older generation than the current one sorting after the current generation's seal (saved after that claim, by a
# pod that had lost the session; checkpoint ids sort by (generation, sequence) as strings). Fenced ones are not
# recorded. Returns (the ids recorded anew, the ids fenced).
_REPAIR = """
local prefix, sid = ARGV[1], ARGV[2]
local zkey = prefix .. ':kv:checkpoints:' .. sid
local genkey = prefix .. ':kv:generation:' .. sid
local cur = redis.call('HMGET', prefix .. ':kv:session:' .. sid, 'pod', 'generation')
local holder, held = cur[1], tonumber(cur[2] or '-1')
local current = tonumber(redis.call('GET', genkey) or '0')
local seal = redis.call('HMGET', prefix .. ':kv:sealed:' .. sid, 'generation', 'checkpoint')
local sealed = tonumber(seal[1] or '-1') == current and seal[2]
local added, fenced = {}, {}
for i = 3, #ARGV, 5 do
  local cid, gen, pod = ARGV[i], tonumber(ARGV[i + 2]), ARGV[i + 3]
  if (holder and gen == held and pod ~= holder) or (sealed and gen < current and cid > sealed) then
    table.insert(fenced, cid)
  else
    if not redis.call('ZSCORE', zkey, cid) then
      redis.call('SET', prefix .. ':kv:checkpoint:' .. cid, ARGV[i + 4])
      redis.call('ZADD', zkey, ARGV[i + 1], cid)
      redis.call('SADD', prefix .. ':kv:retention:changed', sid)
      table.insert(added, cid)
    end
    if tonumber(redis.call('GET', genkey) or '0') < gen then redis.call('SET', genkey, gen) end
  end
end
return {added, fenced}
"""

# KEYS = the session's checkpoints, the aging index; ARGV = cid, the aging member. Forget a checkpoint that
# retention doomed unless it is the session's newest recorded one (a newer one was forgotten meanwhile, as a
# restore forgets a corrupt one): the check and the forgetting are one step. 1 when forgotten (or never recorded).
_RETIRE_OLDER = """
local newest = redis.call('ZREVRANGE', KEYS[1], 0, 0)[1]
redis.call('ZREM', KEYS[2], ARGV[2])
if newest == ARGV[1] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
"""

# KEYS = the session's checkpoints; ARGV = prefix, sid, cid, keep_newest. The scrub found the recorded checkpoint's
# files gone or damaged: the pod holding the session is marked for a full next save (``kv:rewrite:<pod>``), and the
# record is forgotten (with its summary and its place in retention's aging index), unless ``keep_newest`` ('1') and
# it is the session's newest. Nothing when it is no longer recorded (retention forgot it meanwhile). Returns
# (forgotten 0/1, it is or was the newest 0/1, the holder or '').
_FORGET_LOST = """
local prefix, sid, cid = ARGV[1], ARGV[2], ARGV[3]
if not redis.call('ZSCORE', KEYS[1], cid) then return {0, 0, ''} end
local newest = redis.call('ZREVRANGE', KEYS[1], 0, 0)[1] == cid
local holder = redis.call('HGET', prefix .. ':kv:session:' .. sid, 'pod')
if holder then
  redis.call('SADD', prefix .. ':kv:rewrite:' .. holder, sid)
  redis.call('PEXPIRE', prefix .. ':kv:rewrite:' .. holder, 604800000)
end
if newest and ARGV[4] == '1' then return {0, 1, holder or ''} end
redis.call('ZREM', KEYS[1], cid)
redis.call('DEL', prefix .. ':kv:checkpoint:' .. cid)
redis.call('ZREM', prefix .. ':kv:retention:aging', sid .. '/' .. cid)
return {1, newest and 1 or 0, holder or ''}
"""

# ARGV = prefix. Per pod the registry knows: its sessions, its node, its namespace/deployment, and whether its
# lease stands, as one JSON document: one command and one reply, however many pods (a pipeline of three commands
# a pod cost a reply to parse per command: most of a large fleet's summary).
_SUMMARY = """
local prefix = ARGV[1]
local pods = redis.call('HGETALL', prefix .. ':kv:pods')
local by_pod, nodes, deployments, alive = {}, {}, {}, {}
for i = 1, #pods, 2 do
  local pod = pods[i]
  nodes[pod] = pods[i + 1]
  by_pod[pod] = redis.call('HLEN', prefix .. ':kv:held:' .. pod)
  local info = redis.call('HMGET', prefix .. ':kv:podinfo:' .. pod, 'namespace', 'deployment')
  deployments[pod] = (info[1] or '') .. '/' .. (info[2] or '')
  if redis.call('EXISTS', prefix .. ':kv:alive:' .. pod) == 1 then table.insert(alive, pod) end
end
return cjson.encode({by_pod = by_pod, nodes = nodes, deployments = deployments, alive = alive})
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_FINISH = """
if redis.call('HEXISTS', KEYS[1], 'verdict') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'verdict', ARGV[2], 'duration_s', ARGV[3])
redis.call('DEL', KEYS[2])
return 1
"""

_SEQUENCE_SPAN = 2**32


P = ParamSpec("P")
R = TypeVar("R")


def _redis_may_be_down(method: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Redis unreachable is a temporary failure of the caller (retried, or answered "temporary"), said in one
    line rather than a stack trace per announcement while it is down."""

    @functools.wraps(method)
    async def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise TemporaryError(f"session registry: Redis unreachable ({exc})", delay=1.0) from exc

    return guarded


def checkpoint_score(generation: int, sequence: int) -> float:
    """(generation, sequence) as one sorted-set score, exact while generation < 2**21."""
    return float(generation * _SEQUENCE_SPAN + sequence)


def _location(raw: list[Any]) -> SessionLocation:
    """A location record of ``_LOCATED`` as the event a router reads."""
    sid, reason, seq, held, pod, node, ns, dep, gen, prev, cid, tokens = (as_text(v) for v in raw)
    return SessionLocation(
        session_id=sid,
        sequence=int(seq),
        reason=reason,
        held=held == "1",
        pod=pod,
        node=node,
        namespace=ns,
        deployment=dep,
        generation=int(gen),
        token_count=int(tokens),
        checkpoint_id=cid,
        previous_pod=prev,
    )


@dataclass(frozen=True)
class SessionPlace:
    """Where the registry places a session (its pod's view); ``SessionLocation`` is the routers' view."""

    session_id: str
    pod: str
    node: str
    namespace: str
    deployment: str
    generation: int = 0


@dataclass(frozen=True)
class Applied:
    """What one announcement changed: sessions announced under a generation that moved on (stale), ended ones
    whose checkpoints are to be retired, the locations that changed, and whether the agent must resync."""

    stale: list[str]
    retired: list[str]
    changes: list[SessionLocation]
    resync: bool = False


@dataclass(frozen=True)
class Repaired:
    """What a repair did with the store's checkpoints the registry lacked: recorded anew, or fenced (a stale save not
    deleted yet: another pod's checkpoint of the generation the session's holder has now, or an older generation's
    sorting after the current generation's seal; see ``_REPAIR``)."""

    added: list[str]
    fenced: list[str]


@dataclass(frozen=True)
class Recording:
    """What recording one reported checkpoint decided (``_RECORD``). ``outcome``: ``recorded`` (anew: ``location``
    is the session's new location), ``duplicate`` (recorded before: a report sent again or replayed, answered as
    committed and changing nothing), ``refused`` (``refused`` says why; kept, since it may be what someone else
    committed, such as the seal a new holder restored from) or ``stale`` (refused, and a save nobody may take for
    committed: the refusal may delete it)."""

    refused: str
    location: SessionLocation | None
    outcome: str

    @property
    def deletable(self) -> bool:
        return self.outcome == "stale"

    @property
    def first_time(self) -> bool:
        return self.outcome == "recorded"


@dataclass(frozen=True)
class Forgotten:
    """What the scrub's forgetting of a lost checkpoint did: ``forgotten`` (False: retention forgot it first, or it
    is the newest and was kept), whether it is or was the session's ``newest``, and the ``holder`` marked for a full
    next save ('' when no pod holds the session)."""

    forgotten: bool
    newest: bool
    holder: str


@dataclass(frozen=True)
class Claim:
    """A claim's outcome: the generation handed out and the session's new location, or why it was refused
    (``held``: ``holder`` on ``holder_node`` is alive and holds it; ``deployment``: it belongs to ``holder``)."""

    generation: int
    location: SessionLocation | None
    refused: str = ""
    holder: str = ""
    holder_node: str = ""


@dataclass(frozen=True)
class FleetCounts:
    """Sessions per pod, each pod's node and deployment (``namespace/name``), and the pods whose lease stands."""

    by_pod: dict[str, int]
    nodes: dict[str, str]
    deployments: dict[str, str]
    alive: list[str]


class SessionRegistry:
    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.subjects = subjects
        self._announce = client.register_script(_ANNOUNCE)
        self._claim = client.register_script(_CLAIM)
        self._record = client.register_script(_RECORD)
        self._forget = client.register_script(_FORGET)
        self._renew = client.register_script(_RENEW)
        self._finish = client.register_script(_FINISH)
        self._restored = client.register_script(_RESTORED)
        self._where = client.register_script(_WHERE)
        self._replicas = client.register_script(_REPLICAS)
        self._repair = client.register_script(_REPAIR)
        self._release = client.register_script(_RELEASE)
        self._retire_older = client.register_script(_RETIRE_OLDER)
        self._summary = client.register_script(_SUMMARY)
        self._forget_lost = client.register_script(_FORGET_LOST)

    def _key(self, *parts: str) -> str:
        return self.subjects.redis_key("kv", *parts)

    # -- ownership and location ----------------------------------------------------------------------------------
    @_redis_may_be_down
    async def apply_announcement(self, event: AgentSessions) -> Applied:
        """Apply one announcement (full or delta; see ``_ANNOUNCE``): what it touches is what it names."""
        generations = event.generations if len(event.generations) == len(event.sessions) else [0] * len(event.sessions)
        pairs: list[str | int | float] = [
            v for sid, gen in zip(event.sessions, generations, strict=True) for v in (sid, gen)
        ]
        ttl_ms = int(max(1.0, event.ttl_s or 30.0) * 1000)
        head: list[str | int | float] = [
            self.subjects.root,
            event.pod,
            event.node,
            event.namespace,
            event.deployment,
            time.time(),
            ttl_ms,
            event.incarnation,
            event.seq,
            "1" if event.full else "0",
            event.part,
            max(1, event.parts),
            "1" if event.leaving else "0",
            event.bytes_held,
            len(event.ended),
            len(event.dropped),
            "1" if event.monotonic else "0",
        ]
        stale, retired, changes, resync = await self._announce(
            keys=[self._key("held", event.pod)], args=[*head, *event.ended, *event.dropped, *pairs]
        )
        return Applied(
            [as_text(s) for s in stale], [as_text(s) for s in retired], [_location(c) for c in changes], bool(resync)
        )

    @_redis_may_be_down
    async def claim(
        self,
        session_id: str,
        pod: str,
        node: str,
        namespace: str,
        deployment: str,
        floor: int,
        force: bool = False,
        seal: str | None = None,
        take: str = "",
    ) -> Claim:
        """The pod takes the session: its next generation (above ``floor``), and the registry places it there.
        Refused (nothing changed) while another pod that is alive holds it, unless ``force``, or when it belongs
        to another deployment. ``seal``: the newest checkpoint the store held as the claim was decided ('' for
        none; None when the store could not be listed), kept as the new generation's seal. ``take``: the take's
        id; a take this pod made before is answered with the generation it was given (``location`` None: nothing
        changed), and another pod's take id is refused (``take``)."""
        generation, location, refused, holder, holder_node = await self._claim(
            keys=[self._key("generation", session_id)],
            args=[
                self.subjects.root,
                *(session_id, pod, node, namespace, deployment, time.time(), floor, int(force)),
                *(("1", seal) if seal is not None else ("0", "")),
                take,
            ],
        )
        if refused:
            return Claim(0, None, as_text(refused), as_text(holder), as_text(holder_node))
        return Claim(int(generation), _location(location) if location else None)

    @_redis_may_be_down
    async def note_restored(
        self, session_id: str, pod: str, generation: int, checkpoint_id: str
    ) -> SessionLocation | None:
        """``pod`` restored ``checkpoint_id`` under ``generation``: the new location, or None when the pod no
        longer holds that generation (the report is stale)."""
        raw = await self._restored(
            keys=[self._key("session", session_id)],
            args=[self.subjects.root, session_id, pod, generation, checkpoint_id],
        )
        return _location(raw) if raw else None

    @_redis_may_be_down
    async def where(self, session_id: str) -> SessionLocation:
        """The session's location now; ``reason`` ``"unknown"`` and sequence 0 when the registry never saw it."""
        return _location(
            await self._where(keys=[self._key("session", session_id)], args=[self.subjects.root, session_id])
        )

    @_redis_may_be_down
    async def generation(self, session_id: str) -> int:
        raw = await self.client.get(self._key("generation", session_id))
        return int(raw) if raw is not None else 0

    @_redis_may_be_down
    async def sessions_on_node(self, node: str) -> list[SessionPlace]:
        """The sessions placed on the node (its index, then each one's record): what a drain of it reads."""
        sids = sorted(as_text(s) for s in await self.client.hkeys(self._key("onnode", node)))
        if not sids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for sid in sids:
                pipe.hmget(self._key("session", sid), "pod", "node", "namespace", "deployment", "generation")
            rows = await pipe.execute()
        out = []
        for sid, (pod, where, ns, dep, gen) in zip(sids, rows, strict=True):
            if pod is not None and as_text(where) == node:
                out.append(
                    SessionPlace(sid, as_text(pod), node, as_text(ns or b""), as_text(dep or b""), int(gen or 0))
                )
        return out

    @_redis_may_be_down
    async def sessions_of_pod(self, pod: str) -> dict[str, int]:
        """The sessions the pod holds -> the generation it holds each under (its index: one read)."""
        return {as_text(k): int(v) for k, v in (await self.client.hgetall(self._key("held", pod))).items()}

    @_redis_may_be_down
    async def pods(self) -> dict[str, str]:
        """Every pod the registry knows -> its node."""
        return {as_text(k): as_text(v) for k, v in (await self.client.hgetall(self._key("pods"))).items()}

    @_redis_may_be_down
    async def silent_pods(self, known: dict[str, str] | None = None) -> dict[str, str]:
        """Pods whose last announcement no longer stands -> their node (of ``known``, when the caller has read
        the pods already)."""
        known = await self.pods() if known is None else known
        if not known:
            return {}
        alive = await self.client.mget([self._key("alive", p) for p in known])
        return {pod: node for (pod, node), flag in zip(known.items(), alive, strict=True) if flag is None}

    @_redis_may_be_down
    async def forget_pod(self, pod: str) -> list[SessionLocation]:
        """The pod's sessions leave the registry; returns their locations now (held by nothing)."""
        return [_location(c) for c in await self._forget(keys=[self._key("pod", pod)], args=[self.subjects.root, pod])]

    @_redis_may_be_down
    async def summary(self) -> FleetCounts:
        """Session counts per pod, node and deployment, and which pods are alive: one script reading per pod,
        never per session (``_SUMMARY``)."""
        found = json.loads(await self._summary(keys=[self._key("pods")], args=[self.subjects.root]))

        def table(name: str) -> dict[str, Any]:
            value = found.get(name)
            return value if isinstance(value, dict) else {}  # Lua's JSON writes an empty table as {}

        alive = found.get("alive")
        return FleetCounts(
            {pod: int(n) for pod, n in table("by_pod").items()},
            {pod: str(node) for pod, node in table("nodes").items()},
            {pod: str(dep) for pod, dep in table("deployments").items()},
            sorted(str(p) for p in alive) if isinstance(alive, list) else [],
        )

    @_redis_may_be_down
    async def sessions_page(
        self, *, node: str = "", pod: str = "", cursor: str = "", limit: int = 200
    ) -> tuple[list[SessionRecord], str, int | None]:
        """A page of sessions with their newest checkpoint: of a node (its index) or of a pod (its index); one of
        them is named. Returns (records, the next cursor or '', the index's size)."""
        if not (node or pod):
            raise ValueError("a page of sessions is read from a node's or a pod's index: name one")
        position = int(cursor) if cursor.isdigit() else 0
        index = self._key("onnode", node) if node else self._key("held", pod)
        position, found = await self.client.hscan(index, position, count=limit)
        sids = [as_text(k) for k in found]
        total = int(await self.client.hlen(index))
        records = await self._records(sids)
        if pod:
            records = [r for r in records if r.pod == pod]
        return records, (str(position) if position else ""), total

    async def _records(self, sids: list[str]) -> list[SessionRecord]:
        if not sids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for sid in sids:
                pipe.hmget(self._key("session", sid), "pod", "node", "namespace", "deployment", "generation")
                pipe.zrevrange(self._key("checkpoints", sid), 0, 0)
            replies = await pipe.execute()
        newest = {sid: as_text(replies[2 * i + 1][0]) for i, sid in enumerate(sids) if replies[2 * i + 1]}
        summaries = (
            dict(
                zip(newest, await self.client.mget([self._key("checkpoint", c) for c in newest.values()]), strict=True)
            )
            if newest
            else {}
        )
        out = []
        for i, sid in enumerate(sids):
            pod, node, ns, dep, gen = replies[2 * i]
            if pod is None:
                continue  # ended or dropped since the index was read
            summary: dict[str, Any] = {}
            raw = summaries.get(sid)
            if raw:
                with contextlib.suppress(ValueError):
                    summary = json.loads(raw)
            out.append(
                SessionRecord(
                    session_id=sid,
                    pod=as_text(pod),
                    node=as_text(node or b""),
                    namespace=as_text(ns or b""),
                    deployment=as_text(dep or b""),
                    generation=int(gen or 0),
                    checkpoint_id=newest.get(sid, ""),
                    checkpoint_at=summary.get("recorded_at"),
                    bytes=int(summary.get("bytes_total", 0)),
                    tokens=int(summary.get("token_count", 0)),
                )
            )
        return out

    @_redis_may_be_down
    async def replicas(self, owner: str, lease_s: float) -> list[str]:
        """Renew this replica's membership lease and return every replica whose lease stands (this one too)."""
        return [
            as_text(m) for m in await self._replicas(keys=[self._key("replicas")], args=[owner, int(lease_s * 1000)])
        ]

    @_redis_may_be_down
    async def leave_replicas(self, owner: str) -> None:
        await self.client.zrem(self._key("replicas"), owner)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    @_redis_may_be_down
    async def record_checkpoint(self, committed: CommittedCheckpoint, store: str, pod: str, node: str) -> Recording:
        """Record a committed checkpoint when ``pod`` holds the session's current generation; else say why not
        (and record nothing). See ``Recording``: a checkpoint recorded before is a duplicate, whoever holds the
        session now; a refused one is deletable only when it is provably stale."""
        return (await self.record_checkpoints([committed], store, pod, node))[0]

    @_redis_may_be_down
    async def record_checkpoints(
        self, committed: Sequence[CommittedCheckpoint], store: str, pod: str, node: str
    ) -> list[Recording]:
        """``record_checkpoint`` for each of a report's checkpoints, in one round trip (each its own atomic
        script, fenced on its own)."""
        if not committed:
            return []
        now = time.time()
        async with self.client.pipeline(transaction=False) as pipe:
            for c in committed:
                summary = {
                    "session_id": c.session_id,
                    "checkpoint_id": c.checkpoint_id,
                    "generation": c.generation,
                    "sequence": c.sequence,
                    "bytes_total": c.bytes_total,
                    "bytes_written": c.bytes_written,
                    "token_count": c.token_count,
                    "store": store,
                    "pod": pod,
                    "node": node,
                    "recorded_at": now,
                }
                await self._record(
                    keys=[self._key("generation", c.session_id)],
                    args=[
                        self.subjects.root,
                        c.session_id,
                        c.checkpoint_id,
                        c.generation,
                        pod,
                        json.dumps(summary),
                        checkpoint_score(c.generation, c.sequence),
                    ],
                    client=pipe,
                )
            replies = await pipe.execute()
        return [
            Recording(as_text(refused), _location(location) if location else None, as_text(outcome))
            for refused, location, outcome in replies
        ]

    @_redis_may_be_down
    async def repair_checkpoints(
        self, session_id: str, manifests: Sequence[CheckpointManifest], store: str
    ) -> Repaired:
        """Record again checkpoints the store holds (verified manifests) that the registry lost, as a Redis
        failover loses its last writes; the session's generation counter rises to the newest of them. Not fenced
        by ownership (the store is the last word on what was committed) but for stale saves not deleted yet (the
        two fences of ``_REPAIR``). Idempotent."""
        args: list[str | int | float] = [self.subjects.root, session_id]
        for m in manifests:
            summary = {
                "session_id": session_id,
                "checkpoint_id": m.checkpoint_id,
                "generation": m.generation,
                "sequence": m.sequence,
                "bytes_total": m.bytes_total,
                "bytes_written": m.bytes_written,
                "token_count": m.token_count,
                "store": store,
                "pod": m.pod,
                "node": m.node,
                "recorded_at": time.time(),
                "repaired_from_store": True,
            }
            args += [
                m.checkpoint_id,
                checkpoint_score(m.generation, m.sequence),
                m.generation,
                m.pod,
                json.dumps(summary),
            ]
        added, fenced = await self._repair(keys=[self._key("checkpoints", session_id)], args=args)
        return Repaired([as_text(c) for c in added], [as_text(c) for c in fenced])

    @_redis_may_be_down
    async def checkpoints(self, session_id: str, limit: int = 16) -> list[dict[str, Any]]:
        """The session's recorded checkpoints, newest (generation, sequence) first."""
        ids = [as_text(c) for c in await self.client.zrevrange(self._key("checkpoints", session_id), 0, limit - 1)]
        if not ids:
            return []
        raws = await self.client.mget([self._key("checkpoint", c) for c in ids])
        out = [json.loads(raw) if raw else {"checkpoint_id": cid} for cid, raw in zip(ids, raws, strict=True)]
        return sorted(out, key=lambda r: checkpoint_order(str(r["checkpoint_id"])), reverse=True)

    @_redis_may_be_down
    async def newest_checkpoint(self, session_id: str) -> dict[str, Any] | None:
        found = await self.checkpoints(session_id, 1)
        return found[0] if found else None

    @_redis_may_be_down
    async def forget_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zrem(self._key("checkpoints", session_id), checkpoint_id)
            pipe.delete(self._key("checkpoint", checkpoint_id))
            await pipe.execute()

    # -- retention's changes ---------------------------------------------------------------------------------------
    @_redis_may_be_down
    async def take_retention_changes(self, limit: int) -> list[str]:
        """Up to ``limit`` sessions that recorded a checkpoint since retention last looked (each handed out
        once: a replica that dies holding some leaves them to the store walk)."""
        return sorted(as_text(s) for s in await self.client.spop(self._key("retention", "changed"), limit) or [])

    @_redis_may_be_down
    async def note_aging(self, older: Mapping[tuple[str, str], float]) -> None:
        """Index checkpoints that are not their session's newest by when they were made, for ``aged``."""
        if older:
            await self.client.zadd(self._key("retention", "aging"), {f"{s}/{c}": t for (s, c), t in older.items()})

    @_redis_may_be_down
    async def aged(self, made_before: float, limit: int) -> list[tuple[str, str]]:
        """Indexed checkpoints made before ``made_before``, oldest first: (session, checkpoint)."""
        raw = await self.client.zrangebyscore(self._key("retention", "aging"), "-inf", made_before, 0, limit)
        return [(a, b) for a, _, b in (as_text(m).partition("/") for m in raw)]

    @_redis_may_be_down
    async def retire_older(self, session_id: str, checkpoint_id: str) -> bool:
        """Forget a checkpoint retention doomed, unless it is its session's newest recorded one; see
        ``_RETIRE_OLDER``. False when it was kept."""
        keys = [
            self._key("checkpoints", session_id),
            self._key("retention", "aging"),
            self._key("checkpoint", checkpoint_id),
        ]
        return bool(await self._retire_older(keys=keys, args=[checkpoint_id, f"{session_id}/{checkpoint_id}"]))

    @_redis_may_be_down
    async def record_restore(self, session_id: str, checkpoint_id: str, pod: str, node: str) -> None:
        await self.client.xadd(
            self._key("restores"),
            {"session_id": session_id, "checkpoint_id": checkpoint_id, "pod": pod, "node": node},
            maxlen=100_000,
            approximate=True,
        )

    # -- drains ---------------------------------------------------------------------------------------------------
    @_redis_may_be_down
    async def drain_verdict(self, drain_id: str) -> bytes | None:
        """The recorded verdict event (JSON), or None while the drain has none."""
        raw = await self.client.hget(self._key("drain", drain_id), "verdict")
        return raw.encode() if isinstance(raw, str) else raw or None

    @_redis_may_be_down
    async def drain_node(self, drain_id: str) -> str | None:
        """The node a drain was recorded for (running or decided), or None when no drain of that id is known."""
        raw = await self.client.hget(self._key("drain", drain_id), "node")
        return None if raw is None else as_text(raw)

    @_redis_may_be_down
    async def take_drain(self, drain_id: str, node: str, owner: str, lease_s: float) -> bool:
        """Take the lease on running a drain; False while another runner holds it."""
        taken = await self.client.set(self._key("drain", drain_id, "lease"), owner, nx=True, px=int(lease_s * 1000))
        if taken:
            await self.client.hset(
                self._key("drain", drain_id), mapping={"node": node, "state": "running", "started": time.time()}
            )
        return bool(taken)

    @_redis_may_be_down
    async def renew_drain(self, drain_id: str, owner: str, lease_s: float) -> bool:
        """Extend the lease while ``owner`` still holds it; False when it was lost."""
        renewed = await self._renew(keys=[self._key("drain", drain_id, "lease")], args=[owner, int(lease_s * 1000)])
        return bool(renewed)

    @_redis_may_be_down
    async def keep_failures(self, drain_id: str, failures: list[bytes], ttl_s: float) -> str:
        """Keep every failure of a verdict too big for one event; returns the key the verdict references."""
        key = self._key("drain", drain_id, "failed")
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            for start in range(0, len(failures), 1000):
                pipe.rpush(key, *failures[start : start + 1000])
            pipe.expire(key, int(ttl_s))
            await pipe.execute()
        return key

    @_redis_may_be_down
    async def finish_drain(self, drain_id: str, state: DrainOutcome, verdict: bytes, duration_s: float) -> bool:
        """Record the drain's one verdict; False (nothing written) when it already has one."""
        first = await self._finish(
            keys=[self._key("drain", drain_id), self._key("drain", drain_id, "lease")],
            args=[state, verdict, duration_s],
        )
        return bool(first)

    @_redis_may_be_down
    async def recover_drain(self, drain_id: str, node: str, state: DrainOutcome, verdict: bytes) -> bool:
        """Record again a verdict the events stream kept and Redis lost (a failover); False when it has one."""
        await self.client.hsetnx(self._key("drain", drain_id), "node", node)
        return await self.finish_drain(drain_id, state, verdict, 0.0)

    @_redis_may_be_down
    async def take_turn_or_wait(self, what: str, pod: str, owner: str, interval_s: float) -> int:
        """Take the turn (0), or how many milliseconds the turn someone else took still runs."""
        key = self._key("turn", what, pod)
        if await self.client.set(key, owner, nx=True, px=max(1, int(interval_s * 1000))):
            return 0
        return max(1, int(await self.client.pttl(key)))

    @_redis_may_be_down
    async def release_turn(self, what: str, pod: str, owner: str) -> None:
        """Give back a turn ``owner`` took (its work did not happen): the next caller may take it at once."""
        await self._release(keys=[self._key("turn", what, pod)], args=[owner])

    @_redis_may_be_down
    async def take_turn(self, what: str, pod: str, owner: str, interval_s: float) -> bool:
        """True for one caller per ``interval_s`` and pod (periodic saves across replicas and restarts)."""
        taken = await self.client.set(self._key("turn", what, pod), owner, nx=True, px=max(1, int(interval_s * 1000)))
        return bool(taken)

    # -- the scrub: a walk over the recorded checkpoints, and the sessions whose next save is full ---------------
    @_redis_may_be_down
    async def run_id(self) -> str:
        """The run id of the Redis that answers (another after a promotion or a restart)."""
        return str((await self.client.info("server")).get("run_id", ""))

    @_redis_may_be_down
    async def scrub_position(self) -> tuple[int, str]:
        """Where the scrub's walk stands: its SCAN cursor (0: at the start), and the run id of the Redis it was
        taken on ('' when none was kept)."""
        cursor, run_id = await self.client.hmget(self._key("scrub"), "cursor", "run_id")
        return int(cursor or 0), as_text(run_id or b"")

    @_redis_may_be_down
    async def keep_scrub_position(self, cursor: int, run_id: str) -> None:
        await self.client.hset(self._key("scrub"), mapping={"cursor": cursor, "run_id": run_id})

    @_redis_may_be_down
    async def scan_checkpointed(self, cursor: int, count: int) -> tuple[int, list[str]]:
        """One step of SCAN over the sessions with a recorded checkpoint: about ``count`` keys of the keyspace
        looked at, whatever its size. Returns the next cursor (0: the walk went round) and the sessions found."""
        prefix = self._key("checkpoints", "")
        cursor, keys = await self.client.scan(cursor, match=prefix + "*", count=count)
        return int(cursor), [as_text(k)[len(prefix) :] for k in keys]

    @_redis_may_be_down
    async def recorded_checkpoints(self, session_ids: Sequence[str], limit: int) -> dict[str, list[str]]:
        """Each session's recorded checkpoint ids (up to ``limit``), newest first: one round trip."""
        if not session_ids:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for sid in session_ids:
                pipe.zrevrange(self._key("checkpoints", sid), 0, limit - 1)
            rows = await pipe.execute()
        return {sid: [as_text(c) for c in row] for sid, row in zip(session_ids, rows, strict=True)}

    @_redis_may_be_down
    async def forget_lost(self, session_id: str, checkpoint_id: str, keep_newest: bool = False) -> Forgotten:
        """Forget a recorded checkpoint whose files are gone or damaged, and mark the session's holder for a full
        next save; see ``_FORGET_LOST``. Idempotent: a second call finds nothing recorded."""
        forgotten, newest, holder = await self._forget_lost(
            keys=[self._key("checkpoints", session_id)],
            args=[self.subjects.root, session_id, checkpoint_id, "1" if keep_newest else "0"],
        )
        return Forgotten(bool(forgotten), bool(newest), as_text(holder))

    @_redis_may_be_down
    async def rewrites(self, pod: str) -> set[str]:
        """The sessions of ``pod`` whose next save writes every block again."""
        return {as_text(s) for s in await self.client.smembers(self._key("rewrite", pod))}

    @_redis_may_be_down
    async def mark_rewrite(self, pod: str, session_ids: Sequence[str]) -> None:
        """``pod``'s next save of these sessions writes every block again (kept a week unless cleared)."""
        if session_ids:
            key = self._key("rewrite", pod)
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.sadd(key, *session_ids)
                pipe.pexpire(key, 604_800_000)
                await pipe.execute()

    @_redis_may_be_down
    async def clear_rewrites(self, pod: str, session_ids: Sequence[str]) -> None:
        if session_ids:
            await self.client.srem(self._key("rewrite", pod), *session_ids)

    # -- audit: walks of the whole registry, for an invariant checker (tests/faults/checker.py), never a service --
    async def audit_checkpointed_sessions(self) -> AsyncIterator[str]:
        """Every session with a recorded checkpoint (a scan: its cost follows the whole registry)."""
        prefix = self._key("checkpoints", "")
        async for raw in self.client.scan_iter(match=prefix + "*", count=1000):
            yield as_text(raw)[len(prefix) :]

    async def audit_nodes(self) -> AsyncIterator[str]:
        """Every node with a session index (a scan)."""
        prefix = self._key("onnode", "")
        async for raw in self.client.scan_iter(match=prefix + "*", count=1000):
            yield as_text(raw)[len(prefix) :]

    @_redis_may_be_down
    async def node_index(self, node: str) -> dict[str, str]:
        """The node's index as stored: every session it lists -> the pod it names (unchecked against the records,
        unlike ``sessions_on_node``)."""
        return {as_text(k): as_text(v) for k, v in (await self.client.hgetall(self._key("onnode", node))).items()}

    @_redis_may_be_down
    async def session_record(self, session_id: str) -> SessionPlace | None:
        """The session's record as stored (its hash), None when it has none."""
        pod, node, ns, dep, gen = await self.client.hmget(
            self._key("session", session_id), "pod", "node", "namespace", "deployment", "generation"
        )
        if pod is None and node is None:
            return None
        return SessionPlace(
            session_id,
            as_text(pod or b""),
            as_text(node or b""),
            as_text(ns or b""),
            as_text(dep or b""),
            int(gen or 0),
        )

    @_redis_may_be_down
    async def seal(self, session_id: str) -> tuple[int, str] | None:
        """The session's seal as stored (``kv:sealed:<sid>``): the generation it was taken for and the newest
        checkpoint the store held then ('' for none); None when no claim left one."""
        gen, checkpoint = await self.client.hmget(self._key("sealed", session_id), "generation", "checkpoint")
        if gen is None:
            return None
        return int(gen), as_text(checkpoint or b"")

    @_redis_may_be_down
    async def drain_state(self, drain_id: str) -> str:
        """The drain's recorded state (running, completed, failed), '' when no drain of that id was taken."""
        raw = await self.client.hget(self._key("drain", drain_id), "state")
        return "" if raw is None else as_text(raw)
