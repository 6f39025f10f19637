"""The session registry and checkpoint records in Redis (an adapter: the only module here that imports redis). Each
change is one atomic Lua script (``registry_scripts.py``, loaded here); what they answer is decoded into the record
types of ``ports.py``.

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

from . import registry_scripts as lua
from .ports import Applied, Claim, FleetCounts, Forgotten, Recording, Repaired, SessionPlace

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


class SessionRegistry:
    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.subjects = subjects
        self._announce = client.register_script(lua.ANNOUNCE)
        self._claim = client.register_script(lua.CLAIM)
        self._record = client.register_script(lua.RECORD)
        self._forget = client.register_script(lua.FORGET)
        self._renew = client.register_script(lua.RENEW)
        self._finish = client.register_script(lua.FINISH)
        self._restored = client.register_script(lua.RESTORED)
        self._where = client.register_script(lua.WHERE)
        self._replicas = client.register_script(lua.REPLICAS)
        self._repair = client.register_script(lua.REPAIR)
        self._release = client.register_script(lua.RELEASE)
        self._retire_older = client.register_script(lua.RETIRE_OLDER)
        self._summary = client.register_script(lua.SUMMARY)
        self._forget_lost = client.register_script(lua.FORGET_LOST)

    def _key(self, *parts: str) -> str:
        return self.subjects.redis_key("kv", *parts)

    # -- ownership and location ----------------------------------------------------------------------------------
    @_redis_may_be_down
    async def apply_announcement(self, event: AgentSessions) -> Applied:
        """Apply one announcement (full or delta; see ``lua.ANNOUNCE``): what it touches is what it names."""
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
            [as_text(s) for s in stale],
            [as_text(s) for s in retired],
            [lua.location_of(c) for c in changes],
            bool(resync),
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
        return Claim(int(generation), lua.location_of(location) if location else None)

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
        return lua.location_of(raw) if raw else None

    @_redis_may_be_down
    async def where(self, session_id: str) -> SessionLocation:
        """The session's location now; ``reason`` ``"unknown"`` and sequence 0 when the registry never saw it."""
        return lua.location_of(
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
        return [
            lua.location_of(c) for c in await self._forget(keys=[self._key("pod", pod)], args=[self.subjects.root, pod])
        ]

    @_redis_may_be_down
    async def summary(self) -> FleetCounts:
        """Session counts per pod, node and deployment, and which pods are alive: one script reading per pod,
        never per session (``lua.SUMMARY``)."""
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
            Recording(as_text(refused), lua.location_of(location) if location else None, as_text(outcome))
            for refused, location, outcome in replies
        ]

    @_redis_may_be_down
    async def repair_checkpoints(
        self, session_id: str, manifests: Sequence[CheckpointManifest], store: str
    ) -> Repaired:
        """Record again checkpoints the store holds (verified manifests) that the registry lost, as a Redis
        failover loses its last writes; the session's generation counter rises to the newest of them. Not fenced
        by ownership (the store is the last word on what was committed) but for stale saves not deleted yet (the
        two fences of ``lua.REPAIR``). Idempotent."""
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
        ``lua.RETIRE_OLDER``. False when it was kept."""
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
        next save; see ``lua.FORGET_LOST``. Idempotent: a second call finds nothing recorded."""
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
