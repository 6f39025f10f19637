"""What the router knows, and the pick: which endpoints, in order, serve one request.

The knowledge is kept in memory and changed by events, never read per request: the pool's pods as the cluster lists
them (``set_pods``), each pod's KV-cache load (``on_load``, from ``kv.pod.load``) and each session's newest location
(``on_location``, from ``kv.session.location``). ``pick`` is a function of that and the request's facts, with the
time passed in.

A session is credited to one incarnation of its pod, never to a name. The incarnation is the pod's UID and its
container restarts as the cluster reports them: a pod replaced under the same name (a StatefulSet) or a server
restarted in place lost what its GPU held, and a new ``PodIncarnation`` stands for it; the sessions credited to the
old one are not routed to the new one, and nothing has to walk them to forget them. A location that names a pod
the cluster has not shown yet is credited to the incarnation the pod has when it is first seen.

Memory is bounded: a session's entry is one small record, kept until ``max_sessions`` newer changes push it out
(the least recently changed first); a session that is no longer held keeps only its sequence (so that an older,
late event cannot bring it back), and goes out the same way.

A session the router has never heard of is sent to the least loaded pod, and that choice is remembered for
``first_pick_s`` (until its location is heard, which names the pod that claimed it): two requests of a brand-new
session arriving together go to the same pod, rather than to two pods of which one would be refused the claim. The
memory holds at most ``max_first_picks`` sessions (the oldest forgotten first: a forgotten one is only balanced).
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum

from shared.contract.load import PodLoad
from shared.contract.sessions import SessionLocation
from shared.ports.cluster import PodInfo


class Outcome(Enum):
    """How a pick went (counted per outcome; docs/routing.md)."""

    HOLDER = "holder"  # the session's holder first
    HOLDER_GONE = "holder-gone"  # the session was held by a pod that cannot serve now: balanced
    UNPLACED = "unplaced"  # the router knows the session, no pod holds it: balanced (the pod restores it)
    UNKNOWN_SESSION = "unknown-session"  # never heard of: balanced (the pod starts or restores it)
    NO_SESSION = "no-session"  # the request names none: balanced
    REFUSED_SESSION = "refused-session"  # a forged or malformed id, or another deployment's session: balanced
    NO_ENDPOINT = "no-endpoint"  # 503
    HANDOVER_TIMEOUT = "handover-timeout"  # 503: the session's new holder was not heard within the handover wait
    SHED = "shed"  # 429


@dataclass(slots=True, eq=False)
class PodIncarnation:
    """One life of one pod: what the cluster says of it now, and its last load report."""

    name: str
    identity: str | None = None
    """``<uid>/<restarts>``; None while the pod has only been named by a location, not seen in the cluster."""
    endpoint: str = ""
    """``ip:port`` of its model server ('' while it has no IP)."""
    ready: bool = False
    leaving: bool = False
    """Its node is cordoned (a drain, a driver upgrade, a GPU fault being handled): it still serves the sessions it
    holds, but is the last choice for any other request and never a prefetch's target (it would hand them on)."""
    current: bool = True
    """False once another incarnation replaced it or it left the cluster: nothing is credited to it any more."""
    blocks_used: int = 0
    blocks_total: int = 0
    load_at: float | None = None
    load_sent_at: float = 0.0
    """When the pod sent the load report kept (its own clock: compared only with its own earlier reports)."""
    held_sessions: int = 0
    """Sessions the router credits to this incarnation now, and their tokens (``held_tokens``): kept as locations
    change (``EndpointPicker.on_location``), so that what evacuating the pod costs is read without a walk."""
    held_tokens: int = 0
    versions: frozenset[str] | None = None
    """The model versions it can restore a session into, from its last load report; None: not said (any)."""

    @property
    def serves(self) -> bool:
        return self.current and self.ready and bool(self.endpoint)

    def holds(self, versions: frozenset[str]) -> bool:
        """Whether a session needing one of ``versions`` can surely be restored here (a checkpoint restores only
        into the version that built it): the pod holds them all, or does not say what it holds. Empty: any."""
        return not versions or self.versions is None or versions <= self.versions

    def utilisation(self, now: float, stale_s: float) -> float | None:
        """KV blocks used of its pool by a report younger than ``stale_s``; None when unknown (never idle)."""
        if self.load_at is None or now - self.load_at > stale_s or self.blocks_total <= 0:
            return None
        return self.blocks_used / self.blocks_total


