"""The router as the inference gateway sees it: Envoy ext_proc v3 over a real gRPC socket (the generated messages of
``xds-protos``), real NATS, and a fake Kubernetes API server (the real REST shapes) for the pool's pods, allowed
exactly what deploy/rbac/router.yaml grants."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2 as core_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from services.router.config import RouterSettings
from services.router.config import load as load_router_settings
from services.router.deletioncost import rounded
from services.router.extproc import SERVICE_NAME
from services.router.handover import Handovers
from services.router.picker import EndpointPicker, RequestFacts
from services.router.prefetch import Prefetcher
from services.router.service import RouterService
from shared.contract.annotations import POD_DELETION_COST_ANNOTATION as DELETION_COST
from shared.contract.load import PodLoad
from shared.contract.permissions import may_publish, may_subscribe, service_permissions
from shared.contract.sessions import PrefetchSessions, SessionLocation, SessionsPrefetched
from shared.contract.subjects import Subjects
from shared.host.runner import RunningService, start_service
from shared.plumbing.bus import Bus
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import HostPort, Settings
from shared.ports.cluster import PodInfo
from shared.wiring import Wiring
from tests.fake_kube_api import FakeKubeApi
from tests.fake_kube_api import node as kube_node
from tests.fake_kube_api import pod as kube_pod
from tests.helpers import eventually
from tests.rbackit import allowed, shipped_rules

NS, DEP = "llm", "llama"
PODS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
SESSION_HEADER = "x-session-id"
ROUTER_RBAC = Path(__file__).resolve().parents[1] / "deploy" / "router" / "rbac.yaml"


def pod_name(suffix: str) -> str:
    return f"{DEP}-5d4f8c7b9-{suffix}"


def endpoint(suffix: str) -> str:
    return f"{PODS[suffix]}:8000"


def serving_pod(suffix: str, deployment: str = DEP, ip: str | None = None) -> dict[str, Any]:
    obj = kube_pod(NS, deployment, suffix, "node-1")
    obj["status"]["podIP"] = ip or PODS[suffix]
    obj["status"]["containerStatuses"] = [{"name": "server", "restartCount": 0}]
    return obj


@dataclass
class Mesh:
    api: FakeKubeApi
    bus: Bus
    service: RouterService
    running: RunningService
    stub: pb_grpc.ExternalProcessorStub
    channel: grpc.aio.Channel

    @property
    def picker(self) -> EndpointPicker:
        assert self.service.picker is not None
        return self.service.picker

    async def located(self, session: str, sequence: int, pod: str | None, deployment: str = DEP) -> None:
        await self.bus.publish(
            SessionLocation(
                session_id=session,
                sequence=sequence,
                reason="placed" if pod else "forgotten",
                held=pod is not None,
                pod=pod_name(pod) if pod else "",
                namespace=NS,
                deployment=deployment,
            )
        )

    async def load(self, suffix: str, used: int, total: int = 100) -> None:
        await self.bus.publish(
            PodLoad(
                pod=pod_name(suffix), namespace=NS, deployment=DEP, blocks_used=used, blocks_total=total, window_s=5
            )
        )


def headers_message(headers: dict[str, str], end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=core_pb.HeaderMap(
                headers=[core_pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
            ),
            end_of_stream=end_of_stream,
        )
    )


def body_message(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


async def exchange(stub: pb_grpc.ExternalProcessorStub, messages: Iterable[pb.ProcessingRequest]) -> list[Any]:
    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            yield message

    return [response async for response in stub.Process(requests())]


@dataclass(frozen=True)
class Routed:
    """What the gateway got: the destination header and metadata, a header removed, or an immediate status."""

    endpoints: tuple[str, ...] = ()
    metadata: str = ""
    removed: tuple[str, ...] = ()
    status: int = 200


def routed(responses: list[pb.ProcessingResponse]) -> Routed:
    for response in responses:
        if response.HasField("immediate_response"):
            return Routed(status=int(response.immediate_response.status.code))
        phase = response.WhichOneof("response")
        common = getattr(response, phase).response
        if common.header_mutation.set_headers:
            (header,) = common.header_mutation.set_headers
            assert header.header.key == "x-gateway-destination-endpoint"
            assert common.clear_route_cache
            lb = response.dynamic_metadata.fields["envoy.lb"].struct_value
            return Routed(
                tuple(header.header.raw_value.decode().split(",")),
                lb.fields["x-gateway-destination-endpoint"].string_value,
                tuple(common.header_mutation.remove_headers),
            )
    raise AssertionError(f"no destination in {responses}")


async def route(
    stub: pb_grpc.ExternalProcessorStub,
    session: str | None = None,
    body: dict[str, Any] | bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Routed:
    sent = {":method": "POST", ":path": "/v1/chat/completions", **(headers or {})}
    if session is not None:
        sent[SESSION_HEADER] = session
    messages = [headers_message(sent, end_of_stream=body is None)]
    if body is not None:
        messages.append(body_message(body if isinstance(body, bytes) else json.dumps(body).encode()))
    return routed(await exchange(stub, messages))


async def first_is(stub: pb_grpc.ExternalProcessorStub, session: str, suffix: str) -> bool:
    return (await route(stub, session)).endpoints[0] == endpoint(suffix)


@pytest.fixture
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi() as fake:
        for suffix in PODS:
            fake.add("pods", serving_pod(suffix))
        fake.add("pods", serving_pod("z", deployment="other", ip="10.0.9.9"))
        rules = shipped_rules("router", ROUTER_RBAC)
        fake.authorize = lambda access: allowed(access, rules)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
                    "users": [{"name": "router", "user": {"token": "t"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router"}}],
                    "current-context": "fake",
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield fake


async def start_router(api: FakeKubeApi, settings: Settings, bus: Bus, **options: Any) -> Mesh:
    """No KV agent answers here: the router prefetches nothing unless a test says so (``prefetch_s``)."""
    options.setdefault("prefetch_s", 0.0)
    router_settings = RouterSettings(listen=HostPort("127.0.0.1", 0), pool=f"{NS}/{DEP}", **options)
    service = RouterService(router_settings)
    running = await start_service(service, replace(settings, backend="real"), Wiring)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    return Mesh(api, bus, service, running, pb_grpc.ExternalProcessorStub(channel), channel)


@pytest.fixture
async def mesh(api: FakeKubeApi, settings: Settings, bus: Bus) -> AsyncIterator[Mesh]:
    await bus.ensure_streams()
    started = await start_router(api, settings, bus)
    yield started
    await started.channel.close()
    await started.running.stop(grace=1)


async def test_a_session_read_back_at_start_goes_to_its_holder_then_follows_each_move(
    api: FakeKubeApi, settings: Settings, bus: Bus
) -> None:
    """Stored before the router started: the newest location per session is read back, so the first request
    already reaches the holder; a later move is heard, and an older location arriving late changes nothing."""
    await bus.ensure_streams()
    mesh = Mesh(api, bus, None, None, None, None)  # type: ignore[arg-type]
    await mesh.located("s1", 1, "c")
    await mesh.located("s1", 2, "a")  # the newest: s1 is on a
    await mesh.located("s2", 1, "b")
    mesh = await start_router(api, settings, bus)
    try:
        first = await route(mesh.stub, "s1")
        assert first.endpoints[0] == endpoint("a") and len(first.endpoints) == 3
        assert first.metadata == ",".join(first.endpoints)
        assert set(first.endpoints) == {endpoint(s) for s in PODS}
        assert (await route(mesh.stub, body={"model": "m", "user": "s2", "messages": []})).endpoints[0] == endpoint("b")
        await mesh.located("s1", 3, "b")
        await eventually(lambda: first_is(mesh.stub, "s1", "b"), timeout=5)
        await mesh.located("s1", 2, "a")  # late and older: ignored
        await mesh.located("s3", 1, "c")  # heard after it
        await eventually(lambda: first_is(mesh.stub, "s3", "c"), timeout=5)
        assert await first_is(mesh.stub, "s1", "b")
        assert mesh.running.ctx.health()["locations_read_back"] == 2
    finally:
        await mesh.channel.close()
        await mesh.running.stop(grace=1)


async def test_a_replaced_or_restarted_pod_is_not_credited_with_its_predecessors_sessions(mesh: Mesh) -> None:
    for suffix, used in (("a", 90), ("b", 10), ("c", 50)):
        await mesh.load(suffix, used)
    await mesh.located("s1", 1, "a")
    await mesh.located("s2", 1, "c")
    await eventually(lambda: first_is(mesh.stub, "s1", "a"), timeout=5)
    await eventually(lambda: first_is(mesh.stub, "s2", "c"), timeout=5)

    def restarted(obj: dict[str, Any]) -> None:
        obj["status"]["containerStatuses"][0]["restartCount"] = 1

    mesh.api.update("pods", NS, pod_name("a"), restarted)  # same pod, its server restarted: its GPU memory is gone
    await eventually(lambda: first_is(mesh.stub, "s1", "b"), timeout=5)  # balanced: b is the least loaded
    mesh.api.delete("pods", NS, pod_name("c"))  # replaced under the same name: another UID
    await eventually(lambda: mesh.picker.pods.get(pod_name("c")) is None, timeout=5)
    mesh.api.add("pods", serving_pod("c"))
    await eventually(lambda: pod_name("c") in mesh.picker.pods, timeout=5)
    assert (await route(mesh.stub, "s2")).endpoints[0] == endpoint("b")
    await mesh.located("s1", 2, "a")  # the restarted server took s1 again
    await eventually(lambda: first_is(mesh.stub, "s1", "a"), timeout=5)
    assert mesh.picker.picks["holder-gone"] >= 2


async def test_a_session_being_moved_waits_for_its_new_holder_never_racing_to_another_pod(mesh: Mesh) -> None:
    """Its holder's server restarted: the first request hands s1 to the least loaded pod (b); a second request
    before b's claim is heard waits for it (were it balanced again it might reach another pod, whose claim would be
    refused), then goes to b once the location says b holds it."""
    for suffix, used in (("a", 90), ("b", 10), ("c", 50)):
        await mesh.load(suffix, used)
    await mesh.located("s1", 1, "a")
    await eventually(lambda: first_is(mesh.stub, "s1", "a"), timeout=5)

    def restarted(obj: dict[str, Any]) -> None:
        obj["status"]["containerStatuses"][0]["restartCount"] = 1

    mesh.api.update("pods", NS, pod_name("a"), restarted)
    await eventually(lambda: mesh.picker.sessions["s1"].holder is not mesh.picker.pods[pod_name("a")], timeout=5)
    for suffix, used in (("c", 5), ("b", 10)):  # c is the least loaded from now on
        await mesh.load(suffix, used)
    await eventually(lambda: mesh.picker.pods[pod_name("c")].blocks_used == 5, timeout=5)
    handovers = mesh.service.handovers
    assert handovers is not None
    first = await route(mesh.stub, "s1")
    assert first.endpoints[0] == endpoint("c") and handovers.moving("s1", mesh.service.clock()) is not None
    for suffix, used in (("b", 1), ("c", 60)):  # now b is: a second request balanced again would go there
        await mesh.load(suffix, used)
    await eventually(lambda: mesh.picker.pods[pod_name("c")].blocks_used == 60, timeout=5)
    picks = sum(mesh.picker.picks.values())
    second = asyncio.ensure_future(route(mesh.stub, "s1"))
    await eventually(lambda: handovers.waited == 1, timeout=5)
    assert not second.done()
    await mesh.located("s1", 2, "c")  # c claimed it
    assert (await second).endpoints[0] == endpoint("c")
    assert handovers.heard_in_time == 1 and mesh.picker.picks["handover-timeout"] == 0
    assert sum(mesh.picker.picks.values()) == picks + 1  # a request that waited and picked again counts once


async def test_past_the_handover_wait_a_request_is_answered_503_and_the_retry_hands_over_afresh(
    api: FakeKubeApi, settings: Settings, bus: Bus
) -> None:
    await bus.ensure_streams()
    mesh = await start_router(api, settings, bus, handover_wait_s=0.3)
    try:
        await mesh.located("s1", 1, None)  # known, held by no pod
        await eventually(lambda: "s1" in mesh.picker.sessions, timeout=5)
        assert (await route(mesh.stub, "s1")).status == 200  # handed over
        assert (await route(mesh.stub, "s1")).status == 503  # nothing heard within the wait
        assert mesh.picker.picks["handover-timeout"] == 1
        assert (await route(mesh.stub, "s1")).status == 200  # the retry: handed over again
    finally:
        await mesh.channel.close()
        await mesh.running.stop(grace=1)


async def test_each_pod_carries_its_deletion_cost_from_the_sessions_it_holds(
    api: FakeKubeApi, settings: Settings, bus: Bus
) -> None:
    """Sessions plus tokens / 4096, rounded to 3 significant bits, patched on the pods through the real adapter
    as deploy/router/rbac.yaml allows it; rewritten when it changes."""
    await bus.ensure_streams()
    mesh = await start_router(api, settings, bus, deletion_cost_s=0.1)

    def cost(suffix: str) -> str | None:
        obj = api.get("pods", NS, pod_name(suffix)) or {}
        return ((obj.get("metadata") or {}).get("annotations") or {}).get(DELETION_COST)

    try:
        for index in range(9):
            await bus.publish(
                SessionLocation(
                    session_id=f"s{index}",
                    sequence=1,
                    reason="placed",
                    held=True,
                    pod=pod_name("a"),
                    namespace=NS,
                    deployment=DEP,
                    token_count=4096,
                )
            )
        await mesh.located("t1", 1, "b")
        await eventually(lambda: cost("a") == "20" and cost("b") == "1" and cost("c") == "0", timeout=10)
        await mesh.located("t1", 2, "c")  # moved: b holds nothing now
        await eventually(lambda: cost("b") == "0" and cost("c") == "1", timeout=10)
        assert rounded(9 + 9 * 4096 / 4096) == 20 and rounded(7) == 7 and rounded(1000) == 1024
    finally:
        await mesh.channel.close()
        await mesh.running.stop(grace=1)


async def test_a_request_without_a_session_goes_to_the_least_loaded_pod_and_is_shed_when_all_are_full(
    mesh: Mesh,
) -> None:
    for suffix, used in (("a", 90), ("b", 10), ("c", 50)):
        await mesh.load(suffix, used)

    async def ordered() -> bool:
        return (await route(mesh.stub)).endpoints == (endpoint("b"), endpoint("c"), endpoint("a"))

    await eventually(ordered, timeout=5)
    await mesh.located("s1", 1, "a")
    await eventually(lambda: first_is(mesh.stub, "s1", "a"), timeout=5)
    for suffix in PODS:
        await mesh.load(suffix, 100)

    async def shed() -> bool:
        return (await route(mesh.stub)).status == 429

    await eventually(shed, timeout=5)
    assert (await route(mesh.stub, "s1")).endpoints[0] == endpoint("a")  # its holder still takes it
    assert (await route(mesh.stub, "never-seen")).status == 429


async def test_forged_malformed_or_foreign_session_ids_are_refused_and_the_request_still_served(mesh: Mesh) -> None:
    await mesh.located("theirs", 1, "a", deployment="other")
    await mesh.located("s1", 1, "a")
    await eventually(lambda: first_is(mesh.stub, "s1", "a"), timeout=5)
    for forged in ("../../etc/passwd", "a b", "-starts-with-dash", "x" * 129, "é"):
        answer = await route(mesh.stub, forged)
        assert answer.status == 200 and len(answer.endpoints) == 3
        assert answer.removed == (SESSION_HEADER,)  # no pod acts on it
    foreign = await route(mesh.stub, "theirs")
    assert foreign.removed == (SESSION_HEADER,) and foreign.status == 200
    from_body = await route(mesh.stub, body={"user": "bad id!", "messages": []})
    assert from_body.status == 200 and from_body.removed == ()
    assert mesh.picker.picks["refused-session"] == 7
    assert await first_is(mesh.stub, "s1", "a")  # nothing changed


async def test_malformed_streams_are_refused_and_the_router_keeps_serving(mesh: Mesh) -> None:
    cases = [
        [body_message(b"{}")],  # a body before any headers
        [headers_message({}, end_of_stream=True), headers_message({}, end_of_stream=True)],  # headers twice
        [pb.ProcessingRequest()],  # nothing in it
    ]
    for messages in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await exchange(mesh.stub, messages)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for body in (b"not json", b"[1, 2]", b'{"user": 7}', b'{"user": "s1"' + b" " * 2_000_000 + b"}"):
        assert (await route(mesh.stub, body=body)).status == 200  # no session in it: balanced
    responses = await exchange(
        mesh.stub,
        [
            headers_message({SESSION_HEADER: "s9"}, end_of_stream=False),
            body_message(b"{}"),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
            pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)),
        ],
    )
    assert [r.WhichOneof("response") for r in responses] == [
        "request_headers",
        "request_body",
        "response_headers",
        "response_body",
    ]
    assert not responses[1].request_body.response.HasField("header_mutation")  # picked once, at the headers
    assert mesh.service.servicer is not None and mesh.service.servicer.refused_streams == 3


async def test_only_ready_pods_of_the_pool_within_the_gateways_subset_are_picked_else_503(mesh: Mesh) -> None:
    within = await route(mesh.stub, headers={"x-gateway-destination-endpoint-subset": f"{endpoint('c')}, junk"})
    assert within.endpoints == (endpoint("c"),)
    hinted = await exchange(
        mesh.stub,
        [
            pb.ProcessingRequest(
                request_headers=headers_message({}, end_of_stream=True).request_headers,
                metadata_context=core_pb.Metadata(
                    filter_metadata={
                        "envoy.lb.subset_hint": _struct(
                            {"x-gateway-destination-endpoint-subset": [endpoint("b"), "10.0.9.9:8000"]}
                        )
                    }
                ),
            )
        ],
    )
    assert routed(hinted).endpoints == (endpoint("b"),)  # the other deployment's pod is not the pool's
    assert (await route(mesh.stub, headers={"x-gateway-destination-endpoint-subset": "10.9.9.9:8000"})).status == 503

    def not_ready(obj: dict[str, Any]) -> None:
        obj["status"]["conditions"] = [{"type": "Ready", "status": "False"}]

    for suffix in PODS:
        mesh.api.update("pods", NS, pod_name(suffix), not_ready)

    async def unavailable() -> bool:
        return (await route(mesh.stub, "s1")).status == 503

    await eventually(unavailable, timeout=5)
    assert mesh.picker.picks["no-endpoint"] >= 2


async def test_a_cordoned_nodes_pods_get_new_sessions_last_and_keep_their_own(
    api: FakeKubeApi, settings: Settings, bus: Bus
) -> None:
    """Over gRPC, the nodes from the Kubernetes API as the router's RBAC allows: a and b on node-1, c on node-2.
    Cordoning node-1 (a drain begins) puts a and b last for a request of no session, though they are the least
    loaded; a session a holds still goes to a; uncordoned, the order is the loads' again. A node is read when a
    pool pod is first seen on it and when it changes, not per listing."""
    api.add("nodes", kube_node("node-1"))
    api.add("nodes", kube_node("node-2"))
    api.update("pods", NS, pod_name("c"), lambda obj: obj["spec"].__setitem__("nodeName", "node-2"))
    await bus.ensure_streams()
    mesh = await start_router(api, settings, bus)
    try:
        for suffix, used in (("a", 10), ("b", 20), ("c", 50)):
            await mesh.load(suffix, used)
        await mesh.located("s-on-a", 1, "a")

        async def first(expected: str, session: str | None = None) -> bool:
            return (await route(mesh.stub, session)).endpoints[0] == endpoint(expected)

        await eventually(lambda: first("a"), timeout=5)
        reads = mesh.service.pods_follower.node_reads if mesh.service.pods_follower else -1
        assert reads == 2, reads  # node-1 and node-2, once each

        def cordon(unschedulable: bool) -> Callable[[dict[str, Any]], None]:
            return lambda obj: obj["spec"].__setitem__("unschedulable", unschedulable)

        api.update("nodes", "", "node-1", cordon(True))
        await eventually(lambda: first("c"), timeout=15)  # the watch's event, then the node read (a busy machine)
        assert (await route(mesh.stub)).endpoints == (endpoint("c"), endpoint("a"), endpoint("b"))
        assert await first("a", "s-on-a")
        api.update("nodes", "", "node-1", cordon(False))
        await eventually(lambda: first("a"), timeout=15)
    finally:
        await mesh.channel.close()
        await mesh.running.stop(grace=1)


async def test_grpc_health_says_serving(mesh: Mesh) -> None:
    stub = health_pb2_grpc.HealthStub(mesh.channel)
    for name in ("", SERVICE_NAME):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _struct(values: dict[str, Any]) -> Any:
    from google.protobuf import struct_pb2

    found = struct_pb2.Struct()
    found.update(values)
    return found


def test_the_routers_user_reads_locations_loads_and_rollouts_asks_pods_to_prefetch_and_nothing_else(
    subjects: Subjects,
) -> None:
    perms = service_permissions(subjects, "router")
    events = subjects.events_stream.name
    for kind in ("kv.session.location", "kv.pod.load", "kv.rollout.state"):
        assert may_subscribe(perms, subjects.pattern(kind))
    for kind in ("checkpoint.agent.sessions", "node.drain.requested", "requests.inference"):
        assert not may_subscribe(perms, subjects.pattern(kind))
    assert may_publish(perms, f"$JS.API.DIRECT.GET.{events}.{subjects.root}.kv.session.s1.location")
    assert not may_publish(perms, f"$JS.API.DIRECT.GET.{events}.{subjects.root}.node.n1.drain.requested")
    assert not may_publish(perms, f"$JS.API.DIRECT.GET.{events}")
    assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{events}")
    assert not may_publish(perms, subjects.command("checkpoint", "where"))
    assert not any(may_publish(perms, subjects.pattern(k)) for k in ("kv.session.location", "kv.pod.load"))
    assert may_publish(perms, f"{subjects.root}.cmd.kvagent.llama-1.prefetch")  # it asks pods to prefetch
    assert not may_publish(perms, f"{subjects.root}.cmd.kvagent.llama-1.save")  # and nothing else of them


# -- the picker's memory, without transport ---------------------------------------------------------------------


def _picker() -> EndpointPicker:
    picker = EndpointPicker(NS, DEP)
    picker.set_pods(
        PodInfo(name=pod_name(s), namespace=NS, node="n", deployment=DEP, phase="Running", uid=s, ip=PODS[s])
        for s in PODS
    )
    return picker


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["load", "pick", "relist", "cordon"]),
            st.sampled_from(list(PODS)),
            st.integers(min_value=0, max_value=100),
            st.floats(min_value=0, max_value=40),
        ),
        max_size=30,
    )
)
def test_the_kept_order_of_pods_by_load_picks_as_a_full_sort_does(steps: list[tuple[str, str, int, float]]) -> None:
    """The pool's pick reads the pods kept in order (each load report moves one); asked with every endpoint as the
    gateway's subset, the picker sorts them all afresh: both answer the same, as loads come, go stale, pods are
    listed again and their nodes cordoned (shedding included)."""
    picker, now = _picker(), 0.0
    picker.load_stale_s = 15.0
    picker.shed_at = 0.95
    every = frozenset(endpoint(s) for s in PODS)
    for action, suffix, used, later in steps:
        now += later
        if action == "load":
            picker.on_load(
                PodLoad(
                    pod=pod_name(suffix), namespace=NS, deployment=DEP, blocks_used=used, blocks_total=100, window_s=5
                ),
                now,
            )
        elif action in ("relist", "cordon"):  # each pod on a node of its own; "cordon": the step's pod's node
            picker.set_pods(
                (
                    PodInfo(
                        name=pod_name(s),
                        namespace=NS,
                        node=f"n-{s}",
                        deployment=DEP,
                        phase="Running",
                        uid=s,
                        ip=PODS[s],
                    )
                    for s in PODS
                ),
                cordoned={f"n-{suffix}"} if action == "cordon" else (),
            )
        kept = picker.pick(RequestFacts(), now)
        sorted_afresh = picker.pick(RequestFacts(subset=every), now)
        assert (kept.status, kept.endpoints) == (sorted_afresh.status, sorted_afresh.endpoints)


@given(
    st.lists(st.tuples(st.sampled_from(["s1", "s2"]), st.sampled_from([None, "a", "b", "c"])), max_size=12),
    st.randoms(use_true_random=False),
)
def test_the_newest_location_wins_whatever_order_they_arrive_in(
    changes: list[tuple[str, str | None]], shuffler: Any
) -> None:
    locations = [
        SessionLocation(
            session_id=sid,
            sequence=i + 1,
            reason="placed" if pod else "dropped",
            held=pod is not None,
            pod=pod_name(pod) if pod else "",
            namespace=NS,
            deployment=DEP,
        )
        for i, (sid, pod) in enumerate(changes)
    ]
    in_order, shuffled = _picker(), _picker()
    for location in locations:
        in_order.on_location(location)
    arrived = list(locations) * 2  # delivered twice, in any order
    shuffler.shuffle(arrived)
    for location in arrived:
        shuffled.on_location(location)
    for sid in ("s1", "s2"):
        want, got = in_order.pick(RequestFacts(session=sid), 0.0), shuffled.pick(RequestFacts(session=sid), 0.0)
        assert (want.outcome, want.endpoints) == (got.outcome, got.endpoints)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["s1", "s2", "s3", "s4", "s5"]),
            st.sampled_from([None, "a", "b", "c", "other"]),
            st.integers(min_value=0, max_value=9000),
            st.sampled_from(["", "", "", "restart-a", "late"]),
        ),
        max_size=40,
    )
)
def test_the_pods_kept_totals_are_what_a_walk_of_the_sessions_finds(
    steps: list[tuple[str, str | None, int, str]],
) -> None:
    """The deletion cost reads each pod's sessions and tokens from totals kept as locations come (no walk): after
    any sequence of moves, forgets, another deployment's sessions, late locations, sessions pushed out past
    ``max_sessions`` and a pod restarted (a new incarnation credited with nothing), they equal a walk."""
    picker = _picker()
    picker.max_sessions = 4
    sequence, restarts = 0, 0
    for sid, pod, tokens, event in steps:
        sequence += 1
        if event == "restart-a":
            restarts += 1
            picker.set_pods(
                PodInfo(
                    name=pod_name(s),
                    namespace=NS,
                    node="n",
                    deployment=DEP,
                    phase="Running",
                    uid=s,
                    ip=PODS[s],
                    restarts=restarts if s == "a" else 0,
                )
                for s in PODS
            )
        picker.on_location(
            SessionLocation(
                session_id=sid,
                sequence=sequence - 5 if event == "late" else sequence,
                reason="placed" if pod else "forgotten",
                held=pod is not None,
                pod=pod_name(pod) if pod in PODS else ("elsewhere-1" if pod else ""),
                namespace=NS,
                deployment="other" if pod == "other" else DEP,
                token_count=tokens,
            )
        )
    walked: dict[str, tuple[int, int]] = {}
    for placement in picker.sessions.values():
        holder = placement.holder
        if holder is not None and holder.current:
            count, summed = walked.get(holder.name, (0, 0))
            walked[holder.name] = (count + 1, summed + placement.tokens)
    kept = {
        name: (pod.held_sessions, pod.held_tokens)
        for name, pod in picker.pods.items()
        if pod.current and (pod.held_sessions or pod.held_tokens)
    }
    assert kept == walked


def test_memory_stays_bounded_by_max_sessions() -> None:
    picker = _picker()
    picker.max_sessions = 1000
    for i in range(5000):
        picker.on_location(
            SessionLocation(session_id=f"s{i}", sequence=1, reason="placed", held=True, pod=pod_name("a"))
        )
    assert len(picker.sessions) == 1000 and "s4999" in picker.sessions and "s0" not in picker.sessions


# -- deploy/router, validated offline -------------------------------------------------------------------------------


def test_the_router_manifests_agree_with_each_other_with_the_example_pool_and_with_the_settings() -> None:
    import yaml

    from services.router.config import load

    folder = Path(__file__).resolve().parents[1] / "deploy" / "router"
    (kustomization,) = yaml.safe_load_all((folder / "kustomization.yaml").read_text())
    docs = [d for name in kustomization["resources"] for d in yaml.safe_load_all((folder / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    pool, service, deployment = by_kind["InferencePool"], by_kind["Service"], by_kind["Deployment"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["kind"], picker["name"], picker["failureMode"]) == (
        "Service",
        service["metadata"]["name"],
        "FailClose",
    )
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["targetPort"] == "grpc"]
    assert picker["port"]["number"] == grpc_port["port"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = load(env)
    assert settings.listen.port == grpc_port["port"] == next(p["containerPort"] for p in container["ports"])
    assert [{"number": settings.target_port}] == pool["spec"]["targetPorts"]
    assert settings.namespace == kustomization["namespace"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == by_kind["ServiceAccount"]["metadata"]["name"]
    examples = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "inference.yaml"
    served = next(d for d in yaml.safe_load_all(examples.read_text()) if d and d["kind"] == "Deployment")
    assert (served["metadata"]["namespace"], served["metadata"]["name"]) == (settings.namespace, settings.deployment)
    assert pool["spec"]["selector"]["matchLabels"].items() <= served["spec"]["template"]["metadata"]["labels"].items()
    assert {8000} == {p["containerPort"] for c in served["spec"]["template"]["spec"]["containers"] for p in c["ports"]}


def loaded(
    picker: EndpointPicker, used: dict[str, int], now: float, versions: dict[str, list[str]] | None = None
) -> None:
    """A load report of each pod (by suffix): ``used`` blocks of 100, and the model versions it holds when
    ``versions`` names it."""
    for suffix, blocks in used.items():
        picker.on_load(
            PodLoad(
                pod=pod_name(suffix),
                namespace=NS,
                deployment=DEP,
                blocks_used=blocks,
                blocks_total=100,
                window_s=5,
                model_versions=(versions or {}).get(suffix),
            ),
            now,
        )


def held(picker: EndpointPicker, sessions: Iterable[tuple[str, str, int]], version: str = "") -> None:
    """Each (session, pod suffix, tokens) held there, in order (sequence 1, 2, ...), its checkpoint of model
    ``version``."""
    for index, (sid, suffix, tokens) in enumerate(sessions):
        picker.on_location(
            SessionLocation(
                session_id=sid,
                sequence=index + 1,
                reason="placed",
                held=True,
                pod=pod_name(suffix),
                namespace=NS,
                deployment=DEP,
                token_count=tokens,
                model_version=version,
            )
        )


def test_a_session_moves_only_to_a_pod_holding_its_model_version() -> None:
    """After a rollout pod a holds sessions pinned to version 1 and pod c has dropped it (it serves 2 only): when
    a leaves, its sessions are prefetched to b (versions 1 and 2) though c is less pressed, and a request of one
    that was not prefetched goes first to b too. A version no pod holds is prefetched nowhere (counted) and its
    request is balanced as before, counted unserved. A session not saved since it was placed (its version not
    known) goes to a pod holding every version its holder held. A pod that does not say its versions takes any."""
    picker = _picker()
    loaded(picker, {"a": 50, "b": 60, "c": 5}, 100.0, versions={"a": ["1", "2"], "b": ["1", "2"], "c": ["2"]})
    held(picker, (("old-1", "a", 32), ("old-2", "a", 16)), version="1")
    held(picker, (("new", "a", 16),), version="2")
    held(picker, (("unsaved", "a", 0),))  # not saved since it was placed: its version is not known, a's are 1 and 2
    held(picker, (("ancient", "a", 16),), version="0")
    prefetcher = Prefetcher(picker, Handovers(10.0), _never_asked, 30.0, lambda: 100.0)
    for sid in ("old-1", "old-2", "new", "ancient", "unsaved"):
        prefetcher.saw_request(sid, 99.0)
    picker.set_pods(  # a leaves
        PodInfo(name=pod_name(s), namespace=NS, node="n", deployment=DEP, phase="Running", uid=s, ip=PODS[s])
        for s in ("b", "c")
    )
    moving = [(sid, p.tokens, p.needs()) for sid, p in picker.sessions.items()]
    assert prefetcher.assign(moving, 100.0) == {pod_name("b"): ["old-1", "old-2", "unsaved"], pod_name("c"): ["new"]}
    assert prefetcher.stats.no_version == 1  # "ancient": no pod holds version 0

    first = picker.pick(RequestFacts(session="old-2"), 100.0)
    assert first.endpoints[:2] == (endpoint("b"), endpoint("c")) and not first.version_unserved, first
    assert picker.pick(RequestFacts(session="new"), 100.0).endpoints[0] == endpoint("c")  # the least loaded
    within = picker.pick(RequestFacts(session="old-2", subset=frozenset({endpoint("b"), endpoint("c")})), 100.0)
    assert within.endpoints == (endpoint("b"), endpoint("c")), within
    unserved = picker.pick(RequestFacts(session="ancient"), 100.0)
    assert unserved.endpoints[0] == endpoint("c") and unserved.version_unserved
    assert picker.status()["version_unserved"] == 1

    loaded(picker, {"c": 6}, 101.0)  # c stops saying its versions (an older agent): it may take any
    assert picker.pick(RequestFacts(session="old-2"), 101.0).endpoints[0] == endpoint("c")


def test_a_leaving_pods_active_sessions_are_spread_over_the_least_pressed_pods_and_only_they() -> None:
    """The prefetch's choice, without transport: the sessions of pod a with a recent request go to b and c by KV
    pressure (the largest first, each counted where it went); an idle one and another pod's are left alone."""
    picker = _picker()
    loaded(picker, {"b": 10, "c": 40}, 100.0)
    held(
        picker,
        (("big", "a", 16 * 45), ("mid", "a", 16 * 10), ("small", "a", 16), ("idle", "a", 16), ("other", "b", 16)),
    )
    handovers = Handovers(10.0)
    prefetcher = Prefetcher(picker, handovers, _never_asked, 30.0, lambda: 100.0)
    prefetcher.saw_request("idle", 10.0)  # 90 s ago: restored on demand
    for sid in ("big", "mid", "small", "other"):
        prefetcher.saw_request(sid, 95.0)
    before = prefetcher.serving()
    picker.set_pods(  # a leaves
        PodInfo(name=pod_name(s), namespace=NS, node="n", deployment=DEP, phase="Running", uid=s, ip=PODS[s])
        for s in ("b", "c")
    )
    moving = [
        (sid, placement.tokens, placement.needs())
        for sid, placement in picker.sessions.items()
        if sid in prefetcher.activity.since(70.0) and placement.holder is before[pod_name("a")]
    ]
    plan = prefetcher.assign(moving, 100.0)
    assert plan == {pod_name("b"): ["big"], pod_name("c"): ["mid", "small"]}  # b: 0.10 + 0.45 > c's 0.40 + ...
    assert not handovers.moving("idle", 100.0)


