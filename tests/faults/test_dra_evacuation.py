"""A GPU fails on a node whose pods hold their GPUs by DRA claim: the device service taints that device in its
ResourceSlice, names exactly the pod whose claim holds it, the checkpoint service saves exactly that pod's sessions,
the scheduler gives the device to no new pod, and the invariant checker is clean after it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from services.device.config import DeviceSettings
from services.device.dra.slices import DRIVER_NAME
from services.device.service import DeviceService
from shared.contract.checkpoint import CheckpointSaved
from shared.contract.device import DeviceHealthChanged
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.faults import XidFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.lookups import SimGpuPods
from shared.sim.spec import parse_spec
from shared.wiring import Wiring
from tests.faults.conftest import Mesh
from tests.helpers import eventually

SPEC = """
nodes:
  - name: node-1
    gpus: [{model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 2}]
  - name: node-2
    gpus: [{model: NVIDIA L4, memory_mib: 23034, count: 2, nvlink: false}]
deployments:
  - name: llama
    namespace: llm
    replicas: 2
    kv_blocks: 128
    model: {engine: synthetic, max_model_len: 1024}
    claim:
      selectors: ['device.attributes["gpu.gpuwarden.io"].productName == "NVIDIA H100 80GB HBM3"']
"""


@pytest.fixture
def folder() -> Iterator[Path]:
    """Short on purpose: the DRA driver's unix sockets must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gw-drae-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_a_failing_gpu_held_by_claim_evacuates_exactly_its_pod_and_is_given_to_no_new_pod(
    mesh: Mesh, settings: Settings, subjects: Subjects, redis_client: aioredis.Redis, folder: Path
) -> None:
    spec = parse_spec(SPEC, "dra-evacuation.yaml")
    # a cluster of its own: the mesh's checkpoint service attached one of the default spec under the test's root
    cluster = await SimCluster.create(redis_client, Subjects(f"{subjects.root}-dra"), spec)
    assert not [p for p in await cluster.pods() if p.phase == "Running"]  # no slice yet: every claim waits
    device_settings = DeviceSettings(
        api="dra",
        inventory_s=0.05,
        plugin_dir=folder / "device-plugins",
        dra_plugin_dir=folder / "plugins" / DRIVER_NAME,
        dra_registry_dir=folder / "plugins_registry",
        kubelet_poll_s=0.05,
        cdi_dir=folder / "cdi",
    )
    gpus = SimGpus(redis_client, subjects, spec, "node-1")
    holders_of = SimGpuPods(cluster, "node-1")  # which pods hold a GPU: from the claims' devices in the simulation
    device = await start_service(
        DeviceService(device_settings, gpus=gpus, cluster=cluster, pods=holders_of), settings, Wiring
    )
    try:

        async def both_running() -> dict[str, str] | None:
            found = {p.name: p.node for p in await cluster.pods() if p.phase == "Running"}
            return found if len(found) == 2 else None

        placed = await eventually(both_running)
        assert set(placed.values()) == {"node-1"}  # node-2's L4s are not selected
        holders = await cluster.gpu_holders("node-1")
        doomed = holders[1][0].split("/")[1]
        spared = holders[0][0].split("/")[1]
        pods = {
            doomed: await mesh.add_pod(doomed, "node-1", ["s-doomed-1", "s-doomed-2"]),
            spared: await mesh.add_pod(spared, "node-1", ["s-spared-1"]),
        }
        assert set(pods) == set(placed)
        health = await mesh.heard("device.health.changed", DeviceHealthChanged)
        saved = await mesh.heard("checkpoint.saved", CheckpointSaved)

        await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=1, code=79))

        await eventually(lambda: {e.session_id for e in saved} == {"s-doomed-1", "s-doomed-2"}, timeout=30)
        failing = [e for e in health if not e.healthy]
        assert len(failing) == 1 and failing[0].pods == [f"llm/{doomed}"], failing
        assert {e.pod for e in saved} == {doomed}

        async def tainted() -> bool:
            stored = (await cluster.resources.slices())[f"node-1-{DRIVER_NAME}"].slice
            return any(t.effect == "NoExecute" for d in stored.devices if d.name == "gpu-1" for t in d.taints)

        await eventually(tainted)
        await cluster.kill_pod("llm", doomed)  # it goes (its sessions are saved); the replacement waits
        await cluster.tick()
        after = {p.name: (p.node, p.phase) for p in await cluster.pods()}
        assert doomed not in after and after[spared] == ("node-1", "Running")
        assert [phase for name, (_, phase) in after.items() if name != spared] == ["Pending"]
        assert {e.session_id for e in saved} == {"s-doomed-1", "s-doomed-2"}  # nothing of the other pod
        await mesh.check(min_checkpoints=2)
    finally:
        await device.stop(grace=1)
        await cluster.close()
