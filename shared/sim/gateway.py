"""The simulation's inference gateway: for each request, the endpoint picker (``services/router``) is asked over
Envoy's ext_proc v3 gRPC stream exactly as a gateway asks it, and its answer is read the same way.

One request is one ``Process`` stream: the request headers (method, path, and the session header), the body
announced as absent (``end_of_stream``), and the first answer read: the header ``x-gateway-destination-endpoint``
(``ip:port[,ip:port...]``, the first best, the rest for retries) set by the headers response, or an immediate
response (503: no endpoint can serve; 429: shed). The router replicas are tried in the order given, as a gateway's
cluster of endpoint pickers is: a replica that does not answer within ``timeout_s`` (killed, restarting, not
listening) is passed over for the next. When none answers, ``ask`` returns None and the caller decides
(``SimWorkload``: fail open, to its own choice, and counts it).

The settings say whether the simulation routes through a router and which deployment it picks for
(``GPUWARDEN_SIM_ROUTER``, ``GPUWARDEN_SIM_ROUTER_POOL``); without an address the workload routes by itself.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from envoy.config.core.v3 import base_pb2 as core_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from shared.plumbing.errors import SettingsError, TemporaryError
from shared.plumbing.settings import HostPort, Parse, documented, matching, parse_host_port, seconds, setting

if TYPE_CHECKING:
    from shared.sim.pods import PodRuntime

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
"""The session header the simulated gateway sends (the router's default ``GPUWARDEN_ROUTER_SESSION_HEADER``)."""
DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Where the endpoint picker answers (Gateway API Inference Extension, v1.0)."""
DESTINATION_NAMESPACE = "envoy.lb"


def _read_addresses(name: str, raw: str) -> tuple[HostPort, ...]:
    found = tuple(parse_host_port(name, part.strip(), "127.0.0.1:9002") for part in raw.split(",") if part.strip())
    if not found:
        raise SettingsError(f"{name}={raw!r}: expected host:port[,host:port...]")
    return found


@dataclass(frozen=True)
class GatewaySettings:
    router: tuple[HostPort, ...] = setting(
        "GPUWARDEN_SIM_ROUTER",
        (),
        "sim: the endpoint picker replicas (services/router's gRPC addresses, host:port[,host:port...], tried in "
        "order) that the SIMULATED gateway asks for every request of the pool's deployment; empty: the workload "
        "routes by itself",
        parse=Parse(_read_addresses, lambda value: ",".join(map(str, value))),
    )
    pool: str = setting(
        "GPUWARDEN_SIM_ROUTER_POOL",
        "llm/llama",
        "sim: the deployment (namespace/deployment) whose requests go through GPUWARDEN_SIM_ROUTER (the router's "
        "GPUWARDEN_ROUTER_POOL); other deployments' requests are routed by the workload",
        parse=matching(r"^[^/]+/[^/]+$", "expected namespace/deployment"),
    )
    timeout_s: float = setting(
        "GPUWARDEN_SIM_ROUTER_TIMEOUT_S",
        15.0,
        "sim: seconds the SIMULATED gateway waits for one router replica's answer before it asks the next (above "
        "the router's GPUWARDEN_ROUTER_HANDOVER_WAIT_S: a request may be held that long for a moved session)",
        parse=seconds(minimum=0.01, maximum=60),
    )


DOCUMENTED = documented(GatewaySettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


@dataclass(frozen=True, slots=True)
class GatewayAnswer:
    """The picker's answer to one request: the endpoints in order (status 200), or an immediate status."""

    endpoints: tuple[str, ...] = ()
    status: int = 200
    reason: str = ""


def _headers(session_id: str) -> pb.ProcessingRequest:
    headers = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
    if session_id:
        headers[SESSION_HEADER] = session_id
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=core_pb.HeaderMap(
                headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
            ),
            end_of_stream=True,
        )
    )


def read_answer(response: pb.ProcessingResponse) -> GatewayAnswer:
    """The endpoints a gateway would use from one processing response: an immediate response's status, else the
    destination header (else the same under ``envoy.lb`` dynamic metadata). No destination at all: 503, as a
    gateway configured to fail closed answers."""
    if response.HasField("immediate_response"):
        immediate = response.immediate_response
        return GatewayAnswer(status=int(immediate.status.code) or 500, reason=immediate.details)
    destination = ""
    phase = response.WhichOneof("response")
    if phase in ("request_headers", "request_body"):
        for option in getattr(response, phase).response.header_mutation.set_headers:
            if option.header.key.lower() == DESTINATION_HEADER:
                destination = (option.header.raw_value or option.header.value.encode()).decode(errors="replace")
    if not destination and DESTINATION_NAMESPACE in response.dynamic_metadata.fields:
        lb = response.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value
        if DESTINATION_HEADER in lb.fields:
            destination = lb.fields[DESTINATION_HEADER].string_value
    endpoints = tuple(e.strip() for e in destination.split(",") if e.strip())
    if not endpoints:
        return GatewayAnswer(status=503, reason="the endpoint picker named no endpoint")
    return GatewayAnswer(endpoints)


@dataclass
class GatewayStats:
    asked: int = 0
    answered: int = 0
    replica_failures: int = 0
    """Asks a replica did not answer (the next one was asked)."""
    unanswered: int = 0
    """Requests no replica answered: the caller chose by itself."""
    by_replica: dict[str, int] = field(default_factory=dict)


