"""What an inference pod reports of its load: how full its KV block pool is and how long its requests waited for
their first token. Telemetry over core NATS, sent every few seconds by each pod (``shared.kv.load``): a lost
report is replaced by the next, and a pod that stops reporting is missing, never idle.

The scaler reads these per deployment (``services/scaler``): KV-cache utilisation is ``blocks_used /
blocks_total`` summed over the pods with a fresh report, and the time to first token at the 90th percentile is
the highest ``ttft_p90_s`` among them (a deployment's p90 is never above its slowest pod's).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from shared.contract.base import DeploymentName, Event, Namespace, OptModelVersion, OptNodeName, PodName

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class PodLoad(Event, frozen=True, kw_only=True, tag="kv.pod.load"):
    """One pod's load over the last ``window_s`` seconds, as its inference server measured it.

    ``blocks_used`` / ``blocks_total``: the KV blocks held by running sequences now, of the pool the engine
    allocated (vLLM's ``num_gpu_blocks``); ``blocks_total`` 0 means the pool is not known yet (the figure is
    missing, not empty). ``ttft_p90_s``: the 90th percentile of the time to first token of the ``requests``
    requests whose first token came within the window, from the request's arrival (queue wait included); None
    when no request got its first token in the window (nothing measured, which is not a fast answer)."""

    family: ClassVar[str] = "kv"

    pod: PodName
    node: OptNodeName = ""
    namespace: Namespace
    deployment: DeploymentName
    blocks_used: NonNegative
    blocks_total: NonNegative
    ttft_p90_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    window_s: Annotated[float, msgspec.Meta(gt=0)]
    requests: NonNegative = 0
    model_versions: Annotated[list[OptModelVersion], msgspec.Meta(max_length=16)] | None = None
    """The model versions the pod can restore a session into now (weights loaded: the one it serves, and those its
    sessions still run on); None: not said (an older pod), any."""
