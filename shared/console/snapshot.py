"""``gpuwarden status``: the mesh as one value, read from where the mesh keeps it.

- nodes, pods and deployments: the cluster port (the simulated cluster in Redis, or the Kubernetes API);
- driver version, GPUs, their health and MIG instances: each node's newest ``device.inventory`` event (JetStream);
- GPU utilisation and memory in use: ``metrics.gpu.sample`` telemetry heard on core NATS while the snapshot is
  taken, up to ``--sample`` seconds (``SAMPLE_WAIT_S``; ``null`` when none was heard: unknown, never 0);
- upgrade state: the node label ``nvidia.com/gpu-driver-upgrade-state`` (and its failure annotation);
- why a deployment has its replica count: its newest ``scaler.decision`` event;
- sessions and their counts: asked of the checkpoint service (``kv.fleet.query`` for the counts per node, pod and
  deployment, ``kv.sessions.query`` for a page of sessions, of one node, pod or deployment with ``--node``,
  ``--pod`` or ``--deployment``): what it costs follows the pods and the page, never the number of sessions;
- drains: each node's newest ``node.drain.requested`` and its verdict in the events stream (JetStream);
- whether a session was verified after a restore: its newest ``checkpoint.restored`` event, which a KV agent
  publishes only after every chunk digest and the manifest were checked, for the pod and generation that hold it.

The newest events of every node, deployment and listed session are read in a few batched reads of the events stream
(``shared.plumbing.newest``: one request per 1,000 subjects), not one read each, and everything is read at once: at
1,000 nodes the reads cost about what they cost at 3.

The JSON form (``status --json``) is a stable, documented contract (docs/cli.md): fields are only ever added.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Literal

import msgspec

from shared.clients.drains import StoredDrain, newest_drains
from shared.clients.rollouts import read_models
from shared.console.client import CommandError, MeshClient
from shared.console.process import QUICK_METRICS_UP_TO
from shared.console.state import named
from shared.contract.annotations import UPGRADE_FAILURE_ANNOTATION, UPGRADE_STATE_LABEL
from shared.contract.base import Event
from shared.contract.checkpoint import SessionRestored
from shared.contract.configdocs import ModelVersions
from shared.contract.deadletter import DeadLetter
from shared.contract.device import DeviceInventory
from shared.contract.metrics import GpuSample
from shared.contract.node import DrainCompleted, DrainFailed, DrainOutcome
from shared.contract.scaler import ScaleDecision
from shared.contract.sessions import FleetQuery, FleetSummary, SessionRecord, SessionsPage, SessionsQuery
from shared.plumbing.configsync import ConfigStore
from shared.ports.cluster import DeploymentInfo, NodeInfo, PodInfo

_DRIVER_LABELS = ("nvidia.com/cuda.driver.major", "nvidia.com/cuda.driver.minor", "nvidia.com/cuda.driver.rev")


class MigView(msgspec.Struct, kw_only=True):
    uuid: str
    profile: str
    memory_mib: int = 0


class GpuView(msgspec.Struct, kw_only=True):
    index: int
    uuid: str
    model: str
    healthy: bool
    memory_total_mib: int
    memory_used_mib: float | None = None
    util_percent: float | None = None
    mig_enabled: bool = False
    mig: list[MigView] = msgspec.field(default_factory=list)


class NodeView(msgspec.Struct, kw_only=True):
    name: str
    schedulable: bool
    ready: bool
    driver_version: str
    upgrade_state: str
    upgrade_failure: str = ""
    gpus: list[GpuView] = msgspec.field(default_factory=list)
    pods: list[str] = msgspec.field(default_factory=list)
    sessions: int = 0


class RolloutView(msgspec.Struct, kw_only=True):
    """The deployment's newest model rollout (the ``models`` document)."""

    id: str
    phase: str
    """``preparing``, ``switched`` or ``aborted``."""
    from_version: str
    to_version: str
    ready: list[str] = msgspec.field(default_factory=list)
    failed: list[str] = msgspec.field(default_factory=list)
    reason: str = ""


