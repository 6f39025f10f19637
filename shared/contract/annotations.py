"""The node labels and annotations gpuwarden writes and reads around a drain, named once: the driver upgrade's state
and bookkeeping, and the names of the drains asked for a node (by whom they were asked says which annotation).

A drain is named on its node *before* it is asked (``shared.clients.drains``), so a process that dies in between
finds the name and asks the same drain again rather than a second one; the name is removed once its verdict is used.
The labels under ``nvidia.com/`` are those NVIDIA's GPU Operator uses for the same states, so its tooling reads them.
"""

from __future__ import annotations

UPGRADE_STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
"""The node's driver upgrade state (``shared.contract.driver.UpgradeState``), as NVIDIA's GPU Operator names it."""
UPGRADE_SKIP_NODE_LABEL = "nvidia.com/gpu-driver-upgrade.skip"
"""``true``: the driver upgrade leaves this node alone."""
UPGRADE_SKIP_DRAIN_POD_LABEL = "nvidia.com/gpu-driver-upgrade-drain.skip"
"""``true`` on a pod: the driver upgrade does not evict it."""

_UPGRADE = "gpuwarden.io/driver-upgrade-"
UPGRADE_FAILURE_ANNOTATION = _UPGRADE + "failure"
"""Why the node is ``upgrade-failed``; kept until the failure is cleared."""
UPGRADE_CLEAR_ANNOTATION = _UPGRADE + "clear"
"""Set to ``true`` by a person to clear ``upgrade-failed``: the node starts over from ``upgrade-required``."""
UPGRADE_WAS_CORDONED_ANNOTATION = _UPGRADE + "was-cordoned"
"""``true`` when the node was cordoned by someone else before or while the upgrade held it (a person's
``gpuwarden drain``): the upgrade leaves it cordoned when it is done."""
UPGRADE_SINCE_ANNOTATION = _UPGRADE + "since"
"""When the node entered its current upgrade state (seconds since the epoch): the timeouts count from it."""
UPGRADE_TARGET_ANNOTATION = _UPGRADE + "target"
"""The version this upgrade installs, fixed when the node starts, so a policy edit mid-upgrade is not half-applied."""
UPGRADE_DRAIN_ANNOTATION = _UPGRADE + "drain-id"
"""The drain the driver upgrade asked for the node; its verdict moves the node on."""
UPGRADE_FENCE_ANNOTATION = "gpuwarden.io/driver-coordinator-fence"
"""The fencing token of the upgrade coordinator that last wrote the node; a writer with a smaller token is stale."""

CORDON_DRAIN_ANNOTATION = "gpuwarden.io/cordon-drain-id"
"""The drain asked for a node cordoned by someone other than the upgrade coordinator: written by ``gpuwarden
drain`` with its cordon, or by the coordinator for a node it found cordoned without one (a node cordoned with this
annotation set gets no second drain); removed when the node is schedulable again."""

MIG_DRAIN_ANNOTATION = "gpuwarden.io/mig-drain-id"
"""The drain the MIG controller asked before changing the node's MIG layout; removed once its verdict is used."""

POD_DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
"""On a pod: the ReplicaSet controller removes the lowest cost first on scale-in (the router writes it)."""
