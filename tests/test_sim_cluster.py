"""The simulated cluster: its pure core under random operations, and the Redis adapter shared by separate processes."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shared.contract.annotations import POD_DELETION_COST_ANNOTATION as DELETION_COST
from shared.contract.subjects import Subjects
from shared.plumbing.settings import Settings
from shared.ports.cluster import ClusterChange, ClusterError, ClusterPort, EvictionOutcome
from shared.sim.cluster import SimCluster
from shared.sim.clusterstate import ClusterState, from_spec, object_key
from shared.sim.spec import DeploymentSpec, GpuSpec, NodeSpec, SimSpec, SpecError, load_spec
from tests.helpers import eventually

REPO = Path(__file__).resolve().parents[1]

SPEC_2_1_1 = """
nodes:
  - {name: node-a, gpus: [{count: 2}]}
  - {name: node-b, gpus: [{count: 1}]}
  - {name: node-c, gpus: [{count: 1}]}
deployments:
  - {name: llama, namespace: llm, replicas: 4, gpus_per_pod: 1, max_unavailable: 1, grace_period_s: 300}
"""


# -- the pure core, driven at random ----------------------------------------------------------------------------
@st.composite
def specs(draw: st.DrawFn) -> SimSpec:
    gpu_counts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    deployments = draw(
        st.lists(
            st.tuples(st.integers(0, 4), st.integers(1, 2), st.integers(0, 2), st.sampled_from([1.0, 5.0, 30.0])),
            min_size=1,
            max_size=2,
        )
    )
    return SimSpec(
        nodes=[NodeSpec(name=f"n{i}", gpus=[GpuSpec(count=c)] if c else []) for i, c in enumerate(gpu_counts)],
        deployments=[
            DeploymentSpec(
                name=f"d{i}", namespace="ns", replicas=r, gpus_per_pod=g, max_unavailable=m, grace_period_s=grace
            )
            for i, (r, g, m, grace) in enumerate(deployments)
        ],
    )


_encode = msgspec.msgpack.encode


class ClusterMachine(RuleBasedStateMachine):
    """Random cordons, uncordons, labels, evictions, scales, finished preStops and the passing of time, each
    followed by ``reconcile`` as the adapter does. Alongside runs a watcher that knows only the change records and
    snapshots an object when a change names it: if any object ever differs from its snapshot, a change went
    unreported."""

    state: ClusterState
    now: float

    @initialize(spec=specs())
    def start(self, spec: SimSpec) -> None:
        self.state = from_spec(spec)
        self.now = 0.0
        self.snapshots: dict[tuple[str, str], bytes] = {}
        self.alive: set[tuple[str, str]] = set()
        self.names_used: set[str] = set()
        self.step(self.state.as_added)

    def step(self, operation: Callable[[], list[ClusterChange]]) -> None:
        before = _encode(self.state)
        bound_before = {key for key, pod in self.state.pods.items() if pod.node}
        changes = operation() + self.state.reconcile(self.now)
        if not changes:
            assert _encode(self.state) == before, "the state changed without a change record"
        touched: set[tuple[str, str]] = set()
        for change in changes:
            key: tuple[str, str] = (
                change.kind,
                change.name if change.kind == "node" else object_key(change.namespace, change.name),
            )
            touched.add(key)
            if change.type == "ADDED":
                assert key not in self.alive, f"{key} added twice"
                self.alive.add(key)
                if change.kind == "pod":
                    assert change.name not in self.names_used, f"pod name {change.name} used again"
                    self.names_used.add(change.name)
            else:
                assert key in self.alive, f"{change.type} for {key}, which the watcher does not know"
                if change.type == "DELETED":
                    self.alive.remove(key)
        for key in touched:
            current = self.lookup(*key)
            assert (current is not None) == (key in self.alive)
            if current is None:
                self.snapshots.pop(key, None)
            else:
                self.snapshots[key] = _encode(current)
        for pod_key, pod in self.state.pods.items():
            if pod.node and pod_key not in bound_before:
                node = self.state.nodes[pod.node]
                assert node.schedulable and node.ready, f"{pod_key} was bound to {pod.node}, which takes no new pods"

    def lookup(self, kind: str, key: str) -> Any:
        table: dict[str, Any] = {"node": self.state.nodes, "pod": self.state.pods, "deployment": self.state.deployments}
        return table[kind].get(key)

    def held(self, node: str) -> int:
        """GPUs on ``node`` held by its pods, whatever their phase: a Terminating pod still has its GPU."""
        return sum(p.gpus for p in self.state.pods.values() if p.node == node)

    def pick(self, names: list[str], i: int) -> str:
        return sorted(names)[i % len(names)]

    @rule(i=st.integers(0, 7))
    def cordon(self, i: int) -> None:
        self.step(lambda: self.state.cordon(self.pick(list(self.state.nodes), i)))

    @rule(i=st.integers(0, 7))
    def uncordon(self, i: int) -> None:
        self.step(lambda: self.state.uncordon(self.pick(list(self.state.nodes), i)))

    @rule(i=st.integers(0, 7), key=st.sampled_from(["pool", "upgrade"]), value=st.sampled_from(["x", "y", None]))
    def label(self, i: int, key: str, value: str | None) -> None:
        self.step(lambda: self.state.set_labels(self.pick(list(self.state.nodes), i), {key: value}))

    @rule(i=st.integers(0, 7), replicas=st.integers(0, 6))
    def scale(self, i: int, replicas: int) -> None:
        deployment = self.state.deployments[self.pick(list(self.state.deployments), i)]
        self.step(lambda: self.state.scale(deployment.namespace, deployment.name, replicas))

    @rule(i=st.integers(0, 20))
    def evict(self, i: int) -> None:
        if not self.state.pods:
            outcome, changes = self.state.evict("ns", "nobody-1", self.now)
            assert (outcome, changes) == (EvictionOutcome.NOT_FOUND, [])
            return
        pod = self.state.pods[self.pick(list(self.state.pods), i)]
        owner = self.state.deployments[object_key(pod.namespace, pod.deployment)]
        running = sum(
            1
            for p in self.state.pods.values()
            if (p.namespace, p.deployment, p.phase) == (owner.namespace, owner.name, "Running")
        )
        phase, shortfall = pod.phase, owner.replicas - running
        outcomes: list[EvictionOutcome] = []

        def attempt() -> list[ClusterChange]:
            outcome, changes = self.state.evict(pod.namespace, pod.name, self.now)
            outcomes.append(outcome)
            return changes

        self.step(attempt)
        if phase == "Terminating":
            assert outcomes == [EvictionOutcome.NOT_FOUND]
        elif phase == "Pending" or shortfall + 1 <= owner.max_unavailable:
            assert outcomes == [EvictionOutcome.EVICTED]
        else:
            assert outcomes == [EvictionOutcome.BLOCKED_BY_PDB]

    @rule(i=st.integers(0, 20))
    def prestop_done(self, i: int) -> None:
        if self.state.pods:
            pod = self.state.pods[self.pick(list(self.state.pods), i)]
            self.step(lambda: self.state.mark_prestop_done(pod.namespace, pod.name))

    @rule(dt=st.sampled_from([0.0, 0.5, 4.0, 31.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.step(list)

    @rule()
    def settle(self) -> None:
        """Uncordon everything and let every Terminating pod finish: each deployment then runs all its replicas
        as far as the GPUs go, and with one GPU per pod that is as far as the free GPUs go."""
        for name in list(self.state.nodes):
            self.step(functools.partial(self.state.uncordon, name))
        self.now += 31.0
        self.step(list)
        assert not any(p.phase == "Terminating" for p in self.state.pods.values())
        pending = [p for p in self.state.pods.values() if p.phase == "Pending"]
        if pending and all(d.gpus_per_pod == 1 for d in self.state.deployments.values()):
            assert all(self.held(name) == node.gpus for name, node in self.state.nodes.items())

    @invariant()
    def every_object_is_as_the_watcher_last_saw_it(self) -> None:
        current = {
            **{("node", k): _encode(v) for k, v in self.state.nodes.items()},
            **{("pod", k): _encode(v) for k, v in self.state.pods.items()},
            **{("deployment", k): _encode(v) for k, v in self.state.deployments.items()},
        }
        assert current == self.snapshots

    @invariant()
    def no_node_holds_more_gpus_than_it_has(self) -> None:
        for name, node in self.state.nodes.items():
            assert self.held(name) <= node.gpus

    @invariant()
    def every_deployment_has_its_replicas(self) -> None:
        for deployment in self.state.deployments.values():
            active = [p for p in self.state.pods_of(deployment) if p.phase != "Terminating"]
            assert len(active) == deployment.replicas

    @invariant()
    def a_pending_pod_fits_nowhere(self) -> None:
        for pod in self.state.pods.values():
            if pod.phase == "Pending":
                assert pod.node == ""
                for name, node in self.state.nodes.items():
                    assert not (node.schedulable and node.ready and node.gpus - self.held(name) >= pod.gpus)
            else:
                assert pod.node in self.state.nodes

    @invariant()
    def terminating_pods_are_within_their_grace_period(self) -> None:
        for pod in self.state.pods.values():
            if pod.phase == "Terminating":
                owner = self.state.deployments[object_key(pod.namespace, pod.deployment)]
                assert pod.terminating_since is not None and not pod.prestop_done
                assert self.now - pod.terminating_since < owner.grace_period_s

    @invariant()
    def pod_names_follow_the_sequence(self) -> None:
        seqs = [p.created_seq for p in self.state.pods.values()]
        assert len(seqs) == len(set(seqs)) and all(s < self.state.next_seq for s in seqs)
        for key, pod in self.state.pods.items():
            assert key == object_key(pod.namespace, pod.name) and pod.name == f"{pod.deployment}-{pod.created_seq}"

    @invariant()
    def reconcile_is_idempotent(self) -> None:
        copy = msgspec.msgpack.decode(_encode(self.state), type=ClusterState)
        assert copy.reconcile(self.now) == []


ClusterMachine.TestCase.settings = hypothesis_settings(max_examples=60, stateful_step_count=30, deadline=None)
TestClusterStateMachine = ClusterMachine.TestCase


def test_pods_fill_nodes_by_free_gpus_most_free_first_ties_by_name() -> None:
    state = from_spec(
        SimSpec(
            nodes=[NodeSpec(name=n, gpus=[GpuSpec(count=c)]) for n, c in (("c", 1), ("b", 1), ("a", 2))],
            deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=5)],
        )
    )
    state.reconcile(0.0)
    placement = {p.name: (p.node, p.phase) for p in state.pods.values()}
    assert placement == {
        "llama-1": ("a", "Running"),
        "llama-2": ("a", "Running"),
        "llama-3": ("b", "Running"),
        "llama-4": ("c", "Running"),
        "llama-5": ("", "Pending"),
    }


def test_scale_in_removes_the_lowest_deletion_cost_first_then_the_newest() -> None:
    """As the ReplicaSet controller does with ``controller.kubernetes.io/pod-deletion-cost`` (the router writes it)."""
    state = from_spec(
        SimSpec(
            nodes=[NodeSpec(name="a", gpus=[GpuSpec(count=4)])],
            deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=4)],
        )
    )
    state.reconcile(0.0)
    for name, cost in (("llama-1", "3"), ("llama-2", "0"), ("llama-3", "12"), ("llama-4", "0")):
        assert state.set_pod_annotations("llm", name, {DELETION_COST: cost})
    assert state.set_pod_annotations("llm", "llama-1", {DELETION_COST: "3"}) == []  # unchanged: no change
    assert state.set_pod_annotations("llm", "gone", {DELETION_COST: "1"}) == []
    state.scale("llm", "llama", 2)
    state.reconcile(1.0)
    phases = {p.name: p.phase for p in state.pods.values()}
    assert phases == {"llama-1": "Running", "llama-2": "Terminating", "llama-3": "Running", "llama-4": "Terminating"}
    state.scale("llm", "llama", 1)
    state.reconcile(2.0)
    assert state.pods[object_key("llm", "llama-1")].phase == "Terminating"  # 3 < 12


# -- the adapter, in separate processes -------------------------------------------------------------------------
class Worker:
    """One ``tests.sim_cluster_worker`` process, driven line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, settings: Settings, spec_path: Path) -> Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.sim_cluster_worker",
            settings.redis.url,
            settings.root,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "GPUWARDEN_SIM_SPEC": str(spec_path)},
        )
        return cls(process)

    async def send(self, op: str, *args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, "args": args}).encode() + b"\n")
        await self.process.stdin.drain()

    async def reply(self) -> Any:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), 20)
        assert line, f"worker {self.process.pid} exited ({self.process.returncode})"
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer["ok"]

    async def call(self, op: str, *args: Any) -> Any:
        await self.send(op, *args)
        return await self.reply()

    async def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC_2_1_1)
    return path


