"""The MIG controller: makes the node's MIG layout what its ``nvidia.com/mig.config`` label asks for.

A node picks a layout of the ``mig`` configuration document by the value of its label; the planner
(``services.device.mig_plan``, pure) gives the changes that layout needs, or refuses it with a reason. This module
is the controller around it: it reads the GPUs and the document, drains the node, applies the steps, and reports.

``MigController`` is level-triggered: on every wake (the document changed, the node changed, a verdict of its
node was published, the bus reconnected, the period passed) it compares desired with actual and acts only when
they differ. While it changes the GPUs the kubelet device plugin advertises no devices at all, so nothing is
scheduled onto instances being torn down (NVIDIA's MIG manager stops its device plugin for the same reason);
afterwards the inventory is read again and the plugin advertises the new layout. Every change runs under its own
timeout (``GPUWARDEN_MIG_STEP_TIMEOUT_S``): a hung step ends in ``failed``, never in a node stuck at ``pending``.
A failed layout is tried again when the document or the label changes, or after ``GPUWARDEN_MIG_RETRY_S``.

The outcome is reported the way NVIDIA's MIG manager reports it, in the node label ``nvidia.com/mig.config.state``
(``pending`` -> ``success`` | ``failed``), with the reason of a failure in the annotation
``gpuwarden.io/mig-config-reason``, and as a ``MigConfigChanged`` event for every state reported.

NVML may list a GPU's profiles only once MIG mode is on; for such a GPU NVML's own refusal fails the step instead,
with its reason.

Destroying instances (or toggling MIG mode) stops the work on them, and the KV caches of the inference sessions in
those pods with it. So before any change the controller drains its node through the drain client
(``shared.clients.drains``), as the driver service does before an upgrade: it asks for a drain and changes nothing
until the drain's record (the checkpoint service's, asked at each pass while it waits) says ``completed``. A failed
verdict, or none within ``GPUWARDEN_MIG_DRAIN_TIMEOUT_S``, ends the layout in ``failed`` with the reason and the
GPUs as they were; the state is ``pending`` meanwhile. The node's verdict events and the bus's reconnects only wake
the controller (``VerdictWake``). One drain is asked at a time, named on the node (``MIG_DRAIN_ANNOTATION``)
before it is published, so a restarted controller asks the same drain again (the checkpoint service runs a drain
id once) instead of a second one; the annotation is removed as soon as the drain's verdict is used, so a verdict
is never used twice. ``GPUWARDEN_MIG_CHECKPOINT=off`` changes the GPUs without a drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from shared.clients.drains import Drain, DrainClient, RecordReader, VerdictReader, VerdictUnknown, VerdictWake
from shared.contract.annotations import MIG_DRAIN_ANNOTATION
from shared.contract.base import Event
from shared.contract.configdocs import MigConfig
from shared.contract.device import MigConfigChanged, MigConfigState
from shared.contract.node import DrainCompleted, DrainFailed
from shared.host.runner import ServiceContext
from shared.plumbing.configsync import VersionedConfig
from shared.plumbing.retries import CLUSTER_REWATCH
from shared.ports.cluster import ClusterError, ClusterPort, NodeInfo
from shared.ports.gpu import GpuError, GpuPort

from .config import DeviceSettings
from .mig_plan import CONFIG_DOCUMENT, LayoutRefused, MigStep, layout, plan

log = logging.getLogger(__name__)

CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"
REASON_ANNOTATION = "gpuwarden.io/mig-config-reason"
DRAIN_PREFIX = "mig-"
REQUESTED_BY = "device/mig"
DRAIN_DEADLINE_S = 25.0
"""The most the savers are given (``DrainRequested.deadline_s``): under the pods' default grace period of 30s."""
FAILED_SESSIONS_SHOWN = 5
FAILED_PASS_WAIT_S = 1.0
"""The least a reconcile pass that failed (cluster, GPUs or the drain's record not answering) waits before the
next, unless woken."""
STOP_REPORT_S = 4.0
"""The most a stop waits to report the layout ``failed``: under the 5s the service runner gives its tasks once
cancelled (a busy node's cluster and bus may take seconds to answer)."""