class DeploymentView(msgspec.Struct, kw_only=True):
    namespace: str
    name: str
    replicas: int
    """Pods serving now (Running)."""
    desired: int
    """What the deployment asks for now (its spec's replica count)."""
    scaler_desired: int | None = None
    scaler_signal: str = ""
    """What set the newest scale decision's count: ``queue``, ``gpu``, ``kv``, ``ttft``, ``queue+gpu``, or a later
    step (``maxReplicas``, ``held``, ``stabilisation``, ...: services/scaler/decision.py); empty without one."""
    why: str = ""
    """The newest scale decision's reason, or what else explains the count."""
    pods: list[str] = msgspec.field(default_factory=list)
    sessions: int = 0
    """Sessions held by its running pods."""
    serving_version: str = ""
    """The model version new sessions start on ('' until a first rollout records one)."""
    rollout: RolloutView | None = None
    landed: dict[str, int] | None = None
    """Where the router sent this deployment's requests since it started (holder, prefetched, cold, new,
    no_session, refused_session, unavailable: docs/routing.md); None when no router picks for it."""


class CheckpointView(msgspec.Struct, kw_only=True):
    id: str
    at: float | None = None
    bytes: int = 0
    tokens: int = 0


class SessionView(msgspec.Struct, kw_only=True):
    id: str
    pod: str
    node: str
    namespace: str = ""
    deployment: str = ""
    generation: int = 0
    bytes: int = 0
    """Bytes of the session's KV cache as of its last checkpoint."""
    tokens: int = 0
    last_checkpoint: CheckpointView | None = None
    verified_after_restore: bool | None = None
    """True: the pod holding it now restored it and every digest checked out; None: it did not come from a
    checkpoint on this pod (started or recomputed here)."""
    restored_from: str = ""
    tokens_recomputed: int | None = None
    """With ``verified_after_restore``: the tokens after that checkpoint its pod computed again (a pod lost without
    a final save: what its journal or last checkpoint did not hold); None when not restored here, or when the pod
    did not know the conversation's length."""
    restored_generation: int | None = None
    """The generation under which it was last restored and verified, when that is not the generation it is held
    under now (it was restored on an earlier pod, then taken by this one without a restore); else None."""
    state: str = "held"
    """held: its pod runs; moving: its pod is terminating or gone, and the session is restored elsewhere on its
    next request (the registry drops it once the pod's announcements lapse)."""


class DrainView(msgspec.Struct, kw_only=True):
    id: str
    node: str
    state: Literal["running"] | DrainOutcome
    """running (asked, no verdict yet), else the checkpoint service's verdict on the saves (its ``DrainOutcome``)."""
    started_at: float | None = None
    duration_s: float | None = None
    sessions_committed: int = 0
    reason: str = ""
    pods_left: int = 0
    sessions_left: int = 0
    cordoned: bool = False


class MeshStatus(msgspec.Struct, kw_only=True):
    taken_at: float
    root: str
    simulated: bool
    nodes: list[NodeView]
    deployments: list[DeploymentView]
    sessions: list[SessionView]
    """A page of the sessions (of ``--node``, ``--pod`` or ``--deployment`` when given), at most ``--sessions``
    of them."""
    drains: list[DrainView]
    sessions_total: int | None = None
    """Sessions the registry places on pods (of ``--node``, ``--pod`` or ``--deployment``); None when the
    checkpoint service did not answer."""
    sessions_moving: int = 0
    """Of those, sessions whose pod is terminating or gone: restored elsewhere on their next request."""
    sessions_error: str = ""
    """Why the sessions could not be read ('' when they were)."""
    services: dict[str, str] = msgspec.field(default_factory=dict)
    """Each service the run's state file lists -> ok, degraded or unreachable."""
    simulation: dict[str, Any] | None = None
    """The simulated workload's own counters (requests, restored, lost, ...), when it runs."""
    sessions_by_pod: dict[str, int] = msgspec.field(default_factory=dict)
    """Sessions the registry places on each pod (a pod terminating or gone among them: its sessions moving)."""


def driver_from_labels(labels: dict[str, str]) -> str:
    parts = [labels.get(k, "") for k in _DRIVER_LABELS]
    return ".".join(p for p in parts if p) if parts[0] else ""


class SampleListener:
    """The newest ``metrics.gpu.sample`` per GPU heard since ``start``."""

    def __init__(self, mesh: MeshClient) -> None:
        self.mesh = mesh
        self.samples: dict[str, GpuSample] = {}
        self._heard = asyncio.Event()
        self._sub: Any = None

    async def start(self) -> None:
        async def on_sample(event: GpuSample) -> None:
            if not event.gpu_instance_id:
                self.samples[event.gpu_uuid] = event
                self._heard.set()

        self._sub = await self.mesh.bus.subscribe(
            self.mesh.subjects.pattern("metrics.gpu.sample"), on_sample, (GpuSample,), name="cli-samples"
        )

    async def wait_for(self, uuids: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not uuids <= set(self.samples):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._heard.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heard.wait(), left)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


