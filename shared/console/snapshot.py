"""``gpuwarden status``: the mesh as one value, read from where the mesh keeps it.

- nodes, pods and deployments: the cluster port (the simulated cluster in Redis, or the Kubernetes API);
- driver version, GPUs, their health and MIG instances: each node's newest ``device.inventory`` event (JetStream);
- GPU utilisation and memory in use: ``metrics.gpu.sample`` telemetry heard on core NATS while the snapshot is
  taken (``null`` when none was heard: unknown, never 0);
- upgrade state: the node label ``nvidia.com/gpu-driver-upgrade-state`` (and its failure annotation);
- why a deployment has its replica count: its newest ``scaler.decision`` event;
- sessions, checkpoints and drains: the checkpoint service's registry in Redis (read only);
- whether a session was verified after a restore: its newest ``checkpoint.restored`` event, which a KV agent
  publishes only after every chunk digest and the manifest were checked, for the pod and generation that hold it.

The JSON form (``status --json``) is a stable, documented contract (docs/cli.md): fields are only ever added.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from shared.console.client import MeshClient
from shared.contract.checkpoint import SessionRestored
from shared.contract.configdocs import ModelVersions
from shared.contract.device import DeviceInventory
from shared.contract.metrics import GpuSample
from shared.contract.scaler import ScaleDecision
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.rollouts import read_models
from shared.ports.cluster import NodeInfo, PodInfo

UPGRADE_STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
UPGRADE_FAILURE_ANNOTATION = "gpuwarden.io/driver-upgrade-failure"
CORDON_DRAIN_ANNOTATION = "gpuwarden.io/cordon-drain-id"
"""The drain asked for a node cordoned by someone other than the upgrade coordinator. The driver service reads it
(``services/driver/upgrade.py``): a node cordoned with this annotation already set gets no second drain."""
UPGRADE_WAS_CORDONED_ANNOTATION = "gpuwarden.io/driver-upgrade-was-cordoned"
"""``true``: a person wants the node cordoned whatever the driver upgrade does; the upgrade leaves it cordoned
when done (``services/driver/upgrade.py``, ``WAS_CORDONED_ANNOTATION``)."""
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
    why: str = ""
    """The newest scale decision's reason, or what else explains the count."""
    pods: list[str] = msgspec.field(default_factory=list)
    serving_version: str = ""
    """The model version new sessions start on ('' until a first rollout records one)."""
    rollout: RolloutView | None = None


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
    state: str = "held"
    """held: its pod runs; moving: its pod is terminating or gone, and the session is restored elsewhere on its
    next request (the registry drops it once the pod's announcements lapse)."""


