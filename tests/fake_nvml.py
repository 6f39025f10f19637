"""NVML as a small fake: GPUs, their readings and events, behind the calls the NVML adapter makes (pynvml names)."""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

GIB = 1024**3


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {15: "GPU is lost", 10: "Timeout", 3: "Not Supported", 12: "NVML Shared Library Not Found"}.get(
            self.value, f"NVML error {self.value}"
        )


@dataclass
class Pci:
    busId: str


@dataclass
class Memory:
    total: int
    used: int
    free: int


@dataclass
class Rates:
    gpu: int
    memory: int


@dataclass
class EventData:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeGpu:
    uuid: str
    name: str
    bus: str
    numa: int
    peer_bus: str
    lost: bool = False
    xid_capable: bool = True
    utilisation_supported: bool = True  # NVML answers NOT_SUPPORTED for a GPU in MIG mode


class FakeNvml:
    """The functions the adapter calls, with pynvml's names and return shapes."""

    NVMLError = NVMLError
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_DEVICE_MIG_DISABLE = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        self.gpus = [
            FakeGpu("GPU-aaaa", "NVIDIA H100 80GB HBM3", "00000000:07:00.0", 0, "0000:0F:00.0"),
            FakeGpu("GPU-bbbb", "NVIDIA H100 80GB HBM3", "00000000:0F:00.0", 1, "0000:07:00.0"),
        ]
        self.driver = "550.54.15"
        self.cuda = 12040
        self.init_error: int | None = None
        self.inits = 0
        self.events: queue.Queue[EventData] = queue.Queue()
        self.registered: list[str] = []
        self.mig_modes: dict[str, int] = {}

    def _gpu(self, h: FakeGpu) -> FakeGpu:
        if h.lost:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return h

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        for g in self.gpus:
            if g.uuid == uuid:
                return self._gpu(g)
        raise NVMLError(self.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return h.uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return self._gpu(h).name

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> Pci:
        return Pci(self._gpu(h).bus)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Memory:
        self._gpu(h)
        return Memory(total=80 * GIB, used=20 * GIB, free=60 * GIB)

    def nvmlDeviceGetNumaNodeId(self, h: FakeGpu) -> int:
        return self._gpu(h).numa

    def nvmlDeviceGetNvLinkState(self, h: FakeGpu, link: int) -> int:
        self._gpu(h)
        if link >= 4:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return 1 if link < 2 else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: FakeGpu, link: int) -> Pci:
        return Pci(self._gpu(h).peer_bus)

    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        self._gpu(h)
        if h.uuid not in self.mig_modes:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return [self.mig_modes[h.uuid], self.mig_modes[h.uuid]]

    def nvmlDeviceSetMigMode(self, h: FakeGpu, mode: int) -> int:
        self._gpu(h)
        if h.uuid not in self.mig_modes:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        self.mig_modes[h.uuid] = mode
        return 0

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        return 0

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: FakeGpu, profile: int) -> Any:
        raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Rates:
        self._gpu(h)
        if not h.utilisation_supported:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return Rates(gpu=75 if h.numa == 0 else 5, memory=30)

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._gpu(h)
        return 350_500

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        self._gpu(h)
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 61

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlEventSetFree(self, event_set: object) -> None:
        return None

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, types: int, event_set: object) -> None:
        if not h.xid_capable:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        assert types == self.nvmlEventTypeXidCriticalError
        self.registered.append(h.uuid)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> EventData:
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(self.NVML_ERROR_TIMEOUT) from None
