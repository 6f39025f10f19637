"""The node's side of driver upgrades, and the coordinator's way to it.

Every node's driver service runs a ``DriverAgent``: it answers the coordinator's commands (``shared.contract.driver``:
install, validate, versions) on that node's subjects with the node's own GPU port (NVML on a real node, simulated
GPUs in the simulation). The coordinator, on whichever node it leads, reaches a node through ``BusNodeDriver``, a
request/reply client that waits no longer than its timeout: a silent node costs one timeout in a pass, and the
policy's timeouts turn it into ``upgrade-failed`` with the reason.

An install happens only where the upgrade put the node for it: before it starts one, the agent reads its node and
installs only while the node is in ``pod-restart-required`` (cordoned, its pods' sessions saved and moved) under
the command's attempt. A command sent again once the node moved on (a replay, a duplicate that arrives late, a
coordinator that lost its lead) is refused with the reason, never run: it would install a driver under running
pods, or put an older one back.

An install can take minutes, so it is not one long request: the agent runs it in the background and answers
within the command's ``wait_s``, ``running`` until it has finished. Asking again joins it; once it has finished
the same attempt is answered from memory. A validation or version read that hangs (a wedged driver) is waited for
with a bound and joined by the next command, never started a second time beside it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from shared.contract.base import Event
from shared.contract.deadletter import DeadLetter
from shared.contract.driver import (
    DriverAgentAnswer,
    DriverCommandName,
    InstallDriver,
    ReadDriverVersions,
    ValidateDriver,
)
from shared.plumbing.bus import Bus
from shared.plumbing.errors import PermanentError, TemporaryError
from shared.ports.cluster import ClusterPort
from shared.ports.gpu import DriverValidation, DriverVersions, GpuError, GpuPort

from .ports import AgentUnreachable, InstallStatus
from .upgrade import NodeView, install_attempt

log = logging.getLogger(__name__)

T = TypeVar("T")
Outcome = Literal["ok", "failed", "running"]

_ANSWER_SHARE = 0.8
"""Of the caller's timeout, how much the agent may spend before it answers: the rest is for the round trip."""
_INSTALL_WAIT_SHARE = 0.5
"""Of the caller's timeout, how long the agent waits for a running install before it answers ``running``."""


class _Busy(Exception):
    """A call of the same kind for something else is still running."""


