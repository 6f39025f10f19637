"""Where the checkpoint core's records live in Redis: each ``kv:*`` key spelled once (``RegistryKeys``), for the
three adapters that read and write them (``registry.py``: sessions and checkpoints; ``leases.py``: drains, turns and
replicas; ``audit.py``: the fault checker's walks), and what Redis being unreachable means to their callers
(``redis_may_be_down``). The Lua scripts (``registry_scripts.py``, ``leases.py``) build the same keys from the
prefix they are handed.

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
- ``kv:retention:changed``    set: sessions that recorded a checkpoint since retention last looked
- ``kv:retention:aging``      sorted set: ``<sid>/<cid>`` of checkpoints that are not their session's newest, by
  when they were made
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
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import redis.exceptions

from shared.contract.subjects import Subjects
from shared.plumbing.errors import TemporaryError

P = ParamSpec("P")
R = TypeVar("R")


def redis_may_be_down(method: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Redis unreachable is a temporary failure of the caller (retried, or answered "temporary"), said in one
    line rather than a stack trace per announcement while it is down."""

    @functools.wraps(method)
    async def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise TemporaryError(f"session registry: Redis unreachable ({exc})", delay=1.0) from exc

    return guarded


class RegistryKeys:
    """The ``kv:*`` keys under one root, each named for the record it holds (see the module's list). A key of a
    session, pod or node given '' is the prefix of every such key (what a SCAN matches)."""

    def __init__(self, subjects: Subjects) -> None:
        self.subjects = subjects

    def _key(self, *parts: str) -> str:
        return self.subjects.redis_key("kv", *parts)

    # sessions and their owners
    def session(self, session_id: str) -> str:
        return self._key("session", session_id)

    def generation(self, session_id: str) -> str:
        return self._key("generation", session_id)

    def sealed(self, session_id: str) -> str:
        return self._key("sealed", session_id)

    def takes(self, session_id: str) -> str:
        return self._key("takes", session_id)

    # pods and nodes
    def onnode(self, node: str) -> str:
        return self._key("onnode", node)

    def held(self, pod: str) -> str:
        return self._key("held", pod)

    def pods(self) -> str:
        return self._key("pods")

    def alive(self, pod: str) -> str:
        return self._key("alive", pod)

    def pod(self, pod: str) -> str:
        """No record: the pod's name as a key, the one ``KEYS`` entry of the script that forgets the pod (which
        reads and writes the pod's keys under the prefix it is handed)."""
        return self._key("pod", pod)

    # checkpoints, retention and the scrub
    def checkpoints(self, session_id: str) -> str:
        return self._key("checkpoints", session_id)

    def checkpoint(self, checkpoint_id: str) -> str:
        return self._key("checkpoint", checkpoint_id)

    def retention_changed(self) -> str:
        return self._key("retention", "changed")

    def retention_aging(self) -> str:
        return self._key("retention", "aging")

    def rewrite(self, pod: str) -> str:
        return self._key("rewrite", pod)

    def scrub(self) -> str:
        return self._key("scrub")

    def restores(self) -> str:
        return self._key("restores")

    # drains, turns and replicas
    def drain(self, drain_id: str) -> str:
        return self._key("drain", drain_id)

    def drain_lease(self, drain_id: str) -> str:
        return self._key("drain", drain_id, "lease")

    def drain_failed(self, drain_id: str) -> str:
        return self._key("drain", drain_id, "failed")

    def turn(self, what: str, pod: str) -> str:
        return self._key("turn", what, pod)

    def replicas(self) -> str:
        return self._key("replicas")
