"""The gRPC server KEDA talks to: ``externalscaler.ExternalScaler`` and ``grpc.health.v1``, plain, TLS or mTLS.

The servicer is a thin translator over ``ScalerCore``: it checks the request (``INVALID_ARGUMENT`` naming the key
and what is allowed, or the limit it is over; no error quotes more than a short prefix of the request), answers
from the decision kept in memory, answers ``UNAVAILABLE`` when there is no decision to give (so KEDA's
``fallback`` applies), and on ``StreamIsActive`` sends the current state first, then every change, until KEDA
hangs up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .config import ScalerSettings
from .decision import METRIC_TARGET, Decision
from .gen import externalscaler_pb2 as pb
from .gen import externalscaler_pb2_grpc as pb_grpc
from .handlers import ScalerCore, Watch
from .trigger import TriggerError, check_metric_name

log = logging.getLogger(__name__)

SERVICE_NAME = "externalscaler.ExternalScaler"
HEALTH_POLL_S = 1.0
MAX_DETAILS = 512  # characters of an error message, whatever it says
# A KEDA that vanished without closing its connection (pod killed, node lost) answers no HTTP/2 ping: a quiet
# connection is pinged every KEEPALIVE_S and closed when a ping is not answered within KEEPALIVE_TIMEOUT_S, which
# ends its streams as a hang-up would. (A ping costs 17 bytes; KEDA shares one connection per scaler address.)
KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
# Calls that arrived and wait for the server loop to take them. gRPC's defaults (1,000, then rejection with rising
# probability up to 3,000) cancelled about a quarter of 3,000 StreamIsActive calls opened at once, as KEDA does
# when it reconnects, and each cancelled one came back after KEDA's backoff.
MAX_PENDING_CALLS = 20_000


class ExternalScalerServicer(pb_grpc.ExternalScalerServicer):
    def __init__(self, core: ScalerCore) -> None:
        self.core = core

    async def _watch(self, ref: pb.ScaledObjectRef, context: grpc.aio.ServicerContext, stream: bool = False) -> Watch:
        """The ScaledObject's watch; a stream holds it until it gives it back with ``core.release``."""
        try:
            return await self.core.watch(ref.namespace, ref.name, dict(ref.scalerMetadata), stream=stream)
        except TriggerError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort raises; this line only satisfies the type checker

    async def _decision(self, watch: Watch, context: grpc.aio.ServicerContext) -> Decision:
        decision = watch.decision
        if decision is None or not decision.available:
            self.core.unavailable += 1
            reason = decision.reason if decision else "no decision yet"
            await _abort(context, grpc.StatusCode.UNAVAILABLE, f"{'/'.join(watch.deployment)}: {reason}")
            raise AssertionError("unreachable")
        return decision

    async def IsActive(self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext) -> pb.IsActiveResponse:
        watch = await self._watch(request, context)
        decision = await self._decision(watch, context)
        return pb.IsActiveResponse(result=decision.active)

    async def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IsActiveResponse]:
        watch = await self._watch(request, context, stream=True)
        try:
            sent: bool | None = None
            while True:
                changed = watch.changed
                decision = watch.decision
                active = bool(decision and decision.available and decision.active)
                if active != sent:
                    yield pb.IsActiveResponse(result=active)
                    sent = active
                await changed.wait()
        finally:
            self.core.release(watch)

    async def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricSpecResponse:
        watch = await self._watch(request, context)
        return pb.GetMetricSpecResponse(metricSpecs=[self._spec(watch)])

    async def StreamMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GetMetricSpecResponse]:
        """The spec follows from the metadata alone, which a stream cannot change: it is sent once, and the
        stream stays open until KEDA closes it."""
        watch = await self._watch(request, context, stream=True)
        try:
            yield pb.GetMetricSpecResponse(metricSpecs=[self._spec(watch)])
            await asyncio.Event().wait()
        finally:
            self.core.release(watch)

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricsResponse:
        try:
            check_metric_name(request.metricName)
        except TriggerError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        watch = await self._watch(request.scaledObjectRef, context)
        decision = await self._decision(watch, context)
        return pb.GetMetricsResponse(
            metricValues=[
                pb.MetricValue(
                    metricName=request.metricName or watch.trigger.metric_name,
                    metricValue=decision.desired,
                    metricValueFloat=decision.metric_value,
                )
            ]
        )

    @staticmethod
    def _spec(watch: Watch) -> pb.MetricSpec:
        return pb.MetricSpec(
            metricName=watch.trigger.metric_name, targetSize=int(METRIC_TARGET), targetSizeFloat=METRIC_TARGET
        )


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call with ``code``; the message is cut to ``MAX_DETAILS`` (grpc-message travels in a header)."""
    if len(message) > MAX_DETAILS:
        message = message[: MAX_DETAILS - 3] + "..."
    await context.abort(code, message)


def server_credentials(settings: ScalerSettings) -> grpc.ServerCredentials | None:
    """TLS from the PEM files in the settings; with a client CA, clients must present a certificate it signed."""
    tls = settings.tls
    if tls.cert is None or tls.key is None:
        return None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=tls.client_ca.read_bytes() if tls.client_ca else None,
        require_client_auth=tls.client_ca is not None,
    )


class ScalerServer:
    """The grpc.aio server; ``start()`` binds and returns the port (a free one for port 0)."""

    def __init__(self, core: ScalerCore, settings: ScalerSettings, serving: Callable[[], bool] = lambda: True) -> None:
        self.core = core
        self.settings = settings
        self.serving = serving
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
                ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
                ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),  # else a ping waits 60 s for its ack
                ("grpc.http2.max_pings_without_data", 0),  # a quiet StreamIsActive sends no data for hours
                ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
            ]
        )
        pb_grpc.add_ExternalScalerServicer_to_server(ExternalScalerServicer(core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        address = f"{self.settings.host}:{self.settings.port}"
        if ":" in self.settings.host:
            address = f"[{self.settings.host}]:{self.settings.port}"
        credentials = server_credentials(self.settings)
        if credentials is None:
            port = self.server.add_insecure_port(address)
        else:
            port = self.server.add_secure_port(address, credentials)
        if port == 0:
            raise OSError(f"GPUWARDEN_SCALER_ADDR={address}: cannot listen there")
        await self.server.start()
        await self._set_health(self.serving())
        self._health_task = asyncio.create_task(self._follow_health(), name="scaler-grpc-health")
        log.info(
            "external scaler serving",
            extra={
                "grpc": f"{self.settings.host}:{port}",
                "tls": credentials is not None,
                "mtls": self.settings.tls.mutual,
            },
        )
        return port

    async def _set_health(self, ok: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _follow_health(self) -> None:
        """SERVING while the connection to NATS is up: without it the queue depth goes stale."""
        last = self.serving()
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            now = self.serving()
            if now != last:
                await self._set_health(now)
                last = now

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace: float = 1.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
