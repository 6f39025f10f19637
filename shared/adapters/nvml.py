"""The GPU port on NVML (nvidia-ml-py, module ``pynvml``): the real adapter (``simulated = False``).

The nvml module is a constructor parameter so tests can hand in a small fake with the same functions. Every NVML
failure becomes a ``GpuError`` that says which call failed and why; a GPU that answers "GPU is lost" leaves
``devices()`` and ``utilisation()`` and is reported once on ``health_events()`` as ``kind="lost"``.

Driver installs run the node's own command (``shared.adapters.driverinstall``); the caller validates afterwards
with ``validate_driver``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from shared.adapters.driverinstall import install_driver
from shared.adapters.nvmlhealth import NvmlHealthWatch, is_gpu_lost, is_nvml_error, nvml_code
from shared.contract.device import GpuDevice, MigInstance
from shared.plumbing.replies import as_text
from shared.ports.gpu import (
    DriverValidation,
    DriverVersions,
    GpuError,
    GpuHealthEvent,
    GpuUtilisation,
    MigProfile,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MIB = 1024 * 1024
_MIG_PROFILE_RE = re.compile(r"MIG\s+(\S+)\s*$")

# What NVIDIA's profile names append for the GPU instance profiles that are not the plain one of their size.
_PROFILE_SUFFIXES: dict[str, str] = {
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": "+me",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": "+me",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME": "-me",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME": "-me",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME": "+me.all",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME": "+me.all",
}
_GI_PROFILE_COUNT = 0x12


def cuda_version_text(raw: int) -> str:
    """NVML's CUDA driver version integer (12040) as text ("12.4")."""
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def normalise_bus_id(raw: str | bytes) -> str:
    """PCI bus ids in one form: NVML writes the domain with 8 or 4 hex digits depending on the call."""
    text = as_text(raw)
    text = text.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        return text
    try:
        return f"{int(domain, 16):08x}:{rest}"
    except ValueError:
        return text


