"""The simulated cluster adapter: ``ClusterPort`` over a small control plane whose state lives in Redis.

The whole ``ClusterState`` (``shared.sim.clusterstate``) is one msgpack value under ``<root>:sim:cluster``, so every
process attached to the same root sees one cluster. Each mutation is an optimistic transaction: WATCH and read the
state, apply the operation and ``reconcile``, then in one MULTI/EXEC write the state and append each change to the
stream ``<root>:sim:cluster:changes``; a concurrent writer makes EXEC fail and the mutation is redone on the new
state, so no update is ever lost.

Every write bumps ``ClusterState.revision`` and its changes get the stream ids ``<revision>-0``, ``<revision>-1``, ...
A write always has at least one change, so the revisions in the stream are dense, and the revision a reader saw
with its last listing is exactly where its watch must start (Kubernetes' list-then-watch by resourceVersion).

The preStop hook is a conversation with the workload: a pod turning Terminating is how the workload learns that it
must save its state (it watches the pods on its nodes), and ``mark_prestop_done`` is how it says it has. ``tick``
reconciles with the clock, so that a pod whose workload never answers is killed when its grace period runs out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar, cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError
from redis.typing import EncodableT, FieldT

from shared.contract.subjects import Subjects
from shared.plumbing.configsync import redis_client
from shared.plumbing.replies import as_text
from shared.plumbing.retries import SIM_REDIS
from shared.plumbing.settings import RedisSettings
from shared.ports.cluster import (
    NODE_NAME_EXTRA,
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    ClusterChange,
    ClusterError,
    DeploymentInfo,
    EvictionOutcome,
    NodeInfo,
    PodInfo,
    TokenReview,
)
from shared.sim.clusterstate import ClusterState, SimDeployment, SimNode, SimPod, from_spec, object_key
from shared.sim.gpus import raise_if_cancelled
from shared.sim.spec import SimSpec, load_spec
from shared.sim.tokens import TokenClaims, TokenInvalid, service_account_uid
from shared.sim.tokens import sign as sign_token
from shared.sim.tokens import verify as verify_token

log = logging.getLogger(__name__)

T = TypeVar("T")
Clock = Callable[[], float]
Step = Callable[[ClusterState | None, float], tuple[T, ClusterState | None, list[ClusterChange]]]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ClusterState)
_STREAM_MAXLEN = 10_000
_WATCH_BLOCK_MS = 1_000
_WATCH_BATCH = 512
_LAST_SEQ = 2**64 - 1
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


def _redis_down(exc: Exception) -> bool:
    return isinstance(exc, _REDIS_DOWN)


def _watch_unreachable(exc: Exception, wait_s: float) -> None:
    log.warning("simulated cluster watch: Redis unreachable (%s); retrying in %.2f s", exc, wait_s)


def _informer_again(exc: Exception) -> bool:
    return isinstance(exc, (ClusterError, *_REDIS_DOWN))


def _informer_failed(exc: Exception, wait_s: float) -> None:
    if isinstance(exc, _REDIS_DOWN):
        log.warning("simulated cluster informer: Redis unreachable (%s); retrying in %.2f s", exc, wait_s)


class SimCluster:
    """A simulated cluster (``simulated = True``) shared through Redis by every process on the same root.

    Safe for concurrent use from many processes: mutations are compare-and-set transactions, retried until they
    apply to the newest state. Redis being unreachable raises ``ClusterError``; ``watch`` waits and resumes.
    """

    simulated = True

    def __init__(
        self, client: aioredis.Redis, subjects: Subjects, clock: Clock = time.time, *, owns_client: bool = False
    ) -> None:
        """Attach to the cluster under ``subjects.root`` (which ``create`` makes, here or in another process)."""
        self._client = client
        self._subjects = subjects
        self._state_key = subjects.redis_key("sim", "cluster")
        self._changes_key = subjects.redis_key("sim", "cluster", "changes")
        self._token_key_key = subjects.redis_key("sim", "cluster", "token-key")
        self._clock = clock
        self._owns_client = owns_client
        self._seen = 0
        self.created = False
        """True when this instance's ``create`` made the cluster, False when it found one."""

    @classmethod
    async def create(
        cls,
        redis: RedisSettings | aioredis.Redis,
        subjects: Subjects,
        spec: SimSpec | None = None,
        clock: Clock = time.time,
    ) -> SimCluster:
        """Attach to the cluster under ``subjects.root``, creating it from ``spec`` when there is none.

        Without a spec, ``load_spec()`` reads ``GPUWARDEN_SIM_SPEC`` (or takes the default spec: node-1..node-3
        with 2 GPUs each). The spec is loaded before Redis is touched, so a bad spec (``SpecError`` naming the
        field) writes nothing. Of several processes creating at once, exactly one creates and the others attach;
        an existing cluster is kept as it is, whatever the spec says.
        """
        spec = load_spec() if spec is None else spec
        if isinstance(redis, RedisSettings):
            cluster = cls(redis_client(redis), subjects, clock, owns_client=True)
        else:
            cluster = cls(redis, subjects, clock)
        try:
            await cluster.ensure(spec)
        except BaseException:
            await cluster.close()
            raise
        return cluster

    async def present(self) -> bool:
        """Whether Redis holds the cluster (one cheap command, nothing decoded)."""
        try:
            return bool(await self._client.exists(self._state_key))
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc

    async def ensure(self, spec: SimSpec) -> bool:
        """Create the cluster from ``spec`` unless one exists (kept as it is); says whether it was created."""
        self.created = await self._transact(functools.partial(_create_step, spec))
        if self.created:
            log.info("simulated cluster created from the spec: %d nodes", len(spec.nodes))
        return self.created

    # -- reading ------------------------------------------------------------------------------------------------
    async def nodes(self) -> list[NodeInfo]:
        state = await self._read()
        return [_node_info(n) for n in sorted(state.nodes.values(), key=lambda n: n.name)]

    async def node(self, name: str) -> NodeInfo | None:
        found = (await self._read()).nodes.get(name)
        return None if found is None else _node_info(found)

    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[PodInfo]:
        """Pods in creation order, on ``node`` and in ``namespace`` when given."""
        state = await self._read()
        return [
            _pod_info(p)
            for p in sorted(state.pods.values(), key=lambda p: p.created_seq)
            if (node is None or p.node == node) and (namespace is None or p.namespace == namespace)
        ]

    async def gpu_holders(self, node: str) -> dict[int, list[str]]:
        """GPU index on ``node`` -> the pods holding it (``namespace/name``): the simulation's stand-in for the
        kubelet's PodResources API. (Simulation only: the cluster port does not know which GPU a pod holds.)"""
        return (await self._read()).gpu_holders(node)

    async def deployments(self, namespace: str | None = None) -> list[DeploymentInfo]:
        state = await self._read()
        return [
            _deployment_info(d)
            for d in sorted(state.deployments.values(), key=lambda d: d.key)
            if namespace is None or d.namespace == namespace
        ]

    @property
    def revision(self) -> int:
        """The newest revision this instance has read, written or watched; ``watch`` starts after it."""
        return self._seen

    # -- writing ------------------------------------------------------------------------------------------------
    async def cordon(self, node: str) -> None:
        await self._mutate(lambda state, now: (None, state.cordon(node)))

    async def uncordon(self, node: str) -> None:
        await self._mutate(lambda state, now: (None, state.uncordon(node)))

    async def set_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set labels; a value of None removes the label."""
        await self._mutate(lambda state, now: (None, state.set_labels(node, labels)))

    async def set_node_annotations(self, node: str, annotations: Mapping[str, str | None]) -> None:
        await self._mutate(lambda state, now: (None, state.set_annotations(node, annotations)))

    async def update_node(
        self,
        node: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        schedulable: bool | None = None,
        expect: str = "",
    ) -> NodeInfo:
        """One transaction; with ``expect``, a compare-and-set on the node's revision (``ClusterConflict``)."""

        def update(state: ClusterState, now: float) -> tuple[SimNode, list[ClusterChange]]:
            changes = state.update_node(node, labels or {}, annotations or {}, schedulable, expect)
            return state.node(node), changes  # stamped with the write's revision before it is stored

        return _node_info(await self._mutate(update))

    async def evict(self, namespace: str, pod: str) -> EvictionOutcome:
        """EVICTED: the pod is Terminating and its replacement is on its way; BLOCKED_BY_PDB: try again later."""
        return await self._mutate(lambda state, now: state.evict(namespace, pod, now))

    async def scale(self, namespace: str, deployment: str, replicas: int) -> None:
        await self._mutate(lambda state, now: (None, state.scale(namespace, deployment, replicas)))

    async def create_deployment(
        self,
        namespace: str,
        name: str,
        replicas: int,
        *,
        gpus_per_pod: int = 1,
        max_unavailable: int = 1,
        grace_period_s: float = 30.0,
    ) -> None:
        """A deployment the spec did not have, its pods made and bound at once (``kubectl create deployment``);
        the simulation's workload does not play them: whoever made it does. Idempotent. (Simulation only.)"""
        deployment = SimDeployment(
            name=name,
            namespace=namespace,
            replicas=replicas,
            gpus_per_pod=gpus_per_pod,
            max_unavailable=max_unavailable,
            grace_period_s=grace_period_s,
            labels={"app": name},
        )
        await self._mutate(lambda state, now: (None, state.add_deployment(deployment)))

    async def mark_prestop_done(self, namespace: str, pod: str) -> None:
        """The workload has run the pod's preStop hook; the pod goes now. Idempotent. (Simulation only: a real
        pod's preStop ends when its hook returns.)"""
        await self._mutate(lambda state, now: (None, state.mark_prestop_done(namespace, pod)))

    async def tick(self) -> None:
        """Reconcile at the clock's time: kill Terminating pods whose grace period has run out. Idempotent."""
        await self._mutate(lambda state, now: (None, []))

    # -- service-account tokens -----------------------------------------------------------------------------------
    async def issue_token(
        self,
        namespace: str,
        pod: str = "",
        audience: str = "gpuwarden",
        ttl_s: float = 3600.0,
        service_account: str = "default",
    ) -> str:
        """A service-account token as a kubelet projects it into a pod (``pod`` given: bound to it, naming its UID
        and node) or as the TokenRequest API gives one to a service account alone. (Simulation only: the stand-in
        for the kubelet's projected volume.) ``ClusterError`` for a pod that is not in the cluster."""
        bound = ""
        uid = ""
        node = ""
        if pod:
            found = (await self._read()).pods.get(object_key(namespace, pod))
            if found is None:
                raise ClusterError(f"pod {object_key(namespace, pod)} is not in the simulated cluster")
            bound, uid, node = found.name, found.uid, found.node
        now = int(self._clock())
        claims = TokenClaims(
            namespace=namespace,
            service_account=service_account,
            audiences=(audience,),
            expires_at=now + int(ttl_s),
            issued_at=now,
            pod=bound,
            pod_uid=uid,
            node=node,
        )
        return sign_token(claims, await self._token_key())

    async def review_token(self, token: str, audiences: tuple[str, ...]) -> TokenReview:
        """The TokenReview API: the token's signature (the cluster's own key), expiry and audience, and for a
        bound token that its pod is still there, the same pod (UID), and running (Running, or Terminating while
        its preStop hook saves); whose it is, as Kubernetes says it."""
        try:
            claims = verify_token(token, await self._token_key(), self._clock(), audiences)
        except TokenInvalid as exc:
            return TokenReview(authenticated=False, error=f"invalid bearer token, {exc}")
        extra: dict[str, tuple[str, ...]] = {}
        if claims.pod:
            found = (await self._read()).pods.get(object_key(claims.namespace, claims.pod))
            if found is None or found.uid != claims.pod_uid:
                return TokenReview(authenticated=False, error="invalid bearer token, the pod it is bound to is gone")
            if found.phase not in ("Running", "Terminating"):
                return TokenReview(authenticated=False, error=f"invalid bearer token, its pod is {found.phase}")
            extra = {POD_NAME_EXTRA: (claims.pod,), POD_UID_EXTRA: (claims.pod_uid,)}
            if claims.node:
                extra[NODE_NAME_EXTRA] = (claims.node,)
        return TokenReview(
            authenticated=True,
            username=claims.username,
            uid=service_account_uid(claims.namespace, claims.service_account),
            groups=("system:serviceaccounts", f"system:serviceaccounts:{claims.namespace}", "system:authenticated"),
            extra=extra,
            audiences=tuple(a for a in claims.audiences if not audiences or a in audiences),
        )

    async def _token_key(self) -> bytes:
        """The key the simulated cluster signs its tokens with, made once per cluster (kept in Redis with it)."""
        try:
            await self._client.set(self._token_key_key, secrets.token_bytes(32), nx=True)
            key = await self._client.get(self._token_key_key)
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc
        if not isinstance(key, bytes) or len(key) != 32:
            raise ClusterError(f"the simulated cluster's token key at {self._token_key_key} is unreadable")
        return key

    # -- watching -----------------------------------------------------------------------------------------------
    def watch(self) -> AsyncIterator[ClusterChange]:
        """Every change after ``revision``, in order, each with its stream id as ``revision``.

        A caller that lists (``nodes``, ``pods``) and then watches misses nothing. Raises ``ClusterError`` when the
        stream has been trimmed past the starting point: list again and watch anew.
        """
        return self._follow(self._seen)

    async def _follow(self, after: int) -> AsyncIterator[ClusterChange]:
        last = (after, _LAST_SEQ)
        while True:
            reply = await SIM_REDIS.call(
                functools.partial(self._changes_after, last), when=_redis_down, note=_watch_unreachable
            )
            for entry_id, fields in _entries(reply):
                revision, seq = (int(part) for part in entry_id.split("-"))
                if (revision, seq) not in ((last[0], last[1] + 1), (last[0] + 1, 0)):
                    raise ClusterError(
                        f"simulated cluster watch: changes after {_stream_id(*last)} are gone (trimmed, or the "
                        f"cluster was made afresh; next is {entry_id}); list again and watch anew"
                    )
                last = (revision, seq)
                self._seen = max(self._seen, revision)
                yield _change_from(entry_id, fields)

    async def _changes_after(self, last: tuple[int, int]) -> Any:
        """One blocking read of the changes after ``last``; an idle one checks that they still reach it."""
        reply = await self._client.xread(
            {self._changes_key: _stream_id(*last)}, count=_WATCH_BATCH, block=_WATCH_BLOCK_MS
        )
        if not reply and last[0] > 0:
            await self._still_there(last[0])
        return reply

    async def _still_there(self, revision: int) -> None:
        """An idle watch checks that the changes it follows still reach ``revision``. Redis restarted without its
        data (or a cluster made afresh) starts the revisions again from 1, and a watch after ``revision`` would
        wait for ever; it says so instead, and ``revision`` (where the next watch starts) follows the store back."""
        newest: Any = await self._client.xrevrange(self._changes_key, count=1)
        now = int(as_text(newest[0][0]).split("-")[0]) if newest else 0
        if now < revision:
            self._seen = now
            raise ClusterError(
                f"simulated cluster watch: the changes went back from revision {revision} to {now} (Redis lost them, "
                "or the cluster was made afresh); list again and watch anew"
            )

    # -- the transaction ----------------------------------------------------------------------------------------
    async def _read(self) -> ClusterState:
        try:
            raw = await self._client.get(self._state_key)
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc
        if raw is None:
            raise self._absent()
        state = self._decode(raw)
        self._seen = max(self._seen, state.revision)
        return state

    async def _mutate(self, operation: Callable[[ClusterState, float], tuple[T, list[ClusterChange]]]) -> T:
        def step(current: ClusterState | None, now: float) -> tuple[T, ClusterState | None, list[ClusterChange]]:
            if current is None:
                raise self._absent()
            result, changes = operation(current, now)
            return result, current, changes + current.reconcile(now)

        return await self._transact(step)

    async def _transact(self, step: Step[T]) -> T:
        """Run ``step`` on the newest state and commit what it returns, retrying while other writers win.

        ``step`` gets the stored state (None when there is none) and the time, and returns its result, the state
        to store and the changes that led there; with no changes nothing is written.
        """
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(self._state_key)
                        raw = await pipe.get(self._state_key)
                        current = None if raw is None else self._decode(raw)
                        if current is not None:
                            self._seen = max(self._seen, current.revision)
                        result, state, changes = step(current, self._clock())
                        if state is None or not changes:
                            return result
                        state.revision += 1
                        state.stamp(changes)
                        pipe.multi()
                        if current is None:
                            pipe.delete(self._changes_key)
                        pipe.set(self._state_key, _ENCODER.encode(state))
                        for seq, change in enumerate(changes):
                            pipe.xadd(
                                self._changes_key,
                                _fields(change),
                                id=_stream_id(state.revision, seq),
                                maxlen=_STREAM_MAXLEN,
                                approximate=True,
                            )
                        await pipe.execute()
                        self._seen = max(self._seen, state.revision)
                        self._committed(state)
                        return result
                    except WatchError:
                        continue
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc

    def _committed(self, state: ClusterState) -> None:
        """Called with the state a transaction of this instance has just stored (it is not changed after)."""

    def _decode(self, raw: object) -> ClusterState:
        try:
            if not isinstance(raw, bytes):
                raise msgspec.DecodeError("the Redis client must not decode responses")
            return _DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise ClusterError(
                f"the simulated cluster at {self._state_key} is unreadable ({exc}); delete {self._state_key} and "
                f"{self._changes_key} to start it afresh from the spec"
            ) from None

    def _absent(self) -> ClusterError:
        return ClusterError(f"no simulated cluster at {self._state_key}: SimCluster.create makes one from the spec")

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


