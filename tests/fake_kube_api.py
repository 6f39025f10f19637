"""A small Kubernetes API server for tests: the real REST paths, JSON bodies, Status errors and watch streams.

It holds objects in memory under one global ``resourceVersion`` counter (as etcd's revision is) and keeps the
history of changes, so a watch from ``resourceVersion=N`` gets every change after N, as newline-delimited
``{"type": ..., "object": ...}`` events in a chunked response. A watch from a version older than the compacted one
gets the API server's answer: an ``ERROR`` event with a ``Status`` of code 410 ("too old resource version").

Served (enough for ``shared.adapters.kube``): nodes (get, list, watch, patch), pods (list, watch, and the eviction
subresource, which honours PodDisruptionBudgets as the API server does), deployments (list, watch, and the scale
subresource), poddisruptionbudgets (list), tokenreviews (create: the tokens a test has ``issue_token``-ed are
genuine, for their audiences), and resource.k8s.io/v1 resourceslices and resourceclaims (get, create, update).
Every request is recorded as an ``Access`` (verb, API group, resource, namespace), which is what RBAC authorizes,
so a test can hold the requests against the ClusterRoles in ``deploy/rbac``.

Tests steer it with ``block_next_evictions`` (429s), ``drop_watches`` (connections cut mid-stream),
``hold_watches`` / ``release_watches`` (a lagging watch cache) and ``compact`` (history gone: 410).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

Obj = dict[str, Any]

PDB_VIOLATION = "Cannot evict pod as it would violate the pod's disruption budget."


@dataclass(frozen=True, slots=True, order=True)
class Access:
    """One request as RBAC sees it: ``resource`` is ``pods/eviction`` for a subresource."""

    verb: str
    group: str
    resource: str
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class _Kind:
    kind: str
    api_version: str
    namespaced: bool


_KINDS: dict[tuple[str, str], _Kind] = {
    ("", "nodes"): _Kind("Node", "v1", False),
    ("", "pods"): _Kind("Pod", "v1", True),
    ("apps", "deployments"): _Kind("Deployment", "apps/v1", True),
    ("policy", "poddisruptionbudgets"): _Kind("PodDisruptionBudget", "policy/v1", True),
    ("resource.k8s.io", "resourceslices"): _Kind("ResourceSlice", "resource.k8s.io/v1", False),
    ("resource.k8s.io", "resourceclaims"): _Kind("ResourceClaim", "resource.k8s.io/v1", True),
}
_PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


class _ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details


def status(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    """A ``Status`` body as the API server writes it."""
    body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message}
    if reason:
        body["reason"] = reason
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


def _not_found(resource: str, name: str) -> _ApiError:
    return _ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


def merge_patch(target: Obj, patch: Mapping[str, Any]) -> Obj:
    """RFC 7386 JSON merge patch (a strategic merge patch is the same for maps and scalars)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        elif isinstance(value, Mapping):
            target[key] = merge_patch({}, value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); None matches nothing, ``{}`` everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _scaled(value: int | str, total: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(total * int(value[:-1]) / 100)
    return int(value)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Watcher:
    def __init__(self) -> None:
        self.dropped = False
        self.woken = asyncio.Event()


class FakeKubeApi:
    """An in-memory API server on a free local port: ``async with FakeKubeApi() as api: api.url``."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[tuple[str, str], Obj]] = {key: {} for key in _KINDS}
        self.history: list[tuple[int, tuple[str, str], str, Obj]] = []
        self.revision = 1
        self.compacted = 0
        self.accesses: list[Access] = []
        self.watch_requests: list[tuple[str, str]] = []
        """(resource, resourceVersion) of every watch request, in order."""
        self.authorize: Callable[[Access], bool] | None = None
        """When set, a request it refuses is answered 403 Forbidden, as RBAC would."""
        self.conflicts = 0
        """How many writes were refused with 409 Conflict for a stale resourceVersion."""
        self.tokens: dict[str, tuple[Obj, tuple[str, ...]]] = {}
        """token -> (the ``status.user`` a TokenReview of it answers, its audiences): what the API server knows of
        the tokens it signed."""
        self._blocked_evictions = 0
        self._holding = False
        self._watchers: set[_Watcher] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeKubeApi:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- what tests do to the cluster -----------------------------------------------------------------------------
    def add(self, resource: str, obj: Obj, group: str = "") -> Obj:
        """Create ``obj`` (an ADDED event), as a controller or kubectl would."""
        meta = obj.setdefault("metadata", {})
        key = (meta.get("namespace", ""), meta["name"])
        if key in self.objects[(group, resource)]:
            raise _ApiError(409, "AlreadyExists", f'{resource} "{meta["name"]}" already exists')
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        return self._commit((group, resource), "ADDED", obj)

    def update(self, resource: str, namespace: str, name: str, change: Callable[[Obj], None], group: str = "") -> Obj:
        """Change an object in place (a MODIFIED event), as a kubelet or controller would."""
        obj = copy.deepcopy(self._get((group, resource), namespace, name))
        change(obj)
        return self._commit((group, resource), "MODIFIED", obj)

    def delete(self, resource: str, namespace: str, name: str, group: str = "") -> None:
        obj = self._get((group, resource), namespace, name)
        self._commit((group, resource), "DELETED", obj)

    def get(self, resource: str, namespace: str, name: str, group: str = "") -> Obj | None:
        found = self.objects[(group, resource)].get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def block_next_evictions(self, count: int = 1) -> None:
        """Answer the next ``count`` evictions with 429, whatever the budgets say."""
        self._blocked_evictions = count

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream (no final chunk), as a restarting API server does."""
        for watcher in self._watchers:
            watcher.dropped = True
        self._wake()

    def hold_watches(self) -> None:
        """Open watches stop receiving events (a lagging watch cache) until ``release_watches``."""
        self._holding = True

    def release_watches(self) -> None:
        self._holding = False
        self._wake()

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        self.compacted = self.revision
        self.history.clear()

    def issue_token(self, token: str, user: Obj, audiences: Iterable[str]) -> None:
        """Make ``token`` one the API server signed for ``user`` (``username``, ``uid``, ``groups``, ``extra``)
        and ``audiences``; ``revoke_token`` (its pod deleted) makes it invalid again."""
        self.tokens[token] = (copy.deepcopy(user), tuple(audiences))

    def revoke_token(self, token: str) -> None:
        self.tokens.pop(token, None)

    def used(self) -> set[Access]:
        return set(self.accesses)

    # -- the store ----------------------------------------------------------------------------------------------
    def _get(self, res: tuple[str, str], namespace: str, name: str) -> Obj:
        found = self.objects[res].get((namespace, name))
        if found is None:
            raise _not_found(res[1], name)
        return found

    def _commit(self, res: tuple[str, str], type_: str, obj: Obj) -> Obj:
        self.revision += 1
        kind = _KINDS[res]
        obj = copy.deepcopy(obj)
        obj["kind"], obj["apiVersion"] = kind.kind, kind.api_version
        obj["metadata"]["resourceVersion"] = str(self.revision)
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if type_ == "DELETED":
            self.objects[res].pop(key, None)
        else:
            self.objects[res][key] = obj
        self.history.append((self.revision, res, type_, copy.deepcopy(obj)))
        self._wake()
        return copy.deepcopy(obj)

    def _wake(self) -> None:
        for watcher in self._watchers:
            watcher.woken.set()

    # -- HTTP ---------------------------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._route(request)
        except _ApiError as exc:
            return web.json_response(status(exc.code, exc.reason, exc.message, exc.details), status=exc.code)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if m := re.fullmatch(r"/api/v1/(.+)", path):
            group, rest = "", m.group(1)
        elif m := re.fullmatch(r"/apis/([^/]+)/v1/(.+)", path):
            group, rest = m.group(1), m.group(2)
        else:
            raise _ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        if (group, rest) == ("authentication.k8s.io", "tokenreviews"):
            return await self._review(request)
        parts = rest.split("/")
        namespace = ""
        if parts[0] == "namespaces" and len(parts) >= 3:
            namespace, parts = parts[1], parts[2:]
        resource, name, sub = (*parts, "", "")[:3]
        if (group, resource) not in _KINDS or len(parts) > 3:
            raise _ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        res = (group, resource)
        query = request.query
        watching = query.get("watch") in ("1", "true")
        verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
        if request.method == "GET":
            verb = "get" if name else ("watch" if watching else "list")
        elif request.method in verbs:
            verb = verbs[request.method]
        else:
            raise _ApiError(405, "MethodNotAllowed", f"{request.method} is not supported")
        access = Access(verb, group, f"{resource}/{sub}" if sub else resource, namespace)
        self.accesses.append(access)
        if self.authorize is not None and not self.authorize(access):
            scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            message = (
                f'{resource} is forbidden: User "system:serviceaccount:gpuwarden:test" cannot {verb} resource '
                f'"{access.resource}" in API group "{group}" {scope}'
            )
            raise _ApiError(403, "Forbidden", message, {"kind": resource, "group": group})

        if not name and verb == "list":
            return self._list(res, namespace, query)
        if not name and verb == "watch":
            return await self._watch(request, res, namespace, query)
        if not name and verb == "create":
            body = await request.json()
            body.setdefault("metadata", {})["namespace"] = namespace
            return web.json_response(self.add(resource, body, group), status=201)
        if sub == "eviction" and verb == "create":
            return self._evict(namespace, name)
        if sub == "scale":
            return await self._scale(request, namespace, name, verb)
        if name and not sub and verb == "get":
            return web.json_response(self._get(res, namespace, name))
        if name and not sub and verb == "patch":
            return await self._patch(request, res, namespace, name)
        if name and not sub and verb == "update":
            return await self._replace(request, res, namespace, name)
        raise _ApiError(405, "MethodNotAllowed", f"{request.method} is not supported on {path}")

    async def _review(self, request: web.Request) -> web.StreamResponse:
        """``POST /apis/authentication.k8s.io/v1/tokenreviews``: the answer is in ``status``, 201 either way."""
        if request.method != "POST":
            raise _ApiError(405, "MethodNotAllowed", f"{request.method} is not supported on tokenreviews")
        access = Access("create", "authentication.k8s.io", "tokenreviews")
        self.accesses.append(access)
        if self.authorize is not None and not self.authorize(access):
            message = 'tokenreviews.authentication.k8s.io is forbidden: cannot create resource "tokenreviews"'
            raise _ApiError(403, "Forbidden", message, {"kind": "tokenreviews", "group": access.group})
        body = await request.json()
        spec = body.get("spec") or {}
        wanted = tuple(spec.get("audiences") or ())
        known = self.tokens.get(spec.get("token") or "")
        result: Obj = {"authenticated": False, "user": {}}
        if known is None:
            result["error"] = "[invalid bearer token, token lookup failed]"
        elif wanted and not set(wanted) & set(known[1]):
            result["error"] = "[invalid bearer token, token audiences is invalid for the target audiences]"
        else:
            result = {"authenticated": True, "user": copy.deepcopy(known[0]), "audiences": list(wanted or known[1])}
        answer = {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1", "spec": spec, "status": result}
        return web.json_response(answer, status=201)

    def _selected(self, res: tuple[str, str], namespace: str, query: Mapping[str, str]) -> Callable[[Obj], bool]:
        fields = _pairs(query.get("fieldSelector", ""))
        labels = _pairs(query.get("labelSelector", ""))
        known = {"metadata.name", "metadata.namespace", "spec.nodeName"}
        if unknown := set(fields) - known:
            raise _ApiError(400, "BadRequest", f"field label not supported: {', '.join(sorted(unknown))}")

        def matches(obj: Obj) -> bool:
            meta = obj["metadata"]
            values = {
                "metadata.name": meta["name"],
                "metadata.namespace": meta.get("namespace", ""),
                "spec.nodeName": obj.get("spec", {}).get("nodeName", ""),
            }
            return (
                (not namespace or meta.get("namespace") == namespace)
                and all(values[k] == v for k, v in fields.items())
                and all((meta.get("labels") or {}).get(k) == v for k, v in labels.items())
            )

        return matches

    def _list(self, res: tuple[str, str], namespace: str, query: Mapping[str, str]) -> web.Response:
        matches = self._selected(res, namespace, query)
        kind = _KINDS[res]
        items = []
        for _key, obj in sorted(self.objects[res].items()):
            if matches(obj):
                item = copy.deepcopy(obj)
                item.pop("kind"), item.pop("apiVersion")
                items.append(item)
        body = {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(self.revision)},
            "items": items,
        }
        return web.json_response(body)

    async def _watch(
        self, request: web.Request, res: tuple[str, str], namespace: str, query: Mapping[str, str]
    ) -> web.StreamResponse:
        matches = self._selected(res, namespace, query)
        since = query.get("resourceVersion", "")
        self.watch_requests.append((res[1], since))
        timeout = float(query.get("timeoutSeconds", "1800"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(type_: str, obj: Obj) -> None:
            await response.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

        if since not in ("", "0") and int(since) < self.compacted:
            message = f"too old resource version: {since} ({self.compacted})"
            await send("ERROR", status(410, "Expired", message))
            await response.write_eof()
            return response
        watcher = _Watcher()
        self._watchers.add(watcher)
        try:
            if since in ("", "0"):
                position = self.revision
                for obj in [o for _key, o in sorted(self.objects[res].items()) if matches(o)]:
                    await send("ADDED", obj)
            else:
                position = int(since)
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                watcher.woken.clear()
                if watcher.dropped:
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                if not self._holding and position < self.compacted:
                    message = f"too old resource version: {position} ({self.compacted})"
                    await send("ERROR", status(410, "Expired", message))
                    break
                if not self._holding:
                    upto = self.revision
                    pending = [
                        (type_, obj)
                        for revision, event_res, type_, obj in self.history
                        if position < revision <= upto and event_res == res and matches(obj)
                    ]
                    position = upto
                    for type_, obj in pending:
                        await send(type_, obj)
                    if pending:
                        continue
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(watcher.woken.wait(), remaining)
                except TimeoutError:
                    pass
        finally:
            self._watchers.discard(watcher)
        await response.write_eof()
        return response

    async def _patch(self, request: web.Request, res: tuple[str, str], namespace: str, name: str) -> web.Response:
        content_type = request.headers.get("Content-Type", "")
        if content_type not in _PATCH_TYPES:
            raise _ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - "
                f"accepted media types include: {', '.join(_PATCH_TYPES)}",
            )
        patch = await request.json()
        current = self._get(res, namespace, name)
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
            raise self._conflict(res, name)
        updated = merge_patch(copy.deepcopy(current), patch)
        updated["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        if updated == current:
            return web.json_response(current)
        return web.json_response(self._commit(res, "MODIFIED", updated))

    async def _replace(self, request: web.Request, res: tuple[str, str], namespace: str, name: str) -> web.Response:
        """PUT: the whole object, its ``metadata.resourceVersion`` the one stored (409 otherwise)."""
        body = await request.json()
        current = self._get(res, namespace, name)
        meta = body.setdefault("metadata", {})
        if meta.get("name") != name:
            raise _ApiError(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match {name}")
        if meta.get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise self._conflict(res, name)
        meta["namespace"] = namespace
        meta["uid"] = current["metadata"]["uid"]
        meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]
        return web.json_response(self._commit(res, "MODIFIED", body))

    def _conflict(self, res: tuple[str, str], name: str) -> _ApiError:
        self.conflicts += 1
        qualified = f"{res[1]}.{res[0]}" if res[0] else res[1]
        return _ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; please apply '
            "your changes to the latest version and try again",
            {"name": name, "group": res[0], "kind": res[1]},
        )

    def _evict(self, namespace: str, name: str) -> web.Response:
        """The eviction subresource: a Pending, terminal or already deleting pod goes without asking its budgets;
        otherwise each budget matching the pod must allow one more disruption, else 429."""
        pod = self._get(("", "pods"), namespace, name)
        phase = pod.get("status", {}).get("phase", "Pending")
        if pod["metadata"].get("deletionTimestamp") is None and phase not in ("Pending", "Succeeded", "Failed"):
            budget = self._violated_budget(pod)
            if self._blocked_evictions > 0 or budget is not None:
                self._blocked_evictions = max(0, self._blocked_evictions - 1)
                causes = [{"reason": "DisruptionBudget", "message": f"The disruption budget {budget} is exhausted"}]
                raise _ApiError(429, "TooManyRequests", PDB_VIOLATION, {"causes": causes})

        def terminate(obj: Obj) -> None:
            obj["metadata"].setdefault("deletionTimestamp", _now())
            obj["metadata"].setdefault("deletionGracePeriodSeconds", 30)

        if pod["metadata"].get("deletionTimestamp") is None:
            self.update("pods", namespace, name, terminate)
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        return web.json_response(body, status=201)

    def _violated_budget(self, pod: Obj) -> str | None:
        namespace = pod["metadata"]["namespace"]
        labels = pod["metadata"].get("labels") or {}
        pods = [p for (ns, _), p in self.objects[("", "pods")].items() if ns == namespace]
        for (ns, budget_name), pdb in self.objects[("policy", "poddisruptionbudgets")].items():
            spec = pdb.get("spec", {})
            if ns != namespace or not selector_matches(spec.get("selector"), labels):
                continue
            covered = [p for p in pods if selector_matches(spec.get("selector"), p["metadata"].get("labels") or {})]
            healthy = [
                p
                for p in covered
                if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
            ]
            if "minAvailable" in spec:
                required = _scaled(spec["minAvailable"], len(covered))
            else:
                required = len(covered) - _scaled(spec.get("maxUnavailable", 0), len(covered))
            if len(healthy) - required < 1:
                return budget_name
        return None

    async def _scale(self, request: web.Request, namespace: str, name: str, verb: str) -> web.Response:
        res = ("apps", "deployments")
        deployment = self._get(res, namespace, name)
        if verb == "patch":
            if request.headers.get("Content-Type", "") not in _PATCH_TYPES:
                raise _ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format")
            patch = await request.json()
            replicas = (patch.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise _ApiError(422, "Invalid", f'Scale.autoscaling "{name}" is invalid: spec.replicas')
            if replicas != deployment["spec"].get("replicas", 1):

                def rescale(obj: Obj) -> None:
                    obj["spec"]["replicas"] = replicas

                deployment = self.update("deployments", namespace, name, rescale, group="apps")
        elif verb != "get":
            raise _ApiError(405, "MethodNotAllowed", f"{verb} is not supported on deployments/scale")
        selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"].get("matchLabels", {}).items())
        meta = deployment["metadata"]
        scale = {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")},
            "spec": {"replicas": deployment["spec"].get("replicas", 1)},
            "status": {"replicas": deployment.get("status", {}).get("replicas", 0), "selector": selector},
        }
        return web.json_response(scale)


def _pairs(selector: str) -> dict[str, str]:
    pairs = {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.replace("==", "=").partition("=")
        pairs[key.strip()] = value.strip()
    return pairs


# -- objects as the API returns them ----------------------------------------------------------------------------
def node(name: str, gpus: int = 0, labels: Mapping[str, str] | None = None, ready: bool = True) -> Obj:
    return {
        "metadata": {"name": name, "labels": dict(labels or {"kubernetes.io/hostname": name})},
        "spec": {"podCIDR": "10.244.0.0/24"},
        "status": {
            "capacity": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": str(gpus)},
            "allocatable": {"cpu": "15900m", "memory": "63Gi", "nvidia.com/gpu": str(gpus)},
            "conditions": [
                {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
                {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"},
            ],
        },
    }


def deployment(namespace: str, name: str, replicas: int, gpus: int = 1) -> Obj:
    labels = {"app.kubernetes.io/name": name}
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels), "generation": 1},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "containers": [
                        {"name": "server", "image": "vllm/vllm-openai:v0.6.0", "resources": _gpu_limits(gpus)},
                        {"name": "sidecar", "image": "busybox", "resources": {"limits": {"cpu": "100m"}}},
                    ]
                },
            },
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}},
        },
        "status": {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas},
    }


