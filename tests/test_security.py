"""Least privilege on NATS: one user per service (shared.contract.permissions), checked on the allow-lists
themselves and on a real nats-server that enforces them."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import nats.js.errors
import nkeys
import pytest
import redis.asyncio as aioredis
import yaml
from nats.js import api as js_api
from nats.js.api import RawStreamMsg

from services.auth import natsjwt
from services.auth.authority import Authority, Verdict
from services.auth.config import AuthSettings
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.driver import DriverUpgradeStateChanged
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.permissions import (
    ADMIN,
    AGENT,
    ANY_NODE,
    AUTH,
    DURABLES,
    GATEWAY,
    NODE_SCOPED,
    PUBLISHES,
    SERVICES,
    USERS,
    Identity,
    admin_permissions,
    agent_permissions,
    auth_permissions,
    durables_of,
    gateway_permissions,
    may_publish,
    may_subscribe,
    nats_auth_config,
    nats_callout_config,
    permissions,
    service_permissions,
    subject_matches,
    user_name,
)
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import ROUTES, Subjects
from shared.host.devservers import NatsServer
from shared.host.runner import start_service
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.objstore.family import PodBuckets
from shared.kv.stores import open_store
from shared.plumbing.bus import Bus, PublishFailed
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.consumer import ConsumerSpec, consume, consumer_config, consumer_drift
from shared.plumbing.settings import NatsSettings, RedisSettings, Secret, Settings
from shared.ports.cluster import NODE_NAME_EXTRA, POD_NAME_EXTRA, ClusterError, TokenReview
from shared.sim.cluster import SimCluster
from shared.sim.spec import DeploymentSpec, GpuSpec, NodeSpec, SimSpec
from shared.wiring import Wiring
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content

_FIELD_RE = re.compile(r"\{(\w+)\}")

AsUser = Callable[..., NatsSettings]  # (name, password=None) -> the settings to connect as that user
AGENT_POD = "llama-1"


def bucket_of(subjects: Subjects) -> str:
    return f"ck-{subjects.root}"


def concrete(subjects: Subjects, kind: str, **fields: str) -> str:
    """A subject an event of ``kind`` could be published on: every field filled (``x`` unless given)."""
    names = _FIELD_RE.findall(ROUTES[kind].template)
    return subjects.pattern(kind, **{name: fields.get(name, "x") for name in names})


# -- the allow-lists, pure ------------------------------------------------------------------------------------------


def test_subject_matching_follows_nats_wildcards() -> None:
    assert subject_matches("a.*.c", "a.b.c")
    assert not subject_matches("a.*.c", "a.b.c.d")
    assert subject_matches("a.>", "a.b.c")
    assert not subject_matches("a.>", "a")
    assert not subject_matches("a.b", "a.b.c")
    assert not subject_matches("a.b.c", "a.b")


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_may_publish_exactly_its_own_kinds(subjects: Subjects, service: str) -> None:
    perms = service_permissions(subjects, service)
    for kind in ROUTES:
        if kind in ("config.applied", "deadletter"):
            continue
        allowed = may_publish(perms, concrete(subjects, kind))
        assert allowed == (kind in PUBLISHES[service]), f"{service} / {kind}"
    assert may_publish(perms, subjects.pattern("config.applied", name="models", service=service))
    other = next(s for s in SERVICES if s != service)
    assert not may_publish(perms, subjects.pattern("config.applied", name="models", service=other))
    assert may_publish(perms, subjects.deadletter(f"{service}-drains"))
    # replies go through allow_responses: no publish right on anyone's inbox
    assert not may_publish(perms, "_INBOX.abc.def") and perms["allow_responses"] is True
    own = f"_INBOX.{user_name(subjects, service)}"
    assert may_subscribe(perms, own + ".x.y") and may_subscribe(perms, own + ".>")
    for elsewhere in ("_INBOX.>", "_INBOX.*.>", f"_INBOX.{user_name(subjects, other)}.>", f"{subjects.root}.>"):
        assert not may_subscribe(perms, elsewhere), elsewhere


def test_services_subscribe_only_to_what_they_hear(subjects: Subjects) -> None:
    checkpoint = service_permissions(subjects, "checkpoint")
    for verb in ("locate", "record", "restored", "serving"):
        assert may_subscribe(checkpoint, subjects.agent_commands(verb))
        for service in set(SERVICES) - {"checkpoint"}:  # nobody else may take (or answer) a pod's claims
            assert not may_subscribe(service_permissions(subjects, service), subjects.agent_commands(verb))
    announcements = subjects.pattern("checkpoint.agent.sessions")
    assert {s for s in SERVICES if may_subscribe(service_permissions(subjects, s), announcements)} == {"checkpoint"}
    where = subjects.command("checkpoint", "where")
    assert {s for s in SERVICES if may_subscribe(service_permissions(subjects, s), where)} == {"checkpoint"}
    assert may_subscribe(service_permissions(subjects, "scaler"), subjects.pattern("metrics.deployment.utilisation"))


@pytest.mark.parametrize("service", SERVICES)
def test_services_reach_only_their_own_consumers(subjects: Subjects, service: str) -> None:
    perms = service_permissions(subjects, service, node="node-1")
    own = durables_of(subjects, service, "node-1")
    assert own or service == "router", service  # the router creates no consumer: it hears and reads back only
    for spec, durable in own:
        assert may_publish(perms, f"$JS.API.STREAM.INFO.{spec.name}")
        assert may_publish(perms, f"$JS.API.CONSUMER.DURABLE.CREATE.{spec.name}.{durable}")
        assert may_publish(perms, f"$JS.API.CONSUMER.CREATE.{spec.name}.{durable}.{subjects.root}.node.*.y")
        assert may_publish(perms, f"$JS.API.CONSUMER.INFO.{spec.name}.{durable}")
        assert may_publish(perms, f"$JS.API.CONSUMER.MSG.NEXT.{spec.name}.{durable}")
        assert may_publish(perms, f"$JS.API.CONSUMER.DELETE.{spec.name}.{durable}")
        assert may_publish(perms, f"$JS.ACK.{spec.name}.{durable}.1.2.3.4.0")
        assert may_subscribe(perms, f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{spec.name}.{durable}")
    mine = {durable for _, durable in own}
    for other_service in SERVICES:
        for spec, durable in durables_of(subjects, other_service, "node-1"):
            if durable in mine:
                continue
            for api in ("CONSUMER.MSG.NEXT", "CONSUMER.DURABLE.CREATE", "CONSUMER.INFO", "CONSUMER.DELETE"):
                assert not may_publish(perms, f"$JS.API.{api}.{spec.name}.{durable}"), (api, durable)
            assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{spec.name}.{durable}.x")
            assert not may_publish(perms, f"$JS.ACK.{spec.name}.{durable}.1.2.3.4.0")
    for spec in subjects.streams:
        assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{spec.name}")  # no ephemeral: any filter
        assert not may_publish(perms, f"$JS.API.DIRECT.GET.{spec.name}")
        for verb in ("CREATE", "UPDATE", "DELETE", "PURGE"):
            assert not may_publish(perms, f"$JS.API.STREAM.{verb}.{spec.name}")
    other = Subjects(subjects.root + "x")
    for spec in other.streams:
        assert not may_publish(perms, f"$JS.API.STREAM.INFO.{spec.name}")
    for kind in PUBLISHES[service]:
        assert not may_publish(perms, concrete(other, kind))
    assert not may_publish(perms, "$JS.API.INFO")
    assert not may_publish(perms, "$JS.API.STREAM.NAMES")


def test_a_node_scoped_service_without_its_node_gets_no_per_node_consumer(subjects: Subjects) -> None:
    perms = service_permissions(subjects, "device")
    assert durables_of(subjects, "device") == []
    assert not any("CONSUMER" in subject for subject in perms["publish"]["allow"])


def test_every_durable_consumer_a_service_creates_is_in_the_contract() -> None:
    """``DURABLES`` is the table the permissions come from; every ``durable(...)`` a service's code names must be
    in it, with its per-node scope (a consumer left out would be refused to its own service on a secured server)."""
    import ast

    found: set[tuple[str, str, bool]] = set()
    for path in (Path(__file__).parents[1] / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "durable":
                args = node.args
                if len(args) >= 2 and all(isinstance(a, ast.Constant) for a in args[:2]):
                    service, purpose = (a.value for a in args[:2])  # type: ignore[attr-defined]
                    if service != "workload":  # the request queues' consumers: the inference servers', not ours
                        found.add((service, purpose, len(args) > 2))
            # node_consumer(subjects, service, purpose, node, ...): one node's consumer (shared.plumbing.consumer)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "node_consumer":
                args = node.args
                if len(args) >= 3 and all(isinstance(a, ast.Constant) for a in args[1:3]):
                    service, purpose = (a.value for a in args[1:3])  # type: ignore[attr-defined]
                    found.add((service, purpose, True))
    table = {(d.service, d.purpose, d.per_node) for d in DURABLES}
    assert found == table


def test_nobody_but_checkpoint_may_report_a_drain_completed(subjects: Subjects) -> None:
    subject = concrete(subjects, "node.drain.completed", node="node-1")
    may = {s for s in SERVICES if may_publish(service_permissions(subjects, s), subject)}
    assert may == {"checkpoint"}
    for node in (None, "node-1"):
        for service in SERVICES:
            assert may_publish(service_permissions(subjects, service, node), subject) == (service == "checkpoint")


def test_the_mig_controller_may_ask_a_drain_of_its_own_node_only(subjects: Subjects) -> None:
    perms = service_permissions(subjects, "device", node="node-1")
    own, other = (concrete(subjects, "node.drain.requested", node=n) for n in ("node-1", "node-2"))
    assert may_publish(perms, own) and not may_publish(perms, other)


@pytest.mark.parametrize("service", sorted(NODE_SCOPED))
def test_node_scoped_services_can_be_held_to_their_node(subjects: Subjects, service: str) -> None:
    perms = service_permissions(subjects, service, node="gpu-1.example.com")
    for kind in PUBLISHES[service]:
        if "{node}" not in ROUTES[kind].template:
            assert may_publish(perms, concrete(subjects, kind))
            continue
        assert may_publish(perms, concrete(subjects, kind, node="gpu-1.example.com"))
        # the coordinator leads from any driver pod and commands every node's agent
        assert may_publish(perms, concrete(subjects, kind, node="gpu-2")) == (kind in ANY_NODE), kind


def test_node_does_not_narrow_cluster_wide_services(subjects: Subjects) -> None:
    for service in set(SERVICES) - NODE_SCOPED:
        assert service_permissions(subjects, service, node="n1") == service_permissions(subjects, service)


def test_a_kv_agent_speaks_only_as_its_pod(subjects: Subjects) -> None:
    drains = subjects.durable("checkpoint", "drains")
    perms = agent_permissions(subjects, pod="llama-1", bucket="ck")
    for kind in ("checkpoint.agent.sessions", "checkpoint.save.report", "checkpoint.save.progress"):
        assert may_publish(perms, concrete(subjects, kind, pod="llama-1"))
        assert not may_publish(perms, concrete(subjects, kind, pod="llama-2"))
    for verb in ("locate", "record", "restored", "serving"):
        assert may_publish(perms, subjects.agent_command(verb, "llama-1"))
        assert not may_publish(perms, subjects.agent_command(verb, "llama-2")), verb
    assert may_publish(perms, concrete(subjects, "checkpoint.save.command", pod="llama-1"))  # its preStop hook
    assert not may_publish(perms, concrete(subjects, "checkpoint.save.command", pod="llama-2"))
    for kind in ROUTES:  # no lifecycle event at all: the checkpoint service records what agents report
        if kind != "deadletter" and ROUTES[kind].delivery.name == "JETSTREAM":
            assert not may_publish(perms, concrete(subjects, kind, pod="llama-1")), kind
    # the checkpoint store nats://ck: its own pod's bucket to write, every bucket to read, no consumer anywhere
    assert may_publish(perms, "$O.ck-llama-1.C.abc") and may_publish(perms, "$JS.API.STREAM.PURGE.OBJ_ck-llama-1")
    for stream in ("OBJ_ck-llama-1", "OBJ_ck-llama-2", "OBJIDX_ck"):  # no stream created, not even its own bucket
        assert not may_publish(perms, f"$JS.API.STREAM.CREATE.{stream}"), stream
    for other in ("$O.ck-llama-2.C.abc", "$O.ck.C.abc", "$O.other.C.abc", "$JS.API.STREAM.PURGE.OBJ_ck-llama-2"):
        assert not may_publish(perms, other), other
    assert not may_publish(perms, "$JS.API.STREAM.CREATE.OBJ_ck") and not may_publish(
        perms, "$JS.API.STREAM.PURGE.OBJ_ck"
    )
    assert may_publish(perms, "$O.ck.I.s1.c1.llama-1") and not may_publish(perms, "$O.ck.I.s1.c1.llama-2")
    assert not may_publish(perms, "$JS.API.STREAM.PURGE.OBJIDX_ck")
    assert may_publish(perms, "$JS.API.DIRECT.GET.OBJ_ck-llama-2") and may_publish(perms, "$JS.API.DIRECT.GET.OBJ_ck")
    for spec in subjects.streams:  # the installation's own streams are no bucket
        assert not may_publish(perms, f"$JS.API.DIRECT.GET.{spec.name}")
        assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{spec.name}.x")
        assert not may_publish(perms, f"$JS.API.CONSUMER.MSG.NEXT.{spec.name}.x")
    assert not may_publish(perms, "$JS.API.CONSUMER.CREATE.OBJ_ck-llama-2.x")
    shared = agent_permissions(subjects, bucket="ck")  # a static configuration's one agent user owns one bucket
    assert may_publish(shared, "$O.ck.C.abc") and may_publish(shared, "$JS.API.CONSUMER.CREATE.OBJ_ck.reader")
    custodian = service_permissions(subjects, "checkpoint", bucket="ck")  # retention: every pod's bucket
    for bucket in ("ck-llama-1", "ck-llama-2", "ck"):
        assert may_publish(custodian, f"$JS.API.STREAM.PURGE.OBJ_{bucket}")
        assert may_publish(custodian, f"$JS.API.DIRECT.GET.OBJ_{bucket}")
        assert not may_publish(custodian, f"$O.{bucket}.C.abc")  # it writes no checkpoint
    assert may_publish(custodian, "$JS.API.STREAM.PURGE.OBJIDX_ck") and may_publish(custodian, "$JS.API.STREAM.NAMES")
    for stream in ("OBJ_ck-llama-1", "OBJIDX_ck"):  # it makes each pod's bucket, and the index
        assert may_publish(custodian, f"$JS.API.STREAM.CREATE.{stream}")
    for spec in subjects.streams:
        assert not may_publish(custodian, f"$JS.API.STREAM.PURGE.{spec.name}")
        assert not may_publish(custodian, f"$JS.API.STREAM.CREATE.{spec.name}")
        assert not may_publish(custodian, f"$JS.API.DIRECT.GET.{spec.name}")
    assert may_publish(custodian, f"$JS.API.CONSUMER.MSG.NEXT.{subjects.events_stream.name}.{drains}")
    assert "deny" not in service_permissions(subjects, "driver", bucket="ck")["publish"]
    assert may_publish(perms, concrete(subjects, "model.prepare.report", pod="llama-1"))
    assert not may_publish(perms, concrete(subjects, "model.prepare.report", pod="llama-2"))
    assert perms["subscribe"]["allow"] == [
        concrete(subjects, "checkpoint.save.command", pod="llama-1"),
        concrete(subjects, "model.prepare.command", pod="llama-1"),  # its own prepare commands only
        concrete(subjects, "kv.session.prefetch.command", pod="llama-1"),  # and the router's prefetch for it
        subjects.pattern("kv.rollout.state"),  # every rollout's switch
        f"_INBOX.{subjects.root}-agent-llama-1.>",  # its own replies only
    ]
    assert not may_subscribe(perms, "_INBOX.>") and not may_publish(perms, "_INBOX.x.y")
    assert perms["allow_responses"] is True  # it answers save commands as replies
    assert not may_subscribe(perms, f"_INBOX.{subjects.root}-agent-llama-2.>")
    assert not may_subscribe(perms, f"_INBOX.{subjects.root}-agent-llama-1x.>")
    anywhere = agent_permissions(subjects)
    assert may_publish(anywhere, concrete(subjects, "checkpoint.agent.sessions", pod="llama-7"))
    assert not any(p.startswith("$O.") for p in anywhere["publish"]["allow"])


def test_admin_may_publish_everything_under_its_root(subjects: Subjects) -> None:
    perms = admin_permissions(subjects)
    for kind in ROUTES:
        assert may_publish(perms, concrete(subjects, kind))
    assert may_publish(perms, f"$JS.API.STREAM.CREATE.{subjects.events_stream.name}")
    assert not may_publish(perms, concrete(Subjects(subjects.root + "x"), "node.drain.completed"))


def test_auth_config_has_a_user_per_service_and_the_admin(subjects: Subjects) -> None:
    passwords = {name: f"pw-{name}" for name in USERS}
    text = nats_auth_config(subjects, passwords, node="n1")
    assert text.startswith("authorization {")
    users = json.loads(text[text.index("[") : text.rindex("]") + 1])
    assert [u["user"] for u in users] == [user_name(subjects, n) for n in USERS]
    by_user = {u["user"]: u for u in users}
    assert by_user[user_name(subjects, "driver")]["permissions"] == service_permissions(subjects, "driver", "n1")
    assert by_user[user_name(subjects, ADMIN)]["permissions"] == admin_permissions(subjects)
    assert by_user[user_name(subjects, AGENT)]["permissions"] == agent_permissions(subjects)
    assert by_user[user_name(subjects, "scaler")]["password"] == "pw-scaler"


def test_auth_config_errors_name_the_user_never_the_password(subjects: Subjects) -> None:
    passwords = {name: f"pw-{name}-{secrets.token_hex(4)}" for name in USERS}
    for broken, needle in (
        ({**passwords, "scaler": ""}, "scaler"),
        ({k: v for k, v in passwords.items() if k != ADMIN}, ADMIN),
        ({**passwords, "intruder": "pw-intruder"}, "intruder"),
        ({**passwords, "device": passwords["device"] + "\n"}, "device"),
    ):
        with pytest.raises(ValueError, match=needle) as err:
            nats_auth_config(subjects, broken)
        for value in broken.values():
            if value:
                assert value.strip() not in str(err.value)


def test_a_gateway_may_only_follow_locations_and_ask_where(subjects: Subjects) -> None:
    perms = gateway_permissions(subjects)
    assert may_publish(perms, subjects.command("checkpoint", "where"))
    for kind in ROUTES:  # no event, no command but the question itself: it only listens and asks
        assert may_publish(perms, concrete(subjects, kind)) == (kind == "kv.session.where"), kind
    for verb in ("locate", "record", "restored", "serving"):
        assert not may_publish(perms, subjects.agent_command(verb, "llama-1")), verb
    assert perms["subscribe"]["allow"] == [
        subjects.pattern("kv.session.location"),
        subjects.pattern("kv.rollout.state"),
        f"_INBOX.{subjects.root}-gateway.>",
    ]
    events = subjects.events_stream.name
    location = concrete(subjects, "kv.session.location", session_id="s1")
    rollout = concrete(subjects, "kv.rollout.state", namespace="llm", deployment="llama")
    assert may_publish(perms, f"$JS.API.DIRECT.GET.{events}.{location}")
    assert may_publish(perms, f"$JS.API.DIRECT.GET.{events}.{rollout}")
    for kind in ROUTES:  # read back: locations and rollouts only
        if kind not in ("kv.session.location", "kv.rollout.state"):
            assert not may_publish(perms, f"$JS.API.DIRECT.GET.{events}.{concrete(subjects, kind)}"), kind
    assert not may_publish(perms, f"$JS.API.DIRECT.GET.{events}")  # a body could name any sequence
    for api in ("CONSUMER.CREATE", "CONSUMER.DURABLE.CREATE", "CONSUMER.MSG.NEXT", "STREAM.MSG.GET", "CONSUMER.INFO"):
        assert not any(api in subject for subject in perms["publish"]["allow"]), api
    assert "allow_responses" not in perms


def test_the_gateway_user_is_written_only_when_it_has_a_password(subjects: Subjects) -> None:
    base = {name: f"pw-{name}" for name in USERS}
    without = [u["user"] for u in json.loads(_users_json(nats_auth_config(subjects, base)))]
    assert user_name(subjects, GATEWAY) not in without
    text = nats_auth_config(subjects, {**base, GATEWAY: "pw-gw"})
    by_user = {u["user"]: u for u in json.loads(_users_json(text))}
    assert by_user[user_name(subjects, GATEWAY)]["permissions"] == gateway_permissions(subjects)
    with pytest.raises(ValueError, match="no password for: gateway"):
        nats_auth_config(subjects, {**base, GATEWAY: ""})


def _users_json(text: str) -> str:
    return text[text.index("[") : text.rindex("]") + 1]


def test_secrets_never_show_in_settings_reprs() -> None:
    nats_pw, redis_pw, token = (secrets.token_urlsafe(16) for _ in range(3))
    nats_settings = NatsSettings(user="gw-driver", password=Secret(nats_pw), token=Secret(token))
    settings = Settings(nats=nats_settings, redis=RedisSettings(username="gw", password=Secret(redis_pw)))
    for text in (repr(nats_settings), str(nats_settings), repr(settings), str(settings), f"{settings!r}"):
        for secret in (nats_pw, redis_pw, token):
            assert secret not in text
    assert "gw-driver" in repr(nats_settings)


# -- a real server that enforces them -------------------------------------------------------------------------------


@pytest.fixture
def passwords() -> dict[str, str]:
    pw = {name: secrets.token_urlsafe(18) for name in (*USERS, GATEWAY)}
    # quotes, backslashes, '$', '#', '}' and spaces must survive the server's configuration parser
    pw["checkpoint"] = 'ck "q" \\ $HOME #x } // ' + secrets.token_hex(6)
    return pw


@pytest.fixture
def secured(tmp_path: Path, subjects: Subjects, passwords: dict[str, str]) -> Iterator[NatsServer]:
    """A nats-server of this test's own that knows only the users of ``nats_auth_config``.

    The store directory is not in the configuration: ``NatsServer`` always passes ``-js -sd <store>``, and
    nats-server refuses a ``store_dir`` given twice ("Duplicate 'store_dir' configuration")."""
    conf = tmp_path / "nats.conf"
    conf.write_text("jetstream {}\n" + nats_auth_config(subjects, passwords, pod=AGENT_POD, bucket=bucket_of(subjects)))
    conf.chmod(0o600)
    server = NatsServer(config=conf)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def as_user(secured: NatsServer, subjects: Subjects, passwords: dict[str, str]) -> AsUser:
    def make(name: str, password: str | None = None) -> NatsSettings:
        pw = passwords[name] if password is None else password
        return NatsSettings(servers=(secured.url,), user=user_name(subjects, name), password=Secret(pw))

    return make


@pytest.fixture
async def admin(as_user: AsUser, subjects: Subjects) -> AsyncIterator[Bus]:
    bus = await Bus.connect(as_user(ADMIN), subjects, "admin", connect_timeout=2.0)
    await bus.ensure_streams()
    yield bus
    await bus.close(grace=1.0)


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)


def _no_secrets_in(text: str, passwords: dict[str, str]) -> None:
    for name, value in passwords.items():
        assert value not in text, f"the password of {name} was logged"


async def test_checkpoint_service_runs_under_its_own_user(
    admin: Bus,
    as_user: AsUser,
    subjects: Subjects,
    settings: Settings,
    passwords: dict[str, str],
    redis_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    # a configuration to apply, so the service also announces config.applied under its own user
    await ConfigStore(redis_client, subjects).write("checkpoint", CheckpointPolicy(), 0, "admin")
    running = await start_service(CheckpointService(), replace(settings, nats=as_user("checkpoint")), Wiring)
    driver = await Bus.connect(as_user("driver"), subjects, "driver/node-1", connect_timeout=2.0)
    try:
        await driver.publish(DrainRequested(node="node-1", drain_id="drain-7"))
        await eventually(lambda: "drain-7" in running.ctx.status["drains"])

        durable = subjects.durable("checkpoint", "drains")

        async def acked() -> bool:
            info = await admin.js.consumer_info(subjects.events_stream.name, durable)
            return info.num_ack_pending == 0 and info.ack_floor.stream_seq >= 1

        await eventually(acked)
        applied = subjects.pattern("config.applied", name="checkpoint", service="checkpoint")
        msg = await eventually(lambda: _last_msg(admin, subjects, applied))
        assert b'"service":"checkpoint"' in msg.data
    finally:
        await driver.close(grace=1.0)
        await running.stop(grace=1)
    logged = _logged(caplog)
    assert "permissions violation" not in logged.lower()
    assert "authorization violation" not in logged.lower()
    _no_secrets_in(logged, passwords)


async def _last_msg(bus: Bus, subjects: Subjects, subject: str) -> RawStreamMsg | None:
    try:
        return await bus.js.get_last_msg(subjects.events_stream.name, subject)
    except nats.js.errors.NotFoundError:
        return None


async def test_checkpoint_user_cannot_publish_driver_events(
    admin: Bus,
    as_user: AsUser,
    subjects: Subjects,
    passwords: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors: list[Exception] = []
    bus = await Bus.connect(as_user("checkpoint"), subjects, "checkpoint", connect_timeout=2.0, on_error=errors.append)
    bus.publish_deadline = 1.0
    try:
        forged = DriverUpgradeStateChanged(node="node-1", state="upgrade-done")
        forged_subject = subjects.for_event(forged)
        with pytest.raises(PublishFailed):
            await bus.publish(forged)
        # the server says 'Permissions Violation for Publish to "<subject>"'; nats-py hands it on lower-cased
        refusal = f'permissions violation for publish to "{forged_subject}"'.lower()
        await eventually(lambda: any(refusal in str(e).lower() for e in errors), timeout=5)
        assert bus.connected  # refused, not disconnected

        verdict = DrainCompleted(node="node-1", drain_id="drain-7", sessions_committed=3)
        await bus.publish(verdict)
    finally:
        await bus.close(grace=1.0)
    stored = await _last_msg(admin, subjects, subjects.for_event(verdict))
    assert stored is not None and verdict.event_id.encode() in (stored.data or b"")
    assert await _last_msg(admin, subjects, forged_subject) is None
    _no_secrets_in(_logged(caplog) + "".join(map(str, errors)), passwords)


async def test_a_wrong_password_cannot_connect(
    as_user: AsUser,
    subjects: Subjects,
    passwords: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors: list[Exception] = []
    wrong = as_user("checkpoint", password=passwords["driver"])
    with pytest.raises(ConnectionRefusedError, match="NATS refused the credentials"):
        await Bus.connect(wrong, subjects, "checkpoint", connect_timeout=1.0, on_error=errors.append)
    assert any("authorization violation" in str(e).lower() for e in errors)
    _no_secrets_in(_logged(caplog) + "".join(map(str, errors)), passwords)


async def test_a_kv_agent_saves_and_restores_under_its_own_user(
    admin: Bus,
    as_user: AsUser,
    subjects: Subjects,
    settings: Settings,
    passwords: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The whole checkpoint path on least privilege: the checkpoint service as its user, the pod's KV agent as
    the agents' user scoped to that pod (its own bucket of the family ``nats://<bucket>``); a drain saves every
    session, and the pod, restarted, restores them. Speaking as another pod is refused."""
    caplog.set_level(logging.DEBUG)
    bucket = bucket_of(subjects)
    service_bus = await Bus.connect(as_user("checkpoint"), subjects, "checkpoint", connect_timeout=2.0)
    agent_errors: list[Exception] = []
    agent_bus = await Bus.connect(
        as_user(AGENT), subjects, f"agent/{AGENT_POD}", connect_timeout=2.0, on_error=agent_errors.append
    )
    service_store = open_store(f"nats://{bucket}", service_bus.nc)
    assert isinstance(service_store, PodBuckets)
    await service_store.index.ensure()  # the checkpoint service makes the family's index; each pod its own bucket
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=service_store)
    running = await start_service(service, replace(settings, nats=as_user("checkpoint")), Wiring)
    agent_store = open_store(f"nats://{bucket}", agent_bus.nc, pod=AGENT_POD)
    agent = KvAgent(agent_store, pod=AGENT_POD, node="node-1", namespace="llm", deployment="llama", layout=LAYOUT)
    blocks = {f"s{i}": [block_content(f"s{i}", b, LAYOUT.block_bytes) for b in range(3)] for i in range(3)}
    for sid, arrays in blocks.items():
        agent.register_session(sid)
        for array in arrays:
            agent.append_block(sid, array)
    endpoint = AgentEndpoint(agent, agent_bus, announce_s=30)
    seen: list[DrainCompleted | DrainFailed] = []

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        seen.append(event)

    await admin.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
    await admin.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
    try:
        await endpoint.start()
        await eventually(lambda: _sessions_on(service, "node-1", 3))
        await admin.publish(DrainRequested(node="node-1", drain_id="d-auth", deadline_s=20))
        await eventually(lambda: seen, timeout=20)
        assert isinstance(seen[0], DrainCompleted) and seen[0].sessions_committed == 3, seen[0]

        restarted = KvAgent(
            agent_store, pod=AGENT_POD, node="node-2", namespace="llm", deployment="llama", layout=LAYOUT
        )
        again = AgentEndpoint(restarted, agent_bus, announce_s=30)
        for sid, arrays in blocks.items():
            restored = await again.restore(sid)
            assert [bytes(b) for b in restored.blocks] == [a.tobytes() for a in arrays]

        forged = subjects.pattern("checkpoint.agent.sessions", pod="llama-2")
        await agent_bus.nc.publish(forged, b"{}")
        await agent_bus.nc.flush()
        await eventually(lambda: any(forged.lower() in str(e).lower() for e in agent_errors), timeout=5)
    finally:
        await endpoint.stop()
        await running.stop(grace=1)
        await agent_store.close()
        await agent_bus.close(grace=1.0)
        await service_bus.close(grace=1.0)
    logged = _logged(caplog)
    assert "authorization violation" not in logged.lower()
    violations = [line for line in logged.lower().splitlines() if "permissions violation" in line]
    assert violations and all(forged.lower() in line for line in violations), violations
    _no_secrets_in(logged + "".join(map(str, agent_errors)), passwords)


