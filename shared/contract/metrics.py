"""GPU telemetry and the aggregates the scaler reads. Samples go over core NATS: a lost one is replaced by the next."""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

import msgspec

from shared.contract.base import Event, Token


class GpuSample(Event, frozen=True, kw_only=True, tag="metrics.gpu.sample", omit_defaults=True):
    """One GPU's reading. A value the source did not have (the series absent, NaN or infinite) is null, never 0:
    the field is left out of the message, and its default is null. ``missing`` still names those fields, for
    readers from before values could be null (to them an absent field was 0, and ``missing`` said it meant
    unknown). Every field at its default is left out of the message; a reader fills the same default back in."""

    family: ClassVar[str] = "metrics"

    node: Token
    gpu_uuid: str
    gpu_util: float
    mem_copy_util: float | None = None
    mem_used_mib: float | None = None
    mem_free_mib: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    xid: int | None = None
    """The last XID error (0: none) as the source reported it; null when it reported nothing."""
    pod: str = ""
    namespace: str = ""
    sampled_at: datetime | None = None
    gpu_instance_id: str = ""  # MIG: the GPU instance this sample is about ("" for a whole GPU)
    mig_profile: str = ""
    missing: list[str] = msgspec.field(default_factory=list)
    """Fields the source had no usable value for (absent, NaN): null here; kept for readers from before that."""


class DeploymentUtilisation(Event, frozen=True, kw_only=True, tag="metrics.deployment.utilisation", omit_defaults=True):
    """A deployment's figures over the window, published only when some utilisation was seen in it. A figure with
    no reading behind it is null (left out of the message; its default is null), never 0."""

    family: ClassVar[str] = "metrics"

    namespace: Token
    deployment: Token
    window_s: float
    mean_util: float
    max_util: float
    mem_pressure: float | None = None
    """The highest used/(used+free+reserved) of its GPUs in the window, 0..1; null when no GPU reported both."""
    gpus: int = 0
    sampled_at: datetime | None = None
    pods: int = 0
    samples: int = 0
    stale: bool = False
    """True when the newest sample is older than the service's staleness limit: the figures are the last known."""


class UtilisationRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the metrics service keeps in Redis per pod (``<root>:metrics:pod:<ns>:<pod>``) and per deployment
    (``<root>:metrics:deployment:<ns>:<name>``), JSON. ``sampled_at`` (seconds since the epoch) is the newest sample
    behind the figures: a reader compares it with its clock. With no sample in the window the figures are null and
    ``stale`` is true; a missing figure is never written as 0."""

    namespace: str
    name: str
    scope: str  # "pod" or "deployment"
    window_s: float
    mean_util: float | None = None
    max_util: float | None = None
    mem_pressure: float | None = None  # the highest used/(used+free+reserved) of its GPUs in the window, 0..1
    gpus: int = 0
    stale_gpus: int = 0
    pods: int = 0
    samples: int = 0
    sampled_at: float | None = None
    written_at: float = 0.0
    stale: bool = True
