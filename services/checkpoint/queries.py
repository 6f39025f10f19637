"""Read-only answers from the registry: where a session's KV is now (``kv.session.where`` over the bus, and
``GET /sessions/<id>`` on the HTTP endpoint), a page of the sessions of a node, pod or deployment, and the
fleet's session counts. Each reads what its answer needs (an index per node and pod), never every session."""

from __future__ import annotations

import json
from collections import defaultdict
from urllib.parse import unquote

from shared.contract.base import id_problem
from shared.contract.registry import codec
from shared.contract.sessions import (
    FleetQuery,
    FleetSummary,
    SessionLocation,
    SessionRecord,
    SessionsPage,
    SessionsQuery,
    WhereIsSession,
)
from shared.plumbing.errors import TemporaryError
from shared.plumbing.http import Response

from .ports import Registry


class SessionQueries:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def on_where(self, event: WhereIsSession) -> SessionLocation:
        """Read-only: where the session's KV is now, from the registry."""
        return await self.registry.where(event.session_id)

    async def on_sessions_query(self, query: SessionsQuery) -> SessionsPage:
        """Read-only: a page of the sessions of a node or a pod (their indexes), of a deployment (its pods'
        indexes) or of all (every pod's index in turn). What it reads follows the page, plus the list of pods
        when no node or pod is named; never every session."""
        if not (query.node or query.pod):
            return await self._pods_page(query)
        records, cursor, total = await self.registry.sessions_page(
            node=query.node, pod=query.pod, cursor=query.cursor, limit=query.limit
        )
        if query.deployment:
            records = [r for r in records if (r.namespace, r.deployment) == (query.namespace, query.deployment)]
        return SessionsPage(sessions=records, next_cursor=cursor, total=total)

    async def _pods_page(self, query: SessionsQuery) -> SessionsPage:
        """The sessions of every pod (of the deployment, when one is named), pod by pod: the cursor is
        ``<pod index>:<cursor within the pod>``."""
        total: int | None = None
        if query.deployment:
            counts = await self.registry.summary()
            wanted = f"{query.namespace}/{query.deployment}"
            pods = sorted(p for p, d in counts.deployments.items() if d == wanted)
            total = sum(counts.by_pod[p] for p in pods)
        else:
            pods = sorted(await self.registry.pods())
        index, _, inner = query.cursor.partition(":")
        at = int(index) if index.isdigit() else 0
        records: list[SessionRecord] = []
        while at < len(pods) and len(records) < query.limit:
            page, inner, _ = await self.registry.sessions_page(
                pod=pods[at], cursor=inner, limit=query.limit - len(records)
            )
            records += page
            if not inner:
                at += 1
        cursor = f"{at}:{inner}" if at < len(pods) else ""
        return SessionsPage(sessions=records, next_cursor=cursor, total=total)

    async def on_fleet_query(self, query: FleetQuery) -> FleetSummary:
        """Read-only: session counts per node, pod and deployment, from the pods' indexes (never per session)."""
        counts = await self.registry.summary()
        by_node: dict[str, int] = defaultdict(int)
        by_deployment: dict[str, int] = defaultdict(int)
        for pod, count in counts.by_pod.items():
            by_node[counts.nodes.get(pod, "")] += count
            by_deployment[counts.deployments.get(pod, "/")] += count
        return FleetSummary(
            sessions_total=sum(counts.by_pod.values()),
            by_node=dict(by_node),
            by_pod=counts.by_pod,
            by_deployment=dict(by_deployment),
            pods=counts.nodes,
            alive=counts.alive,
        )

    async def on_http_session(self, method: str, path: str) -> Response:
        """``GET /sessions/<id>``: the ``kv.session.location`` JSON of the session; 200 while a pod holds it,
        404 when none does (ended, dropped, its pod gone, or never seen: the body says which), 400 for a bad
        id, 503 while Redis is unreachable."""
        sid = unquote(path.removeprefix("/sessions/"))
        problem = id_problem("session", sid)
        if problem:
            return _json_error(
                "400 Bad Request", f"{problem} (GET /sessions/<id>)" if sid else "no session id: GET /sessions/<id>"
            )
        try:
            location = await self.registry.where(sid)
        except TemporaryError as exc:
            return _json_error("503 Service Unavailable", str(exc))
        status = "200 OK" if location.held else "404 Not Found"
        return status, "application/json", codec.encode(location)


def _json_error(status: str, message: str) -> Response:
    return status, "application/json", json.dumps({"error": message}).encode()
