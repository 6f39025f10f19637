"""What the node's GPUs are advertised as to the kubelet, and how its requests are answered. Pure: no gRPC here.

- ``advertise``: GPUs -> resource names and device IDs under a MIG strategy, with time-slicing replicas.
- ``preferred``: which devices to give a container (GetPreferredAllocation), preferring GPUs joined by NVLink,
  then GPUs on one NUMA node; deterministic, so the same request gets the same answer.
- ``allocate``: what a container gets (Allocate); unknown or unhealthy IDs are refused, naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from shared.contract.device import GpuDevice

from .config import GPU_RESOURCE, MIG_RESOURCE_PREFIX, DeviceListStrategy, DevicePluginConfig

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
CDI_KIND = "nvidia.com/gpu"
REPLICA_SEPARATOR = "::"
_LISTED = 8


class ResourceError(ValueError):
    """The node's GPUs cannot be advertised under the configured MIG strategy (the message says why and what
    would fix it). The advertisement is left as it was."""


class AllocationError(ValueError):
    """A request from the kubelet that is refused; the message names the IDs at fault."""


@dataclass(frozen=True, slots=True)
class AdvertisedDevice:
    """One device ID the kubelet sees. ``uuid`` is what the container gets (a GPU or MIG UUID); ``gpu_uuid`` the
    physical GPU it lives on; ``replica`` the time-slice, when the resource is shared."""

    id: str
    resource: str
    uuid: str
    gpu_uuid: str
    gpu_index: int
    numa_node: int | None
    nvlink_peers: frozenset[str]
    healthy: bool
    mig: bool = False
    replica: int | None = None

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


Advertisement = dict[str, tuple[AdvertisedDevice, ...]]


def _whole(gpu: GpuDevice, resource: str) -> AdvertisedDevice:
    return AdvertisedDevice(
        id=gpu.uuid,
        resource=resource,
        uuid=gpu.uuid,
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        numa_node=gpu.numa_node,
        nvlink_peers=frozenset(gpu.nvlink_peers),
        healthy=gpu.healthy,
    )


def _slices(gpu: GpuDevice, resource_of: Mapping[str, str]) -> list[AdvertisedDevice]:
    return [
        AdvertisedDevice(
            id=mig.uuid,
            resource=resource_of[mig.profile],
            uuid=mig.uuid,
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            numa_node=gpu.numa_node,
            nvlink_peers=frozenset(),
            healthy=gpu.healthy,
            mig=True,
        )
        for mig in gpu.mig_instances
    ]


def _single(gpus: Sequence[GpuDevice]) -> list[AdvertisedDevice]:
    in_mig = [g for g in gpus if g.mig_enabled]
    if not in_mig:
        return [_whole(g, GPU_RESOURCE) for g in gpus]
    if len(in_mig) != len(gpus):
        whole = ", ".join(str(g.index) for g in gpus if not g.mig_enabled)
        raise ResourceError(
            f"mig_strategy single needs every GPU in MIG mode or none; GPU(s) {whole} are not in MIG mode while "
            f"GPU(s) {', '.join(str(g.index) for g in in_mig)} are (use mig_strategy: mixed, or make them alike)"
        )
    profiles = sorted({m.profile for g in gpus for m in g.mig_instances})
    if len(profiles) > 1:
        raise ResourceError(
            f"mig_strategy single needs one MIG profile on the node; found {', '.join(profiles)} "
            "(use mig_strategy: mixed, or one profile on every GPU)"
        )
    return [d for g in gpus for d in _slices(g, {p: GPU_RESOURCE for p in profiles})]


def _mixed(gpus: Sequence[GpuDevice]) -> list[AdvertisedDevice]:
    out: list[AdvertisedDevice] = []
    for g in gpus:
        if g.mig_enabled:
            out.extend(_slices(g, {m.profile: MIG_RESOURCE_PREFIX + m.profile for m in g.mig_instances}))
        else:
            out.append(_whole(g, GPU_RESOURCE))
    return out


def _replicate(device: AdvertisedDevice, replicas: int) -> list[AdvertisedDevice]:
    if replicas <= 1:
        return [device]
    return [
        AdvertisedDevice(
            id=f"{device.uuid}{REPLICA_SEPARATOR}{k}",
            resource=device.resource,
            uuid=device.uuid,
            gpu_uuid=device.gpu_uuid,
            gpu_index=device.gpu_index,
            numa_node=device.numa_node,
            nvlink_peers=device.nvlink_peers,
            healthy=device.healthy,
            mig=device.mig,
            replica=k,
        )
        for k in range(replicas)
    ]


def advertise(gpus: Sequence[GpuDevice], config: DevicePluginConfig) -> Advertisement:
    """Resource name -> its devices, in GPU index order, then MIG instance order, then replica.

    ``nvidia.com/gpu`` is always present (possibly empty), so its socket stays registered; MIG resources appear
    with their first instance. A MIG instance is as healthy as its GPU. ``ResourceError`` when the strategy
    cannot describe the node (``single`` with GPUs in and out of MIG mode, or with several profiles)."""
    ordered = sorted(gpus, key=lambda g: g.index)
    match config.mig_strategy:
        case "none":
            devices = [_whole(g, GPU_RESOURCE) for g in ordered]
        case "single":
            devices = _single(ordered)
        case "mixed":
            devices = _mixed(ordered)
    out: dict[str, list[AdvertisedDevice]] = {GPU_RESOURCE: []}
    for d in devices:
        out.setdefault(d.resource, []).extend(_replicate(d, config.replicas(d.resource)))
    return {name: tuple(out[name]) for name in sorted(out)}


# -- preferred allocation -----------------------------------------------------------------------------------------
def _listed(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:_LISTED])
    return shown + (f" and {len(ids) - _LISTED} more" if len(ids) > _LISTED else "")


def _unknown(devices: Mapping[str, AdvertisedDevice], ids: Sequence[str], resource: str) -> None:
    unknown = [i for i in ids if i not in devices]
    if unknown:
        raise AllocationError(
            f"unknown device ID(s) for {resource}: {_listed(unknown)} (advertised: {_listed(list(devices)) or 'none'})"
        )


def affinity(a: AdvertisedDevice, b: AdvertisedDevice) -> int:
    """How well two devices go together in one container: slices of one GPU share it (3), GPUs joined by NVLink
    (2) on one NUMA node (+1); two time-slices of one GPU add no compute (-1), so replicas spread out."""
    if a.gpu_uuid == b.gpu_uuid:
        return 3 if a.mig and a.uuid != b.uuid else -1
    score = 2 if (b.gpu_uuid in a.nvlink_peers or a.gpu_uuid in b.nvlink_peers) else 0
    if a.numa_node is not None and a.numa_node == b.numa_node:
        score += 1
    return score


def _score(chosen: Sequence[AdvertisedDevice]) -> int:
    return sum(affinity(a, b) for a, b in combinations(chosen, 2))


def preferred(
    devices: Mapping[str, AdvertisedDevice],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    resource: str = GPU_RESOURCE,
) -> list[str]:
    """``size`` IDs out of ``available``, with every ``must_include`` ID, that go best together (``affinity``).

    Greedy from each possible first device, keeping the best set; ties go to the lowest GPU indexes, so the
    answer depends only on the request. ``AllocationError`` for unknown IDs or a size that cannot be met."""
    _unknown(devices, [*available, *must_include], resource)
    missing = [i for i in must_include if i not in set(available)]
    if missing:
        raise AllocationError(f"must-include device ID(s) not among the available ones: {_listed(missing)}")
    pool_ids = list(dict.fromkeys(available))
    required = list(dict.fromkeys(must_include))
    if size < len(required) or size > len(pool_ids):
        raise AllocationError(
            f"cannot choose {size} device(s) of {resource} from {len(pool_ids)} available "
            f"with {len(required)} that must be included"
        )
    rank = {device_id: n for n, device_id in enumerate(devices)}
    chosen = [devices[i] for i in required]
    rest = sorted((devices[i] for i in pool_ids if i not in set(required)), key=lambda d: rank[d.id])
    if chosen or size == 0:
        seeds: list[AdvertisedDevice | None] = [None]
    else:
        first_per_gpu = {d.gpu_uuid: d for d in reversed(rest)}
        seeds = [*sorted(first_per_gpu.values(), key=lambda d: rank[d.id])]
    best: tuple[tuple[int, tuple[int, ...]], list[AdvertisedDevice]] | None = None
    for seed in seeds:
        picked = [*chosen, *([seed] if seed else [])]
        pool = [d for d in rest if d is not seed]
        while len(picked) < size:
            nxt = max(pool, key=lambda c: (sum(affinity(c, p) for p in picked), -rank[c.id]))
            picked.append(nxt)
            pool.remove(nxt)
        key = (_score(picked), tuple(-r for r in sorted(rank[d.id] for d in picked)))
        if best is None or key > best[0]:
            best = (key, picked)
    assert best is not None
    return [d.id for d in sorted(best[1], key=lambda d: rank[d.id])]


# -- allocate -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container gets: environment variables and CDI device names (``nvidia.com/gpu=<uuid>``)."""

    envs: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


