"""The simulation routes through the router as a gateway does: each request of the pool asks the endpoint picker
(``services/router``) over Envoy ext_proc on a real gRPC socket, then goes to the first endpoint it names that is a
serving simulated pod. The router knows where sessions are only from what the checkpoint service publishes and
the simulated cluster lists (pod IPs, readiness, UIDs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from shared.clients.rollouts import begin_rollout, deployment_key, read_models
from shared.console import operations
from shared.contract.sessions import PrefetchSessions, SessionsPrefetched
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import HostPort, Settings, settings_from_env
from shared.ports.cluster import EvictionOutcome
from shared.sim.gateway import GatewayClient, GatewaySettings, read_answer
from tests.faults.fleet import Fleet, fleet
from tests.helpers import eventually


async def keep_talking(f: Fleet, sessions: list[str], until: asyncio.Future[object]) -> None:
    """A turn of every session each second until ``until`` is done."""
    while not until.done():
        for sid in sessions:
            await f.bus.publish(f.turn(sid))
        await asyncio.wait([until], timeout=1.0)


async def router_knows(f: Fleet, sessions: list[str]) -> None:
    """Every router has heard where each session is held."""
    for router, _ in f.routers:
        picker = router.picker
        assert picker is not None
        await eventually(
            lambda p=picker: all((s := p.sessions.get(sid)) is not None and s.holder for sid in sessions),
            timeout=30,
        )


async def test_every_request_asks_the_router_and_a_known_session_lands_on_its_holder(
    settings: Settings, tmp_path: Path
) -> None:
    async with fleet(settings, tmp_path, drivers=False, routers=1) as f:
        ips = [r.info.ip for r in f.workload.runtimes.values()]
        assert len(set(ips)) == len(ips) and all(ip.startswith("10.") for ip in ips), ips
        gateway = f.workload.gateway
        assert gateway is not None
        sessions = await f.begin(6)
        assert gateway.client.stats.asked >= len(sessions)
        await router_knows(f, sessions)
        before = gateway.landings.holder
        await f.talk(sessions)
        landed = gateway.landings
        assert landed.holder - before >= len(sessions)
        assert landed.to_non_holder == 0 and landed.fell_back == 0
        f.sessions_intact(sessions)


async def test_a_drained_nodes_sessions_are_prefetched_on_other_pods_and_routed_to_their_new_holders(
    settings: Settings, tmp_path: Path
) -> None:
    async with fleet(settings, tmp_path, drivers=False, routers=1) as f:
        sessions = await f.begin(6)
        on = {n.name: await f.checkpoint.registry.sessions_on_node(n.name) for n in f.spec.nodes}
        node = max(on, key=lambda n: len(on[n]))
        draining = asyncio.ensure_future(
            operations.drain(
                f.mesh, node, wait=True, timeout=120, deadline_s=25, reason="maintenance", requested_by="test"
            )
        )
        await keep_talking(f, sessions, draining)  # the moved sessions are restored where the router sends them
        result = await draining
        assert result.ok, result.reason
        f.sessions_intact(sessions)
        assert all(r.info.node != node for r in f.workload.runtimes.values() if not r.stopping)
        await router_knows(f, sessions)
        gateway = f.workload.gateway
        assert gateway is not None
        before = gateway.landings.holder
        await f.talk(sessions)
        assert gateway.landings.holder - before >= len(sessions)
        assert gateway.landings.fell_back == 0
        f.sessions_intact(sessions)
        await f.check(min_checkpoints=len(on[node]))
        router = f.routers[0][0]
        assert router.prefetcher is not None and router.metrics is not None
        # the drained pods' active sessions were restored on their next pods ahead of their requests
        assert router.prefetcher.stats.prefetched >= 1 and f.workload.stats.prefetched >= 1
        assert router.metrics.counts["prefetched"] >= 1
        assert gateway.landings.to_non_holder == 0


async def test_after_a_rollout_a_pinned_session_moves_only_to_a_pod_that_holds_its_model_version(
    settings: Settings, tmp_path: Path
) -> None:
    """Sessions begun on version 1 stay on it after the switch to version 2 (``finish``). A pod is replaced: the
    new one serves version 2 only, and is the least loaded. When the busiest pod of version 1 is evicted, its
    sessions are prefetched and routed only to the pod that still holds version 1 (the router reads each pod's
    versions from its load reports and each checkpoint's version from its location), never first to the new pod,
    where their checkpoints could not be restored."""
    async with fleet(settings, tmp_path, drivers=False, routers=1) as f:
        router = f.routers[0][0]
        gateway = f.workload.gateway
        assert router.picker is not None and router.prefetcher is not None and gateway is not None
        runtimes = f.workload.runtimes
        sessions: list[str] = []
        for batch in range(3):  # three at a time, each batch once the router heard the pods' loads: spread
            sessions += [f"chat-{batch}-{i}" for i in range(3)]
            await f.talk(sessions)

            def loads_heard() -> bool:
                return all(router.picker.pods[r.info.name].blocks_used == r.pool.used for r in runtimes.values())

            await eventually(loads_heard, timeout=30)
        assert all(r.agent.sessions() for r in runtimes.values()), {n: r.agent.sessions() for n, r in runtimes.items()}
        store = ConfigStore(f.client, f.subjects)
        await begin_rollout(store, "llm", "llama", "2", from_version="1", prepare_timeout_s=20, by="test")

        async def switched() -> bool:
            _, doc = await read_models(store)
            entry = doc.deployments.get(deployment_key("llm", "llama"))
            return entry is not None and entry.serving_version == "2"

        await eventually(switched, timeout=60)
        await eventually(lambda: all(r.agent.layout.model_version == "2" for r in runtimes.values()), timeout=30)

        async def evicted(name: str) -> None:
            talking: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            talk = asyncio.ensure_future(keep_talking(f, sessions, talking))
            try:
                assert await f.cluster.evict("llm", name) is EvictionOutcome.EVICTED
                await eventually(lambda: name not in runtimes and len(runtimes) == 3, timeout=60)
            finally:
                talking.set_result(None)
                await talk

        quietest = min(runtimes.values(), key=lambda r: (len(r.agent.sessions()), r.info.name)).info.name
        await evicted(quietest)
        await f.talk(sessions)
        fresh = next(r for r in runtimes.values() if "1" not in r.agent.layouts)
        olds = [r for r in runtimes.values() if "1" in r.agent.layouts]
        assert len(olds) == 2 and list(fresh.agent.layouts) == ["2"], {
            n: list(r.agent.layouts) for n, r in runtimes.items()
        }
        await eventually(lambda: router.picker.pods[fresh.info.name].versions == frozenset({"2"}), timeout=30)
        await eventually(lambda: all(router.picker.pods[r.info.name].versions == frozenset({"1", "2"}) for r in olds))
        await router_knows(f, sessions)

        busiest, keeper = sorted(olds, key=lambda r: -len(r.agent.sessions()))
        moving = set(busiest.agent.sessions())
        assert moving
        failed_before, wrong_before = router.prefetcher.stats.failed, gateway.landings.wrong_version
        await evicted(busiest.info.name)
        await f.talk(sessions)
        try:
            await eventually(lambda: moving <= set(keeper.agent.sessions()), timeout=30)  # requests retried last
        except AssertionError:
            missing = moving - set(keeper.agent.sessions())
            print(
                "DEBUG",
                missing,
                {n: r.agent.sessions() for n, r in runtimes.items()},
                f.workload.stats.requests,
                f.workload.stats.served,
                {m: router.picker.sessions.get(m) for m in missing},
                f.workload.tracked(),
                gateway.status(),
                router.prefetcher.status(),
            )
            raise
        assert not set(sessions) & set(runtimes[fresh.info.name].agent.sessions())
        assert router.prefetcher.stats.failed == failed_before and router.prefetcher.stats.no_version == 0
        assert router.prefetcher.stats.asked >= len(moving)  # every one asked of the keeper (none failed)
        assert gateway.landings.wrong_version == wrong_before == 0
        assert f.workload.stats.restore_refused_version == 0 and f.workload.stats.mixed_versions == 0
        f.sessions_intact(sessions)


async def test_a_pod_prefetches_through_its_restore_path_never_from_a_holder_still_listed(
    settings: Settings, tmp_path: Path
) -> None:
    """The router's command over the bus to a pod's KV agent: a session another running pod holds is not taken
    (``held_elsewhere``, asked again later), one the pod holds already is answered held; nothing moves."""
    async with fleet(settings, tmp_path, drivers=False, routers=1) as f:
        sessions = await f.begin(4)
        runtimes = [r for r in f.workload.runtimes.values() if not r.stopping]
        holder = next(r for r in runtimes if r.agent.sessions())
        other = next(r for r in runtimes if r is not holder)
        theirs = holder.agent.sessions()[0]
        command = PrefetchSessions(pod=other.info.name, namespace="llm", deployment="llama", session_ids=[theirs])
        answer = await f.bus.request(f.bus.subjects.for_event(command), command, 30)
        assert isinstance(answer, SessionsPrefetched)
        assert answer.held_elsewhere == [theirs] and not answer.restored and not answer.failed
        assert theirs in holder.agent.sessions() and theirs not in other.agent.sessions()
        command = PrefetchSessions(pod=holder.info.name, namespace="llm", deployment="llama", session_ids=[theirs])
        again = await f.bus.request(f.bus.subjects.for_event(command), command, 30)
        assert isinstance(again, SessionsPrefetched) and again.held == [theirs]
        await f.talk(sessions)
        f.sessions_intact(sessions)


async def test_a_prefetch_waits_while_the_old_holder_is_still_saving_then_takes_its_last_save(
    settings: Settings, tmp_path: Path
) -> None:
    """A pod evicted: while its preStop save of a session is still under way (the store's commits held), the pod is
    terminating but listed, and a prefetch of the session elsewhere is answered ``held_elsewhere``: taking it then
    would fence the old holder's last save out and restore an older checkpoint. Once the pod is gone, the prefetch
    takes it, with every token the last save held."""
    async with fleet(settings, tmp_path, drivers=False) as f:
        sessions = await f.begin(4)
        runtimes = f.workload.runtimes
        holder = next(r for r in runtimes.values() if r.agent.sessions())
        other = next(r for r in runtimes.values() if r is not holder)
        theirs = holder.agent.sessions()[0]
        await f.talk([theirs])  # a turn more than any earlier checkpoint of it holds
        tokens = holder.agent.tokens(theirs)
        command = PrefetchSessions(pod=other.info.name, namespace="llm", deployment="llama", session_ids=[theirs])
        subject = f.bus.subjects.for_event(command)
        f.store.gate.clear()
        assert await f.cluster.evict("llm", holder.info.name) is EvictionOutcome.EVICTED
        await eventually(lambda: f.store.held >= 1, timeout=30)  # its last save waits to commit
        assert holder.info.name in {p.name for p in await f.cluster.pods()}
        answer = await f.bus.request(subject, command, 30)
        assert isinstance(answer, SessionsPrefetched) and answer.held_elsewhere == [theirs], answer
        assert theirs not in other.agent.sessions()
        f.store.gate.set()
        await eventually(lambda: holder.info.name not in runtimes, timeout=60)

        async def unlisted() -> bool:
            return holder.info.name not in {p.name for p in await f.cluster.pods()}

        await eventually(unlisted, timeout=60)
        again = await f.bus.request(subject, command, 30)
        assert isinstance(again, SessionsPrefetched) and again.restored == [theirs], again
        assert other.agent.tokens(theirs) == tokens  # the old holder's last save: nothing rolled back
        await f.talk(sessions)
        f.sessions_intact(sessions)
        await f.check(min_checkpoints=1)


async def test_a_router_replica_that_does_not_answer_is_passed_over_and_none_means_no_answer() -> None:
    """Nothing listens on these ports (the router is down): the client says so, without raising."""
    client = GatewayClient([HostPort("127.0.0.1", 9), HostPort("127.0.0.1", 7)], timeout_s=0.5)
    try:
        assert await client.ask("chat-1") is None
        assert client.stats.replica_failures == 2 and client.stats.unanswered == 1
    finally:
        await client.close()


def test_the_answer_is_read_as_a_gateway_reads_it() -> None:
    immediate = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(details="full"))
    immediate.immediate_response.status.code = 429  # type: ignore[assignment]
    assert read_answer(immediate).status == 429
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct("envoy.lb")["x-gateway-destination-endpoint"] = "10.0.0.2:8000, 10.0.0.3:8000"
    only_metadata = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), dynamic_metadata=metadata)
    assert read_answer(only_metadata).endpoints == ("10.0.0.2:8000", "10.0.0.3:8000")
    assert read_answer(pb.ProcessingResponse(request_headers=pb.HeadersResponse())).status == 503


def test_the_router_setting_takes_replicas_in_order_and_refuses_a_bad_one() -> None:
    read = settings_from_env(GatewaySettings, {"GPUWARDEN_SIM_ROUTER": "127.0.0.1:9002, 127.0.0.1:9003"})
    assert read.router == (HostPort("127.0.0.1", 9002), HostPort("127.0.0.1", 9003))
    assert settings_from_env(GatewaySettings, {}).router == ()
    with pytest.raises(SettingsError, match="GPUWARDEN_SIM_ROUTER"):
        settings_from_env(GatewaySettings, {"GPUWARDEN_SIM_ROUTER": "nowhere"})