async def _sessions_on(service: CheckpointService, node: str, count: int) -> bool:
    return len(await service.registry.sessions_on_node(node)) == count


async def test_a_gateway_follows_locations_and_asks_where_under_its_own_user(
    admin: Bus, as_user: AsUser, subjects: Subjects, settings: Settings, passwords: dict[str, str]
) -> None:
    running = await start_service(CheckpointService(), replace(settings, nats=as_user("checkpoint")), Wiring)
    errors: list[Exception] = []
    gateway = await Bus.connect(as_user(GATEWAY), subjects, "gateway", connect_timeout=2.0, on_error=errors.append)
    heard: list[SessionLocation] = []

    async def on_location(event: SessionLocation) -> None:
        heard.append(event)

    try:
        await gateway.subscribe(subjects.pattern("kv.session.location"), on_location, (SessionLocation,))
        await gateway.nc.flush(timeout=10)  # the server has the subscription (the bus's own wait gives up at 2 s)
        moved = SessionLocation(session_id="s1", sequence=7, reason="placed", held=True, pod="llama-1", node="n1")
        await admin.publish(moved)  # (the checkpoint service publishes these; the admin may publish anything)
        await eventually(lambda: heard)
        assert heard[0].pod == "llama-1" and heard[0].sequence == 7
        # a router starting late reads a session's newest location back from the stream: a direct get of the
        # session's location subject (the stream named: looking streams up is not the gateway's to do)
        msg = await gateway.js.get_msg(subjects.events_stream.name, subject=subjects.for_event(moved), direct=True)
        assert msg.data is not None and b'"pod":"llama-1"' in msg.data
        answer = await gateway.request(subjects.command("checkpoint", "where"), WhereIsSession(session_id="s9"), 5)
        assert isinstance(answer, SessionLocation) and (answer.held, answer.reason) == (False, "unknown")
        forged = subjects.pattern("node.drain.requested", node="n1")
        await gateway.nc.publish(forged, b"{}")
        await gateway.nc.flush()
        await eventually(lambda: any(forged.lower() in str(e).lower() for e in errors), timeout=5)
    finally:
        await gateway.close(grace=1.0)
        await running.stop(grace=1)
    _no_secrets_in("".join(map(str, errors)), passwords)


