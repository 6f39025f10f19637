"""The simulated inference workload: plays every pod of the spec's deployments on the simulated cluster.

Each Running pod gets a real KV agent (``shared.kv``) with a real store, answering the checkpoint service over
NATS like a real inference server would. Sessions hold KV blocks sized like the model's (block tokens x bytes
per token) and filled deterministically from the session id and block index, so any copy anywhere can be
verified byte for byte (``expected_block``; never Python's per-process ``hash()``). Requests come from each
deployment's JetStream request queue; a request for a session no running pod holds is routed to the least
loaded pod, which restores the session from its newest checkpoint first (lazy restore) or starts it fresh.

A pod that turns Terminating runs its preStop: a final save recorded by the checkpoint service, then it tells
the cluster it is done. A pod that vanishes without that (a crash, a grace period overrun) loses what its last
checkpoint did not hold. Everything here is simulated except NATS, Redis and the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.contract.requests import InferenceRequest
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.manifest import KvLayout
from shared.kv.store import CheckpointNotFound, CheckpointStore, ChunkCorrupt
from shared.plumbing.bus import Bus, ConsumerSpec
from shared.plumbing.errors import TemporaryError
from shared.ports.cluster import PodInfo
from shared.sim.cluster import SimCluster
from shared.sim.clusterstate import object_key
from shared.sim.spec import DeploymentSpec, ModelShape, SimSpec

log = logging.getLogger(__name__)


def layout_of(model: ModelShape) -> KvLayout:
    return KvLayout(
        model_id=model.model_id,
        model_version=model.model_version,
        tokenizer_id=model.tokenizer_id,
        dtype=model.dtype,
        block_tokens=model.block_tokens,
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
    )


def expected_block(session_id: str, index: int, nbytes: int) -> np.ndarray:
    """The content of a session's block ``index``: the same in every process, on every machine."""
    seed = int.from_bytes(hashlib.blake2b(f"{session_id}/{index}".encode(), digest_size=8).digest(), "little")
    return np.random.Generator(np.random.PCG64(seed)).integers(0, 256, nbytes, dtype=np.uint8)


def verify_blocks(session_id: str, blocks: list[Any]) -> bool:
    return all(
        bytes(memoryview(b).cast("B")) == expected_block(session_id, i, memoryview(b).nbytes).tobytes()
        for i, b in enumerate(blocks)
    )


@dataclass
class PodRuntime:
    info: PodInfo
    agent: KvAgent
    endpoint: AgentEndpoint
    gpu_uuid: str = ""
    gpu_memory_mib: float = 0.0
    served: int = 0
    stopping: bool = False


@dataclass
class WorkloadStats:
    requests: int = 0
    served: int = 0
    restored: int = 0
    started_fresh: int = 0
    lost: int = 0
    prestop_saves: int = 0
    lost_sessions: list[str] = field(default_factory=list)