class _OneAtATime(Generic[T]):
    """At most one call in flight: a caller asking for the same ``key`` joins it, a caller asking for another is
    told it is busy; a finished call is never reused, so every answer is at most one call old."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._key = ""
        self._task: asyncio.Future[T] | None = None

    async def run(self, key: str, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """The call's result; ``TimeoutError`` when it has not finished within ``timeout_s`` (it goes on)."""
        task = self._task
        if task is None or task.done():
            task = self._task = asyncio.ensure_future(call())
            task.add_done_callback(_retrieve)
            self._key = key
        elif key != self._key:
            raise _Busy(f"{self.what} of {self._key} is still running")
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            raise TimeoutError
        return task.result()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A call nobody waits for any more still has its exception looked at (asyncio warns otherwise)."""
    if not task.cancelled():
        task.exception()


@dataclass
class _Install:
    version: str
    attempt: str
    task: asyncio.Task[None] | None = None
    failure: str = ""

    @property
    def outcome(self) -> Outcome:
        if self.task is None or not self.task.done():
            return "running"
        return "failed" if self.failure or self.task.cancelled() else "ok"


class DriverAgent:
    """Answers driver commands for one node with that node's GPU port, reading the node's upgrade state from
    ``cluster`` before it starts an install. Idempotent per command: see the module docstring. Commands naming
    another node, and installs the node's upgrade state does not call for, are refused (dead-lettered, answered
    with the reason)."""

    def __init__(self, node: str, gpus: GpuPort, cluster: ClusterPort, *, owns_port: bool = False) -> None:
        self.node = node
        self.gpus = gpus
        self.cluster = cluster
        self.owns_port = owns_port
        self.install: _Install | None = None
        self._versions: _OneAtATime[DriverVersions] = _OneAtATime("reading the driver versions")
        self._validations: _OneAtATime[DriverValidation] = _OneAtATime("validating driver")

    async def serve(self, bus: Bus) -> None:
        """Answer this node's driver commands on ``bus`` until it closes."""
        s = bus.subjects
        await bus.serve(s.pattern("driver.install.command", node=self.node), self.on_install, (InstallDriver,))
        await bus.serve(s.pattern("driver.validate.command", node=self.node), self.on_validate, (ValidateDriver,))
        await bus.serve(s.pattern("driver.versions.command", node=self.node), self.on_versions, (ReadDriverVersions,))
        log.info("driver agent serving", extra={"node": self.node, "simulated": self.gpus.simulated})

    def status(self) -> dict[str, str]:
        if self.install is None:
            return {}
        return {"version": self.install.version, "attempt": self.install.attempt, "outcome": self.install.outcome}

    # -- commands -------------------------------------------------------------------------------------------------
    async def on_install(self, command: InstallDriver) -> DriverAgentAnswer:
        """Start the install, or join the one of the same version that runs (whatever its attempt), or answer a
        finished attempt from memory; a running install of another version is left alone and answered as such.
        A new install starts only when the node's upgrade state calls for this attempt (``_called_for``)."""
        self._own(command.node)
        current = self.install
        if current is None or (current.outcome != "running" and current.attempt != command.attempt):
            await self._called_for(command)
            current = self.install = _Install(command.version, command.attempt)
            current.task = asyncio.create_task(self._installing(current, command.timeout_s))
            log.info(
                "installing driver",
                extra={"node": self.node, "version": command.version, "attempt": command.attempt},
            )
        elif current.outcome == "running" and current.version != command.version:
            return self._answer(
                "install",
                "running",
                f"installing {current.version} first (attempt {current.attempt}); {command.version} waits for it",
            )
        assert current.task is not None
        await asyncio.wait({current.task}, timeout=command.wait_s)
        outcome = current.outcome
        if outcome == "ok":
            return self._answer("install", "ok", driver_version=current.version)
        if outcome == "failed":
            return self._answer("install", "failed", current.failure or "the install was stopped")
        return self._answer("install", "running", f"installing {current.version} on {self.node}")

    async def _installing(self, install: _Install, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.gpus.install_driver(install.version), timeout_s)
        except TimeoutError:
            install.failure = f"did not finish within {timeout_s:g}s on {self.node}; stopped"
        except GpuError as exc:
            install.failure = str(exc) or type(exc).__name__
        except Exception as exc:
            log.exception("driver install crashed", extra={"node": self.node, "version": install.version})
            install.failure = f"{type(exc).__name__}: {exc}"
        if install.failure:
            log.error("driver install failed", extra={"node": self.node, "reason": install.failure})
        else:
            log.info("driver installed", extra={"node": self.node, "version": install.version})

    async def on_validate(self, command: ValidateDriver) -> DriverAgentAnswer:
        self._own(command.node)
        expected = command.expected_version
        try:
            result = await self._validations.run(
                expected, lambda: self.gpus.validate_driver(expected), command.timeout_s
            )
        except TimeoutError:
            return self._answer(
                "validate", "failed", f"validating {expected} has not finished within {command.timeout_s:g}s"
            )
        except (_Busy, GpuError) as exc:
            return self._answer("validate", "failed", str(exc))
        return self._answer(
            "validate",
            "ok" if result.ok else "failed",
            result.reason,
            driver_version=result.version,
            visible_gpus=result.visible_gpus,
        )

    async def on_versions(self, command: ReadDriverVersions) -> DriverAgentAnswer:
        self._own(command.node)
        try:
            versions = await self._versions.run("", self.gpus.versions, command.timeout_s)
        except TimeoutError:
            return self._answer(
                "versions", "failed", f"reading the driver versions has not finished within {command.timeout_s:g}s"
            )
        except (_Busy, GpuError) as exc:
            return self._answer("versions", "failed", str(exc))
        return self._answer("versions", "ok", driver_version=versions.driver, cuda_version=versions.cuda)

    async def _called_for(self, command: InstallDriver) -> None:
        """Raise ``PermanentError`` unless the node is in ``pod-restart-required`` under ``command.attempt`` (the
        node and when it entered the state: ``upgrade.install_attempt``); ``TemporaryError`` when the node cannot
        be read now (the coordinator asks again on its next pass)."""
        try:
            info = await self.cluster.node(self.node)
        except Exception as exc:
            raise TemporaryError(f"cannot read node {self.node}'s upgrade state: {exc}") from exc
        if info is None:
            raise PermanentError(f"node {self.node} is not in the cluster: no install")
        view = NodeView(name=info.name, labels=info.labels, annotations=info.annotations)
        if view.state != "pod-restart-required":
            raise PermanentError(
                f"install of {command.version} (attempt {command.attempt}) refused: node {self.node} is in "
                f"{view.state or 'no upgrade state'}, not pod-restart-required"
            )
        current = install_attempt(view)
        if current != command.attempt:
            raise PermanentError(
                f"install of {command.version} (attempt {command.attempt}) refused: the node's current attempt is "
                f"{current}"
            )

    def _own(self, node: str) -> None:
        if node != self.node:
            raise PermanentError(f"node={node!r}: this driver agent serves {self.node!r}")

    def _answer(
        self,
        command: DriverCommandName,
        outcome: Outcome,
        reason: str = "",
        *,
        driver_version: str = "",
        cuda_version: str = "",
        visible_gpus: int = 0,
    ) -> DriverAgentAnswer:
        return DriverAgentAnswer(
            node=self.node,
            command=command,
            outcome=outcome,
            reason=reason,
            driver_version=driver_version,
            cuda_version=cuda_version,
            visible_gpus=visible_gpus,
        )

    async def close(self) -> None:
        """Stop what runs (an install is stopped: its process is killed) and close the port if this agent owns it."""
        if self.install is not None and self.install.task is not None:
            self.install.task.cancel()
            await asyncio.gather(self.install.task, return_exceptions=True)
        self._versions.cancel()
        self._validations.cancel()
        if self.owns_port:
            await self.gpus.close()