# -- identity from credentials: NATS JWTs, tokens, the callout's decisions ------------------------------------------


def _server_request(issuer: str, *, user: str = "", password: str = "", token: str = "", name: str = "") -> str:
    """An authorization request as nats-server signs one (with a server key of this test's own)."""
    server = nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_SERVER)))
    user_key = nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)))
    claims = {
        "sub": issuer,
        "aud": natsjwt.REQUEST_AUDIENCE,
        "exp": int(time.time()) + 5,
        "nats": {
            "server_id": {"name": "n1", "host": "127.0.0.1", "id": server.public_key.decode()},
            "user_nkey": user_key.public_key.decode(),
            "client_info": {"host": "127.0.0.1", "name": name},
            "connect_opts": {"user": user, "pass": password, "auth_token": token, "name": name},
            "type": "authorization_request",
            "version": 2,
        },
    }
    return natsjwt.encode(claims, server, int(time.time()))


def test_nats_jwts_verify_against_their_issuer_only() -> None:
    issuer = natsjwt.account_key(natsjwt.new_account_seed())
    public = issuer.public_key.decode()
    request = natsjwt.read_request(_server_request(public, user="gw-scaler", password="pw"), public, time.time())
    assert (request.user, request.password) == ("gw-scaler", "pw")
    assert "pw" not in repr(request)
    head, body, sig = _server_request(public, user="u").split(".")
    tampered = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    tampered["nats"]["connect_opts"]["user"] = "gw-admin"
    forged = base64.urlsafe_b64encode(json.dumps(tampered).encode()).rstrip(b"=").decode()
    with pytest.raises(natsjwt.JwtError, match="signature"):
        natsjwt.read_request(f"{head}.{forged}.{sig}", public, time.time())
    other = natsjwt.account_key(natsjwt.new_account_seed()).public_key.decode()
    with pytest.raises(natsjwt.JwtError, match="another issuer"):
        natsjwt.read_request(_server_request(other, user="u"), public, time.time())
    with pytest.raises(natsjwt.JwtError, match="expired"):
        natsjwt.read_request(_server_request(public, user="u"), public, time.time() + 60)
    with pytest.raises(natsjwt.JwtError, match="server"):  # an account may not pose as a server
        natsjwt.read_request(natsjwt.encode({"sub": public, "nats": {}}, issuer, 0), public, time.time())
    perms = permissions(Subjects("gw"), Identity(AGENT, pod="llama-1"))
    user = natsjwt.encode(natsjwt.user_claims(request.user_nkey, "gw-agent-llama-1", perms, 99), issuer, 1)
    claims = natsjwt.decode(user, "account")
    assert claims["iss"] == public and claims["aud"] == "$G" and claims["exp"] == 99
    assert claims["nats"]["pub"]["allow"] == perms["publish"]["allow"]
    assert claims["nats"]["sub"]["allow"] == perms["subscribe"]["allow"]
    assert claims["nats"]["resp"] == {"max": 1, "ttl": 0}