def test_a_prefetch_never_goes_to_a_pod_on_a_cordoned_node_and_new_sessions_go_there_last() -> None:
    """a and b on node-1, being drained (cordoned), c on node-2: when a leaves, its active sessions all go to c,
    though b is the least pressed (b would hand them on when its turn comes); a request for no session goes to c
    first and b last, and a session b holds still goes to b. Once no pod stays, nothing is prefetched."""
    picker = _picker()
    nodes = {"a": "node-1", "b": "node-1", "c": "node-2"}

    def listing(*suffixes: str) -> list[PodInfo]:
        return [
            PodInfo(name=pod_name(s), namespace=NS, node=nodes[s], deployment=DEP, phase="Running", uid=s, ip=PODS[s])
            for s in suffixes
        ]

    picker.set_pods(listing("a", "b", "c"), cordoned={"node-1"})
    loaded(picker, {"b": 5, "c": 60}, 100.0)
    held(picker, (("s1", "a", 16), ("s2", "a", 16), ("held-by-b", "b", 16)))
    fresh = picker.pick(RequestFacts(), 100.0)
    assert fresh.endpoints == (endpoint("c"), endpoint("b"), endpoint("a")), fresh  # a: no load report, leaving
    assert picker.pick(RequestFacts(session="held-by-b"), 100.0).endpoints[0] == endpoint("b")
    prefetcher = Prefetcher(picker, Handovers(10.0), _never_asked, 30.0, lambda: 100.0)
    assert prefetcher.assign([("s1", 16, frozenset()), ("s2", 16, frozenset())], 100.0) == {pod_name("c"): ["s1", "s2"]}
    picker.set_pods(listing("a", "b", "c"), cordoned={"node-1", "node-2"})
    assert prefetcher.assign([("s1", 16, frozenset())], 100.0) == {}
    assert picker.pick(RequestFacts(), 100.0).endpoints[0] == endpoint("b")  # all leaving: still served


