"""Scale decisions, published so people and other systems can see why the replica count is what it is."""

from __future__ import annotations

from typing import ClassVar

from shared.contract.base import DeploymentName, Event, Namespace


class ScaleDecision(Event, frozen=True, kw_only=True, tag="scaler.decision"):
    family: ClassVar[str] = "scaler"

    namespace: Namespace
    deployment: DeploymentName
    desired_replicas: int
    current_replicas: int = 0
    queue_depth: int = 0
    gpu_util: float | None = None
    drain_surge: int = 0
    reason: str = ""
