"""The session half of the fleet-scale benchmark (``bench.scale`` runs it beside the fleet of hollow nodes).

What it drives: real checkpoint service replicas (processes, ``python -m services.checkpoint``) on a private NATS
and Redis, a file store, and many pods' KV agents hosted in this process on one shared NATS connection (the same
agent code and protocol an inference pod runs; each pod its own ``AgentEndpoint``). Sessions are one block of
4 KiB (a synthetic engine: what is measured is the control plane, not the bytes).

Figures (each in the JSON of ``bench.scale``):

- ``start_redis_calls_per_session_<N>``: Redis commands (those inside scripts included) per session to start N
  sessions on one pod (claim, first block, announcements), N = 1,000 and 5,000;
- ``restore_s_<N>``: a pod holding N saved sessions leaves (evicted); another pod restores every one of them
  (claim, verified read, report): evicted -> all restored, the fastest of ``RESTORE_TRIALS`` (each trial's in
  ``restore_trials_s_<N>``); ``restore_growth_5000_vs_1000``; ``restore_cpu_s_<N>``, the CPU seconds the whole
  machine spent meanwhile (every process: pods, replicas, NATS, Redis, and whatever else the fleet runs), and
  ``restore_cpu_growth_5000_vs_1000``: the growth in work, which the machine's other load does not stretch;
- ``drain_verdict_s_1000``: a drain of a node whose pod holds 1,000 sessions, request -> verdict;
- ``idle_redis_calls_per_session_s``: Redis commands per held session per second while nothing happens;
- ``periodic_*``: with ``fleet_sessions`` held and 10% of them changing per interval, how long each pod's
  periodic save took, whether every pod's saves kept the interval (each started within 10% of one interval after
  the last), and the number of checkpoint replicas sharing the work;
- ``status_s_small`` / ``status_s_large``: what ``gpuwarden status`` asks the checkpoint service (the counts per
  node, pod and deployment, and a page of 500 sessions) at 1,000 and at ``fleet_sessions`` sessions;
- ``status_cli_s_small`` / ``status_cli_s_large`` and ``drain_cli_request_s``: the ``gpuwarden`` commands as a
  user runs them, when ``bench.scale`` hands in how (``run``'s ``status_cli`` and ``drain_cli``);
- ``lost_sessions``: sessions started that the registry or the store lost by the end.

The fleet's pods are hosted here alone, or (``on_cluster``, as ``bench.scale`` runs it) pods of the mesh's
simulated cluster, which a rolling driver upgrade then evicts and moves (``bench.scale_upgrade``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import redis.asyncio as aioredis

from bench.fleetkit import CpuSeconds, HostedPod
from bench.scale_upgrade import GRACE_S, FleetPods, upgrade
from shared.console.client import MeshClient
from shared.contract.checkpoint import SaveSessions, SaveSessionsReport
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.host.devservers import free_port
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.kv.manifest import KvLayout
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.settings import NatsSettings, RedisSettings, Settings
from shared.sim.cluster import SimCluster

LAYOUT = KvLayout(
    model_id="bench/one-block",
    model_version="v1",
    tokenizer_id="bench",
    dtype="float16",
    block_tokens=16,
    layers=1,
    kv_heads=1,
    head_dim=64,
)
"""A 4 KiB block (16 tokens x 1 layer x 1 head x 64 dims x K and V x 2 bytes): the control plane is measured."""

ROOT = "gwscale"
CONCURRENCY = 64
PER_POD = 50
"""Sessions held by each of the fleet's pods."""


async def redis_commands(client: aioredis.Redis) -> int:
    """Commands the server ran so far (those inside scripts included), less the INFO calls that read this."""
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


async def bounded(jobs: list[Callable[[], Awaitable[Any]]], limit: int = CONCURRENCY) -> list[Any]:
    slots = asyncio.Semaphore(limit)

    async def run(job: Callable[[], Awaitable[Any]]) -> Any:
        async with slots:
            return await job()

    return await asyncio.gather(*(run(j) for j in jobs))


