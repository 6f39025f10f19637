"""The kubelet device plugin over real gRPC on unix sockets: a test plays the kubelet (``Registration`` on a temp
``kubelet.sock``), receives the plugin's registration, then calls the plugin as the kubelet would. Health comes
from XIDs injected into the simulated GPUs (through the device service) or is fed to the plugin directly."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from services.device.cdi import SPEC_FILE, spec_problems
from services.device.config import DeviceSettings, parse_plugin_config
from services.device.gen import deviceplugin_pb2 as pb
from services.device.plugin import KubeletDevicePlugin, socket_name
from services.device.resources import ResourceError
from services.device.service import DeviceService
from shared.contract.device import GpuDevice, MigInstance
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.settings import Settings
from shared.sim.faults import XidFault, apply_fault
from shared.sim.gpus import SimGpus
from shared.sim.spec import parse_spec
from shared.wiring import Wiring
from tests.fake_kubelet import TIMEOUT, FakeKubelet, listed, plugin_stub, read
from tests.helpers import eventually


@contextlib.asynccontextmanager
async def running(plugin: KubeletDevicePlugin) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(plugin.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def ended(stream: grpc.aio.UnaryStreamCall) -> bool:
    """The stream was closed by the plugin (EOF) or the connection went (an RPC error)."""
    try:
        return await asyncio.wait_for(stream.read(), TIMEOUT) is grpc.aio.EOF
    except grpc.aio.AioRpcError:
        return True


def gpu(index: int, numa: int, peers: tuple[int, ...] = (), healthy: bool = True) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=f"GPU-{index}",
        model="NVIDIA H100 80GB HBM3",
        numa_node=numa,
        nvlink_peers=[f"GPU-{p}" for p in peers],
        healthy=healthy,
    )


# GPUs 0-1 and 2-3 are NVLink pairs; 0, 1 and 4 sit on NUMA node 0, 2 and 3 on node 1.
def topology(unhealthy: frozenset[int] = frozenset()) -> list[GpuDevice]:
    shape = [(0, (1,)), (0, (0,)), (1, (3,)), (1, (2,)), (0, ())]
    return [gpu(i, numa, peers, i not in unhealthy) for i, (numa, peers) in enumerate(shape)]


def settings_for(folder: Path, config: str = "") -> DeviceSettings:
    return DeviceSettings(
        plugin_dir=folder,
        plugin="on",
        plugin_config=parse_plugin_config(config),
        kubelet_poll_s=0.05,
        cdi_dir=folder / "cdi",
    )


async def test_the_kubelet_registers_lists_allocates_and_re_registers(plugin_dir: Path, kubelet: FakeKubelet) -> None:
    plugin = KubeletDevicePlugin(settings_for(plugin_dir))
    await plugin.update(topology())
    async with running(plugin) as task:
        reg = await kubelet.registration()
        assert (reg.version, reg.endpoint, reg.resource_name) == (
            "v1beta1",
            socket_name("nvidia.com/gpu"),
            "nvidia.com/gpu",
        )
        assert reg.options == pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
        assert (plugin_dir / reg.endpoint).is_socket()

        async with plugin_stub(plugin_dir, reg.endpoint) as stub:
            assert await stub.GetDevicePluginOptions(pb.Empty()) == reg.options
            stream = stub.ListAndWatch(pb.Empty())
            first = await read(stream)
            assert listed(first) == {
                "GPU-0": ("Healthy", [0]),
                "GPU-1": ("Healthy", [0]),
                "GPU-2": ("Healthy", [1]),
                "GPU-3": ("Healthy", [1]),
                "GPU-4": ("Healthy", [0]),
            }

            # Health: a GPU goes bad, and is offered again once it recovers; each time the full list.
            await plugin.update(topology(unhealthy=frozenset({2})))
            sick = listed(await read(stream))
            assert len(sick) == 5 and sick["GPU-2"] == ("Unhealthy", [1]) and sick["GPU-3"][0] == "Healthy"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Allocate(
                    pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-2"])])
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                refused.value.details()
                == "nvidia.com/gpu: request: device ID(s) of nvidia.com/gpu are Unhealthy: GPU-2"
            )
            assert not await plugin.update(topology(unhealthy=frozenset({2})))  # nothing new: nothing sent
            await plugin.update(topology())
            assert {h for h, _ in listed(await read(stream)).values()} == {"Healthy"}

            # Allocate: unknown IDs are refused, naming them, and change nothing.
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Allocate(
                    pb.AllocateRequest(
                        container_requests=[
                            pb.ContainerAllocateRequest(devices_ids=["GPU-0"]),
                            pb.ContainerAllocateRequest(devices_ids=["GPU-9", "GPU-1"]),
                        ]
                    )
                )
            assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown device ID(s) for nvidia.com/gpu: GPU-9 (advertised: GPU-0, GPU-1" in unknown.value.details()
            answer = await stub.Allocate(
                pb.AllocateRequest(
                    container_requests=[
                        pb.ContainerAllocateRequest(devices_ids=["GPU-0", "GPU-1"]),
                        pb.ContainerAllocateRequest(devices_ids=["GPU-2"]),
                    ]
                )
            )
            assert [dict(c.envs) for c in answer.container_responses] == [
                {"NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1"},
                {"NVIDIA_VISIBLE_DEVICES": "GPU-2"},
            ]
            assert all(not c.cdi_devices for c in answer.container_responses)

            # Preferred allocation: NVLink first, then the NUMA node.
            every = [f"GPU-{i}" for i in range(5)]
            pref = await stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(available_deviceIDs=every, allocation_size=2),
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=every, must_include_deviceIDs=["GPU-3"], allocation_size=2
                        ),
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=["GPU-1", "GPU-2", "GPU-4"],
                            must_include_deviceIDs=["GPU-1"],
                            allocation_size=2,
                        ),
                    ]
                )
            )
            assert [list(c.deviceIDs) for c in pref.container_responses] == [
                ["GPU-0", "GPU-1"],
                ["GPU-2", "GPU-3"],
                ["GPU-1", "GPU-4"],
            ]
            with pytest.raises(grpc.aio.AioRpcError) as too_many:
                await stub.GetPreferredAllocation(
                    pb.PreferredAllocationRequest(
                        container_requests=[
                            pb.ContainerPreferredAllocationRequest(available_deviceIDs=["GPU-0"], allocation_size=2)
                        ]
                    )
                )
            assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot choose 2 device(s) of nvidia.com/gpu from 1 available" in too_many.value.details()
            assert await stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["GPU-0"])) == (
                pb.PreStartContainerResponse()
            )

            # The kubelet restarts: it removed the plugin's socket; the plugin serves it again and re-registers.
            await kubelet.restart()
            again = await kubelet.registration()
            assert again == reg and (plugin_dir / again.endpoint).is_socket()
            assert await ended(stream)
        await eventually(lambda: plugin.describe()["registrations"] == 2)
        async with plugin_stub(plugin_dir, again.endpoint) as stub:
            stream = stub.ListAndWatch(pb.Empty())
            assert len(listed(await read(stream))) == 5

            # Cancelled: the stream ends and the socket is gone.
            task.cancel()
            assert await ended(stream)
    assert not (plugin_dir / reg.endpoint).exists()


async def test_mig_resources_and_time_slices_are_served_each_on_its_socket(
    plugin_dir: Path, kubelet: FakeKubelet
) -> None:
    config = """