class BusNodeDriver:
    """``NodeDriver`` over the bus: one node's driver agent, asked by request/reply. Every call answers within
    ``timeout_s`` or raises ``AgentUnreachable`` naming the node; a refused command raises ``GpuError``."""

    def __init__(self, bus: Bus, node: str, timeout_s: float = 10.0) -> None:
        self.bus = bus
        self.node = node
        self.timeout_s = timeout_s

    async def versions(self) -> DriverVersions:
        answer = await self._ask(ReadDriverVersions(node=self.node, timeout_s=self._answer_within))
        if answer.outcome != "ok":
            raise GpuError(f"{self.node}: {answer.reason}")
        return DriverVersions(driver=answer.driver_version, cuda=answer.cuda_version)

    async def install(self, version: str, attempt: str, timeout_s: float) -> InstallStatus:
        command = InstallDriver(
            node=self.node,
            version=version,
            attempt=attempt,
            timeout_s=timeout_s,
            wait_s=self.timeout_s * _INSTALL_WAIT_SHARE,
        )
        answer = await self._ask(command)
        match answer.outcome:
            case "ok":
                return InstallStatus("installed")
            case "failed":
                return InstallStatus("failed", answer.reason)
        return InstallStatus("running", answer.reason)

    async def validate(self, expected_version: str) -> DriverValidation:
        answer = await self._ask(
            ValidateDriver(node=self.node, expected_version=expected_version, timeout_s=self._answer_within)
        )
        return DriverValidation(
            ok=answer.outcome == "ok",
            version=answer.driver_version,
            visible_gpus=answer.visible_gpus,
            reason=answer.reason,
        )

    @property
    def _answer_within(self) -> float:
        return self.timeout_s * _ANSWER_SHARE

    async def _ask(self, command: Event) -> DriverAgentAnswer:
        subject = self.bus.subjects.for_event(command)
        try:
            answer = await self.bus.request(subject, command, timeout=self.timeout_s)
        except TimeoutError as exc:
            raise AgentUnreachable(f"the driver agent on {self.node} does not answer ({exc})") from None
        match answer:
            case DriverAgentAnswer():
                return answer
            case DeadLetter(reason=reason) if reason.startswith("temporary"):
                raise AgentUnreachable(f"the driver agent on {self.node} could not answer: {reason}")
            case DeadLetter(reason=reason):
                raise GpuError(f"the driver agent on {self.node} refused {command.kind}: {reason}")
        raise GpuError(f"the driver agent on {self.node} answered {answer.kind}, not driver.agent.answer")


def bus_node_drivers(bus: Bus, timeout_s: float) -> Callable[[str], BusNodeDriver]:
    """The ``NodeDrivers`` of a coordinator: each node's agent over ``bus``."""

    def driver(node: str) -> BusNodeDriver:
        return BusNodeDriver(bus, node, timeout_s)

    return driver
