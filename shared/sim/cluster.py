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
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar, cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError
from redis.typing import EncodableT, FieldT

from shared.contract.subjects import Subjects
from shared.plumbing.configsync import redis_client
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
_WATCH_RETRY_S = 0.5
_LAST_SEQ = 2**64 - 1
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


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
            cluster.created = await cluster._transact(lambda current, now: _create_step(spec, current, now))
        except BaseException:
            await cluster.close()
            raise
        if cluster.created:
            log.info("simulated cluster created from the spec: %d nodes", len(spec.nodes))
        return cluster

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
            try:
                reply = await self._client.xread(
                    {self._changes_key: _stream_id(*last)}, count=_WATCH_BATCH, block=_WATCH_BLOCK_MS
                )
                if not reply and last[0] > 0:
                    await self._still_there(last[0])
            except _REDIS_DOWN as exc:
                log.warning("simulated cluster watch: Redis unreachable (%s); retrying", exc)
                await asyncio.sleep(_WATCH_RETRY_S)
                continue
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

    async def _still_there(self, revision: int) -> None:
        """An idle watch checks that the changes it follows still reach ``revision``. Redis restarted without its
        data (or a cluster made afresh) starts the revisions again from 1, and a watch after ``revision`` would
        wait for ever; it says so instead, and ``revision`` (where the next watch starts) follows the store back."""
        newest: Any = await self._client.xrevrange(self._changes_key, count=1)
        now = int(_text(newest[0][0]).split("-")[0]) if newest else 0
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
                        return result
                    except WatchError:
                        continue
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc

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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(reply: Any) -> Iterator[tuple[str, Mapping[bytes | str, bytes | str]]]:
    """The entries of an XREAD reply on one stream, in RESP2 (a list of pairs) or RESP3 (a dict) shape."""
    streams = reply.values() if isinstance(reply, dict) else (entries for _key, entries in reply or ())
    for entries in streams:
        for entry_id, fields in entries:
            yield _text(entry_id), fields


def _change_from(revision: str, fields: Mapping[bytes | str, bytes | str]) -> ClusterChange:
    values = {_text(k): _text(v) for k, v in fields.items()}
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
