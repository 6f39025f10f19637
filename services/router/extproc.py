"""The endpoint picker's gRPC server: Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor`` (the protocol of the
Gateway API Inference Extension's endpoint picker) and ``grpc.health.v1``, over the generated protos of the
``xds-protos`` package.

One stream is one HTTP request. The servicer is a thin translator over ``EndpointPicker``:

- request headers: with the session header present, or no body to come, the pick is answered at once in the
  headers response; otherwise the headers are let through (CONTINUE) and the pick waits for the body (the gateway
  sends it buffered: ``request_body_mode: BUFFERED``), answered in the body response;
- the pick: header ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` and the same under dynamic metadata
  ``envoy.lb``, with the route cache cleared; a refused session header is removed, so no pod acts on it; no
  endpoint: an immediate 503; shedding: an immediate 429;
- every later message (body after the pick, trailers, response phases) is let through unchanged.

A stream that breaks the protocol (a body before the headers, headers twice, a message with nothing in it) ends
with ``INVALID_ARGUMENT`` naming what was wrong; nothing the router knows changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2 as core_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .config import RouterSettings
from .handover import Handovers
from .metrics import RouterMetrics, landed_of
from .picker import EndpointPicker, Outcome, Pick, RequestFacts
from .prefetch import Prefetcher
from .reading import DESTINATION_HEADER, DESTINATION_NAMESPACE, SUBSET_HEADER, SUBSET_NAMESPACE, read_request

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_POLL_S = 1.0
MAX_DETAILS = 512
MAX_HEADER_BYTES = 64 * 1024
"""One header value read at most (Envoy's own limit on a whole header block is 60 KiB by default)."""

Clock = Callable[[], float]


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    """The request's headers, names in lower case; a value that is not UTF-8 or is oversized is left out."""
    found: dict[str, str] = {}
    for header in message.headers.headers:
        raw = header.raw_value or header.value.encode()
        if len(raw) > MAX_HEADER_BYTES:
            continue
        try:
            found[header.key.lower()] = raw.decode()
        except UnicodeDecodeError:
            continue
    return found


def _hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The candidates under dynamic metadata ``envoy.lb.subset_hint`` (a list, or one comma-separated string)."""
    if SUBSET_NAMESPACE not in request.metadata_context.filter_metadata:
        return None
    value = request.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields.get(SUBSET_HEADER)
    if value is None:
        return []
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return value.string_value.split(",")
    return []


def _answer(pick: Pick, session_header: str, removes_session: bool) -> pb.CommonResponse | pb.ImmediateResponse:
    if pick.status != 200:
        return pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=pick.status),  # type: ignore[arg-type]
            body=f"{pick.reason}\n".encode(),
            details=pick.reason[:MAX_DETAILS],
        )
    destination = ",".join(pick.endpoints)
    mutation = pb.HeaderMutation(
        set_headers=[
            core_pb.HeaderValueOption(
                header=core_pb.HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()),
                append_action=core_pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
        remove_headers=[session_header] if removes_session else [],
    )
    return pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)


def _metadata(pick: Pick) -> struct_pb2.Struct | None:
    if pick.status != 200:
        return None
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(DESTINATION_NAMESPACE)[DESTINATION_HEADER] = ",".join(pick.endpoints)
    return metadata


@dataclass
class _Exchange:
    """One stream's request, as far as it has come."""

    headers: dict[str, str] | None = None
    hint: list[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    body_too_large: bool = False
    picked: bool = False


HANDED_OVER = (Outcome.HOLDER_GONE, Outcome.UNPLACED)
"""Picks that hand a known session to a pod while no live pod holds it: the start of a handover (handover.py)."""


class ExternalProcessorServicer(pb_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        picker: EndpointPicker,
        settings: RouterSettings,
        clock: Clock = time.time,
        handovers: Handovers | None = None,
        prefetcher: Prefetcher | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.picker = picker
        self.settings = settings
        self.clock = clock
        self.handovers = handovers if handovers is not None else Handovers(settings.handover_wait_s)
        self.prefetcher = prefetcher
        self.metrics = metrics if metrics is not None else RouterMetrics(None, settings.deployment)
        self.refused_streams = 0

    async def _pick_handing_over(self, facts: RequestFacts) -> Pick:
        """The pick, held while the session is being moved (handover.py): a request of a session handed to a pod
        whose new location is not heard yet waits for it, then goes to its new holder; past the bound (from the
        handover's last renewal: ``Handovers.wait``), 503. Woken early (the handover given up, or handed
        elsewhere) it picks again: any pick but another handover is its answer, a handover nobody else started is
        started by it."""
        now = self.clock()
        pick = self.picker.pick(facts, now, count=False)  # counted once, when it is the answer
        deadline: float | None = None
        while pick.outcome in HANDED_OVER and pick.status == 200:
            handover = self.handovers.moving(facts.session, now)
            if handover is None:
                self.handovers.start(facts.session, pick.first_pod, now)
                return self.picker.count(pick)
            if deadline is None:
                deadline = handover.since + self.handovers.wait_s
            if not await self.handovers.wait(handover, deadline, self.clock):
                if self.handovers.moving(facts.session, self.clock()) is handover:
                    self.handovers.forget(facts.session)
                reason = f"session {facts.session} is being moved to {handover.pod}; its new holder is not known yet"
                return self.picker.count(Pick(Outcome.HANDOVER_TIMEOUT, status=503, reason=reason))
            now = self.clock()
            pick = self.picker.pick(facts, now, count=False)
        return self.picker.count(pick)

    async def _pick(self, exchange: _Exchange, with_body: bool) -> tuple[Pick, bool]:
        headers = exchange.headers or {}
        body = bytes(exchange.body) if with_body and not exchange.body_too_large else None
        facts: RequestFacts = read_request(headers, self.settings.session_header, body, exchange.hint)
        pick = await self._pick_handing_over(facts)
        prefetched = False
        if self.prefetcher is not None and facts.session:
            self.prefetcher.saw_request(facts.session, self.clock())
            prefetched = pick.outcome is Outcome.HOLDER and self.prefetcher.took_request(facts.session)
        self.metrics.landed(landed_of(pick, prefetched))
        exchange.picked = True
        if pick.refused_session:
            log.info("session refused; routed without it", extra={"reason": pick.refused_session[:MAX_DETAILS]})
        removes = bool(pick.refused_session) and self.settings.session_header in headers
        return pick, removes

    def _respond(self, phase: str, pick: Pick, removes_session: bool) -> pb.ProcessingResponse:
        answer = _answer(pick, self.settings.session_header, removes_session)
        if isinstance(answer, pb.ImmediateResponse):
            return pb.ProcessingResponse(immediate_response=answer)
        response = pb.ProcessingResponse(dynamic_metadata=_metadata(pick))
        if phase == "request_headers":
            response.request_headers.response.CopyFrom(answer)
        elif phase == "request_body":
            response.request_body.response.CopyFrom(answer)
        else:  # trailers: the headers are gone; the metadata still steers the load balancer
            response.request_trailers.SetInParent()
        return response

    async def _refuse(self, context: grpc.aio.ServicerContext, message: str) -> None:
        self.refused_streams += 1
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message[:MAX_DETAILS])

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange()
        async for request in request_iterator:
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                if exchange.headers is not None:
                    await self._refuse(context, "request headers came twice in one stream")
                exchange.headers = _headers(request.request_headers)
                exchange.hint = _hint(request)
                named = self.settings.session_header in exchange.headers
                if named or request.request_headers.end_of_stream:
                    yield self._respond(phase, *await self._pick(exchange, with_body=False))
                else:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif phase == "request_body":
                if exchange.headers is None:
                    await self._refuse(context, "a request body came before the request headers")
                if exchange.picked:
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                    continue
                chunk = request.request_body.body
                if len(exchange.body) + len(chunk) > self.settings.max_body_bytes:
                    exchange.body_too_large = True
                    exchange.body.clear()
                elif not exchange.body_too_large:
                    exchange.body += chunk
                if request.request_body.end_of_stream:
                    yield self._respond(phase, *await self._pick(exchange, with_body=True))
                else:
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse())
            elif phase == "request_trailers":
                if exchange.headers is None:
                    await self._refuse(context, "request trailers came before the request headers")
                if not exchange.picked:
                    yield self._respond(phase, *await self._pick(exchange, with_body=True))
                else:
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif phase == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif phase == "response_body":
                yield pb.ProcessingResponse(response_body=pb.BodyResponse())
            elif phase == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
            else:
                await self._refuse(context, "a processing request with no request in it")


class RouterServer:
    """The grpc.aio server; ``start()`` binds and returns the port (a free one for port 0)."""

    def __init__(
        self,
        servicer: ExternalProcessorServicer,
        settings: RouterSettings,
        serving: Callable[[], bool] = lambda: True,
    ) -> None:
        self.settings = settings
        self.serving = serving
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if settings.share_port else 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        host, port = self.settings.listen
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = self.server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"GPUWARDEN_ROUTER_ADDR={address}: cannot listen there")
        await self.server.start()
        await self._set_health(self.serving())
        self._health_task = asyncio.create_task(self._follow_health(), name="router-grpc-health")
        log.info("endpoint picker serving", extra={"grpc": f"{host}:{bound}"})
        return bound

    async def _set_health(self, ok: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _follow_health(self) -> None:
        """SERVING while the router follows the bus: without it, what it knows of sessions goes stale."""
        last = self.serving()
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            now = self.serving()
            if now != last:
                await self._set_health(now)
                last = now

    async def stop(self, grace: float = 1.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