async def _never_asked(command: object, timeout: float) -> object:
    raise AssertionError("no command in this test")


def test_the_handover_prefetch_and_deletion_cost_settings_take_zero_for_off_and_refuse_negatives() -> None:
    off = load_router_settings(
        {
            "GPUWARDEN_ROUTER_HANDOVER_WAIT_S": "0",
            "GPUWARDEN_ROUTER_PREFETCH_S": "0",
            "GPUWARDEN_ROUTER_DELETION_COST_S": "0",
        }
    )
    assert (off.handover_wait_s, off.prefetch_s, off.deletion_cost_s) == (0.0, 0.0, 0.0)
    defaults = load_router_settings({})
    assert (defaults.handover_wait_s, defaults.prefetch_s, defaults.deletion_cost_s) == (10.0, 30.0, 10.0)
    with pytest.raises(SettingsError, match="GPUWARDEN_ROUTER_PREFETCH_S"):
        load_router_settings({"GPUWARDEN_ROUTER_PREFETCH_S": "-1"})


def test_a_session_forgotten_with_its_pod_remembers_that_pod_and_a_preempted_one_does_not() -> None:
    picker = _picker()

    def located(sid: str, sequence: int, reason: str, pod: str = "") -> None:
        picker.on_location(
            SessionLocation(
                session_id=sid,
                sequence=sequence,
                reason=reason,
                held=bool(pod),
                pod=pod_name(pod) if pod else "",
                namespace=NS,
                deployment=DEP,
            )
        )

    located("gone", 1, "placed", "a")
    located("gone", 2, "forgotten")  # the registry let it go with pod a, perhaps before the router saw a leave
    located("pre", 1, "placed", "a")
    located("pre", 2, "dropped")  # its engine preempted it: no move
    a = picker.pods[pod_name("a")]
    assert picker.sessions["gone"].holder is None and picker.sessions["gone"].was is a
    assert picker.sessions["pre"].holder is None and picker.sessions["pre"].was is None


