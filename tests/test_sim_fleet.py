"""The simulation at fleet scale: specs that generate their nodes, one informer of the simulated cluster for a whole
process (reads from its copy, watches by node, writes committed together, each still a compare-and-set), one
reader of many nodes' GPU health streams, GPU states read together, every node's exporter page on one server."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
import redis.asyncio as aioredis

from shared.contract.subjects import Subjects
from shared.ports.cluster import ClusterChange, ClusterConflict, ClusterError, NodeInfo
from shared.ports.gpu import GpuHealthEvent
from shared.sim.cluster import SimCluster
from shared.sim.exporter import SimExporter, SimExporterHost, find_exporter
from shared.sim.gpus import SimGpus
from shared.sim.gpustore import SimGpuStore, SimHealthFeed
from shared.sim.informer import SharedSimCluster
from shared.sim.spec import FleetSpec, GpuSpec, NodeSpec, SimSpec, SpecError, parse_spec
from tests.helpers import eventually

SPEC = SimSpec(fleets=[FleetSpec(count=5, gpus=[GpuSpec(count=8)])])


def test_a_fleet_in_a_spec_generates_its_nodes() -> None:
    spec = parse_spec(
        "nodes: [{name: head}]\n"
        "fleets:\n"
        "  - {count: 3, name_prefix: gpu-, first: 7, labels: {pool: a}, gpus: [{count: 8, model: NVIDIA H200}]}\n"
        "hollow: true\n"
    )
    assert [n.name for n in spec.nodes] == ["head", "gpu-7", "gpu-8", "gpu-9"]
    assert spec.fleets == [] and spec.hollow is True
    assert spec.node("gpu-8").gpu_count == 8 and spec.node("gpu-8").labels == {"pool": "a"}
    assert spec.node("gpu-9").gpus[0].model == "NVIDIA H200" and spec.node("head").gpu_count == 2
    assert len(SimSpec(fleets=[FleetSpec(count=1000)]).nodes) == 1000
    for raw, words in (
        ("fleets: [{count: 2, name_prefix: 'bad prefix'}]", "name_prefix"),
        ("nodes: [{name: node-1}]\nfleets: [{count: 2}]", "duplicate node name 'node-1'"),
        ("fleets: [{count: 0}]", "count"),
        ("fleets: []", "at least one node"),
    ):
        with pytest.raises(SpecError, match=words):
            parse_spec(raw)
    with pytest.raises(
        SpecError, match=r"node 'node-99' is not in the spec \(nodes: node-1, .*node-10, \.\.\. \(20 nodes"
    ):
        SimSpec(fleets=[FleetSpec(count=20)]).node("node-99")
    assert NodeSpec(name="x").gpu_count == 2


async def test_the_informer_reads_from_its_copy_and_follows_other_writers(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    other = await SimCluster.create(redis_client, subjects, SPEC)  # another process's handle
    shared = SharedSimCluster(redis_client, subjects)
    shared.start()
    try:
        await eventually(lambda: shared.live, timeout=5)
        await other.set_node_labels("node-3", {"pool": "b"})

        async def seen() -> bool:
            node = await shared.node("node-3")
            return node is not None and node.labels.get("pool") == "b"

        await eventually(seen, timeout=5)
        state_key = subjects.redis_key("sim", "cluster")
        await redis_client.rename(state_key, state_key + ":away")  # Redis no longer has it: the copy answers
        try:
            assert len(await shared.nodes()) == 5 and len(await shared.view().nodes()) == 5
            with pytest.raises(ClusterError, match="no simulated cluster"):
                await other.nodes()
        finally:
            await redis_client.rename(state_key + ":away", state_key)
    finally:
        await shared.close()


async def test_writes_made_together_are_one_transaction_each_still_a_compare_and_set(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    shared = await SharedSimCluster.create(redis_client, subjects, SPEC)
    assert isinstance(shared, SharedSimCluster)
    shared.start()
    try:
        first, second = shared.view(), shared.view()
        node = await first.node("node-1")
        assert node is not None
        before = shared.batches
        results = await asyncio.gather(
            first.update_node("node-1", labels={"by": "first"}, expect=node.revision),
            second.update_node("node-1", labels={"by": "second"}, expect=node.revision),
            *(shared.view().set_node_labels(f"node-{i}", {"pool": "c"}) for i in (2, 3, 4, 5)),
            first.update_node("node-9", labels={"x": "y"}),
            return_exceptions=True,
        )
        assert shared.batches == before + 1, "every write above went in one transaction"
        assert isinstance(results[1], ClusterConflict), "the second write read the revision the first one changed"
        assert isinstance(results[-1], ClusterError) and "node-9" in str(results[-1])
        written = results[0]
        assert isinstance(written, NodeInfo) and written.labels["by"] == "first"
        stored = await SimCluster(redis_client, subjects).nodes()  # what Redis holds, not the copy
        assert [n.labels.get("pool") for n in stored] == [None, "c", "c", "c", "c"]
        assert stored[0].labels["by"] == "first"
        assert len({n.revision for n in stored if n.labels.get("pool") == "c"} | {stored[0].revision}) == 1
    finally:
        await shared.close()


async def test_a_view_of_one_node_is_woken_by_that_node_only(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    shared = await SharedSimCluster.create(redis_client, subjects, SPEC)
    assert isinstance(shared, SharedSimCluster)
    shared.start()
    other = SimCluster(redis_client, subjects)
    try:
        await eventually(lambda: shared.live, timeout=5)
        mine = shared.view(kinds=("node",), node="node-2")
        await mine.nodes()
        heard: list[ClusterChange] = []

        async def watch() -> None:
            async for change in mine.watch():
                heard.append(change)

        assert mine._seen > 0  # the watch follows from the revision read, whenever its task first runs
        watching = asyncio.create_task(watch())
        await other.set_node_labels("node-1", {"a": "1"})
        await other.set_node_labels("node-2", {"a": "2"})
        await eventually(lambda: heard, timeout=5)
        assert [(c.kind, c.name) for c in heard] == [("node", "node-2")], "node-1's change, written first, is not mine"
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    finally:
        await shared.close()


async def test_the_health_feed_reads_every_node_in_one_loop_and_hands_each_its_own(
    redis_client: aioredis.Redis, subjects: Subjects
) -> None:
    feed = SimHealthFeed(redis_client, subjects, block_ms=200)
    ports = {n.name: SimGpus(redis_client, subjects, SPEC, n.name, feed=feed) for n in SPEC.nodes}
    heard: dict[str, list[int]] = {name: [] for name in ports}

    async def follow(name: str) -> None:
        async for event in ports[name].health_events():
            heard[name].append(event.xid)

    tasks = [asyncio.create_task(follow(name)) for name in ports]
    try:
        await eventually(lambda: feed.following == len(ports), timeout=5)
        uuid = (await ports["node-4"].devices())[0].uuid
        await ports["node-4"].store.emit("node-4", GpuHealthEvent(uuid=uuid, kind="xid", xid=79))
        await ports["node-2"].store.emit("node-2", GpuHealthEvent(uuid=uuid, kind="xid", xid=48))
        await ports["node-4"].store.emit("node-4", GpuHealthEvent(uuid=uuid, kind="xid", xid=13))
        await eventually(lambda: heard["node-4"] == [79, 13] and heard["node-2"] == [48], timeout=5)
        assert heard["node-1"] == heard["node-3"] == heard["node-5"] == []
        # a reader that starts again is handed what came after what it handled, nothing twice
        tasks[3].cancel()
        await asyncio.gather(tasks[3], return_exceptions=True)
        await ports["node-4"].store.emit("node-4", GpuHealthEvent(uuid=uuid, kind="xid", xid=31))
        tasks[3] = asyncio.create_task(follow("node-4"))
        await eventually(lambda: heard["node-4"] == [79, 13, 31], timeout=5)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await feed.close()


async def test_states_read_in_one_turn_are_one_round_trip(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    store = SimGpuStore(redis_client, subjects, batch_reads=True)
    ports = [SimGpus(redis_client, subjects, SPEC, n.name, store=store) for n in SPEC.nodes]
    for port in ports:
        await port.attach()
    before = store.batches
    states = await asyncio.gather(*(port.state() for port in ports), store.read("node-77"))
    assert store.batches == before + 1
    assert [s.node for s in states[:-1] if s is not None] == [n.name for n in SPEC.nodes]
    assert states[-1] is None and {len(s.gpus) for s in states[:-1] if s is not None} == {8}


async def test_one_server_serves_every_node_exporter_page(redis_client: aioredis.Redis, subjects: Subjects) -> None:
    gpus = {n.name: SimGpus(redis_client, subjects, SPEC, n.name) for n in SPEC.nodes}
    host = SimExporterHost((SimExporter(port, pods=lambda: {}) for port in gpus.values()), redis_client, subjects)
    await host.start()
    try:
        url = await find_exporter(redis_client, subjects, "node-3")
        assert url == host.url("node-3") and url.endswith("/nodes/node-3/metrics")

        def get(address: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(address, timeout=5) as answer:
                    return int(answer.status), answer.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        status, page = await asyncio.to_thread(get, url)
        assert status == 200 and page.count('Hostname="node-3"') > 8 and 'Hostname="node-2"' not in page
        assert page.count("DCGM_FI_DEV_GPU_UTIL{") == 8
        status, _ = await asyncio.to_thread(get, host.url("node-99"))
        assert status == 404
        await redis_client.delete(*(f"{subjects.root}:sim:exporter:{n}" for n in gpus))
        await host.announce(only_missing=True)  # Redis came back empty: every URL announced again
        assert await find_exporter(redis_client, subjects, "node-5") == host.url("node-5")
    finally:
        await host.stop()
