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

import functools
import logging
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
from shared.plumbing.replies import as_text
from shared.plumbing.retries import SIM_REDIS
from shared.plumbing.settings import RedisSettings
from shared.ports.cluster import (
    AllocatedDevice,
    ClusterChange,
    ClusterError,
    DeploymentInfo,
    EvictionOutcome,
    NodeInfo,
    PodInfo,
    ResourceClaimInfo,
    ResourceSlice,
    TokenReview,
)
from shared.sim.clusterstate import ClusterState, SimDeployment, SimNode, SimPod, from_spec, object_key
from shared.sim.resourceapi import SimResourceApi
from shared.sim.spec import SimSpec, load_spec
from shared.sim.tokenapi import SimTokenApi

log = logging.getLogger(__name__)

T = TypeVar("T")
Clock = Callable[[], float]
Slices = Mapping[str, ResourceSlice]
"""The nodes' ResourceSlices by node, read with the state when a deployment asks for GPUs by claim (else empty)."""
POD_CLAIM_SUFFIX = "-gpus"
"""A simulated pod's claim is named ``<pod>-gpus`` (a claim template's request ``gpus``)."""
Step = Callable[[ClusterState | None, float, Slices], tuple[T, ClusterState | None, list[ClusterChange]]]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ClusterState)
_STREAM_MAXLEN = 10_000
WATCH_BLOCK_MS = 1_000
WATCH_BATCH = 512
LAST_SEQ = 2**64 - 1
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


def _redis_down(exc: Exception) -> bool:
    return isinstance(exc, REDIS_DOWN)


def _watch_unreachable(exc: Exception, wait_s: float) -> None:
    log.warning("simulated cluster watch: Redis unreachable (%s); retrying in %.2f s", exc, wait_s)


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
        self._clock = clock
        self._owns_client = owns_client
        self._seen = 0
        self._claims_wanted = True  # whether the state last read asks for devices by claim (unknown: yes)
        self.tokens = SimTokenApi(client, subjects, clock, self._read)
        """The cluster's service-account token API (TokenRequest and TokenReview)."""
        self.resources = SimResourceApi(client, subjects)
        """The cluster's ResourceSlices and ResourceClaims (``resource.k8s.io``)."""
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
        except REDIS_DOWN as exc:
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
        """Pods in creation order, on ``node`` and in ``namespace`` when given. One node's pods come from the
        state's index by node (``ClusterState.pods_by_node``), built once per state read: a reader that keeps the
        state (``SharedSimCluster``) answers each node's pods without looking at the rest of the fleet's."""
        state = await self._read()
        if node is not None:
            found: list[SimPod] = state.pods_by_node().get(node, [])
        else:
            found = sorted(state.pods.values(), key=lambda p: p.created_seq)
        return [_pod_info(p) for p in found if namespace is None or p.namespace == namespace]

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

    async def set_pod_annotations(self, namespace: str, pod: str, annotations: Mapping[str, str | None]) -> None:
        await self._mutate(lambda state, now: (None, state.set_pod_annotations(namespace, pod, annotations)))

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

    async def kill_pod(self, namespace: str, pod: str) -> PodInfo | None:
        """The pod dies at once, no preStop (``ClusterState.kill``): what it was, or None when there is no such
        running pod. (Simulation only: a fault.)"""
        killed = await self._mutate(lambda state, now: state.kill(namespace, pod))
        return _pod_info(killed) if killed is not None else None

    async def lose_node(self, node: str) -> list[str]:
        """The node is gone (``ClusterState.lose_node``): NotReady, every pod on it dead at once. The pods killed,
        as ``namespace/name``. (Simulation only: a fault.)"""
        return await self._mutate(lambda state, now: state.lose_node(node))

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

    # -- service-account tokens (``shared.sim.tokenapi``) ----------------------------------------------------------
    async def issue_token(
        self,
        namespace: str,
        pod: str = "",
        audience: str = "gpuwarden",
        ttl_s: float = 3600.0,
        service_account: str = "default",
    ) -> str:
        """A service-account token, bound to ``pod`` when given (``SimTokenApi.issue``). (Simulation only.)"""
        return await self.tokens.issue(namespace, pod, audience, ttl_s, service_account)

    async def review_token(self, token: str, audiences: tuple[str, ...]) -> TokenReview:
        """The TokenReview API (``SimTokenApi.review``)."""
        return await self.tokens.review(token, audiences)

    # -- DRA (``shared.sim.resourceapi``) --------------------------------------------------------------------------
    async def publish_resource_slice(self, resource_slice: ResourceSlice) -> bool:
        """Store the slice; when it changed, pods waiting for devices by claim are scheduled again (as a real
        scheduler retries pending pods when a slice changes). A cluster whose state, when this instance last
        wrote it, had no deployment by claim is not read again for it."""
        changed = await self.resources.publish_slice(resource_slice)
        if changed and self._claims_wanted:
            await self._mutate(lambda state, now: (None, []))
        return changed

    async def resource_claim(self, namespace: str, name: str) -> ResourceClaimInfo | None:
        """A stored claim, or the claim of a simulated pod that asks by claim (``<pod>-gpus``, as a pod's claim
        template names it: allocated the devices the simulated scheduler gave the pod, its UID the pod's)."""
        stored = await self.resources.claim(namespace, name)
        if stored is not None or not name.endswith(POD_CLAIM_SUFFIX):
            return stored
        pod = (await self._read()).pods.get(object_key(namespace, name.removesuffix(POD_CLAIM_SUFFIX)))
        if pod is None or not pod.claim_devices:
            return None
        slices = {s.slice.node: s.slice for s in (await self.resources.slices()).values()}
        offered = slices.get(pod.node)
        if offered is None:
            return None
        devices = tuple(AllocatedDevice("gpus", offered.driver, offered.pool, d) for d in pod.claim_devices)
        return ResourceClaimInfo(namespace, name, pod.uid, allocated=True, devices=devices)

    # -- watching -----------------------------------------------------------------------------------------------
    def watch(self) -> AsyncIterator[ClusterChange]:
        """Every change after ``revision``, in order, each with its stream id as ``revision``.

        A caller that lists (``nodes``, ``pods``) and then watches misses nothing. Raises ``ClusterError`` when the
        stream has been trimmed past the starting point: list again and watch anew.
        """
        return self._follow(self._seen)

    async def _follow(self, after: int) -> AsyncIterator[ClusterChange]:
        last = (after, LAST_SEQ)
        while True:
            reply = await SIM_REDIS.call(
                functools.partial(self._changes_after, last), when=_redis_down, note=_watch_unreachable
            )
            for entry_id, fields in stream_entries(reply):
                revision, seq = (int(part) for part in entry_id.split("-"))
                if (revision, seq) not in ((last[0], last[1] + 1), (last[0] + 1, 0)):
                    raise ClusterError(
                        f"simulated cluster watch: changes after {stream_id(*last)} are gone (trimmed, or the "
                        f"cluster was made afresh; next is {entry_id}); list again and watch anew"
                    )
                last = (revision, seq)
                self._seen = max(self._seen, revision)
                yield change_from(entry_id, fields)

    async def _changes_after(self, last: tuple[int, int]) -> Any:
        """One blocking read of the changes after ``last``; an idle one checks that they still reach it."""
        reply = await self._client.xread({self._changes_key: stream_id(*last)}, count=WATCH_BATCH, block=WATCH_BLOCK_MS)
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
        except REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc
        if raw is None:
            raise self._absent()
        state = self._decode(raw)
        self._seen = max(self._seen, state.revision)
        return state

    async def _mutate(self, operation: Callable[[ClusterState, float], tuple[T, list[ClusterChange]]]) -> T:
        def step(
            current: ClusterState | None, now: float, slices: Slices
        ) -> tuple[T, ClusterState | None, list[ClusterChange]]:
            if current is None:
                raise self._absent()
            result, changes = operation(current, now)
            return result, current, changes + current.reconcile(now, slices)

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
                        slices: Slices = {}
                        if current is not None and current.wants_slices:
                            slices = self.resources.by_node(await pipe.hgetall(self.resources.slices_key))
                        result, state, changes = step(current, self._clock(), slices)
                        newest = state if state is not None else current
                        if newest is not None:
                            self._claims_wanted = newest.wants_slices
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
                                id=stream_id(state.revision, seq),
                                maxlen=_STREAM_MAXLEN,
                                approximate=True,
                            )
                        await pipe.execute()
                        self._seen = max(self._seen, state.revision)
                        self._committed(state)
                        return result
                    except WatchError:
                        continue
        except REDIS_DOWN as exc:
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