@dataclass
class Replica:
    """One checkpoint service replica, its own process."""

    proc: subprocess.Popen[bytes]
    port: int

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class SessionBench:
    """A checkpoint mesh at scale: replicas, a store, and pods hosted on one connection."""

    def __init__(
        self,
        nats_url: str,
        redis_url: str,
        home: Path,
        replicas: int,
        announce_s: float = 5.0,
        root: str = ROOT,
        store: Path | None = None,
    ) -> None:
        self.root = root
        self.home = home
        store = store or home / "store"
        self.nats_url = nats_url
        self.redis_url = redis_url
        self.store_dir = store
        self.store = FileStore(store)
        self.replica_count = replicas
        self.announce_s = announce_s
        self.subjects = Subjects(root)
        self.replicas: list[Replica] = []
        self.pods: dict[str, HostedPod] = {}
        self.bus: Bus | None = None
        self.redis = aioredis.Redis.from_url(redis_url)
        self.block = np.zeros(LAYOUT.block_bytes, dtype=np.uint8)
        self.node_names = ["node-1", "node-2", "node-3"]
        """Nodes the cluster has (a drain of another is refused): the default simulation's three."""
        self.drain_ids: list[str] = []
        """Every drain this bench asked for (the checker expects one verdict each)."""

    def replica_env(self, gc_s: float = 0.0) -> dict[str, str]:
        """What a checkpoint replica of this bench runs with; retention every ``gc_s`` seconds (0: none)."""
        return dict(
            os.environ,
            GPUWARDEN_NATS_URL=self.nats_url,
            GPUWARDEN_REDIS_URL=self.redis_url,
            GPUWARDEN_ROOT=self.root,
            GPUWARDEN_CHECKPOINT_STORE=f"file://{self.store_dir}",
            GPUWARDEN_CHECKPOINT_GC_S=f"{gc_s:g}",
            GPUWARDEN_LOG_LEVEL="WARNING",
        )

    def add_replica(self, gc_s: float = 0.0) -> None:
        self.replicas.append(self._spawn(self.replica_env(gc_s)))

    async def start(self) -> None:
        env = self.replica_env()
        for _ in range(self.replica_count):
            self.replicas.append(self._spawn(env))
        self.bus = await Bus.connect(NatsSettings(servers=(self.nats_url,)), self.subjects, "bench-pods")
        await self.bus.ensure_streams()
        await self.policy(0.0)
        deadline = time.monotonic() + 120
        while True:  # every replica answers: its subscriptions are in
            try:
                await self.bus.request(self.subjects.command("checkpoint", "fleet"), _fleet_query(), 2.0)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the checkpoint service did not come up") from None
        await asyncio.sleep(2.0)  # the other replicas, started at the same time, subscribe meanwhile

    def _spawn(self, env: dict[str, str]) -> Replica:
        port = free_port()
        with open(self.home / f"replica-{port}.log", "wb") as log_file:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.checkpoint"],
                env=dict(env, GPUWARDEN_HTTP_ADDR=f"127.0.0.1:{port}"),
                stdout=subprocess.DEVNULL,
                stderr=log_file,
            )
        return Replica(proc, port)

    async def policy(self, interval_s: float) -> None:
        store = ConfigStore(self.redis, self.subjects)
        current = await store.read("checkpoint")
        version = current.version if current is not None else 0
        await store.write("checkpoint", CheckpointPolicy(periodic_interval_s=interval_s), version, "bench")

    async def add_pod(self, name: str, node: str) -> HostedPod:
        assert self.bus is not None
        agent = KvAgent(self.store, pod=name, node=node, namespace="llm", deployment="bench", layout=LAYOUT)
        endpoint = AgentEndpoint(agent, self.bus, announce_s=self.announce_s)
        pod = HostedPod(name, node, agent, endpoint)
        answer = endpoint.on_save

        async def timed(command: SaveSessions) -> SaveSessionsReport:
            started = time.monotonic()
            try:
                return await answer(command)
            finally:
                if command.reason == "periodic":
                    pod.saves.append((started, time.monotonic()))

        endpoint.on_save = timed  # type: ignore[method-assign]
        await endpoint.start()
        self.pods[name] = pod
        return pod

    async def start_sessions(self, pod: HostedPod, sids: list[str]) -> None:
        async def one(sid: str) -> None:
            await pod.endpoint.start_session(sid, timeout=60)
            pod.agent.append_block(sid, self.block)

        await bounded([lambda sid=sid: one(sid) for sid in sids])  # type: ignore[misc]
        await pod.endpoint.announce()

    async def save_all(self, pod: HostedPod) -> int:
        report = await pod.endpoint.final_save(deadline_s=300)
        return len(report.committed)

    async def leave(self, pod: HostedPod) -> None:
        await pod.endpoint.stop()
        self.pods.pop(pod.name, None)

    async def restore_all(self, pod: HostedPod, sids: list[str]) -> None:
        await bounded([lambda sid=sid: pod.endpoint.restore(sid, timeout=60) for sid in sids])  # type: ignore[misc]
        await pod.endpoint.announce()

    async def drain(self, node: str, drain_id: str) -> tuple[float, Any]:
        assert self.bus is not None
        verdict: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
            if event.drain_id == drain_id and not verdict.done():
                verdict.set_result(event)

        subs = [
            await self.bus.subscribe(self.subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,)),
            await self.bus.subscribe(self.subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,)),
        ]
        started = time.monotonic()
        self.drain_ids.append(drain_id)
        await self.bus.publish(DrainRequested(node=node, drain_id=drain_id, deadline_s=25, grace_period_s=30))
        event = await asyncio.wait_for(verdict, 120)
        took = time.monotonic() - started
        for sub in subs:
            await sub.unsubscribe()
        return took, event

    def mesh(self) -> MeshClient:
        """The mesh as a command of the CLI has it, on this bench's connections."""
        assert self.bus is not None
        settings = Settings(
            nats=NatsSettings(servers=(self.nats_url,)), redis=RedisSettings(url=self.redis_url), root=self.root
        )
        return MeshClient(settings, self.bus, self.redis, None)

    async def status(self) -> float:
        """What ``gpuwarden status`` asks of the checkpoint service: the counts, and a page of 500 sessions."""
        from shared.console.snapshot import fleet_summary, read_sessions

        mesh = self.mesh()
        started = time.monotonic()
        await fleet_summary(mesh)
        await read_sessions(mesh, limit=500)
        return time.monotonic() - started

    async def lost(self, pods: list[HostedPod]) -> int:
        """Sessions the pods hold that the registry does not place on them, or that have no checkpoint recorded
        (every session was saved at least once by the end: periodic saves write every new session)."""
        missing = 0
        for pod in pods:
            sids = pod.agent.sessions()
            placed = await self.redis.hmget(f"{self.root}:kv:held:{pod.name}", sids) if sids else []
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid in sids:
                    pipe.exists(f"{self.root}:kv:checkpoints:{sid}")
                recorded = await pipe.execute()
            missing += sum(1 for p, r in zip(placed, recorded, strict=True) if p is None or not r)
        return missing

    async def held(self, pods: list[HostedPod] | None = None) -> int:
        """Sessions the registry places on these pods (on every pod it knows when None)."""
        if pods is None:
            keys = [k async for k in self.redis.scan_iter(match=f"{self.root}:kv:held:*", count=1000)]
        else:
            keys = [f"{self.root}:kv:held:{p.name}" for p in pods]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hlen(key)
            return sum(int(n) for n in await pipe.execute())

    async def close(self) -> None:
        for pod in list(self.pods.values()):
            with contextlib.suppress(Exception):
                await pod.endpoint.stop()
        for replica in self.replicas:
            replica.stop()
        if self.bus is not None:
            await self.bus.close(2)
        await self.redis.aclose()