@dataclass(frozen=True, slots=True)
class Placement:
    """A session's newest location as the router keeps it: its holder (None: nothing holds it) and the sequence."""

    holder: PodIncarnation | None
    sequence: int
    foreign: bool = False
    """The session belongs to another deployment: never routed within this pool."""
    tokens: int = 0
    """Tokens of its newest checkpoint (the location's ``token_count``): its size, to spread prefetches."""
    version: str = ""
    """The model version of its newest checkpoint ('' when not known): where it goes, that version must be held."""

    def needs(self) -> frozenset[str]:
        """The model versions a pod must hold to surely restore this session: its checkpoint's; where that is not
        known (a session not saved since the location was heard), every version its holder held (it runs on one
        of them); empty: any pod."""
        if self.version:
            return frozenset((self.version,))
        holder = self.holder or self.was
        return (holder.versions or frozenset()) if holder is not None else frozenset()

    was: PodIncarnation | None = None
    """While no pod holds it because the registry forgot it with its pod (``forgotten``): that pod (its sessions are
    prefetched when the router sees it stop serving, even after the registry let them go). Not for a session its
    engine dropped (``dropped``: preempted), which restores on its next request."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the router read of one request: the session it names ('' for none; ``session_problem`` says why one
    named was refused) and the candidate endpoints the gateway allows (None: any)."""

    session: str = ""
    session_problem: str = ""
    subset: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Pick:
    """The answer: ``endpoints`` in order (the first is the destination, the rest the fallbacks), or an HTTP
    ``status`` (503, 429) with ``reason``; ``refused_session`` says why the named session was not used."""

    outcome: Outcome
    endpoints: tuple[str, ...] = ()
    status: int = 200
    reason: str = ""
    refused_session: str = ""
    first_pod: str = ""
    """The pod of ``endpoints[0]`` ('' when none)."""
    version_unserved: bool = False
    """The session is to be restored and no candidate pod holds its model version."""


UNKNOWN = 1
"""In a pod's rank class (``EndpointPicker._rank_key``): no fresh load report."""
LEAVING = 2
"""In a pod's rank class: its node is cordoned."""


def _credit(placement: Placement, sign: int) -> None:
    """Add (``sign`` 1) or take (-1) a placement's session and tokens to or from its holder's totals."""
    if placement.holder is not None:
        placement.holder.held_sessions += sign
        placement.holder.held_tokens += sign * placement.tokens


def incarnation_of(pod: PodInfo) -> str:
    """The identity a restart or a replacement changes: the UID (the name where the cluster gives none) and the
    container restarts."""
    return f"{pod.uid or pod.name}/{pod.restarts}"


