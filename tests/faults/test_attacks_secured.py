"""Transport attacks on the secured mesh (tests/faults/secured.py: every client authenticated by the real auth
callout, each pod's KV agent with its own service-account token, the checkpoint service under its own user).

Each attack is refused by the server (a permissions violation, or no connection at all), changes nothing (the
registry, the checkpoints, the consumers) and leaves the service serving; the fault checker runs after each."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.contract.checkpoint import AgentSessions, LocateCheckpoint, SaveSessionsReport
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.permissions import (
    ADMIN,
    AGENT,
    AUTH,
    GATEWAY,
    PUBLISHES,
    Identity,
    bucket_owner,
    identity_name,
    inbox_prefix,
    index_stream,
    pod_bucket,
    user_name,
)
from shared.contract.registry import codec
from shared.host.runner import start_service
from shared.kv.agent import KvAgent
from shared.kv.objstore.codec import chunk_subject, manifest_name, meta_subject
from shared.kv.objstore.family import PodBuckets, pack_owner
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Secret
from shared.sim.tokens import TokenClaims
from shared.sim.tokens import sign as sign_token
from shared.wiring import Wiring
from tests.faults.secured import SecuredMesh, bucket_of, drains_consumer
from tests.faults.test_replay import Sent, Wire, kind_of, replay, settled, source_of, state_of
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content, fill


@pytest.fixture
def mesh(secured_mesh: SecuredMesh) -> SecuredMesh:
    return secured_mesh


# -- the gateway ----------------------------------------------------------------------------------------------------


async def test_the_gateway_can_neither_take_ack_nor_redirect_the_drains(mesh: SecuredMesh) -> None:
    await mesh.add_pod("llama-2", ["s1"])
    stream, durable = drains_consumer(mesh)
    before = await mesh.admin.js.consumer_info(stream, durable)
    gateway = await mesh.connect(mesh.as_user(GATEWAY), "gateway")
    inbox = gateway.nc.new_inbox()
    attempts = {
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}": b'{"batch": 10}',  # pull the drain requests
        f"$JS.ACK.{stream}.{durable}.1.1.1.1.0": b"+ACK",  # ack one it never had
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}": b"{}",  # redirect the filter
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{mesh.subjects.root}.node.nowhere.drain.requested": b"{}",
        f"$JS.API.CONSUMER.DELETE.{stream}.{durable}": b"",
        f"$JS.API.CONSUMER.CREATE.{stream}": b"{}",  # an ephemeral consumer of its own, over every event
        f"$JS.API.STREAM.MSG.GET.{stream}": b'{"seq": 1}',
        f"$JS.API.DIRECT.GET.{stream}": b'{"seq": 1}',
    }
    for subject, body in attempts.items():
        await gateway.nc.publish(subject, body, reply=inbox)
    await gateway.nc.flush()
    for subject in attempts:
        await mesh.refused("gateway", "publish", subject)
    after = await mesh.admin.js.consumer_info(stream, durable)
    assert after.config.filter_subject == before.config.filter_subject == mesh.subjects.pattern("node.drain.requested")
    assert after.ack_floor.stream_seq == before.ack_floor.stream_seq
    verdict = await mesh.drain("node-2", "after-gateway")
    assert isinstance(verdict, DrainCompleted) and verdict.sessions_committed == 1  # the service still answers
    await mesh.check(min_checkpoints=1, drains=["after-gateway"])


async def test_the_gateway_reads_locations_and_rollouts_and_nothing_else(mesh: SecuredMesh) -> None:
    await mesh.add_pod("llama-1", ["s1"])
    await mesh.drain("node-1", "d-read")
    gateway = await mesh.connect(mesh.as_user(GATEWAY), "gateway")
    stream = mesh.subjects.events_stream.name
    location = await gateway.js.get_msg(
        stream, subject=mesh.subjects.pattern("kv.session.location", session_id="s1"), direct=True
    )
    assert location.data is not None and b'"session_id":"s1"' in location.data  # what it may read
    drain = mesh.subjects.for_event(DrainRequested(node="node-1", drain_id="x"))
    with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
        await gateway.js.get_msg(stream, subject=drain, direct=True)  # another event: no answer at all
    await mesh.refused("gateway", "publish", f"$JS.API.DIRECT.GET.{stream}.{drain}")
    # a direct get of an allowed subject cannot name a sequence instead
    answer = await gateway.nc.request(
        f"$JS.API.DIRECT.GET.{stream}.{mesh.subjects.pattern('kv.session.location', session_id='s1')}",
        b'{"seq": 1}',
        timeout=5,
    )
    assert (answer.headers or {}).get("Status") == "408" and not answer.data
    for subject in (mesh.subjects.pattern("node.drain.requested"), f"{mesh.subjects.root}.>", "_INBOX.>"):
        await gateway.nc.subscribe(subject)
        await mesh.refused("gateway", "subscription", subject)
    where = mesh.subjects.command("checkpoint", "where")
    await gateway.nc.subscribe(where, queue="checkpoint")  # answering in the service's place
    await mesh.refused("gateway", "subscription", where)
    await mesh.still_serving("llama-1", "s1")
    await mesh.check(min_checkpoints=1, drains=["d-read"])


# -- a pod's agent --------------------------------------------------------------------------------------------------


async def test_an_agent_speaks_asks_and_hears_only_as_its_own_pod(mesh: SecuredMesh) -> None:
    victim = await mesh.add_pod("llama-2", ["v1", "v2"])
    attacker = await mesh.add_pod("llama-1", ["a1"])
    generation = await mesh.service.registry.generation("v1")
    nc = attacker.bus.nc
    forged_announcement = mesh.subjects.for_event(AgentSessions(pod="llama-2", node="node-2"))
    await nc.publish(forged_announcement, codec.encode(AgentSessions(pod="llama-2", node="node-2", sessions=[])))
    inbox = nc.new_inbox()
    claim = LocateCheckpoint(session_id="v1", pod="llama-2", node="node-2", take_session=True)
    asks = {
        mesh.subjects.agent_command("locate", "llama-2"): codec.encode(claim),
        mesh.subjects.agent_command("record", "llama-2"): codec.encode(SaveSessionsReport(pod="llama-2")),
        mesh.subjects.for_event(DrainRequested(node="node-1", drain_id="by-agent")): b"{}",
        mesh.subjects.pattern("checkpoint.save.command", pod="llama-2"): b"{}",
    }
    for subject, body in asks.items():
        await nc.publish(subject, body, reply=inbox)
    overheard = [
        mesh.subjects.pattern("checkpoint.save.command", pod="llama-2"),
        mesh.subjects.agent_commands("locate"),
    ]
    for subject in overheard:
        await nc.subscribe(subject)
    await nc.flush()
    for subject in (forged_announcement, *asks):
        await mesh.refused("agent/llama-1", "publish", subject)
    for subject in overheard:
        await mesh.refused("agent/llama-1", "subscription", subject)
    assert await mesh.sessions_on("node-2") == {"v1", "v2"}  # llama-2's sessions stand, still its own
    assert await mesh.service.registry.generation("v1") == generation  # nothing claimed
    await mesh.still_serving("llama-2", "v1")
    verdict = await mesh.drain("node-2", "after-agent")  # and its sessions are all saved
    assert isinstance(verdict, DrainCompleted) and verdict.sessions_committed == 2, verdict
    assert set(await mesh.service.registry.sessions_of_pod(victim.name)) == {"v1", "v2"}
    await mesh.check(min_checkpoints=2, drains=["after-agent"])


async def test_a_connection_name_proves_nothing(mesh: SecuredMesh) -> None:
    """An agent that names itself after another pod is still its own pod: the name is only what it wrote."""
    await mesh.add_pod("llama-2", ["v1"])
    token = await mesh.cluster.issue_token("llm", "llama-1")
    impostor = await mesh.connect(mesh.as_token(token, "llama-1"), "agent/llama-2")
    subject = mesh.subjects.for_event(AgentSessions(pod="llama-2", node="node-2"))
    await impostor.nc.publish(subject, codec.encode(AgentSessions(pod="llama-2", node="node-2")))
    await impostor.nc.flush()
    await mesh.refused("agent/llama-2", "publish", subject)
    assert await mesh.sessions_on("node-2") == {"v1"}
    await mesh.check(min_checkpoints=0)


async def test_nobody_reads_replies_meant_for_another(mesh: SecuredMesh) -> None:
    await mesh.add_pod("llama-2", ["v1"])
    attacker = await mesh.add_pod("llama-1", ["a1"])
    heard: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        heard.append(msg.data)

    s = mesh.subjects
    others = [
        "_INBOX.>",
        "_INBOX.*.>",
        f"_INBOX.{user_name(s, 'checkpoint')}.>",
        f"{inbox_prefix(identity_name(s, Identity(AGENT, pod='llama-2')))}.>",
        f"_INBOX.{user_name(s, ADMIN)}.>",
    ]
    for subject in others:
        await attacker.bus.nc.subscribe(subject, cb=on_msg)
        await mesh.refused("agent/llama-1", "subscription", subject)
    driver = await mesh.connect(mesh.as_user("driver"), "driver/node-1")
    await driver.nc.subscribe("_INBOX.>", cb=on_msg)
    await mesh.refused("driver/node-1", "subscription", "_INBOX.>")
    await mesh.still_serving("llama-2", "v1")  # a reply to llama-2 ...
    await mesh.drain("node-2", "d-replies")  # ... and the save commands' replies to the service
    assert heard == []  # ... reached none of them
    await mesh.check(min_checkpoints=1, drains=["d-replies"])


async def test_a_service_user_cannot_take_a_pods_claims(mesh: SecuredMesh) -> None:
    await mesh.add_pod("llama-2", ["v1"])
    driver = await mesh.connect(mesh.as_user("driver"), "driver/node-1")
    for verb in ("locate", "record"):
        await driver.nc.subscribe(mesh.subjects.agent_commands(verb), queue="checkpoint")
        await mesh.refused("driver/node-1", "subscription", mesh.subjects.agent_commands(verb))
    announcements = mesh.subjects.pattern("checkpoint.agent.sessions")
    await driver.nc.subscribe(announcements, queue="checkpoint")
    await mesh.refused("driver/node-1", "subscription", announcements)
    await mesh.still_serving("llama-2", "v1")
    await mesh.check(min_checkpoints=0)


# -- credentials that prove nothing ---------------------------------------------------------------------------------


async def test_tokens_and_passwords_that_prove_nothing_are_refused(mesh: SecuredMesh) -> None:
    await mesh.add_pod("llama-1", ["s1"])
    cluster = mesh.cluster
    genuine = await cluster.issue_token("llm", "llama-2")
    header, claims, signature = genuine.split(".")
    await cluster.scale("llm", "llama", 3)  # no GPU left for the third: it stays Pending
    pending = next(p for p in await cluster.pods() if p.phase == "Pending")
    other_key = sign_token(
        TokenClaims("llm", "default", ("gpuwarden",), 2**31, 0, pod="llama-2", pod_uid="x"), b"k" * 32
    )
    bad = {
        "expired": await cluster.issue_token("llm", "llama-2", ttl_s=-5),
        "pod not running": await cluster.issue_token("llm", pending.name),
        "another audience": await cluster.issue_token("llm", "llama-2", audience="vault"),
        "forged signature": f"{header}.{claims}.{signature[::-1]}",
        "signed by another key": other_key,
        "no pod, no service": await cluster.issue_token("llm", service_account="default"),
        "a service's account of another namespace": await cluster.issue_token(
            "llm", service_account="gpuwarden-checkpoint"
        ),
        "garbage": "not-a-token",
    }
    for what, token in bad.items():
        with pytest.raises(ConnectionRefusedError):
            await Bus.connect(mesh.as_token(token, "llama-2"), mesh.subjects, what, connect_timeout=1.0)
    for name, password in (
        ("checkpoint", mesh.secrets.passwords["driver"]),  # another user's password
        ("checkpoint", mesh.secrets.passwords["checkpoint"] + "x"),
        (AGENT, "anything"),  # agents prove their pod with a token, never a password
        (AUTH, mesh.secrets.passwords["checkpoint"]),
    ):
        with pytest.raises(ConnectionRefusedError):
            await Bus.connect(mesh.as_user(name, password), mesh.subjects, "guess", connect_timeout=1.0)
    callouts = mesh.auth.ctx.health()["callouts"]
    assert callouts["refused"] >= len(bad) + 3, callouts  # the auth user's own is refused by the server itself
    ok = await mesh.connect(mesh.as_token(genuine, "llama-2"), "agent/llama-2")  # the genuine one still works
    assert ok.connected
    await mesh.still_serving("llama-1", "s1")
    await mesh.check(min_checkpoints=0)


async def test_a_pods_token_stops_working_once_the_pod_is_gone(mesh: SecuredMesh) -> None:
    token = await mesh.cluster.issue_token("llm", "llama-2")
    await mesh.cluster.evict("llm", "llama-2")
    await mesh.cluster.mark_prestop_done("llm", "llama-2")
    assert "llama-2" not in {p.name for p in await mesh.cluster.pods()}
    with pytest.raises(ConnectionRefusedError):
        await Bus.connect(mesh.as_token(token, "llama-2"), mesh.subjects, "replayed", connect_timeout=1.0)
    await mesh.check(min_checkpoints=0)


# -- a consumer changed behind the service's back --------------------------------------------------------------------


async def test_a_drifted_drains_consumer_is_repaired_when_the_service_starts(mesh: SecuredMesh) -> None:
    """The admin (the only other user allowed to) points the service's drains consumer elsewhere and makes it
    deliver headers only; the service, started again, puts it back, and a drain is answered."""
    await mesh.add_pod("llama-1", ["s1"])
    stream, durable = drains_consumer(mesh)
    info = await mesh.admin.js.consumer_info(stream, durable)
    nowhere = f"{mesh.subjects.root}.node.nowhere.drain.requested"
    changed = replace(info.config, filter_subject=nowhere, max_deliver=1)
    await mesh.admin.js.add_consumer(stream, changed)
    assert (await mesh.admin.js.consumer_info(stream, durable)).config.filter_subject == nowhere
    await mesh.checkpoint.stop(grace=1)
    mesh.checkpoint = await start_service(mesh.service, replace(mesh.settings, nats=mesh.as_user("checkpoint")), Wiring)
    repaired = await mesh.admin.js.consumer_info(stream, durable)
    assert repaired.config.filter_subject == mesh.subjects.pattern("node.drain.requested")
    assert repaired.config.max_deliver == 20
    verdict = await mesh.drain("node-1", "after-repair")
    assert isinstance(verdict, DrainCompleted) and verdict.sessions_committed == 1
    await mesh.check(min_checkpoints=1, drains=["after-repair"])


async def test_nobody_but_its_owner_may_touch_a_services_consumer(mesh: SecuredMesh) -> None:
    stream, durable = drains_consumer(mesh)
    for name in ("driver", "scaler", GATEWAY):
        bus = await mesh.connect(mesh.as_user(name), f"{name}/node-1")
        for api in ("CONSUMER.INFO", "CONSUMER.MSG.NEXT", "CONSUMER.DELETE", "CONSUMER.DURABLE.CREATE"):
            subject = f"$JS.API.{api}.{stream}.{durable}"
            await bus.nc.publish(subject, b"{}", reply=bus.nc.new_inbox())
            await bus.nc.flush()
            await mesh.refused(f"{name}/node-1", "publish", subject)
    with pytest.raises(nats.js.errors.NotFoundError):  # the service's consumer stands; the admin may look
        await mesh.admin.js.consumer_info(stream, "not-" + durable)
    assert (await mesh.admin.js.consumer_info(stream, durable)).config.durable_name == durable
    await asyncio.sleep(0)
    await mesh.check(min_checkpoints=0)


async def test_an_agent_reconnects_with_the_token_the_kubelet_wrote_last(mesh: SecuredMesh, tmp_path: Path) -> None:
    """A reconnect presents the token file as it is then (the kubelet rewrites it before it expires), and the
    callout reviews it again: the first token has expired by then, the second still works."""
    await mesh.add_pod("llama-2", ["v1"])
    token_file = tmp_path / "token"
    token_file.write_text(await mesh.cluster.issue_token("llm", "llama-1", ttl_s=2))
    settings = replace(mesh.as_token(token_file.read_text(), "llama-1"), token_file=token_file)
    bus = await mesh.connect(settings, "agent/llama-1")
    token_file.write_text(await mesh.cluster.issue_token("llm", "llama-1"))  # the kubelet's next one
    first = token_file.read_text()
    await eventually(lambda: _refused_now(mesh, settings.token), timeout=10)  # the first one has expired
    mesh.server.stop()
    mesh.server.start()
    await eventually(lambda: bus.nc.stats["reconnects"] >= 1 and bus.connected, timeout=20)
    # a working connection, as llama-1 again: its own subjects pass, another pod's are refused
    other = mesh.subjects.for_event(AgentSessions(pod="llama-2", node="node-2"))
    await bus.nc.publish(other, b"{}")
    await bus.nc.flush()
    await mesh.refused("agent/llama-1", "publish", other)
    assert token_file.read_text() == first
    assert mesh.auth.ctx.health()["callouts"]["authorized"]["agent"] >= 3  # llama-2, llama-1, llama-1 again
    await mesh.check(min_checkpoints=0)


async def _refused_now(mesh: SecuredMesh, token: Secret | None) -> bool:
    assert token is not None
    review = await mesh.cluster.review_token(token.reveal(), ("gpuwarden",))
    return not review.authenticated


# -- the checkpoint object store: each pod's bucket is its own ------------------------------------------------------


async def test_a_pods_checkpoints_are_its_own_to_write_and_everyones_to_read(mesh: SecuredMesh) -> None:
    """On ``nats://<bucket>`` each pod writes into a bucket of its own, which the checkpoint service made (no pod may
    create a stream: its configuration could claim another pod's subjects): another pod reads its checkpoints (a
    restore after a move) but can neither delete nor overwrite them, nor name a checkpoint as its, nor create any
    bucket; it writes and deletes its own; the checkpoint service reads and deletes in every pod's bucket."""
    bucket = bucket_of(mesh.subjects)
    custodian_bus = await mesh.connect(mesh.as_user("checkpoint"), "checkpoint")
    custodian = PodBuckets(custodian_bus.nc, bucket)
    await custodian.index.ensure()  # the checkpoint service makes the family's index
    buses: dict[str, Bus] = {}
    stores: dict[str, PodBuckets] = {}
    for name in ("llama-1", "llama-2"):
        await custodian.provision(name)  # and each pod's bucket, when it first hears the pod
        token = await mesh.cluster.issue_token("llm", name)
        buses[name] = await mesh.connect(mesh.as_token(token, name), f"agent/{name}")
        stores[name] = PodBuckets(buses[name].nc, bucket, pod=name)
    first = KvAgent(stores["llama-1"], pod="llama-1", node="node-1", namespace="llm", deployment="llama", layout=LAYOUT)
    originals = fill(first, "v1", 2)
    saved = await first.save(deadline_s=20, reason="drain")
    checkpoint = saved.committed[0].checkpoint_id
    manifest = await custodian.manifest("v1", checkpoint)
    victim = pod_bucket(bucket, bucket_owner("llama-1"))

    second = KvAgent(
        stores["llama-2"], pod="llama-2", node="node-2", namespace="llm", deployment="llama", layout=LAYOUT
    )
    restored = await second.restore("v1", generation=1)  # another pod reads it
    assert [bytes(b) for b in restored.blocks] == [a.tobytes() for a in originals]

    nc = buses["llama-2"].nc
    own_bucket, unborn = pod_bucket(bucket, bucket_owner("llama-2")), pod_bucket(bucket, bucket_owner("llama-3"))
    attempts = {
        f"$JS.API.STREAM.PURGE.OBJ_{victim}": b"{}",
        f"$JS.API.STREAM.MSG.DELETE.OBJ_{victim}": b'{"seq": 1}',
        f"$JS.API.STREAM.DELETE.OBJ_{victim}": b"",
        f"$JS.API.STREAM.UPDATE.OBJ_{victim}": b"{}",
        meta_subject(victim, manifest_name("v1", checkpoint)): b'{"deleted": true}',  # overwrite its commit
        chunk_subject(victim, "forged"): b"x",
        f"$O.{bucket}.I.v1.g0000000009-s0000000001-000000000000.llama-1": b"",  # name a checkpoint as llama-1's
        f"$JS.API.STREAM.PURGE.{index_stream(bucket)}": b"{}",
        f"$JS.API.STREAM.PURGE.{mesh.subjects.events_stream.name}": b"{}",
        f"$JS.API.DIRECT.GET.{mesh.subjects.events_stream.name}": b'{"seq": 1}',  # reads are the buckets' only
        f"$JS.API.STREAM.INFO.{mesh.subjects.requests_stream.name}": b"{}",
        f"$JS.API.CONSUMER.CREATE.OBJ_{victim}": b"{}",  # no consumer anywhere
        # no stream either: its own bucket made again claiming the subjects of a pod not heard yet, or another
        f"$JS.API.STREAM.CREATE.OBJ_{own_bucket}": json.dumps(
            {"name": f"OBJ_{own_bucket}", "subjects": [f"$O.{unborn}.>"]}
        ).encode(),
        f"$JS.API.STREAM.CREATE.OBJ_{unborn}": b"{}",
    }
    for subject, body in attempts.items():
        await nc.publish(subject, body, reply=nc.new_inbox())
    await nc.flush()
    for subject in attempts:
        await mesh.refused("agent/llama-2", "publish", subject)
    assert await custodian.checkpoints("v1") == [checkpoint]  # untouched
    assert (await custodian.manifest("v1", checkpoint)).manifest_digest == manifest.manifest_digest
    assert (await custodian.pack_sizes(manifest.packs)).keys() == manifest.packs

    second.append_block("v1", block_content("v1", 2, LAYOUT.block_bytes).reshape(2, -1))
    own = await second.save(deadline_s=20, reason="periodic")  # it writes its own ...
    newer = await custodian.manifest("v1", own.committed[0].checkpoint_id)
    assert {pack_owner(p) for p in newer.packs} == {"llama-1", "llama-2"}
    [mine] = [p for p in newer.packs if pack_owner(p) == "llama-2"]
    await stores["llama-2"].delete_pack(mine)  # ... and deletes its own
    assert mine not in await custodian.pack_sizes([mine])
    await custodian.delete_checkpoint("v1", checkpoint)  # retention deletes in every pod's bucket
    await custodian.delete_pack(next(iter(manifest.packs)))
    assert await custodian.checkpoints("v1") == [newer.checkpoint_id]
    assert not await custodian.pack_sizes(manifest.packs)
    await custodian.provision("llama-3")  # the pod llama-2 tried to get ahead of: its bucket, on its own subjects
    info = await custodian_bus.nc.request(f"$JS.API.STREAM.INFO.OBJ_{unborn}", b"", timeout=5)
    assert json.loads(info.data)["config"]["subjects"] == [f"$O.{unborn}.C.>", f"$O.{unborn}.M.>"]
    await mesh.check(min_checkpoints=0)