async def test_a_handover_asked_again_keeps_its_waiters_and_one_handed_elsewhere_wakes_them() -> None:
    """The prefetcher asks the same handover again while the old holder finishes leaving: the requests already
    waiting go on waiting and are woken by the location (they were left on a replaced event before, and answered
    503). A handover to another pod wakes the old waiters, who pick again."""
    handovers = Handovers(wait_s=5.0)
    handovers.start("s-1", "llama-a", 0.0)
    first = handovers.moving("s-1", 0.0)
    assert first is not None
    waiting = asyncio.ensure_future(handovers.wait(first, 5.0, lambda: 0.0))
    await asyncio.sleep(0)
    handovers.start("s-1", "llama-a", 1.0)
    handovers.on_location("s-1")
    assert await waiting is True and handovers.timed_out == 0
    handovers.start("s-1", "llama-a", 2.0)
    second = handovers.moving("s-1", 2.0)
    assert second is not None
    woken = asyncio.ensure_future(handovers.wait(second, 7.0, lambda: 2.0))
    await asyncio.sleep(0)
    handovers.start("s-1", "llama-b", 2.5)
    moved = handovers.moving("s-1", 2.5)
    assert await woken is True and moved is not None and moved.pod == "llama-b"


async def test_a_request_waits_on_while_its_handover_is_renewed_and_times_out_once_it_is_not() -> None:
    """The old holder still holds the session (its last save under way): the prefetcher asks again and renews the
    handover, so a request already waiting goes on waiting past its first bound (a retry elsewhere would be refused
    the claim too) and is woken by the new holder's location. Once nobody renews it, the bound ends the wait."""
    now = [0.0]
    handovers = Handovers(wait_s=5.0)
    handovers.start("s-1", "llama-b", now[0])
    handover = handovers.moving("s-1", now[0])
    assert handover is not None
    # a request whose bound ends 0.05 s from now (as one that met the handover near the end of it)
    waiting = asyncio.ensure_future(handovers.wait(handover, 0.05, lambda: now[0]))
    await asyncio.sleep(0)
    now[0] = 0.01
    handovers.start("s-1", "llama-b", now[0])  # asked again: the old holder still holds it (renewed at 0.01)
    await eventually(lambda: handovers.renewed_waits == 1)  # past 0.05: waits on, to 5.01
    assert not waiting.done()
    handovers.on_location("s-1")  # llama-b claimed it
    assert await waiting is True and handovers.timed_out == 0

    quick = Handovers(wait_s=0.05)
    quick.start("s-2", "llama-b", 0.0)
    lone = quick.moving("s-2", 0.0)
    assert lone is not None
    assert await quick.wait(lone, 0.05, lambda: 0.0) is False  # not renewed: the bound holds
    assert quick.timed_out == 1 and quick.renewed_waits == 0


