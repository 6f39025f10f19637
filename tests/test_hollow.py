"""Hollow nodes: the driver, device and metrics agents of a fleet of simulated nodes, each service kind in one
process (here: one ``HollowHost`` each, in the test's process) on one NATS connection and one Redis pool, the same
agent code and protocol as one process per node. A fleet of 30 nodes of 8 GPUs: every node's inventory reaches
its metrics agent through one shared consumer, every exporter page is read, and a driver upgrade of one node runs
through it: cordon, drain (every session on it committed), eviction, the install by that node's agent, validation,
uncordon; no session lost."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.device.__main__ import hollow_instance as device_instance
from services.driver.__main__ import hollow_instance as driver_instance
from services.driver.service import DriverService
from services.driver.upgrade import ORDER
from services.metrics.__main__ import hollow_instance as metrics_instance
from services.metrics.service import MetricsService
from shared.contract.annotations import UPGRADE_STATE_LABEL
from shared.contract.configdocs import DriverPolicy
from shared.contract.device import DeviceInventory
from shared.contract.driver import DriverUpgradeStateChanged
from shared.contract.node import DrainCompleted, DrainFailed, NodeCordoned
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.host.hollow import HollowHost, HollowPlan, node_list, parse_nodes
from shared.host.runner import ServiceContext, start_service
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.consumer import ConsumerSpec, node_consumer
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.exporter import PodRef, SimExporter, SimExporterHost
from shared.sim.gpus import SimGpus
from shared.sim.spec import DeploymentSpec, FleetSpec, GpuSpec, ModelShape, SimSpec
from shared.sim.workload import SimWorkload
from shared.wiring import HollowWiring, Wiring
from tests.faults.checker import check_invariants
from tests.helpers import eventually

NODES = 30
NEW = "560.35.03"
SESSIONS = 24
SMALL_MODEL = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16)
SPEC = SimSpec(
    fleets=[FleetSpec(count=NODES, gpus=[GpuSpec(count=8)])],
    deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=4, max_unavailable=2, model=SMALL_MODEL)],
)
CANARY = ("gpuwarden.io/pool", "canary")


def test_node_lists_name_every_node_once() -> None:
    assert parse_nodes("node-[1-3],gpu-a") == ["node-1", "node-2", "node-3", "gpu-a"]
    assert parse_nodes(" node-1 , node-[09-10]x ") == ["node-1", "node-9x", "node-10x"]
    names = [f"node-{i}" for i in range(1, 1001)]
    assert node_list(names) == "node-[1-1000]" and parse_nodes(node_list(names)) == names
    mixed = ["a", "node-1", "node-2", "node-4", "node-5", "node-6", "node-07"]
    assert parse_nodes(node_list(mixed)) == mixed
    for bad, words in (
        ("node-[3-1]", "counts down"),
        ("node-1,node-1", "listed twice"),
        ("node-[1-2", "not a range"),
        ("Node_1", "not valid"),
        (" , ", "no node"),
    ):
        with pytest.raises(SettingsError, match=words):
            parse_nodes(bad)


class Recorder:
    """A node-scoped service for the host's own tests: it consumes its node's cordons (one consumer per node, as the
    device service does) and the verdicts every instance shares by name; a node named in ``failing`` fails its start
    that many times, after it asked for its consumer."""

    name = "recorder"
    config_names: tuple[str, ...] = ()
    failing: dict[str, int] = {}
    made: list[Recorder] = []

    def __init__(self, first: bool) -> None:
        self.first = first
        self.cordons: list[str] = []
        self.verdicts: list[str] = []
        Recorder.made.append(self)

    async def start(self, ctx: ServiceContext) -> None:
        self.node = ctx.node
        s = ctx.subjects
        await ctx.consume(
            node_consumer(s, "recorder", "cordon", ctx.node, ("node.cordoned",), (NodeCordoned,)), self.on_cordon
        )
        if Recorder.failing.get(ctx.node, 0) > 0:
            Recorder.failing[ctx.node] -= 1
            raise RuntimeError(f"{ctx.node} is not ready yet")
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("recorder", "verdicts"),
                filter_subjects=(s.pattern("node.drain.completed"),),
                accepts=(DrainCompleted,),
                stream=s.events_stream,
            ),
            self.on_verdict,
        )
        ctx.status["cordons"] = self.cordons

    async def on_cordon(self, event: NodeCordoned) -> None:
        assert event.node == self.node
        self.cordons.append(event.node)

    async def on_verdict(self, event: DrainCompleted) -> None:
        self.verdicts.append(event.drain_id)


class NoPorts:
    """``HostBackends`` of a service that asks for no port."""

    def for_node(self, settings: Settings, bus: Bus) -> Wiring:
        return Wiring(settings, bus.subjects, bus)

    async def close(self) -> None:
        return None


async def test_one_consumer_per_family_hands_each_event_to_its_node(
    settings: Settings, subjects: Subjects, bus: Bus
) -> None:
    nodes = [f"node-{i}" for i in range(1, 7)]
    Recorder.failing, Recorder.made = {"node-5": 2}, []
    host = HollowHost.of("recorder", nodes, HollowPlan(Recorder, lambda *_: NoPorts()), settings)
    await host.start()
    try:
        assert not host.nodes["node-5"].started and "not ready yet" in host.nodes["node-5"].status()
        await bus.publish(NodeCordoned(node="node-5"))  # while node-5 is down: kept for the instance that starts
        health = await _get(f"http://127.0.0.1:{host.http_port}/healthz")
        assert health["status"] == "degraded" and health["nodes_ok"] == 5 and list(health["not_ok"]) == ["node-5"]
        await eventually(lambda: host.nodes["node-5"].started, timeout=10)  # started again, with a growing delay
        assert host.nodes["node-5"].failures == 2
        assert set((await _get(f"http://127.0.0.1:{host.http_port}/nodes")).values()) == {"ok"}

        for node in ("node-2", "node-99", "node-2"):  # node-99 is not this host's
            await bus.publish(NodeCordoned(node=node))
        await bus.publish(DrainCompleted(node="node-3", drain_id="d-1", sessions_committed=0))
        services = {node: run.service for node, run in host.nodes.items()}
        assert all(isinstance(service, Recorder) for service in services.values())
        recorders = {node: service for node, service in services.items() if isinstance(service, Recorder)}
        await eventually(lambda: recorders["node-2"].cordons == ["node-2", "node-2"], timeout=10)
        await eventually(lambda: recorders["node-5"].cordons == ["node-5"], timeout=20)
        failed = [r for r in Recorder.made if r.node == "node-5" and r is not recorders["node-5"]]
        assert len(failed) == 2 and not any(r.cordons for r in failed), "an instance that failed to start hears nothing"
        await eventually(lambda: recorders["node-1"].verdicts == ["d-1"], timeout=10)
        assert all(not r.cordons for n, r in recorders.items() if n not in ("node-2", "node-5"))
        assert all(not r.verdicts for n, r in recorders.items() if n != "node-1"), "one instance takes a shared one"
        await eventually(lambda: host.families["recorder-cordon"].foreign == 1, timeout=10)
        names = {c.name for c in await bus.js.consumers_info(subjects.events_stream.name)}
        assert names == {f"recorder-cordon-{host.name}", "recorder-verdicts"}, names
        one = await _get(f"http://127.0.0.1:{host.http_port}/nodes/node-2/healthz")
        assert one["node"] == "node-2" and one["cordons"] == ["node-2", "node-2"] and one["hollow_host"] == host.name
        assert f"recorder-cordon-{host.name}" in one["components"]["consumers"]
        missing = await _get_status(f"http://127.0.0.1:{host.http_port}/nodes/node-77/healthz")
        assert missing == 404
        assert await _get_status(f"http://127.0.0.1:{host.http_port}/nodes/node-2/metrics") == 200
        assert host.next_tick(5.0) is host.next_tick(5.0), "loops of one period share one timer"
        node3 = host.nodes["node-3"].ctx
        assert node3 is not None and node3.bus.nc is host.bus.nc and node3.bus.source == "recorder/node-3"
    finally:
        await host.stop(grace=1)
    assert host.bus.nc.is_closed


async def _get_status(url: str) -> int:
    def get() -> int:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    return await asyncio.to_thread(get)


def test_what_hollow_nodes_cannot_be_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    for module, more, words in (
        ("services.scaler", {}, "runs once per cluster"),
        ("services.device", {"GPUWARDEN_HOLLOW_NODES": "node-[2-1]"}, "counts down"),
        (
            "services.device",
            {"GPUWARDEN_DEVICE_PLUGIN": "on", "GPUWARDEN_DEVICE_PLUGIN_DIR": str(tmp_path)},
            "no kubelet",
        ),
        ("services.driver", {"GPUWARDEN_BACKEND": "real"}, "hollow nodes are simulated nodes"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", module],
            env={**env, "GPUWARDEN_HOLLOW_NODES": "node-1", **more},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr


async def _get(url: str) -> Any:
    def get() -> Any:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return json.loads(answer.read())

    return await asyncio.to_thread(get)


async def test_a_hollow_fleet_upgrades_one_node_through_its_drain(
    settings: Settings,
    subjects: Subjects,
    bus: Bus,
    redis_client: aioredis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec_file = tmp_path / "fleet.json"
    spec_file.write_text(
        json.dumps(
            {
                "fleets": [{"count": NODES, "gpus": [{"count": 8}]}],
                "deployments": [
                    {
                        "name": "llama",
                        "namespace": "llm",
                        "replicas": 4,
                        "max_unavailable": 2,
                        "model": {"layers": 2, "kv_heads": 2, "head_dim": 64, "block_tokens": 16},
                    }
                ],
            }
        )
    )
    for name, value in {
        "GPUWARDEN_SIM_SPEC": str(spec_file),
        "GPUWARDEN_DRIVER_RECONCILE_S": "0.3",
        "GPUWARDEN_DRIVER_LEASE_TTL_S": "5",
        "GPUWARDEN_DRIVER_AGENT_TIMEOUT_S": "2",
        "GPUWARDEN_DEVICE_INVENTORY_S": "1",
        "GPUWARDEN_DEVICE_PLUGIN": "off",
        "GPUWARDEN_METRICS_SOURCE": "dcgm",
        "GPUWARDEN_METRICS_INTERVAL_S": "1",
        "GPUWARDEN_METRICS_AGGREGATE": "bus",
    }.items():
        monkeypatch.setenv(name, value)
    nodes = [n.name for n in SPEC.nodes]
    client = redis_client
    cluster = await SimCluster.create(client, subjects, SPEC)
    store = FileStore(tmp_path / "checkpoints")
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    checkpoint = await start_service(service, settings, Wiring)
    workload_bus = await Bus.connect(settings.nats, subjects, "sim-workload")
    workload = SimWorkload(workload_bus, cluster, store, SPEC, announce_s=1.0, tick_s=0.1)
    exporters = SimExporterHost(
        (SimExporter(SimGpus(client, subjects, SPEC, n), pods=lambda: dict[str, PodRef]()) for n in nodes),
        client,
        subjects,
    )
    hosts = {
        name: HollowHost.of(name, nodes, HollowPlan(instance, HollowWiring), settings)
        for name, instance in (("driver", driver_instance), ("device", device_instance), ("metrics", metrics_instance))
    }
    changes: list[DriverUpgradeStateChanged] = []
    verdicts: list[DrainCompleted | DrainFailed] = []
    inventories: dict[str, DeviceInventory] = {}

    async def on_change(event: DriverUpgradeStateChanged) -> None:
        changes.append(event)

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        verdicts.append(event)

    async def on_inventory(event: DeviceInventory) -> None:
        inventories[event.node] = event

    try:
        await bus.subscribe(subjects.pattern("driver.upgrade.state"), on_change, (DriverUpgradeStateChanged,))
        await bus.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
        await bus.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
        await bus.subscribe(subjects.pattern("device.inventory"), on_inventory, (DeviceInventory,))
        await exporters.start()
        await workload.start()
        for host in hosts.values():
            await host.start()
        for host in hosts.values():
            health = await _get(f"http://127.0.0.1:{host.http_port}/healthz")
            assert health["nodes"] == NODES and health["status"] == "ok", health
            assert health["nodes_ok"] == NODES and not health["not_ok"]

        # every node's agents run: an inventory of 8 GPUs each, reached each node's metrics agent (one consumer)
        await eventually(lambda: len(inventories) == NODES, timeout=30)
        assert {len(inv.gpus) for inv in inventories.values()} == {8}
        metrics = hosts["metrics"]

        agents = [run.service for run in metrics.nodes.values()]
        readers = [agent for agent in agents if isinstance(agent, MetricsService)]
        assert len(readers) == NODES
        await eventually(lambda: all(r.ctx is not None and r.ctx.node in r.gpus for r in readers), timeout=30)
        await eventually(lambda: all(r.reads > 0 for r in readers), timeout=30)
        names = {c.name for c in await bus.js.consumers_info(subjects.events_stream.name)}
        assert not [n for n in names if n.endswith(tuple(f"-{node}" for node in nodes))], names
        assert {f"device-cordon-{hosts['device'].name}", f"metrics-inventory-{hosts['metrics'].name}"} <= names
        node_health = await _get(f"http://127.0.0.1:{hosts['device'].http_port}/nodes/node-7/healthz")
        assert node_health["node"] == "node-7" and len(node_health["gpus"]) == 8
        assert set((await _get(f"http://127.0.0.1:{hosts['driver'].http_port}/nodes")).values()) == {"ok"}

        # sessions on the pods; the node holding the most is upgraded, and drained first
        await eventually(lambda: len(workload.runtimes) == 4, timeout=20)
        for i in range(SESSIONS):
            await bus.publish(
                InferenceRequest(namespace="llm", deployment="llama", session_id=f"chat-{i}", prompt_tokens=30 + 5 * i)
            )
        await eventually(lambda: workload.stats.served >= SESSIONS, timeout=30)
        by_node: dict[str, list[str]] = {}
        for runtime in workload.runtimes.values():
            by_node.setdefault(runtime.info.node, []).extend(runtime.agent.sessions())
        target = max(by_node, key=lambda n: len(by_node[n]))
        moving = sorted(by_node[target])
        assert moving

        async def registered() -> bool:
            return len(await service.registry.sessions_on_node(target)) == len(moving)

        await eventually(registered, timeout=10)
        await cluster.set_node_labels(target, {CANARY[0]: CANARY[1]})
        policy = DriverPolicy(
            pool_overrides={f"{CANARY[0]}={CANARY[1]}": NEW},
            auto_upgrade=True,
            max_parallel_upgrades=1,
            max_unavailable="1",
            drain_timeout_s=30,
        )
        await ConfigStore(client, subjects).write("driver", policy, 0, "test")

        async def upgraded() -> bool:
            node = await cluster.node(target)
            return node is not None and node.labels.get(UPGRADE_STATE_LABEL) == "upgrade-done" and node.schedulable

        await eventually(upgraded, timeout=60, interval=0.1)
        await eventually(lambda: [c.state for c in changes if c.node == target] == list(ORDER), timeout=10)
        assert {c.node for c in changes} == {target}, "only the canary node is upgraded"
        assert (await SimGpus(client, subjects, SPEC, target).versions()).driver == NEW
        completed = [v for v in verdicts if isinstance(v, DrainCompleted) and v.node == target]
        assert completed and completed[0].sessions_committed == len(moving), verdicts
        # the device agent of that node saw its new driver, and every other node kept its own
        await eventually(lambda: inventories[target].driver_version == NEW, timeout=20)
        assert {inv.driver_version for n, inv in inventories.items() if n != target} == {SPEC.driver_version}
        await eventually(lambda: all(r.info.node != target for r in workload.runtimes.values()), timeout=20)

        before = workload.stats.served
        for sid in moving:  # each moved session's next request lands elsewhere and restores it
            await bus.publish(
                InferenceRequest(namespace="llm", deployment="llama", session_id=sid, prompt_tokens=5, max_new_tokens=0)
            )
        await eventually(lambda: workload.stats.served >= before + len(moving), timeout=30)
        assert workload.stats.lost == 0 and workload.stats.restored >= len(moving)
        found = await check_invariants(
            store, client, subjects, drains=[completed[0].drain_id], min_checkpoints=len(moving)
        )
        assert found, found.problems
        drivers = [run.service for run in hosts["driver"].nodes.values()]
        coordinating = [d.ctx.node for d in drivers if isinstance(d, DriverService) and d.coordinator is not None]
        assert coordinating == [nodes[0]], "one coordinator candidate per host: its first node"
    finally:
        for host in hosts.values():
            if host.ready.is_set():
                await host.stop(grace=1)
        await workload.stop()
        await workload_bus.close(1)
        await exporters.stop()
        await checkpoint.stop(grace=1)
        await cluster.close()
