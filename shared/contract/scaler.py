"""Scale decisions, published so people and other systems can see why the replica count is what it is."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from shared.contract.base import DeploymentName, Event, Namespace


class ScaleDecision(Event, frozen=True, kw_only=True, tag="scaler.decision"):
    """A ScaledObject's replica count changed (or what set it did), with the inputs it was decided on.

    ``signal``: what set the count (``services/scaler/decision.py`` lists the values: ``queue``, ``gpu``,
    ``kv``, ``ttft``, ``queue+gpu``, or a later step such as ``maxReplicas`` or ``stabilisation``);
    ``signal_replicas``: the count each signal with a fresh input asked for. An input the scaler did not have
    fresh is null (``gpu_util``, ``kv_cache_util``, ``ttft_p90_s``) and named in ``stale``, never 0."""

    family: ClassVar[str] = "scaler"

    namespace: Namespace
    deployment: DeploymentName
    desired_replicas: int
    current_replicas: int = 0
    queue_depth: int = 0
    gpu_util: float | None = None
    drain_surge: int = 0
    reason: str = ""
    signal: str = ""
    signal_replicas: dict[str, int] = msgspec.field(default_factory=dict)
    kv_cache_util: float | None = None
    """KV blocks used / blocks in the pools of the pods that reported, 0..1."""
    ttft_p90_s: float | None = None
    """Time to first token at the 90th percentile: the slowest reporting pod's, in seconds."""
    stale: list[str] = msgspec.field(default_factory=list)