def _fleet_query() -> Any:
    from shared.contract.sessions import FleetQuery

    return FleetQuery()


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process): what a restore cost in CPU
    is the difference over it, whatever process (pods, replicas, NATS, Redis) spent it."""
    times = psutil.cpu_times()
    return float(times.user + times.system + getattr(times, "nice", 0.0) + getattr(times, "softirq", 0.0))


RESTORE_TRIALS = 2
"""Restores of the same sessions, each on a new pod after the last holder left; ``restore_s_<N>`` is the fastest
(the least disturbed by whatever else the machine runs), ``restore_trials_s_<N>`` lists them all."""

NOMINAL = (1000, 5000)
"""The sizes the figures are named for; ``--quick`` measures the same at smaller ones (``params`` says which)."""


async def one_pod_figures(bench: SessionBench, sizes: tuple[int, int]) -> dict[str, Any]:
    """Start, save, drain (the smaller size) and restore N sessions on one pod, for each N; each figure is named
    for its nominal size."""
    out: dict[str, Any] = {}
    for n, name in zip(sizes, NOMINAL, strict=True):
        pod = await bench.add_pod(f"solo-{n}", bench.node_names[0])  # a node the cluster has: the drain is real
        sids = [f"solo-{n}-s{i}" for i in range(n)]
        before = await redis_commands(bench.redis)
        await bench.start_sessions(pod, sids)
        out[f"start_redis_calls_per_session_{name}"] = round((await redis_commands(bench.redis) - before) / n, 1)
        if name == NOMINAL[0]:
            drained_s, verdict = await bench.drain(pod.node, f"drain-{n}")
            out[f"drain_verdict_s_{name}"] = round(drained_s, 3)
            # the node may hold other pods' sessions too (in a fleet): all of these at least were committed
            out[f"drain_verdict_ok_{name}"] = isinstance(verdict, DrainCompleted) and verdict.sessions_committed >= n
        holder = pod
        took: list[float] = []
        cpu: list[float] = []
        restored: list[int] = []
        saved: list[int] = []
        for trial in range(RESTORE_TRIALS):  # the holder saves and leaves; a new pod restores every session
            saved.append(await bench.save_all(holder))
            await bench.leave(holder)
            holder = await bench.add_pod(f"solo-{n}-new{trial}", bench.node_names[(1 + trial) % len(bench.node_names)])
            busy, started = machine_busy_s(), time.monotonic()
            await bench.restore_all(holder, sids)
            took.append(round(time.monotonic() - started, 3))
            cpu.append(round(machine_busy_s() - busy, 2))
            restored.append(len(holder.agent.sessions()))
        await bench.leave(holder)
        fastest = took.index(min(took))
        out[f"restore_s_{name}"] = took[fastest]
        out[f"restore_trials_s_{name}"] = took
        out[f"restore_cpu_s_{name}"] = cpu[fastest]
        out[f"restored_{name}"] = min(restored)
        out[f"saved_{name}"] = saved[0]
    return out


async def hosted_pods(bench: SessionBench, count: int) -> list[HostedPod]:
    """``count`` pods hosted here alone, spread over the bench's nodes (the cluster does not know them)."""
    return [await bench.add_pod(f"pod-{i}", bench.node_names[i % len(bench.node_names)]) for i in range(count)]


