"""Faults on the secured mesh (tests/faults/secured.py), as a real cluster meets them: every client authenticated
by the auth callout again after the server comes back, each pod's agent with its own token, the checkpoint service
under its own user. A drain caught by a NATS restart or by its checkpoint service's restart ends with exactly one
verdict, every session of the drained pod committed and restored on another pod byte for byte, the fault checker
clean (issue #30: the secured mesh is where faults run, not only attacks). A pod killed without warning goes on from
its KV journal, and the router's prefetch moves a leaving pod's sessions, with every party under its own identity."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.auth.config import AuthSettings
from services.auth.service import AuthService
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.router.config import RouterSettings
from services.router.service import RouterService
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.permissions import AUTH, user_name
from shared.host.runner import start_service
from shared.plumbing.consumer import ConsumerSpec, consume
from shared.plumbing.settings import HostPort, NatsSettings, Secret
from shared.sim.gateway import GatewayClient
from shared.wiring import Wiring
from tests.faults.secured import SecuredMesh, bucket_of
from tests.faults.test_replay import Wire
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content

Verdict = DrainCompleted | DrainFailed


async def stored_verdicts(mesh: SecuredMesh) -> dict[str, list[Verdict]]:
    """Every verdict as the events stream keeps it, read by a durable consumer of the admin's (a subscription
    could miss one published while the admin's connection was coming back), one copy per event id."""
    seen: dict[str, list[Verdict]] = {}

    async def on_verdict(event: Verdict) -> None:
        copies = seen.setdefault(event.drain_id, [])
        if all(v.event_id != event.event_id for v in copies):
            copies.append(event)

    s = mesh.subjects
    await consume(
        mesh.admin,
        ConsumerSpec(
            durable="t-secured-verdicts",
            filter_subjects=(s.pattern("node.drain.completed"), s.pattern("node.drain.failed")),
            accepts=(DrainCompleted, DrainFailed),
            stream=s.events_stream,
        ),
        on_verdict,
    )
    return seen


async def moved_and_restored(
    mesh: SecuredMesh, sessions: list[str], drain_id: str, verdicts: dict[str, list[Verdict]]
) -> None:
    """One verdict for the drain, completed with every session committed; the old pod stops (its preStop save),
    the other pod restores each session byte for byte; the checker is clean."""
    [verdict] = await eventually(lambda: verdicts.get(drain_id), timeout=60)
    assert isinstance(verdict, DrainCompleted), getattr(verdict, "reason", verdict)
    assert verdict.sessions_committed == len(sessions)
    old = mesh.pods["llama-1"]
    await old.endpoint.final_save(deadline_s=20)
    await old.endpoint.stop()
    new = await mesh.add_pod("llama-2", [])
    for sid in sessions:
        restored = await new.endpoint.restore(sid)
        assert [bytes(b) for b in restored.blocks] == [
            block_content(sid, i, LAYOUT.block_bytes).tobytes() for i in range(2)
        ], sid
    assert [v.drain_id for copies in verdicts.values() for v in copies] == [drain_id]
    await mesh.check(min_checkpoints=len(sessions), drains=[drain_id], verdicts=verdicts[drain_id])


async def test_a_nats_restart_mid_drain_on_the_secured_mesh_loses_nothing(secured_mesh: SecuredMesh) -> None:
    """The server stops as soon as the drain request is stored and comes back on its port and store: the services
    (passwords), the admin and the agents (their pods' tokens) are authenticated by the callout again, the drain's
    request is delivered from the stream, and it completes."""
    mesh = secured_mesh
    verdicts = await stored_verdicts(mesh)
    sessions = [f"nr{i}" for i in range(6)]
    await mesh.add_pod("llama-1", sessions)
    await mesh.admin.publish(DrainRequested(node="node-1", drain_id="d-nats-restart", deadline_s=25))
    mesh.server.stop()
    mesh.server.start()
    await moved_and_restored(mesh, sessions, "d-nats-restart", verdicts)
    assert not [e for errors in mesh.errors.values() for e in errors if "permissions violation" in str(e)]


