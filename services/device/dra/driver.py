"""The DRA driver: keeps the node's ResourceSlice as the latest inventory says, and prepares the claims the kubelet
hands it.

``want`` records the inventory and wakes ``publish_loop``, which writes the slice only when it differs from the one
it last wrote (cost follows changes: an unchanged inventory read every few seconds writes nothing). A cluster that
cannot be reached or refuses is logged and tried again with a growing delay, with the slice wanted by then.

To prepare a claim it reads it from the cluster (the kubelet sends only its namespace, name and UID), checks that
it is the same claim (UID), that it is allocated, and that every device allocated to it from this driver's pool on
this node is one of the node's GPUs or MIG devices as now, then writes the claim's CDI spec (``claims``). Devices of
other drivers or pools in the same claim are someone else's to prepare.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec

from shared.contract.device import DeviceInventory, GpuDevice
from shared.plumbing.retries import NODE_LABELS, RetryPolicy
from shared.ports.cluster import ClusterError, ClusterPort, DeviceTaint, ResourceSlice

from ..cdi import CdiError, DriverRoot
from ..config import DeviceSettings
from ..health import GpuHealth
from .claims import ClaimSpecError, cdi_device_id, remove_claim_spec, write_claim_spec
from .kubelet import ClaimError, DraKubeletPlugin, PreparedDevice
from .slices import DRIVER_NAME, MIG_CHANGING_TAINT, devices_by_name, health_taints, node_slice

log = logging.getLogger(__name__)


class DraDriver:
    """The node's DRA driver (``gpu.gpuwarden.io``): ``want`` every inventory, ``run`` for the service's lifetime."""

    def __init__(
        self,
        settings: DeviceSettings,
        node: str,
        connect: Callable[[], Awaitable[ClusterPort]],
        *,
        retry: RetryPolicy = NODE_LABELS,
    ) -> None:
        self.settings = settings
        self.node = node
        self.driver = DRIVER_NAME
        self._connect = connect
        self._retry = retry
        self.inventory: DeviceInventory | None = None
        self.paused = False
        """The MIG controller is changing the layout: every device tainted ``MIG_CHANGING_TAINT`` until ``resume``."""
        self._health: Mapping[str, GpuHealth] = {}
        self._xids: Mapping[str, int] = {}
        self._seen: dict[str, GpuDevice] = {}
        """Every GPU seen, as last seen, by UUID: what a lost GPU's devices were."""
        self.desired: ResourceSlice | None = None
        self.published: ResourceSlice | None = None
        self.writes = 0
        self.failures = 0
        self.last_error = ""
        self._wake = asyncio.Event()
        self.kubelet = DraKubeletPlugin(
            DRIVER_NAME, settings.dra_plugin_dir, settings.dra_registry_dir, self, settings.kubelet_poll_s
        )

    # -- the slice ------------------------------------------------------------------------------------------------
    def want(
        self,
        inventory: DeviceInventory,
        health: Mapping[str, GpuHealth] | None = None,
        xids: Mapping[str, int] | None = None,
    ) -> None:
        """The slice of ``inventory``, its devices tainted by ``health`` (``slices.health_taints``). A lost GPU no
        longer in the inventory stays in the slice as last seen, tainted ``gpu-lost``, so the scheduler is told
        rather than left to notice a device gone."""
        self.inventory = inventory
        self._seen.update({g.uuid: g for g in inventory.gpus})
        health = self._health = dict(health or {})
        self._xids = dict(xids or {})
        present = {g.uuid for g in inventory.gpus}
        lost = [self._seen[u] for u, h in health.items() if h == "lost" and u not in present and u in self._seen]
        shown = msgspec.structs.replace(inventory, gpus=[*inventory.gpus, *lost]) if lost else inventory
        taints: dict[str, tuple[DeviceTaint, ...]] = dict(health_taints(health, self._xids))
        if self.paused:
            changing = DeviceTaint(MIG_CHANGING_TAINT, "", "NoSchedule")
            taints = {g.uuid: (*taints.get(g.uuid, ()), changing) for g in shown.gpus}
        wanted = node_slice(shown, taints, driver=self.driver)
        if wanted != self.desired:
            self.desired = wanted
            self._wake.set()

    async def pause(self) -> None:
        """The MIG controller begins changing the layout (its drain has saved the sessions on these devices): every
        device is tainted ``NoSchedule`` so no new claim is given one being torn down, until ``resume``."""
        self.paused = True
        if self.inventory is not None:
            self.want(self.inventory, self._health, self._xids)

    async def resume(self) -> None:
        """The layout is changed: the next inventory (read by the controller's refresh) is published untainted."""
        self.paused = False
        if self.inventory is not None:
            self.want(self.inventory, self._health, self._xids)

    def describe(self) -> dict[str, Any]:
        """For /healthz."""
        return {
            "driver": self.driver,
            "devices": len(self.desired.devices) if self.desired else 0,
            "up_to_date": self.desired is not None and self.desired == self.published,
            "writes": self.writes,
            "failures": self.failures,
            "error": self.last_error or None,
            "kubelet": self.kubelet.describe(),
        }

    async def run(self) -> None:
        """Runs for the service's lifetime: the publishing loop and the kubelet plugin."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.publish_loop())
            tasks.create_task(self.kubelet.run())

    async def publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            async for attempt in self._retry.tries(note=self._failed):
                with attempt:
                    await self.publish()

    async def publish(self) -> bool:
        """One attempt: write the wanted slice if it is not the one last written; True when it wrote."""
        desired = self.desired
        if desired is None or desired == self.published:
            return False
        cluster = await self._connect()
        wrote = await cluster.publish_resource_slice(desired)
        self.published = desired
        self.last_error = ""
        if wrote:
            self.writes += 1
            log.info("ResourceSlice published", extra={"slice": desired.name, "devices": len(desired.devices)})
        return wrote

    def _failed(self, exc: Exception, wait_s: float) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning(
            "cannot publish the ResourceSlice; trying again", extra={"error": self.last_error, "retry_s": wait_s}
        )

    # -- claims (ClaimPreparer) -----------------------------------------------------------------------------------
    async def prepare(self, namespace: str, uid: str, name: str) -> Sequence[PreparedDevice]:
        if not (namespace and uid and name):
            raise ClaimError("a claim needs its namespace, uid and name")
        try:
            claim = await (await self._connect()).resource_claim(namespace, name)
        except ClusterError as exc:
            raise ClaimError(f"cannot read ResourceClaim {namespace}/{name}: {exc}") from None
        if claim is None:
            raise ClaimError(f"ResourceClaim {namespace}/{name} does not exist")
        if claim.uid != uid:
            raise ClaimError(f"ResourceClaim {namespace}/{name} is now another claim (uid {claim.uid}, not {uid})")
        if not claim.allocated:
            raise ClaimError(f"ResourceClaim {namespace}/{name} is not allocated")
        inventory = self.inventory
        here = devices_by_name(inventory) if inventory is not None else {}
        ours = [d for d in claim.devices if d.driver == self.driver]
        elsewhere = [d.device for d in ours if d.pool != self.node]
        if elsewhere:
            raise ClaimError(f"devices {elsewhere} are in another node's pool, not {self.node!r}")
        unknown = [d.device for d in ours if d.device not in here]
        if unknown:
            raise ClaimError(f"devices {unknown} are not on node {self.node!r} (its devices: {sorted(here)})")
        chosen = [(d.device, *here[d.device]) for d in ours]
        try:
            await asyncio.to_thread(
                write_claim_spec,
                self.settings.cdi_dir,
                uid,
                chosen,
                DriverRoot(host=self.settings.driver_root, here=self.settings.driver_root_here),
                inventory.driver_version if inventory is not None else "",
            )
        except (CdiError, ClaimSpecError) as exc:
            raise ClaimError(str(exc)) from None
        return [PreparedDevice(d.request, d.pool, d.device, (cdi_device_id(uid, d.device),)) for d in ours]

    async def unprepare(self, namespace: str, uid: str, name: str) -> None:
        try:
            await asyncio.to_thread(remove_claim_spec, self.settings.cdi_dir, uid)
        except (CdiError, ClaimSpecError) as exc:
            raise ClaimError(str(exc)) from None
