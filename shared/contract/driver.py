"""Driver lifecycle events. States and their label values are NVIDIA's (../shared/facts/gpu-operator-upgrades.md),
plus ``checkpoint-required``: the step where gpuwarden waits for every KV cache to be saved before any eviction.

The commands (``driver.*.command``) go from the cluster-wide upgrade coordinator to one node's driver agent (the
node's driver service, which holds the node's GPU port) over core NATS request/reply; ``DriverAgentAnswer`` is
the reply to each."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

from shared.contract.base import Event, NodeName
from shared.contract.configdocs import DRIVER_VERSION_PATTERN

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

    node: NodeName
    state: UpgradeState
    previous_state: UpgradeState = ""
    reason: str = ""
    desired_version: str = ""
    installed_version: str = ""


class DriverInstalled(Event, frozen=True, kw_only=True, tag="driver.installed"):
    family: ClassVar[str] = "driver"

    node: NodeName
    version: str
    validated: bool = False


class DriverInstallFailed(Event, frozen=True, kw_only=True, tag="driver.install.failed"):
    family: ClassVar[str] = "driver"

    node: NodeName
    version: str
    reason: str


DriverCommandName = Literal["install", "validate", "versions"]
DriverVersion = Annotated[
    str, msgspec.Meta(pattern=DRIVER_VERSION_PATTERN, description="a driver version like '550.54.15'")
]
CommandSeconds = Annotated[float, msgspec.Meta(gt=0, le=24 * 3600)]


class InstallDriver(Event, frozen=True, kw_only=True, tag="driver.install.command"):
    """A command to one node's driver agent: install ``version``. The agent runs one install at a time and bounds
    it by ``timeout_s``; it answers within ``wait_s``, ``running`` when the install has not finished by then.
    Idempotent per ``attempt``: the same command again joins the install while it runs and, once it has
    finished, answers its result; a new attempt after a finished one installs again."""

    family: ClassVar[str] = "driver"

    node: NodeName
    version: DriverVersion
    attempt: str = ""
    timeout_s: CommandSeconds = 600.0
    wait_s: CommandSeconds = 5.0


class ValidateDriver(Event, frozen=True, kw_only=True, tag="driver.validate.command"):
    """A command to one node's driver agent: does the driver answer, with ``expected_version``, and see every
    GPU? Answered within ``timeout_s``; a validation still running then answers ``failed`` and is joined by the
    next command rather than started again."""

    family: ClassVar[str] = "driver"

    node: NodeName
    expected_version: DriverVersion
    timeout_s: CommandSeconds = 10.0


class ReadDriverVersions(Event, frozen=True, kw_only=True, tag="driver.versions.command"):
    """A command to one node's driver agent: which driver and CUDA versions are installed, answered within
    ``timeout_s``."""

    family: ClassVar[str] = "driver"

    node: NodeName
    timeout_s: CommandSeconds = 10.0


class DriverAgentAnswer(Event, frozen=True, kw_only=True, tag="driver.agent.answer"):
    """A node's driver agent answers a driver command. ``outcome``: ``ok`` (installed; validated; versions read),
    ``failed`` (with the ``reason``) or, for an install, ``running``. The versions are those installed now (empty
    when they could not be read); ``visible_gpus`` is set by a validation."""

    family: ClassVar[str] = "driver"

    node: NodeName
    command: DriverCommandName
    outcome: Literal["ok", "failed", "running"]
    reason: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    visible_gpus: int = 0
