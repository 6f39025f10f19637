"""The node's labels in the style of NVIDIA's GPU feature discovery, from its inventory, and the loop that writes
them through the cluster port.

Users select GPU nodes by these labels (``nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}``), so
names and values follow GPU feature discovery: the product with spaces written as ``-``, the count, the memory in
MiB, the MIG strategy, the driver version as ``cuda.driver.major/minor/rev`` and the CUDA version the driver
supports as ``cuda.runtime.major/minor``. Under ``mig_strategy: single`` a node whose GPUs are all split into one
profile is labelled as that slice (``<product>-MIG-<profile>``, the slice count and memory); under ``mixed`` each
profile gets ``nvidia.com/mig-<profile>.count`` and ``.memory``. A label the GPU port cannot give (compute
capability: ``gpu.compute.major/minor``) is not written; nothing is guessed.

The product and memory are the lowest-numbered GPU's, as GPU feature discovery takes them (it assumes one model per
node). ``nvidia.com/gpu.present`` is set while GPUs are seen and never removed: the DaemonSets select nodes by it,
and removing it would take this service off its own node.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from shared.contract.device import DeviceInventory, GpuDevice
from shared.plumbing.retries import NODE_LABELS, RetryPolicy
from shared.ports.cluster import ClusterError, ClusterPort

from .config import MigStrategy

log = logging.getLogger(__name__)

PRESENT = "nvidia.com/gpu.present"
PRODUCT = "nvidia.com/gpu.product"
COUNT = "nvidia.com/gpu.count"
MEMORY = "nvidia.com/gpu.memory"
MIG_STRATEGY = "nvidia.com/mig.strategy"
DRIVER_MAJOR = "nvidia.com/cuda.driver.major"
DRIVER_MINOR = "nvidia.com/cuda.driver.minor"
DRIVER_REV = "nvidia.com/cuda.driver.rev"
RUNTIME_MAJOR = "nvidia.com/cuda.runtime.major"
RUNTIME_MINOR = "nvidia.com/cuda.runtime.minor"

_OWNED = frozenset(
    {PRODUCT, COUNT, MEMORY, MIG_STRATEGY, DRIVER_MAJOR, DRIVER_MINOR, DRIVER_REV, RUNTIME_MAJOR, RUNTIME_MINOR}
)
_MIG_LABEL = re.compile(r"^nvidia\.com/mig-[A-Za-z0-9._-]+\.(count|memory)$")
_NOT_IN_VALUE = re.compile(r"[^A-Za-z0-9._-]")
_VALUE_MAX = 63
_EDGE = "._-"


def label_value(text: str) -> str:
    """Free text as a Kubernetes label value: a space, or any character a value may not hold, becomes ``-``; at
    most 63 characters, starting and ending with a letter or digit (``''`` when none is left)."""
    return _NOT_IN_VALUE.sub("-", text.strip())[:_VALUE_MAX].strip(_EDGE)


def owned(key: str) -> bool:
    """A label this service writes and so may also remove (``gpu.present`` excepted: see the module)."""
    return key in _OWNED or bool(_MIG_LABEL.match(key))


def _version_labels(text: str, names: tuple[str, ...]) -> dict[str, str]:
    """``550.54.15`` -> major 550, minor 54, rev 15; a part that is missing or not a number is left out."""
    parts = text.strip().split(".") if text.strip() else []
    return {name: part for name, part in zip(names, parts, strict=False) if part.isascii() and part.isdigit()}


def _single_profile(gpus: list[GpuDevice]) -> str | None:
    """The one MIG profile of a node whose GPUs are all in MIG mode with slices of that profile only."""
    if not gpus or not all(g.mig_enabled for g in gpus):
        return None
    profiles = {m.profile for g in gpus for m in g.mig_instances}
    return (profiles.pop() or None) if len(profiles) == 1 else None


def node_labels(inventory: DeviceInventory, mig_strategy: MigStrategy) -> dict[str, str]:
    """The labels the inventory gives the node. Pure; the same inventory always gives the same labels."""
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    labels: dict[str, str] = {COUNT: str(len(gpus)), MIG_STRATEGY: mig_strategy}
    if gpus:
        first = gpus[0]
        labels[PRESENT] = "true"
        product = label_value(first.model)
        if product:
            labels[PRODUCT] = product
        if first.memory_total_mib > 0:
            labels[MEMORY] = str(first.memory_total_mib)
    profile = _single_profile(gpus) if mig_strategy == "single" else None
    if profile is not None:
        slices = [m for g in gpus for m in g.mig_instances]
        labels[COUNT] = str(len(slices))
        labels[PRODUCT] = label_value(f"{gpus[0].model}-MIG-{profile}")
        labels.pop(MEMORY, None)
        if slices[0].memory_mib > 0:
            labels[MEMORY] = str(slices[0].memory_mib)
    if mig_strategy == "mixed":
        by_profile: dict[str, list[int]] = {}
        for m in (m for g in gpus if g.mig_enabled for m in g.mig_instances):
            by_profile.setdefault(m.profile, []).append(m.memory_mib)
        for name, memories in sorted(by_profile.items()):
            if not label_value(name):
                continue
            key = f"nvidia.com/mig-{label_value(name)}"
            labels[f"{key}.count"] = str(len(memories))
            if memories[0] > 0:
                labels[f"{key}.memory"] = str(memories[0])
    labels |= _version_labels(inventory.driver_version, (DRIVER_MAJOR, DRIVER_MINOR, DRIVER_REV))
    labels |= _version_labels(inventory.cuda_version, (RUNTIME_MAJOR, RUNTIME_MINOR))
    return labels


def label_changes(desired: Mapping[str, str], current: Mapping[str, str]) -> dict[str, str | None]:
    """The patch that takes the node from ``current`` to ``desired``: new or changed values, and None for a label
    this service owns that is no longer wanted. Labels owned by others are never in it."""
    changes: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    changes |= {k: None for k in current if owned(k) and k not in desired}
    return changes


class NodeLabeller:
    """Keeps the node's labels as the latest inventory says.

    ``want`` records the labels and wakes ``run``, which writes only when they differ from what it last wrote and
    then only the labels that differ on the node. A cluster that cannot be reached or refuses is logged and tried
    again with a growing delay (``retry``, ``retries.NODE_LABELS`` by default), the labels wanted by then; the
    service never stops for it. ``connect`` opens the cluster port on first use."""

    def __init__(
        self,
        node: str,
        connect: Callable[[], Awaitable[ClusterPort]],
        *,
        retry: RetryPolicy = NODE_LABELS,
    ) -> None:
        self.node = node
        self._connect = connect
        self._retry = retry
        self.cluster: ClusterPort | None = None
        self.desired: dict[str, str] | None = None
        self.written: dict[str, str] | None = None
        self.writes = 0
        self.failures = 0
        self.last_error = ""
        self._wake = asyncio.Event()

    def want(self, labels: Mapping[str, str]) -> None:
        if labels != self.desired:
            self.desired = dict(labels)
            self._wake.set()

    def describe(self) -> dict[str, Any]:
        """For /healthz."""
        return {
            "up_to_date": self.desired is not None and self.desired == self.written,
            "writes": self.writes,
            "failures": self.failures,
            "error": self.last_error or None,
        }

    async def run(self) -> None:
        """Runs for the service's lifetime."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            async for attempt in self._retry.tries(note=self._failed):
                with attempt:
                    desired = self.desired
                    if desired is not None and desired != self.written:
                        await self.write(desired)
                        self.last_error = ""

    def _failed(self, exc: Exception, wait_s: float) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("cannot label the node; trying again", extra={"error": self.last_error, "retry_s": wait_s})

    async def write(self, desired: Mapping[str, str]) -> None:
        """One attempt: read the node's labels, patch what differs. Idempotent."""
        if self.cluster is None:
            self.cluster = await self._connect()
        node = await self.cluster.node(self.node)
        if node is None:
            raise ClusterError(f"node {self.node!r} is not in the cluster (GPUWARDEN_NODE names this node)")
        changes = label_changes(desired, node.labels)
        if changes:
            await self.cluster.set_node_labels(self.node, changes)
            self.writes += 1
            log.info("node labels written", extra={"node": self.node, "labels": changes})
        self.written = dict(desired)
