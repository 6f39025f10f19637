"""The session registry's Redis scripts (Lua): each one atomic step of the registry, named for what it decides,
with its arguments and its answer in the comment above it. ``registry.SessionRegistry`` loads and runs them; the
key layout they share is listed in ``keyspace.py`` (the leases' own scripts are in ``leases.py``). Pieces shared by
several scripts (``LOCATED``, ``MOVE``, ``TAKEN``) are prepended to the scripts that use them."""

from __future__ import annotations

from typing import Any

from shared.contract.sessions import SessionLocation
from shared.plumbing.replies import as_text

# The session's location, as one flat record (see ``location_of``). With a ``reason`` it is a change: the
# session's next sequence is taken (strictly above the last, and at least the registry's clock in microseconds,
# so it keeps growing across a registry that lost its data) and the change remembered in ``kv:last:<sid>``.
# ``cid``: the checkpoint the change is about; '' for the newest recorded, '-' for none (an ended session's
# checkpoints are being retired; a query of an ended session names none either, even while they still exist).
LOCATED = """
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
  local version = ''
  if cid ~= '' then
    local summary = redis.call('GET', prefix .. ':kv:checkpoint:' .. cid)
    if summary then
      local decoded = cjson.decode(summary)
      tokens = string.format('%.0f', decoded['token_count'] or 0)
      if type(decoded['model_version']) == 'string' then version = decoded['model_version'] end
    end
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
    redis.call('GET', genkey) or '0', prev, cid, tokens, version}
end
"""

# Places the session on the pod under ``gen``; returns whether that moved it (another pod, another generation,
# or not placed before). Nothing is written when it is already placed so.
MOVE = """
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

# The pods that took the session's generations on this registry's history (``kv:takes:<sid>``: kept a week after
# the last take), as a table generation -> pod. A generation handed out twice (a claim one side of a Redis split
# brain made that the surviving side never heard of) was taken by one pod here: a checkpoint, record or announcement
# of that generation by any other pod is the discarded side's, fenced even after the surviving taker is gone from
# the registry (evicted, its lease lapsed). A claim made without a take id (an older agent) leaves no entry.
TAKEN = """
local function takers(prefix, sid)
  local out = {}
  for _, given in ipairs(redis.call('HVALS', prefix .. ':kv:takes:' .. sid)) do
    local sep = string.find(given, ' ', 1, true)
    if sep then out[tonumber(string.sub(given, sep + 1))] = string.sub(given, 1, sep - 1) end
  end
  return out
end
-- another pod than ``pod`` took generation ``gen`` of the session here
local function taken_by_another(prefix, sid, pod, gen)
  local by = takers(prefix, sid)[gen]
  return by ~= nil and by ~= pod
end
"""

# One announcement (full or delta) applied atomically. ARGV = prefix, pod, node, ns, dep, now, ttl_ms, incarnation, seq,
# full, part, parts, leaving, bytes, n_ended, n_dropped, the ended sessions, the dropped ones, then (sid, generation)
# pairs. A session announced under an older generation than the newest handed out has moved on: stale, ignored and
# returned. So is one announced under the current generation while another pod that is alive (its lease stands, it is
# not leaving) holds the session under that same generation: only a claim the registry lost in a Redis failover hands
# one generation out twice, and the pod placed first keeps it; nor by a pod other than the one that took that generation
# here (``TAKEN``: the surviving side's taker, even after it left the registry). A newer one than the registry knows (it
# lost its data) raises the counter: never handed out again. An ended session whose newest generation the pod took (held
# now, or dropped since, as after a preemption) leaves the registry and is returned as retired. A numbered delta that
# does not follow what the registry applied last for the pod (another incarnation, a gap: writes lost), or a heartbeat
# whose number is not the one applied last (the last delta was lost), is applied and answered ``resync``. Returns
# (stale, retired, the locations that changed, resync).
ANNOUNCE = (
    LOCATED
    + MOVE
    + TAKEN
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
  if gen < current or (gen == current and (held_by_another(prefix, sid, pod, gen)
    or (redis.call('HGET', prefix .. ':kv:session:' .. sid, 'pod') ~= pod and taken_by_another(prefix, sid, pod, gen))))
  then
    table.insert(stale, sid)
    -- out of the pod's index, unless the pod holds the session under a newer generation (it took it again since
    -- that announcement was made: a late or replayed one must not take it out of its holder's index)
    if redis.call('HGET', prefix .. ':kv:session:' .. sid, 'pod') ~= pod then redis.call('HDEL', heldkey, sid) end
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
# another deployment. Returns (generation or 0, the new location, why refused, the holder, the holder's node, the pod
# that took the generation before this one ('' when unknown: no take id, or a take answered again) and that
# generation: whose node-tier journal may hold the session's newest blocks).
CLAIM = (
    LOCATED
    + MOVE
    + TAKEN
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
local before = tonumber(redis.call('GET', genkey) or '0')
local from = takers(prefix, sid)[before] or ''
if before < floor then redis.call('SET', genkey, floor) end
local gen = redis.call('INCR', genkey)
if ARGV[10] == '1' then
  redis.call('HSET', prefix .. ':kv:sealed:' .. sid, 'generation', gen, 'checkpoint', ARGV[11])
end
if take ~= '' then
  redis.call('HSET', takes, take, pod .. ' ' .. gen)
  redis.call('PEXPIRE', takes, 604800000)
end
move(prefix, sid, pod, node, ns, dep, gen, now)
return {gen, located(prefix, sid, 'placed', ''), '', '', '', from, from ~= '' and before or 0}
"""
)