async def test_the_simulated_cluster_reviews_its_tokens_as_kubernetes_does(redis_client: aioredis.Redis) -> None:
    subjects = Subjects("t" + secrets.token_hex(5))
    spec = SimSpec(
        nodes=[NodeSpec(name="node-1", gpus=[GpuSpec(count=1)])],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2)],
    )
    now = [1_000_000.0]
    cluster = await SimCluster.create(redis_client, subjects, spec, clock=lambda: now[0])
    try:
        running, pending = sorted(await cluster.pods(), key=lambda p: p.phase != "Running")
        token = await cluster.issue_token("llm", running.name, ttl_s=600)
        review = await cluster.review_token(token, ("gpuwarden",))
        assert review.authenticated and review.pod == running.name and review.node == "node-1"
        assert review.service_account == ("llm", "default") and review.pod_uid
        assert not (await cluster.review_token(token, ("vault",))).authenticated
        refused = await cluster.review_token(await cluster.issue_token("llm", pending.name), ("gpuwarden",))
        assert not refused.authenticated and "Pending" in refused.error
        now[0] += 600
        assert "expired" in (await cluster.review_token(token, ("gpuwarden",))).error
        with pytest.raises(ClusterError):
            await cluster.issue_token("llm", "no-such-pod")
        alone = await cluster.review_token(
            await cluster.issue_token("gpuwarden", service_account="gpuwarden-checkpoint"), ("gpuwarden",)
        )
        assert (
            alone.authenticated and alone.pod == "" and alone.service_account == ("gpuwarden", "gpuwarden-checkpoint")
        )
    finally:
        await cluster.close()


