"""What the driver service needs besides the cluster port and the drain client's ``VerdictReader``
(``shared.clients.drains``): a leader lease with fencing, and each node's driver as the coordinator reaches it.
The lease's Redis adapter is in ``services.driver.lease``; the node driver over the bus (and the agent that
answers it on each node) in ``services.driver.agent``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from shared.ports.gpu import DriverValidation, DriverVersions, GpuError

from .upgrade import InstallProgress


class StaleLeader(RuntimeError):
    """This coordinator's fencing token is no longer current: another one leads, and this one's writes are refused."""


class AgentUnreachable(GpuError):
    """A node's driver agent did not answer (not running, not reachable, or busy past the deadline): a temporary
    failure, retried on the next pass; the policy's timeouts decide when it fails the node."""


class LeaseUnavailable(RuntimeError):
    """The store of the lease does not answer (Redis is down or restarting): a temporary failure; the coordinator
    tries again on its next pass."""


TokenFloor = Callable[[], Awaitable[int]]
"""The highest fencing token ever stamped where the lease's store cannot lose it (on the cluster's nodes)."""


class LeaderLease(Protocol):
    """One holder at a time, each new holder with a larger fencing token than every holder before it."""

    holder: str

    async def acquire(self, floor: TokenFloor | None = None) -> int | None:
        """Take or renew the lease; the fencing token while held, None when another holder has it. A new token is
        also above ``floor()`` (asked only when a new token is taken), so a store that lost its counter never
        hands out a token already used. Raises ``LeaseUnavailable`` when the store does not answer."""
        ...

    async def current_token(self) -> int:
        """The token of the lease's present holder (0 when nobody holds it)."""
        ...

    async def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class InstallStatus:
    progress: InstallProgress
    reason: str = ""


class NodeDriver(Protocol):
    """One node's driver, reached from wherever the coordinator runs. Every call answers within the adapter's
    timeout; ``AgentUnreachable`` when the node's agent does not."""

    node: str

    async def versions(self) -> DriverVersions:
        """Raises ``GpuError`` (``AgentUnreachable`` when the agent is silent) when they cannot be read."""
        ...

    async def install(self, version: str, attempt: str, timeout_s: float) -> InstallStatus:
        """Start installing ``version`` or join the install of ``attempt`` already running; ``running`` while it
        has not finished. ``timeout_s`` bounds the install on the node."""
        ...

    async def validate(self, expected_version: str) -> DriverValidation: ...


NodeDrivers = Callable[[str], NodeDriver]
"""The driver of a named node: ``BusNodeDriver``, which asks that node's driver agent over NATS."""