class GatewayClient:
    """The simulated gateway's side of ext_proc, over one gRPC channel per router replica."""

    def __init__(self, replicas: Sequence[HostPort], timeout_s: float = 15.0) -> None:
        self.replicas = [str(r) for r in replicas]
        self.timeout_s = timeout_s
        self.stats = GatewayStats()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, replica: str) -> pb_grpc.ExternalProcessorStub:
        channel = self._channels.get(replica)
        if channel is None:
            host, _, port = replica.rpartition(":")
            target = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else replica
            channel = self._channels[replica] = grpc.aio.insecure_channel(target)
        return pb_grpc.ExternalProcessorStub(channel)

    async def _ask_one(self, replica: str, session_id: str) -> GatewayAnswer:
        async def messages() -> AsyncIterator[pb.ProcessingRequest]:
            yield _headers(session_id)

        call = self._stub(replica).Process(messages(), timeout=self.timeout_s)
        try:
            async for response in call:
                return read_answer(response)
        finally:
            call.cancel()
        return GatewayAnswer(status=503, reason="the endpoint picker closed the stream without an answer")

    async def ask(self, session_id: str) -> GatewayAnswer | None:
        """The picker's answer for one request of ``session_id`` ('' for none), from the first replica that gives
        one; None when no replica answers."""
        self.stats.asked += 1
        for replica in self.replicas:
            try:
                answer = await self._ask_one(replica, session_id)
            except (TimeoutError, grpc.aio.AioRpcError, OSError) as exc:
                self.stats.replica_failures += 1
                detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                log.info("router replica did not answer", extra={"router": replica, "error": detail})
                continue
            self.stats.answered += 1
            self.stats.by_replica[replica] = self.stats.by_replica.get(replica, 0) + 1
            return answer
        self.stats.unanswered += 1
        return None

    async def close(self) -> None:
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._channels.clear()


@dataclass
class Landings:
    """Where the picker's first choice sent requests, as the pods found it: to the pod holding the session, to a
    pod that did not while another live pod did (``to_non_holder``: a session split or a refused claim), or to
    any pod when none held it (``cold``: it is restored there, or started)."""

    holder: int = 0
    to_non_holder: int = 0
    cold: int = 0
    next_endpoint: int = 0
    """Requests whose first endpoint was no usable pod, served by a later one of the list (a gateway's retry)."""
    no_usable_endpoint: int = 0
    refused: dict[int, int] = field(default_factory=dict)
    """Immediate answers by status (503, 429): the request is delivered again later."""
    fell_back: int = 0
    """Requests no router replica answered: routed by the workload's own choice (failing open)."""
    wrong_version: int = 0
    """Requests whose first endpoint was a serving pod that does not hold the session's model version (its
    checkpoint could not be restored there): served by a later endpoint that does."""


class GatewayRouting:
    """The routing seam of ``SimWorkload`` for one pool: the picker's endpoints mapped back to the simulated pods
    (by IP: a simulated pod serves on one port), the first that can serve the session taken."""

    def __init__(self, client: GatewayClient, pool: str) -> None:
        self.client = client
        self.namespace, _, self.deployment = pool.partition("/")
        self.landings = Landings()

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> GatewayRouting | None:
        if not settings.router:
            return None
        return cls(GatewayClient(settings.router, settings.timeout_s), settings.pool)

    def routes(self, namespace: str, deployment: str) -> bool:
        return namespace == self.namespace and deployment == self.deployment

    async def choose(
        self, session_id: str, candidates: Sequence[PodRuntime], serving: Sequence[PodRuntime] = ()
    ) -> PodRuntime | None:
        """The first of the picker's endpoints that is one of ``candidates`` (the pods that may serve the session
        now: those holding its model version, of the pool's ``serving`` pods); None when no router replica
        answered. ``TemporaryError`` (the request is delivered again) when the picker refused it (503, 429) or
        named no pod that can serve it."""
        answer = await self.client.ask(session_id)
        if answer is None:
            self.landings.fell_back += 1
            return None
        if answer.status != 200:
            self.landings.refused[answer.status] = self.landings.refused.get(answer.status, 0) + 1
            delay = 1.0 if answer.status == 429 else 0.5
            raise TemporaryError(f"the endpoint picker answered {answer.status}: {answer.reason}", delay=delay)
        by_ip = {r.info.ip: r for r in candidates if r.info.ip}
        for position, endpoint in enumerate(answer.endpoints):
            ip = endpoint.rpartition(":")[0].strip("[]")
            chosen = by_ip.get(ip)
            if chosen is None:
                if not position and any(r.info.ip == ip for r in serving):  # serving, not of the session's version
                    self.landings.wrong_version += 1
                continue
            if position:
                self.landings.next_endpoint += 1
            holders = [r for r in candidates if session_id in r.agent.sessions()]
            if chosen in holders:
                self.landings.holder += 1
            elif holders:
                self.landings.to_non_holder += 1
            else:
                self.landings.cold += 1
            return chosen
        self.landings.no_usable_endpoint += 1
        raise TemporaryError(f"no endpoint the picker named is a serving pod: {','.join(answer.endpoints)}", delay=0.5)

    def status(self) -> dict[str, object]:
        stats, landed = self.client.stats, self.landings
        return {
            "pool": f"{self.namespace}/{self.deployment}",
            "routers": list(self.client.replicas),
            "asked": stats.asked,
            "replica_failures": stats.replica_failures,
            "answered_by": dict(stats.by_replica),
            "landed": {"holder": landed.holder, "to_non_holder": landed.to_non_holder, "cold": landed.cold},
            "next_endpoint": landed.next_endpoint,
            "wrong_version": landed.wrong_version,
            "no_usable_endpoint": landed.no_usable_endpoint,
            "refused": {str(k): v for k, v in landed.refused.items()},
            "fell_back": landed.fell_back,
        }

    async def close(self) -> None:
        await self.client.close()
