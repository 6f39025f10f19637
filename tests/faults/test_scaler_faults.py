"""Faults users found in the KEDA scaler, reproduced over real gRPC sockets, with real NATS behind the scaler.

1. ``StreamIsActive`` streams that KEDA dropped (reconnecting) left their ScaledObjects watched and their queues
   polled for the 15-minute idle limit. A stream's end must be noticed and, when nothing else uses the
   ScaledObject, its watch and queue released within a refresh or two; the count of what the scaler holds is
   read where operators read it (``/healthz`` ``following``, Prometheus ``gpuwarden_scaler_*``). Streams are
   dropped here by cancelling them, by closing their connections, before their first answer, and behind a relay
   that goes silent (a KEDA that vanished: only keepalive pings can tell). A burst of streams opened at once,
   as KEDA reconnecting opens them, must be served whole: gRPC's pending-call limit cancelled part of it.
2. A 1 MB metadata value was echoed back in the error, which made the answer ``RESOURCE_EXHAUSTED`` instead of
   ``INVALID_ARGUMENT``. Oversized metadata (``services/scaler/trigger.py`` has the limits) must be refused as
   ``INVALID_ARGUMENT`` with a short message naming the key and the limit, and no error may echo more than a
   short prefix of what the caller sent.

No timing is asserted: conditions are awaited with a timeout, and "within two refreshes" is counted in the
scaler's refresh loop iterations.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from services.scaler import grpcserver
from services.scaler.gen import externalscaler_pb2 as pb
from services.scaler.gen import externalscaler_pb2_grpc as pb_grpc
from services.scaler.trigger import MAX_KEY_BYTES, MAX_KEYS, MAX_NAME_BYTES, MAX_VALUE_BYTES
from shared.adapters.httpclient import http_get
from shared.host.runner import RunningService
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from tests.helpers import eventually
from tests.scalerkit import ref, serving_consumer, start_scaler

REFRESH_S = 0.25
STREAMS = 200  # ScaledObjects on external-push, one stream each
QUEUES = 20  # the deployments they scale: the queues polled for them
CHANNELS = 4  # KEDA's connections
BURST = 2500  # streams opened at once


async def following(running: RunningService) -> dict[str, int]:
    """What the scaler holds, as ``/healthz`` reports it."""
    status, body = await http_get(f"http://127.0.0.1:{running.http_port}/healthz", 5)
    assert status == 200
    return {key: int(n) for key, n in json.loads(body)["following"].items()}


def held(f: dict[str, int]) -> tuple[int, int, int]:
    return f["scaled_objects"], f["queues"], f["streams"]


async def after_refreshes(running: RunningService, n: int) -> dict[str, int]:
    """``following`` once ``n`` more refreshes of the scaler have completed than when called."""
    start = (await following(running))["refreshes"]

    async def counted() -> dict[str, int] | None:
        now = await following(running)
        return now if now["refreshes"] >= start + n else None

    result: dict[str, int] = await eventually(counted, timeout=30)
    return result


async def streams_open(running: RunningService, n: int) -> None:
    async def reached() -> bool:
        return (await following(running))["streams"] == n

    await eventually(reached, timeout=30)


# -- 1. streams KEDA dropped --------------------------------------------------------------------------------------
async def test_streams_keda_dropped_release_their_watches_and_queues_within_two_refreshes(
    settings: Settings, bus: Bus
) -> None:
    service, running, _, _ = await start_scaler(settings, refresh_s=REFRESH_S)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") for _ in range(CHANNELS)]
    stubs = [pb_grpc.ExternalScalerStub(channel) for channel in channels]
    try:
        await serving_consumer(bus)
        assert (await stubs[0].IsActive(ref("polled"))).result is False  # KEDA polls this one: it stays
        before = await following(running)
        assert held(before) == (1, 1, 0)

        calls = [
            stubs[i % CHANNELS].StreamIsActive(ref(f"push-{i}", deployment=f"push-{i % QUEUES}"))
            for i in range(STREAMS)
        ]
        firsts = await asyncio.wait_for(asyncio.gather(*(call.read() for call in calls)), 60)
        assert {reply.result for reply in firsts} == {False}
        assert held(await following(running)) == (1 + STREAMS, 1 + QUEUES, STREAMS)
        _, metrics = await http_get(f"http://127.0.0.1:{running.http_port}/metrics", 5)
        assert f"gpuwarden_scaler_streams {float(STREAMS)}" in metrics.decode()

        # KEDA reconnects: the streams of its first connection are cancelled one by one, the other connections
        # are closed under their streams.
        for call in calls[::CHANNELS]:
            call.cancel()
        for channel in channels[1:]:
            await channel.close()
        await streams_open(running, 0)  # every end noticed

        after = await after_refreshes(running, 2)
        assert held(after) == held(before)
        health = (await http_get(f"http://127.0.0.1:{running.http_port}/healthz", 5))[1]
        assert list(json.loads(health)["scaled_objects"]) == ["llm/polled"]
        _, metrics = await http_get(f"http://127.0.0.1:{running.http_port}/metrics", 5)
        assert "gpuwarden_scaler_queues 1.0" in metrics.decode()

        # Nothing kept growing: the same ScaledObjects streaming again hold the same again, and no more.
        again = [stubs[0].StreamIsActive(ref(f"push-{i}", deployment=f"push-{i % QUEUES}")) for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(call.read() for call in again)), 60)
        assert held(await following(running)) == (1 + STREAMS, 1 + QUEUES, STREAMS)
        for call in again:
            call.cancel()
        await streams_open(running, 0)
        assert held(await after_refreshes(running, 2)) == held(before)
    finally:
        for channel in channels:
            await channel.close()
        await running.stop(grace=1)


async def test_streams_dropped_before_their_first_answer_release_their_watches(settings: Settings) -> None:
    """No requests stream exists, so the first queue read fails and each new stream waits for it (up to the
    first-read timeout) before its first answer; KEDA hangs up during that wait."""
    service, running, _, _ = await start_scaler(settings, refresh_s=REFRESH_S)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        before = await following(running)
        assert held(before) == (0, 0, 0)
        calls = [stub.StreamIsActive(ref(f"early-{i}", deployment=f"early-{i % 5}")) for i in range(50)]
        await streams_open(running, 50)
        for call in calls:
            call.cancel()
        await streams_open(running, 0)
        assert held(await after_refreshes(running, 2)) == held(before)
    finally:
        await channel.close()
        await running.stop(grace=1)


async def test_a_burst_of_streams_as_keda_reconnecting_opens_them_all_is_served_whole(settings: Settings) -> None:
    """gRPC's default limit on calls waiting for the server (1,000, then rejection with rising probability)
    cancelled a part of such a burst, and KEDA came back with each after its backoff."""
    service, running, _, _ = await start_scaler(settings, refresh_s=REFRESH_S)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        calls = [stub.StreamIsActive(ref(f"burst-{i}", deployment=f"burst-{i % 10}")) for i in range(BURST)]
        replies = await asyncio.wait_for(asyncio.gather(*(c.read() for c in calls), return_exceptions=True), 120)
        failed = [r for r in replies if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} of {BURST} failed: {failed[0]!r}"
        assert held(await following(running)) == (BURST, 10, BURST)
        for call in calls:
            call.cancel()
        await streams_open(running, 0)
        assert held(await after_refreshes(running, 2)) == (0, 0, 0)
    finally:
        await channel.close()
        await running.stop(grace=1)


class SilentProxy:
    """A TCP relay to the scaler that can go silent: after ``silence()`` it forwards nothing either way and
    keeps both connections open, as a KEDA pod that vanished (or a lost node) leaves them."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silent = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [client_w, server_w]
        for source, sink in ((client_r, server_w), (server_r, client_w)):
            task = asyncio.create_task(self._pump(source, sink))
            self._tasks.add(task)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            if self.silent.is_set():
                return
            sink.write(data)
            await sink.drain()

    def silence(self) -> None:
        self.silent.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()