def pod(
    namespace: str,
    deployment_name: str,
    suffix: str,
    node_name: str,
    phase: str = "Running",
    gpus: int = 1,
    template_hash: str = "5d4f8c7b9",
) -> Obj:
    replica_set = f"{deployment_name}-{template_hash}"
    return {
        "metadata": {
            "name": f"{replica_set}-{suffix}",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": deployment_name, "pod-template-hash": template_hash},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": replica_set,
                    "uid": str(uuid.uuid4()),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "server", "image": "vllm/vllm-openai:v0.6.0", "resources": _gpu_limits(gpus)}],
        },
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(phase == "Running")}]},
    }


def pdb(namespace: str, name: str, selector: Mapping[str, str], **budget: int | str) -> Obj:
    """``min_available=`` or ``max_unavailable=``: an int or a percentage string."""
    spec: Obj = {"selector": {"matchLabels": dict(selector)}}
    spec.update({"minAvailable" if k == "min_available" else "maxUnavailable": v for k, v in budget.items()})
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


def _gpu_limits(gpus: int) -> Obj:
    if gpus == 0:
        return {"limits": {"cpu": "4"}}
    return {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "8"}, "requests": {"nvidia.com/gpu": str(gpus)}}


def names(objs: Iterable[Obj]) -> list[str]:
    return [o["metadata"]["name"] for o in objs]
