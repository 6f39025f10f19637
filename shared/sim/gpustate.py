"""A simulated node's GPUs and driver as one value, and the pure rules that change and read it.

``SimNodeState`` is what the simulation stores per node (``shared.sim.gpustore`` keeps it in Redis): the GPUs the
node spec describes, their MIG layout, the installed driver and the faults injected into it. The rules here make
it from the spec, change it (MIG mode and instances, refusing what a GPU cannot do), and read it the way NVML
would (devices, utilisation samples from a load, driver validation). Pure: no Redis, no clock.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from typing import Literal

import msgspec

from shared.contract.device import GpuDevice, MigInstance
from shared.ports.gpu import DriverValidation, GpuError, GpuUtilisation, MigProfile
from shared.sim.spec import SimSpec, SpecError

MIG_COMPUTE_SLICES = 7
MIG_PROFILE_RE = re.compile(r"^(?P<slices>[1-7])g\.(?P<gb>[1-9][0-9]*)gb(?:\+me)?$")
DRIVER_VERSION_RE = re.compile(r"^[0-9]{3}(\.[0-9]{1,3}){1,2}$")
IDLE_POWER_W = 70.0
IDLE_TEMPERATURE_C = 35.0

# The highest CUDA version each driver branch supports (what NVML and nvidia-smi report as "CUDA Version").
CUDA_BY_DRIVER_BRANCH: dict[int, str] = {
    525: "12.0",
    530: "12.1",
    535: "12.2",
    545: "12.3",
    550: "12.4",
    555: "12.5",
    560: "12.6",
    565: "12.7",
    570: "12.8",
    575: "12.9",
    580: "13.0",
}

_UUID_NAMESPACE = uuidlib.UUID("5b0c1d2e-7f1a-4c55-9a59-6770756172de")


class SimGpu(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated GPU as stored in Redis. ``mig_profiles`` empty means not MIG-capable."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    pci_bus_id: str
    numa_node: int
    nvlink_peers: list[str] = msgspec.field(default_factory=list)
    mig_profiles: list[str] = msgspec.field(default_factory=list)
    mig_enabled: bool = False
    mig_instances: list[MigInstance] = msgspec.field(default_factory=list)
    next_instance: int = 0
    lost: bool = False
    copy_slowdown: float = 1.0


InstallFault = Literal["", "fail", "hang"]
MigFault = Literal["", "fail", "hang"]


class SimNodeState(msgspec.Struct, frozen=True, kw_only=True):
    """A simulated node's GPUs and driver. ``install_fault`` persists until cleared: every install fails or hangs.
    ``mig_fault`` likewise for every MIG change (mode, create, destroy)."""

    node: str
    driver_version: str
    cuda_version: str
    gpus: list[SimGpu]
    install_fault: InstallFault = ""
    install_fault_reason: str = ""
    mig_fault: MigFault = ""
    mig_fault_reason: str = ""

    def gpu(self, uuid: str) -> SimGpu:
        """The GPU with ``uuid``, lost or not; ``GpuError`` when the node has none."""
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise GpuError(f"{self.node}: no GPU {uuid!r} (GPUs: {', '.join(g.uuid for g in self.gpus)})")

    def visible(self, uuid: str) -> SimGpu:
        """The GPU with ``uuid`` if it has not been lost; NVML answers "GPU is lost" for a lost one."""
        g = self.gpu(uuid)
        if g.lost:
            raise GpuError(f"{self.node}: GPU {g.index} ({uuid}) is lost")
        return g

    def replace_gpu(self, gpu: SimGpu) -> SimNodeState:
        return msgspec.structs.replace(self, gpus=[gpu if g.uuid == gpu.uuid else g for g in self.gpus])


class SimLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the simulated workload puts on one GPU: percentages 0-100 and MiB."""

    util: float = 0.0
    mem_used_mib: float = 0.0
    copy_util: float = 0.0


# -- pure rules ---------------------------------------------------------------------------------------------------
def gpu_uuid(root: str, node: str, index: int) -> str:
    """Deterministic: every process (and every run) names a simulated GPU the same way."""
    return "GPU-" + str(uuidlib.uuid5(_UUID_NAMESPACE, f"{root}/{node}/{index}"))


def mig_profile_slices(profile: str) -> tuple[int, int]:
    """``"3g.40gb"`` is ``(3, 40)``: compute slices out of 7, and memory in GB. ``ValueError`` for anything else."""
    match = MIG_PROFILE_RE.match(profile)
    if not match:
        raise ValueError(f"{profile!r} is not a MIG profile such as '1g.10gb' or '3g.40gb'")
    return int(match["slices"]), int(match["gb"])


