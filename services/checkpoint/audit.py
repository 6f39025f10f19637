"""The registry as stored, read whole: walks over every session and node, and records read as they are, unchecked
against each other. For an invariant checker (``tests/faults/checker.py``), never a service: a walk's cost follows
the whole registry, not what changed. Read-only; the keys are ``keyspace.RegistryKeys``'s, so the layout stays
written in this package alone."""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from shared.contract.subjects import Subjects
from shared.plumbing.replies import as_text

from .keyspace import RegistryKeys, redis_may_be_down
from .ports import SessionPlace


class RegistryAudit:
    def __init__(self, client: aioredis.Redis, subjects: Subjects) -> None:
        self.client = client
        self.keys = RegistryKeys(subjects)

    async def checkpointed_sessions(self) -> AsyncIterator[str]:
        """Every session with a recorded checkpoint (a scan: its cost follows the whole registry)."""
        prefix = self.keys.checkpoints("")
        async for raw in self.client.scan_iter(match=prefix + "*", count=1000):
            yield as_text(raw)[len(prefix) :]

    async def nodes(self) -> AsyncIterator[str]:
        """Every node with a session index (a scan)."""
        prefix = self.keys.onnode("")
        async for raw in self.client.scan_iter(match=prefix + "*", count=1000):
            yield as_text(raw)[len(prefix) :]

    @redis_may_be_down
    async def node_index(self, node: str) -> dict[str, str]:
        """The node's index as stored: every session it lists -> the pod it names (unchecked against the records,
        unlike ``SessionRegistry.sessions_on_node``)."""
        return {as_text(k): as_text(v) for k, v in (await self.client.hgetall(self.keys.onnode(node))).items()}

    @redis_may_be_down
    async def session_record(self, session_id: str) -> SessionPlace | None:
        """The session's record as stored (its hash), None when it has none."""
        pod, node, ns, dep, gen = await self.client.hmget(
            self.keys.session(session_id), "pod", "node", "namespace", "deployment", "generation"
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

    @redis_may_be_down
    async def seal(self, session_id: str) -> tuple[int, str] | None:
        """The session's seal as stored (``kv:sealed:<sid>``): the generation it was taken for and the newest
        checkpoint the store held then ('' for none); None when no claim left one."""
        gen, checkpoint = await self.client.hmget(self.keys.sealed(session_id), "generation", "checkpoint")
        if gen is None:
            return None
        return int(gen), as_text(checkpoint or b"")

    @redis_may_be_down
    async def takers(self, session_id: str) -> dict[int, str]:
        """Who took each generation of the session on this registry's history (``kv:takes:<sid>``, as ``lua.TAKEN``
        reads it): generation -> pod; generations taken without a take id are absent."""
        out: dict[int, str] = {}
        for raw in await self.client.hvals(self.keys.takes(session_id)):
            pod, _, gen = as_text(raw).rpartition(" ")
            if pod and gen.isdigit():
                out[int(gen)] = pod
        return out

    @redis_may_be_down
    async def drain_state(self, drain_id: str) -> str:
        """The drain's recorded state (running, completed, failed), '' when no drain of that id was taken."""
        raw = await self.client.hget(self.keys.drain(drain_id), "state")
        return "" if raw is None else as_text(raw)
