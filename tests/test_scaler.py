"""The KEDA external scaler over real gRPC (stubs generated from proto/externalscaler.proto) and real NATS.

The request queue is filled with real ``InferenceRequest`` events; a workload-style durable consumer is created
and left unconsumed, so its pending count is the queue depth. Pod placement is the one fake (a Kubernetes API
cannot run here): a small class implementing the ``Placement`` port.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scaler.config import ScalerSettings, ScalerTls
from services.scaler.gen import externalscaler_pb2 as pb
from services.scaler.gen import externalscaler_pb2_grpc as pb_grpc
from services.scaler.service import ScalerService
from shared.contract.metrics import DeploymentUtilisation
from shared.contract.models import RolloutState
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.requests import InferenceRequest
from shared.contract.scaler import ScaleDecision
from shared.host.runner import RunningService, start_service
from shared.plumbing.bus import Bus
from shared.plumbing.settings import HostPort, Settings
from shared.wiring import Wiring
from tests.fake_kube_api import FakeKubeApi
from tests.fake_kube_api import pod as kube_pod
from tests.helpers import eventually
from tests.rbackit import allowed, shipped_rules
from tests.scalerkit import DEP, NS, ShiftedClock, StaticPlacement, ref, serving_consumer, start_scaler, value


@dataclass
class Harness:
    service: ScalerService
    running: RunningService
    placement: StaticPlacement
    stub: pb_grpc.ExternalScalerStub
    channel: grpc.aio.Channel
    clock: ShiftedClock
    extra: list[Any] = field(default_factory=list)


@pytest.fixture
async def scaler(settings: Settings) -> AsyncIterator[Harness]:
    service, running, placement, clock = await start_scaler(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    yield Harness(service, running, placement, pb_grpc.ExternalScalerStub(channel), channel, clock)
    await channel.close()
    await running.stop(grace=1)


async def fill(bus: Bus, n: int, namespace: str = NS, deployment: str = DEP) -> None:
    await bus.publish_many(
        [InferenceRequest(namespace=namespace, deployment=deployment, session_id=f"s{i}") for i in range(n)]
    )


def utilisation(util: float, gpus: int = 2, age_s: float = 0.0) -> DeploymentUtilisation:
    sampled = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age_s)
    return DeploymentUtilisation(
        namespace=NS, deployment=DEP, window_s=30, mean_util=util, max_util=util, gpus=gpus, sampled_at=sampled
    )


async def wait_value(h: Harness, so: pb.ScaledObjectRef, expected: float) -> None:
    async def reached() -> bool:
        return await value(h.stub, so) == expected

    await eventually(reached, timeout=5)


# -- every RPC ----------------------------------------------------------------------------------------------------
async def test_every_rpc_answers_from_the_queue_and_publishes_its_decisions(scaler: Harness, bus: Bus) -> None:
    decisions: list[ScaleDecision] = []

    async def on_decision(event: ScaleDecision) -> None:
        decisions.append(event)

    await bus.subscribe(bus.subjects.pattern("scaler.decision"), on_decision, accepts=(ScaleDecision,))
    await serving_consumer(bus)
    so = ref(queueDepthPerReplica="4")
    spec = await scaler.stub.GetMetricSpec(so)
    assert [(m.metricName, m.targetSize, m.targetSizeFloat) for m in spec.metricSpecs] == [
        ("gpuwarden-llm-chat", 1, 1.0)
    ]
    assert (await scaler.stub.IsActive(so)).result is False
    assert await value(scaler.stub, so) == 0.0

    await fill(bus, 10)
    await wait_value(scaler, so, 3.0)  # ceil(10 / 4); the HPA: ceil(3 / 1) = 3 replicas
    assert (await scaler.stub.IsActive(so)).result is True

    stream = scaler.stub.StreamMetricSpec(so)
    first = await stream.read()
    assert first.metricSpecs[0].targetSizeFloat == 1.0
    stream.cancel()

    await eventually(lambda: any(d.desired_replicas == 3 for d in decisions), timeout=5)
    last = next(d for d in decisions if d.desired_replicas == 3)
    assert last.queue_depth == 10 and "queue 10/4 -> 3" in last.reason
    assert scaler.running.ctx.health()["scaled_objects"]["llm/so"]["desired"] == 3


async def test_queue_depth_without_a_serving_consumer_counts_the_stored_requests(scaler: Harness, bus: Bus) -> None:
    so = ref(queueDepthPerReplica="1", maxReplicas="20")
    assert await value(scaler.stub, so) == 0.0
    await fill(bus, 5)  # scaled to zero: nobody consumes, the work-queue stream holds them
    await wait_value(scaler, so, 5.0)


async def test_health_service_reports_serving(scaler: Harness) -> None:
    health = health_pb2_grpc.HealthStub(scaler.channel)
    for service in ("", "externalscaler.ExternalScaler"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- StreamIsActive -----------------------------------------------------------------------------------------------
async def test_stream_is_active_sends_the_state_at_once_and_true_on_the_first_request(
    settings: Settings, bus: Bus
) -> None:
    # A 60 s refresh period: only the core subscription can bring the news within the test's timeout.
    service, running, _, _ = await start_scaler(settings, refresh_s=60)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        stub = pb_grpc.ExternalScalerStub(channel)
        await serving_consumer(bus)
        stream = stub.StreamIsActive(ref())
        assert (await asyncio.wait_for(stream.read(), 5)).result is False
        started = time.perf_counter()
        await fill(bus, 1)
        assert (await asyncio.wait_for(stream.read(), 5)).result is True
        assert time.perf_counter() - started < 5
        stream.cancel()
    finally:
        await channel.close()
        await running.stop(grace=1)


# -- metadata errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ({"deployment": ""}, "metadata deployment: missing"),
        ({"gpuUtilTarget": "lots"}, "metadata gpuUtilTarget: 'lots' is not a number"),
        ({"combine": "avg"}, "metadata combine: 'avg': expected 'max' or 'sum'"),
        ({"queueDepthPerReplica": "-1"}, "metadata queueDepthPerReplica"),
        ({"maxReplicas": "0"}, "metadata maxReplicas"),
        ({"lagThreshold": "5"}, "metadata lagThreshold: unknown key"),
    ],
)
async def test_bad_metadata_is_invalid_argument_naming_the_key(
    scaler: Harness, metadata: dict[str, str], words: str
) -> None:
    so = ref(**metadata)
    calls = [
        scaler.stub.IsActive(so),
        scaler.stub.GetMetricSpec(so),
        scaler.stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=so, metricName="m")),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (info.value.details() or "")
    stream = scaler.stub.StreamIsActive(so)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- the decision over the wire -----------------------------------------------------------------------------------
async def test_utilisation_only(scaler: Harness, bus: Bus) -> None:
    scaler.placement.pods[(NS, DEP)] = {"node-1": 2}
    so = ref(gpuUtilTarget="50", activationGpuUtil="5")
    assert await value(scaler.stub, so) == 0.0
    await bus.publish(utilisation(90))
    await wait_value(scaler, so, 4.0)  # ceil(2 x 90 / 50)
    assert (await scaler.stub.IsActive(so)).result is True


async def test_combined_max_and_sum(scaler: Harness, bus: Bus) -> None:
    scaler.placement.pods[(NS, DEP)] = {"node-1": 2}
    await serving_consumer(bus)
    by_max = ref("by-max", queueDepthPerReplica="4", gpuUtilTarget="50")
    by_sum = ref("by-sum", queueDepthPerReplica="4", gpuUtilTarget="50", combine="sum")
    assert await value(scaler.stub, by_max) == 0.0 and await value(scaler.stub, by_sum) == 0.0
    await fill(bus, 10)
    await bus.publish(utilisation(90))
    await wait_value(scaler, by_max, 4.0)  # max(ceil(10/4)=3, ceil(2x90/50)=4)
    await wait_value(scaler, by_sum, 7.0)  # 3 + 4


async def test_draining_node_adds_its_pods_until_the_verdict(scaler: Harness, bus: Bus) -> None:
    scaler.placement.pods[(NS, DEP)] = {"node-1": 2, "node-2": 1}
    await serving_consumer(bus)
    so = ref(queueDepthPerReplica="4", stabilisationWindow="0")
    await fill(bus, 4)
    await wait_value(scaler, so, 1.0)
    await bus.publish(DrainRequested(node="node-1", drain_id="d1"))
    await wait_value(scaler, so, 3.0)  # 1 + the 2 pods on node-1
    await bus.publish(DrainCompleted(node="node-1", drain_id="d1"))
    await wait_value(scaler, so, 1.0)
    assert scaler.running.ctx.status["drains_in_flight"] == {}


async def test_a_preparing_rollout_holds_the_replicas_until_it_is_switched(scaler: Harness, bus: Bus) -> None:
    scaler.placement.pods[(NS, DEP)] = {"node-1": 2, "node-2": 1}
    await serving_consumer(bus)
    so = ref(queueDepthPerReplica="4", stabilisationWindow="0")
    await fill(bus, 4)
    await wait_value(scaler, so, 1.0)
    preparing = RolloutState(namespace=NS, deployment=DEP, rollout_id="r1", phase="preparing", to_version="2")
    await bus.publish(preparing)
    await wait_value(scaler, so, 3.0)  # the three pods prepare the new version: none is taken away meanwhile
    assert scaler.running.ctx.health()["rollouts_preparing"] == {f"{NS}/{DEP}": "r1"}
    await bus.publish(RolloutState(namespace=NS, deployment=DEP, rollout_id="r0", phase="aborted"))
    await bus.publish(RolloutState(namespace=NS, deployment=DEP, rollout_id="r1", phase="switched"))
    await wait_value(scaler, so, 1.0)  # an older rollout's outcome changed nothing; this one's released it
    assert scaler.running.ctx.health()["rollouts_preparing"] == {}


async def test_stale_inputs_fall_back_as_documented(scaler: Harness, bus: Bus) -> None:
    scaler.placement.pods[(NS, DEP)] = {"node-1": 2}
    await serving_consumer(bus)
    so = ref(queueDepthPerReplica="4", gpuUtilTarget="50", utilStaleAfter="60s", queueStaleAfter="15s")
    assert await value(scaler.stub, so) == 0.0
    await bus.publish(utilisation(90, age_s=600))  # ten minutes old: stale, ignored
    await fill(bus, 8)
    await wait_value(scaler, so, 2.0)  # the queue alone
    status = scaler.running.ctx.health()["scaled_objects"]["llm/so"]
    assert "stale: gpu" in status["reason"]

    # The queue becomes unreadable (its stream is gone) and time passes: the last decision is held.
    await bus.js.delete_stream(bus.subjects.requests_stream.name)
    scaler.clock.offset = 20.0
    await eventually(lambda: "held" in scaler.running.ctx.health()["scaled_objects"]["llm/so"]["reason"], timeout=5)
    assert await value(scaler.stub, so) == 2.0

    # A ScaledObject with no fresh input and no earlier decision: UNAVAILABLE, so KEDA's fallback applies.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await value(scaler.stub, ref("other", deployment="other"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no fresh input" in (info.value.details() or "")


# -- TLS ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: bytes
    client_key: bytes
    other_ca: bytes


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _ca(common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key, now = _key(), dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(common: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, server: bool) -> tuple[bytes, bytes]:
    key, now = _key(), dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca, ca_key = _ca("gpuwarden test CA")
    other, _ = _ca("some other CA")
    server_cert, server_key = _leaf("gpuwarden-scaler", ca, ca_key, server=True)
    client_cert, client_key = _leaf("keda", ca, ca_key, server=False)
    paths = {"ca.pem": ca.public_bytes(serialization.Encoding.PEM), "tls.crt": server_cert, "tls.key": server_key}
    for name, data in paths.items():
        (tmp_path / name).write_bytes(data)
    return Pki(
        ca=tmp_path / "ca.pem",
        server_cert=tmp_path / "tls.crt",
        server_key=tmp_path / "tls.key",
        client_cert=client_cert,
        client_key=client_key,
        other_ca=other.public_bytes(serialization.Encoding.PEM),
    )


async def _health(port: int, credentials: grpc.ChannelCredentials) -> int:
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def test_mtls_accepts_the_right_ca_and_client_and_refuses_the_rest(settings: Settings, pki: Pki) -> None:
    tls = ScalerTls(cert=pki.server_cert, key=pki.server_key, client_ca=pki.ca)
    service, running, _, _ = await start_scaler(settings, tls=tls)
    ca = pki.ca.read_bytes()
    try:
        good = grpc.ssl_channel_credentials(ca, pki.client_key, pki.client_cert)
        assert await _health(service.port, good) == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{service.port}", good, options=[("grpc.ssl_target_name_override", "localhost")]
        ) as channel:
            spec = await pb_grpc.ExternalScalerStub(channel).GetMetricSpec(ref(), timeout=5)
            assert spec.metricSpecs[0].metricName == "gpuwarden-llm-chat"

        wrong_ca = grpc.ssl_channel_credentials(pki.other_ca, pki.client_key, pki.client_cert)
        no_client_cert = grpc.ssl_channel_credentials(ca)
        for credentials in (wrong_ca, no_client_cert):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _health(service.port, credentials)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=2)
    finally:
        await running.stop(grace=1)


async def test_tls_without_client_ca_serves_any_client_that_trusts_the_server(settings: Settings, pki: Pki) -> None:
    service, running, _, _ = await start_scaler(settings, tls=ScalerTls(cert=pki.server_cert, key=pki.server_key))
    try:
        trusting = grpc.ssl_channel_credentials(pki.ca.read_bytes())
        assert await _health(service.port, trusting) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _health(service.port, grpc.ssl_channel_credentials(pki.other_ca))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(grace=1)


async def test_real_backend_reads_placement_from_the_kubernetes_api(
    settings: Settings, bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backend ``real``: where the pods run comes from a pod list of the Kubernetes API (a fake API server
    speaking the real REST shapes), allowed exactly what deploy/rbac/scaler.yaml grants; the surge follows it."""
    async with FakeKubeApi() as api:
        api.add("pods", kube_pod(NS, DEP, "a1", "node-1"))
        api.add("pods", kube_pod(NS, DEP, "a2", "node-1"))
        api.add("pods", kube_pod(NS, DEP, "b1", "node-2"))
        api.add("pods", kube_pod(NS, "other", "c1", "node-1"))
        rules = shipped_rules("scaler")
        api.authorize = lambda access: allowed(access, rules)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                    "users": [{"name": "scaler", "user": {"token": "t"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "scaler"}}],
                    "current-context": "fake",
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        service = ScalerService(ScalerSettings(listen=HostPort("127.0.0.1", 0), refresh_s=0.1))
        running = await start_service(service, replace(settings, backend="real"), Wiring)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
        try:
            stub = pb_grpc.ExternalScalerStub(channel)
            await serving_consumer(bus)
            so = ref(queueDepthPerReplica="4", stabilisationWindow="0")
            await fill(bus, 4)
            await eventually(lambda: _value_is(stub, so, 1.0), timeout=5)
            await bus.publish(DrainRequested(node="node-1", drain_id="d1"))
            await eventually(lambda: _value_is(stub, so, 3.0), timeout=10)  # 1 + the 2 chat pods on node-1
            assert "placement" not in running.ctx.status
        finally:
            await channel.close()
            await running.stop(grace=1)
        assert {a.verb for a in api.used()} == {"list"} and {a.resource for a in api.used()} == {"pods"}


async def _value_is(stub: pb_grpc.ExternalScalerStub, so: pb.ScaledObjectRef, expected: float) -> bool:
    return await value(stub, so) == expected
