"""The inference request queue of a deployment: what KEDA scales on and the workload serves."""

from __future__ import annotations

from typing import ClassVar

from shared.contract.base import DeploymentName, Event, Namespace, SessionId


class InferenceRequest(Event, frozen=True, kw_only=True, tag="requests.inference"):
    family: ClassVar[str] = "requests"

    namespace: Namespace
    deployment: DeploymentName
    session_id: SessionId
    prompt_tokens: int = 0
    max_new_tokens: int = 0
