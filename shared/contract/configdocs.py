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
    install_timeout_s: Seconds = 600.0
    """An install not finished this long after it began fails the node (so does a driver agent silent as long)."""
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


ModelVersion = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+\-]{0,63}$", description="a model version like '2' or 'v2.1'")
]
DeploymentKey = Annotated[
    str,
    msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="'namespace/name'"),
]


class ModelRollout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One rollout of a deployment from ``from_version`` to ``to_version``.

    ``pinned_sessions``: sessions that began on ``from_version`` ``finish`` on it (on pods that still hold it), or
    are ``end``ed at the switch with ``end_reason``; never are they continued, or restored, on ``to_version``.
    ``prepare_timeout_s``: pods not ready this long after ``started_at`` count as failed. ``min_ready``: the
    fraction of the deployment's running pods that must be ready for the switch (1.0: every one, and a single
    failure aborts); below it the rollout is aborted and everything stays on ``from_version``.
    ``phase`` and what follows are written by the checkpoint service as the rollout goes."""

    rollout_id: str
    from_version: ModelVersion
    to_version: ModelVersion
    pinned_sessions: Literal["finish", "end"] = "finish"
    end_reason: str = "the deployment moved to a new model version"
    prepare_timeout_s: Seconds = 120.0
    min_ready: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    started_at: float = 0.0
    started_by: str = ""
    phase: Literal["preparing", "switched", "aborted"] = "preparing"
    reason: str = ""
    finished_at: float = 0.0
    ready: list[str] = msgspec.field(default_factory=list)
    failed: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.from_version == self.to_version:
            raise ValueError(f"to_version: the deployment already serves {self.to_version!r}")


class DeploymentModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A deployment's serving version ('' until a rollout switches it: pods serve what they started with) and its
    newest rollout."""

    serving_version: Annotated[str, msgspec.Meta(pattern=r"^$|^[A-Za-z0-9][A-Za-z0-9_.+\-]{0,63}$")] = ""
    rollout: ModelRollout | None = None


class ModelVersions(ConfigDocument, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which model version each deployment (``namespace/name``) serves, and its rollout. A KV cache only restores
    into the same model, version, weights and tokenizer (the manifest's layout says which)."""

    deployments: dict[DeploymentKey, DeploymentModel] = msgspec.field(default_factory=dict)


MIG_PROFILE_PATTERN = r"^[1-7]g\.[1-9][0-9]*gb(\+me)?$"
MigProfileName = Annotated[str, msgspec.Meta(pattern=MIG_PROFILE_PATTERN, description="a MIG profile like '1g.10gb'")]
MigLayoutName = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9_.\-]{0,61}[A-Za-z0-9])?$",
        description="a name usable as the value of the node label nvidia.com/mig.config",
    ),
]
GpuIndexes = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]


class MigDeviceGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One entry of a MIG layout: the GPUs it covers (``all`` or their indexes), whether they are in MIG mode,
    and how many instances of each profile each of them gets."""

    devices: Literal["all"] | GpuIndexes
    mig_enabled: bool = msgspec.field(name="mig-enabled")
    mig_devices: dict[MigProfileName, Annotated[int, msgspec.Meta(ge=0, le=7)]] = msgspec.field(
        default_factory=dict, name="mig-devices"
    )

    def __post_init__(self) -> None:
        if self.devices != "all" and len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices: a GPU index is listed twice in {list(self.devices)}")
        if not self.mig_enabled and any(self.mig_devices.values()):
            raise ValueError("mig-devices: instances are asked for while mig-enabled is false")


class MigConfig(ConfigDocument, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Desired MIG layouts in NVIDIA mig-parted's shape; each node picks one by its label
    ``nvidia.com/mig.config=<name>``. Keys are spelled as mig-parted spells them (``mig-configs``,
    ``mig-enabled``, ``mig-devices``), so its files convert as they are."""

    version: Literal["v1"] = "v1"
    mig_configs: dict[MigLayoutName, Annotated[list[MigDeviceGroup], msgspec.Meta(min_length=1)]] = msgspec.field(
        default_factory=dict, name="mig-configs"
    )


CONFIG_DOCUMENTS: dict[str, type[ConfigDocument]] = {
    "driver": DriverPolicy,
    "checkpoint": CheckpointPolicy,
    "models": ModelVersions,
    "mig": MigConfig,
}
