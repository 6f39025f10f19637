"""The scaler's test kit: a started scaler with its placement and clock in the test's hands, ScaledObject refs, and
the workload's never-consumed durable consumer (whose pending count is the queue depth)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from nats.js import api as js_api

from services.scaler.config import ScalerSettings, ScalerTls
from services.scaler.gen import externalscaler_pb2 as pb
from services.scaler.gen import externalscaler_pb2_grpc as pb_grpc
from services.scaler.service import ScalerService
from shared.host.runner import RunningService, start_service
from shared.plumbing.bus import Bus
from shared.plumbing.settings import HostPort, Settings
from shared.wiring import Wiring

NS, DEP = "llm", "chat"


class StaticPlacement:
    """The ``Placement`` port, answered from a dict the test sets."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, int]] = {}

    async def pods_by_node(self, namespace: str, deployment: str) -> Mapping[str, int]:
        return self.pods.get((namespace, deployment), {})


class ShiftedClock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


async def start_scaler(
    settings: Settings, refresh_s: float = 0.1, tls: ScalerTls | None = None
) -> tuple[ScalerService, RunningService, StaticPlacement, ShiftedClock]:
    placement, clock = StaticPlacement(), ShiftedClock()
    service = ScalerService(
        ScalerSettings(listen=HostPort("127.0.0.1", 0), refresh_s=refresh_s, tls=tls or ScalerTls()),
        placement=placement,
        clock=clock,
    )
    running = await start_service(service, settings, Wiring)
    return service, running, placement, clock


def ref(name: str = "so", namespace: str = NS, **metadata: str) -> pb.ScaledObjectRef:
    meta = {"scalerAddress": "gpuwarden-scaler:9090", "deployment": DEP, "namespace": NS, **metadata}
    return pb.ScaledObjectRef(name=name, namespace=namespace, scalerMetadata=meta)


async def serving_consumer(bus: Bus, namespace: str = NS, deployment: str = DEP) -> None:
    """The workload's durable consumer on the queue, created and never consumed: pending grows."""
    s = bus.subjects
    await bus.ensure_stream(s.requests_stream)
    await bus.js.add_consumer(
        s.requests_stream.name,
        js_api.ConsumerConfig(
            durable_name=s.durable("workload", namespace, deployment),
            filter_subject=s.pattern("requests.inference", namespace=namespace, deployment=deployment),
            ack_policy=js_api.AckPolicy.EXPLICIT,
        ),
    )


async def value(stub: pb_grpc.ExternalScalerStub, so: pb.ScaledObjectRef) -> float:
    """The one metric value GetMetrics answers for ``so`` (as KEDA reads it: integer and float agree)."""
    reply = await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=so, metricName="s0-gpuwarden-llm-chat"))
    assert len(reply.metricValues) == 1
    metric = reply.metricValues[0]
    assert metric.metricValue == int(metric.metricValueFloat)
    return float(metric.metricValueFloat)