class SimWorkload:
    def __init__(
        self,
        bus: Bus,
        cluster: SimCluster,
        store: CheckpointStore,
        spec: SimSpec,
        *,
        gpus: dict[str, Any] | None = None,
        periodic_s: float = 0.0,
        announce_s: float = 2.0,
        tick_s: float = 0.2,
    ) -> None:
        self.bus = bus
        self.cluster = cluster
        self.store = store
        self.spec = spec
        self.gpus = gpus or {}
        self.periodic_s = periodic_s
        self.announce_s = announce_s
        self.tick_s = tick_s
        self.deployments: dict[tuple[str, str], DeploymentSpec] = {(d.namespace, d.name): d for d in spec.deployments}
        self.runtimes: dict[str, PodRuntime] = {}
        self.home: dict[str, str] = {}
        self.stats = WorkloadStats()
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._wake = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.bus.ensure_streams()
        s = self.bus.subjects
        for namespace, name in self.deployments:
            await self.bus.consume(
                ConsumerSpec(
                    durable=s.durable("workload", namespace, name),
                    filter_subjects=(s.pattern("requests.inference", namespace=namespace, deployment=name),),
                    accepts=(InferenceRequest,),
                    stream=s.requests_stream,
                    max_deliver=20,
                    backoff=(0.2, 0.5, 1.0, 2.0),
                    concurrency=4,
                ),
                self.on_request,
            )
        await self.reconcile()
        self._tasks.append(asyncio.create_task(self._watch(), name="workload-watch"))
        self._tasks.append(asyncio.create_task(self._loop(), name="workload-loop"))
        log.info("SIMULATED workload started", extra={"deployments": len(self.deployments), "simulated": True})

    async def stop(self) -> None:
        """Cancel the loops and wait a bounded time: redis-py may swallow a cancellation mid-command, so a
        loop gets a second cancel rather than an unbounded wait."""
        for task in self._tasks:
            task.cancel()
        pending = {t for t in self._tasks if not t.done()}
        for _ in range(3):
            if not pending:
                break
            _, pending = await asyncio.wait(pending, timeout=1.0)
            for task in pending:
                task.cancel()
        for runtime in list(self.runtimes.values()):
            await runtime.endpoint.stop()
        self.runtimes.clear()

    async def _watch(self) -> None:
        while True:
            try:
                async for _ in self.cluster.watch():
                    self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cluster watch interrupted", extra={"error": str(exc)})
                await asyncio.sleep(0.5)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.tick_s)
            self._wake.clear()
            try:
                await self.cluster.tick()
                await self.reconcile()
                await self._report_load()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("workload reconcile failed", extra={"error": str(exc)})

    async def reconcile(self) -> None:
        """Level-triggered: runtimes follow the cluster's pods, whatever events were missed."""
        pods = [p for p in await self.cluster.pods() if (p.namespace, p.deployment) in self.deployments]
        present = {p.name for p in pods}
        for pod in pods:
            runtime = self.runtimes.get(pod.name)
            if pod.phase == "Running" and runtime is None:
                await self._start_pod(pod)
            elif pod.phase == "Terminating" and runtime is not None and not runtime.stopping:
                runtime.stopping = True
                self._tasks.append(asyncio.create_task(self._pre_stop(runtime), name=f"prestop-{pod.name}"))
        for name in [n for n in self.runtimes if n not in present]:
            runtime = self.runtimes.pop(name)
            await runtime.endpoint.stop()
            if not runtime.stopping:  # killed without preStop: what was not checkpointed is gone
                self.stats.lost += len(runtime.agent.sessions())
                self.stats.lost_sessions += runtime.agent.sessions()
            for sid in runtime.agent.sessions():
                if self.home.get(sid) == name:
                    self.home.pop(sid, None)

    async def _start_pod(self, pod: PodInfo) -> None:
        deployment = self.deployments[(pod.namespace, pod.deployment)]
        agent = KvAgent(
            self.store,
            pod=pod.name,
            node=pod.node,
            namespace=pod.namespace,
            deployment=pod.deployment,
            layout=layout_of(deployment.model),
        )
        endpoint = AgentEndpoint(agent, self.bus, announce_s=self.announce_s)
        await endpoint.start()
        gpu_uuid, memory = "", 0.0
        gpus = self.gpus.get(pod.node)
        if gpus is not None:
            with contextlib.suppress(Exception):
                holders = await self.cluster.gpu_holders(pod.node)
                first = min(
                    (i for i, names in holders.items() if object_key(pod.namespace, pod.name) in names), default=-1
                )
                for device in await gpus.devices():
                    if device.index == first:
                        gpu_uuid, memory = device.uuid, float(device.memory_total_mib)
        self.runtimes[pod.name] = PodRuntime(pod, agent, endpoint, gpu_uuid, memory)
        log.info("SIMULATED pod serving", extra={"pod": pod.name, "node": pod.node, "simulated": True})

    async def _pre_stop(self, runtime: PodRuntime) -> None:
        deployment = self.deployments[(runtime.info.namespace, runtime.info.deployment)]
        try:
            report = await runtime.endpoint.final_save(deadline_s=deployment.grace_period_s * 0.8)
            self.stats.prestop_saves += 1
            log.info(
                "preStop saved",
                extra={"pod": runtime.info.name, "committed": len(report.committed), "failed": len(report.failed)},
            )
        except Exception as exc:
            log.warning("preStop save failed", extra={"pod": runtime.info.name, "error": str(exc)})
        with contextlib.suppress(Exception):
            await self.cluster.mark_prestop_done(runtime.info.namespace, runtime.info.name)
        self._wake.set()

    async def _report_load(self) -> None:
        window = max(self.tick_s, 0.2)
        for runtime in self.runtimes.values():
            gpus = self.gpus.get(runtime.info.node)
            if gpus is None or not runtime.gpu_uuid:
                continue
            held = sum(runtime.agent.session_bytes(s) for s in runtime.agent.sessions())
            util = min(100.0, runtime.served / window * 10.0)
            runtime.served = 0
            with contextlib.suppress(Exception):
                memory = runtime.gpu_memory_mib or held / 2**20
                await gpus.set_load(runtime.gpu_uuid, util, min(held / 2**20, memory), min(100.0, util / 4))

    # -- requests -------------------------------------------------------------------------------------------------
    async def on_request(self, request: InferenceRequest) -> None:
        """Idempotent enough for at-least-once delivery: a redelivered request grows its session again, as a
        retried request does on a real server."""
        self.stats.requests += 1
        lock = self._locks.setdefault(request.session_id, asyncio.Lock())
        async with lock:
            runtime = self._runtime_for(request)
            sid = request.session_id
            if sid not in runtime.agent.sessions():
                await self._bring_session(runtime, sid)
            layout = runtime.agent.layout
            tokens = runtime.agent.tokens(sid) + request.prompt_tokens + request.max_new_tokens
            have = len(runtime.agent.blocks(sid))
            need = math.ceil(tokens / layout.block_tokens)
            for index in range(have, need):
                runtime.agent.append_block(sid, expected_block(sid, index, layout.block_bytes))
            runtime.agent.set_tokens(sid, tokens)
            runtime.served += 1
            self.stats.served += 1
            runtime.endpoint.sessions_changed()

    def _runtime_for(self, request: InferenceRequest) -> PodRuntime:
        home = self.home.get(request.session_id)
        runtime = self.runtimes.get(home) if home else None
        if runtime is not None and not runtime.stopping:
            return runtime
        candidates = [
            r
            for r in self.runtimes.values()
            if not r.stopping and r.info.namespace == request.namespace and r.info.deployment == request.deployment
        ]
        if not candidates:
            raise TemporaryError(f"no running pod of {request.namespace}/{request.deployment}", delay=0.5)
        chosen = min(candidates, key=lambda r: (len(r.agent.sessions()), r.info.name))
        self.home[request.session_id] = chosen.info.name
        return chosen

    async def _bring_session(self, runtime: PodRuntime, session_id: str) -> None:
        try:
            restored = await runtime.endpoint.restore(session_id)
        except CheckpointNotFound:
            runtime.agent.register_session(session_id)
            self.stats.started_fresh += 1
            return
        except ChunkCorrupt as exc:
            log.error("session context lost: no good checkpoint", extra={"session": session_id, "error": str(exc)})
            self.stats.lost += 1
            self.stats.lost_sessions.append(session_id)
            runtime.agent.register_session(session_id)
            return
        except TimeoutError as exc:
            raise TemporaryError(f"checkpoint service not answering: {exc}", delay=1.0) from exc
        self.stats.restored += 1
        if not verify_blocks(session_id, restored.blocks):
            log.error("restored bytes differ from the session's content", extra={"session": session_id})

    # -- for tests and status -------------------------------------------------------------------------------------
    def session_blocks(self, session_id: str) -> list[Any] | None:
        home = self.home.get(session_id)
        runtime = self.runtimes.get(home) if home else None
        if runtime is None or session_id not in runtime.agent.sessions():
            return None
        return runtime.agent.blocks(session_id)

    def status(self) -> dict[str, Any]:
        return {
            "simulated": True,
            "pods": {
                name: {"node": r.info.node, "sessions": len(r.agent.sessions()), "stopping": r.stopping}
                for name, r in self.runtimes.items()
            },
            "requests": self.stats.requests,
            "served": self.stats.served,
            "restored": self.stats.restored,
            "started_fresh": self.stats.started_fresh,
            "lost": self.stats.lost,
        }


async def publish_requests(
    bus: Bus, spec: SimSpec, sessions: int, rate_per_s: float, prompt_tokens: int, new_tokens: int, seconds: float
) -> int:
    """A steady load: ``rate_per_s`` requests per second over ``sessions`` sessions per deployment."""
    sent = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        for deployment in spec.deployments:
            sid = f"{deployment.name}-s{sent % sessions}"
            await bus.publish(
                InferenceRequest(
                    namespace=deployment.namespace,
                    deployment=deployment.name,
                    session_id=sid,
                    prompt_tokens=prompt_tokens,
                    max_new_tokens=new_tokens,
                )
            )
            sent += 1
        await asyncio.sleep(1.0 / rate_per_s)
    return sent