async def test_the_checkpoint_service_replaced_mid_drain_on_the_secured_mesh(secured_mesh: SecuredMesh) -> None:
    """The checkpoint service stops while its drain runs (the agents' saves in flight); a new one, under the same
    service user, takes the drain from the durable consumer and answers it once."""
    mesh = secured_mesh
    verdicts = await stored_verdicts(mesh)
    sessions = [f"cr{i}" for i in range(6)]
    await mesh.add_pod("llama-1", sessions)
    wire = Wire()
    tap = await mesh.admin.nc.subscribe(f"{mesh.subjects.root}.>", cb=wire.heard)
    await mesh.admin.publish(DrainRequested(node="node-1", drain_id="d-service-restart", deadline_s=25))
    await eventually(lambda: "checkpoint.save.command" in wire.kinds(), timeout=30)  # the agent was asked
    await tap.unsubscribe()
    await mesh.checkpoint.stop(grace=0.2)
    nats = NatsSettings(
        servers=(mesh.server.url,),
        user=user_name(mesh.subjects, "checkpoint"),
        password=Secret(mesh.secrets.passwords["checkpoint"]),
    )
    service = CheckpointService(CheckpointSettings(gc_interval_s=0, drain_lease_s=2.0), store=mesh.store)
    mesh.checkpoint = await start_service(service, replace(mesh.settings, nats=nats), Wiring)
    mesh.service = service
    await moved_and_restored(mesh, sessions, "d-service-restart", verdicts)


async def test_clients_come_back_when_the_auth_callout_comes_back_after_the_server(secured_mesh: SecuredMesh) -> None:
    """The server restarts while the auth service is away: every client trying to reconnect is refused (the
    callout does not answer) for as long as it is away, and none gives up; once the callout is back they all are
    authenticated again, and a drain asked then completes."""
    mesh = secured_mesh
    verdicts = await stored_verdicts(mesh)
    sessions = [f"ar{i}" for i in range(4)]
    await mesh.add_pod("llama-1", sessions)
    await mesh.auth.stop(grace=0.2)
    mesh.server.stop()
    mesh.server.start()
    buses = [mesh.admin, mesh.service.ctx.bus, *(p.bus for p in mesh.pods.values())]
    log = mesh.server.store / "server.log"
    await eventually(lambda: "authentication error" in log.read_text(errors="replace"), timeout=30)  # refused
    auth_nats = NatsSettings(
        servers=(mesh.server.url,),
        user=user_name(mesh.subjects, AUTH),
        password=Secret(mesh.secrets.passwords[AUTH]),
    )
    mesh.auth = await start_service(
        AuthService(
            AuthSettings(
                issuer_seed_file=mesh.secrets.seed, password_dir=mesh.secrets.folder, bucket=bucket_of(mesh.subjects)
            )
        ),
        replace(mesh.settings, nats=auth_nats),
        Wiring,
    )
    await eventually(lambda: all(b.nc.is_connected for b in buses), timeout=30)
    assert not any(b.nc.is_closed for b in buses)
    await mesh.admin.publish(DrainRequested(node="node-1", drain_id="d-auth-back", deadline_s=25))
    await moved_and_restored(mesh, sessions, "d-auth-back", verdicts)


def no_violations(mesh: SecuredMesh) -> None:
    """No client of the mesh was refused anything by the server."""
    refused = [str(e) for errors in mesh.errors.values() for e in errors if "permissions violation" in str(e)]
    assert not refused, refused


