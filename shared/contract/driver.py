"""Driver lifecycle events. States and their label values are NVIDIA's (../shared/facts/gpu-operator-upgrades.md),
plus ``checkpoint-required``: the step where gpuwarden waits for every KV cache to be saved before any eviction."""

from __future__ import annotations

from typing import ClassVar, Literal

from shared.contract.base import Event, Token

UpgradeState = Literal[
    "",
    "upgrade-required",
    "cordon-required",
    "wait-for-jobs-required",
    "checkpoint-required",
    "pod-deletion-required",
    "drain-required",
    "pod-restart-required",
    "validation-required",
    "uncordon-required",
    "upgrade-done",
    "upgrade-failed",
]


class DriverUpgradeStateChanged(Event, frozen=True, kw_only=True, tag="driver.upgrade.state"):
    family: ClassVar[str] = "driver"

    node: Token
    state: UpgradeState
    previous_state: UpgradeState = ""
    reason: str = ""
    desired_version: str = ""
    installed_version: str = ""


class DriverInstalled(Event, frozen=True, kw_only=True, tag="driver.installed"):
    family: ClassVar[str] = "driver"

    node: Token
    version: str
    validated: bool = False


class DriverInstallFailed(Event, frozen=True, kw_only=True, tag="driver.install.failed"):
    family: ClassVar[str] = "driver"

    node: Token
    version: str
    reason: str