def _get_json_blocking(url: str, timeout: float) -> Any:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:  # the run's own services, on loopback
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:  # a 503 still says why in its body
        return json.loads(exc.read() or b"{}")


async def get_json(url: str, timeout: float = 2.0) -> Any:
    return await asyncio.to_thread(_get_json_blocking, url, timeout)


async def _health_body(url: str) -> Any:
    """A process's ``/healthz`` body; None when it does not answer."""
    try:
        return await get_json(url, timeout=2.0)
    except Exception:
        return None


def _health(body: Any) -> str:
    if body is None:
        return "unreachable"
    return str(body.get("status", "ok")) if isinstance(body, dict) else "ok"


SAMPLE_WAIT_S = 2.5
"""How long ``status`` listens for utilisation samples by default in a mesh of up to ``QUICK_METRICS_UP_TO``
nodes, whose metrics services ``gpuwarden up`` has read every 2 s: every GPU is heard. A larger fleet's read every
15 s (as Prometheus scrapes dcgm-exporter), where a one-off ``status`` would wait 2.5 s to hear a sixth of them: it
shows what it heard while reading the rest (``--sample S`` waits anyway, ``--watch`` fills them in)."""
SESSION_PAGE = 100
"""Sessions a snapshot lists by default (``--sessions``): the counts cover every session whatever the page."""