async def test_the_kubernetes_adapter_asks_the_tokenreview_api() -> None:
    from shared.adapters.kube import KubeCluster
    from tests.fake_kube_api import Access, FakeKubeApi

    async with FakeKubeApi() as api:
        user = {
            "username": "system:serviceaccount:llm:llm-inference",
            "uid": "u-1",
            "groups": ["system:serviceaccounts"],
            "extra": {
                "authentication.kubernetes.io/pod-name": ["llama-7"],
                "authentication.kubernetes.io/pod-uid": ["p"],
            },
        }
        api.issue_token("projected-token", user, ("gpuwarden",))
        kube = KubeCluster.from_host(api.url)
        try:
            review = await kube.review_token("projected-token", ("gpuwarden",))
            assert (
                review.authenticated and review.pod == "llama-7" and review.service_account == ("llm", "llm-inference")
            )
            assert not (await kube.review_token("projected-token", ("vault",))).authenticated
            api.revoke_token("projected-token")  # its pod was deleted
            gone = await kube.review_token("projected-token", ("gpuwarden",))
            assert not gone.authenticated and "invalid bearer token" in gone.error
        finally:
            await kube.close()
        assert api.used() == {Access("create", "authentication.k8s.io", "tokenreviews")}


def test_the_auth_service_account_may_review_tokens_and_nothing_else() -> None:
    rbac = yaml.safe_load_all((Path(__file__).parents[1] / "deploy/rbac/auth.yaml").read_text())
    rules = [rule for doc in rbac if doc and doc.get("kind") == "ClusterRole" for rule in doc["rules"]]
    assert rules == [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}]