@pytest.fixture
async def workers(settings: Settings, spec_file: Path) -> AsyncIterator[tuple[Worker, Worker]]:
    pair = (await Worker.start(settings, spec_file), await Worker.start(settings, spec_file))
    yield pair
    for worker in pair:
        await worker.stop()


async def _collect(cluster: SimCluster, into: list[ClusterChange]) -> None:
    async for change in cluster.watch():
        into.append(change)


async def _placement(cluster: SimCluster) -> dict[str, tuple[str, str]]:
    return {p.name: (p.node, p.phase) for p in await cluster.pods(namespace="llm")}


def _assert_dense(changes: list[ClusterChange], first: int = 1) -> None:
    ids = [tuple(int(x) for x in c.revision.split("-")) for c in changes]
    expected = (first, 0)
    for got in ids:
        assert got == expected or (got[0] == expected[0] + 1 and got[1] == 0 and expected[1] > 0), (got, expected)
        expected = (got[0], got[1] + 1)


async def test_separate_processes_share_one_cluster_that_schedules_evicts_and_cordons(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis, workers: tuple[Worker, Worker]
) -> None:
    ops, drainer = workers
    watcher, reader = SimCluster(redis_client, subjects), SimCluster(redis_client, subjects)
    seen: list[ClusterChange] = []
    follow = asyncio.create_task(_collect(watcher, seen))
    try:
        await ops.send("create")
        await drainer.send("create")
        assert sorted([(await ops.reply())["created"], (await drainer.reply())["created"]]) == [False, True]

        # 4 one-GPU pods on 2 + 1 + 1 GPUs: every GPU taken, the most free node first
        assert await _placement(reader) == {
            "llama-1": ("node-a", "Running"),
            "llama-2": ("node-a", "Running"),
            "llama-3": ("node-b", "Running"),
            "llama-4": ("node-c", "Running"),
        }

        # PDB: with one pod terminating (and its replacement pending), a second eviction is refused
        assert await drainer.call("evict", "llm", "llama-4") == "evicted"
        placement = await _placement(reader)
        assert placement["llama-4"] == ("node-c", "Terminating") and placement["llama-5"] == ("", "Pending")
        assert await drainer.call("evict", "llm", "llama-3") == "blocked-by-pdb"
        assert await drainer.call("evict", "llm", "llama-4") == "not-found"
        await ops.call("prestop_done", "llm", "llama-4")
        placement = await _placement(reader)
        assert "llama-4" not in placement and placement["llama-5"] == ("node-c", "Running")
        assert await drainer.call("evict", "llm", "llama-3") == "evicted"
        await ops.call("prestop_done", "llm", "llama-3")
        assert (await _placement(reader))["llama-6"] == ("node-b", "Running")

        # scaling: a fifth pod finds no GPU; scaling down drops the unbound pod, then terminates the newest
        await drainer.call("scale", "llm", "llama", 5)
        assert (await _placement(reader))["llama-7"] == ("", "Pending")
        await drainer.call("scale", "llm", "llama", 3)
        placement = await _placement(reader)
        assert "llama-7" not in placement and placement["llama-6"] == ("node-b", "Terminating")
        await ops.call("prestop_done", "llm", "llama-6")

        # a drain of node-a: cordoned, an evicted pod's replacement runs elsewhere, and new pods stay off node-a
        await ops.call("cordon", "node-a")
        assert await drainer.call("evict", "llm", "llama-1") == "evicted"
        assert (await _placement(reader))["llama-8"] == ("node-b", "Running")
        await ops.call("prestop_done", "llm", "llama-1")
        await drainer.call("scale", "llm", "llama", 4)
        assert (await _placement(reader))["llama-9"] == ("", "Pending")
        node_a = await reader.node("node-a")
        assert node_a is not None and not node_a.schedulable
        await ops.call("uncordon", "node-a")
        assert await _placement(reader) == {
            "llama-2": ("node-a", "Running"),
            "llama-5": ("node-c", "Running"),
            "llama-8": ("node-b", "Running"),
            "llama-9": ("node-a", "Running"),
        }

        everyone = await reader.pods()
        for name in ("node-a", "node-b", "node-c", "node-x"):  # one node's pods, from the index by node
            assert await reader.pods(node=name) == [p for p in everyone if p.node == name]
        assert await reader.pods(node="node-a", namespace="other") == []

        final = reader.revision
        await eventually(lambda: seen and seen[-1].revision.startswith(f"{final}-"))
    finally:
        follow.cancel()

    _assert_dense(seen)
    added = [c.name for c in seen if c.kind == "pod" and c.type == "ADDED"]
    deleted = [c.name for c in seen if c.kind == "pod" and c.type == "DELETED"]
    assert added == [f"llama-{i}" for i in range(1, 10)]
    assert set(added) - set(deleted) == {"llama-2", "llama-5", "llama-8", "llama-9"}
    assert [c.type for c in seen if c.kind == "pod" and c.name == "llama-4"] == [
        "ADDED",  # Pending
        "MODIFIED",  # bound to node-c, Running
        "MODIFIED",  # Terminating: the workload runs its preStop
        "MODIFIED",  # preStop done
        "DELETED",
    ]
    assert [c.name for c in seen if c.kind == "node" and c.type == "MODIFIED"] == ["node-a", "node-a"]
    assert all(c.node == c.name for c in seen if c.kind == "node")
    # each pod change names the node it is about: none while Pending, the node it is bound to (was, when it goes)
    assert [c.node for c in seen if c.kind == "pod" and c.name == "llama-4"] == ["", *["node-c"] * 4]
    assert [c.node for c in seen if c.kind == "pod" and c.name == "llama-7"] == ["", ""]  # never bound
    assert [c.type for c in seen if c.kind == "deployment"] == ["ADDED", "MODIFIED", "MODIFIED", "MODIFIED"]
    assert Counter(c.name for c in seen if c.kind == "node" and c.type == "ADDED") == {
        "node-a": 1,
        "node-b": 1,
        "node-c": 1,
    }