# ARGV = prefix, sid, cid, generation, pod, summary, score. Records a checkpoint only from the holder of the
# session's current generation; otherwise returns why not. Returns (why not, the location when it changed, the
# outcome): 'recorded' (anew), 'duplicate' (recorded before: a report sent again or replayed changes nothing and is
# answered as committed, whoever holds the session now), 'refused' (kept: it may be what someone else committed,
# e.g. the seal of the holder's generation, which a restore may have taken), 'stale' (refused, and provably a save
# nobody may take for committed: of the holder's generation by another pod, of a generation another pod took here
# (``TAKEN``), or of an older generation sorting after the current generation's seal, i.e. saved after that claim
# by a pod that had lost the session; the same fences as ``REPAIR``). Only a 'stale' checkpoint may be deleted by
# the refusal.
RECORD = (
    LOCATED
    + TAKEN
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
local taker = holder ~= pod and takers(prefix, sid)[gen]
if not why and taker and taker ~= pod then
  why = 'generation ' .. gen .. ' of the session was taken by pod ' .. taker
end
if why then
  local seal = redis.call('HMGET', prefix .. ':kv:sealed:' .. sid, 'generation', 'checkpoint')
  local sealed = tonumber(seal[1] or '-1') == current and seal[2]
  if (holder and gen == held and pod ~= holder) or (taker and taker ~= pod)
    or (sealed and gen < current and cid > sealed) then
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
FORGET = (
    LOCATED
    + MOVE
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
RESTORED = (
    LOCATED
    + """
local prefix, sid, pod, gen, cid = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local f = redis.call('HMGET', prefix .. ':kv:session:' .. sid, 'pod', 'generation')
if f[1] ~= pod or tonumber(f[2]) ~= gen then return {} end
if redis.call('HGET', prefix .. ':kv:last:' .. sid, 'reason') == 'restored' then return {} end
return located(prefix, sid, 'restored', cid)
"""
)

# ARGV = prefix, sid: the session's location now (no change).
WHERE = (
    LOCATED
    + """
return located(ARGV[1], ARGV[2], nil, '')
"""
)

# ARGV = prefix, sid, then (cid, score, generation, pod, summary) for each checkpoint: records checkpoints the
# store holds and the registry lost (a Redis failover), without the fence of ``RECORD`` (the store is the last
# word on what was committed), and raises the generation counter to the newest of them. Two fences are kept, for
# saves refused as stale whose files are not deleted yet: a checkpoint of the generation the session's holder has
# now written by another pod (or by the other holder of a generation a lost claim handed out twice), and one of an
# older generation than the current one sorting after the current generation's seal (saved after that claim, by a
# pod that had lost the session; checkpoint ids sort by (generation, sequence) as strings). A third fence outlives
# the holder: a checkpoint of a generation another pod took on this history (``TAKEN``), as the discarded side of a
# split brain wrote under a generation handed out twice. Fenced ones are not recorded. Returns (the ids recorded
# anew, the ids fenced).
REPAIR = (
    TAKEN
    + """
local prefix, sid = ARGV[1], ARGV[2]
local zkey = prefix .. ':kv:checkpoints:' .. sid
local genkey = prefix .. ':kv:generation:' .. sid
local cur = redis.call('HMGET', prefix .. ':kv:session:' .. sid, 'pod', 'generation')
local holder, held = cur[1], tonumber(cur[2] or '-1')
local current = tonumber(redis.call('GET', genkey) or '0')
local seal = redis.call('HMGET', prefix .. ':kv:sealed:' .. sid, 'generation', 'checkpoint')
local sealed = tonumber(seal[1] or '-1') == current and seal[2]
local taken = takers(prefix, sid)
local added, fenced = {}, {}
for i = 3, #ARGV, 5 do
  local cid, gen, pod = ARGV[i], tonumber(ARGV[i + 2]), ARGV[i + 3]
  if (holder and gen == held and pod ~= holder) or (taken[gen] and taken[gen] ~= pod)
    or (sealed and gen < current and cid > sealed) then
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
)

# KEYS = the session's checkpoints, the aging index; ARGV = cid, the aging member. Forget a checkpoint that
# retention doomed unless it is the session's newest recorded one (a newer one was forgotten meanwhile, as a
# restore forgets a corrupt one): the check and the forgetting are one step. 1 when forgotten (or never recorded).
RETIRE_OLDER = """
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
FORGET_LOST = """
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
SUMMARY = """
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


def location_of(raw: list[Any]) -> SessionLocation:
    """A location record of ``LOCATED`` as the event a router reads."""
    sid, reason, seq, held, pod, node, ns, dep, gen, prev, cid, tokens, version = (as_text(v) for v in raw)
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
        model_version=version,
    )
