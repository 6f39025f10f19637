"""One simulated inference pod while it runs (``PodRuntime``): its KV agent and endpoint, its block pool, its
engines per model version, its load reports and its GPU; and its side of a model rollout (``PodModels``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.contract.models import RolloutState
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.load import LoadReporter
from shared.kv.manifest import KvLayout
from shared.kv.store import CheckpointStore
from shared.plumbing.bus import Bus
from shared.ports.cluster import PodInfo
from shared.sim.blockpool import BlockPool
from shared.sim.cluster import SimCluster
from shared.sim.clusterstate import object_key
from shared.sim.engines import PodEngine

log = logging.getLogger(__name__)


@dataclass
class PodLink:
    """How one pod's KV agent reaches NATS and the checkpoint store: on a secured mesh a connection of its own
    (its pod identity, from its token) and a store that writes as the pod."""

    bus: Bus
    store: CheckpointStore
    own_bus: bool = True
    """The connection is the pod's own (closed when the pod goes), not the simulation's."""
    own_store: bool = True
    """The store is the pod's own (a ``nats://`` family store writing as the pod), not one all pods share."""

    async def close(self) -> None:
        if self.own_store:
            with contextlib.suppress(Exception):
                await self.store.close()
        if self.own_bus:
            await self.bus.close(0.5)


@dataclass
class PodRuntime:
    info: PodInfo
    agent: KvAgent
    endpoint: AgentEndpoint
    pool: BlockPool
    engines: dict[str, PodEngine]
    """The pod's engine per model version it holds: the serving one, and during a rollout the next one (prepared)
    or the previous one (its sessions finish on it)."""
    load: LoadReporter | None = None
    """The pod's ``kv.pod.load`` reports: its pool's blocks used and its requests' time to first token."""
    gpu_uuid: str = ""
    gpu_memory_mib: float = 0.0
    served: int = 0
    reported: tuple[float, float, float] | None = None
    """The load last written on the pod's GPU (written again only when it changes)."""
    stopping: bool = False
    gone: bool = False
    link: PodLink | None = None
    """The pod's own connection and store, when it has them (``SimWorkload.link_pod``): closed when it goes."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """The engine runs one step at a time: held while it computes and while its pool changes, so a session is never
    preempted in the middle of its own turn."""

    def engine_of(self, session_id: str) -> PodEngine:
        """The engine of the model version the session is pinned to (the one that built its KV)."""
        return self.engines[self.agent.session_layout(session_id).model_version]

    def release(self, session_id: str) -> None:
        for engine in self.engines.values():
            engine.release(session_id)

    async def close_engines(self, kill: bool = False) -> None:
        """The pod is gone: each of its engines ends what it runs apart from the simulation (a vLLM pod's engine
        process: stopped, or killed with the pod); one that fails to is logged."""
        for version, engine in list(self.engines.items()):
            try:
                await engine.close(kill=kill)
            except Exception as exc:
                log.warning("engine close failed", extra={"pod": self.info.name, "version": version, "error": str(exc)})

    async def final_save(self, deadline_s: float) -> bool:
        """The preStop hook's save, recorded by the checkpoint service; False (logged) when it failed."""
        try:
            report = await self.endpoint.final_save(deadline_s=deadline_s)
        except Exception as exc:
            log.warning("preStop save failed", extra={"pod": self.info.name, "error": str(exc)})
            return False
        log.info(
            "preStop saved",
            extra={"pod": self.info.name, "committed": len(report.committed), "failed": len(report.failed)},
        )
        return True

    async def report_load(self, gpus: Any, window_s: float) -> None:
        """The pod's ``kv.pod.load`` when its interval has passed, and its GPU's utilisation, memory and power (from
        the requests served in the last ``window_s``) to the simulated GPUs, when they changed."""
        if self.load is not None and not self.stopping:
            await self.load.tick()
        if gpus is None or not self.gpu_uuid:
            return
        held = sum(self.agent.session_bytes(s) for s in self.agent.sessions())
        util = min(100.0, self.served / window_s * 10.0)
        self.served = 0
        memory = self.gpu_memory_mib or held / 2**20
        load = (util, min(held / 2**20, memory), min(100.0, util / 4))
        if load == self.reported:
            return
        with contextlib.suppress(Exception):
            await gpus.set_load(self.gpu_uuid, *load)
            self.reported = load


async def pod_gpu(cluster: SimCluster, gpus: Any, pod: PodInfo, memory_mib: float) -> tuple[str, float]:
    """The UUID and memory of the first simulated GPU the pod holds; ``("", memory_mib)`` when it holds none
    (or the node's GPUs are not simulated here)."""
    gpu_uuid, memory = "", memory_mib
    if gpus is not None:
        with contextlib.suppress(Exception):
            holders = await cluster.gpu_holders(pod.node)
            first = min((i for i, names in holders.items() if object_key(pod.namespace, pod.name) in names), default=-1)
            for device in await gpus.devices():
                if device.index == first:
                    gpu_uuid, memory = device.uuid, float(device.memory_total_mib)
    return gpu_uuid, memory


class ModelVersions(Protocol):
    """What a pod's side of a rollout asks of the workload (``SimWorkload``)."""

    async def prepare_version(self, agent: KvAgent, engines: dict[str, PodEngine], version: str) -> KvLayout: ...

    def end_pinned_soon(self, pod: str, version: str, reason: str) -> None: ...


class PodModels:
    """One pod's side of a model rollout (``shared.kv.endpoint.ModelHost``): prepare loads a version's engine
    beside the serving one; at the switch new sessions go to the new one, while the old version's sessions
    finish on it (or end, as the rollout says)."""

    def __init__(self, versions: ModelVersions, agent: KvAgent, engines: dict[str, PodEngine]) -> None:
        self.versions = versions
        self.agent = agent
        self.engines = engines

    async def prepare(self, version: str) -> KvLayout:
        return await self.versions.prepare_version(self.agent, self.engines, version)

    def switched(self, state: RolloutState, previous: str) -> None:
        if state.pinned_sessions == "end":
            reason = state.end_reason or "the deployment moved to a new model version"
            self.versions.end_pinned_soon(self.agent.pod, previous, reason)