async def take(
    mesh: MeshClient,
    samples: SampleListener | None = None,
    sample_wait_s: float | None = 0.0,
    *,
    node: str = "",
    pod: str = "",
    deployment: str = "",
    max_sessions: int = SESSION_PAGE,
) -> MeshStatus:
    """One snapshot. With ``samples`` (already listening) it waits, up to ``sample_wait_s`` from its start and
    meanwhile reading the rest, for a utilisation sample of every GPU the inventories name (of ``node``'s alone
    with ``node``); None: ``SAMPLE_WAIT_S`` in a mesh of up to ``QUICK_METRICS_UP_TO`` nodes, none beyond.
    Sessions: the counts of the whole fleet, and a page of at most ``max_sessions`` (of ``node``, ``pod`` or
    ``deployment`` ``namespace/name`` when given). What it reads follows the fleet's nodes,
    deployments and pods in a few batched reads each, and the page, never the number of sessions."""
    began = time.monotonic()
    cluster = mesh.need_cluster()
    infos, pods, deployments = await asyncio.gather(cluster.nodes(), cluster.pods(), cluster.deployments())
    _check_filters(infos, pods, deployments, node=node, pod=pod, deployment=deployment)
    if sample_wait_s is None:
        sample_wait_s = SAMPLE_WAIT_S if len(infos) <= QUICK_METRICS_UP_TO else 0.0
    wait_s = sample_wait_s
    s = mesh.subjects
    inventory_of = {info.name: s.pattern("device.inventory", node=info.name) for info in infos}
    decision_of = {
        (d.namespace, d.name): s.pattern("scaler.decision", namespace=d.namespace, deployment=d.name)
        for d in deployments
    }

    async def stored_then_samples() -> dict[str, Any]:
        stored = await mesh.last_events([*inventory_of.values(), *decision_of.values()])
        if samples is not None and wait_s > 0:
            shown = [inventory_of[node]] if node else inventory_of.values()
            uuids = {
                g.uuid for subject in shown if isinstance(inv := stored.get(subject), DeviceInventory) for g in inv.gpus
            }
            await samples.wait_for(uuids, wait_s - (time.monotonic() - began))
        return stored

    stored, counted, models, found_drains, bodies = await asyncio.gather(
        stored_then_samples(),
        _sessions(mesh, pods, node=node, pod=pod, deployment=deployment, limit=max_sessions),
        read_model_versions(mesh),
        newest_drains(mesh.bus, [info.name for info in infos]),
        asyncio.gather(*map(_health_body, mesh.services.values())),
    )
    health_of = dict(zip(mesh.services, bodies, strict=True))  # each process asked once
    landed, simulation = _landed(health_of.get("router")), _simulation(health_of.get("sim"))
    by_node, by_pod, by_deployment, sessions, total, moving, error = counted
    pods_on: dict[str, list[PodInfo]] = {}
    pods_of: dict[tuple[str, str], list[PodInfo]] = {}
    for p in pods:
        pods_on.setdefault(p.node, []).append(p)
        pods_of.setdefault((p.namespace, p.deployment), []).append(p)
    nodes = []
    for info in sorted(infos, key=lambda n: n.name):
        inventory = stored.get(inventory_of[info.name])
        inventory = inventory if isinstance(inventory, DeviceInventory) else None
        nodes.append(_node_view(info, inventory, pods_on.get(info.name, []), samples, by_node.get(info.name, 0)))
    views = []
    for dep in sorted(deployments, key=lambda d: (d.namespace, d.name)):
        mine = pods_of.get((dep.namespace, dep.name), [])
        decision = stored.get(decision_of[dep.namespace, dep.name])
        running = sum(1 for p in mine if p.phase == "Running")
        view = DeploymentView(
            namespace=dep.namespace,
            name=dep.name,
            replicas=running,
            desired=dep.replicas,
            pods=[f"{p.name}@{p.node or '-'}:{p.phase}" for p in mine],
            sessions=by_deployment.get(f"{dep.namespace}/{dep.name}", 0),
            landed=landed.get(f"{dep.namespace}/{dep.name}"),
        )
        model = models.deployments.get(f"{dep.namespace}/{dep.name}")
        if model is not None:
            view.serving_version = model.serving_version
            if (r := model.rollout) is not None:
                view.rollout = RolloutView(
                    id=r.rollout_id,
                    phase=r.phase,
                    from_version=r.from_version,
                    to_version=r.to_version,
                    ready=list(r.ready),
                    failed=list(r.failed),
                    reason=r.reason,
                )
        if isinstance(decision, ScaleDecision):
            view.scaler_desired = decision.desired_replicas
            view.scaler_signal = decision.signal
            view.why = decision.reason
        elif running < dep.replicas:
            view.why = f"{dep.replicas - running} pod(s) starting or waiting for a GPU"
        else:
            view.why = "no scale decision yet (no KEDA ScaledObject asked)"
        views.append(view)
    return MeshStatus(
        taken_at=time.time(),
        root=s.root,
        simulated=mesh.simulated,
        nodes=nodes,
        deployments=views,
        sessions=sessions,
        drains=drain_views(infos, pods_on, by_node, found_drains),
        services={label: _health(body) for label, body in health_of.items()},
        simulation=simulation,
        sessions_total=total,
        sessions_moving=moving,
        sessions_error=error,
        sessions_by_pod=by_pod,
    )


def _check_filters(
    infos: list[NodeInfo],
    pods: list[PodInfo],
    deployments: list[DeploymentInfo],
    *,
    node: str,
    pod: str,
    deployment: str,
) -> None:
    """``CommandError`` naming what the cluster has, for a ``--node``, ``--pod`` or ``--deployment`` it lacks."""
    if node and node not in {info.name for info in infos}:
        raise CommandError(f"--node {node}: no such node in the cluster (nodes: {named(i.name for i in infos)})")
    if pod and pod not in {p.name for p in pods}:
        raise CommandError(f"--pod {pod}: no such pod in the cluster (pods: {named(p.name for p in pods)})")
    if deployment:
        known = {f"{d.namespace}/{d.name}" for d in deployments}
        if deployment not in known:
            raise CommandError(
                f"--deployment {deployment}: no such deployment in the cluster (NAMESPACE/NAME: {named(known)})"
            )


