"""Hollow nodes: the driver, device and metrics agents of a fleet of simulated nodes, each service kind in one
process (here: one ``HollowHost`` each, in the test's process) on one NATS connection and one Redis pool, the same
agent code and protocol as one process per node. A fleet of 30 nodes of 8 GPUs: every node's inventory reaches
its metrics agent through one shared consumer, every exporter page is read, and a driver upgrade of one node runs
through it: cordon, drain (every session on it committed), eviction, the install by that node's agent, validation,
uncordon; no session lost."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.device.__main__ import hollow_instance as device_instance
from services.driver.__main__ import hollow_instance as driver_instance
from services.driver.upgrade import ORDER, STATE_LABEL
from services.metrics.__main__ import hollow_instance as metrics_instance
from shared.contract.configdocs import DriverPolicy
from shared.contract.device import DeviceInventory
from shared.contract.driver import DriverUpgradeStateChanged
from shared.contract.node import DrainCompleted, DrainFailed
from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.errors import SettingsError
from shared.plumbing.hollow import HollowHost, HollowPlan, node_list, parse_nodes
from shared.plumbing.runner import start_service
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

        def metrics_know_every_node() -> bool:
            return all(run.service is not None and run.node in run.service.gpus for run in metrics.nodes.values())  # type: ignore[attr-defined]

        await eventually(metrics_know_every_node, timeout=30)
        await eventually(lambda: all(r.service.reads > 0 for r in metrics.nodes.values()), timeout=30)  # type: ignore[attr-defined]
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
            return node is not None and node.labels.get(STATE_LABEL) == "upgrade-done" and node.schedulable

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
        found = await check_invariants(store, client, subjects, drains=[completed[0].drain_id])
        assert found, found.problems
        coordinators = [r for r in hosts["driver"].nodes.values() if r.service.coordinator is not None]  # type: ignore[attr-defined]
        assert [r.node for r in coordinators] == [nodes[0]], "one coordinator candidate per host: its first node"
    finally:
        for host in hosts.values():
            if host.ready.is_set():
                await host.stop(grace=1)
        await workload.stop()
        await workload_bus.close(1)
        await exporters.stop()
        await checkpoint.stop(grace=1)
        await cluster.close()
