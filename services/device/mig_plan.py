"""The MIG planner: from the GPUs as they are, the profiles each offers and the layout a node's label chooses, the
changes that give the GPUs that layout, or a refusal with its reason. Pure: no I/O, no clock; the controller
(``services.device.mig``) reads the GPUs and the document, asks the drain, and applies the steps.

Desired layouts live in the ``mig`` configuration document (NVIDIA mig-parted's ``mig-configs`` shape). ``plan``
refuses (``LayoutRefused``) a layout that does not fit the node: a GPU index out of range, a GPU without MIG, a
profile the GPU does not offer, more instances or compute slices than the GPU holds. A refused layout changes
nothing. A GPU whose instances differ from the layout in any way has all of them destroyed and the layout created
afresh, largest first (as mig-parted does: keeping some instances can leave the free slices too scattered for the
rest); a GPU that already matches is left alone, and GPUs no entry names are never touched. Profiles are checked
when the GPU port lists them; without them only the compute slices are counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shared.contract.configdocs import MigConfig, MigDeviceGroup
from shared.contract.device import GpuDevice
from shared.ports.gpu import MigProfile

CONFIG_DOCUMENT = "mig"
MIG_COMPUTE_SLICES = 7


class LayoutRefused(ValueError):
    """The layout cannot be applied to this node; the message says why. Nothing has been changed."""


@dataclass(frozen=True, slots=True)
class MigStep:
    """One change to one GPU, as the GPU port makes it."""

    action: Literal["enable", "disable", "destroy", "create"]
    gpu_uuid: str
    gpu_index: int
    profile: str = ""
    instance_uuid: str = ""

    def __str__(self) -> str:
        if self.action == "destroy":
            return f"GPU {self.gpu_index}: destroy {self.profile or 'MIG instance'} {self.instance_uuid}"
        if self.action == "create":
            return f"GPU {self.gpu_index}: create {self.profile}"
        return f"GPU {self.gpu_index}: {self.action} MIG mode"


def layout(doc: MigConfig, name: str) -> list[MigDeviceGroup]:
    """The entries of the layout ``name``; ``LayoutRefused`` naming the known layouts when there is none."""
    found = doc.mig_configs.get(name)
    if found is None:
        known = ", ".join(sorted(doc.mig_configs)) or "none"
        raise LayoutRefused(f"no layout {name!r} in the {CONFIG_DOCUMENT!r} configuration document (layouts: {known})")
    return found


def _profile_slices(profile: str) -> int:
    return int(profile.split("g.", 1)[0])


def _select(
    name: str, groups: Sequence[MigDeviceGroup], gpus: Sequence[GpuDevice]
) -> dict[int, tuple[int, MigDeviceGroup]]:
    """GPU index -> the entry that covers it, and its position. A GPU named by two entries, or an index the node
    lacks, refuses."""
    indexes = sorted(g.index for g in gpus)
    chosen: dict[int, tuple[int, MigDeviceGroup]] = {}
    for k, group in enumerate(groups):
        covered = indexes if group.devices == "all" else list(group.devices)
        for index in covered:
            if index not in indexes:
                have = ", ".join(map(str, indexes)) or "none"
                raise LayoutRefused(f"{name}[{k}].devices: GPU index {index} is not on this node (GPUs: {have})")
            if index in chosen:
                raise LayoutRefused(
                    f"{name}[{k}].devices: GPU {index} is already covered by {name}[{chosen[index][0]}]"
                )
            chosen[index] = (k, group)
    return chosen


def _check_fit(where: str, gpu: GpuDevice, wanted: Counter[str], offered: Sequence[MigProfile]) -> None:
    """Refuses a layout that cannot exist on ``gpu``: not MIG-capable, a profile it lacks, too many of one
    profile, or more compute slices than it has. Without ``offered`` only the slice count is checked."""
    label = f"GPU {gpu.index} ({gpu.model})"
    if not gpu.mig_capable:
        raise LayoutRefused(f"{where}: {label} is not MIG-capable")
    if not offered:
        needed = sum(_profile_slices(p) * n for p, n in wanted.items())
        if needed > MIG_COMPUTE_SLICES:
            raise LayoutRefused(f"{where}: {label}: the layout needs {needed} compute slices, a GPU has at most 7")
        return
    by_name = {p.name: p for p in offered}
    for profile, count in sorted(wanted.items()):
        found = by_name.get(profile)
        if found is None:
            raise LayoutRefused(
                f"{where}.mig-devices: {label} has no MIG profile {profile!r} (it offers: {', '.join(by_name)})"
            )
        if count > found.max_count:
            raise LayoutRefused(
                f"{where}.mig-devices: {label}: {count} x {profile} asked for, at most {found.max_count} fit"
            )
    capacity = max(p.slices * p.max_count for p in offered)
    needed = sum(by_name[p].slices * n for p, n in wanted.items())
    if needed > capacity:
        raise LayoutRefused(
            f"{where}.mig-devices: {label}: the layout needs {needed} compute slices, the GPU has {capacity}"
        )


def _gpu_steps(gpu: GpuDevice, group: MigDeviceGroup, slices: Mapping[str, int]) -> list[MigStep]:
    def step(action: Literal["enable", "disable", "destroy", "create"], **more: str) -> MigStep:
        return MigStep(action=action, gpu_uuid=gpu.uuid, gpu_index=gpu.index, **more)

    destroy_all = [step("destroy", profile=i.profile, instance_uuid=i.uuid) for i in gpu.mig_instances]
    if not group.mig_enabled:
        return [*destroy_all, step("disable")] if gpu.mig_capable and gpu.mig_enabled else []
    wanted = Counter({p: n for p, n in group.mig_devices.items() if n > 0})
    if gpu.mig_enabled and Counter(i.profile for i in gpu.mig_instances) == wanted:
        return []
    largest_first = sorted(wanted, key=lambda p: (-slices.get(p, _profile_slices(p)), p))
    create = [step("create", profile=p) for p in largest_first for _ in range(wanted[p])]
    return [*destroy_all, *create] if gpu.mig_enabled else [step("enable"), *create]


def plan(
    name: str,
    groups: Sequence[MigDeviceGroup],
    gpus: Sequence[GpuDevice],
    profiles: Mapping[str, Sequence[MigProfile]],
) -> list[MigStep]:
    """The changes that give ``gpus`` the layout ``name`` (``groups``), in order; empty when they already have it.

    ``profiles`` maps a GPU's UUID to the profiles it offers (absent or empty: unknown). Every GPU is checked
    before any step is given: ``LayoutRefused`` says what does not fit, and then nothing is to be done. Pure."""
    by_index = {g.index: g for g in gpus}
    selected = sorted(_select(name, groups, gpus).items())
    for index, (k, group) in selected:
        gpu = by_index[index]
        if group.mig_enabled:
            wanted = Counter({p: n for p, n in group.mig_devices.items() if n > 0})
            _check_fit(f"{name}[{k}]", gpu, wanted, profiles.get(gpu.uuid, ()))
    steps: list[MigStep] = []
    for index, (_k, group) in selected:
        gpu = by_index[index]
        slices = {p.name: p.slices for p in profiles.get(gpu.uuid, ())}
        steps.extend(_gpu_steps(gpu, group, slices))
    return steps