def cdi_name(uuid: str) -> str:
    return f"{CDI_KIND}={uuid}"


def allocate(
    devices: Mapping[str, AdvertisedDevice],
    requests: Sequence[Sequence[str]],
    strategy: DeviceListStrategy,
    resource: str = GPU_RESOURCE,
) -> list[ContainerAllocation]:
    """One allocation per container request. Every request is checked before any answer is made: an unknown,
    repeated or unhealthy ID refuses the whole call (``AllocationError`` naming them). Time-slices of one GPU
    give the container that GPU once."""
    out: list[ContainerAllocation] = []
    for n, ids in enumerate(requests):
        where = f"container request {n}" if len(requests) > 1 else "request"
        if not ids:
            raise AllocationError(f"{where}: no device IDs for {resource}")
        _unknown(devices, ids, resource)
        repeated = sorted({i for i in ids if list(ids).count(i) > 1})
        if repeated:
            raise AllocationError(f"{where}: device ID(s) asked for twice: {_listed(repeated)}")
        sick = [i for i in ids if not devices[i].healthy]
        if sick:
            raise AllocationError(f"{where}: device ID(s) of {resource} are {UNHEALTHY}: {_listed(sick)}")
        uuids = list(dict.fromkeys(devices[i].uuid for i in ids))
        if strategy == "cdi":
            out.append(ContainerAllocation(cdi_devices=tuple(cdi_name(u) for u in uuids)))
        else:
            out.append(ContainerAllocation(envs={VISIBLE_DEVICES_ENV: ",".join(uuids)}))
    return out
