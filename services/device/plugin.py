"""The kubelet device plugin (v1beta1 over gRPC on unix sockets): the adapter between ``resources`` and the kubelet.

One ``DevicePlugin`` server per resource name, each on its own socket in the kubelet's device-plugins folder,
registered with the kubelet's ``Registration`` service on ``kubelet.sock`` there. The kubelet removes every
plugin socket when it restarts and re-creates ``kubelet.sock``; the plugin notices by polling the socket's
identity (inode and change time), serves its sockets again and registers again.

The servicer is a thin translator: it answers from the advertisement kept in memory, refuses bad requests with
``INVALID_ARGUMENT`` naming the IDs, and on ``ListAndWatch`` sends the full list at once and again after every
change, until the kubelet hangs up or the plugin stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from shared.contract.device import GpuDevice

from .cdi import CdiError, DriverRoot, write_cdi_spec
from .config import GPU_RESOURCE, DeviceSettings
from .gen import deviceplugin_pb2 as pb
from .gen import deviceplugin_pb2_grpc as pb_grpc
from .resources import AdvertisedDevice, AllocationError, ResourceError, advertise, allocate, preferred

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT_S = 5.0
STOP_GRACE_S = 1.0


def options() -> pb.DevicePluginOptions:
    """No PreStartContainer call is needed; GetPreferredAllocation is worth asking."""
    return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def socket_name(resource: str) -> str:
    """``nvidia.com/mig-1g.10gb`` -> ``gpuwarden-nvidia.com_mig-1g.10gb.sock``: the endpoint sent to the kubelet."""
    return "gpuwarden-" + resource.replace("/", "_") + ".sock"


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class ResourceState:
    """One resource's advertised devices. ``changed`` is set (and replaced) on every change, so a stream awaits
    the next one without missing it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.devices: dict[str, AdvertisedDevice] = {}
        self.changed = asyncio.Event()

    def set(self, devices: Sequence[AdvertisedDevice]) -> bool:
        new = {d.id: d for d in devices}
        if list(new.items()) == list(self.devices.items()):
            return False
        self.devices = new
        self.wake()
        return True

    def wake(self) -> None:
        old, self.changed = self.changed, asyncio.Event()
        old.set()


def list_response(devices: Sequence[AdvertisedDevice]) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                ID=d.id,
                health=d.health,
                topology=(pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)]) if d.numa_node is not None else None),
            )
            for d in devices
        ]
    )


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    def __init__(self, state: ResourceState, plugin: KubeletDevicePlugin) -> None:
        self.state = state
        self.plugin = plugin
        self.stopping = False

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return options()

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        sent: list[tuple[str, str, int | None]] | None = None
        while not self.stopping:
            changed = self.state.changed
            devices = list(self.state.devices.values())
            now = [(d.id, d.health, d.numa_node) for d in devices]
            if now != sent:
                yield list_response(devices)
                sent = now
            await changed.wait()

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        devices = self.state.devices
        try:
            answers = [
                preferred(
                    devices,
                    list(c.available_deviceIDs),
                    list(c.must_include_deviceIDs),
                    c.allocation_size,
                    self.state.name,
                )
                for c in request.container_requests
            ]
        except AllocationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.state.name}: {exc}")
            raise
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in answers]
        )

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        strategy = self.plugin.settings.plugin_config.device_list_strategy
        try:
            answers = allocate(
                self.state.devices, [list(c.devices_ids) for c in request.container_requests], strategy, self.state.name
            )
        except AllocationError as exc:
            log.warning("Allocate refused", extra={"resource": self.state.name, "error": str(exc)})
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.state.name}: {exc}")
            raise
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(
                    envs=a.envs, cdi_devices=[pb.CDIDevice(name=name) for name in a.cdi_devices]
                )
                for a in answers
            ]
        )

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        """``pre_start_required`` is false, so the kubelet does not call this; a call anyway has nothing to do."""
        return pb.PreStartContainerResponse()


class _Endpoint:
    """One resource's gRPC server on its socket."""

    def __init__(self, plugin: KubeletDevicePlugin, state: ResourceState) -> None:
        self.state = state
        self.path = plugin.plugin_dir / socket_name(state.name)
        self.servicer = DevicePluginServicer(state, plugin)
        self.server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, self.server)

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.server.add_insecure_port(f"unix://{self.path}") == 0:
            raise OSError(f"cannot serve the device plugin on {self.path}")
        await self.server.start()

    async def stop(self) -> None:
        self.servicer.stopping = True
        self.state.wake()
        await self.server.stop(STOP_GRACE_S)
        self.path.unlink(missing_ok=True)


