"""The Kubernetes adapter of the cluster port, on the official client's asyncio flavour (``kubernetes.aio``).

Every call goes through the generated API classes (so paths, query parameters, authentication and TLS are the
client's), but bodies are read as the JSON the API server sends rather than as generated models: a newer server's
unknown fields or enum values can never fail a read, and a refusal's ``Status`` body is there to be reported.

Requests and the RBAC they need (see ``deploy/rbac``):

==========================================  ============================================================
``nodes`` / ``node``                        nodes list / get
``cordon`` ``uncordon`` ``set_node_*``      nodes patch (JSON merge patch; a None value deletes the key)
``update_node``                             nodes patch, the resourceVersion read as precondition (409)
``pods``                                    pods list (``spec.nodeName`` field selector for one node)
``evict``                                   pods/eviction create (policy/v1 Eviction)
``deployments``                             deployments list (apps), poddisruptionbudgets list (policy)
``scale``                                   deployments/scale patch (apps)
``watch``                                   list + watch of each kind watched (nodes and pods by default)
``acquire_lease`` / ``renew`` / ``release`` leases get, create, update (coordination.k8s.io, its namespace)
``review_token``                            tokenreviews create (authentication.k8s.io; cluster-wide)
==========================================  ============================================================

A watch lists, then watches from the list's resourceVersion; a dropped connection (or a server-side timeout)
resumes from the last version seen, and a 410 Gone (history compacted) lists again and reports the difference
from what it knew as ADDED / MODIFIED / DELETED, so a consumer misses no object's latest state and sees no
duplicate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, cast

import aiohttp
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config

from shared.ports.cluster import (
    ClusterChange,
    ClusterConflict,
    ClusterError,
    DeploymentInfo,
    EvictionOutcome,
    NodeInfo,
    PodInfo,
    PodPhase,
    TokenReview,
)

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Kind = Literal["node", "pod", "deployment"]
ChangeType = Literal["ADDED", "MODIFIED", "DELETED"]

GPU_RESOURCE = "nvidia.com/gpu"
MERGE_PATCH = "application/merge-patch+json"
_WATCH_TIMEOUT_S = 290
"""Server-side end of one watch request (the API server's own default lies between 30 and 60 minutes); the
client gives up on a silent connection 30 s later. Either way the watch resumes from the last version seen."""
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 10.0
_PERMANENT = frozenset({400, 401, 403, 404, 405, 415, 422})


class KubeApiError(ClusterError):
    """The API server refused a request: ``code`` is the HTTP status, ``reason`` the Status reason."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"Kubernetes API: {code} {reason}: {message}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Resource:
    """One watchable collection: how to list or watch it, and how to name its objects in a change."""

    kind: Kind
    list_all: Callable[..., Awaitable[aiohttp.ClientResponse]]


class KubeCluster:
    """``ClusterPort`` over a Kubernetes API server (``simulated = False``).

    ``watch_kinds`` are the kinds ``watch`` follows (each needs list and watch on its resource); ``watch_node``
    narrows the pod watch to one node's pods (the device service's view). ``clock`` is monotonic seconds, used to
    time lease expiry; ``wall`` is the wall clock written into leases.
    """

    simulated = False

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        watch_kinds: Iterable[Kind] = ("node", "pod"),
        watch_node: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._api = api
        self._core = k8s.CoreV1Api(api)
        self._apps = k8s.AppsV1Api(api)
        self._policy = k8s.PolicyV1Api(api)
        self._coordination = k8s.CoordinationV1Api(api)
        self._authentication = k8s.AuthenticationV1Api(api)
        self._watch_kinds = tuple(watch_kinds)
        self._watch_node = watch_node
        self._clock = clock
        self._wall = wall
        self._observed: dict[tuple[str, str], tuple[str, float]] = {}
        self._watches: set[ClusterWatch] = set()

    # -- making one ---------------------------------------------------------------------------------------------
    @classmethod
    def from_host(cls, url: str, token: str | None = None, verify: bool = True, **options: Any) -> KubeCluster:
        """An API server at ``url`` (``https://...`` or, for tests, ``http://...``), with a bearer token if given."""
        configuration = k8s.Configuration(host=url)
        configuration.verify_ssl = verify
        if token is not None:
            configuration.api_key = {"BearerToken": token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return cls(k8s.ApiClient(configuration), **options)

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, context: str | None = None, **options: Any) -> KubeCluster:
        """In a pod: its ServiceAccount (token refreshed as it rotates). Elsewhere: ``kubeconfig`` (or $KUBECONFIG,
        or ~/.kube/config) and its ``context``."""
        try:
            if kubeconfig is None and context is None and "KUBERNETES_SERVICE_HOST" in os.environ:
                configuration = k8s.Configuration()
                k8s_config.load_incluster_config(client_configuration=configuration)
                api = k8s.ApiClient(configuration)
            else:  # $KUBECONFIG read now: the client library reads it once, when it is imported
                config_file = kubeconfig or os.environ.get("KUBECONFIG") or None
                api = await k8s_config.new_client_from_config(config_file=config_file, context=context)
        except k8s_config.ConfigException as exc:
            raise ClusterError(f"no Kubernetes configuration: {exc}") from exc
        return cls(api, **options)

    async def close(self) -> None:
        for watch in list(self._watches):
            await watch.aclose()
        await self._api.close()

    # -- nodes --------------------------------------------------------------------------------------------------
    async def nodes(self) -> list[NodeInfo]:
        listing = await _read(self._core.list_node_without_preload_content())
        return sorted((_node_info(n) for n in listing["items"]), key=lambda n: n.name)

    async def node(self, name: str) -> NodeInfo | None:
        try:
            return _node_info(await _read(self._core.read_node_without_preload_content(name)))
        except KubeApiError as exc:
            if exc.code == 404:
                return None
            raise

    async def cordon(self, node: str) -> None:
        await self._patch_node(node, {"spec": {"unschedulable": True}})

    async def uncordon(self, node: str) -> None:
        """Removes ``spec.unschedulable`` (what ``kubectl uncordon`` leaves: the field unset, not false)."""
        await self._patch_node(node, {"spec": {"unschedulable": None}})

    async def set_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set labels; a value of None removes the label."""
        if labels:
            await self._patch_node(node, {"metadata": {"labels": dict(labels)}})

    async def set_node_annotations(self, node: str, annotations: Mapping[str, str | None]) -> None:
        if annotations:
            await self._patch_node(node, {"metadata": {"annotations": dict(annotations)}})

    async def update_node(
        self,
        node: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        schedulable: bool | None = None,
        expect: str = "",
    ) -> NodeInfo:
        """One merge patch; the node as the API server answers it. With ``expect`` the patch carries
        ``metadata.resourceVersion``, which the API server holds as a precondition: a node changed since it was
        read answers 409 Conflict, raised as ``ClusterConflict``."""
        metadata: Obj = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        if expect:
            metadata["resourceVersion"] = expect
        patch: Obj = {"metadata": metadata}
        if schedulable is not None:
            patch["spec"] = {"unschedulable": None if schedulable else True}
        try:
            return _node_info(await self._patch_node(node, patch))
        except KubeApiError as exc:
            if exc.code == 409:
                raise ClusterConflict(f"node {node!r} changed since it was read (resourceVersion {expect})") from exc
            raise

    async def _patch_node(self, node: str, patch: Obj) -> Obj:
        return await _read(self._core.patch_node_without_preload_content(node, patch, _content_type=MERGE_PATCH))

    # -- pods ---------------------------------------------------------------------------------------------------
    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[PodInfo]:
        """Pods bound to ``node`` and in ``namespace`` when given, by namespace and name. Pods that have finished
        (Succeeded, Failed) hold no GPU and are left out."""
        selector = f"spec.nodeName={node}" if node is not None else None
        if namespace is None:
            call = self._core.list_pod_for_all_namespaces_without_preload_content(field_selector=selector)
        else:
            call = self._core.list_namespaced_pod_without_preload_content(namespace, field_selector=selector)
        listing = await _read(call)
        found = (_pod_info(p) for p in listing["items"])
        return sorted((p for p in found if p is not None), key=lambda p: (p.namespace, p.name))

    async def evict(self, namespace: str, pod: str) -> EvictionOutcome:
        """The Eviction API: EVICTED once the pod is being deleted (its preStop runs); BLOCKED_BY_PDB on 429, when
        a PodDisruptionBudget forbids it now (try again later); NOT_FOUND for a pod that is not there."""
        body = k8s.V1Eviction(
            api_version="policy/v1", kind="Eviction", metadata=k8s.V1ObjectMeta(name=pod, namespace=namespace)
        )
        try:
            await _read(self._core.create_namespaced_pod_eviction_without_preload_content(pod, namespace, body))
        except KubeApiError as exc:
            if exc.code == 429:
                return EvictionOutcome.BLOCKED_BY_PDB
            if exc.code == 404:
                return EvictionOutcome.NOT_FOUND
            raise
        return EvictionOutcome.EVICTED

    # -- deployments --------------------------------------------------------------------------------------------
    async def deployments(self, namespace: str | None = None) -> list[DeploymentInfo]:
        """Deployments with their GPUs per pod (the pod template's ``nvidia.com/gpu`` limits) and how many pods
        may be down at once by the strictest PodDisruptionBudget covering the template (1 when none does)."""
        if namespace is None:
            deployments = self._apps.list_deployment_for_all_namespaces_without_preload_content()
            budgets = self._policy.list_pod_disruption_budget_for_all_namespaces_without_preload_content()
        else:
            deployments = self._apps.list_namespaced_deployment_without_preload_content(namespace)
            budgets = self._policy.list_namespaced_pod_disruption_budget_without_preload_content(namespace)
        listing, pdbs = await asyncio.gather(_read(deployments), _read(budgets))
        infos = [_deployment_info(d, pdbs["items"]) for d in listing["items"]]
        return sorted(infos, key=lambda d: (d.namespace, d.name))

    async def scale(self, namespace: str, deployment: str, replicas: int) -> None:
        """Set the replica count through the scale subresource (which a HorizontalPodAutoscaler also uses)."""
        if replicas < 0:
            raise ClusterError(f"deployment {namespace}/{deployment}: replicas must be >= 0, not {replicas}")
        patch = {"spec": {"replicas": replicas}}
        call = self._apps.patch_namespaced_deployment_scale_without_preload_content(
            deployment, namespace, patch, _content_type=MERGE_PATCH
        )
        await _read(call)

    # -- watching -----------------------------------------------------------------------------------------------
    def watch(self) -> ClusterWatch:
        """Changes from the watch's first listing on, in order for each kind (Kubernetes orders no two kinds).

        The listing happens on the first ``__anext__`` or ``ready()``; await ``ready()`` to know it is done.
        Raises ``KubeApiError`` for a refusal that retrying cannot cure (403: RBAC); a dropped connection, a 5xx
        or a 429 is retried with backoff and resumed where it stopped.
        """
        resources: dict[Kind, _Resource] = {
            "node": _Resource("node", self._core.list_node_without_preload_content),
            "pod": _Resource("pod", self._pod_collection),
            "deployment": _Resource(
                "deployment", self._apps.list_deployment_for_all_namespaces_without_preload_content
            ),
        }
        watch = ClusterWatch([resources[kind] for kind in self._watch_kinds], self._watches.discard)
        self._watches.add(watch)
        return watch

    def _pod_collection(self, **query: Any) -> Awaitable[aiohttp.ClientResponse]:
        if self._watch_node is not None:
            query["field_selector"] = f"spec.nodeName={self._watch_node}"
        return self._core.list_pod_for_all_namespaces_without_preload_content(**query)

    # -- tokens -------------------------------------------------------------------------------------------------
    async def review_token(self, token: str, audiences: tuple[str, ...]) -> TokenReview:
        """A TokenReview (authentication.k8s.io/v1): the API server checks the token's signature, expiry and
        audience, and for a bound token that its pod still exists with the same UID; its answer, as it gave it.
        The token goes in the request body only, never into a log line or an error."""
        body = k8s.V1TokenReview(
            api_version="authentication.k8s.io/v1",
            kind="TokenReview",
            spec=k8s.V1TokenReviewSpec(token=token, audiences=list(audiences)),
        )
        answer = await _read(self._authentication.create_token_review_without_preload_content(body))
        status = answer.get("status") or {}
        user = status.get("user") or {}
        extra = {str(k): tuple(str(v) for v in (vs or ())) for k, vs in (user.get("extra") or {}).items()}
        return TokenReview(
            authenticated=bool(status.get("authenticated")),
            username=str(user.get("username") or ""),
            uid=str(user.get("uid") or ""),
            groups=tuple(str(g) for g in user.get("groups") or ()),
            extra=extra,
            audiences=tuple(str(a) for a in status.get("audiences") or ()),
            error=str(status.get("error") or ""),
        )

    # -- leases -------------------------------------------------------------------------------------------------
    async def acquire_lease(self, namespace: str, name: str, holder: str, duration_s: int) -> bool:
        """Take the Lease ``namespace/name`` for ``holder``: True when ``holder`` holds it now.

        It is taken when it does not exist, is ``holder``'s already, is released, or has not been renewed for
        ``duration_s`` as timed by this process's own clock since it last saw the lease change (client-go's rule:
        no trust in another node's clock). Every write carries the resourceVersion read, so of two contenders
        exactly one wins (the other gets 409 Conflict and False). Holding a lease is not exclusive action: fence
        side effects with a resourceVersion compare-and-set as well.
        """
        lease = await self._read_lease(namespace, name)
        now = self._wall()
        if lease is None:
            body = _lease(namespace, name, holder, duration_s, now, now, transitions=0)
            try:
                await _read(self._coordination.create_namespaced_lease_without_preload_content(namespace, body))
            except KubeApiError as exc:
                if exc.code == 409:
                    return False
                raise
            return True
        spec = lease.get("spec") or {}
        current = spec.get("holderIdentity") or ""
        if current == holder:
            return await self._write_lease(lease, holder, duration_s, acquired=_time(spec.get("acquireTime")))
        if current and not self._expired(namespace, name, lease):
            return False
        return await self._write_lease(lease, holder, duration_s, acquired=now, transition=True)

    async def renew_lease(self, namespace: str, name: str, holder: str, duration_s: int) -> bool:
        """Renew ``holder``'s Lease; False when it is not ``holder``'s any more (or another write won)."""
        lease = await self._read_lease(namespace, name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != holder:
            return False
        return await self._write_lease(lease, holder, duration_s, acquired=_time(lease["spec"].get("acquireTime")))

    async def release_lease(self, namespace: str, name: str, holder: str) -> bool:
        """Give the Lease up so that another can take it at once; False when ``holder`` did not hold it."""
        lease = await self._read_lease(namespace, name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != holder:
            return False
        return await self._write_lease(lease, None, 1, acquired=None, transition=False)

    async def _read_lease(self, namespace: str, name: str) -> Obj | None:
        try:
            lease = await _read(self._coordination.read_namespaced_lease_without_preload_content(name, namespace))
        except KubeApiError as exc:
            if exc.code == 404:
                return None
            raise
        version = lease["metadata"]["resourceVersion"]
        seen = self._observed.get((namespace, name))
        if seen is None or seen[0] != version:
            self._observed[(namespace, name)] = (version, self._clock())
        return lease

    def _expired(self, namespace: str, name: str, lease: Obj) -> bool:
        duration = (lease.get("spec") or {}).get("leaseDurationSeconds") or 0
        _version, since = self._observed[(namespace, name)]
        return self._clock() - since >= duration

    async def _write_lease(
        self,
        lease: Obj,
        holder: str | None,
        duration_s: int,
        acquired: datetime | None,
        transition: bool = False,
    ) -> bool:
        meta = lease["metadata"]
        transitions = (lease.get("spec") or {}).get("leaseTransitions") or 0
        body = _lease(
            meta["namespace"],
            meta["name"],
            holder,
            duration_s,
            acquired,
            self._wall(),
            transitions=transitions + 1 if transition else transitions,
            version=meta["resourceVersion"],
        )
        call = self._coordination.replace_namespaced_lease_without_preload_content(
            meta["name"], meta["namespace"], body
        )
        try:
            written = await _read(call)
        except KubeApiError as exc:
            if exc.code in (404, 409):
                return False
            raise
        self._observed[(meta["namespace"], meta["name"])] = (written["metadata"]["resourceVersion"], self._clock())
        return True


class ClusterWatch(AsyncIterator[ClusterChange]):
    """The changes of the watched kinds, as an async iterator; ``aclose()`` (or the cluster's ``close``) stops it.

    One task per kind lists, then watches; each keeps the resourceVersion of every object it knows, which both
    drops a duplicate (an event for a version already seen) and gives the difference to report after a re-list.
    """

    def __init__(self, resources: list[_Resource], forget: Callable[[ClusterWatch], None]) -> None:
        self._resources = resources
        self._forget = forget
        self._queue: asyncio.Queue[ClusterChange | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._synced = 0
        self._ready: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._closed = False

    def __aiter__(self) -> ClusterWatch:
        return self

    async def __anext__(self) -> ClusterChange:
        if self._closed:
            raise StopAsyncIteration
        self._start()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        return item

    async def ready(self) -> None:
        """Return once every kind is listed (changes after that are all reported); raise what stopped a kind."""
        self._start()
        assert self._ready is not None
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure

    async def aclose(self) -> None:
        self._closed = True
        self._forget(self)
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self) -> None:
        if self._ready is None:
            self._ready = asyncio.Event()
            if not self._resources:
                self._ready.set()
            self._tasks = [asyncio.create_task(self._follow(resource)) for resource in self._resources]

    def _emit(self, kind: Kind, type_: ChangeType, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        change = ClusterChange(
            kind, type_, meta.get("name", ""), meta.get("namespace", ""), meta.get("resourceVersion", "")
        )
        self._queue.put_nowait(change)

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        self._queue.put_nowait(exc)
        assert self._ready is not None
        self._ready.set()

    async def _follow(self, resource: _Resource) -> None:
        cursor = _Cursor()
        listed = False
        delay = _RETRY_FIRST_S
        try:
            while True:
                try:
                    if cursor.version is None:
                        await self._relist(resource, cursor, report=listed)
                        if not listed:
                            listed = True
                            self._synced += 1
                            if self._synced == len(self._resources):
                                assert self._ready is not None
                                self._ready.set()
                    if await self._stream(resource, cursor):
                        delay = _RETRY_FIRST_S
                        continue
                except _Gone:
                    log.info("watch of %ss: version %s is gone; listing again", resource.kind, cursor.version)
                    cursor.version = None
                    continue
                except KubeApiError as exc:
                    if exc.code in _PERMANENT:
                        raise
                    log.warning("watch of %ss: %s; retrying in %.2f s", resource.kind, exc, delay)
                except (ClusterError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    log.warning("watch of %ss: %r; resuming in %.2f s", resource.kind, exc, delay)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, _RETRY_MAX_S)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    async def _relist(self, resource: _Resource, cursor: _Cursor, report: bool) -> None:
        """List ``resource`` afresh into ``cursor``; with ``report``, emit how the listing differs from before."""
        listing = await _read(resource.list_all())
        version = str(listing["metadata"]["resourceVersion"])
        fresh: dict[tuple[str, str], Obj] = {_key(obj): obj for obj in listing["items"]}
        known = cursor.known
        if report:
            for key, obj in fresh.items():
                if key not in known:
                    self._emit(resource.kind, "ADDED", obj)
                elif known[key] != obj["metadata"]["resourceVersion"]:
                    self._emit(resource.kind, "MODIFIED", obj)
            for key in known.keys() - fresh.keys():
                gone = {"metadata": {"namespace": key[0], "name": key[1], "resourceVersion": version}}
                self._emit(resource.kind, "DELETED", gone)
        cursor.known = {key: obj["metadata"]["resourceVersion"] for key, obj in fresh.items()}
        cursor.version = version

    async def _stream(self, resource: _Resource, cursor: _Cursor) -> int:
        """Follow one watch request from ``cursor.version`` to its end, moving the cursor with each event; how
        many events came."""
        response = await resource.list_all(
            watch=True,
            resource_version=cursor.version,
            allow_watch_bookmarks=True,
            timeout_seconds=_WATCH_TIMEOUT_S,
            _request_timeout=float(_WATCH_TIMEOUT_S + 30),
        )
        events = 0
        try:
            if response.status == 410:
                raise _Gone
            if response.status != 200:
                await _body(response)
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                events += 1
                type_, obj = event.get("type"), event.get("object") or {}
                if type_ == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone
                    raise KubeApiError(int(obj.get("code") or 500), obj.get("reason", ""), obj.get("message", ""))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or cursor.version)
                key = _key(obj)
                if type_ == "DELETED":
                    if cursor.known.pop(key, None) is not None:
                        self._emit(resource.kind, "DELETED", obj)
                elif type_ in ("ADDED", "MODIFIED") and cursor.known.get(key) != version:
                    seen_before = key in cursor.known
                    cursor.known[key] = version
                    self._emit(resource.kind, "MODIFIED" if seen_before else "ADDED", obj)
                cursor.version = version
            return events
        finally:
            response.close()


@dataclass(slots=True)
class _Cursor:
    """Where a watch of one kind stands: the version to resume from (None: list first) and the version of every
    object it knows, which drops duplicates and gives the difference to report after a re-list."""

    version: str | None = None
    known: dict[tuple[str, str], str] = field(default_factory=dict)


class _Gone(Exception):
    """The watch's resourceVersion is older than the server's history: list again."""


async def _read(call: Awaitable[aiohttp.ClientResponse]) -> Obj:
    """The JSON body of a call; a non-2xx answer raises ``KubeApiError`` with the Status' reason and message."""
    try:
        response = await call
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ClusterError(f"Kubernetes API unreachable: {exc!r}") from exc
    return await _body(response)


async def _body(response: aiohttp.ClientResponse) -> Obj:
    try:
        raw = await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ClusterError(f"Kubernetes API unreachable: {exc!r}") from exc
    finally:
        response.release()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {"message": raw[:200].decode(errors="replace")}
    if not 200 <= response.status < 300:
        if not isinstance(body, dict):
            body = {}
        raise KubeApiError(response.status, body.get("reason", response.reason or ""), body.get("message", ""))
    return cast(Obj, body)


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


def _count(quantity: object) -> int:
    """An integer resource quantity ("2"); anything else (an absent or fractional quantity) counts as 0."""
    try:
        return int(str(quantity))
    except ValueError:
        return 0


def _node_info(node: Obj) -> NodeInfo:
    meta, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    gpus = (status.get("allocatable") or status.get("capacity") or {}).get(GPU_RESOURCE, 0)
    return NodeInfo(
        name=meta["name"],
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        schedulable=not spec.get("unschedulable", False),
        ready=ready,
        gpus=_count(gpus),
        revision=str(meta.get("resourceVersion", "")),
    )


def _pod_gpus(spec: Obj) -> int:
    """GPUs a pod spec holds: the larger of its containers' sum and its largest init container (as the
    scheduler counts); a container's limit, else its request (extended resources have both equal)."""

    def gpus(container: Obj) -> int:
        resources = container.get("resources") or {}
        value = (resources.get("limits") or {}).get(GPU_RESOURCE, (resources.get("requests") or {}).get(GPU_RESOURCE))
        return _count(value or 0)

    main = sum(gpus(c) for c in spec.get("containers") or [])
    init = max((gpus(c) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def _pod_info(pod: Obj) -> PodInfo | None:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    phase = status.get("phase", "Pending")
    if phase in ("Succeeded", "Failed"):
        return None
    shown: PodPhase = (
        "Terminating" if meta.get("deletionTimestamp") else ("Running" if phase == "Running" else "Pending")
    )
    labels = meta.get("labels") or {}
    return PodInfo(
        name=meta["name"],
        namespace=meta.get("namespace", ""),
        node=spec.get("nodeName", ""),
        deployment=_owner_deployment(meta),
        phase=shown,
        gpus=_pod_gpus(spec),
        labels=dict(labels),
    )


def _owner_deployment(meta: Obj) -> str:
    """The Deployment behind a pod: its ReplicaSet owner's name less ``-<pod-template-hash>``; otherwise the
    controlling owner's name (a StatefulSet, a Job), or "" for a bare pod."""
    owners = meta.get("ownerReferences") or []
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else None)
    if owner is None:
        return ""
    name = str(owner.get("name", ""))
    template_hash = (meta.get("labels") or {}).get("pod-template-hash")
    if owner.get("kind") == "ReplicaSet" and template_hash and name.endswith(f"-{template_hash}"):
        return name[: -len(template_hash) - 1]
    return name


def _matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector: None selects nothing, ``{}`` everything (policy/v1 PodDisruptionBudget semantics)."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        present = key in labels
        if operator == "In" and (not present or labels[key] not in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if (operator == "Exists" and not present) or (operator == "DoesNotExist" and present):
            return False
    return True


def _scaled(value: int | str, total: int) -> int:
    """An IntOrString of a budget against ``total`` pods; percentages round up, as the disruption controller."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(total * int(value[:-1]) / 100)
    return int(value)


def _deployment_info(deployment: Obj, budgets: list[Obj]) -> DeploymentInfo:
    meta, spec = deployment["metadata"], deployment.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    template = spec.get("template") or {}
    template_labels = (template.get("metadata") or {}).get("labels") or {}
    allowed: list[int] = []
    for budget in budgets:
        budget_spec = budget.get("spec") or {}
        if budget["metadata"].get("namespace") != meta.get("namespace"):
            continue
        if not _matches(budget_spec.get("selector"), template_labels):
            continue
        if budget_spec.get("maxUnavailable") is not None:
            allowed.append(_scaled(budget_spec["maxUnavailable"], replicas))
        elif budget_spec.get("minAvailable") is not None:
            allowed.append(replicas - _scaled(budget_spec["minAvailable"], replicas))
    return DeploymentInfo(
        name=meta["name"],
        namespace=meta.get("namespace", ""),
        replicas=replicas,
        gpus_per_pod=_pod_gpus(template.get("spec") or {}),
        max_unavailable=max(0, min(allowed)) if allowed else 1,
        labels=dict(meta.get("labels") or {}),
    )


def _time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _lease(
    namespace: str,
    name: str,
    holder: str | None,
    duration_s: int,
    acquired: datetime | None,
    renewed: datetime,
    transitions: int,
    version: str | None = None,
) -> k8s.V1Lease:
    return k8s.V1Lease(
        api_version="coordination.k8s.io/v1",
        kind="Lease",
        metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, resource_version=version),
        spec=k8s.V1LeaseSpec(
            holder_identity=holder,
            lease_duration_seconds=duration_s,
            acquire_time=acquired,
            renew_time=renewed,
            lease_transitions=transitions,
        ),
    )


__all__ = ["ClusterWatch", "KubeApiError", "KubeCluster"]