async def test_a_prefetch_still_restoring_keeps_its_sessions_handovers_alive_until_its_pod_answers() -> None:
    """A pod restoring hundreds of sessions answers once all are done: meanwhile the prefetcher renews their
    handovers, so a request of one restored late waits for it instead of timing out and restoring it cold
    elsewhere. Once the answer is in, nothing renews them any more."""
    now = [0.0]
    handovers = Handovers(wait_s=0.2)
    answered = asyncio.Event()

    async def slow_ask(command: PrefetchSessions, timeout: float) -> SessionsPrefetched:
        await answered.wait()
        return SessionsPrefetched(pod=command.pod, restored=list(command.session_ids))

    prefetcher = Prefetcher(_picker(), handovers, slow_ask, 30.0, lambda: now[0])
    b = pod_name("b")
    for session in ("s1", "s2"):
        handovers.start(session, b, now[0])
    handovers.start("s3", pod_name("c"), now[0])  # handed to another pod: not this prefetch's to renew
    asking = asyncio.ensure_future(prefetcher._prefetch(b, ["s1", "s2", "s3"]))
    now[0] = 1.0  # five bounds on, the pod still restoring
    await eventually(lambda: prefetcher.stats.renewed >= 2)
    assert handovers.moving("s1", now[0]) is not None and handovers.moving("s2", now[0]) is not None
    assert handovers.moving("s3", now[0]) is None
    answered.set()
    await asking
    renewed = prefetcher.stats.renewed
    await asyncio.sleep(0.25)
    assert prefetcher.stats.renewed == renewed and prefetcher.stats.prefetched == 3