class DrainView(msgspec.Struct, kw_only=True):
    id: str
    node: str
    state: str
    """running, completed or failed (the checkpoint service's record of the saves)."""
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
    drains: list[DrainView]
    services: dict[str, str] = msgspec.field(default_factory=dict)
    """Each service the run's state file lists -> ok, degraded or unreachable."""
    simulation: dict[str, Any] | None = None
    """The simulated workload's own counters (requests, restored, lost, ...), when it runs."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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


async def _health(url: str) -> str:
    try:
        body = await get_json(url, timeout=2.0)
    except Exception:
        return "unreachable"
    return str(body.get("status", "ok")) if isinstance(body, dict) else "ok"


async def take(mesh: MeshClient, samples: SampleListener | None = None, sample_wait_s: float = 0.0) -> MeshStatus:
    """One snapshot. With ``samples`` (already listening) it waits up to ``sample_wait_s`` for a utilisation
    sample of every GPU the inventories name."""
    cluster = mesh.need_cluster()
    infos, pods, deployments = await asyncio.gather(cluster.nodes(), cluster.pods(), cluster.deployments())
    s = mesh.subjects
    inventories: dict[str, DeviceInventory] = {}
    for info in infos:
        found = await mesh.last_event(s.pattern("device.inventory", node=info.name))
        if isinstance(found, DeviceInventory):
            inventories[info.name] = found
    if samples is not None and sample_wait_s > 0:
        await samples.wait_for({g.uuid for inv in inventories.values() for g in inv.gpus}, sample_wait_s)
    sessions = await read_sessions(mesh)
    serving = {p.name for p in pods if p.phase == "Running"}
    by_node: dict[str, int] = {}
    for session in sessions:
        if session.pod not in serving:
            session.state = "moving"
            continue
        by_node[session.node] = by_node.get(session.node, 0) + 1
    nodes = [
        _node_view(info, inventories.get(info.name), pods, samples, by_node.get(info.name, 0))
        for info in sorted(infos, key=lambda n: n.name)
    ]
    models = await read_model_versions(mesh)
    views = []
    for dep in sorted(deployments, key=lambda d: (d.namespace, d.name)):
        mine = [p for p in pods if p.namespace == dep.namespace and p.deployment == dep.name]
        decision = await mesh.last_event(s.pattern("scaler.decision", namespace=dep.namespace, deployment=dep.name))
        running = sum(1 for p in mine if p.phase == "Running")
        view = DeploymentView(
            namespace=dep.namespace,
            name=dep.name,
            replicas=running,
            desired=dep.replicas,
            pods=[f"{p.name}@{p.node or '-'}:{p.phase}" for p in mine],
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
            view.why = decision.reason
        elif running < dep.replicas:
            view.why = f"{dep.replicas - running} pod(s) starting or waiting for a GPU"
        else:
            view.why = "no scale decision yet (no KEDA ScaledObject asked)"
        views.append(view)
    drains = await read_drains(mesh, infos, pods, by_node)
    services = dict(zip(mesh.services, await asyncio.gather(*map(_health, mesh.services.values())), strict=True))
    simulation = None
    sim_url = mesh.services.get("sim")
    if sim_url:
        with contextlib.suppress(Exception):
            body = await get_json(sim_url, timeout=2.0)
            sim = body.get("simulation") if isinstance(body, dict) else None
            if isinstance(sim, dict):
                simulation = {k: v for k, v in sim.items() if k not in ("pods", "tracked")}
    return MeshStatus(
        taken_at=time.time(),
        root=s.root,
        simulated=mesh.simulated,
        nodes=nodes,
        deployments=views,
        sessions=sessions,
        drains=drains,
        services=services,
        simulation=simulation,
    )


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
        pods=[p.name for p in pods if p.node == info.name],
        sessions=sessions,
    )


async def read_model_versions(mesh: MeshClient) -> ModelVersions:
    """The ``models`` document (serving versions and rollouts); empty when none was written or it is unreadable."""
    try:
        _, models = await read_models(ConfigStore(mesh.redis, mesh.subjects))
    except Exception:
        return ModelVersions()
    return models


async def _scan(redis: Any, pattern: str) -> list[str]:
    return [_text(k) async for k in redis.scan_iter(match=pattern, count=500)]


async def read_sessions(mesh: MeshClient) -> list[SessionView]:
    """Every session the registry places on a pod, with its newest checkpoint and how it got there."""
    s = mesh.subjects
    prefix = s.redis_key("kv", "session", "")
    keys = sorted(await _scan(mesh.redis, prefix + "*"))
    if not keys:
        return []
    async with mesh.redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hgetall(key)
            pipe.zrevrange(s.redis_key("kv", "checkpoints", key[len(prefix) :]), 0, 0)
        replies = await pipe.execute()
    out: list[SessionView] = []
    newest: dict[str, str] = {}
    for i, key in enumerate(keys):
        fields = {_text(k): _text(v) for k, v in (replies[2 * i] or {}).items()}
        if not fields.get("pod"):
            continue
        sid = key[len(prefix) :]
        out.append(
            SessionView(
                id=sid,
                pod=fields["pod"],
                node=fields.get("node", ""),
                namespace=fields.get("namespace", ""),
                deployment=fields.get("deployment", ""),
                generation=int(fields.get("generation", "0") or 0),
            )
        )
        if replies[2 * i + 1]:
            newest[sid] = _text(replies[2 * i + 1][0])
    if newest:
        raws = await mesh.redis.mget([s.redis_key("kv", "checkpoint", c) for c in newest.values()])
        summaries = dict(zip(newest, raws, strict=True))
    else:
        summaries = {}
    restored = await asyncio.gather(*(mesh.last_event(s.pattern("checkpoint.restored", session_id=v.id)) for v in out))
    for view, event in zip(out, restored, strict=True):
        raw = summaries.get(view.id)
        if raw:
            with contextlib.suppress(ValueError, msgspec.DecodeError):
                summary = msgspec.json.decode(raw)
                view.bytes = int(summary.get("bytes_total", 0))
                view.tokens = int(summary.get("token_count", 0))
                view.last_checkpoint = CheckpointView(
                    id=str(summary.get("checkpoint_id", newest[view.id])),
                    at=summary.get("recorded_at"),
                    bytes=view.bytes,
                    tokens=view.tokens,
                )
        if isinstance(event, SessionRestored) and event.pod == view.pod and event.generation == view.generation:
            view.verified_after_restore = True
            view.restored_from = event.checkpoint_id
    return sorted(out, key=lambda v: (v.node, v.pod, v.id))


async def read_drains(
    mesh: MeshClient, infos: list[NodeInfo], pods: list[PodInfo], sessions_by_node: dict[str, int]
) -> list[DrainView]:
    """Drains the registry records that are running, or whose node is still cordoned (its pods and sessions on
    the way out): the drains in flight, with what is left on their node."""
    s = mesh.subjects
    prefix = s.redis_key("kv", "drain", "")
    keys = [k for k in await _scan(mesh.redis, prefix + "*") if ":" not in k[len(prefix) :]]
    cordoned = {n.name for n in infos if not n.schedulable}
    out = []
    for key in keys:
        fields = {_text(k): _text(v) for k, v in (await mesh.redis.hgetall(key)).items()}
        node = fields.get("node", "")
        state = fields.get("state", "")
        if state != "running" and node not in cordoned:
            continue
        view = DrainView(
            id=key[len(prefix) :],
            node=node,
            state=state,
            started_at=float(fields["started"]) if fields.get("started") else None,
            duration_s=float(fields["duration_s"]) if fields.get("duration_s") else None,
            pods_left=sum(1 for p in pods if p.node == node),
            sessions_left=sessions_by_node.get(node, 0),
            cordoned=node in cordoned,
        )
        verdict = fields.get("verdict")
        if verdict:
            with contextlib.suppress(ValueError, msgspec.DecodeError):
                decoded = msgspec.json.decode(verdict)
                view.sessions_committed = int(decoded.get("sessions_committed", 0))
                view.reason = str(decoded.get("reason", ""))
        out.append(view)
    latest: dict[str, DrainView] = {}
    for view in sorted(out, key=lambda d: d.started_at or 0.0):
        latest[view.node] = view  # the newest drain of each node
    return sorted(latest.values(), key=lambda d: d.node)


def to_json(status: MeshStatus) -> bytes:
    return msgspec.json.encode(status)
