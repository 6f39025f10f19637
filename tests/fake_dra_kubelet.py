"""The kubelet's side of DRA as a small fake over real gRPC: its plugin watcher (finds a registration socket in the
``plugins_registry`` folder, asks ``GetInfo``, answers ``NotifyRegistrationStatus``) and its DRA manager (dials the
endpoint the plugin named and calls ``NodePrepareResources`` / ``NodeUnprepareResources``). A restarted kubelet is
a new ``FakeDraKubelet`` on the same folder: it knows nothing and finds the sockets that are there."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from services.device.config import DeviceSettings
from services.device.dra.slices import DRIVER_NAME
from services.device.gen import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from services.device.gen import pluginregistration_pb2 as reg_pb
from services.device.gen import pluginregistration_pb2_grpc as reg_grpc
from tests.helpers import eventually

TIMEOUT = 10.0
VERSIONS: dict[str, tuple[ModuleType, Any]] = {
    "v1": (dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginStub),
    "v1beta1": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginStub),
}


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns)


class FakeDraKubelet:
    def __init__(self, registry: Path) -> None:
        self.registry = registry
        self.info: reg_pb.PluginInfo | None = None
        self.registered_socket: tuple[int, int] | None = None

    def _new_socket(self) -> Path | None:
        for path in sorted(self.registry.glob("*-reg.sock")):
            if _inode(path) not in (None, self.registered_socket):
                return path
        return None

    async def register(self) -> reg_pb.PluginInfo:
        """Wait for a registration socket this kubelet has not registered yet, and register the plugin behind it
        as the plugin watcher does; refuses (``plugin_registered`` False) a plugin offering no DRA service it
        speaks."""
        path: Path = await eventually(self._new_socket, TIMEOUT)
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=TIMEOUT)
            usable = info.type == "DRAPlugin" and any(f"{v}.DRAPlugin" in info.supported_versions for v in VERSIONS)
            await stub.NotifyRegistrationStatus(
                reg_pb.RegistrationStatus(plugin_registered=usable, error="" if usable else "no DRA service"),
                timeout=TIMEOUT,
            )
        self.registered_socket = _inode(path)
        self.info = info
        return info

    async def call(self, method: str, claims: list[tuple[str, str, str]], version: str = "v1") -> Any:
        """``method`` (``NodePrepareResources`` or ``NodeUnprepareResources``) for (namespace, uid, name) claims."""
        assert self.info is not None, "not registered"
        pb, stub_class = VERSIONS[version]
        request_class = getattr(pb, f"{method}Request")
        request = request_class(claims=[pb.Claim(namespace=n, uid=u, name=c) for n, u, c in claims])
        async with grpc.aio.insecure_channel(f"unix://{self.info.endpoint}") as channel:
            return await getattr(stub_class(channel), method)(request, timeout=TIMEOUT)

    async def prepare(self, *claims: tuple[str, str, str], version: str = "v1") -> Any:
        return await self.call("NodePrepareResources", list(claims), version)

    async def unprepare(self, *claims: tuple[str, str, str], version: str = "v1") -> Any:
        return await self.call("NodeUnprepareResources", list(claims), version)


def dra_settings(folder: Path, **more: Any) -> DeviceSettings:
    return DeviceSettings(
        api="dra",
        plugin_dir=folder / "device-plugins",
        dra_plugin_dir=folder / "plugins" / DRIVER_NAME,
        dra_registry_dir=folder / "plugins_registry",
        kubelet_poll_s=0.05,
        cdi_dir=folder / "cdi",
        **more,
    )