MIG_PLACEMENTS: dict[int, tuple[int, tuple[int, ...]]] = {
    1: (1, (0, 1, 2, 3, 4, 5, 6)),
    2: (2, (0, 2, 4)),
    3: (4, (0, 4)),
    4: (4, (0,)),
    7: (8, (0,)),
}
"""By compute slices: the memory slices (of 8) a GPU instance occupies and where it may start, as on an A100 or
H100 (NVML's ``nvmlDeviceGetGpuInstancePossiblePlacements``)."""


def mig_placement(slices: int, taken: set[int]) -> tuple[int, int] | None:
    """The first placement (start, size) of a ``slices``-slice instance whose memory slices are all free; None when
    none is (or the profile has no placement table here)."""
    size, starts = MIG_PLACEMENTS.get(slices, (0, ()))
    for start in starts:
        if not taken & set(range(start, start + size)):
            return start, size
    return None


def mig_profile(profile: str, gpu_memory_mib: int) -> MigProfile:
    """What a simulated GPU offers for ``profile``: a media-extension profile (``+me``) once per GPU, the others
    as many times as their compute slices fit in 7."""
    slices, gb = mig_profile_slices(profile)
    count = 1 if profile.endswith("+me") else MIG_COMPUTE_SLICES // slices
    return MigProfile(name=profile, slices=slices, max_count=count, memory_mib=min(gb * 1024, gpu_memory_mib))


def check_spec(spec: SimSpec) -> None:
    """Refuse a spec whose MIG profiles cannot exist; the error names the field."""
    for i, node in enumerate(spec.nodes):
        for j, group in enumerate(node.gpus):
            for k, profile in enumerate(group.mig_profiles):
                try:
                    mig_profile_slices(profile)
                except ValueError as exc:
                    raise SpecError(f"$.nodes[{i}].gpus[{j}].mig_profiles[{k}]: {exc}") from None


def pci_bus_id(index: int) -> str:
    return f"{index // 14:08X}:{0x18 + 0x10 * (index % 14):02X}:00.0"


def cuda_for_driver(driver_version: str, fallback: str) -> str:
    try:
        branch = int(driver_version.split(".")[0])
    except ValueError:
        return fallback
    return CUDA_BY_DRIVER_BRANCH.get(branch, fallback)


def initial_state(spec: SimSpec, node: str, root: str) -> SimNodeState:
    """The node's GPUs as the spec describes them: indexes in spec order, NUMA nodes spread evenly, NVLink
    between the GPUs of one spec entry that has ``nvlink``."""
    node_spec = spec.node(node)
    total = node_spec.gpu_count
    gpus: list[SimGpu] = []
    index = 0
    for group in node_spec.gpus:
        members = [gpu_uuid(root, node, index + k) for k in range(group.count)]
        for k in range(group.count):
            gpus.append(
                SimGpu(
                    index=index,
                    uuid=members[k],
                    model=group.model,
                    memory_mib=group.memory_mib,
                    pci_bus_id=pci_bus_id(index),
                    numa_node=index * node_spec.numa_nodes // total,
                    nvlink_peers=[u for u in members if u != members[k]] if group.nvlink else [],
                    mig_profiles=list(group.mig_profiles),
                )
            )
            index += 1
    driver = node_spec.driver_version or spec.driver_version
    cuda = spec.cuda_version if driver == spec.driver_version else cuda_for_driver(driver, spec.cuda_version)
    return SimNodeState(node=node, driver_version=driver, cuda_version=cuda, gpus=gpus)


def as_device(gpu: SimGpu, lost: frozenset[str] = frozenset()) -> GpuDevice:
    return GpuDevice(
        index=gpu.index,
        uuid=gpu.uuid,
        model=gpu.model,
        pci_bus_id=gpu.pci_bus_id,
        memory_total_mib=gpu.memory_mib,
        numa_node=gpu.numa_node,
        nvlink_peers=[p for p in gpu.nvlink_peers if p not in lost],
        mig_capable=bool(gpu.mig_profiles),
        mig_enabled=gpu.mig_enabled,
        mig_instances=list(gpu.mig_instances),
    )


def tdp_watts(model: str) -> float:
    """Board power limit by model name; 300 W for models this table does not know."""
    name = model.upper()
    pcie = "PCIE" in name
    if "H100" in name or "H200" in name or "B200" in name:
        return 350.0 if pcie else 700.0
    if "A100" in name:
        return 300.0 if pcie else 400.0
    if "L40" in name:
        return 350.0
    if "L4" in name:
        return 72.0
    return 300.0


def sample(gpu: SimGpu, load: SimLoad) -> GpuUtilisation:
    """Deterministic in the load: power rises linearly from 70 W idle to the TDP, temperature from 35 °C by
    0.5 °C per percent, and slow copies keep the copy engines busy ``copy_slowdown`` times longer."""
    util = min(max(load.util, 0.0), 100.0)
    used = min(max(load.mem_used_mib, 0.0), float(gpu.memory_mib))
    tdp = tdp_watts(gpu.model)
    return GpuUtilisation(
        uuid=gpu.uuid,
        gpu_util=util,
        mem_copy_util=min(max(load.copy_util, 0.0) * gpu.copy_slowdown, 100.0),
        mem_used_mib=used,
        mem_free_mib=float(gpu.memory_mib) - used,
        power_w=IDLE_POWER_W + util / 100.0 * max(tdp - IDLE_POWER_W, 0.0),
        temperature_c=IDLE_TEMPERATURE_C + 0.5 * util,
    )