class Reviews:
    """A TokenReviewer that answers from a table (token -> review)."""

    def __init__(self, table: dict[str, TokenReview]) -> None:
        self.table = table

    async def review_token(self, token: str, audiences: tuple[str, ...]) -> TokenReview:
        return self.table.get(token, TokenReview(authenticated=False, error="unknown"))


def _sa(namespace: str, name: str, **extra: str) -> TokenReview:
    keys = {"pod": POD_NAME_EXTRA, "node": NODE_NAME_EXTRA}
    return TokenReview(
        authenticated=True,
        username=f"system:serviceaccount:{namespace}:{name}",
        extra={keys[k]: (v,) for k, v in extra.items()},
        audiences=("gpuwarden",),
    )


async def test_the_callout_takes_identity_from_credentials_only() -> None:
    subjects = Subjects("gw")
    reviews = Reviews(
        {
            "pod": _sa("llm", "llm-inference", pod="llama-1", node="node-1"),
            "svc": _sa("gpuwarden", "gpuwarden-device", pod="device-abc", node="node-4"),
            "other-ns": _sa("team-b", "x", pod="evil-1"),
            "lonely": _sa("llm", "default"),
        }
    )
    authority = Authority(
        AuthSettings(agent_namespaces=("llm",)), subjects, {"device": "dpw", "admin": "apw"}, reviews, lambda: 100.0
    )

    async def decide(**fields: str) -> Verdict:
        base = {"server_id": "N", "server_name": "", "user_nkey": "U", "client_host": "", "expires_at": 0}
        given = {"user": "", "password": "", "token": "", "client_name": "", **fields}
        return await authority.decide(natsjwt.AuthorizationRequest(**base, **given))  # type: ignore[arg-type]

    agent = await decide(token="pod", client_name="agent/llama-2")  # the name it gives counts for nothing
    assert agent.identity == Identity(AGENT, pod="llama-1", namespace="llm") and agent.expires_at == 0
    assert (await decide(token="svc")).identity == Identity("device", node="node-4")
    assert (await decide(user="gw-device", password="dpw", client_name="device/node-2")).identity == Identity(
        "device", node="node-2"
    )
    assert (await decide(user="gw-admin", password="apw", client_name="admin/node-2")).identity == Identity(ADMIN)
    for refused in (
        {"user": "gw-device", "password": "apw"},
        {"user": "gw-agent", "password": "x"},
        {"user": "gw-nobody", "password": ""},
        {"token": "other-ns"},
        {"token": "lonely"},
        {"token": "unknown"},
        {},
    ):
        verdict = await decide(**refused)
        assert verdict.identity is None and verdict.reason, refused
        assert "apw" not in verdict.reason and "dpw" not in verdict.reason