async def test_every_message_sent_again_by_its_own_sender_changes_nothing(mesh: SecuredMesh) -> None:
    """Issue #30 on the secured mesh: what only the pod itself may send (its announcements, takes, restored
    reports and preStop save report), the checkpoint service's save commands and events, and the admin's drain
    request, each sent again byte for byte on its sender's own connection (a late duplicate of its own request,
    as a connection that fails over sends) after llama-1's sessions moved to llama-2. Nothing changes, nothing is
    deleted, the checker is clean."""
    wire = Wire()
    sub = await mesh.admin.nc.subscribe(f"{mesh.subjects.root}.>", cb=wire.heard)
    sessions, pods, drains = ["s1", "s2"], ["llama-1", "llama-2"], ["d1"]
    old = await mesh.add_pod("llama-1", sessions)
    assert isinstance(await mesh.drain("node-1", "d1"), DrainCompleted)
    await old.endpoint.final_save(deadline_s=10)
    await old.endpoint.stop()
    new = await mesh.add_pod("llama-2", [])
    for sid in sessions:
        assert [bytes(b) for b in (await new.endpoint.restore(sid)).blocks] == [
            block_content(sid, i, LAYOUT.block_bytes).tobytes() for i in range(2)
        ]
    await eventually(lambda: sum(kind_of(s) == "cmd.checkpoint.restored" for s in wire.sent) >= 2)
    await sub.unsubscribe()
    senders = {f"agent/{name}": pod.bus.nc for name, pod in mesh.pods.items()}

    def sender(sent: Sent) -> Client:
        """The service for the kinds it publishes (a restored report's body keeps the agent's source), the pod
        for what its agent sent, the admin for the rest (the drain request)."""
        if kind_of(sent) in PUBLISHES["checkpoint"]:
            return mesh.service.ctx.bus.nc
        return senders.get(source_of(sent), mesh.admin.nc)

    assert {"cmd.checkpoint.record", "cmd.checkpoint.locate", "checkpoint.agent.sessions"} <= {
        kind_of(s) for s in wire.sent
    }
    before = await state_of(mesh, sessions, pods, drains)
    assert all(before[sid]["recorded"] and before[sid]["stored"] for sid in sessions)
    await replay(wire, sender)
    await settled(mesh, before, sessions, pods, drains)
    assert not [e for who, errors in mesh.errors.items() for e in errors if "permissions violation" in str(e)]
    await mesh.check(min_checkpoints=2, drains=drains)  # the drain's; the preStop found nothing new