async def fleet_figures(
    bench: SessionBench, pods: list[HostedPod], sessions: int, per_pod: int, interval_s: float, rounds: int
) -> dict[str, Any]:
    """``sessions`` held by ``pods``, ``per_pod`` each: idle load, periodic saves with 10% changing per interval,
    and status."""
    started_at = time.monotonic()
    await bounded(
        [
            lambda pod=pod, i=i: bench.start_sessions(  # type: ignore[misc]
                pod, [f"p{i}-s{j}" for j in range(min(per_pod, sessions - i * per_pod))]
            )
            for i, pod in enumerate(pods)
        ],
        limit=8,
    )
    out: dict[str, Any] = {"fleet_start_s": round(time.monotonic() - started_at, 1)}
    held = await bench.held(pods)
    out["fleet_sessions"] = held
    out["fleet_pods"] = len(pods)
    out["status_s_large"] = round(min([await bench.status() for _ in range(3)]), 3)
    window = 10.0
    await asyncio.sleep(bench.announce_s)  # the start's announcements settle
    before = await redis_commands(bench.redis)
    await asyncio.sleep(window)
    out["idle_redis_calls_per_session_s"] = round((await redis_commands(bench.redis) - before) / held / window, 5)
    # every session saved once (what the first periodic rounds would do), then the steady state measured:
    # every interval, 10% of the sessions get a block
    started_at = time.monotonic()
    await bounded([lambda pod=pod: bench.save_all(pod) for pod in pods], limit=16)  # type: ignore[misc]
    out["fleet_first_save_s"] = round(time.monotonic() - started_at, 1)
    await bench.policy(interval_s)
    rng = np.random.default_rng(7)
    all_sids = [(pod, sid) for pod in pods for sid in pod.agent.sessions()]
    changed = 0
    end = time.monotonic() + interval_s * rounds
    while time.monotonic() < end:
        for k in rng.choice(len(all_sids), size=max(1, len(all_sids) // 10), replace=False):
            pod, sid = all_sids[int(k)]
            pod.agent.append_block(sid, bench.block)
            changed += 1
        await asyncio.sleep(interval_s)
    await bench.policy(0.0)
    durations = [e - s for pod in pods for s, e in pod.saves]
    gaps = [b[0] - a[0] for pod in pods for a, b in zip(pod.saves, pod.saves[1:], strict=False)]
    late = [g for g in gaps if abs(g - interval_s) > 0.1 * interval_s]
    out.update(
        periodic_sessions=held,
        periodic_interval_s=interval_s,
        periodic_changed=changed,
        periodic_saves=sum(len(p.saves) for p in pods),
        periodic_round_s=round(max(durations), 3) if durations else None,
        periodic_round_p50_s=round(sorted(durations)[len(durations) // 2], 3) if durations else None,
        periodic_gaps=len(gaps),
        periodic_gaps_off=len(late),
        periodic_gaps_off_s=sorted(round(g, 2) for g in late)[:20],
        periodic_interval_kept=bool(gaps) and not late,
    )
    out["lost_sessions"] = await bench.lost(pods)
    return out


async def checked(bench: SessionBench, sessions: int) -> dict[str, Any]:
    """The fault suite's invariant checker over what the run left (the store walked and compared with the registry
    both ways, every checkpoint read back and verified, node and pod indexes, generations, every drain's verdict),
    once the run is quiet; the fleet's ``sessions`` were each saved at least once (the checker finds no fewer)."""
    from tests.faults.checker import check_invariants

    started = time.monotonic()
    found = await check_invariants(
        bench.store, bench.redis, bench.subjects, min_checkpoints=sessions, drains=bench.drain_ids
    )
    return {
        "checker_problems": len(found.problems),
        "checker_first_problems": found.problems[:5],
        "checker_checkpoints": found.recorded,
        "checker_bytes": found.verified_bytes,
        "checker_s": round(time.monotonic() - started, 1),
    }


async def run(
    nats_url: str,
    redis_url: str,
    *,
    quick: bool,
    sessions: int,
    nodes: int,
    replicas: int = 3,
    interval_s: float = 60.0,
    rounds: int = 3,
    root: str = ROOT,
    store: Path | None = None,
    node_names: list[str] | None = None,
    replicas_running: int = 0,
    on_cluster: bool = False,
    upgrade_parallel: float = 0.0,
    upgrade_timeout_s: float = 1800.0,
    grace_s: float = GRACE_S,
    cpu: CpuSeconds | None = None,
    status_cli: Callable[[], Awaitable[float]] | None = None,
    drain_cli: Callable[[str], Awaitable[tuple[float, str]]] | None = None,
) -> dict[str, Any]:
    """Every figure. Against a mesh already running (a fleet of ``node_names`` under ``root``, with its own
    checkpoint service and ``store``), ``replicas`` more replicas join the ``replicas_running`` it has.

    ``on_cluster``: the fleet's sessions live on pods of the mesh's simulated cluster (``FleetPods``), not on pods
    hosted here alone; then, with ``upgrade_parallel``, a rolling driver upgrade of every node at that fraction
    of the nodes at once runs with them before the checker (``bench.scale_upgrade``; ``cpu``: the mesh's
    processes' CPU seconds so far, by name).

    ``status_cli`` times ``gpuwarden status --json`` as a user runs it (``status_cli_s_small`` and ``_large``, beside
    ``status_s_*``); ``drain_cli`` runs ``gpuwarden drain NODE`` on a node of the fleet's pods once the rest is done
    (``drain_cli_request_s``: its start -> its request stored), its drain joining those the checker expects."""
    fleet: FleetPods | None = None
    with tempfile.TemporaryDirectory(prefix="gw-scale-") as home:
        bench = SessionBench(nats_url, redis_url, Path(home), replicas, root=root, store=store)
        bench.node_names = node_names or [f"node-{i + 1}" for i in range(max(3, nodes))]
        try:
            await bench.start()
            sizes = (20, 100) if quick else NOMINAL
            out = await one_pod_figures(bench, sizes)
            out["one_pod_sizes"] = list(sizes)
            small = await bench.add_pod("small", bench.node_names[2 % len(bench.node_names)])
            await bench.start_sessions(small, [f"small-s{i}" for i in range(NOMINAL[0] // (50 if quick else 1))])
            out["status_s_small"] = round(min([await bench.status() for _ in range(3)]), 3)
            out["status_sessions_small"] = await bench.held()  # every session the registry places
            if status_cli is not None:
                out["status_cli_s_small"] = round(min([await status_cli() for _ in range(3)]), 3)
            await bench.leave(small)
            count = (sessions + PER_POD - 1) // PER_POD
            if on_cluster:
                fleet = FleetPods(bench, SimCluster(bench.redis, bench.subjects), count, grace_s)
                pods = await fleet.start()
            else:
                pods = await hosted_pods(bench, count)
            out.update(await fleet_figures(bench, pods, sessions, PER_POD, interval_s, rounds))
            out["fleet_on_cluster"] = on_cluster
            out["status_sessions_large"] = await bench.held()
            if status_cli is not None:
                out["status_cli_s_large"] = round(min([await status_cli() for _ in range(3)]), 3)
            out["status_ratio_large_vs_small"] = round(out["status_s_large"] / out["status_s_small"], 2)
            out["checkpoint_replicas"] = replicas + replicas_running
            a, b = NOMINAL
            if out.get(f"restore_s_{a}"):
                out[f"restore_growth_{b}_vs_{a}"] = round(out[f"restore_s_{b}"] / out[f"restore_s_{a}"], 2)
                out[f"restore_cpu_growth_{b}_vs_{a}"] = round(out[f"restore_cpu_s_{b}"] / out[f"restore_cpu_s_{a}"], 2)
            if fleet is not None and upgrade_parallel > 0:
                out.update(await upgrade(bench, fleet, upgrade_parallel, upgrade_timeout_s, cpu))
            if drain_cli is not None:
                holders = list(fleet.pods.values()) if fleet is not None else pods
                asked_s, drain_id = await drain_cli(holders[0].node)
                bench.drain_ids.append(drain_id)
                out["drain_cli_request_s"] = round(asked_s, 3)
                if fleet is not None:
                    await fleet.settled(300.0)
            out.update(await checked(bench, sessions))
            return out
        finally:
            if fleet is not None:
                await fleet.stop()
            await bench.close()