mig_strategy: mixed
device_list_strategy: cdi
sharing:
  time_slicing:
    resources: [{name: nvidia.com/mig-1g.10gb, replicas: 2}]
"""
    h100 = GpuDevice(
        index=0,
        uuid="GPU-0",
        model="NVIDIA H100 80GB HBM3",
        numa_node=0,
        mig_capable=True,
        mig_enabled=True,
        mig_instances=[MigInstance(uuid="MIG-a", profile="1g.10gb"), MigInstance(uuid="MIG-b", profile="3g.40gb")],
    )
    plugin = KubeletDevicePlugin(settings_for(plugin_dir, config))
    await plugin.update([h100, gpu(1, 1)])
    async with running(plugin):
        regs = await kubelet.registrations_for(3)
        assert {name: r.endpoint for name, r in regs.items()} == {
            "nvidia.com/gpu": "gpuwarden-nvidia.com_gpu.sock",
            "nvidia.com/mig-1g.10gb": "gpuwarden-nvidia.com_mig-1g.10gb.sock",
            "nvidia.com/mig-3g.40gb": "gpuwarden-nvidia.com_mig-3g.40gb.sock",
        }
        async with plugin_stub(plugin_dir, regs["nvidia.com/mig-1g.10gb"].endpoint) as stub:
            stream = stub.ListAndWatch(pb.Empty())
            assert listed(await read(stream)) == {"MIG-a::0": ("Healthy", [0]), "MIG-a::1": ("Healthy", [0])}
            answer = await stub.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["MIG-a::1"])])
            )
            assert [c.name for c in answer.container_responses[0].cdi_devices] == ["nvidia.com/gpu=MIG-a"]
            assert dict(answer.container_responses[0].envs) == {}
            # A MIG-only ID asked of the whole-GPU resource is unknown there.
            async with plugin_stub(plugin_dir, regs["nvidia.com/gpu"].endpoint) as gpus:
                with pytest.raises(grpc.aio.AioRpcError, match=r"unknown device ID.*MIG-a::0"):
                    await gpus.Allocate(
                        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["MIG-a::0"])])
                    )

            # The MIG layout changes: a new profile gets its own socket and registration; a vanished one is empty.
            relaid = GpuDevice(
                index=0,
                uuid="GPU-0",
                model=h100.model,
                numa_node=0,
                mig_capable=True,
                mig_enabled=True,
                mig_instances=[MigInstance(uuid="MIG-c", profile="7g.80gb")],
            )
            await plugin.update([relaid, gpu(1, 1)])
            new = await kubelet.registration()
            assert new.resource_name == "nvidia.com/mig-7g.80gb" and (plugin_dir / new.endpoint).is_socket()
            assert listed(await read(stream)) == {}

        spec = json.loads((plugin_dir / "cdi" / SPEC_FILE).read_text())
        assert spec_problems(spec) == []
        assert {"GPU-0", "MIG-c", "GPU-1", "all"} <= {d["name"] for d in spec["devices"]}


async def test_a_layout_the_strategy_cannot_describe_changes_nothing(plugin_dir: Path, kubelet: FakeKubelet) -> None:
    def sliced(*profiles: str) -> GpuDevice:
        instances = [MigInstance(uuid=f"MIG-{k}", profile=p) for k, p in enumerate(profiles)]
        return GpuDevice(index=0, uuid="GPU-0", model="H100", mig_enabled=True, mig_instances=instances)

    plugin = KubeletDevicePlugin(settings_for(plugin_dir, "mig_strategy: single"))
    await plugin.update([sliced("1g.10gb", "1g.10gb")])
    async with running(plugin):
        reg = await kubelet.registration()
        async with plugin_stub(plugin_dir, reg.endpoint) as stub:
            stream = stub.ListAndWatch(pb.Empty())
            assert list(listed(await read(stream))) == ["MIG-0", "MIG-1"]
            with pytest.raises(ResourceError, match=r"one MIG profile on the node; found 1g\.10gb, 3g\.40gb"):
                await plugin.update([sliced("1g.10gb", "3g.40gb")])
            assert "found 1g.10gb, 3g.40gb" in plugin.describe()["layout_error"]
            answer = await stub.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["MIG-1"])])
            )
            assert dict(answer.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": "MIG-1"}
            # The next good layout is what the stream sends next: nothing was sent for the refused one.
            await plugin.update([sliced("1g.10gb")])
            assert list(listed(await read(stream))) == ["MIG-0"]
            assert plugin.describe()["layout_error"] is None


async def test_the_plugin_waits_for_a_kubelet_that_is_not_there_yet(plugin_dir: Path) -> None:
    plugin = KubeletDevicePlugin(settings_for(plugin_dir))
    await plugin.update(topology())
    async with running(plugin):
        await eventually(lambda: (plugin_dir / socket_name("nvidia.com/gpu")).is_socket())
        assert plugin.describe()["resources"]["nvidia.com/gpu"] == {"devices": 5, "healthy": 5, "registered": False}
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        try:
            assert (await kubelet.registration()).resource_name == "nvidia.com/gpu"
            await eventually(lambda: plugin.describe()["resources"]["nvidia.com/gpu"]["registered"])
        finally:
            await kubelet.stop()


# -- through the device service: XIDs injected into the simulated GPUs reach the kubelet -------------------------
SPEC = """
driver_version: "550.54.15"
cuda_version: "12.4"
nodes:
  - name: node-1
    numa_nodes: 2
    gpus:
      - {model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 2}
      - {model: NVIDIA L4, memory_mib: 23034, count: 1, nvlink: false}
