"""The kubelet side of DRA: the DRA plugin service (``k8s.io.kubelet.pkg.apis.dra.v1`` and ``.v1beta1``
``DRAPlugin``) on ``dra.sock`` in the driver's plugin folder, and the plugin registration service
(``pluginregistration.Registration``) on ``<driver>-reg.sock`` in the kubelet's ``plugins_registry`` folder.

Registration goes the other way round from the device plugin's: the kubelet's plugin watcher finds the
registration socket, asks ``GetInfo`` (type ``DRAPlugin``, the driver name, the DRA socket's path and the gRPC
services offered, ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin``) and reports the outcome with
``NotifyRegistrationStatus``. A restarted kubelet finds the socket again and asks again. A socket that disappears
(a wiped folder) or is replaced is served afresh, found by polling each socket's identity, so the watcher sees a new
plugin and registers it again.

The servicers translate only: ``ClaimPreparer`` decides. Every claim of a request gets an answer, a failed one its
``error``, never the whole call failing; the kubelet asks again for the failed ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import grpc

from ..gen import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from ..gen import pluginregistration_pb2 as reg_pb
from ..gen import pluginregistration_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""What ``GetInfo`` offers in ``supported_versions``: DRA names gRPC services there, newest first."""
DRA_SOCKET = "dra.sock"
STOP_GRACE_S = 1.0


class ClaimError(Exception):
    """This claim cannot be prepared or unprepared now; the message is the claim's ``error`` in the answer."""


@dataclass(frozen=True)
class PreparedDevice:
    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimPreparer(Protocol):
    async def prepare(self, namespace: str, uid: str, name: str) -> Sequence[PreparedDevice]:
        """The claim's devices on this node, their CDI spec written; ``ClaimError`` when it cannot be."""
        ...

    async def unprepare(self, namespace: str, uid: str, name: str) -> None:
        """Undo ``prepare``; nothing to undo is no error. ``ClaimError`` when it cannot be undone."""
        ...


def registration_socket(driver: str) -> str:
    return f"{driver}-reg.sock"


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class _DraServicer:
    """One version of the DRA service; ``pb`` is its generated messages module."""

    def __init__(self, preparer: ClaimPreparer, pb: ModuleType) -> None:
        self.preparer = preparer
        self.pb = pb

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        answers = await asyncio.gather(*(self._prepare(c) for c in request.claims))
        return self.pb.NodePrepareResourcesResponse(claims=dict(answers))

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        answers = await asyncio.gather(*(self._unprepare(c) for c in request.claims))
        return self.pb.NodeUnprepareResourcesResponse(claims=dict(answers))

    async def _prepare(self, claim: Any) -> tuple[str, Any]:
        try:
            devices = await self.preparer.prepare(claim.namespace, claim.uid, claim.name)
        except ClaimError as exc:
            log.warning("claim not prepared", extra={"claim": _named(claim), "error": str(exc)})
            return claim.uid, self.pb.NodePrepareResourceResponse(error=str(exc))
        return claim.uid, self.pb.NodePrepareResourceResponse(
            devices=[
                self.pb.Device(
                    request_names=[d.request] if d.request else [],
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=list(d.cdi_ids),
                )
                for d in devices
            ]
        )

    async def _unprepare(self, claim: Any) -> tuple[str, Any]:
        try:
            await self.preparer.unprepare(claim.namespace, claim.uid, claim.name)
        except ClaimError as exc:
            log.warning("claim not unprepared", extra={"claim": _named(claim), "error": str(exc)})
            return claim.uid, self.pb.NodeUnprepareResourceResponse(error=str(exc))
        return claim.uid, self.pb.NodeUnprepareResourceResponse()


def _named(claim: Any) -> str:
    return f"{claim.namespace}/{claim.name} ({claim.uid})"