def _create_step(
    spec: SimSpec, current: ClusterState | None, now: float, slices: Slices
) -> tuple[bool, ClusterState | None, list[ClusterChange]]:
    if current is not None:
        return False, None, []
    state = from_spec(spec)
    changes = state.as_added()
    return True, state, changes + state.reconcile(now, slices)


def _fields(change: ClusterChange) -> dict[FieldT, EncodableT]:
    return {
        "kind": change.kind,
        "type": change.type,
        "name": change.name,
        "namespace": change.namespace,
        "node": change.node,
    }


def stream_id(revision: int, seq: int) -> str:
    return f"{revision}-{seq}"


def stream_entries(reply: Any) -> Iterator[tuple[str, Mapping[bytes | str, bytes | str]]]:
    """The entries of an XREAD reply on one stream, in RESP2 (a list of pairs) or RESP3 (a dict) shape."""
    streams = reply.values() if isinstance(reply, dict) else (entries for _key, entries in reply or ())
    for entries in streams:
        for entry_id, fields in entries:
            yield as_text(entry_id), fields


def change_from(revision: str, fields: Mapping[bytes | str, bytes | str]) -> ClusterChange:
    values = {as_text(k): as_text(v) for k, v in fields.items()}
    return ClusterChange(
        kind=cast(Literal["node", "pod", "deployment"], values["kind"]),
        type=cast(Literal["ADDED", "MODIFIED", "DELETED"], values["type"]),
        name=values["name"],
        namespace=values.get("namespace", ""),
        revision=revision,
        node=values.get("node", ""),
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
        ip=pod.ip,
        ready=pod.phase == "Running",
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