@dataclass
class EndpointPicker:
    """The router's memory of one pool (``namespace``/``deployment``) and its picks."""

    namespace: str
    deployment: str
    target_port: int = 8000
    fallbacks: int = 2
    shed_at: float = 0.99
    load_stale_s: float = 15.0
    max_sessions: int = 1_000_000
    first_pick_s: float = 10.0
    max_first_picks: int = 100_000
    pods: dict[str, PodIncarnation] = field(default_factory=dict)
    sessions: dict[str, Placement] = field(default_factory=dict)
    picks: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in Outcome})
    ignored_locations: int = 0
    version_unserved: int = 0
    """Picks of a session to restore whose model version no candidate pod surely holds (it went to the least
    loaded pod)."""
    _order: list[tuple[int, float, str]] | None = field(default=None, repr=False)
    """The serving pods by load, kept sorted (``_rank_key``): a pick reads its head, a load report moves one
    entry; None: to be built again (the pods changed, or a load it ranks went stale)."""
    _keys: dict[str, tuple[int, float, str]] = field(default_factory=dict, repr=False)
    _oldest_load: float | None = field(default=None, repr=False)
    """No fresh load in ``_order`` was reported before this: once it is older than ``load_stale_s``, the order is
    built again (the loads gone stale count as unknown)."""
    _first_picks: dict[str, tuple[PodIncarnation, float]] = field(default_factory=dict, repr=False)
    """Sessions never heard of, by when their first request was sent, with the pod it went to (oldest first)."""

    # -- knowledge ------------------------------------------------------------------------------------------------
    def _ours(self, namespace: str, deployment: str) -> bool:
        """Whether an event naming ``namespace``/``deployment`` is about this pool (an event naming neither is)."""
        return (not namespace or namespace == self.namespace) and (not deployment or deployment == self.deployment)

    def set_pods(self, listed: Iterable[PodInfo], cordoned: Collection[str] = ()) -> None:
        """The pool's pods as the cluster lists them now (level-triggered: the whole listing, any number of times),
        and which of their nodes are cordoned (their pods are ``leaving``). A pod of another deployment in
        ``listed`` is ignored. Idempotent."""
        seen: set[str] = set()
        for pod in listed:
            if pod.namespace != self.namespace or pod.deployment != self.deployment:
                continue
            seen.add(pod.name)
            identity = incarnation_of(pod)
            known = self.pods.get(pod.name)
            if known is None or (known.identity is not None and known.identity != identity):
                if known is not None:
                    known.current = False
                known = self.pods[pod.name] = PodIncarnation(pod.name, identity)
            elif known.identity is None:
                known.identity = identity  # named by a location first: this is the life it was named in
            known.endpoint = f"{pod.ip}:{self.target_port}" if pod.ip else ""
            if ":" in pod.ip:
                known.endpoint = f"[{pod.ip}]:{self.target_port}"
            known.ready = pod.phase == "Running" and pod.ready
            known.leaving = pod.node in cordoned
        for name in [n for n, p in self.pods.items() if n not in seen and p.identity is not None]:
            self.pods.pop(name).current = False
        self._order = None

    def on_load(self, load: PodLoad, now: float) -> None:
        """A pod's load report (telemetry: the newest wins; a report for a pod not listed yet is kept for it). One
        the pod sent no later than the report kept (a duplicate, a replay, a report overtaken) changes nothing, not
        even how fresh the pod's load reads."""
        if not self._ours(load.namespace, load.deployment):
            return
        pod = self.pods.get(load.pod)
        if pod is None:
            pod = self.pods[load.pod] = PodIncarnation(load.pod)
        sent_at = load.occurred_at.timestamp()
        if pod.load_at is not None and sent_at <= pod.load_sent_at:
            return
        pod.blocks_used, pod.blocks_total, pod.load_at = load.blocks_used, load.blocks_total, now
        pod.load_sent_at = sent_at
        versions = None if load.model_versions is None else frozenset(load.model_versions)
        if versions != pod.versions:
            pod.versions = versions
        old = self._keys.get(pod.name)
        if self._order is None or old is None:
            return
        del self._order[bisect.bisect_left(self._order, old)]
        new = self._keys[pod.name] = self._rank_key(pod, now)
        bisect.insort(self._order, new)
        if not new[0] & UNKNOWN:
            self._oldest_load = now if self._oldest_load is None else min(self._oldest_load, now)

    def on_location(self, location: SessionLocation) -> bool:
        """A session's location; kept when it ``supersedes`` what is known (returns whether it was). Idempotent:
        the same or an older location changes nothing, whatever order they arrive in."""
        known = self.sessions.get(location.session_id)
        if known is not None and location.sequence <= known.sequence:
            self.ignored_locations += 1
            return False
        version = sys.intern(location.model_version)  # one string per version, not one per session
        if not self._ours(location.namespace, location.deployment):
            placement = Placement(None, location.sequence, foreign=True)
        elif location.held and location.pod:
            holder = self.pods.get(location.pod)
            if holder is None:
                holder = self.pods[location.pod] = PodIncarnation(location.pod)
            placement = Placement(holder, location.sequence, tokens=location.token_count, version=version)
        else:
            was = None  # the pod that held it, when the registry forgot it with its pod; never for a preemption
            if known is not None:
                was = (known.holder or known.was) if location.reason == "forgotten" else known.was
            placement = Placement(None, location.sequence, tokens=location.token_count, version=version, was=was)
        self._first_picks.pop(location.session_id, None)  # its holder is known now (or that nothing holds it)
        if known is not None:
            del self.sessions[location.session_id]  # re-inserted last: the dict's order is the order of change
            _credit(known, -1)
        self.sessions[location.session_id] = placement
        _credit(placement, 1)
        while len(self.sessions) > self.max_sessions:
            _credit(self.sessions.pop(next(iter(self.sessions))), -1)
        return True

    # -- picking --------------------------------------------------------------------------------------------------
    def _rank_key(self, pod: PodIncarnation, now: float) -> tuple[int, float, str]:
        """Least loaded first; pods with no fresh report after those with one; pods on a cordoned node after all
        the others (whatever they take they hand on soon); by name among equals. The first element is the class:
        ``UNKNOWN`` set for no fresh report, ``LEAVING`` set for a cordoned node."""
        used = pod.utilisation(now, self.load_stale_s)
        rank = LEAVING if pod.leaving else 0
        return (rank | UNKNOWN, 0.0, pod.name) if used is None else (rank, used, pod.name)

    def _all_full(self, order: list[tuple[int, float, str]]) -> bool:
        """Every pod of ``order`` (kept sorted, not empty) has a fresh load at ``shed_at`` or above: no pod's load
        is unknown, and the least full of the pods staying and of those leaving (each class's head) are full."""
        staying_end = bisect.bisect_left(order, (UNKNOWN, -1.0, ""))
        leaving_at = bisect.bisect_left(order, (LEAVING, -1.0, ""))
        if staying_end < leaving_at or order[-1][0] & UNKNOWN:
            return False
        heads = [order[i] for i in (0, leaving_at) if i < len(order)]
        return all(used >= self.shed_at for _, used, _ in heads)

    def _ranked(self, now: float) -> list[tuple[int, float, str]]:
        """``_order``, built again when it is missing or a load it ranks went stale (rare: a pod that stopped
        reporting); otherwise kept by ``on_load``, one entry per report."""
        stale = self._oldest_load is not None and now - self._oldest_load > self.load_stale_s
        if self._order is None or stale:
            self._keys = {p.name: self._rank_key(p, now) for p in self.pods.values() if p.serves}
            self._order = sorted(self._keys.values())
            known = [p.load_at for p in self.pods.values() if p.serves and p.load_at is not None]
            fresh = [at for at in known if now - at <= self.load_stale_s]
            self._oldest_load = min(fresh) if fresh else None
        return self._order

    def pick(self, facts: RequestFacts, now: float, *, count: bool = True) -> Pick:
        """The endpoints for one request: the session's holder first when it can serve, then the least loaded pods
        (by KV-cache utilisation; pods with no fresh report after those with one, pods on a cordoned node last);
        within ``facts.subset`` when the gateway gave one. A session no serving pod holds goes first to the pods
        holding its checkpoint's model version (a checkpoint restores only into it: ``Placement.needs``), the
        others after them. 503 when no endpoint can serve; 429 when no holder can take it and every candidate is
        at ``shed_at`` or above. A session never heard of goes first where its
        first request went, within ``first_pick_s`` (module doc). Changes nothing but the counters, the kept order
        of the pods by load and those first picks; ``count`` False leaves the counters (a request that will pick
        again: the handover wait counts its last pick only, ``count``).

        Without a subset the pick reads the head of the pods kept in order (``_ranked``): its cost does not grow
        with the pool (2,000 pods: bench/router.py), but for a session to restore whose version few pods hold (a
        rollout's pinned sessions), which walks the order until it finds them."""
        chosen = self._choose(facts, now)
        if chosen.outcome is Outcome.UNKNOWN_SESSION and chosen.first_pod:
            self._remember_first(facts.session, self.pods[chosen.first_pod], now)
        return self._count(chosen) if count else chosen

    def _remember_first(self, session: str, pod: PodIncarnation, now: float) -> None:
        """Keep (or renew) the pod a session never heard of was sent to; forget those past ``first_pick_s`` and the
        oldest beyond ``max_first_picks``. Amortised O(1): the dict is in order of time."""
        self._first_picks.pop(session, None)
        self._first_picks[session] = (pod, now)
        while self._first_picks:
            name, (_, at) = next(iter(self._first_picks.items()))
            if now - at <= self.first_pick_s and len(self._first_picks) <= self.max_first_picks:
                break
            del self._first_picks[name]

    def _first_pick(self, session: str, now: float) -> PodIncarnation | None:
        """Where the session's first request went, when that was within ``first_pick_s``."""
        kept = self._first_picks.get(session)
        if kept is None or now - kept[1] > self.first_pick_s:
            return None
        return kept[0]

    def _choose(self, facts: RequestFacts, now: float) -> Pick:
        """``pick``'s answer, not counted."""
        if facts.subset is None:
            return self._pick_in_pool(facts, now)
        candidates = [p for p in self.pods.values() if p.serves]
        if facts.subset is not None:
            candidates = [p for p in candidates if p.endpoint in facts.subset]
        if not candidates:
            reason = "no ready endpoint in the pool"
            if facts.subset is not None:
                reason = "none of the gateway's candidate endpoints is a ready pod of the pool"
            return Pick(Outcome.NO_ENDPOINT, status=503, reason=reason)
        keys = {id(p): self._rank_key(p, now) for p in candidates}
        ranked = sorted(candidates, key=lambda p: keys[id(p)])
        outcome, holder, refused = self._holder(facts, candidates, now)
        unserved = False
        if holder is not None:
            ranked.remove(holder)
            ranked.insert(0, holder)
        elif all(not keys[id(p)][0] & UNKNOWN and keys[id(p)][1] >= self.shed_at for p in candidates):
            return Pick(Outcome.SHED, status=429, reason="every pod's KV cache is full", refused_session=refused)
        elif needs := self._needs(facts.session, outcome):
            holding = [p for p in ranked if p.holds(needs)]
            unserved = not holding
            ranked = holding + [p for p in ranked if not p.holds(needs)]
        endpoints = tuple(p.endpoint for p in ranked[: 1 + self.fallbacks])
        return Pick(outcome, endpoints, refused_session=refused, first_pod=ranked[0].name, version_unserved=unserved)

    def _pick_in_pool(self, facts: RequestFacts, now: float) -> Pick:
        """``pick`` among every serving pod of the pool, from the kept order (the same answer as a full sort)."""
        order = self._ranked(now)
        if not order:
            return Pick(Outcome.NO_ENDPOINT, status=503, reason="no ready endpoint in the pool")
        outcome, holder, refused = self._holder(facts, None, now)
        if holder is None and self._all_full(order):
            return Pick(Outcome.SHED, status=429, reason="every pod's KV cache is full", refused_session=refused)
        chosen = [holder] if holder is not None else []
        needs = self._needs(facts.session, outcome) if holder is None else frozenset()
        others: list[PodIncarnation] = []  # pods that cannot restore the session's version: after those that can
        for _, _, name in order:
            if len(chosen) > self.fallbacks:
                break
            pod = self.pods[name]
            if pod is holder:
                continue
            if needs and not pod.holds(needs):
                if len(others) <= self.fallbacks:
                    others.append(pod)
                continue
            chosen.append(pod)
        unserved = bool(needs) and not chosen
        chosen += others
        endpoints = tuple(p.endpoint for p in chosen[: 1 + self.fallbacks])
        return Pick(outcome, endpoints, refused_session=refused, first_pod=chosen[0].name, version_unserved=unserved)

    def _needs(self, session: str, outcome: Outcome) -> frozenset[str]:
        """The model versions a pod must hold to restore a session that no serving pod holds (``Placement.needs``;
        empty when any pod will do, or the session is not to be restored)."""
        placement = self.sessions.get(session) if outcome in (Outcome.UNPLACED, Outcome.HOLDER_GONE) else None
        return placement.needs() if placement is not None else frozenset()

    def _holder(
        self, facts: RequestFacts, candidates: list[PodIncarnation] | None, now: float
    ) -> tuple[Outcome, PodIncarnation | None, str]:
        """The pod to put first (the session's holder, or where a new session's first request went) and why."""
        if facts.session_problem:
            return Outcome.REFUSED_SESSION, None, facts.session_problem
        if not facts.session:
            return Outcome.NO_SESSION, None, ""
        placement = self.sessions.get(facts.session)
        if placement is None:
            first = self._first_pick(facts.session, now)
            if first is not None and (first.serves if candidates is None else (first.current and first in candidates)):
                return Outcome.UNKNOWN_SESSION, first, ""
            return Outcome.UNKNOWN_SESSION, None, ""
        if placement.foreign:
            return Outcome.REFUSED_SESSION, None, f"session {facts.session} belongs to another deployment"
        holder = placement.holder
        if holder is None:
            return Outcome.UNPLACED, None, ""
        if holder.serves if candidates is None else (holder.current and holder in candidates):
            return Outcome.HOLDER, holder, ""
        return Outcome.HOLDER_GONE, None, ""

    def count(self, pick: Pick) -> Pick:
        """Count a pick made outside ``pick`` (the handover wait's 503)."""
        return self._count(pick)

    def _count(self, pick: Pick) -> Pick:
        self.picks[pick.outcome.value] += 1
        self.version_unserved += pick.version_unserved
        return pick

    # -- status ---------------------------------------------------------------------------------------------------
    def status(self) -> dict[str, object]:
        return {
            "pool": f"{self.namespace}/{self.deployment}",
            "pods_serving": sum(1 for p in self.pods.values() if p.serves),
            "sessions_known": len(self.sessions),
            "new_sessions_pending": len(self._first_picks),
            "picks": dict(self.picks),
            "version_unserved": self.version_unserved,
        }
