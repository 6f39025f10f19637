"""The node's ResourceSlice from its inventory: a device per whole GPU and per MIG device, with the attributes and
capacities NVIDIA's DRA driver (``gpu.nvidia.com``) publishes, so that a DeviceClass or claim selector written for
it reads ours the same way once its driver name is ours.

A GPU in MIG mode is offered only as its MIG devices (it cannot be handed out whole while it is split), as the
device plugin's ``mixed`` strategy does. What the GPU port does not report is not published rather than guessed:
``architecture`` and ``cudaComputeCapability`` come from the product name for the data-centre GPUs listed in
``PRODUCTS`` and are left out for any other; a MIG device's ``multiprocessors`` likewise, from its profile on the
GPUs in ``MIG_MULTIPROCESSORS``. Version attributes are semantic versions, normalised as NVIDIA's driver does
(``535.104.05`` -> ``535.104.5``, ``12.4`` -> ``12.4.0``), since the API server refuses any other form.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from shared.contract.device import DeviceInventory, GpuDevice, MigInstance
from shared.ports.cluster import DeviceAttribute, DeviceTaint, ResourceSlice, Semver, SliceDevice, TaintEffect

from ..health import GpuHealth

DRIVER_NAME = "gpu.gpuwarden.io"
"""Ours, not NVIDIA's ``gpu.nvidia.com``: a driver name is one kubelet plugin's on a node, and NVIDIA's driver may run
on the same cluster; DeviceClasses select by it (``deploy/dra``)."""

PRODUCTS: Mapping[str, tuple[str, str]] = {
    **dict.fromkeys(("B200", "B100", "GB200"), ("Blackwell", "10.0")),
    **dict.fromkeys(("H100", "H200", "H800", "H20", "GH200"), ("Hopper", "9.0")),
    **dict.fromkeys(("L40S", "L40", "L20", "L4"), ("Ada Lovelace", "8.9")),
    **dict.fromkeys(("A100", "A800", "A30"), ("Ampere", "8.0")),
    **dict.fromkeys(("A40", "A10", "A10G", "A16", "A2"), ("Ampere", "8.6")),
    "T4": ("Turing", "7.5"),
    "V100": ("Volta", "7.0"),
}
"""A word of the product name -> (NVML's architecture name, CUDA compute capability)."""

_GA100_SMS: Mapping[int, int] = {1: 14, 2: 28, 3: 42, 4: 56, 7: 98}
_GH100_SMS: Mapping[int, int] = {1: 16, 2: 32, 3: 60, 4: 64, 7: 132}
MIG_MULTIPROCESSORS: Mapping[str, Mapping[int, int]] = {
    **{word: _GA100_SMS for word in ("A100", "A800")},
    **{word: _GH100_SMS for word in ("H100", "H200", "H800", "H20", "GH200")},
}
"""A word of the product name -> streaming multiprocessors of a MIG device by its compute slices (``<n>g``)."""

XID_TAINT = "gpuwarden.io/xid"
LOST_TAINT = "gpuwarden.io/gpu-lost"
MIG_CHANGING_TAINT = "gpuwarden.io/mig-changing"
"""``NoSchedule`` on every device of the node while the MIG controller changes its layout (after the drain that
saved the sessions on them): no new claim is given a device being torn down, and no running pod is evicted for it."""
FATAL_XIDS: frozenset[int] = frozenset({48, 79, 95})
"""XIDs after which the GPU's work is lost anyway and the GPU needs a reset (a double-bit ECC error, fallen off the
bus, an uncontained ECC error): their taint is ``NoExecute``, so pods holding the device are evicted (gracefully:
their preStop hooks save their sessions); any other critical XID's is ``NoSchedule``."""

_WORD = re.compile(r"[A-Za-z0-9]+")
_NUMBERS = re.compile(r"^[0-9]+(\.[0-9]+){0,2}$")
_PROFILE_SLICES = re.compile(r"^([1-7])g\.")


def semver(text: str) -> Semver | None:
    """``535.104.05`` -> ``535.104.5``; None for what is not one to three dot-separated numbers."""
    text = text.strip()
    if not _NUMBERS.match(text):
        return None
    parts = [str(int(p)) for p in text.split(".")]
    return Semver(".".join(parts + ["0"] * (3 - len(parts))))


def _product_word(model: str, table: Mapping[str, object]) -> str | None:
    return next((w for w in _WORD.findall(model.upper()) if w in table), None)


def product(model: str) -> tuple[str, str] | None:
    """(architecture, compute capability) of a GPU named ``model``; None for a product not in ``PRODUCTS``."""
    word = _product_word(model, PRODUCTS)
    return PRODUCTS[word] if word else None


def mig_multiprocessors(model: str, profile: str) -> int | None:
    word = _product_word(model, MIG_MULTIPROCESSORS)
    slices = _PROFILE_SLICES.match(profile)
    if word is None or slices is None:
        return None
    return MIG_MULTIPROCESSORS[word].get(int(slices.group(1)))


def gpu_device_name(gpu: GpuDevice) -> str:
    return f"gpu-{gpu.index}"


def mig_device_name(gpu: GpuDevice, k: int, mig: MigInstance) -> str:
    """``gpu-<index>-mig-<gpu instance>-<compute instance>`` (NVML's ids, stable across restarts), or
    ``gpu-<index>-mig-<k>`` by position where the GPU port does not give them."""
    if mig.gpu_instance_id is not None and mig.compute_instance_id is not None:
        return f"gpu-{gpu.index}-mig-{mig.gpu_instance_id}-{mig.compute_instance_id}"
    return f"gpu-{gpu.index}-mig-{k}"


def _common(gpu: GpuDevice, inventory: DeviceInventory) -> dict[str, DeviceAttribute]:
    attributes: dict[str, DeviceAttribute] = {"productName": gpu.model}
    known = product(gpu.model)
    if known is not None:
        attributes["architecture"] = known[0]
        capability = semver(known[1])
        if capability is not None:
            attributes["cudaComputeCapability"] = capability
    for name, text in (("driverVersion", inventory.driver_version), ("cudaDriverVersion", inventory.cuda_version)):
        version = semver(text)
        if version is not None:
            attributes[name] = version
    return attributes


def gpu_device(gpu: GpuDevice, inventory: DeviceInventory, taints: Sequence[DeviceTaint] = ()) -> SliceDevice:
    attributes: dict[str, DeviceAttribute] = {"type": "gpu", "uuid": gpu.uuid, "index": gpu.index}
    attributes |= _common(gpu, inventory)
    if gpu.pci_bus_id:
        attributes["pcieBusID"] = gpu.pci_bus_id
    return SliceDevice(
        name=gpu_device_name(gpu),
        attributes=attributes,
        capacity={"memory": f"{gpu.memory_total_mib}Mi"},
        taints=tuple(taints),
    )


def mig_device(
    gpu: GpuDevice, k: int, mig: MigInstance, inventory: DeviceInventory, taints: Sequence[DeviceTaint] = ()
) -> SliceDevice:
    attributes: dict[str, DeviceAttribute] = {
        "type": "mig",
        "uuid": mig.uuid,
        "parentUUID": gpu.uuid,
        "parentIndex": gpu.index,
        "profile": mig.profile,
    }
    attributes |= _common(gpu, inventory)
    capacity = {"memory": f"{mig.memory_mib}Mi"}
    multiprocessors = mig_multiprocessors(gpu.model, mig.profile)
    if multiprocessors is not None:
        capacity["multiprocessors"] = str(multiprocessors)
    if mig.placement_start is not None and mig.placement_size is not None:  # the memory slices it occupies
        for i in range(mig.placement_start, mig.placement_start + mig.placement_size):
            capacity[f"memorySlice{i}"] = "1"
    return SliceDevice(
        name=mig_device_name(gpu, k, mig), attributes=attributes, capacity=capacity, taints=tuple(taints)
    )


def health_taints(health: Mapping[str, GpuHealth], xids: Mapping[str, int]) -> dict[str, tuple[DeviceTaint, ...]]:
    """By GPU UUID, the taints its health puts on its devices: ``gpuwarden.io/gpu-lost`` (``NoExecute``) on a lost
    GPU, ``gpuwarden.io/xid=<code>`` on an unhealthy one (``xids``: the critical XID that took it out; no value
    when unknown); a healthy GPU has none, so a recovered GPU loses its taint."""
    taints: dict[str, tuple[DeviceTaint, ...]] = {}
    for uuid, state in health.items():
        if state == "lost":
            taints[uuid] = (DeviceTaint(LOST_TAINT, "", "NoExecute"),)
        elif state == "unhealthy":
            xid = xids.get(uuid)
            effect: TaintEffect = "NoExecute" if xid in FATAL_XIDS else "NoSchedule"
            taints[uuid] = (DeviceTaint(XID_TAINT, str(xid) if xid else "", effect),)
    return taints


def node_slice(
    inventory: DeviceInventory,
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    driver: str = DRIVER_NAME,
) -> ResourceSlice:
    """The slice of every GPU of ``inventory`` (its MIG devices for a GPU in MIG mode), in index order; the pool is
    the node. ``taints``: by GPU UUID, put on the GPU's device or on each of its MIG devices."""
    taints = taints or {}
    devices: list[SliceDevice] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        on_gpu = taints.get(gpu.uuid, ())
        if gpu.mig_enabled:
            devices.extend(mig_device(gpu, k, m, inventory, on_gpu) for k, m in enumerate(gpu.mig_instances))
        else:
            devices.append(gpu_device(gpu, inventory, on_gpu))
    return ResourceSlice(driver=driver, node=inventory.node, pool=inventory.node, devices=tuple(devices))


def devices_by_name(inventory: DeviceInventory) -> dict[str, tuple[GpuDevice, MigInstance | None]]:
    """Each slice device's name -> its GPU and, for a MIG device, its instance: what a claim's results name."""
    found: dict[str, tuple[GpuDevice, MigInstance | None]] = {}
    for gpu in inventory.gpus:
        if gpu.mig_enabled:
            for k, mig in enumerate(gpu.mig_instances):
                found[mig_device_name(gpu, k, mig)] = (gpu, mig)
        else:
            found[gpu_device_name(gpu)] = (gpu, None)
    return found
