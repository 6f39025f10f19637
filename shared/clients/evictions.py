"""Evicting a node's pods, as a drain does once its sessions are saved: the one routine the CLI's ``drain``
(``shared.console.operations``) and the driver's upgrade coordinator (``services.driver.coordinator``) both use.

Pods go through the Eviction API only (nothing is deleted), so every PodDisruptionBudget is honoured. A refusal by
a budget is not a failure: the pod is tried again after a delay (``PdbBackoff``) that starts at ``first_s``,
doubles with each round refused in a row, and never exceeds ``max_s``; a round with no refusal starts it over. A
pod already Terminating is never evicted again: its eviction was accepted, and its preStop hook runs.

The delays, in one place:

- ``COMMAND_BACKOFF``, for ``gpuwarden drain`` (a person waits): from 0.5 s up to 5 s, the interval at which
  ``kubectl drain`` retries a refused eviction; the node is looked at again every ``COMMAND_POLL_S`` while no
  eviction is refused.
- the driver upgrade's, a controller's: from the ``driver`` document's ``eviction_backoff_s`` (2 s by default)
  up to ``MAX_BACKOFF_S`` (60 s), the time kept per node by the coordinator (``NodeView.evict_after``), so a pass
  that comes early evicts nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.ports.cluster import ClusterPort, EvictionOutcome

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
"""The longest a controller waits before trying again an eviction a PodDisruptionBudget refused."""


@dataclass(frozen=True, slots=True)
class PdbBackoff:
    """How long to wait after a round of evictions a PodDisruptionBudget refused: ``first_s`` after the first
    such round, doubling with each one in a row, at most ``max_s``. A delay computed from the one before, not a
    ``shared.plumbing.retries`` policy: the driver's coordinator keeps it per node across its passes, and a refusal
    is no failure to try again."""

    first_s: float
    max_s: float = MAX_BACKOFF_S

    def after(self, previous_s: float | None) -> float:
        """The delay after a refused round; ``previous_s``: the delay after the round before it, when that one
        was refused too (None when it was not: the delays start over)."""
        return min(self.first_s if previous_s is None else previous_s * 2, self.max_s)


COMMAND_BACKOFF = PdbBackoff(first_s=0.5, max_s=5.0)
COMMAND_POLL_S = 0.2
"""How often ``gpuwarden drain`` looks at the node again while no eviction is refused (its pods are leaving)."""


@dataclass(slots=True)
class EvictionRound:
    """What one round of evictions did: the pods evicted, and those a PodDisruptionBudget refused (each as
    ``namespace/name``)."""

    evicted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    @property
    def blocked(self) -> bool:
        return bool(self.refused)


async def evict_pods(
    cluster: ClusterPort,
    node: str,
    pods: Iterable[tuple[str, str]],
    on_evicted: Callable[[str, str], None] | None = None,
) -> EvictionRound:
    """Ask the Eviction API once for each pod (``(namespace, name)``, none of them Terminating) on ``node``;
    ``on_evicted(namespace, name)`` hears each eviction accepted. Raises what the cluster port raises (a round
    cut short is simply done again: an accepted eviction leaves the pod Terminating, and a gone pod is no
    eviction). Idempotent for the cluster."""
    done = EvictionRound()
    for namespace, name in pods:
        outcome = await cluster.evict(namespace, name)
        if outcome is EvictionOutcome.BLOCKED_BY_PDB:
            done.refused.append(f"{namespace}/{name}")
            log.info("eviction refused by a PodDisruptionBudget; backing off", extra={"node": node, "pod": name})
        elif outcome is EvictionOutcome.EVICTED:
            done.evicted.append(f"{namespace}/{name}")
            log.info("pod evicted", extra={"node": node, "pod": f"{namespace}/{name}"})
            if on_evicted is not None:
                on_evicted(namespace, name)
    return done
