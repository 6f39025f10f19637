"""The Kubernetes adapter of the cluster port, on the official client's asyncio flavour (``kubernetes.aio``).

Every call goes through the generated API classes (so paths, query parameters, authentication and TLS are the
client's), but bodies are read as the JSON the API server sends rather than as generated models, and watches are
followed by ``shared.adapters.kubeapi`` (``read_json``, ``ClusterWatch``).

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
``review_token``                            tokenreviews create (authentication.k8s.io; cluster-wide)
``publish_resource_slice``                  resourceslices get, create, update (resource.k8s.io)
``resource_claim``                          resourceclaims get (resource.k8s.io)
==========================================  ============================================================
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

import aiohttp
from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config

from shared.adapters.kubeapi import ClusterWatch, Collection, Kind, KubeApiError, Obj, read_json
from shared.adapters.kuberesources import claim_info, generation_of, slice_from_object, slice_object
from shared.ports.cluster import (
    ClusterConflict,
    ClusterError,
    DeploymentInfo,
    EvictionOutcome,
    NodeInfo,
    PodInfo,
    PodPhase,
    ResourceClaimInfo,
    ResourceSlice,
    TokenReview,
)

GPU_RESOURCE = "nvidia.com/gpu"
MERGE_PATCH = "application/merge-patch+json"


class KubeCluster:
    """``ClusterPort`` over a Kubernetes API server (``simulated = False``).

    ``watch_kinds`` are the kinds ``watch`` follows (each needs list and watch on its resource); ``watch_node``
    narrows the pod watch to one node's pods (the device service's view).
    """

    simulated = False

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        watch_kinds: Iterable[Kind] = ("node", "pod"),
        watch_node: str | None = None,
    ) -> None:
        self._api = api
        self._core = k8s.CoreV1Api(api)
        self._apps = k8s.AppsV1Api(api)
        self._policy = k8s.PolicyV1Api(api)
        self._authentication = k8s.AuthenticationV1Api(api)
        self._resource = k8s.ResourceV1Api(api)
        self._watch_kinds = tuple(watch_kinds)
        self._watch_node = watch_node
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
        listing = await read_json(self._core.list_node_without_preload_content())
        return sorted((_node_info(n) for n in listing["items"]), key=lambda n: n.name)

    async def node(self, name: str) -> NodeInfo | None:
        try:
            return _node_info(await read_json(self._core.read_node_without_preload_content(name)))
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

    async def set_pod_annotations(self, namespace: str, pod: str, annotations: Mapping[str, str | None]) -> None:
        """One merge patch of ``metadata.annotations``; a pod that is gone (404) is no error."""
        if not annotations:
            return
        patch = {"metadata": {"annotations": dict(annotations)}}
        try:
            await read_json(
                self._core.patch_namespaced_pod_without_preload_content(
                    pod, namespace, patch, _content_type=MERGE_PATCH
                )
            )
        except KubeApiError as exc:
            if exc.code != 404:
                raise

    async def _patch_node(self, node: str, patch: Obj) -> Obj:
        return await read_json(self._core.patch_node_without_preload_content(node, patch, _content_type=MERGE_PATCH))

    # -- DRA ----------------------------------------------------------------------------------------------------
    async def publish_resource_slice(self, resource_slice: ResourceSlice) -> bool:
        """Read the slice; create it (generation 1), or replace it with the generation one higher when its devices
        differ, the resourceVersion read as precondition (409: ``ClusterConflict``, the caller tries again)."""
        name = resource_slice.name
        try:
            current: Obj | None = await read_json(self._resource.read_resource_slice_without_preload_content(name))
        except KubeApiError as exc:
            if exc.code != 404:
                raise
            current = None
        if current is None:
            body = slice_object(resource_slice, 1)
            await read_json(self._resource.create_resource_slice_without_preload_content(body))
            return True
        if slice_from_object(current) == resource_slice:
            return False
        version = current["metadata"]["resourceVersion"]
        body = slice_object(resource_slice, generation_of(current) + 1, version)
        try:
            await read_json(self._resource.replace_resource_slice_without_preload_content(name, body))
        except KubeApiError as exc:
            if exc.code == 409:
                raise ClusterConflict(f"ResourceSlice {name!r} changed since it was read ({version})") from exc
            raise
        return True

    async def resource_claim(self, namespace: str, name: str) -> ResourceClaimInfo | None:
        try:
            return claim_info(
                await read_json(self._resource.read_namespaced_resource_claim_without_preload_content(name, namespace))
            )
        except KubeApiError as exc:
            if exc.code == 404:
                return None
            raise

    # -- pods ---------------------------------------------------------------------------------------------------
    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[PodInfo]:
        """Pods bound to ``node`` and in ``namespace`` when given, by namespace and name. Pods that have finished
        (Succeeded, Failed) hold no GPU and are left out."""
        selector = f"spec.nodeName={node}" if node is not None else None
        if namespace is None:
            call = self._core.list_pod_for_all_namespaces_without_preload_content(field_selector=selector)
        else:
            call = self._core.list_namespaced_pod_without_preload_content(namespace, field_selector=selector)
        listing = await read_json(call)
        found = (_pod_info(p) for p in listing["items"])
        return sorted((p for p in found if p is not None), key=lambda p: (p.namespace, p.name))

    async def evict(self, namespace: str, pod: str) -> EvictionOutcome:
        """The Eviction API: EVICTED once the pod is being deleted (its preStop runs); BLOCKED_BY_PDB on 429, when
        a PodDisruptionBudget forbids it now (try again later); NOT_FOUND for a pod that is not there."""
        body = k8s.V1Eviction(
            api_version="policy/v1", kind="Eviction", metadata=k8s.V1ObjectMeta(name=pod, namespace=namespace)
        )
        try:
            await read_json(self._core.create_namespaced_pod_eviction_without_preload_content(pod, namespace, body))
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
        listing, pdbs = await asyncio.gather(read_json(deployments), read_json(budgets))
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
        await read_json(call)

    # -- watching -----------------------------------------------------------------------------------------------
    def watch(self) -> ClusterWatch:
        """Changes from the watch's first listing on, in order for each kind (Kubernetes orders no two kinds).

        The listing happens on the first ``__anext__`` or ``ready()``; await ``ready()`` to know it is done.
        Raises ``KubeApiError`` for a refusal that retrying cannot cure (403: RBAC); a dropped connection, a 5xx
        or a 429 is retried with backoff (``retries.KUBE_WATCH``) and resumed where it stopped.
        """
        resources: dict[Kind, Collection] = {
            "node": Collection("node", self._core.list_node_without_preload_content),
            "pod": Collection("pod", self._pod_collection),
            "deployment": Collection(
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
        answer = await read_json(self._authentication.create_token_review_without_preload_content(body))
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
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or [] if isinstance(c, dict)}
    restarts = sum(
        int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [] if isinstance(c, dict)
    )
    return PodInfo(
        name=meta["name"],
        namespace=meta.get("namespace", ""),
        node=spec.get("nodeName", ""),
        deployment=_owner_deployment(meta),
        phase=shown,
        gpus=_pod_gpus(spec),
        labels=dict(labels),
        uid=str(meta.get("uid") or ""),
        ip=str(status.get("podIP") or ""),
        ready=conditions.get("Ready", "True" if phase == "Running" else "False") == "True",
        restarts=restarts,
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


__all__ = ["KubeCluster"]