Operation = Callable[[ClusterState, float], tuple[Any, list[ClusterChange]]]
WatchKinds = frozenset[str] | None


class SharedSimCluster(SimCluster):
    """The simulated cluster for everything one process hosts (the hollow host's nodes), as Kubernetes' shared
    informers serve many controllers of one process.

    - One follower reads the change stream and keeps the newest state decoded; reads are answered from that copy
      while the follower has heard from Redis within ``FRESH_S``, and a write of this process is seen by its next
      read at once. Otherwise a read goes to Redis as ``SimCluster``'s does (``ClusterError`` while Redis does not
      answer), one at a time: readers that come while one read is on its way share its answer, so a thousand
      agents reading at once decode the cluster once, not a thousand times.
    - Each ``view`` (an agent's ``ClusterPort``) watches only what it asked for: a view of one node's changes
      is woken by that node's changes alone, not by every change of the fleet.
    - Writes that arrive together, from any number of views, are applied in one transaction on the state read
      inside it, in the order they came, each one still refused on its own (a stale ``expect`` is a
      ``ClusterConflict`` for that write only: a node one write of the batch changed carries the batch's new
      revision for the writes after it). Redis stays the one truth.
    """

    FRESH_S = 10.0
    """Reads use the copy while the follower heard from Redis this recently (its blocking read returns every
    second when nothing changes; a busy process may answer it late)."""
    HISTORY = 10_000
    """Changes kept for watches that start behind the newest one."""

    def __init__(
        self, client: aioredis.Redis, subjects: Subjects, clock: Clock = time.time, *, owns_client: bool = False
    ) -> None:
        super().__init__(client, subjects, clock, owns_client=owns_client)
        self._state: ClusterState | None = None
        self._heard = 0.0
        self._history: deque[tuple[tuple[int, int], ClusterChange]] = deque(maxlen=self.HISTORY)
        self._history_from = 0
        self._last: tuple[int, int] | None = None
        """The newest change the informer has handed on; None: read the cluster (again) first."""
        self._by_node: dict[str, set[asyncio.Queue[ClusterChange | ClusterError]]] = {}
        self._filtered: dict[asyncio.Queue[ClusterChange | ClusterError], tuple[WatchKinds, str | None]] = {}
        self._pending: list[tuple[Operation, asyncio.Future[Any]]] = []
        self._committer: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._reading: asyncio.Future[ClusterState] | None = None
        self.batches = 0
        """Transactions written by the group commit (each holding one or more writes)."""

    def start(self) -> None:
        """Start following the change stream (idempotent)."""
        if self._follower is None or self._follower.done():
            self._follower = asyncio.create_task(self._follow_changes(), name="sim-cluster-informer")

    def watch(self) -> AsyncIterator[ClusterChange]:
        return self.follow(self._seen, None, None)

    async def tick(self) -> None:
        """As ``SimCluster.tick``; nothing to do (and nothing read from Redis) while the copy is fresh and holds
        no Terminating pod: the clock changes nothing else (every write reconciles as it is made)."""
        state = self._state
        fresh = state is not None and time.monotonic() - self._heard < self.FRESH_S
        if fresh and state is not None and not any(p.phase == "Terminating" for p in state.pods.values()):
            return
        await super().tick()

    def view(self, kinds: Iterable[str] | None = None, node: str | None = None) -> SimClusterView:
        """A ``ClusterPort`` over this cluster whose watch yields only changes of ``kinds`` (and, for node
        changes, of ``node``); closing it closes nothing shared."""
        return SimClusterView(self, frozenset(kinds) if kinds is not None else None, node)

    @property
    def live(self) -> bool:
        return self._state is not None and time.monotonic() - self._heard < self.FRESH_S

    # -- reads ----------------------------------------------------------------------------------------------------
    async def _read(self) -> ClusterState:
        state = self._state
        if state is not None and time.monotonic() - self._heard < self.FRESH_S:
            return state
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_through())
        return await asyncio.shield(self._reading)

    async def _read_through(self) -> ClusterState:
        state = await super()._read()
        self._adopt(state)
        return state

    def _committed(self, state: ClusterState) -> None:
        self._adopt(state)

    def _adopt(self, state: ClusterState) -> None:
        if self._state is None or state.revision >= self._state.revision:
            self._state = state

    async def _follow_changes(self) -> None:
        """Runs for the informer's lifetime, one read of the change stream after another (``_next_changes``):
        Redis away, or changes gone from the stream (the cluster is read again), tried again as
        ``retries.SIM_REDIS`` says."""
        while True:
            await SIM_REDIS.call(self._next_changes, when=_informer_again, note=_informer_failed)

    async def _next_changes(self) -> None:
        """Read the cluster when there is no revision to follow from, then one blocking read of the changes after
        it, handed to the watches. Redis away: ``_REDIS_DOWN``; changes gone: ``ClusterError``, each watch told
        (list again and watch anew) and the cluster read again next time."""
        try:
            last = self._last
            if last is None:
                state = await super()._read()
                self._adopt(state)
                last = self._last = (state.revision, _LAST_SEQ)
                self._history.clear()
                self._history_from = state.revision
                self._heard = time.monotonic()
            reply = await self._client.xread(
                {self._changes_key: _stream_id(*last)}, count=_WATCH_BATCH, block=_WATCH_BLOCK_MS
            )
            raise_if_cancelled()
            self._heard = time.monotonic()
            entries = list(_entries(reply))
            if not entries:
                if last[0] > 0:
                    await self._still_there(last[0])
                return
            changes: list[tuple[tuple[int, int], ClusterChange]] = []
            for entry_id, fields in entries:
                key = _revision_key(entry_id)
                expected = [(last[0] + 1, 0)] + ([(last[0], last[1] + 1)] if last[1] != _LAST_SEQ else [])
                if key not in expected:
                    raise ClusterError(
                        f"changes after {_stream_id(*last)} are gone (trimmed, or the cluster was made afresh; "
                        f"next is {entry_id})"
                    )
                last = self._last = key
                changes.append((last, _change_from(entry_id, fields)))
            if self._state is None or last[0] > self._state.revision:
                self._adopt(await super()._read())
            for key, change in changes:
                self._history.append((key, change))
                self._notify(change)
        except ClusterError as exc:
            log.info("simulated cluster informer: %s; reading the cluster again", exc)
            self._fail_watchers(exc)
            self._state, self._heard, self._last = None, 0.0, None
            raise
        except _REDIS_DOWN:
            self._heard = 0.0
            raise

    # -- watches --------------------------------------------------------------------------------------------------
    def _notify(self, change: ClusterChange) -> None:
        if change.kind == "node":
            for queue in self._by_node.get(change.name, ()):
                queue.put_nowait(change)
        for queue, (kinds, node) in self._filtered.items():
            if _selects(change, kinds, node):
                queue.put_nowait(change)

    def _fail_watchers(self, exc: ClusterError) -> None:
        for queues in self._by_node.values():
            for queue in queues:
                queue.put_nowait(exc)
        for queue in self._filtered:
            queue.put_nowait(exc)

    async def follow(self, after: int, kinds: WatchKinds, node: str | None) -> AsyncIterator[ClusterChange]:
        """The changes after revision ``after`` that ``kinds`` and ``node`` select (``after`` 0: from now on).
        Raises ``ClusterError`` when changes after ``after`` are no longer held: list again and watch anew."""
        queue: asyncio.Queue[ClusterChange | ClusterError] = asyncio.Queue()
        indexed = node is not None and kinds == frozenset({"node"})
        if indexed:
            assert node is not None
            self._by_node.setdefault(node, set()).add(queue)
        else:
            self._filtered[queue] = (kinds, node)
        try:
            newest = (after, _LAST_SEQ)
            if after > 0:
                if after < self._history_from:
                    raise ClusterError(
                        f"simulated cluster watch: changes after revision {after} are no longer held; list again"
                    )
                for key, change in list(self._history):
                    if key > newest and _selects(change, kinds, node):
                        newest = key
                        yield change
            while True:
                item = await queue.get()
                if isinstance(item, ClusterError):
                    raise item
                key = _revision_key(item.revision)
                if key > newest or after == 0:
                    newest = max(newest, key)
                    yield item
        finally:
            if indexed:
                assert node is not None
                watchers = self._by_node.get(node)
                if watchers is not None:
                    watchers.discard(queue)
                    if not watchers:
                        del self._by_node[node]
            else:
                self._filtered.pop(queue, None)

    # -- writes ---------------------------------------------------------------------------------------------------
    async def _mutate(self, operation: Callable[[ClusterState, float], tuple[T, list[ClusterChange]]]) -> T:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((operation, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_pending(), name="sim-cluster-group-commit")
        result: T = await future
        return result

    async def _commit_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                outcomes = await self._transact(functools.partial(self._batch_step, batch))
            except BaseException as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            self.batches += 1
            for (_, future), (ok, value) in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    def _batch_step(
        self, batch: list[tuple[Operation, asyncio.Future[Any]]], current: ClusterState | None, now: float
    ) -> tuple[list[tuple[bool, Any]], ClusterState | None, list[ClusterChange]]:
        if current is None:
            raise self._absent()
        revision = current.revision + 1
        outcomes: list[tuple[bool, Any]] = []
        changes: list[ClusterChange] = []
        for operation, _ in batch:
            try:
                result, made = operation(current, now)
            except Exception as exc:  # refused before it changed anything (ClusterState's operations do)
                outcomes.append((False, exc))
                continue
            made = made + current.reconcile(now)
            for change in made:  # later writes of the batch see the revision this one gives the node
                if change.kind == "node" and change.name in current.nodes:
                    current.nodes[change.name].revision = revision
            changes += made
            outcomes.append((True, result))
        return outcomes, current, changes

    async def close(self) -> None:
        for task in (self._follower, self._committer):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await super().close()


class SimClusterView(SimCluster):
    """One agent's ``ClusterPort`` over a ``SharedSimCluster``: reads and writes go to the shared cluster, its
    watch yields what it selects; ``close`` closes nothing shared. SIMULATED."""

    def __init__(self, shared: SharedSimCluster, kinds: WatchKinds, node: str | None) -> None:
        super().__init__(shared._client, shared._subjects, shared._clock)
        self.shared = shared
        self.kinds = kinds
        self.node_filter = node

    async def _read(self) -> ClusterState:
        state = await self.shared._read()
        self._seen = max(self._seen, state.revision)
        return state

    async def _mutate(self, operation: Callable[[ClusterState, float], tuple[T, list[ClusterChange]]]) -> T:
        result = await self.shared._mutate(operation)
        self._seen = max(self._seen, self.shared.revision)
        return result

    def watch(self) -> AsyncIterator[ClusterChange]:
        return self.shared.follow(self._seen, self.kinds, self.node_filter)

    async def close(self) -> None:
        return None


def _selects(change: ClusterChange, kinds: WatchKinds, node: str | None) -> bool:
    return (kinds is None or change.kind in kinds) and (node is None or change.kind != "node" or change.name == node)


def _revision_key(revision: str) -> tuple[int, int]:
    head, _, seq = revision.partition("-")
    return int(head), int(seq or 0)


def _create_step(
    spec: SimSpec, current: ClusterState | None, now: float
) -> tuple[bool, ClusterState | None, list[ClusterChange]]:
    if current is not None:
        return False, None, []
    state = from_spec(spec)
    changes = state.as_added()
    return True, state, changes + state.reconcile(now)


def _fields(change: ClusterChange) -> dict[FieldT, EncodableT]:
    return {"kind": change.kind, "type": change.type, "name": change.name, "namespace": change.namespace}


def _stream_id(revision: int, seq: int) -> str:
    return f"{revision}-{seq}"


def _entries(reply: Any) -> Iterator[tuple[str, Mapping[bytes | str, bytes | str]]]:
    """The entries of an XREAD reply on one stream, in RESP2 (a list of pairs) or RESP3 (a dict) shape."""
    streams = reply.values() if isinstance(reply, dict) else (entries for _key, entries in reply or ())
    for entries in streams:
        for entry_id, fields in entries:
            yield as_text(entry_id), fields


def _change_from(revision: str, fields: Mapping[bytes | str, bytes | str]) -> ClusterChange:
    values = {as_text(k): as_text(v) for k, v in fields.items()}
    return ClusterChange(
        kind=cast(Literal["node", "pod", "deployment"], values["kind"]),
        type=cast(Literal["ADDED", "MODIFIED", "DELETED"], values["type"]),
        name=values["name"],
        namespace=values.get("namespace", ""),
        revision=revision,
    )


def _node_info(node: SimNode) -> NodeInfo:
    return NodeInfo(
        name=node.name,
        labels=dict(node.labels),
        annotations=dict(node.annotations),
        schedulable=node.schedulable,
        ready=node.ready,
        gpus=node.gpus,
        revision=str(node.revision),
    )


def _pod_info(pod: SimPod) -> PodInfo:
    return PodInfo(
        name=pod.name,
        namespace=pod.namespace,
        node=pod.node,
        deployment=pod.deployment,
        phase=pod.phase,
        gpus=pod.gpus,
        labels=dict(pod.labels),
        uid=pod.uid,
    )


def _deployment_info(deployment: SimDeployment) -> DeploymentInfo:
    return DeploymentInfo(
        name=deployment.name,
        namespace=deployment.namespace,
        replicas=deployment.replicas,
        gpus_per_pod=deployment.gpus_per_pod,
        max_unavailable=deployment.max_unavailable,
        labels=dict(deployment.labels),
    )
