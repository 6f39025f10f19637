"""What the simulated workload reports of itself (``SimWorkload``'s ``/healthz`` status, the sizes of its own
structures) and what tests read of a session: kept apart from the workload's serving, which it only reads."""

from __future__ import annotations

import asyncio
from typing import Any

from shared.sim.engines import DeploymentEngine
from shared.sim.gateway import GatewayRouting
from shared.sim.pods import PodRuntime
from shared.sim.sessions import Preempted, SessionLocks, WorkloadStats


class WorkloadReport:
    """The report of a ``SimWorkload`` (which sets these attributes; this class only reads them)."""

    runtimes: dict[str, PodRuntime]
    home: dict[str, str]
    versions: dict[str, str]
    preempted: dict[str, Preempted]
    killed: dict[str, str]
    last_request: dict[str, float]
    served_on: dict[str, str]
    engines: dict[tuple[str, str, str], DeploymentEngine]
    gateway: GatewayRouting | None
    stats: WorkloadStats
    _locks: SessionLocks
    _tasks: set[asyncio.Task[Any]]

    def session_blocks(self, session_id: str) -> list[Any] | None:
        home = self.home.get(session_id)
        runtime = self.runtimes.get(home) if home else None
        if runtime is None or session_id not in runtime.agent.sessions():
            return None
        return runtime.agent.blocks(session_id)

    def status(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "simulated": True,
            "pods": {
                name: {
                    "node": r.info.node,
                    "sessions": len(r.agent.sessions()),
                    "stopping": r.stopping,
                    "kv_blocks": {"capacity": r.pool.capacity, "used": r.pool.used, "peak": r.pool.peak},
                }
                for name, r in self.runtimes.items()
            },
            **stats.as_status(),
            "engines": {f"{ns}/{name}@{v}": e.layout.model_id for (ns, name, v), e in self.engines.items()},
            "rollouts": stats.rollouts(),
            "tracked": self.tracked(),
            "gateway": self.gateway.status() if self.gateway is not None else None,
        }

    def tracked(self) -> dict[str, int]:
        """How many entries each of the workload's own structures holds: bounded by the live sessions and pods."""
        return {
            "runtimes": len(self.runtimes),
            "home": len(self.home),
            "versions": len(self.versions),
            "preempted": len(self.preempted),
            "killed": len(self.killed),
            "last_request": len(self.last_request),
            "served_on": len(self.served_on),
            "locks": len(self._locks),
            "tasks": len(self._tasks),
            "lost_sessions": len(self.stats.lost_sessions),
            "conversations": sum(e.tracked() for e in self.engines.values()),
        }