class StepFailed(RuntimeError):
    """A change to the GPUs failed or did not finish in time; the message names the step."""


def drain_id_for(node: str, name: str, version: int) -> str:
    """A new drain id for one attempt at layout ``name`` of document ``version`` on ``node``: readable, a subject
    token, and never the id of an earlier attempt (the checkpoint service answers an id only once)."""
    return DrainClient.new_id(f"{DRAIN_PREFIX}{node}-{name}-v{version}")


def drain_failure(verdict: DrainFailed) -> str:
    """Why a failed drain stops the layout: the checkpoint service's reason and the first sessions not saved."""
    shown = [f"{f.session_id} ({f.pod + ': ' if f.pod else ''}{f.reason})" for f in verdict.failed_sessions]
    more = len(shown) - FAILED_SESSIONS_SHOWN
    listed = "; ".join(shown[:FAILED_SESSIONS_SHOWN]) + (f"; and {more} more" if more > 0 else "")
    return f"drain {verdict.drain_id} failed, GPUs left unchanged: {verdict.reason}" + (
        f"; not saved: {listed}" if listed else ""
    )


def _cluster_failed(exc: Exception) -> bool:
    return isinstance(exc, ClusterError)


def _rewatching(exc: Exception, wait_s: float) -> None:
    log.info("node watch ended; watching again", extra={"error": str(exc), "retry_s": wait_s})


# -- applying it --------------------------------------------------------------------------------------------------
Hook = Callable[[], Awaitable[None]]


