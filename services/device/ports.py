"""What the device service needs besides the GPU and cluster ports: which pods hold a GPU (``shared.ports.pods``,
where the simulated adapter can reach it too)."""

from __future__ import annotations

from shared.ports.pods import GpuPods, PodLookupError

__all__ = ["GpuPods", "PodLookupError"]
