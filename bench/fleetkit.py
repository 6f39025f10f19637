"""What the session half of the fleet-scale benchmark (``bench.scale_sessions``) and its rolling upgrade
(``bench.scale_upgrade``) share: a pod hosted in the benchmark's process, what the upgrade asks of the benchmark
that hosts the pods (``SessionBench`` is one), and how the CPU seconds of the mesh's processes are read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shared.console.client import MeshClient
from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.plumbing.bus import Bus

CpuSeconds = Callable[[], Mapping[str, float]]


@dataclass
class HostedPod:
    name: str
    node: str
    agent: KvAgent
    endpoint: AgentEndpoint
    saves: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of every periodic save command the pod answered (monotonic seconds)."""


class FleetBench(Protocol):
    """The benchmark hosting the fleet's pods, as the rolling upgrade and its pods use it (``SessionBench``)."""

    subjects: Subjects
    bus: Bus | None
    redis_url: str
    """The mesh's Redis: the upgrade's label watch opens a client of its own there."""
    block: np.ndarray
    """The one block every session holds: what a moved session is checked against."""
    drain_ids: list[str]
    """Every drain asked for (the checker expects one verdict each)."""

    async def add_pod(self, name: str, node: str) -> HostedPod: ...

    async def leave(self, pod: HostedPod) -> None: ...

    async def lost(self, pods: list[HostedPod]) -> int: ...

    def mesh(self) -> MeshClient: ...