async def test_a_pod_killed_without_warning_goes_on_from_its_journal_on_the_secured_mesh(
    secured_mesh: SecuredMesh,
) -> None:
    """The pod's KV journal records its entries as the pod itself (the record road its user may take); the pod is
    then killed (no preStop, its agent gone): another pod, under its own token, restores each session's newest
    journaled prefix, every block, and nothing else was refused on the way."""
    mesh = secured_mesh
    sessions = [f"jk{i}" for i in range(4)]
    old = await mesh.add_pod("llama-1", sessions, journal_s=0.05)
    for sid in sessions:
        old.grow(sid, 3)  # five full blocks each: the journal writes them behind the engine

    async def journaled() -> bool:
        located = [await mesh.service.registry.where(sid) for sid in sessions]
        return all(loc.token_count == 5 * LAYOUT.block_tokens for loc in located)

    await eventually(journaled, timeout=30)
    await old.endpoint.stop()  # killed: nothing saved at the end
    await mesh.cluster.kill_pod("llm", "llama-1")
    new = await mesh.add_pod("llama-2", [])
    for sid in sessions:
        restored = await new.endpoint.restore(sid)
        assert restored.manifest.reason == "journal"
        assert [bytes(b) for b in restored.blocks] == [
            block_content(sid, i, LAYOUT.block_bytes).tobytes() for i in range(5)
        ], sid
    no_violations(mesh)
    await mesh.check(min_checkpoints=len(sessions))


@pytest.mark.timeout(120)
async def test_the_routers_prefetch_moves_a_leaving_pods_sessions_on_the_secured_mesh(
    secured_mesh: SecuredMesh,
) -> None:
    """The router under its own user (it reads locations, loads and the pool's pods; it asks pods to prefetch) and
    the pods' agents under their tokens: when the drained pod leaves, the router asks the other pod to prefetch its
    sessions, that pod restores each as itself, and the next request of each is sent there. Nobody is refused."""
    mesh = secured_mesh
    sessions = [f"rp{i}" for i in range(4)]
    await mesh.add_pod("llama-1", sessions)
    new = await mesh.add_pod("llama-2", [], prefetch=True)
    settings = RouterSettings(
        listen=HostPort("127.0.0.1", 0), pool="llm/llama", pods_resync_s=0.5, prefetch_s=60, deletion_cost_s=0
    )
    router = RouterService(settings)
    running = await start_service(router, replace(mesh.settings, nats=mesh.as_user("router")), Wiring)
    client = GatewayClient([HostPort("127.0.0.1", router.port)], timeout_s=15.0)
    try:
        picker, prefetcher = router.picker, router.prefetcher
        assert picker is not None and prefetcher is not None
        ip = {p.name: p.ip for p in await mesh.cluster.pods()}

        def held_by(pod: str) -> bool:
            return all(
                (p := picker.sessions.get(s)) is not None and p.holder and p.holder.name == pod for s in sessions
            )

        await eventually(lambda: held_by("llama-1"), timeout=30)
        for sid in sessions:  # a request each: the conversations the router will prefetch
            answer = await client.ask(sid)
            assert answer is not None and answer.endpoints[0] == f"{ip['llama-1']}:8000", answer
        verdict = await mesh.drain("node-1", "d-router")
        assert isinstance(verdict, DrainCompleted), verdict
        await mesh.cluster.cordon("node-1")
        await mesh.pods["llama-1"].endpoint.stop()
        await mesh.cluster.kill_pod("llm", "llama-1")  # gone: the router sees it stop serving

        await eventually(lambda: set(sessions) <= set(new.agent.sessions()), timeout=60)
        await eventually(lambda: held_by("llama-2"), timeout=30)
        for sid in sessions:
            assert [bytes(b) for b in new.agent.blocks(sid)] == [
                block_content(sid, i, LAYOUT.block_bytes).tobytes() for i in range(2)
            ], sid
            answer = await client.ask(sid)
            assert answer is not None and answer.endpoints[0] == f"{ip['llama-2']}:8000", answer
        assert prefetcher.stats.prefetched == len(sessions) and prefetcher.stats.failed == 0, prefetcher.stats
        assert prefetcher.stats.unanswered == 0
        no_violations(mesh)
        await mesh.check(min_checkpoints=len(sessions), drains=["d-router"])
    finally:
        await client.close()
        await running.stop(grace=1)