async def test_streams_of_a_keda_that_vanished_without_hanging_up_end_and_release_their_watches(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No FIN, no RST: only the scaler's keepalive pings, unanswered, can tell (shortened here)."""
    monkeypatch.setattr(grpcserver, "KEEPALIVE_S", 0.5)
    monkeypatch.setattr(grpcserver, "KEEPALIVE_TIMEOUT_S", 0.5)
    service, running, _, _ = await start_scaler(settings, refresh_s=REFRESH_S)
    proxy = SilentProxy(service.port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{await proxy.start()}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        before = await following(running)
        calls = [stub.StreamIsActive(ref(f"gone-{i}", deployment=f"gone-{i % 5}")) for i in range(50)]
        await asyncio.wait_for(asyncio.gather(*(call.read() for call in calls)), 60)
        assert held(await following(running)) == (50, 5, 50)
        proxy.silence()
        await streams_open(running, 0)
        assert held(await after_refreshes(running, 2)) == held(before)
    finally:
        await proxy.close()
        await channel.close()
        await running.stop(grace=1)


# -- 2. oversized metadata ----------------------------------------------------------------------------------------
MIB = 1 << 20
SHORT = 512  # no error message is longer than this


@pytest.fixture
async def stub(settings: Settings) -> AsyncIterator[pb_grpc.ExternalScalerStub]:
    service, running, _, _ = await start_scaler(settings, refresh_s=REFRESH_S)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    yield pb_grpc.ExternalScalerStub(channel)
    await channel.close()
    await running.stop(grace=1)


Rpc = Callable[[pb_grpc.ExternalScalerStub, pb.ScaledObjectRef], Awaitable[object]]


async def _stream_first(stub: pb_grpc.ExternalScalerStub, so: pb.ScaledObjectRef) -> object:
    call = stub.StreamIsActive(so)
    try:
        return await call.read()
    finally:
        call.cancel()


RPCS: dict[str, Rpc] = {
    "IsActive": lambda stub, so: stub.IsActive(so, timeout=30),
    "StreamIsActive": _stream_first,
    "GetMetricSpec": lambda stub, so: stub.GetMetricSpec(so, timeout=30),
    "GetMetrics": lambda stub, so: stub.GetMetrics(
        pb.GetMetricsRequest(scaledObjectRef=so, metricName="m"), timeout=30
    ),
}


async def refused(rpc: Rpc, stub: pb_grpc.ExternalScalerStub, so: pb.ScaledObjectRef) -> str:
    """The details of the ``INVALID_ARGUMENT`` the call must end with."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await rpc(stub, so)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.code()
    details = info.value.details() or ""
    assert len(details) <= SHORT, len(details)
    return details


OVERSIZED = {
    "a 1 MiB value of a scaler key": ({"gpuUtilTarget": "7" * MIB}, ["gpuUtilTarget", f"{MAX_VALUE_BYTES}"], "7"),
    "a 1 MiB value of a KEDA key": ({"scalerAddress": "a" * MIB}, ["scalerAddress", f"{MAX_VALUE_BYTES}"], "a"),
    "a 1 MiB deployment name": ({"deployment": "d" * MIB}, ["deployment", f"{MAX_VALUE_BYTES}"], "d"),
    "a value over the limit in bytes, not characters": (
        {"scalerAddress": "\u00e9" * (MAX_VALUE_BYTES // 2 + 1)},
        ["scalerAddress", f"{MAX_VALUE_BYTES}"],
        "\u00e9",
    ),
    "a 1 MiB key": ({"k" * MIB: "1"}, ["kkkkkkkk", f"{MAX_KEY_BYTES}"], "k"),
    "too many keys": (  # with the three keys ref() adds: one more than allowed
        {f"key{i}": "1" for i in range(MAX_KEYS + 1 - 3)},
        [f"{MAX_KEYS + 1} keys", f"{MAX_KEYS}"],
        "1",
    ),
    "a wrong value under the limit": ({"gpuUtilTarget": "9" * MAX_VALUE_BYTES}, ["gpuUtilTarget"], "9"),
    "an unknown key under the limit": ({"q" * MAX_KEY_BYTES: "1"}, ["qqqqqqqq", "unknown key"], "q"),
    "a deployment name under the limit that is wrong": ({"deployment": "D" * MAX_VALUE_BYTES}, ["deployment"], "D"),
}


@pytest.mark.parametrize("case", list(OVERSIZED))
@pytest.mark.parametrize("rpc", list(RPCS))
async def test_oversized_metadata_is_invalid_argument_naming_the_key_and_limit_without_echoing_it(
    stub: pb_grpc.ExternalScalerStub, rpc: str, case: str
) -> None:
    metadata, words, filler = OVERSIZED[case]
    details = await refused(RPCS[rpc], stub, ref(**metadata))
    for word in words:
        assert word in details, (word, details)
    assert filler * 48 not in details  # at most a short prefix of what was sent


@pytest.mark.parametrize("rpc", list(RPCS))
async def test_oversized_scaled_object_names_are_invalid_argument(stub: pb_grpc.ExternalScalerStub, rpc: str) -> None:
    for so, field in (
        (ref("n" * MIB), "name"),
        (ref(namespace="s" * (MAX_NAME_BYTES + 1)), "namespace"),
    ):
        details = await refused(RPCS[rpc], stub, so)
        assert f"scaledObjectRef {field}" in details and f"{MAX_NAME_BYTES}" in details, details


async def test_an_oversized_metric_name_is_invalid_argument(stub: pb_grpc.ExternalScalerStub) -> None:
    request = pb.GetMetricsRequest(scaledObjectRef=ref(), metricName="m" * MIB)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetMetrics(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert "metricName" in details and f"{MAX_VALUE_BYTES}" in details and len(details) <= SHORT, details


async def test_metadata_at_the_limits_is_accepted(stub: pb_grpc.ExternalScalerStub) -> None:
    """KEDA's own keys at the value limit, KEDA's PEM keys over it (a certificate chain), and the most keys a
    valid trigger can have: all accepted."""
    so = ref(
        scalerAddress="a" * MAX_VALUE_BYTES,
        caCert="-----BEGIN CERTIFICATE-----\n" + "c" * (16 * 1024),
        tlsClientCert="-----BEGIN CERTIFICATE-----\n" + "c" * (8 * 1024),
        enableTLS="false",
        unsafeSsl="false",
        queueDepthPerReplica="4",
    )
    spec = await stub.GetMetricSpec(so, timeout=30)
    assert spec.metricSpecs[0].metricName == "gpuwarden-llm-chat"
