"""Least-privilege NATS permissions: one user per service, allowed to publish only its own events and the
JetStream API subjects its consumers need (../shared/facts/messaging-reliability.md, "Security").

Every allow-list is derived from ``ROUTES`` and ``Subjects``; the only subjects written here are the fixed
JetStream API and inbox prefixes. ``nats_auth_config`` renders the ``authorization`` block of a nats-server
configuration with a user ``<root>-<service>`` per service plus ``<root>-admin``.

Pure: no NATS client, no I/O, no logging. The passwords pass through ``nats_auth_config`` into the returned text
only; nothing here prints or logs them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from shared.contract.subjects import AGENT_VERBS, ROUTES, Subjects, subject_matches

JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
INBOX = "_INBOX.>"
ADMIN = "admin"
AGENT = "agent"  # the KV agents in inference pods
GATEWAY = "gateway"  # a KV-aware router (an inference gateway's endpoint picker): optional

# The event kinds each service publishes (its own events; config.applied and dead letters come on top).
PUBLISHES: dict[str, tuple[str, ...]] = {
    "driver": (
        "node.drain.requested",
        "node.cordoned",
        "node.uncordoned",
        "driver.upgrade.state",
        "driver.installed",
        "driver.install.failed",
        "driver.install.command",
        "driver.validate.command",
        "driver.versions.command",
    ),
    "device": (
        "device.inventory",
        "device.health.changed",
        "device.xid",
        "device.mig.config",
        "node.drain.requested",  # the MIG controller saves every session on its node before changing the GPUs
    ),
    "metrics": ("metrics.gpu.sample", "metrics.deployment.utilisation"),
    "scaler": ("scaler.decision",),
    "checkpoint": (
        "node.drain.completed",
        "node.drain.failed",
        "checkpoint.saved",
        "checkpoint.failed",
        "checkpoint.restored",
        "checkpoint.save.command",
        "kv.session.location",
        "kv.rollout.state",
        "model.prepare.command",
    ),
}

SERVICES: tuple[str, ...] = tuple(PUBLISHES)

# The core subjects a KV agent publishes as its pod (announcements, save reports and progress), and the commands
# it sends the checkpoint service.
AGENT_PUBLISHES: tuple[str, ...] = (
    "checkpoint.agent.sessions",
    "checkpoint.save.report",
    "checkpoint.save.progress",
    "model.prepare.report",
)
AGENT_REQUESTS: tuple[str, ...] = AGENT_VERBS

# Everyone ``nats_auth_config`` writes a user for; the optional ones only when given a password.
USERS: tuple[str, ...] = (*SERVICES, AGENT, ADMIN)
OPTIONAL_USERS: tuple[str, ...] = (GATEWAY,)

# Services that run one instance per node; their node-scoped subjects can be narrowed to one node.
NODE_SCOPED: frozenset[str] = frozenset({"driver", "device", "metrics"})

# Kinds a node-scoped service sends to every node, never narrowed to its own: the driver upgrade coordinator runs
# in whichever driver pod leads, and commands each node's driver agent.
ANY_NODE: frozenset[str] = frozenset({"driver.install.command", "driver.validate.command", "driver.versions.command"})

# The JetStream API a durable pull consumer needs: look the stream up, create or look up its consumer, fetch.
_CONSUMER_API: tuple[str, ...] = (
    "CONSUMER.CREATE",
    "CONSUMER.DURABLE.CREATE",
    "CONSUMER.INFO",
    "CONSUMER.MSG.NEXT",
)

for _kind in ANY_NODE:
    if _kind not in ROUTES:
        raise RuntimeError(f"permissions: ANY_NODE names unknown event kind {_kind!r}")

for _service, _kinds in PUBLISHES.items():
    for _kind in _kinds:
        if _kind not in ROUTES:  # a renamed kind must fail at import, not as a silent permission gap
            raise RuntimeError(f"permissions: {_service} publishes unknown event kind {_kind!r}")

_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def user_name(subjects: Subjects, service: str) -> str:
    """The NATS user of ``service`` (or ``"admin"``) under this root: ``<root>-<service>``."""
    return f"{subjects.root}-{service}"


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def jetstream_consumer_api(subjects: Subjects) -> list[str]:
    """The JetStream API and ack subjects a service's consumers need on this root's streams (and no others)."""
    allowed: list[str] = []
    for spec in subjects.streams:
        allowed.append(f"{JS_API}.STREAM.INFO.{spec.name}")
        allowed.append(f"{JS_API}.STREAM.MSG.GET.{spec.name}")  # reading back what a max-deliveries advisory names
        allowed.extend(f"{JS_API}.{api}.{spec.name}.>" for api in _CONSUMER_API)
        allowed.append(f"{JS_ACK}.{spec.name}.>")
    return allowed


def publish_allow(subjects: Subjects, service: str, node: str | None = None) -> list[str]:
    """What ``service`` may publish. With ``node``, a node-scoped service's node subjects name that node only."""
    if service not in PUBLISHES:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    fields: dict[str, str] = {"node": node} if node is not None and service in NODE_SCOPED else {}
    events = [subjects.pattern(kind, **({} if kind in ANY_NODE else fields)) for kind in PUBLISHES[service]]
    applied = subjects.pattern("config.applied", service=service)
    return _unique(
        [
            *events,
            applied,
            *subjects.deadletter_stream.subjects,
            INBOX,
            *jetstream_consumer_api(subjects),
        ]
    )