async def _sessions(
    mesh: MeshClient, pods: list[PodInfo], *, node: str, pod: str, deployment: str, limit: int
) -> tuple[dict[str, int], dict[str, int], dict[str, int], list[SessionView], int | None, int, str]:
    """The checkpoint service's counts and page: sessions held by a running pod per node, per pod and per
    deployment; the page (of the filter); the total and the moving of the filter (None and 0, with why, when the
    service did not answer)."""
    serving = {p.name for p in pods if p.phase == "Running"}
    owner_of = {p.name: f"{p.namespace}/{p.deployment}" for p in pods}
    try:
        summary, sessions = await asyncio.gather(
            fleet_summary(mesh), read_sessions(mesh, node=node, pod=pod, deployment=deployment, limit=limit)
        )
    except CommandError as exc:
        return {}, {}, {}, [], None, 0, str(exc)
    by_node: dict[str, int] = {}
    by_deployment: dict[str, int] = {}
    moving = 0
    for name, count in summary.by_pod.items():
        where = summary.pods.get(name, "")
        if name not in serving:
            if (
                (not node or where == node)
                and (not pod or name == pod)
                and (not deployment or owner_of.get(name) == deployment)
            ):
                moving += count
            continue
        by_node[where] = by_node.get(where, 0) + count
        by_deployment[owner_of[name]] = by_deployment.get(owner_of[name], 0) + count
    if pod:
        total = summary.by_pod.get(pod, 0)
    elif deployment:
        total = summary.by_deployment.get(deployment, 0)
    else:
        total = summary.by_node.get(node, 0) if node else summary.sessions_total
    for session in sessions:
        if session.pod not in serving:
            session.state = "moving"
    return by_node, dict(summary.by_pod), by_deployment, sessions, total, moving, ""


def _landed(body: Any) -> dict[str, dict[str, int]]:
    """Per deployment the router picks for, where its requests were sent, from the ``router`` process's health
    body (empty when none runs or it does not answer)."""
    found = body.get("landed") if isinstance(body, dict) else None
    if not isinstance(found, dict):
        return {}
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        return {
            str(pool): {str(k): int(v) for k, v in counts.items()}
            for pool, counts in found.items()
            if isinstance(counts, dict)
        }
    return {}


def _simulation(body: Any) -> dict[str, Any] | None:
    """The simulated workload's own counters, from the ``sim`` process's health body (None when none runs)."""
    sim = body.get("simulation") if isinstance(body, dict) else None
    if isinstance(sim, dict):
        return {k: v for k, v in sim.items() if k not in ("pods", "tracked")}
    return None


def _node_view(
    info: NodeInfo,
    inventory: DeviceInventory | None,
    pods: list[PodInfo],
    samples: SampleListener | None,
    sessions: int,
) -> NodeView:
    gpus = []
    heard = samples.samples if samples is not None else {}
    for gpu in inventory.gpus if inventory else []:
        sample = heard.get(gpu.uuid)
        used = util = None
        if sample is not None:
            util = None if "gpu_util" in sample.missing else sample.gpu_util
            used = None if "mem_used_mib" in sample.missing else sample.mem_used_mib
        gpus.append(
            GpuView(
                index=gpu.index,
                uuid=gpu.uuid,
                model=gpu.model,
                healthy=gpu.healthy,
                memory_total_mib=gpu.memory_total_mib,
                memory_used_mib=used,
                util_percent=util,
                mig_enabled=gpu.mig_enabled,
                mig=[MigView(uuid=m.uuid, profile=m.profile, memory_mib=m.memory_mib) for m in gpu.mig_instances],
            )
        )
    return NodeView(
        name=info.name,
        schedulable=info.schedulable,
        ready=info.ready,
        driver_version=(inventory.driver_version if inventory else "") or driver_from_labels(dict(info.labels)),
        upgrade_state=info.labels.get(UPGRADE_STATE_LABEL, ""),
        upgrade_failure=info.annotations.get(UPGRADE_FAILURE_ANNOTATION, ""),
        gpus=gpus,
        pods=[p.name for p in pods],
        sessions=sessions,
    )


async def read_model_versions(mesh: MeshClient) -> ModelVersions:
    """The ``models`` document (serving versions and rollouts); empty when none was written or it is unreadable."""
    try:
        _, models = await read_models(ConfigStore(mesh.redis, mesh.subjects))
    except Exception:
        return ModelVersions()
    return models


async def _ask(mesh: MeshClient, subject: str, question: Event, timeout: float = 10.0) -> Event:
    try:
        answer = await mesh.bus.request(subject, question, timeout)
    except TimeoutError as exc:
        raise CommandError(f"the checkpoint service did not answer ({exc})") from None
    if isinstance(answer, DeadLetter):
        raise CommandError(f"the checkpoint service refused the question: {answer.reason}")
    return answer


