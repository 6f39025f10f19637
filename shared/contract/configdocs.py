"""Configuration documents kept in Redis. Unlike events, they forbid unknown fields: a typo in a key must be
refused at write time, not silently ignored while the cluster runs on a default."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Seconds = Annotated[float, msgspec.Meta(gt=0)]
DRIVER_VERSION_PATTERN = r"^[0-9]{3}(\.[0-9]{1,3}){1,2}$"
DriverVersion = Annotated[
    str, msgspec.Meta(pattern=r"^$|" + DRIVER_VERSION_PATTERN, description="a driver version like '550.54.15'")
]
MaxUnavailable = Annotated[
    str,
    msgspec.Meta(pattern=r"^(\d{1,4}|(100|[1-9]?[0-9])%)$", description="a node count like '2' or a percent 0-100%"),
]
PoolSelector = Annotated[
    str,
    msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./\-]*=[A-Za-z0-9_.\-]*$", description="'label=value' of a pool"),
]


class ConfigDocument(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every configuration document."""


class DriverPolicy(ConfigDocument, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The desired GPU driver and how to roll it out (names as NVIDIA's GPU Operator users know them)."""

    desired_version: DriverVersion = ""
    pool_overrides: dict[PoolSelector, Annotated[str, msgspec.Meta(pattern=DRIVER_VERSION_PATTERN)]] = msgspec.field(
        default_factory=dict
    )
    auto_upgrade: bool = False
    max_parallel_upgrades: Annotated[int, msgspec.Meta(ge=0)] = 1
    max_unavailable: MaxUnavailable = "25%"
    drain_timeout_s: Seconds = 300.0
    pod_deletion_timeout_s: Seconds = 300.0
    on_drain_failure: Literal["stop", "continue"] = "stop"
    max_failed_nodes: Annotated[int, msgspec.Meta(ge=0)] = 0
    """No node starts while more nodes than this are in upgrade-failed."""
    drain_pod_selector: dict[str, str] = msgspec.field(default_factory=dict)
    """Labels of the pods the upgrade evicts (empty: all but those labelled to skip)."""
    wait_for_jobs_selector: dict[str, str] = msgspec.field(default_factory=dict)
    """Labels of job pods waited for before the drain (empty: none)."""
    wait_for_jobs_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """0: wait for the jobs forever."""
    validation_timeout_s: Seconds = 600.0
    eviction_backoff_s: Seconds = 2.0
    """First delay after a PodDisruptionBudget refusal; it doubles up to 60 s."""


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
