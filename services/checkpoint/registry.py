"""The session registry and checkpoint records in Redis (an adapter, as are ``leases.py`` and ``audit.py`` beside
it). Each change is one atomic Lua script (``registry_scripts.py``, loaded here); what they answer is decoded into
the record types of ``ports.py``.

The keys are ``keyspace.RegistryKeys``'s (the layout is listed there); the drain and turn leases and the
replicas' membership are ``leases.py``'s, the fault checker's walks ``audit.py``'s.

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
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from shared.contract.checkpoint import AgentSessions, CommittedCheckpoint
from shared.contract.sessions import SessionLocation, SessionRecord
from shared.contract.subjects import Subjects
from shared.kv.manifest import CheckpointManifest, checkpoint_order
from shared.plumbing.replies import as_text

from . import registry_scripts as lua
from .keyspace import RegistryKeys, redis_may_be_down
from .ports import Applied, Claim, FleetCounts, Forgotten, Recording, Repaired, SessionPlace

_SEQUENCE_SPAN = 2**32


def checkpoint_score(generation: int, sequence: int) -> float:
    """(generation, sequence) as one sorted-set score, exact while generation < 2**21."""
    return float(generation * _SEQUENCE_SPAN + sequence)


class SessionRegistry:
    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.subjects = subjects
        self.keys = RegistryKeys(subjects)
        self._announce = client.register_script(lua.ANNOUNCE)
        self._claim = client.register_script(lua.CLAIM)
        self._record = client.register_script(lua.RECORD)
        self._forget = client.register_script(lua.FORGET)
        self._restored = client.register_script(lua.RESTORED)
        self._where = client.register_script(lua.WHERE)
        self._repair = client.register_script(lua.REPAIR)
        self._retire_older = client.register_script(lua.RETIRE_OLDER)
        self._summary = client.register_script(lua.SUMMARY)
        self._forget_lost = client.register_script(lua.FORGET_LOST)

    # -- ownership and location ----------------------------------------------------------------------------------
    @redis_may_be_down
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
            keys=[self.keys.held(event.pod)], args=[*head, *event.ended, *event.dropped, *pairs]
        )
        return Applied(
            [as_text(s) for s in stale],
            [as_text(s) for s in retired],
            [lua.location_of(c) for c in changes],
            bool(resync),
        )

    @redis_may_be_down
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
        generation, location, refused, holder, holder_node, *previous = await self._claim(
            keys=[self.keys.generation(session_id)],
            args=[
                self.subjects.root,
                *(session_id, pod, node, namespace, deployment, time.time(), floor, int(force)),
                *(("1", seal) if seal is not None else ("0", "")),
                take,
            ],
        )
        if refused:
            return Claim(0, None, as_text(refused), as_text(holder), as_text(holder_node))
        taken_from, taken_gen = (as_text(previous[0]), int(previous[1])) if len(previous) == 2 else ("", 0)
        return Claim(
            int(generation), lua.location_of(location) if location else None, "", "", "", taken_from, taken_gen
        )

    @redis_may_be_down
    async def note_restored(
        self, session_id: str, pod: str, generation: int, checkpoint_id: str
    ) -> SessionLocation | None:
        """``pod`` restored ``checkpoint_id`` under ``generation``: the new location, or None when the pod no
        longer holds that generation (the report is stale)."""
        raw = await self._restored(
            keys=[self.keys.session(session_id)],
            args=[self.subjects.root, session_id, pod, generation, checkpoint_id],
        )
        return lua.location_of(raw) if raw else None

    @redis_may_be_down
    async def where(self, session_id: str) -> SessionLocation:
        """The session's location now; ``reason`` ``"unknown"`` and sequence 0 when the registry never saw it."""
        return lua.location_of(
            await self._where(keys=[self.keys.session(session_id)], args=[self.subjects.root, session_id])
        )

    @redis_may_be_down
    async def generation(self, session_id: str) -> int:
        raw = await self.client.get(self.keys.generation(session_id))
        return int(raw) if raw is not None else 0

    @redis_may_be_down
    async def sessions_on_node(self, node: str) -> list[SessionPlace]:
        """The sessions placed on the node (its index, then each one's record): what a drain of it reads."""
        sids = sorted(as_text(s) for s in await self.client.hkeys(self.keys.onnode(node)))
        if not sids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for sid in sids:
                pipe.hmget(self.keys.session(sid), "pod", "node", "namespace", "deployment", "generation")
            rows = await pipe.execute()
        out = []
        for sid, (pod, where, ns, dep, gen) in zip(sids, rows, strict=True):
            if pod is not None and as_text(where) == node:
                out.append(
                    SessionPlace(sid, as_text(pod), node, as_text(ns or b""), as_text(dep or b""), int(gen or 0))
                )
        return out

    @redis_may_be_down
    async def sessions_of_pod(self, pod: str) -> dict[str, int]:
        """The sessions the pod holds -> the generation it holds each under (its index: one read)."""
        return {as_text(k): int(v) for k, v in (await self.client.hgetall(self.keys.held(pod))).items()}

    @redis_may_be_down
    async def pods(self) -> dict[str, str]:
        """Every pod the registry knows -> its node."""
        return {as_text(k): as_text(v) for k, v in (await self.client.hgetall(self.keys.pods())).items()}

    @redis_may_be_down
    async def silent_pods(self, known: dict[str, str] | None = None) -> dict[str, str]:
        """Pods whose last announcement no longer stands -> their node (of ``known``, when the caller has read
        the pods already)."""
        known = await self.pods() if known is None else known
        if not known:
            return {}
        alive = await self.client.mget([self.keys.alive(p) for p in known])
        return {pod: node for (pod, node), flag in zip(known.items(), alive, strict=True) if flag is None}

    @redis_may_be_down
    async def forget_pod(self, pod: str) -> list[SessionLocation]:
        """The pod's sessions leave the registry; returns their locations now (held by nothing)."""
        return [
            lua.location_of(c) for c in await self._forget(keys=[self.keys.pod(pod)], args=[self.subjects.root, pod])
        ]

    @redis_may_be_down
    async def summary(self) -> FleetCounts:
        """Session counts per pod, node and deployment, and which pods are alive: one script reading per pod,
        never per session (``lua.SUMMARY``)."""
        found = json.loads(await self._summary(keys=[self.keys.pods()], args=[self.subjects.root]))

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

    @redis_may_be_down
    async def sessions_page(
        self, *, node: str = "", pod: str = "", cursor: str = "", limit: int = 200
    ) -> tuple[list[SessionRecord], str, int | None]:
        """A page of sessions with their newest checkpoint: of a node (its index) or of a pod (its index); one of
        them is named. Returns (records, the next cursor or '', the index's size)."""
        if not (node or pod):
            raise ValueError("a page of sessions is read from a node's or a pod's index: name one")
        position = int(cursor) if cursor.isdigit() else 0
        index = self.keys.onnode(node) if node else self.keys.held(pod)
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
                pipe.hmget(self.keys.session(sid), "pod", "node", "namespace", "deployment", "generation")
                pipe.zrevrange(self.keys.checkpoints(sid), 0, 0)
            replies = await pipe.execute()
        newest = {sid: as_text(replies[2 * i + 1][0]) for i, sid in enumerate(sids) if replies[2 * i + 1]}
        summaries = (
            dict(zip(newest, await self.client.mget([self.keys.checkpoint(c) for c in newest.values()]), strict=True))
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

    # -- checkpoints -----------------------------------------------------------------------------------------------
    @redis_may_be_down
    async def record_checkpoint(self, committed: CommittedCheckpoint, store: str, pod: str, node: str) -> Recording:
        """Record a committed checkpoint when ``pod`` holds the session's current generation; else say why not
        (and record nothing). See ``Recording``: a checkpoint recorded before is a duplicate, whoever holds the
        session now; a refused one is deletable only when it is provably stale."""
        return (await self.record_checkpoints([committed], store, pod, node))[0]

    @redis_may_be_down
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
                    "model_version": c.model_version,
                    "store": store,
                    "pod": pod,
                    "node": node,
                    "recorded_at": now,
                }
                await self._record(
                    keys=[self.keys.generation(c.session_id)],
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

    @redis_may_be_down
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
                "model_version": m.layout.model_version,
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
        added, fenced = await self._repair(keys=[self.keys.checkpoints(session_id)], args=args)
        return Repaired([as_text(c) for c in added], [as_text(c) for c in fenced])

    @redis_may_be_down
    async def checkpoints(self, session_id: str, limit: int = 16) -> list[dict[str, Any]]:
        """The session's recorded checkpoints, newest (generation, sequence) first."""
        ids = [as_text(c) for c in await self.client.zrevrange(self.keys.checkpoints(session_id), 0, limit - 1)]
        if not ids:
            return []
        raws = await self.client.mget([self.keys.checkpoint(c) for c in ids])
        out = [json.loads(raw) if raw else {"checkpoint_id": cid} for cid, raw in zip(ids, raws, strict=True)]
        return sorted(out, key=lambda r: checkpoint_order(str(r["checkpoint_id"])), reverse=True)

    @redis_may_be_down
    async def newest_checkpoint(self, session_id: str) -> dict[str, Any] | None:
        found = await self.checkpoints(session_id, 1)
        return found[0] if found else None

    @redis_may_be_down
    async def forget_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zrem(self.keys.checkpoints(session_id), checkpoint_id)
            pipe.delete(self.keys.checkpoint(checkpoint_id))
            await pipe.execute()

    # -- retention's changes ---------------------------------------------------------------------------------------
    @redis_may_be_down
    async def take_retention_changes(self, limit: int) -> list[str]:
        """Up to ``limit`` sessions that recorded a checkpoint since retention last looked (each handed out
        once: a replica that dies holding some leaves them to the store walk)."""
        return sorted(as_text(s) for s in await self.client.spop(self.keys.retention_changed(), limit) or [])

    @redis_may_be_down
    async def note_aging(self, older: Mapping[tuple[str, str], float]) -> None:
        """Index checkpoints that are not their session's newest by when they were made, for ``aged``."""
        if older:
            await self.client.zadd(self.keys.retention_aging(), {f"{s}/{c}": t for (s, c), t in older.items()})

    @redis_may_be_down
    async def aged(self, made_before: float, limit: int) -> list[tuple[str, str]]:
        """Indexed checkpoints made before ``made_before``, oldest first: (session, checkpoint)."""
        raw = await self.client.zrangebyscore(self.keys.retention_aging(), "-inf", made_before, 0, limit)
        return [(a, b) for a, _, b in (as_text(m).partition("/") for m in raw)]

    @redis_may_be_down
    async def retire_older(self, session_id: str, checkpoint_id: str) -> bool:
        """Forget a checkpoint retention doomed, unless it is its session's newest recorded one; see
        ``lua.RETIRE_OLDER``. False when it was kept."""
        keys = [
            self.keys.checkpoints(session_id),
            self.keys.retention_aging(),
            self.keys.checkpoint(checkpoint_id),
        ]
        return bool(await self._retire_older(keys=keys, args=[checkpoint_id, f"{session_id}/{checkpoint_id}"]))

    @redis_may_be_down
    async def record_restore(self, session_id: str, checkpoint_id: str, pod: str, node: str) -> None:
        await self.client.xadd(
            self.keys.restores(),
            {"session_id": session_id, "checkpoint_id": checkpoint_id, "pod": pod, "node": node},
            maxlen=100_000,
            approximate=True,
        )

    # -- the scrub: a walk over the recorded checkpoints, and the sessions whose next save is full ---------------
    @redis_may_be_down
    async def run_id(self) -> str:
        """The run id of the Redis that answers (another after a promotion or a restart)."""
        return str((await self.client.info("server")).get("run_id", ""))

    @redis_may_be_down
    async def scrub_position(self) -> tuple[int, str]:
        """Where the scrub's walk stands: its SCAN cursor (0: at the start), and the run id of the Redis it was
        taken on ('' when none was kept)."""
        cursor, run_id = await self.client.hmget(self.keys.scrub(), "cursor", "run_id")
        return int(cursor or 0), as_text(run_id or b"")

    @redis_may_be_down
    async def keep_scrub_position(self, cursor: int, run_id: str) -> None:
        await self.client.hset(self.keys.scrub(), mapping={"cursor": cursor, "run_id": run_id})

    @redis_may_be_down
    async def scan_checkpointed(self, cursor: int, count: int) -> tuple[int, list[str]]:
        """One step of SCAN over the sessions with a recorded checkpoint: about ``count`` keys of the keyspace
        looked at, whatever its size. Returns the next cursor (0: the walk went round) and the sessions found."""
        prefix = self.keys.checkpoints("")
        cursor, keys = await self.client.scan(cursor, match=prefix + "*", count=count)
        return int(cursor), [as_text(k)[len(prefix) :] for k in keys]

    @redis_may_be_down
    async def recorded_checkpoints(self, session_ids: Sequence[str], limit: int) -> dict[str, list[str]]:
        """Each session's recorded checkpoint ids (up to ``limit``), newest first: one round trip."""
        if not session_ids:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for sid in session_ids:
                pipe.zrevrange(self.keys.checkpoints(sid), 0, limit - 1)
            rows = await pipe.execute()
        return {sid: [as_text(c) for c in row] for sid, row in zip(session_ids, rows, strict=True)}

    @redis_may_be_down
    async def forget_lost(self, session_id: str, checkpoint_id: str, keep_newest: bool = False) -> Forgotten:
        """Forget a recorded checkpoint whose files are gone or damaged, and mark the session's holder for a full
        next save; see ``lua.FORGET_LOST``. Idempotent: a second call finds nothing recorded."""
        forgotten, newest, holder = await self._forget_lost(
            keys=[self.keys.checkpoints(session_id)],
            args=[self.subjects.root, session_id, checkpoint_id, "1" if keep_newest else "0"],
        )
        return Forgotten(bool(forgotten), bool(newest), as_text(holder))

    @redis_may_be_down
    async def rewrites(self, pod: str) -> set[str]:
        """The sessions of ``pod`` whose next save writes every block again."""
        return {as_text(s) for s in await self.client.smembers(self.keys.rewrite(pod))}

    @redis_may_be_down
    async def mark_rewrite(self, pod: str, session_ids: Sequence[str]) -> None:
        """``pod``'s next save of these sessions writes every block again (kept a week unless cleared)."""
        if session_ids:
            key = self.keys.rewrite(pod)
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.sadd(key, *session_ids)
                pipe.pexpire(key, 604_800_000)
                await pipe.execute()

    @redis_may_be_down
    async def clear_rewrites(self, pod: str, session_ids: Sequence[str]) -> None:
        if session_ids:
            await self.client.srem(self.keys.rewrite(pod), *session_ids)