class Advertiser(Protocol):
    """What offers the node's devices to the scheduler and withdraws them while the layout changes: the kubelet
    device plugin (advertises none) and the DRA driver (taints every device of its slice ``NoSchedule``)."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...


class MigController:
    """Keeps the node's MIG layout as its label and the ``mig`` document say (see the module).

    ``run`` reconciles on every wake and every ``reconcile_s``; ``watch_cluster`` wakes it when the node changes;
    ``on_config`` when the document does. ``pause``/``resume`` withdraw and restore the devices' offer (the device
    plugin's advertisement, the DRA slice's) around the changes; ``refresh`` reads the inventory again after them.

    With ``drain_timeout_s`` every change waits for a drain of the node first (``publish`` sends the request,
    ``record`` reads its verdict: the drain client's ``RecordReader``); ``None`` changes the GPUs without one.
    ``drain_deadline_s`` is the time the savers are given, shorter than ``drain_timeout_s``."""

    def __init__(
        self,
        node: str,
        gpus: GpuPort,
        connect: Callable[[], Awaitable[ClusterPort]],
        layouts: Callable[[], VersionedConfig | None],
        publish: Callable[[Event], Awaitable[None]],
        *,
        step_timeout_s: float,
        reconcile_s: float,
        retry_s: float,
        pause: Hook | None = None,
        resume: Hook | None = None,
        refresh: Hook | None = None,
        drain_timeout_s: float | None = None,
        drain_deadline_s: float = DRAIN_DEADLINE_S,
        record: VerdictReader | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.gpus = gpus
        self._connect = connect
        self.cluster: ClusterPort | None = None
        self.layouts = layouts
        self.publish = publish
        self.step_timeout_s = step_timeout_s
        self.reconcile_s = reconcile_s
        self.retry_s = retry_s
        self._pause = pause
        self._resume = resume
        self._refresh = refresh
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline_s = drain_deadline_s
        self.drains = DrainClient(lambda event: self.publish(event), REQUESTED_BY, record, lambda: self.clock())
        self._drain: Drain | None = None
        """The drain this controller asked for its node and has not acted on yet (one at a time)."""
        self.clock = clock
        self.status: dict[str, Any] = {"state": "idle"}
        self._failed: tuple[tuple[str, int], float, str] | None = None
        self._wake = asyncio.Event()
        self._connecting = asyncio.Lock()

    def wake(self) -> None:
        self._wake.set()

    def on_verdict_heard(self, drain_id: str) -> None:
        """A verdict of this node was published (``drain_id``), or the bus reconnected (''): the pass waiting for
        the drain it names is woken to ask the drain's record; another drain's verdict wakes nothing."""
        if not drain_id or (self._drain is not None and drain_id == self._drain.drain_id):
            self.wake()

    def on_config(self, applied: VersionedConfig) -> None:
        if applied.name == CONFIG_DOCUMENT:
            self.wake()

    def describe(self) -> dict[str, Any]:
        """For /healthz: the layout asked for, its state and reason, the steps of the last change, the drain
        waited for."""
        drain = {"drain": self._drain.drain_id} if self._drain is not None else {}
        return {**self.status, **drain}

    async def _cluster(self) -> ClusterPort:
        """The cluster port, opened on first use (by whichever loop comes first: the other waits for it)."""
        async with self._connecting:
            if self.cluster is None:
                self.cluster = await self._connect()
            return self.cluster

    # -- the loops ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Runs for the service's lifetime. A cluster or GPU that does not answer is logged and tried again at
        the next wake; the loop itself never stops for it. A drain waited for wakes it when its time is up; a
        stop while waiting reports the layout ``failed`` (a restart asks the same drain again).

        Not a ``retries`` policy: this is the level-triggered cadence of a reconcile (every ``reconcile_s``, a
        failed pass after ``FAILED_PASS_WAIT_S``), whose every wait a wake (the node or the document changed) must
        cut short, and each pass decides afresh what to do rather than repeat an operation."""
        try:
            while True:
                self._wake.clear()
                wait = self.reconcile_s
                try:
                    await self.reconcile()
                    self.status.pop("error", None)
                    wait = self._until_drain_timeout()
                except (ClusterError, GpuError, VerdictUnknown) as exc:
                    self.status["error"] = f"{type(exc).__name__}: {exc}"
                    log.warning("MIG reconcile failed; trying again", extra={"error": self.status["error"]})
                    wait = max(FAILED_PASS_WAIT_S, self._until_drain_timeout())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
        except asyncio.CancelledError:
            if self._drain is not None:
                reason = f"interrupted: the device service stopped while waiting for drain {self._drain.drain_id}"
                await _on_stop(self._report_stopped(reason), reason)
            raise

    def _until_drain_timeout(self) -> float:
        if self._drain is None or self.drain_timeout_s is None:
            return self.reconcile_s
        left = self.drain_timeout_s - self.drains.waited_s(self._drain)
        return max(0.0, min(self.reconcile_s, left))

    async def _report_stopped(self, reason: str) -> None:
        info = await (await self._cluster()).node(self.node)
        if info is not None and info.labels.get(CONFIG_LABEL):
            await self._report(info, info.labels[CONFIG_LABEL], "failed", reason, force=True)

    async def watch_cluster(self) -> None:
        """Wakes ``run`` whenever this node changes (its labels among others). Runs for the service's lifetime: a
        watch that ends is watched again, at once when it brought changes, else as ``retries.CLUSTER_REWATCH``
        says."""
        while True:
            async for attempt in CLUSTER_REWATCH.tries(when=_cluster_failed, note=_rewatching):
                with attempt:
                    await self._watch_node()

    async def _watch_node(self) -> None:
        """One watch of the cluster, to its end; ``ClusterError`` when it ended before a change came."""
        changed = False
        try:
            async for change in (await self._cluster()).watch():
                changed = True
                if change.kind == "node" and change.name == self.node:
                    self.wake()
            ended = ClusterError("the watch ended")
        except ClusterError as exc:
            ended = exc
        self.wake()  # whatever happened while nobody watched is looked at
        if not changed:
            raise ended
        log.info("node watch ended; watching again", extra={"error": str(ended)})

    # -- one pass -------------------------------------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Compare the layout the node's label asks for with the GPUs, and apply it when they differ.

        Idempotent: a node already in its layout is only reported ``success`` if it is not so labelled yet, a
        refused layout only ``failed`` if it is not yet; every path ends with the state label out of
        ``pending``. No label, or no document yet (Redis not read so far): nothing is done."""
        cluster = await self._cluster()
        info = await cluster.node(self.node)
        if info is None:
            raise ClusterError(f"node {self.node!r} is not in the cluster (GPUWARDEN_NODE names this node)")
        name = info.labels.get(CONFIG_LABEL, "")
        if not name:
            await self._forget_drain(info)
            self.status = {"state": "idle", "reason": f"the node has no {CONFIG_LABEL} label"}
            return
        current = self.layouts()
        if current is None or not isinstance(current.doc, MigConfig):
            self.status = {"config": name, "state": "waiting", "reason": f"no {CONFIG_DOCUMENT!r} document yet"}
            return
        key = (name, current.version)
        devices = await self.gpus.devices()
        profiles = {g.uuid: await self.gpus.mig_profiles(g.uuid) for g in devices if g.mig_capable}
        try:
            steps = plan(name, layout(current.doc, name), devices, profiles)
        except LayoutRefused as exc:
            await self._forget_drain(info)
            await self._report(info, name, "failed", f"refused: {exc}")
            return
        if not steps:
            self._failed = None
            await self._forget_drain(info)
            await self._report(info, name, "success", "")
            return
        if self._failed is not None and self._failed[0] == key and self.clock() - self._failed[1] < self.retry_s:
            await self._report(info, name, "failed", self._failed[2])
            return
        if self.drain_timeout_s is not None and not await self._drained(info, name, key, steps):
            return
        await self._apply(info, name, key, steps)

    async def _drained(self, info: NodeInfo, name: str, key: tuple[str, int], steps: list[MigStep]) -> bool:
        """True once the checkpoint service has committed every session on the node for this change; then the
        drain is used up. Until then the layout is ``pending`` and the GPUs untouched; a failed drain, or none
        answered within ``drain_timeout_s``, ends it in ``failed`` (tried again as any failed layout is, with a
        new drain). Level-triggered: each pass moves the one drain on, asking it (again) until it is sent, then
        asking its record for the verdict (``VerdictUnknown``, raised once the layout is reported, when the record
        cannot be read: the pass is tried again soon)."""
        planned = [str(s) for s in steps]
        drain = self._drain
        if drain is None:
            adopted = info.annotations.get(MIG_DRAIN_ANNOTATION, "")
            drain_id = adopted or drain_id_for(self.node, name, key[1])
            if not adopted:
                await self.drains.name_on_node(await self._cluster(), self.node, MIG_DRAIN_ANNOTATION, drain_id)
            drain = self._drain = self.drains.follow(drain_id, self.node)
        verdict: DrainCompleted | DrainFailed | None = None
        unknown: VerdictUnknown | None = None
        if drain.published:
            try:
                verdict = await self.drains.verdict(drain.drain_id, self.node)
            except VerdictUnknown as exc:
                unknown = exc
        match verdict:
            case DrainCompleted(sessions_committed=committed):
                await self._forget_drain(info)
                log.info(
                    "drain completed; changing the GPUs", extra={"drain_id": drain.drain_id, "sessions": committed}
                )
                return True
            case DrainFailed() as verdict:
                await self._forget_drain(info)
                await self._drain_failed(info, name, key, planned, drain_failure(verdict))
                return False
        assert self.drain_timeout_s is not None
        if self.drains.waited_s(drain) >= self.drain_timeout_s:
            await self._forget_drain(info)
            reason = (
                f"drain {drain.drain_id}: no verdict from the checkpoint service within {self.drain_timeout_s:g}s "
                "(GPUWARDEN_MIG_DRAIN_TIMEOUT_S), GPUs left unchanged"
            )
            await self._drain_failed(info, name, key, planned, reason)
            return False
        waiting = f"waiting for drain {drain.drain_id}: every session on the node is saved before the GPUs change"
        await self._report(info, name, "pending", waiting, planned)
        if not drain.published:
            await self._ask(drain, name, key[1])
        elif unknown is not None:
            raise unknown
        return False

    async def _ask(self, drain: Drain, name: str, version: int) -> None:
        """Publishes the drain request; one that cannot be sent is sent at the next pass (its timeout runs on)."""
        reason = f"MIG layout {name!r} (mig document version {version}) is applied to the GPUs"
        try:
            await self.drains.ask(drain.drain_id, self.node, reason, self.drain_deadline_s)
        except Exception as exc:
            log.warning("cannot ask for the drain", extra={"error": f"{type(exc).__name__}: {exc}"})

    async def _drain_failed(
        self, info: NodeInfo, name: str, key: tuple[str, int], planned: list[str], reason: str
    ) -> None:
        self._failed = (key, self.clock(), reason)
        log.error("MIG layout failed", extra={"config": name, "reason": reason})
        await self._report(info, name, "failed", reason, planned, force=True)

    async def _forget_drain(self, info: NodeInfo) -> None:
        """No drain is waited for any more (its change is no longer wanted, or its time is up): its verdict, when
        it comes, is never used for a later change, and a restart does not ask it again."""
        if self._drain is not None:
            self.drains.forget(self._drain.drain_id)
        self._drain = None
        if MIG_DRAIN_ANNOTATION in info.annotations:
            await self.drains.clear_name(await self._cluster(), self.node, MIG_DRAIN_ANNOTATION)

    async def _apply(self, info: NodeInfo, name: str, key: tuple[str, int], steps: list[MigStep]) -> None:
        planned = [str(s) for s in steps]
        log.info("applying MIG layout", extra={"config": name, "steps": planned})
        await self._report(info, name, "pending", "", planned, force=True)
        outcome: tuple[MigConfigState, str]
        try:
            await self._hook(self._pause, "withdraw the devices (plugin, DRA slice)")
            await self._run_steps(name, steps)
            outcome = ("success", "")
        except (StepFailed, GpuError) as exc:
            outcome = ("failed", str(exc))
        except asyncio.CancelledError:
            reason = "interrupted: the device service stopped while applying the layout"
            self._failed = (key, self.clock(), reason)
            await _on_stop(self._finish(info, name, ("failed", reason), planned), reason)
            raise
        if outcome[0] == "failed":
            self._failed = (key, self.clock(), outcome[1])
        await self._finish(info, name, outcome, planned)

    async def _finish(self, info: NodeInfo, name: str, outcome: tuple[MigConfigState, str], planned: list[str]) -> None:
        """After the changes, whatever became of them: the inventory read again, the plugin back, the outcome
        reported (so no path leaves ``pending`` behind)."""
        await self._hook(self._refresh, "read the inventory again")
        await self._hook(self._resume, "offer the devices again (plugin, DRA slice)")
        state, reason = outcome
        if state == "failed":
            log.error("MIG layout failed", extra={"config": name, "reason": reason})
        await self._report(info, name, state, reason, planned, force=True)

    async def _run_steps(self, name: str, steps: Sequence[MigStep]) -> None:
        for step in steps:
            try:
                async with asyncio.timeout(self.step_timeout_s):
                    await self._step(step)
            except TimeoutError:
                raise StepFailed(f"{step}: did not finish within {self.step_timeout_s:g}s") from None
            except GpuError as exc:
                raise StepFailed(f"{step}: {exc}") from None
        current = self.layouts()
        if current is None or not isinstance(current.doc, MigConfig):
            return
        devices = await self.gpus.devices()
        profiles = {g.uuid: await self.gpus.mig_profiles(g.uuid) for g in devices if g.mig_capable}
        try:
            left = plan(name, layout(current.doc, name), devices, profiles)
        except LayoutRefused:
            return  # the document changed meanwhile; the next pass deals with the new one
        if left:
            raise StepFailed(f"the GPUs do not show the layout after every step; still different: {left[0]}")

    async def _step(self, step: MigStep) -> None:
        log.info("MIG step", extra={"step": str(step)})
        match step.action:
            case "enable" | "disable":
                await self.gpus.set_mig_mode(step.gpu_uuid, step.action == "enable")
            case "destroy":
                await self.gpus.destroy_mig_instance(step.gpu_uuid, step.instance_uuid)
            case "create":
                await self.gpus.create_mig_instance(step.gpu_uuid, step.profile)

    async def _hook(self, hook: Hook | None, what: str) -> None:
        """A hook that fails is logged: the layout and its report matter more than the plugin's pause."""
        if hook is None:
            return
        try:
            await asyncio.wait_for(hook(), self.step_timeout_s)
        except Exception as exc:
            log.warning(f"could not {what}", extra={"error": f"{type(exc).__name__}: {exc}"})

    async def _report(
        self,
        info: NodeInfo,
        name: str,
        state: MigConfigState,
        reason: str,
        steps: Sequence[str] = (),
        *,
        force: bool = False,
    ) -> None:
        """Label, annotation and event; skipped when the node already shows this state and reason (unless
        ``force``). The annotation is written before the label, so whoever sees ``failed`` finds its reason."""
        self.status = {"config": name, "state": state, "reason": reason or None, "steps": list(steps)}
        shown = (info.labels.get(STATE_LABEL, ""), info.annotations.get(REASON_ANNOTATION, ""))
        if not force and shown == (state, reason):
            return
        cluster = await self._cluster()
        if shown[1] != reason or force:
            await cluster.set_node_annotations(self.node, {REASON_ANNOTATION: reason or None})
        await cluster.set_node_labels(self.node, {STATE_LABEL: state})
        log.info("MIG config state", extra={"config": name, "state": state, "reason": reason})
        try:
            await self.publish(
                MigConfigChanged(node=self.node, config=name, state=state, reason=reason, steps=list(steps))
            )
        except Exception as exc:
            log.warning("cannot publish the MIG config state", extra={"error": f"{type(exc).__name__}: {exc}"})


async def _on_stop(report: Awaitable[None], reason: str) -> None:
    """A stop's last report, given ``STOP_REPORT_S``; one that fails or is late is logged (the node keeps its last
    state, and the restarted controller decides afresh)."""
    try:
        await asyncio.wait_for(report, STOP_REPORT_S)
    except Exception as exc:
        log.warning("cannot report the stop", extra={"reason": reason, "error": f"{type(exc).__name__}: {exc}"})


async def start_mig_controller(
    ctx: ServiceContext,
    settings: DeviceSettings,
    gpus: GpuPort,
    connect: Callable[[], Awaitable[ClusterPort]],
    advertisers: Sequence[Advertiser],
    refresh: Hook,
) -> MigController:
    """The device service's MIG controller, started: it reads the ``mig`` document through the service's config
    watcher, watches its node through the service's cluster port (``connect``; the service owns and closes it),
    withdraws the devices from the ``advertisers`` (device plugin, DRA driver) while it works, and (unless
    ``GPUWARDEN_MIG_CHECKPOINT=off``) drains the node first, woken by its node's verdict events and the bus's
    reconnects, and reading each verdict from the drain's record."""
    controller = MigController(
        ctx.node,
        gpus,
        connect,
        lambda: ctx.config.current(CONFIG_DOCUMENT),
        ctx.publish,
        step_timeout_s=settings.mig_step_timeout_s,
        reconcile_s=settings.mig_reconcile_s,
        retry_s=settings.mig_retry_s,
        pause=_each(a.pause for a in advertisers) if advertisers else None,
        resume=_each(a.resume for a in advertisers) if advertisers else None,
        refresh=refresh,
        drain_timeout_s=settings.mig_drain_timeout_s if settings.mig_checkpoint else None,
        drain_deadline_s=min(DRAIN_DEADLINE_S, settings.mig_drain_timeout_s * 0.8),
        record=RecordReader(ctx.bus),
    )
    if settings.mig_checkpoint:
        wake = await VerdictWake(ctx.bus, ctx.node, controller.on_verdict_heard).open()
        ctx.on_stop(wake.close)

    ctx.config.on_change(controller.on_config)
    ctx.status["mig"] = controller.describe
    ctx.spawn(controller.run, "mig-controller")
    ctx.spawn(controller.watch_cluster, "mig-node-watch")
    return controller


def _each(hooks: Iterable[Hook]) -> Hook:
    """One hook that runs ``hooks`` in turn."""
    listed = list(hooks)

    async def run() -> None:
        for hook in listed:
            await hook()

    return run
