"""GPU telemetry and the aggregates the scaler reads. Samples go over core NATS: a lost one is replaced by the next."""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from shared.contract.base import Event, Token


class GpuSample(Event, frozen=True, kw_only=True, tag="metrics.gpu.sample"):
    family: ClassVar[str] = "metrics"

    node: Token
    gpu_uuid: str
    gpu_util: float
    mem_copy_util: float = 0.0
    mem_used_mib: float = 0.0
    mem_free_mib: float = 0.0
    power_w: float = 0.0
    temperature_c: float = 0.0
    xid: int = 0
    pod: str = ""
    namespace: str = ""
    sampled_at: datetime | None = None


class DeploymentUtilisation(Event, frozen=True, kw_only=True, tag="metrics.deployment.utilisation"):
    family: ClassVar[str] = "metrics"

    namespace: Token
    deployment: Token
    window_s: float
    mean_util: float
    max_util: float
    mem_pressure: float = 0.0
    gpus: int = 0
    sampled_at: datetime | None = None