async def test_a_consumer_whose_deliveries_were_changed_is_made_again_from_where_it_was(
    bus: Bus, subjects: Subjects
) -> None:
    """A change JetStream cannot undo in place (another user made the consumer again, delivering only the last
    message): the service deletes it and makes it again from the ack floor it found, so nothing after that is
    skipped (what came before may be delivered again: handlers are idempotent)."""
    await bus.ensure_streams()
    spec = ConsumerSpec(
        durable=subjects.durable("checkpoint", "drains"),
        filter_subjects=(subjects.pattern("node.drain.requested"),),
        accepts=(DrainRequested,),
        stream=subjects.events_stream,
    )
    seen: list[str] = []

    async def on_drain(event: DrainRequested) -> None:
        seen.append(event.drain_id)

    consumer = await consume(bus, spec, on_drain)
    await bus.publish(DrainRequested(node="node-1", drain_id="before"))
    await eventually(lambda: seen == ["before"])
    await eventually(lambda: _acked(bus, spec, 1))
    await consumer.stop(1)
    stream = subjects.events_stream.name
    info = await bus.js.consumer_info(stream, spec.durable)
    await bus.js.delete_consumer(stream, spec.durable)
    await bus.js.add_consumer(stream, replace(info.config, deliver_policy=js_api.DeliverPolicy.LAST, max_deliver=1))
    await bus.publish(DrainRequested(node="node-1", drain_id="while-changed-1"))
    await bus.publish(DrainRequested(node="node-1", drain_id="while-changed-2"))
    await consume(bus, spec, on_drain)
    await eventually(lambda: {"while-changed-1", "while-changed-2"} <= set(seen))
    repaired = await bus.js.consumer_info(stream, spec.durable)
    assert consumer_drift(repaired.config, consumer_config(spec)) == []
    assert repaired.config.max_deliver == spec.max_deliver


async def _acked(bus: Bus, spec: ConsumerSpec, seq: int) -> bool:
    info = await bus.js.consumer_info(spec.stream.name, spec.durable)
    return info.ack_floor.stream_seq >= seq


def test_the_callout_configuration_names_only_its_own_user(subjects: Subjects) -> None:
    issuer = natsjwt.account_key(natsjwt.new_account_seed()).public_key.decode()
    text = nats_callout_config(subjects, "pw-auth", issuer)
    assert f'"issuer": "{issuer}"' in text and f'"auth_users": ["{user_name(subjects, AUTH)}"]' in text
    users = json.loads(text[text.index("[") : text.index("\n  timeout")])
    assert [u["user"] for u in users] == [user_name(subjects, AUTH)]
    assert users[0]["permissions"] == auth_permissions()
    with pytest.raises(ValueError, match="account public key"):
        nats_callout_config(subjects, "pw", "U" + issuer[1:])
    with pytest.raises(ValueError, match="no password"):
        nats_callout_config(subjects, "", issuer)