def subscribe_allow(subjects: Subjects) -> list[str]:
    advisories = [f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{spec.name}.>" for spec in subjects.streams]
    return [f"{subjects.root}.>", INBOX, *advisories]


def service_permissions(
    subjects: Subjects, service: str, node: str | None = None, bucket: str | None = None
) -> dict[str, Any]:
    """The NATS ``permissions`` object of ``service``'s user. With ``bucket``, the checkpoint service may also use
    that Object Store bucket (it reads and deletes the checkpoints the agents write)."""
    allow = publish_allow(subjects, service, node)
    if bucket is not None and service == "checkpoint":
        allow = _unique([*allow, *object_store_api(bucket)])
    return {
        "publish": {"allow": allow},
        "subscribe": {"allow": subscribe_allow(subjects)},
    }


def object_store_api(bucket: str) -> list[str]:
    """What writing and reading checkpoints in the Object Store bucket ``bucket`` takes (shared.kv.objstore); the
    bucket itself is created by the admin."""
    stream = f"OBJ_{bucket}"
    return [
        f"$O.{bucket}.>",
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.STREAM.PURGE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.DELETE.{stream}.>",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.>",
        f"{JS_ACK}.{stream}.>",
    ]


def agent_permissions(subjects: Subjects, pod: str | None = None, bucket: str | None = None) -> dict[str, Any]:
    """The KV agents' user. With ``pod``, the agent may speak only as that pod and hear only that pod's save
    commands (a user per pod, e.g. issued at pod start); without, as any pod. With ``bucket``, it may write and
    read checkpoints in that JetStream Object Store bucket (``nats://<bucket>``) and nothing else of JetStream
    but storing a dead letter. It never publishes lifecycle events: the checkpoint service records what agents
    report."""
    fields: dict[str, str] = {"pod": pod} if pod is not None else {}
    own = [subjects.pattern(kind, **fields) for kind in AGENT_PUBLISHES]
    save_command = subjects.pattern("checkpoint.save.command", **fields)  # the preStop hook asks its own agent
    prepare_command = subjects.pattern("model.prepare.command", **fields)
    rollouts = subjects.pattern("kv.rollout.state")  # a rollout's switch, heard by every agent
    requests = (
        [subjects.agent_command(verb, pod) for verb in AGENT_REQUESTS]
        if pod is not None
        else [subjects.agent_commands(verb) for verb in AGENT_REQUESTS]
    )
    deadletters = subjects.deadletter_stream
    publish = [*own, save_command, *requests, INBOX, *deadletters.subjects, f"{JS_API}.STREAM.INFO.{deadletters.name}"]
    if bucket is not None:
        publish += object_store_api(bucket)
    return {
        "publish": {"allow": _unique(publish)},
        "subscribe": {"allow": [save_command, prepare_command, rollouts, INBOX]},
    }


def gateway_permissions(subjects: Subjects) -> dict[str, Any]:
    """A KV-aware router's user: it hears where sessions move (``kv.session.location``, live or read back from the
    events stream with its own ephemeral consumer, e.g. the last one per session) and rollouts switching, and asks
    the checkpoint service where a session is (``where``). It publishes nothing else: no event, no command."""
    events = subjects.events_stream.name
    locations = subjects.pattern("kv.session.location")
    rollouts = subjects.pattern("kv.rollout.state")
    publish = [
        subjects.command("checkpoint", "where"),
        INBOX,
        f"{JS_API}.STREAM.INFO.{events}",
        f"{JS_API}.CONSUMER.CREATE.{events}",
        f"{JS_API}.CONSUMER.CREATE.{events}.>",
        f"{JS_API}.CONSUMER.DELETE.{events}.>",
        f"{JS_API}.CONSUMER.INFO.{events}.>",
        f"{JS_API}.CONSUMER.MSG.NEXT.{events}.>",
        f"{JS_ACK}.{events}.>",
    ]
    return {"publish": {"allow": publish}, "subscribe": {"allow": [locations, rollouts, INBOX]}}


def admin_permissions(subjects: Subjects) -> dict[str, Any]:
    """The operator's user: everything under the root, the whole JetStream API (streams are created here), acks
    and replies. Note ``$JS.API.>`` is account-wide: isolate installations that share a server by account."""
    return {
        "publish": {"allow": [f"{subjects.root}.>", f"{JS_API}.>", f"{JS_ACK}.>", INBOX]},
        "subscribe": {"allow": subscribe_allow(subjects)},
    }


def may_publish(permissions: Mapping[str, Any], subject: str) -> bool:
    """Whether a permissions object (as built here) lets its user publish on ``subject``."""
    allow: list[str] = permissions.get("publish", {}).get("allow", [])
    deny: list[str] = permissions.get("publish", {}).get("deny", [])
    return any(subject_matches(p, subject) for p in allow) and not any(subject_matches(p, subject) for p in deny)


def nats_auth_config(
    subjects: Subjects,
    passwords: Mapping[str, str],
    node: str | None = None,
    pod: str | None = None,
    bucket: str | None = None,
) -> str:
    """A nats-server configuration fragment ``authorization { users = [ ... ] }`` with one user per service, the
    KV agents' user (scoped by ``pod`` and ``bucket``, see ``agent_permissions``) and the admin, and each of
    ``OPTIONAL_USERS`` given a password (the gateway: ``gateway_permissions``). ``passwords`` maps each name of
    ``USERS`` to its password; a missing, empty or unknown entry is an error naming the entry (never the value).
    The text holds the passwords: write it to a file only the server can read."""
    known = (*USERS, *OPTIONAL_USERS)
    unknown = sorted(set(passwords) - set(known))
    if unknown:
        raise ValueError(f"passwords given for unknown users: {', '.join(unknown)}; known: {', '.join(known)}")
    missing = [name for name in USERS if not passwords.get(name)]
    if missing:
        raise ValueError(f"no password for: {', '.join(missing)}")
    names = [*USERS, *(name for name in OPTIONAL_USERS if name in passwords)]
    empty = [name for name in names if not passwords[name]]
    if empty:
        raise ValueError(f"no password for: {', '.join(empty)}")
    bad = [name for name in names if _CONTROL_RE.search(passwords[name])]
    if bad:
        raise ValueError(f"password of {', '.join(bad)} has control characters")
    users: list[dict[str, Any]] = []
    for name in names:
        if name == ADMIN:
            permissions = admin_permissions(subjects)
        elif name == GATEWAY:
            permissions = gateway_permissions(subjects)
        elif name == AGENT:
            permissions = agent_permissions(subjects, pod, bucket)
        else:
            permissions = service_permissions(subjects, name, node, bucket)
        users.append({"user": user_name(subjects, name), "password": passwords[name], "permissions": permissions})
    body = json.dumps(users, indent=2, ensure_ascii=False)
    indented = body.replace("\n", "\n  ")
    return f"authorization {{\n  users = {indented}\n}}\n"
