"""Prefetch: when a session's holder leaves, the pod the router will send the session to restores it before the
session's next request comes.

The router notices a holder leaving when the pool's listing shows one of its pods stop serving (not ready,
terminating, gone, or replaced by another incarnation: a drain, a scale-in, a rollout, a restart). The sessions it
held (or held last, where the registry let them go before the listing showed the pod leave) that had a request
within ``prefetch_s`` (``GPUWARDEN_ROUTER_PREFETCH_S``: the conversations still going on; older ones restore on
demand) are each given their next pod: the serving pod with the least KV pressure that holds the session's model
version (a checkpoint restores only into the version that built it: after a rollout, a pinned session goes only to a
pod that still holds its version; none: it restores on demand), counting what this round already gave it (each
session's blocks, from its tokens), and never one on a cordoned node (``leaving``: the rest
of a drained node's pods, which would hand the session on once more). Each pod is sent one
``kv.session.prefetch.command`` (``cmd.kvagent.<pod>.prefetch``, up to 1,000 sessions a command), answered by
``kv.session.prefetched``; its KV agent restores through the pod's own restore path, which never takes a session
from a holder the cluster still lists (``LocateCheckpoint.prefetch``): a holder still terminating (its last save
under way) keeps it, the answer says ``held_elsewhere`` and the router asks again every ``RETRY_S`` until the
prefetch deadline. From the moment it is sent, each session is in handover to its new pod (``handover.py``): a
request that comes first waits for the new holder's location rather than racing the restore.

Nothing here changes what the router knows of locations: the pod's claim and restore are published by the
checkpoint service as for any restore, and heard as any location is.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.contract.sessions import PrefetchSessions, SessionsPrefetched

from .handover import Handovers
from .picker import EndpointPicker, PodIncarnation

log = logging.getLogger(__name__)

BATCH = 1000
"""Sessions one prefetch command names at most (the contract's bound)."""
RETRY_S = 0.5
"""Between two asks for the sessions a listed holder still keeps."""
BLOCK_TOKENS = 16
"""Tokens per KV block assumed when spreading sessions by their size (the engines' usual block)."""

Moving = tuple[str, int, frozenset[str]]
"""A session whose holder left: its id, its tokens (its size) and the model versions a pod must hold to restore it
(``Placement.needs``: its checkpoint's version, else those its holder held; empty: any)."""

Ask = Callable[[PrefetchSessions, float], Awaitable[object]]
"""Sends one prefetch command and returns the answer (``Bus.request``)."""


@dataclass
class PrefetchStats:
    rounds: int = 0
    asked: int = 0
    prefetched: int = 0
    held: int = 0
    asked_again: int = 0
    failed: int = 0
    unanswered: int = 0
    renewed: int = 0
    """Handovers renewed while their pod was still restoring them."""
    no_version: int = 0
    """Sessions not prefetched because no staying pod holds their model version (they restore on demand)."""


class Activity:
    """When each session last had a request routed, bounded (the least recent forgotten first)."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._at: OrderedDict[str, float] = OrderedDict()

    def saw(self, session: str, now: float) -> None:
        self._at.pop(session, None)
        self._at[session] = now
        while len(self._at) > self.max_sessions:
            self._at.popitem(last=False)

    def since(self, cutoff: float) -> list[str]:
        """Sessions with a request at or after ``cutoff``, the most recent first."""
        found: list[str] = []
        for session, at in reversed(self._at.items()):
            if at < cutoff:
                break
            found.append(session)
        return found


class Prefetcher:
    """Chooses the next pod of each active session whose holder left, and asks it to restore them."""

    def __init__(
        self,
        picker: EndpointPicker,
        handovers: Handovers,
        ask: Ask,
        prefetch_s: float,
        clock: Callable[[], float],
        deadline_s: float = 60.0,
        max_sessions: int = 1_000_000,
    ) -> None:
        self.clock = clock
        self.picker = picker
        self.handovers = handovers
        self.ask = ask
        self.prefetch_s = prefetch_s
        self.deadline_s = deadline_s
        self.activity = Activity(max_sessions)
        self.stats = PrefetchStats()
        self.prefetched: OrderedDict[str, None] = OrderedDict()
        """Sessions a prefetch brought, whose next request has not come yet (counted ``prefetched`` when it does);
        at most ``max_sessions``, the oldest forgotten first (a session that ends never sends that request)."""
        self.max_sessions = max_sessions
        self._tasks: set[asyncio.Task[None]] = set()

    def saw_request(self, session: str, now: float) -> None:
        if self.prefetch_s > 0 and session:
            self.activity.saw(session, now)

    def took_request(self, session: str) -> bool:
        """Whether this request is the first of ``session`` since a prefetch brought it (and forget that)."""
        return self.prefetched.pop(session, False) is None

    def serving(self) -> dict[str, PodIncarnation]:
        """The pool's serving pods now, by name (``snapshot`` before a listing, compared after it)."""
        return {name: pod for name, pod in self.picker.pods.items() if pod.serves}

    def on_listing(self, before: dict[str, PodIncarnation], now: float) -> int:
        """After a listing: the incarnations serving in ``before`` that serve no more have left; their active
        sessions are prefetched. Returns how many sessions were sent."""
        if self.prefetch_s <= 0:
            return 0
        left = {id(p) for name, p in before.items() if not p.serves or self.picker.pods.get(name) is not p}
        if not left:
            return 0
        moving: list[Moving] = []
        for session in self.activity.since(now - self.prefetch_s):
            placement = self.picker.sessions.get(session)
            holder = None if placement is None else (placement.holder or placement.was)
            if placement is not None and holder is not None and id(holder) in left:
                moving.append((session, placement.tokens, placement.needs()))
        if not moving:
            return 0
        plan = self.assign(moving, now)
        for pod, sessions in plan.items():
            for start in range(0, len(sessions), BATCH):
                batch = sessions[start : start + BATCH]
                for session in batch:
                    self.handovers.start(session, pod, now)
                task = asyncio.ensure_future(self._prefetch(pod, batch))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self.stats.rounds += 1
        return len(moving)

    def assign(self, moving: list[Moving], now: float) -> dict[str, list[str]]:
        """Each session to the serving pod with the least KV pressure that holds the session's model version (a
        checkpoint restores only into the version that built it; where the session's is not known, a pod holding
        every version its holder held, else any), counting what this round already gave each pod; never to a pod
        that is ``leaving`` (on a cordoned node: a drain's other pods), which would hand it on again. A session of
        a known version that no such pod holds is not prefetched (``no_version``): it restores on its next
        request."""
        pressure: dict[str, float] = {}
        totals: dict[str, int] = {}
        for name, pod in self.picker.pods.items():
            if not pod.serves or pod.leaving:
                continue
            used = pod.utilisation(now, self.picker.load_stale_s)
            totals[name] = max(pod.blocks_total, 1) if used is not None else 1_000
            pressure[name] = 0.5 if used is None else used
        heaps: dict[frozenset[str], list[tuple[float, str]]] = {}  # per model versions needed (``_heap``)
        plan: dict[str, list[str]] = {}
        if not pressure:
            return plan
        for session, tokens, needs in sorted(moving, key=lambda m: -m[1]):  # the largest first: a better spread
            heap = self._heap(heaps, pressure, needs)
            if not heap and len(needs) > 1:  # its version is not known: any pod may hold it
                heap = self._heap(heaps, pressure, frozenset())
            if not heap:
                self.stats.no_version += 1
                continue
            _, name = heapq.heappop(heap)
            plan.setdefault(name, []).append(session)
            pressure[name] += max(1, math.ceil(tokens / BLOCK_TOKENS)) / totals[name]
            heapq.heappush(heap, (pressure[name], name))
        return plan

    def _heap(
        self, heaps: dict[frozenset[str], list[tuple[float, str]]], pressure: dict[str, float], needs: frozenset[str]
    ) -> list[tuple[float, str]]:
        """The pods holding ``needs`` by pressure, kept per ``needs`` for one round, its head fresh: an entry whose
        pod a session of other needs made more pressed since is pushed again with its pressure when it comes up."""
        heap = heaps.get(needs)
        if heap is None:
            heap = heaps[needs] = [(p, n) for n, p in pressure.items() if self.picker.pods[n].holds(needs)]
            heapq.heapify(heap)
        while heap and heap[0][0] != pressure[heap[0][1]]:
            _, name = heapq.heappop(heap)
            heapq.heappush(heap, (pressure[name], name))
        return heap

    async def _prefetch(self, pod: str, sessions: list[str]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        remaining = sessions
        namespace, deployment = self.picker.namespace, self.picker.deployment
        while remaining:
            self.stats.asked += len(remaining)
            left_s = max(1.0, deadline - loop.time())
            command = PrefetchSessions(
                pod=pod, namespace=namespace, deployment=deployment, session_ids=remaining, deadline_s=left_s
            )
            renewing = asyncio.ensure_future(self._renew_while_asked(remaining, pod))
            try:
                answer = await self.ask(command, left_s + 5.0)
            except Exception as exc:  # no agent answers (the pod is starting or gone): restored on demand
                self.stats.unanswered += len(remaining)
                self.handovers.given_up(remaining, pod)
                log.info("prefetch unanswered", extra={"pod": pod, "sessions": len(remaining), "error": str(exc)})
                return
            finally:
                renewing.cancel()
            if not isinstance(answer, SessionsPrefetched):
                self.stats.failed += len(remaining)
                self.handovers.given_up(remaining, pod)
                log.info("prefetch refused", extra={"pod": pod, "answer": getattr(answer, "reason", "")[:200]})
                return
            self.stats.prefetched += len(answer.restored)
            self.stats.held += len(answer.held)
            self.stats.failed += len(answer.failed)
            self.prefetched.update(dict.fromkeys(answer.restored))
            while len(self.prefetched) > self.max_sessions:
                self.prefetched.popitem(last=False)
            if answer.failed:
                self.handovers.given_up(list(answer.failed), pod)
                log.info(
                    "prefetch failed for some sessions",
                    extra={"pod": pod, "failed": len(answer.failed), "first": next(iter(answer.failed.items()))},
                )
            remaining = answer.held_elsewhere
            if remaining and loop.time() + RETRY_S < deadline:
                self.stats.asked_again += len(remaining)
                now = self.clock()
                for session in remaining:  # still in handover to this pod while its holder finishes leaving
                    self.handovers.start(session, pod, now)
                await asyncio.sleep(RETRY_S)
            else:
                self.handovers.given_up(remaining, pod)
                return

    async def _renew_while_asked(self, sessions: list[str], pod: str) -> None:
        """While ``pod`` restores ``sessions`` (its answer comes when all are done: hundreds take seconds), their
        handovers are renewed every half bound, so that a request of one restored late waits for it rather than
        giving up and restoring it cold elsewhere (handover.py). Cancelled when the answer comes."""
        period = self.handovers.wait_s / 2
        if period <= 0:
            return
        while True:
            await asyncio.sleep(period)
            self.stats.renewed += self.handovers.renew(sessions, pod, self.clock())

    def status(self) -> dict[str, object]:
        return {
            "prefetch_s": self.prefetch_s,
            "in_flight": len(self._tasks),
            **self.stats.__dict__,
        }

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
