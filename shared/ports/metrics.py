"""The metrics source port: where GPU utilisation comes from. One Protocol and what a read returns.

The adapters (``shared.adapters.metrics``): ``DcgmScrape`` (a node's dcgm-exporter page), ``PrometheusQuery``
(PromQL over Prometheus' HTTP API) and ``NvmlSource`` (the GPU port, on nodes without dcgm-exporter; NVML knows no
pods, so its readings have none).

A reading never invents a value: a series that is absent, NaN or infinite is simply not in ``values`` (and named in
``invalid`` when it was there but unusable), so nothing downstream can mistake a gap for a zero. A source that
cannot be read raises ``MetricsSourceError`` saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class MetricsSourceError(RuntimeError):
    """A source could not be read (refused, timed out, HTTP or PromQL error). Says which source and why."""


@dataclass(slots=True)
class GpuReading:
    """One GPU, or one MIG GPU instance, as a source saw it at one time. ``values`` holds only finite numbers."""

    uuid: str
    gpu: str = ""
    node: str = ""
    model: str = ""
    mig_profile: str = ""
    gpu_instance_id: str = ""
    pod: str = ""
    namespace: str = ""
    container: str = ""
    values: dict[str, float] = field(default_factory=dict)
    invalid: list[str] = field(default_factory=list)
    timestamp: float | None = None  # seconds since the epoch, when the source said when it sampled

    @property
    def key(self) -> str:
        """Unique per GPU or GPU instance: the UUID, with ``/gi<N>`` for a MIG instance."""
        return f"{self.uuid}/gi{self.gpu_instance_id}" if self.gpu_instance_id else self.uuid

    @property
    def util(self) -> float | None:
        """GPU utilisation in percent: ``DCGM_FI_DEV_GPU_UTIL``, or for MIG slices (which lack it) the graphics
        engine activity ratio times 100. None when neither is usable."""
        value = self.values.get("gpu_util")
        if value is None and (ratio := self.values.get("gr_engine_active")) is not None:
            value = ratio * 100.0
        return value

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(slots=True)
class SourceRead:
    """What one read of a source returned: readings, the problems met (malformed lines, NaN series, series
    without a UUID) and how many samples were seen."""

    source: str
    readings: list[GpuReading]
    problems: list[str] = field(default_factory=list)
    series: int = 0
    read_at: float = 0.0  # wall clock, seconds since the epoch


@runtime_checkable
class MetricsSource(Protocol):
    name: str
    simulated: bool

    async def read(self) -> SourceRead:
        """One reading of every GPU the source covers; raises ``MetricsSourceError`` when it cannot."""
        ...

    async def close(self) -> None: ...
