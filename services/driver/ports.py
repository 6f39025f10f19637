"""What the driver service needs besides the cluster and GPU ports: a leader lease with fencing and a book of
drain verdicts. The Redis adapters are in ``services.driver.lease``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from shared.ports.gpu import GpuPort


class StaleLeader(RuntimeError):
    """This coordinator's fencing token is no longer current: another one leads, and this one's writes are refused."""


class LeaderLease(Protocol):
    """One holder at a time, each new holder with a larger fencing token than every holder before it."""

    holder: str

    async def acquire(self) -> int | None:
        """Take or renew the lease; the fencing token while held, None when another holder has it."""
        ...

    async def current_token(self) -> int:
        """The token of the lease's present holder (0 when nobody holds it)."""
        ...

    async def release(self) -> None: ...


class DrainVerdicts(Protocol):
    """Verdicts of drains by drain id, shared by every coordinator replica (any replica may receive one)."""

    async def record(self, drain_id: str, verdict: str) -> None:
        """Idempotent: a redelivered verdict writes the same value."""
        ...

    async def get(self, drain_id: str) -> str: ...


GpuPortFactory = Callable[[str], GpuPort]
"""The GPU port of a named node (``SimGpus`` for that node in the simulation; the driver pod's port on a real one)."""