async def fleet_summary(mesh: MeshClient) -> FleetSummary:
    """Session counts per node, pod and deployment, from the checkpoint service."""
    answer = await _ask(mesh, mesh.subjects.command("checkpoint", "fleet"), FleetQuery())
    if not isinstance(answer, FleetSummary):
        raise CommandError(f"the checkpoint service answered {answer.kind}, not a fleet summary")
    return answer


async def read_sessions(
    mesh: MeshClient,
    *,
    node: str = "",
    pod: str = "",
    deployment: str = "",
    limit: int | None = None,
    verified: bool = True,
) -> list[SessionView]:
    """The sessions the registry places on pods (of ``node``, ``pod`` or ``deployment`` ``namespace/name`` when
    given), page by page from the checkpoint service, at most ``limit`` (all when None), each with its newest
    checkpoint and, with ``verified``, how it got there (their newest ``checkpoint.restored`` events, a batched
    read per 1,000: a caller that does not show it asks for none)."""
    subject = mesh.subjects.command("checkpoint", "sessions")
    namespace, _, name = deployment.partition("/")
    records: list[SessionRecord] = []
    cursor = ""
    while limit is None or len(records) < limit:
        want = 1000 if limit is None else max(1, min(1000, limit - len(records)))
        query = SessionsQuery(node=node, pod=pod, namespace=namespace, deployment=name, cursor=cursor, limit=want)
        page = await _ask(mesh, subject, query)
        if not isinstance(page, SessionsPage):
            raise CommandError(f"the checkpoint service answered {page.kind}, not a page of sessions")
        records += page.sessions
        cursor = page.next_cursor
        if not cursor:
            break
    out = [
        SessionView(
            id=r.session_id,
            pod=r.pod,
            node=r.node,
            namespace=r.namespace,
            deployment=r.deployment,
            generation=r.generation,
            bytes=r.bytes,
            tokens=r.tokens,
            last_checkpoint=(
                CheckpointView(id=r.checkpoint_id, at=r.checkpoint_at, bytes=r.bytes, tokens=r.tokens)
                if r.checkpoint_id
                else None
            ),
        )
        for r in (records if limit is None else records[:limit])
    ]
    if not verified:
        return sorted(out, key=lambda v: (v.node, v.pod, v.id))
    s = mesh.subjects
    restored_of = {v.id: s.pattern("checkpoint.restored", session_id=v.id) for v in out}
    restored = await mesh.last_events(restored_of.values())
    for view in out:
        event = restored.get(restored_of[view.id])
        if not isinstance(event, SessionRestored):
            continue
        if event.pod == view.pod and event.generation == view.generation:
            view.verified_after_restore = True
            view.restored_from = event.checkpoint_id
            view.tokens_recomputed = event.tokens_recomputed
        else:
            view.restored_generation = event.generation
    return sorted(out, key=lambda v: (v.node, v.pod, v.id))


def drain_views(
    infos: list[NodeInfo],
    pods_on: dict[str, list[PodInfo]],
    sessions_by_node: dict[str, int],
    found: dict[str, StoredDrain],
) -> list[DrainView]:
    """The newest drain of each node, as the events stream holds its request and verdict (the drain client's
    ``newest_drains``, a few batched reads for the whole fleet), when it is still running (asked, no verdict yet)
    or its node is still cordoned (its pods and sessions on the way out): the drains in flight, with what is left
    on their node. Nothing of the checkpoint service's own records is read."""
    out = []
    for info in infos:
        stored = found.get(info.name)
        if stored is None:
            continue
        request, verdict = stored.request, stored.verdict
        if verdict is not None and info.schedulable:
            continue
        asked_at = request.occurred_at.timestamp()
        view = DrainView(
            id=request.drain_id,
            node=info.name,
            state="running",
            started_at=asked_at,
            pods_left=len(pods_on.get(info.name, [])),
            sessions_left=sessions_by_node.get(info.name, 0),
            cordoned=not info.schedulable,
        )
        match verdict:
            case DrainCompleted():
                view.state = verdict.outcome
                view.duration_s = verdict.duration_s
                view.sessions_committed = verdict.sessions_committed
            case DrainFailed():
                view.state = verdict.outcome
                view.duration_s = max(0.0, verdict.occurred_at.timestamp() - asked_at)
                view.sessions_committed = verdict.sessions_committed
                view.reason = verdict.reason
        out.append(view)
    return sorted(out, key=lambda d: d.node)


def to_json(status: MeshStatus) -> bytes:
    return msgspec.json.encode(status)