"""


async def test_the_device_service_feeds_xid_health_to_the_kubelet(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis, plugin_dir: Path, kubelet: FakeKubelet
) -> None:
    gpus = SimGpus(redis_client, subjects, parse_spec(SPEC, "spec.yaml"), "node-1")
    device_settings = DeviceSettings(
        inventory_s=0.05, plugin_dir=plugin_dir, plugin="on", kubelet_poll_s=0.05, cdi_dir=plugin_dir / "cdi"
    )
    service = DeviceService(device_settings, gpus=gpus)
    runner = await start_service(service, settings, Wiring)
    stopped = False
    try:
        reg = await kubelet.registration()
        assert (reg.version, reg.resource_name) == ("v1beta1", "nvidia.com/gpu")
        h100a, h100b, l4 = (d.uuid for d in await gpus.devices())
        async with plugin_stub(plugin_dir, reg.endpoint) as stub:
            stream = stub.ListAndWatch(pb.Empty())
            assert listed(await read(stream)) == {
                h100a: ("Healthy", [0]),
                h100b: ("Healthy", [0]),
                l4: ("Healthy", [1]),
            }
            pref = await stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=[l4, h100b, h100a], allocation_size=2
                        )
                    ]
                )
            )
            assert list(pref.container_responses[0].deviceIDs) == [h100a, h100b]

            # An application XID counts for nothing; the next list is the critical XID's.
            await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=1, code=13))
            await apply_fault(redis_client, subjects, XidFault(node="node-1", gpu=0, code=79))
            after = listed(await read(stream))
            assert {uuid: health for uuid, (health, _) in after.items()} == {
                h100a: "Unhealthy",
                h100b: "Healthy",
                l4: "Healthy",
            }
            with pytest.raises(grpc.aio.AioRpcError, match=f"Unhealthy: {h100a}"):
                await stub.Allocate(
                    pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[h100a])])
                )

            def advertised() -> dict[str, object]:
                return dict(runner.ctx.health()["device_plugin"]["resources"]["nvidia.com/gpu"])

            await eventually(lambda: advertised()["registered"])
            assert advertised() == {"devices": 3, "healthy": 2, "registered": True}
            cdi = json.loads((plugin_dir / "cdi" / SPEC_FILE).read_text())
            assert spec_problems(cdi) == [] and h100a in {d["name"] for d in cdi["devices"]}

            await runner.stop(grace=1)
            stopped = True
            assert await ended(stream)
        assert not (plugin_dir / reg.endpoint).exists()
    finally:
        if not stopped:
            await runner.stop(grace=1)


async def test_pausing_withdraws_every_device_until_resumed(plugin_dir: Path, kubelet: FakeKubelet) -> None:
    """What the MIG controller does while it reconfigures: the kubelet sees no devices, then all of them again."""
    plugin = KubeletDevicePlugin(settings_for(plugin_dir))
    await plugin.update(topology())
    async with running(plugin):
        reg = await kubelet.registration()
        async with plugin_stub(plugin_dir, reg.endpoint) as stub:
            stream = stub.ListAndWatch(pb.Empty())
            assert len(listed(await read(stream))) == 5
            await plugin.pause()
            assert listed(await read(stream)) == {}
            await plugin.update(topology(unhealthy=frozenset({0})))  # news while paused is kept, not sent
            with pytest.raises(grpc.aio.AioRpcError, match="unknown device ID"):
                await stub.Allocate(
                    pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-1"])])
                )
            await plugin.resume()
            resumed = listed(await read(stream))
            assert len(resumed) == 5 and resumed["GPU-0"][0] == "Unhealthy"
