"""Which pods hold a GPU: the adapters of ``ports.GpuPods``.

On a real node the kubelet knows, because its device manager handed the GPUs out: its PodResources API (v1, gRPC
on ``/var/lib/kubelet/pod-resources/kubelet.sock``) lists every pod's containers with the device IDs each got. A
container holds a GPU when one of its IDs is the GPU's UUID, a time-slice of it (``<uuid>::<k>``) or one of its
MIG instances' UUIDs, whoever advertised the resource; or when one of its ResourceClaims' CDI ids (its dynamic
resources) is one the DRA driver answered for the GPU or one of its MIG devices. In simulation the simulated
cluster records which GPU indices each pod was bound to (``shared.sim.lookups.SimGpuPods``); ``shared.wiring``
picks one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import grpc

from shared.contract.device import GpuDevice

from .dra.claims import names_gpu
from .gen import podresources_pb2 as pb
from .gen import podresources_pb2_grpc as pb_grpc
from .ports import PodLookupError
from .resources import REPLICA_SEPARATOR

LIST_TIMEOUT_S = 3.0
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
"""A node with many pods answers with more than gRPC's default 4 MiB."""


def holds(device_id: str, gpu: GpuDevice) -> bool:
    """Whether a device ID the kubelet gave a container is ``gpu``: its UUID, a time-slice of it, or one of its
    MIG instances (whole or time-sliced)."""
    uuid = device_id.split(REPLICA_SEPARATOR, 1)[0]
    return uuid == gpu.uuid or any(uuid == m.uuid for m in gpu.mig_instances)


def pods_holding(pods: Iterable[pb.PodResources], gpu: GpuDevice) -> list[str]:
    """``namespace/name`` of the pods with a container holding ``gpu``, sorted, each once: from the device plugin
    (its device IDs) or by a DRA claim (the CDI ids the DRA driver answered for it)."""
    return sorted(
        {
            f"{pod.namespace}/{pod.name}"
            for pod in pods
            for container in pod.containers
            if any(holds(d, gpu) for devices in container.devices for d in devices.device_ids)
            or any(
                names_gpu(cdi.name, gpu)
                for claim in container.dynamic_resources
                for resource in claim.claim_resources
                for cdi in resource.cdi_devices
            )
        }
    )


class PodResourcesClient:
    """``GpuPods`` over the kubelet's PodResources API. One connection per question: the question is asked when a
    GPU fails, rarely, and a kubelet restarted in between is met afresh."""

    simulated = False

    def __init__(self, socket: Path, timeout_s: float = LIST_TIMEOUT_S) -> None:
        self.socket = socket
        self.timeout_s = timeout_s

    async def pod_resources(self) -> list[pb.PodResources]:
        """Every pod's resources as the kubelet reports them. Raises ``PodLookupError``."""
        if not self.socket.exists():
            raise PodLookupError(
                f"no kubelet PodResources socket at {self.socket} (mount the kubelet's pod-resources folder, or set "
                "GPUWARDEN_DEVICE_POD_RESOURCES_SOCKET)"
            )
        options = [("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.socket}", options=options) as channel:
                stub = pb_grpc.PodResourcesListerStub(channel)
                response = await stub.List(pb.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise PodLookupError(
                f"kubelet PodResources API at {self.socket}: {exc.code().name}: {exc.details()}"
            ) from None
        return list(response.pod_resources)

    async def pods_using(self, gpu: GpuDevice) -> list[str]:
        return pods_holding(await self.pod_resources(), gpu)

    async def close(self) -> None:
        return None
