"""Faults on the secured mesh (tests/faults/secured.py), as a real cluster meets them: every client authenticated
by the auth callout again after the server comes back, each pod's agent with its own token, the checkpoint service
under its own user. A drain caught by a NATS restart or by its checkpoint service's restart ends with exactly one
verdict, every session of the drained pod committed and restored on another pod byte for byte, the fault checker
clean (issue #30: the secured mesh is where faults run, not only attacks)."""

from __future__ import annotations

from dataclasses import replace

from services.auth.config import AuthSettings
from services.auth.service import AuthService
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.permissions import AUTH, user_name
from shared.host.runner import start_service
from shared.plumbing.consumer import ConsumerSpec, consume
from shared.plumbing.settings import NatsSettings, Secret
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
