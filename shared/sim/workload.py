"""The simulated inference workload: plays every pod of the spec's deployments on the simulated cluster.

Each Running pod gets a real KV agent (``shared.kv``) with a real store, answering the checkpoint service over
NATS like a real inference server would, and an engine (``shared.sim.engines``): a real tiny transformers model
that prefills and decodes (the default), or synthetic blocks sized like a big model's and filled from the session
id. Requests come from each deployment's JetStream request queue; a request for a session no running pod holds
is routed to the least loaded pod, which restores the session from its newest checkpoint first (lazy restore) and
checks it against a reference run (``restore_verified``), or starts it fresh. With a gateway
(``shared.sim.gateway``, ``GPUWARDEN_SIM_ROUTER``) the requests of its pool go where the endpoint picker
(``services/router``) says, asked per request as a gateway asks it (``_runtime_for``, the one routing seam).

Each pod's engine has a KV block pool of the spec's capacity (``shared.sim.blockpool``): a session that needs
blocks the pool lacks preempts the most recently arrived other session on the pod, which loses its blocks and is
recomputed from its tokens (its blocks regenerated) when its next request comes. Sessions end: a request with
neither prompt nor new tokens closes one (as SGLang's ``close_session`` does), a request that would take it past
the model's ``max_model_len`` ends it (an engine refuses such a request), and one idle for ``session_idle_s`` is
dropped. An ended session leaves its pod, so the agent's next announcement takes it out of the registry.

Each pod reports its load every ``load_interval_s`` as an inference server does (``shared.kv.load.LoadReporter``,
``kv.pod.load``): its pool's blocks used and in all, and the 90th percentile of its requests' time to first token,
from the request's publication to the end of the engine step that serves it (the simulated engines prefill and
decode in one step, so this is an upper bound of the first token's time).

A pod that turns Terminating runs its preStop: a final save recorded by the checkpoint service, then it tells
the cluster it is done. A pod that vanishes without that (a crash, a grace period overrun) loses what its last
checkpoint (or, with the journal on, its last journal entry) did not hold: its sessions go on from there on
other pods, the tokens after it computed again (``continued_after_kill``, ``tokens_recomputed_after_kill``), and
only one that cannot go on is lost. Everything here is simulated except NATS, Redis and the store.

This module routes requests and moves sessions (how a session is brought onto a pod, restored, started or recomputed,
is ``shared.sim.bringing``'); each pod while it runs is ``shared.sim.pods``' (``PodRuntime``,
and ``PodModels`` for its side of a model rollout), what is kept per session ``shared.sim.sessions``', and the
traffic the simulation sends ``shared.sim.conversations``' (``Conversations``, ``publish_requests``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shutil
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from shared.contract.requests import InferenceRequest
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint, LocateRefused, SessionHeld
from shared.kv.journal import DEFAULT_SPILL_S
from shared.kv.load import LoadReporter
from shared.kv.manifest import KvLayout
from shared.kv.nodetier import NodeTier
from shared.kv.store import CheckpointStore
from shared.plumbing.bus import Bus
from shared.plumbing.consumer import ConsumerSpec, consume
from shared.plumbing.errors import TemporaryError
from shared.plumbing.retries import CLUSTER_REWATCH
from shared.ports.cluster import PodInfo
from shared.sim.blockpool import BlockPool
from shared.sim.bringing import SessionBringing
from shared.sim.cluster import SimCluster
from shared.sim.engines import DeploymentEngine, PodEngine, SessionCheck, engine_for
from shared.sim.gateway import GatewayRouting
from shared.sim.pods import PodLink, PodModels, PodRuntime, pod_gpu
from shared.sim.sessions import RETIRED_KEPT, SESSION_IDLE_S, Preempted, SessionLocks, WorkloadStats, is_close
from shared.sim.spec import DeploymentSpec, SimSpec
from shared.sim.workreport import WorkloadReport

log = logging.getLogger(__name__)


def _watch_interrupted(exc: Exception, wait_s: float) -> None:
    log.warning("cluster watch interrupted", extra={"error": str(exc), "retry_s": wait_s})


class PodSessions:
    """One simulated pod's ``SessionHost``: the router's prefetch commands, brought through the workload."""

    def __init__(self, workload: SimWorkload, pod: str) -> None:
        self.workload = workload
        self.pod = pod

    async def prefetch(self, session_id: str) -> bool:
        return await self.workload.prefetch(self.pod, session_id)


class SimWorkload(SessionBringing, WorkloadReport):
    """Every pod of the spec's deployments, played on the simulated cluster: the pods follow the cluster
    (``reconcile``), each request runs on its session's pod (``on_request``), and sessions move, are preempted,
    recomputed and end as on real inference servers."""

    def __init__(
        self,
        bus: Bus,
        cluster: SimCluster,
        store: CheckpointStore,
        spec: SimSpec,
        *,
        gpus: dict[str, Any] | None = None,
        announce_s: float = 2.0,
        load_interval_s: float = 2.0,
        tick_s: float = 0.2,
        session_idle_s: float = SESSION_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        link_pod: Callable[[PodInfo], Awaitable[PodLink]] | None = None,
        gateway: GatewayRouting | None = None,
        journal_s: float = 0.0,
        node_dir: Path | None = None,
        spill_s: float = DEFAULT_SPILL_S,
        node_budget_bytes: int = 0,
    ) -> None:
        self.bus = bus
        self.journal_s = journal_s
        """Each pod's KV journal interval (``GPUWARDEN_KV_JOURNAL_S``; 0: off, periodic checkpoints only)."""
        self.node_dir = node_dir
        """Where each simulated node's local disk holds the journal's node tier (``<node_dir>/<node>``, gone with a
        lost node); None: no node tier (the journal writes to the shared store)."""
        self.spill_s = spill_s
        self.node_budget_bytes = node_budget_bytes
        self.gateway = gateway
        """The simulated inference gateway asking the endpoint picker (``services/router``) where each request of
        its pool goes; None: the workload routes every request by itself."""
        self.link_pod = link_pod
        """How a pod's KV agent connects (``shared.sim.__main__``: its own connection with its pod's token on a
        secured mesh, and a ``nats://`` store writing as the pod); None: the simulation's connection and store."""
        self.cluster = cluster
        self.store = store
        self.spec = spec
        self.gpus = gpus or {}
        self.announce_s = announce_s
        self.load_interval_s = load_interval_s
        self.tick_s = tick_s
        self.session_idle_s = session_idle_s
        self.clock = clock
        self.deployments: dict[tuple[str, str], DeploymentSpec] = {(d.namespace, d.name): d for d in spec.deployments}
        self.engines: dict[tuple[str, str, str], DeploymentEngine] = {
            (ns, name, d.model.model_version): engine_for(d) for (ns, name), d in self.deployments.items()
        }
        """Every model version's engine, per deployment: one set of weights per version, shared by the pods."""
        self.versions: dict[str, str] = {}
        """The model version each live session is pinned to (the one that built its KV); it never changes."""
        self.retired: OrderedDict[str, str] = OrderedDict()
        """Sessions a rollout ended (``pinned_sessions: end``), with the reason: their later requests are refused,
        never served on another version. The newest ``RETIRED_KEPT``."""
        self.prepare_faults: dict[str, str] = {}
        """Fault injection: a pod (by name, or ``*``) whose prepare of a model version fails, with the reason."""
        self.served_log: list[tuple[str, str]] | None = None
        """When a list: every served request's (session, model version) is appended (for tests)."""
        self.runtimes: dict[str, PodRuntime] = {}
        # Per live session only: each entry leaves when its session ends, expires or is lost.
        self.home: dict[str, str] = {}
        self.preempted: dict[str, Preempted] = {}
        self.killed: dict[str, str] = {}
        """Sessions whose pod was killed (no preStop) and that have not gone on yet, with that pod: counted as
        continued (and their recomputed tokens) or lost when their next request brings them to another pod."""
        self.last_request: dict[str, float] = {}
        self.served_on: dict[str, str] = {}
        """The pod that served each live session's last request (its next one elsewhere has ``moved``)."""
        self.stats = WorkloadStats()
        self._locks = SessionLocks()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.bus.ensure_streams()
        s = self.bus.subjects
        for namespace, name in self.deployments:
            await consume(
                self.bus,
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
        self._spawn(self._watch(), "workload-watch")
        self._spawn(self._loop(), "workload-loop")
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
            await runtime.close_engines()
            if runtime.link is not None:
                await runtime.link.close()
        self.runtimes.clear()
        if self.gateway is not None:
            await self.gateway.close()

    async def end_engines(self) -> None:
        """The simulation stops: what its pods' engines run apart from it (a vLLM pod's engine process, its folder)
        ends at once, as the pods' memory does; the registry is left as it is (a restarted simulation finds it)."""
        await asyncio.gather(*(r.close_engines(kill=True) for r in self.runtimes.values()))

    def _spawn(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``work`` in the background; the task is forgotten once it is done."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        """Wakes ``_loop`` on every change of the cluster. A watch that ends is watched again, at once when it
        brought changes, else as ``retries.CLUSTER_REWATCH`` says."""
        while True:
            await CLUSTER_REWATCH.call(self._watch_once, note=_watch_interrupted)

    async def _watch_once(self) -> None:
        """One watch of the cluster, to its end; its failure raised again only when it brought no change."""
        changed = False
        try:
            async for _ in self.cluster.watch():
                changed = True
                self._wake.set()
        except Exception as exc:
            if not changed:
                raise
            _watch_interrupted(exc, 0.0)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.tick_s)
            self._wake.clear()
            try:
                await self.cluster.tick()
                await self.reconcile()
                self.expire_idle()
                self.release_versions()
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
                self._spawn(self._pre_stop(runtime), f"prestop-{pod.name}")
        for name in [n for n in self.runtimes if n not in present]:
            runtime = self.runtimes[name]
            killed = not runtime.stopping  # deleted without preStop: what was not checkpointed is gone
            runtime.stopping = True  # no request is routed here any more
            await runtime.lock.acquire()  # the step under way ends first; those waiting find the pod gone
            runtime.gone = True
            runtime.lock.release()
            if killed and runtime.endpoint.journal is not None:
                await runtime.endpoint.journal.stop()  # dead with its pod: what it logged stays as it was
            if killed:  # its sessions go on from their checkpoints (the preempted ones from their tokens)
                self.stats.pods_killed += 1
                await self._lose_node_disks()
                for sid in runtime.agent.sessions():
                    self.killed[sid] = name
            for sid in runtime.agent.sessions():
                runtime.release(sid)  # the pod's memory is gone: drop the blocks with it
                runtime.agent.forget_session(sid)
            for sid in [s for s, pod in self.home.items() if pod == name]:
                del self.home[sid]
            await runtime.endpoint.stop()  # it leaves: the registry hears its sessions are no longer held
            await runtime.close_engines(kill=killed)
            if runtime.link is not None:
                await runtime.link.close()
            del self.runtimes[name]

    def _node_tier(self, pod: PodInfo, agent: KvAgent) -> NodeTier | None:
        if self.node_dir is None:
            return None
        return NodeTier(self.node_dir / pod.node, pod.name, cipher=agent.cipher, budget_bytes=self.node_budget_bytes)

    async def _lose_node_disks(self) -> None:
        """A node that is lost (NotReady) takes its local disk with it: its journal tier is gone."""
        if self.node_dir is None:
            return
        for node in await self.cluster.nodes():
            if not node.ready and (self.node_dir / node.name).exists():
                shutil.rmtree(self.node_dir / node.name, ignore_errors=True)
                log.warning("SIMULATED node lost with its local disk", extra={"node": node.name, "simulated": True})

    async def _start_pod(self, pod: PodInfo) -> None:
        deployment = self.deployments[(pod.namespace, pod.deployment)]
        engine = self.engines[(pod.namespace, pod.deployment, deployment.model.model_version)]
        link = await self.link_pod(pod) if self.link_pod is not None else None
        bus = link.bus if link is not None else self.bus
        agent = KvAgent(
            link.store if link is not None else self.store,
            pod=pod.name,
            node=pod.node,
            namespace=pod.namespace,
            deployment=pod.deployment,
            layout=engine.layout,
        )
        engines: dict[str, PodEngine] = {engine.layout.model_version: engine.for_pod(agent)}
        endpoint = AgentEndpoint(
            agent,
            bus,
            announce_s=self.announce_s,
            models=PodModels(self, agent, engines),
            journal_s=self.journal_s,
            sessions=PodSessions(self, pod.name),
            node_tier=self._node_tier(pod, agent),
            spill_s=self.spill_s,
        )
        node_gpus = [g.memory_mib for n in self.spec.nodes if n.name == pod.node for g in n.gpus]
        fallback = float(min(node_gpus, default=self.spec.smallest_gpu_mib()))
        gpu_uuid, memory = await pod_gpu(self.cluster, self.gpus.get(pod.node), pod, fallback)
        capacity = max(deployment.kv_capacity(memory), deployment.model.max_len_blocks)
        pool = BlockPool(capacity)
        load = LoadReporter(
            bus.publish,
            lambda: (pool.used, pool.capacity),
            pod=pod.name,
            node=pod.node,
            namespace=pod.namespace,
            deployment=pod.deployment,
            interval_s=self.load_interval_s,
            versions=lambda: agent.layouts.keys(),
        )
        self.runtimes[pod.name] = PodRuntime(pod, agent, endpoint, pool, engines, load, gpu_uuid, memory, link=link)
        await endpoint.start()  # asks for the serving version first: a pod started after a switch serves it
        log.info(
            "SIMULATED pod serving",
            extra={"pod": pod.name, "node": pod.node, "kv_blocks": capacity, "simulated": True},
        )

    async def _pre_stop(self, runtime: PodRuntime) -> None:
        deployment = self.deployments[(runtime.info.namespace, runtime.info.deployment)]
        if await runtime.final_save(deadline_s=deployment.grace_period_s * 0.8):
            self.stats.prestop_saves += 1
        with contextlib.suppress(Exception):
            await self.cluster.mark_prestop_done(runtime.info.namespace, runtime.info.name)
        self._wake.set()

    async def _report_load(self) -> None:
        """Each pod's ``kv.pod.load`` when its interval has passed, and its GPU's utilisation, memory and power (from
        the requests served since the last tick) to the simulated GPUs."""
        window = max(self.tick_s, 0.2)
        for runtime in list(self.runtimes.values()):
            await runtime.report_load(self.gpus.get(runtime.info.node), window)

    # -- requests -------------------------------------------------------------------------------------------------
    async def on_request(self, request: InferenceRequest) -> None:
        """Idempotent enough for at-least-once delivery: a redelivered request grows its session again, as a
        retried request does on a real server; a redelivered close finds nothing left to close."""
        self.stats.requests += 1
        sid = request.session_id
        async with self._locks.hold(sid):
            if is_close(request):
                if self.end_session(sid):
                    self.stats.ended += 1
                return
            if self._refused_retired(sid):
                return
            self.last_request[sid] = self.clock()
        # routed outside the conversation's lock: a gateway's pick does not hold the pods up, and it may be waiting
        # for a pod's prefetch of this very session (the router's handover wait), which takes the lock
        runtime = await self._runtime_for(request)
        if runtime is None:
            return
        async with self._locks.hold(sid):
            if self._refused_retired(sid) or sid not in self.last_request:  # ended while it was routed
                return
            model = self.deployments[(runtime.info.namespace, runtime.info.deployment)].model
            async with runtime.lock:
                if runtime.gone:
                    raise TemporaryError(f"pod {runtime.info.name} is gone", delay=0.2)
                if sid not in runtime.agent.sessions():
                    await self._bring_session(runtime, sid)
                    if sid not in runtime.agent.sessions():
                        return
                engine = runtime.engine_of(sid)
                version = runtime.agent.session_layout(sid).model_version
                pinned = self.versions.setdefault(sid, version)
                if pinned != version:  # never: the guarantee this counter watches
                    self.stats.mixed_versions += 1
                    log.error("session on two model versions", extra={"session": sid, "was": pinned, "now": version})
                tokens = engine.tokens_after(sid, request.prompt_tokens, request.max_new_tokens)
                if tokens > model.max_model_len:
                    log.info(
                        "session ended: its context is full",
                        extra={"session": sid, "tokens": tokens, "max_model_len": model.max_model_len},
                    )
                    self.end_session(sid)
                    self.stats.ended_at_max_len += 1
                    return
                blocks = math.ceil(tokens / runtime.agent.layout.block_tokens)
                self._preempt(runtime, runtime.pool.reserve(sid, blocks))
                await engine.serve(sid, request.prompt_tokens, request.max_new_tokens)
            waited = time.time() - request.occurred_at.timestamp()  # prefill and decode are one step: its first token
            if runtime.load is not None:
                runtime.load.first_token(waited)
            was = self.served_on.get(sid)
            self.served_on[sid] = runtime.info.name
            self.stats.first_tokens.add(was is not None and was != runtime.info.name, waited)
            runtime.served += 1
            self.stats.served += 1
            self.stats.served_by_version[version] = self.stats.served_by_version.get(version, 0) + 1
            if self.served_log is not None:
                self.served_log.append((sid, version))
            runtime.endpoint.sessions_changed()

    def _refused_retired(self, sid: str) -> bool:
        """A request of a session that was ended is refused (counted, logged)."""
        if sid not in self.retired:
            return False
        self.stats.refused_retired += 1
        log.info("request refused: its session was ended", extra={"session": sid, "why": self.retired[sid]})
        return True

    def end_session(self, session_id: str) -> bool:
        """The session is over: every pod forgets it and frees its blocks. Says whether anything held it."""
        preempted = self.preempted.pop(session_id, None)
        held = preempted is not None
        for runtime in self.runtimes.values():
            if session_id in runtime.pool or session_id in runtime.agent.sessions():
                runtime.endpoint.end_session(session_id)  # announced as ended: its checkpoints are retired
                runtime.release(session_id)
                runtime.pool.release(session_id)
                held = True
        owner = self.runtimes.get(preempted.pod) if preempted is not None else None
        if owner is not None:
            owner.endpoint.end_session(session_id)  # the pod that owned it last retires its checkpoints
        elif not held and (session_id in self.versions or session_id in self.last_request):
            version = self.versions.get(session_id)
            self._spawn(self._end_unheld(session_id, version), f"end-{session_id}")
        for engine in self.engines.values():
            engine.end(session_id)
        self.home.pop(session_id, None)
        self.versions.pop(session_id, None)
        self.last_request.pop(session_id, None)
        self.served_on.pop(session_id, None)
        self.killed.pop(session_id, None)
        return held

    async def _end_unheld(self, session_id: str, version: str | None) -> None:
        """A live session ended while no pod held it (its pod drained or killed, its next request not come yet):
        a pod takes it and ends it at once, as a server does that gets a conversation's last request, so that the
        registry retires its checkpoints and says it ended (``kv.session.location`` ``ended``: what ``gpuwarden
        drain --wait`` counts such a session by). Only the pod that took its newest generation can end it; the
        drained pod is gone. Nothing to do when no pod serves its version any more (retention retires it)."""
        candidates = [
            r for r in self.runtimes.values() if not r.stopping and (version is None or version in r.agent.layouts)
        ]
        if not candidates:
            return
        runtime = min(candidates, key=lambda r: (len(r.agent.sessions()), r.info.name))
        async with self._locks.hold(session_id):
            if session_id in runtime.agent.sessions() or self.versions.get(session_id) is not None:
                return  # it came back meanwhile: a new conversation under the same id, served as such
            layout = runtime.agent.layouts.get(version) if version is not None else None
            try:
                await runtime.endpoint.start_session(session_id, layout=layout)
            except (SessionHeld, TimeoutError, LocateRefused) as exc:
                log.warning("ended session not retired", extra={"session": session_id, "error": str(exc)})
                return
            runtime.endpoint.end_session(session_id)

    def retire(self, session_id: str, reason: str) -> None:
        """End the session for good with ``reason``: its later requests are refused, not served on another model
        version."""
        log.info("session ended", extra={"session": session_id, "reason": reason})
        self.end_session(session_id)
        self.stats.ended_by_rollout += 1
        self.retired[session_id] = reason
        while len(self.retired) > RETIRED_KEPT:
            self.retired.popitem(last=False)

    async def end_pinned(self, runtime: PodRuntime, version: str, reason: str) -> None:
        """A rollout with ``pinned_sessions: end``: the pod's sessions of ``version`` end, each between its
        requests."""
        held = runtime.agent.sessions_on(version)
        held += [s for s, p in self.preempted.items() if p.pod == runtime.info.name and p.version == version]
        for sid in held:
            async with self._locks.hold(sid):
                if self.versions.get(sid, version) == version and sid not in self.retired:
                    self.retire(sid, reason)

    def release_versions(self) -> None:
        """Each pod lets go of model versions it no longer serves once no session (held or preempted) is on them."""
        for runtime in self.runtimes.values():
            for version in list(runtime.engines):
                waiting = any(p.pod == runtime.info.name and p.version == version for p in self.preempted.values())
                if not waiting and runtime.agent.release(version):
                    self._spawn(runtime.engines.pop(version).close(), f"close-{runtime.info.name}-{version}")
                    log.info("model version released", extra={"pod": runtime.info.name, "version": version})

    def end_pinned_soon(self, pod: str, version: str, reason: str) -> None:
        """``end_pinned`` in the background, for the pod's side of a rollout (``PodModels``)."""
        runtime = self.runtimes.get(pod)
        if runtime is not None:
            self._spawn(self.end_pinned(runtime, version, reason), f"end-pinned-{pod}")

    async def prepare_version(self, agent: KvAgent, engines: dict[str, PodEngine], version: str) -> KvLayout:
        """Load ``version`` on the pod (the simulation's weights come from the model's seed, a new one per
        version, as if read from shared storage): its engine joins the pod's engines."""
        fault = self.prepare_faults.get(agent.pod) or self.prepare_faults.get("*")
        if fault:
            raise RuntimeError(fault)
        key = (agent.namespace, agent.deployment, version)
        engine = self.engines.get(key)
        if engine is None:
            deployment = self.deployments[(agent.namespace, agent.deployment)]
            engine = await asyncio.to_thread(engine_for, deployment, version)
            engine = self.engines.setdefault(key, engine)
        if version not in engines:  # a pod's engine may start a process (vLLM): never made only to be dropped
            engines[version] = engine.for_pod(agent)
        return engine.layout

    def expire_idle(self) -> int:
        """End the sessions that had no request for ``session_idle_s`` (a client that went away without closing
        them); a session with a request under way is never idle. Returns how many ended."""
        cutoff = self.clock() - self.session_idle_s
        idle = [s for s, at in self.last_request.items() if at <= cutoff and s not in self._locks]
        for sid in idle:
            if self.end_session(sid):
                self.stats.expired += 1
        return len(idle)

    async def _runtime_for(self, request: InferenceRequest) -> PodRuntime | None:
        """The session's pod, the one routing seam. Through the endpoint picker when the deployment is the
        gateway's pool (``shared.sim.gateway``: asked per request as a gateway asks it, its endpoints tried in
        order); else, or when no router replica answers (failing open), its own choice: its home, else the least
        loaded pod. Either way only a pod that holds the model version the session is pinned to (any pod for a
        new session); None when no pod holds that version any more: the session is ended, never moved to another
        version."""
        routed = self.gateway is not None and self.gateway.routes(request.namespace, request.deployment)
        home = self.home.get(request.session_id)
        runtime = self.runtimes.get(home) if home else None
        if not routed and runtime is not None and not runtime.stopping:
            return runtime
        candidates = [
            r
            for r in self.runtimes.values()
            if not r.stopping and r.info.namespace == request.namespace and r.info.deployment == request.deployment
        ]
        if not candidates:
            raise TemporaryError(f"no running pod of {request.namespace}/{request.deployment}", delay=0.5)
        serving, pinned = candidates, self.versions.get(request.session_id)
        if pinned is not None:
            candidates = [r for r in candidates if pinned in r.agent.layouts]
            if not candidates:
                self.retire(request.session_id, f"no pod serves its model version {pinned!r} any more")
                return None
        chosen = None
        if self.gateway is not None and routed:
            chosen = await self.gateway.choose(request.session_id, candidates, serving)
        if chosen is None and runtime is not None and not runtime.stopping:
            chosen = runtime  # no router answered: the session's home, as the workload knows it
        if chosen is None:
            chosen = min(candidates, key=lambda r: (len(r.agent.sessions()), r.info.name))
        self.home[request.session_id] = chosen.info.name
        return chosen

    async def check_session(self, session_id: str) -> SessionCheck:
        """Compare what the session's pod holds now with the reference (between its requests)."""
        async with self._locks.hold(session_id):
            home = self.home.get(session_id)
            runtime = self.runtimes.get(home) if home else None
            if runtime is None or session_id not in runtime.agent.sessions():
                return SessionCheck(None, f"no running pod holds session {session_id!r}")
            async with runtime.lock:
                if runtime.gone:
                    return SessionCheck(None, f"pod {runtime.info.name} is gone")
                return await runtime.engine_of(session_id).check(session_id)