async def test_concurrent_label_updates_from_two_processes_lose_none(
    subjects: Subjects, redis_client: aioredis.Redis, workers: tuple[Worker, Worker]
) -> None:
    first, second = workers
    await first.call("create")
    await second.call("create")
    observer = SimCluster(redis_client, subjects)
    assert [n.name for n in await observer.nodes()] == ["node-a", "node-b", "node-c"]
    seen: list[ClusterChange] = []
    follow = asyncio.create_task(_collect(observer, seen))
    try:
        await first.send("label_burst", "node-b", "first", 50)
        await second.send("label_burst", "node-b", "second", 50)
        await first.reply()
        await second.reply()
        await eventually(lambda: len(seen) >= 100)
    finally:
        follow.cancel()
    node = await observer.node("node-b")
    assert node is not None
    assert dict(node.labels) == {f"{who}-{i}": str(i) for who in ("first", "second") for i in range(50)}
    assert [(c.kind, c.type, c.name) for c in seen] == [("node", "MODIFIED", "node-b")] * 100
    _assert_dense(seen, first=int(seen[0].revision.split("-")[0]))


# -- the adapter, in this process -------------------------------------------------------------------------------
async def test_without_a_spec_file_the_default_cluster_is_created_once(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUWARDEN_SIM_SPEC", raising=False)
    cluster = await SimCluster.create(settings.redis, subjects)
    try:
        port: ClusterPort = cluster
        assert isinstance(port, ClusterPort) and port.simulated and cluster.created
        assert [(n.name, n.gpus, n.schedulable) for n in await cluster.nodes()] == [
            ("node-1", 2, True),
            ("node-2", 2, True),
            ("node-3", 2, True),
        ]
        assert [(d.namespace, d.name, d.replicas) for d in await cluster.deployments()] == [("llm", "llama", 2)]
        assert [(p.node, p.phase) for p in await cluster.pods()] == [("node-1", "Running"), ("node-2", "Running")]
        await cluster.set_node_annotations("node-3", {"gpuwarden.io/upgrade": "pending"})
        await cluster.set_node_labels("node-3", {"pool": "h100"})
        await cluster.set_node_labels("node-3", {"pool": None})
        node = await cluster.node("node-3")
        assert node is not None and dict(node.annotations) == {"gpuwarden.io/upgrade": "pending"} and not node.labels
        assert await cluster.node("node-9") is None
        with pytest.raises(ClusterError, match="node 'node-9' is not in the simulated cluster"):
            await cluster.cordon("node-9")
        with pytest.raises(ClusterError, match="deployment llm/nope"):
            await cluster.scale("llm", "nope", 1)
    finally:
        await cluster.close()
    other = await SimCluster.create(redis_client, subjects, SimSpec(nodes=[NodeSpec(name="elsewhere")]))
    assert not other.created
    assert [n.name for n in await other.nodes()] == ["node-1", "node-2", "node-3"]


async def test_an_unanswered_prestop_ends_with_the_grace_period(
    subjects: Subjects, redis_client: aioredis.Redis, spec_file: Path
) -> None:
    clock = [1000.0]
    cluster = await SimCluster.create(redis_client, subjects, load_spec(str(spec_file)), clock=lambda: clock[0])
    await cluster.scale("llm", "llama", 3)
    assert await cluster.evict("llm", "llama-2") is EvictionOutcome.EVICTED
    clock[0] += 299.0
    await cluster.tick()
    assert ("node-a", "Terminating") == (await _placement(cluster))["llama-2"]
    clock[0] += 1.0
    await cluster.tick()
    placement = await _placement(cluster)
    assert "llama-2" not in placement and placement["llama-5"] == ("node-a", "Running")


async def test_a_deployment_created_later_gets_its_pods_bound_once_and_a_different_one_is_refused(
    subjects: Subjects, redis_client: aioredis.Redis, spec_file: Path
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, load_spec(str(spec_file)))
    await cluster.scale("llm", "llama", 2)
    for pod in await cluster.pods(namespace="llm"):
        if pod.phase == "Terminating":  # their GPUs are free once their preStop is done
            await cluster.mark_prestop_done("llm", pod.name)
    await cluster.create_deployment("llm", "bench", 2, max_unavailable=2, grace_period_s=60)
    assert [(d.name, d.replicas) for d in await cluster.deployments("llm")] == [("bench", 2), ("llama", 2)]
    bench = {p.name: (p.node, p.phase) for p in await cluster.pods(namespace="llm") if p.deployment == "bench"}
    assert sorted(bench.values()) == [("node-b", "Running"), ("node-c", "Running")]
    revision = cluster.revision
    await cluster.create_deployment("llm", "bench", 2, max_unavailable=2, grace_period_s=60)  # the same: nothing
    await cluster.node("node-a")
    assert cluster.revision == revision
    with pytest.raises(ClusterError, match="llm/bench is in the simulated cluster already"):
        await cluster.create_deployment("llm", "bench", 3)
    with pytest.raises(ClusterError, match="replicas must be >= 0"):
        await cluster.create_deployment("llm", "other", -1)
    evicted = min(bench)
    assert await cluster.evict("llm", evicted) is EvictionOutcome.EVICTED  # its PodDisruptionBudget allows it
    await cluster.mark_prestop_done("llm", evicted)
    after = {p.name: p.phase for p in await cluster.pods(namespace="llm") if p.deployment == "bench"}
    assert evicted not in after and len(after) == 2  # the replacement runs wherever a GPU is free


async def test_a_watch_that_fell_behind_the_trimmed_stream_says_so(
    subjects: Subjects, redis_client: aioredis.Redis, spec_file: Path
) -> None:
    cluster = await SimCluster.create(redis_client, subjects, load_spec(str(spec_file)))
    await redis_client.xtrim(subjects.redis_key("sim", "cluster", "changes"), maxlen=2, approximate=False)
    with pytest.raises(ClusterError, match="list again and watch anew"):
        await anext(SimCluster(redis_client, subjects).watch())
    follow = cluster.watch()
    await cluster.cordon("node-b")
    change = await asyncio.wait_for(anext(follow), 5)
    assert (change.kind, change.type, change.name, change.revision) == ("node", "MODIFIED", "node-b", "2-0")


BAD_SPECS = [
    ("nodes:\n  - {name: n1, gpu: 2}\n", r"unknown field `gpu`.*\$\.nodes\[0\]"),
    ("nodes:\n  - {name: n1, gpus: [{count: two}]}\n", r"\$\.nodes\[0\]\.gpus\[0\]\.count"),
    ("nodes:\n  - {name: n1}\n  - {name: n1}\n", r"\$\.nodes\[1\]\.name: duplicate node name 'n1'"),
    ("nodes: [{name: n1}]\ndeployments:\n  - {name: d, replicas: -1}\n", r"\$\.deployments\[0\]\.replicas"),
    ("nodes: []\n", r"\$\.nodes: at least one node"),
    ("nodes: [{name: n1}\n", r"not valid YAML"),
]


@pytest.mark.parametrize(("text", "message"), BAD_SPECS)
async def test_a_bad_spec_names_the_field_and_writes_nothing(
    settings: Settings,
    subjects: Subjects,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    message: str,
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    monkeypatch.setenv("GPUWARDEN_SIM_SPEC", str(path))
    with pytest.raises(SpecError, match=message) as raised:
        await SimCluster.create(settings.redis, subjects)
    assert str(path) in str(raised.value)
    assert [k async for k in redis_client.scan_iter(match=f"{settings.root}:*")] == []


def test_label_changes_are_parsed_as_kubectl_spells_them() -> None:
    from shared.console.sim import label_changes
    from shared.console.state import UsageError

    assert label_changes(["nvidia.com/mig.config=all-1g.10gb", "pool-", "tier="]) == {
        "nvidia.com/mig.config": "all-1g.10gb",
        "pool": None,
        "tier": "",
    }
    for bad, needle in (("novalue", "KEY=VALUE"), ("bad key=x", "label key"), ("k=has space", "label value")):
        with pytest.raises(UsageError, match=needle):
            label_changes([bad])


async def test_sim_label_sets_and_removes_labels_of_a_simulated_node(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis
) -> None:
    """``gpuwarden sim label`` in a process of its own, as a person runs it against ``make run``."""
    import subprocess

    cluster = await SimCluster.create(redis_client, subjects)  # the default spec: node-1..3
    env = dict(os.environ, GPUWARDEN_REDIS_URL=settings.redis.url, GPUWARDEN_ROOT=subjects.root)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shared.cli", "sim", "label", *args], env=env, capture_output=True, text=True
        )

    done = await asyncio.to_thread(cli, "node-3", "nvidia.com/mig.config=all-1g.10gb", "pool=h100")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["nvidia.com/mig.config"] == "all-1g.10gb"
    node = await cluster.node("node-3")
    assert node is not None and node.labels["pool"] == "h100"
    done = await asyncio.to_thread(cli, "node-3", "pool-")
    assert done.returncode == 0 and "pool" not in json.loads(done.stdout)
    missing = await asyncio.to_thread(cli, "node-9", "a=b")
    assert missing.returncode == 2 and "no simulated node 'node-9'" in missing.stderr
    assert "node-1, node-2, node-3" in missing.stderr
    await cluster.close()


async def test_sim_scale_sets_a_deployments_replicas_and_scales_in_by_deletion_cost(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis
) -> None:
    """``gpuwarden sim scale`` in a process of its own, as ``kubectl scale``: up to 3, then in to 1 removing the pods
    of lowest deletion cost (the router's annotation); an unknown deployment or a negative count is refused."""
    import subprocess

    spec = SimSpec(
        nodes=[NodeSpec(name=n, gpus=[GpuSpec(count=1)]) for n in ("node-a", "node-b", "node-c")],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2)],
    )
    cluster = await SimCluster.create(redis_client, subjects, spec)
    env = dict(os.environ, GPUWARDEN_REDIS_URL=settings.redis.url, GPUWARDEN_ROOT=subjects.root)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shared.cli", "sim", "scale", *args], env=env, capture_output=True, text=True
        )

    up = await asyncio.to_thread(cli, "llm/llama", "3")
    assert up.returncode == 0, up.stderr
    pods = json.loads(up.stdout)["pods"]
    assert len(pods) == 3 and set(pods.values()) == {"Running"} and json.loads(up.stdout)["replicas"] == 3
    cheap, *costly = sorted(pods)
    for name in costly:
        await cluster.set_pod_annotations("llm", name, {DELETION_COST: "100"})
    down = await asyncio.to_thread(cli, "llm/llama", "2")
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout)["pods"] == {cheap: "Terminating", costly[0]: "Running", costly[1]: "Running"}
    missing = await asyncio.to_thread(cli, "llm/other", "1")
    assert missing.returncode == 1 and "no simulated deployment 'llm/other'" in missing.stderr
    assert "llm/llama" in missing.stderr
    negative = await asyncio.to_thread(cli, "llm/llama", "-1")
    assert negative.returncode == 2 and "replicas" in negative.stderr
    await cluster.close()


