"""The kubelet's side of the device plugin API as a small fake over real gRPC: registration, and reading a
plugin's ListAndWatch stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from services.device.gen import deviceplugin_pb2 as pb
from services.device.gen import deviceplugin_pb2_grpc as pb_grpc
from services.device.plugin import KUBELET_SOCKET

TIMEOUT = 10.0


class FakeKubelet(pb_grpc.RegistrationServicer):
    """The kubelet's side: serves ``Registration`` on ``kubelet.sock`` and keeps every registration, refusing a
    wrong API version as the kubelet does. ``restart`` does what a restarted kubelet does to the folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.socket = folder / KUBELET_SOCKET
        self.registrations: asyncio.Queue[pb.RegisterRequest] = asyncio.Queue()
        self.server: grpc.aio.Server | None = None

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
        await self.registrations.put(request)
        return pb.Empty()

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None
        self.socket.unlink(missing_ok=True)

    async def restart(self) -> None:
        """The kubelet removes every plugin socket and serves a new ``kubelet.sock``."""
        await self.stop()
        for path in self.folder.glob("*.sock"):
            path.unlink()
        await self.start()

    async def registration(self) -> pb.RegisterRequest:
        return await asyncio.wait_for(self.registrations.get(), TIMEOUT)

    async def registrations_for(self, count: int) -> dict[str, pb.RegisterRequest]:
        got = [await self.registration() for _ in range(count)]
        return {r.resource_name: r for r in got}


@contextlib.asynccontextmanager
async def plugin_stub(folder: Path, endpoint: str) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    async with grpc.aio.insecure_channel(f"unix://{folder / endpoint}") as channel:
        yield pb_grpc.DevicePluginStub(channel)


async def read(stream: grpc.aio.UnaryStreamCall) -> pb.ListAndWatchResponse:
    response = await asyncio.wait_for(stream.read(), TIMEOUT)
    assert response is not grpc.aio.EOF, "ListAndWatch ended"
    return response  # type: ignore[no-any-return]


def listed(response: pb.ListAndWatchResponse) -> dict[str, tuple[str, list[int]]]:
    return {d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in response.devices}