def with_mig_mode(state: SimNodeState, uuid: str, enabled: bool) -> SimNodeState:
    gpu = state.visible(uuid)
    if not gpu.mig_profiles:
        raise GpuError(f"{state.node}: GPU {gpu.index} ({gpu.model}) is not MIG-capable (no mig_profiles in the spec)")
    if gpu.mig_enabled == enabled:
        return state
    if not enabled and gpu.mig_instances:
        raise GpuError(
            f"{state.node}: GPU {gpu.index} still has {len(gpu.mig_instances)} MIG instance(s); destroy them before "
            "disabling MIG mode"
        )
    return state.replace_gpu(msgspec.structs.replace(gpu, mig_enabled=enabled))


def with_mig_instance(state: SimNodeState, uuid: str, profile: str) -> tuple[SimNodeState, MigInstance]:
    """Add an instance of ``profile``: the profile must be one the spec allows and its compute slices must fit
    in what the GPU's other instances leave of the 7."""
    gpu = state.visible(uuid)
    if not gpu.mig_profiles:
        raise GpuError(f"{state.node}: GPU {gpu.index} ({gpu.model}) is not MIG-capable (no mig_profiles in the spec)")
    if not gpu.mig_enabled:
        raise GpuError(f"{state.node}: GPU {gpu.index} is not in MIG mode; enable MIG mode first")
    if profile not in gpu.mig_profiles:
        raise GpuError(
            f"{state.node}: MIG profile {profile!r} is not allowed on GPU {gpu.index} "
            f"(allowed: {', '.join(gpu.mig_profiles)})"
        )
    slices, gb = mig_profile_slices(profile)
    used = sum(mig_profile_slices(i.profile)[0] for i in gpu.mig_instances)
    if used + slices > MIG_COMPUTE_SLICES:
        raise GpuError(
            f"{state.node}: no room for {profile} on GPU {gpu.index}: {used} of {MIG_COMPUTE_SLICES} compute slices "
            f"are in use, {profile} needs {slices}"
        )
    taken = {
        i
        for other in gpu.mig_instances
        if other.placement_start is not None and other.placement_size is not None
        for i in range(other.placement_start, other.placement_start + other.placement_size)
    }
    placed = mig_placement(slices, taken)  # None: no start is free in this order; the instance is still made
    instance = MigInstance(
        uuid="MIG-" + str(uuidlib.uuid5(_UUID_NAMESPACE, f"{gpu.uuid}/{gpu.next_instance}")),
        profile=profile,
        memory_mib=min(gb * 1024, gpu.memory_mib),
        gpu_instance_id=gpu.next_instance + 1,
        compute_instance_id=0,
        placement_start=placed[0] if placed else None,
        placement_size=placed[1] if placed else None,
    )
    changed = msgspec.structs.replace(
        gpu, mig_instances=[*gpu.mig_instances, instance], next_instance=gpu.next_instance + 1
    )
    return state.replace_gpu(changed), instance


def without_mig_instance(state: SimNodeState, uuid: str, instance_uuid: str) -> SimNodeState:
    gpu = state.visible(uuid)
    remaining = [i for i in gpu.mig_instances if i.uuid != instance_uuid]
    if len(remaining) == len(gpu.mig_instances):
        known = ", ".join(i.uuid for i in gpu.mig_instances) or "none"
        raise GpuError(f"{state.node}: GPU {gpu.index} has no MIG instance {instance_uuid!r} (instances: {known})")
    return state.replace_gpu(msgspec.structs.replace(gpu, mig_instances=remaining))


def validation(state: SimNodeState, expected_version: str) -> DriverValidation:
    """OK only when the installed version is the expected one and no GPU is lost (nvidia-smi fails on a lost
    GPU, so a node with one never validates)."""
    visible = sum(1 for g in state.gpus if not g.lost)
    if state.driver_version != expected_version:
        return DriverValidation(
            ok=False,
            version=state.driver_version,
            visible_gpus=visible,
            reason=f"driver {state.driver_version} is installed, {expected_version} was expected",
        )
    lost = [f"GPU {g.index} ({g.uuid})" for g in state.gpus if g.lost]
    if lost:
        return DriverValidation(
            ok=False, version=state.driver_version, visible_gpus=visible, reason=f"lost: {', '.join(lost)}"
        )
    return DriverValidation(ok=True, version=state.driver_version, visible_gpus=visible)