class _RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraKubeletPlugin) -> None:
        self.plugin = plugin

    async def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.aio.ServicerContext) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.plugin.driver,
            endpoint=str(self.plugin.dra_socket),
            supported_versions=list(SERVICES),
        )

    async def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        self.plugin.registered = request.plugin_registered
        self.plugin.registration_error = request.error
        if request.plugin_registered:
            self.plugin.registrations += 1
            log.info("DRA plugin registered with the kubelet", extra={"driver": self.plugin.driver})
        else:
            log.error(
                "the kubelet refused the DRA plugin", extra={"driver": self.plugin.driver, "error": request.error}
            )
        return reg_pb.RegistrationStatusResponse()


class _Socket:
    """One gRPC server on one unix socket, served again when the socket file goes or is replaced."""

    def __init__(self, path: Path, add: Any) -> None:
        self.path = path
        self._add = add
        self.server: grpc.aio.Server | None = None
        self.identity: tuple[int, int, int] | None = None

    async def ensure(self) -> bool:
        """Serve unless already serving on this very socket file; True when it (re)started."""
        if self.server is not None and self.identity is not None and _identity(self.path) == self.identity:
            return False
        await self.stop(unlink=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        server = grpc.aio.server()
        self._add(server)
        try:
            bound = server.add_insecure_port(f"unix://{self.path}")
        except RuntimeError as exc:  # grpc's answer to a socket it cannot bind
            raise OSError(f"cannot serve on {self.path}: {exc}") from None
        if bound == 0:
            raise OSError(f"cannot serve on {self.path}")
        await server.start()
        self.server, self.identity = server, _identity(self.path)
        return True

    async def stop(self, unlink: bool = True) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.stop(STOP_GRACE_S)
        if unlink and self.identity is not None and _identity(self.path) == self.identity:
            self.path.unlink(missing_ok=True)
        self.identity = None


class DraKubeletPlugin:
    """Serves both sockets for the service's lifetime (``run``), answering claims through ``preparer``."""

    def __init__(
        self, driver: str, plugin_dir: Path, registry_dir: Path, preparer: ClaimPreparer, poll_s: float
    ) -> None:
        self.driver = driver
        self.dra_socket = plugin_dir / DRA_SOCKET
        self.registration_path = registry_dir / registration_socket(driver)
        self.poll_s = poll_s
        self.registered = False
        self.registration_error = ""
        self.registrations = 0
        self.serves = 0
        self.last_error = ""

        def add_dra(server: grpc.aio.Server) -> None:
            dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_DraServicer(preparer, dra_v1_pb2), server)
            dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(_DraServicer(preparer, dra_v1beta1_pb2), server)

        def add_registration(server: grpc.aio.Server) -> None:
            reg_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)

        self._dra = _Socket(self.dra_socket, add_dra)
        self._registration = _Socket(self.registration_path, add_registration)

    def describe(self) -> dict[str, Any]:
        """For /healthz."""
        return {
            "socket": str(self.dra_socket),
            "registration_socket": str(self.registration_path),
            "registered": self.registered,
            "registrations": self.registrations,
            "error": self.registration_error or self.last_error or None,
        }

    async def serve(self) -> None:
        """Serve any socket that is missing: the DRA service first, so the kubelet finds it once told of it."""
        if await self._dra.ensure():
            self.serves += 1
            log.info("DRA plugin serving", extra={"socket": str(self.dra_socket)})
        if await self._registration.ensure():
            self.registered = False
            log.info("DRA plugin registration offered", extra={"socket": str(self.registration_path)})

    async def run(self) -> None:
        """Runs until cancelled; then stops both servers and removes their sockets."""
        try:
            while True:
                try:
                    await self.serve()
                    self.last_error = ""
                except OSError as exc:
                    if str(exc) != self.last_error:
                        log.error("cannot serve the DRA plugin; trying again", extra={"error": str(exc)})
                    self.last_error = str(exc)
                await asyncio.sleep(self.poll_s)
        finally:
            await asyncio.shield(self.stop())

    async def stop(self) -> None:
        for socket in (self._registration, self._dra):
            with contextlib.suppress(Exception):
                await socket.stop()