async def test_a_lost_node_is_not_ready_for_good_and_its_pods_die_and_come_back_elsewhere(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    """``lose_node``: the node NotReady, every pod on it dead at once (no preStop), replaced on the nodes left that
    have room; an unknown node or a missing cluster is refused naming the field."""
    from shared.sim.faults import FaultError, LoseNodeFault, apply_fault

    with pytest.raises(FaultError, match=r"\$\.node: there is no simulated cluster"):
        await apply_fault(redis_client, subjects, LoseNodeFault(node="node-a"))
    spec = SimSpec(
        nodes=[NodeSpec(name=n, gpus=[GpuSpec(count=1)]) for n in ("node-a", "node-b", "node-c")],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2)],
    )
    cluster = await SimCluster.create(redis_client, subjects, spec)
    before = {p.name: p.node for p in await cluster.pods()}
    assert sorted(before.values()) == ["node-a", "node-b"]
    with pytest.raises(FaultError, match=r"\$\.node: no node 'node-z'"):
        await apply_fault(redis_client, subjects, LoseNodeFault(node="node-z"))
    done = await apply_fault(redis_client, subjects, LoseNodeFault(node="node-a"))
    gone = next(name for name, node in before.items() if node == "node-a")
    assert f"llm/{gone}" in done and "NotReady" in done
    nodes = {n.name: n for n in await cluster.nodes()}
    assert not nodes["node-a"].ready and nodes["node-b"].ready
    after = {p.name: p.node for p in await cluster.pods()}
    assert gone not in after and sorted(after.values()) == ["node-b", "node-c"]
    assert await cluster.lose_node("node-a") == []  # again: nothing left to kill, nothing changes
