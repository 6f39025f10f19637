"""The Kubernetes adapter of the cluster port against a fake API server speaking the real REST and watch shapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from shared.adapters.kube import KubeCluster
from shared.adapters.kubeapi import ClusterWatch, KubeApiError
from shared.ports.cluster import (
    ClusterChange,
    ClusterConflict,
    ClusterPort,
    DeploymentInfo,
    EvictionOutcome,
    NodeInfo,
    ResourceSlice,
    SliceDevice,
)
from tests.fake_kube_api import PDB_VIOLATION, Access, FakeKubeApi, deployment, node, pdb, pod
from tests.rbackit import allowed, shipped_rules

NS = "inference"
WAIT_S = 5.0


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as fake:
        fake.add("nodes", node("gpu-a", gpus=8))
        fake.add("nodes", node("gpu-b", gpus=8))
        fake.add("nodes", node("cpu-a", gpus=0, ready=False))
        fake.add("deployments", deployment(NS, "llama", replicas=2, gpus=2), group="apps")
        fake.add("pods", pod(NS, "llama", "x1", "gpu-a", gpus=2))
        fake.add("pods", pod(NS, "llama", "x2", "gpu-b", gpus=2))
        fake.add("pods", pod("other", "web", "w1", "gpu-a", gpus=0))
        yield fake


@pytest.fixture
async def cluster(api: FakeKubeApi) -> AsyncIterator[KubeCluster]:
    kube = KubeCluster.from_host(api.url, token="t0ken")
    yield kube
    await kube.close()


async def changes(watch: ClusterWatch, count: int) -> list[ClusterChange]:
    async def take() -> list[ClusterChange]:
        return [await anext(watch) for _ in range(count)]

    return await asyncio.wait_for(take(), WAIT_S)


async def nothing_more(watch: ClusterWatch, api: FakeKubeApi) -> None:
    """No further change is pending: a marker change made now is the very next one seen."""
    api.add("nodes", node("marker"))
    (seen,) = await changes(watch, 1)
    assert (seen.kind, seen.type, seen.name) == ("node", "ADDED", "marker")


def summary(seen: list[ClusterChange]) -> list[tuple[str, str, str]]:
    return [(c.kind, c.type, c.name) for c in seen]


# -- reading ------------------------------------------------------------------------------------------------------
async def test_is_a_cluster_port(cluster: KubeCluster) -> None:
    assert isinstance(cluster, ClusterPort)
    assert cluster.simulated is False


async def test_nodes_and_node(cluster: KubeCluster) -> None:
    nodes = await cluster.nodes()
    assert [n.name for n in nodes] == ["cpu-a", "gpu-a", "gpu-b"]
    assert nodes[0] == NodeInfo("cpu-a", {"kubernetes.io/hostname": "cpu-a"}, {}, True, False, 0, revision="4")
    assert nodes[1].gpus == 8 and nodes[1].ready and nodes[1].schedulable
    assert await cluster.node("gpu-b") == nodes[2]
    assert await cluster.node("nope") is None


async def test_pods_by_node_and_namespace(cluster: KubeCluster, api: FakeKubeApi) -> None:
    api.add("pods", pod(NS, "llama", "p0", "", phase="Pending"))
    api.add("pods", pod(NS, "batch", "done", "gpu-a", phase="Succeeded"))
    everything = await cluster.pods()
    assert [p.name for p in everything] == [
        "llama-5d4f8c7b9-p0",
        "llama-5d4f8c7b9-x1",
        "llama-5d4f8c7b9-x2",
        "web-5d4f8c7b9-w1",
    ]
    pending, first = everything[0], everything[1]
    assert (pending.phase, pending.node) == ("Pending", "")
    assert (first.deployment, first.phase, first.node, first.gpus) == ("llama", "Running", "gpu-a", 2)
    assert first.labels["app.kubernetes.io/name"] == "llama"
    assert [p.name for p in await cluster.pods(node="gpu-a")] == ["llama-5d4f8c7b9-x1", "web-5d4f8c7b9-w1"]
    assert [p.name for p in await cluster.pods(node="gpu-a", namespace=NS)] == ["llama-5d4f8c7b9-x1"]
    assert [p.namespace for p in await cluster.pods(namespace="other")] == ["other"]
    assert Access("list", "", "pods", "") in api.used() and Access("list", "", "pods", NS) in api.used()


async def test_deployments_with_budgets(cluster: KubeCluster, api: FakeKubeApi) -> None:
    api.add("deployments", deployment(NS, "mistral", replicas=4, gpus=1), group="apps")
    api.add("deployments", deployment("other", "web", replicas=3, gpus=0), group="apps")
    api.add("poddisruptionbudgets", pdb(NS, "mistral", {"app.kubernetes.io/name": "mistral"}, min_available="50%"),
            group="policy")  # fmt: skip
    api.add("poddisruptionbudgets", pdb("other", "web", {"app.kubernetes.io/name": "web"}, max_unavailable=2),
            group="policy")  # fmt: skip
    found = await cluster.deployments()
    assert found == [
        DeploymentInfo("llama", NS, 2, gpus_per_pod=2, max_unavailable=1, labels={"app.kubernetes.io/name": "llama"}),
        DeploymentInfo("mistral", NS, 4, 1, 2, {"app.kubernetes.io/name": "mistral"}),
        DeploymentInfo("web", "other", 3, 0, 2, {"app.kubernetes.io/name": "web"}),
    ]
    assert [d.name for d in await cluster.deployments(NS)] == ["llama", "mistral"]


# -- writing ------------------------------------------------------------------------------------------------------
async def test_cordon_and_uncordon_patch_spec_unschedulable(cluster: KubeCluster, api: FakeKubeApi) -> None:
    await cluster.cordon("gpu-a")
    assert api.get("nodes", "", "gpu-a")["spec"]["unschedulable"] is True  # type: ignore[index]
    assert (await cluster.node("gpu-a")).schedulable is False  # type: ignore[union-attr]
    await cluster.uncordon("gpu-a")
    assert "unschedulable" not in api.get("nodes", "", "gpu-a")["spec"]  # type: ignore[index]
    assert (await cluster.node("gpu-a")).schedulable is True  # type: ignore[union-attr]
    with pytest.raises(KubeApiError) as missing:
        await cluster.cordon("nope")
    assert missing.value.code == 404


async def test_labels_and_annotations_set_and_remove(cluster: KubeCluster) -> None:
    await cluster.set_node_labels("gpu-a", {"gpuwarden.io/upgrade": "draining", "kubernetes.io/hostname": None})
    await cluster.set_node_annotations("gpu-a", {"gpuwarden.io/driver": "550.90"})
    got = await cluster.node("gpu-a")
    assert got is not None
    assert got.labels == {"gpuwarden.io/upgrade": "draining"}
    assert got.annotations == {"gpuwarden.io/driver": "550.90"}
    await cluster.set_node_labels("gpu-a", {"gpuwarden.io/upgrade": None})
    await cluster.set_node_annotations("gpu-a", {"gpuwarden.io/driver": None})
    got = await cluster.node("gpu-a")
    assert got is not None and dict(got.labels) == {} and dict(got.annotations) == {}


async def test_update_node_is_one_patch_and_a_compare_and_set(cluster: KubeCluster, api: FakeKubeApi) -> None:
    read = await cluster.node("gpu-a")
    assert read is not None and read.revision == api.get("nodes", "", "gpu-a")["metadata"]["resourceVersion"]  # type: ignore[index]
    writes = len(api.history)
    answered = await cluster.update_node(
        "gpu-a",
        labels={"nvidia.com/gpu-driver-upgrade-state": "cordon-required", "kubernetes.io/hostname": None},
        annotations={"gpuwarden.io/driver-coordinator-fence": "3"},
        schedulable=False,
        expect=read.revision,
    )
    assert len(api.history) == writes + 1  # labels, annotations and the cordon in one write
    written = await cluster.node("gpu-a")
    assert written == answered and written.revision != read.revision
    assert written.labels == {"nvidia.com/gpu-driver-upgrade-state": "cordon-required"}
    assert written.annotations == {"gpuwarden.io/driver-coordinator-fence": "3"}
    assert written.schedulable is False

    with pytest.raises(ClusterConflict, match="gpu-a"):  # decided on the first read: refused, nothing written
        await cluster.update_node(
            "gpu-a", labels={"nvidia.com/gpu-driver-upgrade-state": "upgrade-done"}, expect=read.revision
        )
    with pytest.raises(ClusterConflict):  # even a write that would change nothing
        await cluster.update_node(
            "gpu-a", annotations={"gpuwarden.io/driver-coordinator-fence": "3"}, expect=read.revision
        )
    assert api.conflicts == 2
    assert await cluster.node("gpu-a") == written

    await cluster.update_node(
        "gpu-a", labels={"nvidia.com/gpu-driver-upgrade-state": None}, schedulable=True, expect=written.revision
    )
    assert "unschedulable" not in api.get("nodes", "", "gpu-a")["spec"]  # type: ignore[index]
    await cluster.update_node("gpu-a", annotations={"gpuwarden.io/driver-coordinator-fence": None})  # no expect: plain
    final = await cluster.node("gpu-a")
    assert final is not None and final.schedulable and dict(final.labels) == {} and dict(final.annotations) == {}


async def test_evict_honours_budgets(cluster: KubeCluster, api: FakeKubeApi) -> None:
    api.add("poddisruptionbudgets", pdb(NS, "llama", {"app.kubernetes.io/name": "llama"}, min_available=1),
            group="policy")  # fmt: skip
    first, second = "llama-5d4f8c7b9-x1", "llama-5d4f8c7b9-x2"
    assert await cluster.evict(NS, first) is EvictionOutcome.EVICTED
    assert (await cluster.pods(node="gpu-a", namespace=NS))[0].phase == "Terminating"
    assert await cluster.evict(NS, second) is EvictionOutcome.BLOCKED_BY_PDB
    assert await cluster.evict(NS, "gone") is EvictionOutcome.NOT_FOUND
    api.delete("pods", NS, first)
    api.add("pods", pod(NS, "llama", "x3", "gpu-b", gpus=2))
    assert await cluster.evict(NS, second) is EvictionOutcome.EVICTED


async def test_evict_429_is_blocked_by_pdb(cluster: KubeCluster, api: FakeKubeApi) -> None:
    api.block_next_evictions(2)
    assert await cluster.evict("other", "web-5d4f8c7b9-w1") is EvictionOutcome.BLOCKED_BY_PDB
    assert await cluster.evict("other", "web-5d4f8c7b9-w1") is EvictionOutcome.BLOCKED_BY_PDB
    assert await cluster.evict("other", "web-5d4f8c7b9-w1") is EvictionOutcome.EVICTED
    assert Access("create", "", "pods/eviction", "other") in api.used()


async def test_fake_answers_429_with_the_api_servers_status(api: FakeKubeApi) -> None:
    import aiohttp

    api.block_next_evictions(1)
    url = f"{api.url}/api/v1/namespaces/other/pods/web-5d4f8c7b9-w1/eviction"
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "web-5d4f8c7b9-w1"}}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 429
        status = await response.json()
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 429, "TooManyRequests")
    assert status["message"] == PDB_VIOLATION


async def test_scale_through_the_scale_subresource(cluster: KubeCluster, api: FakeKubeApi) -> None:
    await cluster.scale(NS, "llama", 5)
    assert (await cluster.deployments(NS))[0].replicas == 5
    assert Access("patch", "apps", "deployments/scale", NS) in api.used()
    with pytest.raises(KubeApiError) as missing:
        await cluster.scale(NS, "nope", 1)
    assert missing.value.code == 404


# -- watching -----------------------------------------------------------------------------------------------------
async def test_watch_sees_every_change_in_order(cluster: KubeCluster, api: FakeKubeApi) -> None:
    watch = cluster.watch()
    await watch.ready()
    await cluster.cordon("gpu-a")
    await cluster.set_node_labels("gpu-a", {"gpuwarden.io/upgrade": "draining"})
    await cluster.uncordon("gpu-a")
    assert await cluster.evict(NS, "llama-5d4f8c7b9-x1") is EvictionOutcome.EVICTED
    api.delete("pods", NS, "llama-5d4f8c7b9-x1")
    api.add("pods", pod(NS, "llama", "x3", "gpu-b"))
    seen = await changes(watch, 6)
    nodes = [c for c in seen if c.kind == "node"]
    pods = [c for c in seen if c.kind == "pod"]
    assert summary(nodes) == [("node", "MODIFIED", "gpu-a")] * 3
    assert summary(pods) == [
        ("pod", "MODIFIED", "llama-5d4f8c7b9-x1"),
        ("pod", "DELETED", "llama-5d4f8c7b9-x1"),
        ("pod", "ADDED", "llama-5d4f8c7b9-x3"),
    ]
    assert all(c.namespace == NS for c in pods) and all(c.revision for c in seen)
    assert [int(c.revision) for c in nodes] == sorted(int(c.revision) for c in nodes)
    assert [c.node for c in nodes] == ["gpu-a"] * 3
    assert [c.node for c in pods][1:] == [pods[0].node, "gpu-b"] and pods[0].node  # the node each pod is on
    await nothing_more(watch, api)
    await watch.aclose()


async def test_watch_resumes_after_dropped_connections(cluster: KubeCluster, api: FakeKubeApi) -> None:
    watch = cluster.watch()
    await watch.ready()
    await cluster.cordon("gpu-a")
    assert summary(await changes(watch, 1)) == [("node", "MODIFIED", "gpu-a")]
    last = (await cluster.node("gpu-a"), api.revision)
    api.drop_watches()
    await cluster.uncordon("gpu-a")
    await cluster.cordon("gpu-b")
    seen = await changes(watch, 2)
    assert summary(seen) == [("node", "MODIFIED", "gpu-a"), ("node", "MODIFIED", "gpu-b")]
    resumed = [version for resource, version in api.watch_requests if resource == "nodes"]
    assert len(resumed) >= 2 and resumed[-1] == str(last[1])
    await nothing_more(watch, api)
    await watch.aclose()


async def test_watch_relists_on_410_and_reports_the_difference(cluster: KubeCluster, api: FakeKubeApi) -> None:
    watch = cluster.watch()
    await watch.ready()
    api.hold_watches()
    await cluster.cordon("gpu-a")
    await cluster.cordon("gpu-a")  # no change, no event
    api.delete("nodes", "", "cpu-a")
    api.add("nodes", node("gpu-c", gpus=4))
    api.add("pods", pod(NS, "llama", "x3", "gpu-c"))
    api.delete("pods", "other", "web-5d4f8c7b9-w1")
    api.compact()
    api.release_watches()
    seen = await changes(watch, 5)
    assert sorted(summary(seen)) == [
        ("node", "ADDED", "gpu-c"),
        ("node", "DELETED", "cpu-a"),
        ("node", "MODIFIED", "gpu-a"),
        ("pod", "ADDED", "llama-5d4f8c7b9-x3"),
        ("pod", "DELETED", "web-5d4f8c7b9-w1"),
    ]
    lists = [a for a in api.accesses if a.verb == "list" and a.resource == "nodes"]
    assert len(lists) == 2
    await nothing_more(watch, api)
    await watch.aclose()


async def test_watch_from_a_compacted_version_on_reconnect(cluster: KubeCluster, api: FakeKubeApi) -> None:
    watch = cluster.watch()
    await watch.ready()
    api.hold_watches()
    await cluster.set_node_labels("gpu-b", {"a": "1"})
    api.compact()
    api.drop_watches()
    api.release_watches()
    assert summary(await changes(watch, 1)) == [("node", "MODIFIED", "gpu-b")]
    await nothing_more(watch, api)
    await watch.aclose()


async def test_watch_of_one_nodes_pods(api: FakeKubeApi) -> None:
    kube = KubeCluster.from_host(api.url, watch_kinds=("pod",), watch_node="gpu-b")
    try:
        watch = kube.watch()
        await watch.ready()
        api.add("pods", pod(NS, "llama", "a1", "gpu-a"))
        api.add("pods", pod(NS, "llama", "b1", "gpu-b"))
        assert summary(await changes(watch, 1)) == [("pod", "ADDED", "llama-5d4f8c7b9-b1")]
        assert {a for a in api.used() if a.verb in ("list", "watch")} == {
            Access("list", "", "pods"),
            Access("watch", "", "pods"),
        }
    finally:
        await kube.close()


async def test_watch_of_deployments(api: FakeKubeApi) -> None:
    kube = KubeCluster.from_host(api.url, watch_kinds=("deployment",))
    try:
        watch = kube.watch()
        await watch.ready()
        await kube.scale(NS, "llama", 3)
        seen = await changes(watch, 1)
        assert (seen[0].kind, seen[0].type, seen[0].name, seen[0].namespace) == ("deployment", "MODIFIED", "llama", NS)
    finally:
        await kube.close()


async def test_watch_refused_by_rbac_raises(api: FakeKubeApi) -> None:
    api.authorize = lambda access: access.resource != "pods"
    kube = KubeCluster.from_host(api.url)
    try:
        watch = kube.watch()
        with pytest.raises(KubeApiError) as refused:
            await asyncio.wait_for(watch.ready(), WAIT_S)
        assert refused.value.code == 403 and "cannot list resource" in str(refused.value)
        with pytest.raises(KubeApiError):
            await anext(watch)
        with pytest.raises(StopAsyncIteration):
            await anext(watch)
    finally:
        await kube.close()


async def test_close_stops_open_watches(api: FakeKubeApi) -> None:
    kube = KubeCluster.from_host(api.url)
    watch = kube.watch()
    await watch.ready()
    await kube.close()
    with pytest.raises(StopAsyncIteration):
        await anext(watch)


# -- RBAC ---------------------------------------------------------------------------------------------------------


async def driver_work(kube: KubeCluster, api: FakeKubeApi) -> None:
    """Everything the driver does through the port: read, cordon, label, evict, watch."""
    watch = kube.watch()
    await watch.ready()
    await kube.nodes()
    await kube.node("gpu-a")
    await kube.cordon("gpu-a")
    await kube.set_node_labels("gpu-a", {"gpuwarden.io/upgrade": "draining"})
    await kube.set_node_annotations("gpu-a", {"gpuwarden.io/driver": "550"})
    read = await kube.node("gpu-a")
    assert read is not None
    await kube.update_node("gpu-a", labels={"gpuwarden.io/upgrade": "done"}, expect=read.revision)
    await kube.pods(node="gpu-a")
    await kube.evict(NS, "llama-5d4f8c7b9-x1")
    await kube.uncordon("gpu-a")
    await changes(watch, 6)
    await watch.aclose()


async def device_work(kube: KubeCluster, api: FakeKubeApi) -> None:
    """Its own node, read, watched (the MIG controller) and labelled; which pods hold a GPU it asks the kubelet,
    not the API server."""
    watch = kube.watch()
    await watch.ready()
    await kube.node("gpu-a")
    await kube.set_node_labels("gpu-a", {"nvidia.com/gpu.count": "8"})
    await changes(watch, 1)
    await watch.aclose()
    # As a DRA driver: its node's ResourceSlice (created, then replaced), and a claim it is asked to prepare.
    for count in (2, 1):
        devices = tuple(SliceDevice(f"gpu-{i}", {"type": "gpu"}, {"memory": "81559Mi"}) for i in range(count))
        await kube.publish_resource_slice(ResourceSlice("gpu.gpuwarden.io", "gpu-a", "gpu-a", devices))
    await kube.resource_claim(NS, "claim")


async def pods_work(kube: KubeCluster, api: FakeKubeApi) -> None:
    await kube.pods()


async def checkpoint_work(kube: KubeCluster, api: FakeKubeApi) -> None:
    """Pods (which are gone), and whether a node to drain exists."""
    watch = kube.watch()
    await watch.ready()
    await kube.pods()
    await kube.pods(node="gpu-a")
    assert await kube.node("gpu-a") is not None
    api.add("pods", pod(NS, "llama", "a9", "gpu-a"))
    await changes(watch, 1)
    await watch.aclose()


Work = Callable[[KubeCluster, FakeKubeApi], Awaitable[None]]
SERVICES: dict[str, tuple[Work, dict[str, Any]]] = {
    "driver": (driver_work, {}),
    "device": (device_work, {"watch_kinds": ("node",)}),
    "checkpoint": (checkpoint_work, {"watch_kinds": ("pod",)}),
    "metrics": (pods_work, {}),
}
UNUSED = {
    # Granted by deploy/rbac but used by no adapter call: Kubernetes Events are for the driver to record itself.
    "driver": {
        Access("create", "", "events", "*"),
        Access("create", "events.k8s.io", "events", "*"),
    },
    "device": set(),
    "checkpoint": {Access("get", "", "pods", "*")},
    "metrics": {Access("get", "", "pods", "*")},
}


@pytest.mark.parametrize("service", sorted(SERVICES))
async def test_rbac_allows_everything_used(service: str, api: FakeKubeApi) -> None:
    work, options = SERVICES[service]
    rules = shipped_rules(service)
    api.authorize = lambda access: allowed(access, rules)
    kube = KubeCluster.from_host(api.url, **options)
    try:
        await work(kube, api)
    finally:
        await kube.close()
    forbidden = {a for a in api.used() if not allowed(a, rules)}
    assert not forbidden, f"deploy/rbac/{service}.yaml does not allow {sorted(forbidden)}"
    used = {Access(a.verb, a.group, a.resource, "*") for a in api.used()} | api.used()
    assert rules - used == UNUSED[service]


async def test_rbac_scaler_may_list_pods_and_nothing_else(api: FakeKubeApi) -> None:
    """The scaler's ``ClusterPlacement`` lists pods by namespace; that is all its ClusterRole grants."""
    rules = shipped_rules("scaler")
    assert rules == {Access("list", "", "pods", "*")}
    api.authorize = lambda access: allowed(access, rules)
    kube = KubeCluster.from_host(api.url)
    try:
        assert {p.name for p in await kube.pods(namespace=NS)} == {"llama-5d4f8c7b9-x1", "llama-5d4f8c7b9-x2"}
        with pytest.raises(KubeApiError) as refused:
            await kube.node("gpu-a")
    finally:
        await kube.close()
    assert refused.value.code == 403
    assert api.used() == {Access("list", "", "pods", NS), Access("get", "", "nodes", "")}
