"""Model rollouts: a deployment's pods prepare a new model version, then switch to it together.

The checkpoint service coordinates a rollout (the ``models`` configuration document holds what is asked and where
it stands): it asks every pod's KV agent to ``prepare`` the new version (``model.prepare.command``, answered by
``model.prepare.report``), then flips the deployment's serving version with one compare-and-set and publishes
``kv.rollout.state``. Agents also ask for the serving version (``model.serving.query``) when they start and on
every announcement, so a pod that missed the switch switches anyway. Sessions stay on the version that built
their KV cache: a checkpoint is never restored into another version.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from shared.contract.base import DeploymentName, Event, Namespace, OptDeploymentName, OptNamespace, OptPodName, PodName

RolloutPhase = Literal["none", "preparing", "switched", "aborted"]


class PrepareModel(Event, frozen=True, kw_only=True, tag="model.prepare.command"):
    """A command to one pod's KV agent: make ``version`` ready (load its weights) while still serving the
    current one, and answer ``ModelPrepared`` before ``deadline_s``. Idempotent: a version already ready is
    answered ready at once."""

    family: ClassVar[str] = "model"

    pod: PodName
    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    rollout_id: str = ""
    version: str
    deadline_s: float = 60.0


class ModelPrepared(Event, frozen=True, kw_only=True, tag="model.prepare.report"):
    """A KV agent's answer to ``PrepareModel``: ``ready``, or not with the ``reason``."""

    family: ClassVar[str] = "model"

    pod: PodName
    rollout_id: str = ""
    version: str = ""
    ready: bool = False
    reason: str = ""
    weights_digest: str = ""


class ServingQuery(Event, frozen=True, kw_only=True, tag="model.serving.query"):
    """A KV agent asks which version its deployment serves now (answered with ``RolloutState``)."""

    family: ClassVar[str] = "model"

    namespace: OptNamespace = ""
    deployment: OptDeploymentName = ""
    pod: OptPodName = ""


class RolloutState(Event, frozen=True, kw_only=True, tag="kv.rollout.state"):
    """Where a deployment's rollout stands, published on every change of phase, and the answer to
    ``model.serving.query``.

    ``serving_version``: the version new sessions start on ('' when no rollout ever ran: each pod serves what it
    was started with). ``pinned_sessions``: what pods do with sessions of the version they left: ``finish`` them
    on it, or ``end`` them with ``end_reason``."""

    family: ClassVar[str] = "kv"

    namespace: Namespace
    deployment: DeploymentName
    rollout_id: str = ""
    phase: RolloutPhase = "none"
    from_version: str = ""
    to_version: str = ""
    serving_version: str = ""
    pinned_sessions: Literal["finish", "end"] = "finish"
    end_reason: str = ""
    reason: str = ""
    ready: list[str] = msgspec.field(default_factory=list)
    failed: list[str] = msgspec.field(default_factory=list)
    config_version: int = 0
    """The version of the ``models`` document this state was read from: a pod never goes back to an older one
    (an answer read before the switch that arrives after it)."""
