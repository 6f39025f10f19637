"""Configuration documents kept in Redis. Unlike events, they forbid unknown fields: a typo in a key must be
refused at write time, not silently ignored while the cluster runs on a default."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Percent = Annotated[str, msgspec.Meta(pattern=r"^(\d+|\d{1,3}%)$", description="a count like '2' or a percent '25%'")]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class ConfigDocument(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every configuration document."""


class DriverPolicy(ConfigDocument, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The desired GPU driver and how to roll it out (names as NVIDIA's GPU Operator users know them)."""

    desired_version: str = ""
    pool_overrides: dict[str, str] = msgspec.field(default_factory=dict)
    auto_upgrade: bool = False
    max_parallel_upgrades: Annotated[int, msgspec.Meta(ge=0)] = 1
    max_unavailable: Percent = "25%"
    drain_timeout_s: Seconds = 300.0
    pod_deletion_timeout_s: Seconds = 300.0
    on_drain_failure: Literal["stop", "continue"] = "stop"


class CheckpointPolicy(ConfigDocument, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How often sessions are checkpointed without a drain, and what is kept."""

    periodic_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    keep_per_session: Annotated[int, msgspec.Meta(ge=1)] = 2
    max_age_s: Seconds = 7 * 24 * 3600.0
    max_total_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    drain_parallelism: Annotated[int, msgspec.Meta(ge=1)] = 8


class ModelRollout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model_id: str
    model_version: str
    tokenizer_id: str = ""


class ModelVersions(ConfigDocument, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which model each deployment serves; a KV cache only restores into the same model, version and tokenizer."""

    deployments: dict[str, ModelRollout] = msgspec.field(default_factory=dict)


CONFIG_DOCUMENTS: dict[str, type[ConfigDocument]] = {
    "driver": DriverPolicy,
    "checkpoint": CheckpointPolicy,
    "models": ModelVersions,
}