class KubeletDevicePlugin:
    """The node's device plugin: ``update`` with the GPUs whenever they or their health change, ``run`` for the
    service's lifetime (serve, register, re-register after a kubelet restart; on cancel, stop and remove the
    sockets). ``pause`` advertises no devices (the MIG controller at work) until ``resume``."""

    def __init__(self, settings: DeviceSettings) -> None:
        self.settings = settings
        self.plugin_dir = settings.plugin_dir
        self.kubelet_socket = settings.plugin_dir / KUBELET_SOCKET
        self.resources: dict[str, ResourceState] = {GPU_RESOURCE: ResourceState(GPU_RESOURCE)}
        self.endpoints: dict[str, _Endpoint] = {}
        self.registrations = 0
        self.paused = False
        self.last_error = ""
        self.cdi_error = ""
        self.layout_error = ""
        self._gpus: list[GpuDevice] = []
        self._driver_version = ""
        self._kubelet: tuple[int, int, int] | None = None
        self._registered: set[str] = set()
        self._lock = asyncio.Lock()
        self._running = False

    # -- what is advertised ---------------------------------------------------------------------------------------
    async def update(self, gpus: Sequence[GpuDevice], driver_version: str | None = None) -> bool:
        """Advertise ``gpus`` (their ``healthy`` flags included), whose CDI spec mounts the files of
        ``driver_version`` (None: the last one given); True when any resource changed. Raises
        ``ResourceError`` and changes nothing when the MIG strategy cannot describe them. A resource that
        disappears stays served with no devices, so the kubelet drops its count at once. Idempotent."""
        try:
            advertised = advertise(gpus, self.settings.plugin_config)
        except ResourceError as exc:
            self.layout_error = str(exc)
            raise
        self.layout_error = ""
        async with self._lock:
            self._gpus = list(gpus)
            if driver_version is not None:
                self._driver_version = driver_version
            await self._write_cdi(gpus)
            changed = False
            for name in advertised.keys() - self.resources.keys():
                self.resources[name] = ResourceState(name)
            for name, state in self.resources.items():
                changed |= state.set(() if self.paused else advertised.get(name, ()))
            if self._running:
                await self._serve_missing()
                await self._register_missing()
        if changed:
            log.info("device plugin advertisement changed", extra={"resources": self.describe()["resources"]})
        return changed

    async def _write_cdi(self, gpus: Sequence[GpuDevice]) -> None:
        """A CDI spec that cannot be written is reported (``describe``, the log), and the GPUs are advertised
        anyway: the ``envvar`` strategy does not need it."""
        try:
            root = DriverRoot(host=self.settings.driver_root, here=self.settings.driver_root_here)
            await asyncio.to_thread(write_cdi_spec, self.settings.cdi_dir, gpus, root, self._driver_version)
            self.cdi_error = ""
        except CdiError as exc:
            if str(exc) != self.cdi_error:
                log.error("cannot write the CDI spec", extra={"error": str(exc)})
            self.cdi_error = str(exc)

    async def pause(self) -> None:
        """Every resource lists no devices until ``resume``, whatever the GPUs are (even a layout the MIG strategy
        cannot describe): the kubelet schedules nothing onto GPUs being reconfigured, and Allocate refuses."""
        async with self._lock:
            self.paused = True
            for state in self.resources.values():
                state.set(())

    async def resume(self) -> None:
        self.paused = False
        await self.update(self._gpus)

    def describe(self) -> dict[str, Any]:
        """For /healthz: each resource's device and healthy counts, and whether the kubelet has it."""
        return {
            "resources": {
                name: {
                    "devices": len(s.devices),
                    "healthy": sum(1 for d in s.devices.values() if d.healthy),
                    "registered": name in self._registered,
                }
                for name, s in self.resources.items()
            },
            "registrations": self.registrations,
            "paused": self.paused,
            "error": self.last_error or None,
            "cdi_error": self.cdi_error or None,
            "layout_error": self.layout_error or None,
        }

    # -- serving and registering ----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve and keep registered; runs until cancelled, then stops every server and removes the sockets."""
        try:
            async with self._lock:
                self._running = True
                await self._serve_missing()
            while True:
                await self.check_kubelet()
                await asyncio.sleep(self.settings.kubelet_poll_s)
        finally:
            await asyncio.shield(self._stop())

    async def check_kubelet(self) -> None:
        """Registers every resource with a kubelet it has not registered with yet. A re-created ``kubelet.sock``
        is a restarted kubelet, which removed the plugin sockets: they are served again first."""
        async with self._lock:
            identity = _identity(self.kubelet_socket)
            if identity is None:
                self._registered.clear()
                self._kubelet = None
                return
            if identity != self._kubelet:
                if self._kubelet is not None:
                    log.info(
                        "kubelet restarted; serving and registering again", extra={"socket": str(self.kubelet_socket)}
                    )
                self._registered.clear()
                self._kubelet = identity
            gone = [name for name, e in self.endpoints.items() if not e.path.exists()]
            for name in gone:
                self._registered.discard(name)
                await self.endpoints.pop(name).stop()
            await self._serve_missing()
            await self._register_missing()

    async def _serve_missing(self) -> None:
        for name, state in self.resources.items():
            if name not in self.endpoints:
                endpoint = _Endpoint(self, state)
                await endpoint.start()
                self.endpoints[name] = endpoint
                self._registered.discard(name)
                log.info("device plugin serving", extra={"resource": name, "socket": str(endpoint.path)})

    async def _register_missing(self) -> None:
        missing = [name for name in self.endpoints if name not in self._registered]
        if self._kubelet is None or not missing:
            return
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                stub = pb_grpc.RegistrationStub(channel)
                for name in missing:
                    await stub.Register(
                        pb.RegisterRequest(
                            version=API_VERSION,
                            endpoint=socket_name(name),
                            resource_name=name,
                            options=options(),
                        ),
                        timeout=REGISTER_TIMEOUT_S,
                    )
                    self._registered.add(name)
                    self.registrations += 1
                    log.info("registered with the kubelet", extra={"resource": name, "endpoint": socket_name(name)})
            self.last_error = ""
        except grpc.aio.AioRpcError as exc:
            self.last_error = (
                f"registering with the kubelet at {self.kubelet_socket}: {exc.code().name}: {exc.details()}"
            )
            log.warning("kubelet registration failed; retrying", extra={"error": self.last_error})

    async def _stop(self) -> None:
        async with self._lock:
            self._running = False
            endpoints, self.endpoints = list(self.endpoints.values()), {}
            self._registered.clear()
            self._kubelet = None
        for endpoint in endpoints:
            with contextlib.suppress(Exception):
                await endpoint.stop()
        log.info("device plugin stopped", extra={"sockets": [str(e.path) for e in endpoints]})