def mig_profile_name(slices: int, memory_mib: int, total_mib: int, suffix: str = "") -> str:
    """NVIDIA's name for a GPU instance profile, for drivers that do not give it: the instance's share of the
    GPU's memory rounded up to eighths, times the GPU's memory in whole GB (``1g.10gb`` on an 80 GB GPU)."""
    eighths = -(-memory_mib * 8 // max(total_mib, 1))
    total_gb = -(-total_mib // 1024)
    return f"{slices}g.{int(eighths * total_gb / 8 + 0.5)}gb{suffix}"


class NvmlGpus:
    """The GPU port for this node's GPUs, on NVML.

    NVML is initialised on first use (``open()``); the number of GPUs seen then is what ``validate_driver``
    compares against. ``health_events()`` comes from ``NvmlHealthWatch`` (``shared.adapters.nvmlhealth``): a
    thread that waits on an NVML event set for critical XID errors and polls the GPUs for "GPU is lost".
    """

    simulated = False

    def __init__(
        self,
        nvml: Any = None,
        *,
        install_command: str | None = None,
        event_wait_ms: int = 500,
    ) -> None:
        self._nvml_arg = nvml
        self._nvml: Any = None
        self._install_command = install_command
        self._open = False
        self._closed = False
        self._initial_count = 0
        self._health = NvmlHealthWatch(event_wait_ms)

    def __repr__(self) -> str:
        return f"NvmlGpus(open={self._open}, gpus_at_open={self._initial_count})"

    # -- NVML plumbing --------------------------------------------------------------------------------------------
    def _module(self) -> Any:
        if self._nvml is None:
            if self._nvml_arg is not None:
                self._nvml = self._nvml_arg
            else:
                try:
                    import pynvml
                except ImportError as exc:
                    raise GpuError(
                        f"NVML is not available on this node: nvidia-ml-py is not installed ({exc})"
                    ) from exc
                self._nvml = pynvml
        return self._nvml

    def _is_nvml_error(self, exc: BaseException) -> bool:
        return is_nvml_error(self._nvml, exc)

    def _is_lost(self, exc: BaseException) -> bool:
        return is_gpu_lost(self._nvml, exc)

    def open_sync(self) -> None:
        """Initialise NVML (idempotent); ``GpuError`` when NVML is missing or refuses."""
        if self._open:
            return
        if self._closed:
            raise GpuError("the NVML GPU adapter is closed")
        nvml = self._module()
        try:
            nvml.nvmlInit()
            self._initial_count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            if self._is_nvml_error(exc) or isinstance(exc, OSError):
                raise GpuError(f"NVML is not available on this node: {type(exc).__name__}: {exc}") from exc
            raise
        self._open = True
        log.info("NVML initialised", extra={"gpus": self._initial_count})

    async def open(self) -> None:
        self.open_sync()

    def _call(self, what: str, fn: Callable[..., T], *args: Any, uuid: str = "") -> T:
        """One NVML call; an NVML failure becomes ``GpuError`` (and "GPU is lost" is reported on the health stream)."""
        try:
            return fn(*args)
        except Exception as exc:
            if not self._is_nvml_error(exc):
                raise
            if self._is_lost(exc) and uuid:
                self._health.report_lost(uuid, f"{what}: {exc}")
            where = f" on GPU {uuid}" if uuid else ""
            raise GpuError(f"NVML {what}{where} failed: {exc}") from exc

    def _handles(self) -> list[tuple[int, str, Any]]:
        """(index, uuid, handle) of every GPU that answers; lost ones are reported and left out."""
        self.open_sync()
        nvml = self._nvml
        count = int(self._call("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount))
        found: list[tuple[int, str, Any]] = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = as_text(nvml.nvmlDeviceGetUUID(handle))
            except Exception as exc:
                if self._is_lost(exc):
                    log.warning("GPU is lost", extra={"index": index, "error": str(exc)})
                    self._health.report_lost(f"index:{index}", f"nvmlDeviceGetHandleByIndex({index}): {exc}")
                    continue
                if self._is_nvml_error(exc):
                    raise GpuError(f"NVML could not open GPU {index}: {exc}") from exc
                raise
            if self._health.reported_lost(uuid):
                continue
            found.append((index, uuid, handle))
        return found

    def _handle(self, uuid: str) -> Any:
        self.open_sync()
        if self._health.reported_lost(uuid):
            raise GpuError(f"GPU {uuid} is lost")
        return self._call("nvmlDeviceGetHandleByUUID", self._nvml.nvmlDeviceGetHandleByUUID, uuid, uuid=uuid)

    # -- inventory and samples ------------------------------------------------------------------------------------
    def _devices(self) -> list[GpuDevice]:
        nvml = self._nvml_after_open()
        handles = self._handles()
        bus_ids: dict[str, str] = {}
        records: list[dict[str, Any]] = []
        for index, uuid, h in handles:
            try:
                name = as_text(self._call("nvmlDeviceGetName", nvml.nvmlDeviceGetName, h, uuid=uuid))
                bus = normalise_bus_id(
                    self._call("nvmlDeviceGetPciInfo", nvml.nvmlDeviceGetPciInfo, h, uuid=uuid).busId
                )
                memory = self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, h, uuid=uuid)
            except GpuError:
                if self._health.reported_lost(uuid):
                    continue
                raise
            bus_ids[bus] = uuid
            records.append(
                {
                    "index": index,
                    "uuid": uuid,
                    "model": name,
                    "pci_bus_id": bus,
                    "memory_total_mib": int(memory.total) // MIB,
                    "numa_node": self._numa_node(h),
                    "handle": h,
                }
            )
        devices: list[GpuDevice] = []
        for r in records:
            h = r.pop("handle")
            capable, enabled = self._mig_mode(h)
            devices.append(
                GpuDevice(
                    **r,
                    nvlink_peers=self._nvlink_peers(h, r["uuid"], bus_ids),
                    mig_capable=capable,
                    mig_enabled=enabled,
                    mig_instances=self._mig_instances(h) if enabled else [],
                )
            )
        return devices

    def _nvml_after_open(self) -> Any:
        self.open_sync()
        return self._nvml

    def _numa_node(self, h: Any) -> int | None:
        fn = getattr(self._nvml, "nvmlDeviceGetNumaNodeId", None)
        if fn is None:
            return None
        try:
            node = int(fn(h))
        except Exception as exc:
            if self._is_nvml_error(exc):
                return None
            raise
        return node if node >= 0 else None

    def _nvlink_peers(self, h: Any, uuid: str, bus_ids: dict[str, str]) -> list[str]:
        nvml = self._nvml
        enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        peers: list[str] = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nvml.nvmlDeviceGetNvLinkState(h, link) != enabled:
                    continue
                remote = normalise_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except Exception as exc:
                if self._is_nvml_error(exc):
                    continue
                raise
            peer = bus_ids.get(remote)
            if peer is not None and peer != uuid and peer not in peers:
                peers.append(peer)
        return peers

    def _mig_mode(self, h: Any) -> tuple[bool, bool]:
        try:
            current, _pending = self._nvml.nvmlDeviceGetMigMode(h)
        except Exception as exc:
            if self._is_nvml_error(exc):
                return False, False
            raise
        return True, current == getattr(self._nvml, "NVML_DEVICE_MIG_ENABLE", 1)

    def _mig_instances(self, h: Any) -> list[MigInstance]:
        nvml = self._nvml
        instances: list[MigInstance] = []
        try:
            count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(h))
        except Exception as exc:
            if self._is_nvml_error(exc):
                return []
            raise
        for i in range(count):
            try:
                mh = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
                mig_uuid = as_text(nvml.nvmlDeviceGetUUID(mh))
                memory = int(nvml.nvmlDeviceGetMemoryInfo(mh).total) // MIB
            except Exception as exc:
                if self._is_nvml_error(exc):
                    continue  # an empty slot answers NOT_FOUND
                raise
            profile = ""
            with contextlib.suppress(Exception):
                # MIG devices are named "<GPU name> MIG 1g.10gb"; the cheapest way to the profile.
                match = _MIG_PROFILE_RE.search(as_text(nvml.nvmlDeviceGetName(mh)))
                profile = match.group(1) if match else ""
            gi_id, ci_id = self._instance_ids(mh)
            start, size = self._placement(h, gi_id)
            instances.append(
                MigInstance(
                    uuid=mig_uuid,
                    profile=profile,
                    memory_mib=memory,
                    gpu_instance_id=gi_id,
                    compute_instance_id=ci_id,
                    placement_start=start,
                    placement_size=size,
                )
            )
        return instances

    def _placement(self, h: Any, gi_id: int | None) -> tuple[int | None, int | None]:
        """The memory slices a GPU instance occupies (start, size); (None, None) where the driver does not say."""
        if gi_id is None:
            return None, None
        try:
            gi = self._nvml.nvmlDeviceGetGpuInstanceById(h, gi_id)
            placement = self._nvml.nvmlGpuInstanceGetInfo(gi).placement
            return int(placement.start), int(placement.size)
        except Exception as exc:
            if self._is_nvml_error(exc) or isinstance(exc, AttributeError):
                return None, None  # an older driver or binding: the slice then lists no memorySlice capacities
            raise

    def _instance_ids(self, mh: Any) -> tuple[int | None, int | None]:
        """A MIG device's GPU and compute instance ids; None for one the driver does not answer (the CDI spec then
        lacks its capability nodes, which is logged there, rather than the inventory lacking the device)."""
        ids: list[int | None] = []
        for name in ("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId"):
            try:
                ids.append(int(getattr(self._nvml, name)(mh)))
            except Exception as exc:
                if not self._is_nvml_error(exc):
                    raise
                ids.append(None)
        return ids[0], ids[1]

    async def devices(self) -> list[GpuDevice]:
        return await asyncio.to_thread(self._devices)

    def _versions(self) -> DriverVersions:
        nvml = self._nvml_after_open()
        driver = as_text(self._call("nvmlSystemGetDriverVersion", nvml.nvmlSystemGetDriverVersion))
        cuda = int(self._call("nvmlSystemGetCudaDriverVersion_v2", nvml.nvmlSystemGetCudaDriverVersion_v2))
        return DriverVersions(driver=driver, cuda=cuda_version_text(cuda))

    async def versions(self) -> DriverVersions:
        return await asyncio.to_thread(self._versions)

    def _reading(self, what: str, fn: Callable[..., T], *args: Any, uuid: str = "") -> T | None:
        """One NVML reading that a GPU may not offer (utilisation of a GPU in MIG mode, power on some boards):
        None when NVML says NOT_SUPPORTED, so the sample says "unknown" instead of failing for every GPU."""
        try:
            return fn(*args)
        except Exception as exc:
            unsupported = getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
            if self._is_nvml_error(exc) and nvml_code(exc) == unsupported:
                return None
        return self._call(what, fn, *args, uuid=uuid)

    def _utilisation(self) -> list[GpuUtilisation]:
        """A value a GPU does not offer is NaN (the metrics sources treat it as missing, never as 0)."""
        nvml = self._nvml_after_open()
        samples: list[GpuUtilisation] = []
        nan = float("nan")
        for _index, uuid, h in self._handles():
            try:
                rates = self._reading("nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, h, uuid=uuid)
                memory = self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, h, uuid=uuid)
                power_mw = self._reading("nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, h, uuid=uuid)
                temp = self._reading(
                    "nvmlDeviceGetTemperature", nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU, uuid=uuid
                )
            except GpuError:
                if self._health.reported_lost(uuid):
                    continue
                raise
            samples.append(
                GpuUtilisation(
                    uuid=uuid,
                    gpu_util=float(rates.gpu) if rates is not None else nan,
                    mem_copy_util=float(rates.memory) if rates is not None else nan,
                    mem_used_mib=int(memory.used) / MIB,
                    mem_free_mib=int(memory.free) / MIB,
                    power_w=float(power_mw) / 1000.0 if power_mw is not None else nan,
                    temperature_c=float(temp) if temp is not None else nan,
                )
            )
        return samples

    async def utilisation(self) -> list[GpuUtilisation]:
        return await asyncio.to_thread(self._utilisation)

    # -- health (``shared.adapters.nvmlhealth``) ------------------------------------------------------------------
    async def health_events(self) -> AsyncIterator[GpuHealthEvent]:
        await asyncio.to_thread(self.open_sync)
        async for event in self._health.events(self._nvml, self._handles):
            yield event

    # -- MIG ------------------------------------------------------------------------------------------------------
    def _gi_profiles(self, h: Any, uuid: str) -> list[tuple[int, MigProfile]]:
        """(NVML profile id, profile) of every GPU instance profile the GPU offers; none for a GPU without MIG."""
        nvml = self._nvml
        total_mib = int(self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, h, uuid=uuid).total) // MIB
        suffixes = {getattr(nvml, name): suffix for name, suffix in _PROFILE_SUFFIXES.items() if hasattr(nvml, name)}
        found: dict[str, tuple[int, MigProfile]] = {}
        for profile_id in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", _GI_PROFILE_COUNT))):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, profile_id)
            except Exception as exc:
                if not self._is_nvml_error(exc):
                    raise
                if self._is_lost(exc):
                    self._health.report_lost(uuid, f"nvmlDeviceGetGpuInstanceProfileInfo: {exc}")
                    raise GpuError(f"NVML nvmlDeviceGetGpuInstanceProfileInfo on GPU {uuid} failed: {exc}") from exc
                continue  # not supported on this GPU (or no MIG at all)
            if int(info.instanceCount) <= 0:
                continue
            slices, memory = int(info.sliceCount), int(info.memorySizeMB)
            named = _MIG_PROFILE_RE.search("MIG " + as_text(getattr(info, "name", b"")).removeprefix("MIG "))
            name = (
                named.group(1) if named else mig_profile_name(slices, memory, total_mib, suffixes.get(profile_id, ""))
            )
            profile = MigProfile(name=name, slices=slices, max_count=int(info.instanceCount), memory_mib=memory)
            found.setdefault(name, (profile_id, profile))
        return list(found.values())

    def _mig_profiles(self, uuid: str) -> list[MigProfile]:
        self.open_sync()
        return [p for _id, p in self._gi_profiles(self._handle(uuid), uuid)]

    async def mig_profiles(self, uuid: str) -> list[MigProfile]:
        return await asyncio.to_thread(self._mig_profiles, uuid)

    def _set_mig_mode(self, uuid: str, enabled: bool) -> None:
        nvml = self._nvml_after_open()
        h = self._handle(uuid)
        mode = nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE
        activation = self._call("nvmlDeviceSetMigMode", nvml.nvmlDeviceSetMigMode, h, mode, uuid=uuid)
        current, pending = self._call("nvmlDeviceGetMigMode", nvml.nvmlDeviceGetMigMode, h, uuid=uuid)
        if current != mode:
            status = ""
            if activation:
                try:
                    status = f" (NVML activation status: {nvml.NVMLError(activation)})"
                except Exception:
                    status = f" (NVML activation status {activation})"
            raise GpuError(
                f"MIG mode of GPU {uuid} is still {'enabled' if current == nvml.NVML_DEVICE_MIG_ENABLE else 'disabled'}"
                f"{status}; the change is {'pending' if pending == mode else 'not pending'} and needs the GPU idle "
                "and reset, or the node rebooted"
            )

    async def set_mig_mode(self, uuid: str, enabled: bool) -> None:
        await asyncio.to_thread(self._set_mig_mode, uuid, enabled)

    def _mig_handles(self, h: Any, uuid: str) -> list[tuple[Any, str, int]]:
        """(handle, MIG UUID, GPU instance id) of every MIG device on the GPU."""
        nvml = self._nvml
        count = int(self._call("nvmlDeviceGetMaxMigDeviceCount", nvml.nvmlDeviceGetMaxMigDeviceCount, h, uuid=uuid))
        found: list[tuple[Any, str, int]] = []
        for i in range(count):
            try:
                mh = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except Exception as exc:
                if self._is_nvml_error(exc) and not self._is_lost(exc):
                    continue  # an empty slot answers NOT_FOUND
                raise
            mig_uuid = as_text(self._call("nvmlDeviceGetUUID", nvml.nvmlDeviceGetUUID, mh, uuid=uuid))
            gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", nvml.nvmlDeviceGetGpuInstanceId, mh, uuid=uuid))
            found.append((mh, mig_uuid, gi_id))
        return found

    def _create_mig_instance(self, uuid: str, profile: str) -> MigInstance:
        """One GPU instance of ``profile`` holding one compute instance of its full size: one MIG device."""
        nvml = self._nvml_after_open()
        h = self._handle(uuid)
        offered = {p.name: (profile_id, p) for profile_id, p in self._gi_profiles(h, uuid)}
        if profile not in offered:
            names = ", ".join(offered) or "none"
            raise GpuError(f"MIG profile {profile!r} is not offered by GPU {uuid} (offered: {names})")
        profile_id, info = offered[profile]
        ci_profile = getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{info.slices}_SLICE", None)
        if ci_profile is None:
            raise GpuError(f"MIG profile {profile!r} on GPU {uuid}: NVML has no {info.slices}-slice compute instance")
        gi = self._call("nvmlDeviceCreateGpuInstance", nvml.nvmlDeviceCreateGpuInstance, h, profile_id, uuid=uuid)
        try:
            ci_info = self._call(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                gi,
                ci_profile,
                nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                uuid=uuid,
            )
            self._call(
                "nvmlGpuInstanceCreateComputeInstance",
                nvml.nvmlGpuInstanceCreateComputeInstance,
                gi,
                ci_info.id,
                uuid=uuid,
            )
            gi_info = self._call("nvmlGpuInstanceGetInfo", nvml.nvmlGpuInstanceGetInfo, gi, uuid=uuid)
            gi_id = int(gi_info.id)
        except BaseException:
            with contextlib.suppress(Exception):
                nvml.nvmlGpuInstanceDestroy(gi)  # no half-made instance holding slices
            raise
        for mh, mig_uuid, owner in self._mig_handles(h, uuid):
            if owner == gi_id:
                memory = int(self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, mh, uuid=uuid).total)
                ci_id = self._instance_ids(mh)[1]
                placement = getattr(gi_info, "placement", None)
                return MigInstance(
                    uuid=mig_uuid,
                    profile=profile,
                    memory_mib=memory // MIB,
                    gpu_instance_id=gi_id,
                    compute_instance_id=ci_id,
                    placement_start=int(placement.start) if placement is not None else None,
                    placement_size=int(placement.size) if placement is not None else None,
                )
        raise GpuError(f"GPU {uuid}: GPU instance {gi_id} ({profile}) was created but NVML lists no MIG device for it")

    async def create_mig_instance(self, uuid: str, profile: str) -> MigInstance:
        return await asyncio.to_thread(self._create_mig_instance, uuid, profile)

    def _destroy_mig_instance(self, uuid: str, instance_uuid: str) -> None:
        """Destroys the MIG device's compute instance, then its GPU instance unless other MIG devices share it."""
        nvml = self._nvml_after_open()
        h = self._handle(uuid)
        handles = self._mig_handles(h, uuid)
        found = [(mh, gi_id) for mh, mig_uuid, gi_id in handles if mig_uuid == instance_uuid]
        if not found:
            known = ", ".join(mig_uuid for _mh, mig_uuid, _gi in handles) or "none"
            raise GpuError(f"GPU {uuid} has no MIG instance {instance_uuid!r} (instances: {known})")
        mh, gi_id = found[0]
        shared = any(owner == gi_id and mig_uuid != instance_uuid for _mh, mig_uuid, owner in handles)
        ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", nvml.nvmlDeviceGetComputeInstanceId, mh, uuid=uuid))
        gi = self._call("nvmlDeviceGetGpuInstanceById", nvml.nvmlDeviceGetGpuInstanceById, h, gi_id, uuid=uuid)
        ci = self._call(
            "nvmlGpuInstanceGetComputeInstanceById", nvml.nvmlGpuInstanceGetComputeInstanceById, gi, ci_id, uuid=uuid
        )
        self._call("nvmlComputeInstanceDestroy", nvml.nvmlComputeInstanceDestroy, ci, uuid=uuid)
        if not shared:
            self._call("nvmlGpuInstanceDestroy", nvml.nvmlGpuInstanceDestroy, gi, uuid=uuid)

    async def destroy_mig_instance(self, uuid: str, instance_uuid: str) -> None:
        await asyncio.to_thread(self._destroy_mig_instance, uuid, instance_uuid)

    # -- driver ---------------------------------------------------------------------------------------------------
    async def install_driver(self, version: str) -> None:
        """The node's install command, run by ``shared.adapters.driverinstall``: this instance's
        ``install_command`` if it was given one, else the one the environment names."""
        await install_driver(version, self._install_command)

    def _validate(self, expected_version: str) -> DriverValidation:
        self.open_sync()
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            if self._is_nvml_error(exc) or isinstance(exc, OSError):
                return DriverValidation(ok=False, version="", visible_gpus=0, reason=f"NVML does not start: {exc}")
            raise
        try:
            try:
                version = as_text(nvml.nvmlSystemGetDriverVersion())
                count = int(nvml.nvmlDeviceGetCount())
            except Exception as exc:
                if not self._is_nvml_error(exc):
                    raise
                return DriverValidation(ok=False, version="", visible_gpus=0, reason=f"NVML does not answer: {exc}")
            visible = 0
            lost: list[str] = []
            for index in range(count):
                try:
                    h = nvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = as_text(nvml.nvmlDeviceGetUUID(h))
                    nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
                except Exception as exc:
                    if not self._is_nvml_error(exc):
                        raise
                    lost.append(f"GPU {index}: {exc}")
                    continue
                self._health.answers_again(uuid)
                visible += 1
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
        if version != expected_version:
            return DriverValidation(
                ok=False, version=version, visible_gpus=visible, reason=f"expected {expected_version}, found {version}"
            )
        if lost:
            return DriverValidation(ok=False, version=version, visible_gpus=visible, reason="; ".join(lost))
        if visible < self._initial_count:
            return DriverValidation(
                ok=False,
                version=version,
                visible_gpus=visible,
                reason=f"{visible} of the {self._initial_count} GPUs seen at start are visible",
            )
        return DriverValidation(ok=True, version=version, visible_gpus=visible)

    async def validate_driver(self, expected_version: str) -> DriverValidation:
        return await asyncio.to_thread(self._validate, expected_version)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._health.close()
        if self._open and self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._open = False