def test_two_first_requests_of_a_new_session_go_to_one_pod_until_its_location_is_heard() -> None:
    """A brand-new session's first request goes to the least loaded pod; a second one that comes before the pod's
    claim is heard (the loads having changed meanwhile) goes to the same pod, not to the now least loaded one. Its
    location then decides; past ``first_pick_s``, or with that pod gone, the session is balanced again."""
    picker = _picker()
    picker.first_pick_s = 10.0

    def load(suffix: str, used: int, now: float) -> None:
        picker.on_load(
            PodLoad(pod=pod_name(suffix), namespace=NS, deployment=DEP, blocks_used=used, blocks_total=100, window_s=5),
            now,
        )

    for suffix, used in (("a", 10), ("b", 50), ("c", 90)):
        load(suffix, used, 0.0)
    first = picker.pick(RequestFacts(session="new-1"), 0.0)
    assert first.endpoints[0] == endpoint("a") and first.outcome.value == "unknown-session"
    load("a", 95, 1.0)  # a filled up before the session's claim was heard: balancing alone would say b
    assert picker.pick(RequestFacts(session="other"), 1.0).endpoints[0] == endpoint("b")
    again = picker.pick(RequestFacts(session="new-1"), 1.0)
    assert again.endpoints[0] == endpoint("a") and again.outcome.value == "unknown-session"
    assert picker.pick(RequestFacts(session="new-1", subset=frozenset({endpoint("a"), endpoint("c")})), 1.0).endpoints[
        0
    ] == endpoint("a")
    assert picker.status()["new_sessions_pending"] == 2

    picker.on_location(
        SessionLocation(
            session_id="new-1", sequence=1, reason="placed", held=True, pod=pod_name("c"), namespace=NS, deployment=DEP
        )
    )  # the claim that won names the holder, whichever it is
    held = picker.pick(RequestFacts(session="new-1"), 2.0)
    assert held.endpoints[0] == endpoint("c") and held.outcome.value == "holder"
    assert picker.status()["new_sessions_pending"] == 1

    late = picker.pick(RequestFacts(session="other"), 12.0)  # past first_pick_s: balanced (b), remembered afresh
    assert late.endpoints[0] == endpoint("b")
    load("b", 99, 12.5)
    picker.set_pods(  # b leaves the pool: its pending sessions are balanced
        PodInfo(name=pod_name(s), namespace=NS, node="n", deployment=DEP, phase="Running", uid=s, ip=PODS[s])
        for s in ("a", "c")
    )
    assert picker.pick(RequestFacts(session="other"), 13.0).endpoints[0] != endpoint("b")


def test_the_memory_of_first_picks_is_bounded() -> None:
    picker = _picker()
    picker.max_first_picks = 100
    for i in range(1_000):
        picker.pick(RequestFacts(session=f"s-{i}"), float(i) / 1_000)
    assert picker.status()["new_sessions_pending"] == 100
    assert "s-999" in picker._first_picks and "s-0" not in picker._first_picks
