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

from shared.contract.subjects import ROUTES, Subjects

JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
INBOX = "_INBOX.>"
ADMIN = "admin"

# The event kinds each service publishes (its own events; config.applied and dead letters come on top).
PUBLISHES: dict[str, tuple[str, ...]] = {
    "driver": (
        "node.drain.requested",
        "node.cordoned",
        "node.uncordoned",
        "driver.upgrade.state",
        "driver.installed",
        "driver.install.failed",
    ),
    "device": ("device.inventory", "device.health.changed", "device.xid"),
    "metrics": ("metrics.gpu.sample", "metrics.deployment.utilisation"),
    "scaler": ("scaler.decision",),
    "checkpoint": (
        "node.drain.completed",
        "node.drain.failed",
        "checkpoint.saved",
        "checkpoint.failed",
        "checkpoint.restored",
        "checkpoint.save.command",
    ),
}

SERVICES: tuple[str, ...] = tuple(PUBLISHES)

# Services that run one instance per node; their node-scoped subjects can be narrowed to one node.
NODE_SCOPED: frozenset[str] = frozenset({"driver", "device", "metrics"})

# The JetStream API a durable pull consumer needs: look the stream up, create or look up its consumer, fetch.
_CONSUMER_API: tuple[str, ...] = (
    "CONSUMER.CREATE",
    "CONSUMER.DURABLE.CREATE",
    "CONSUMER.INFO",
    "CONSUMER.MSG.NEXT",
)

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
    events = [subjects.pattern(kind, **fields) for kind in PUBLISHES[service]]
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


def service_permissions(subjects: Subjects, service: str, node: str | None = None) -> dict[str, Any]:
    """The NATS ``permissions`` object of ``service``'s user."""
    return {
        "publish": {"allow": publish_allow(subjects, service, node)},
        "subscribe": {"allow": subscribe_allow(subjects)},
    }


def admin_permissions(subjects: Subjects) -> dict[str, Any]:
    """The operator's user: everything under the root, the whole JetStream API (streams are created here), acks
    and replies. Note ``$JS.API.>`` is account-wide: isolate installations that share a server by account."""
    return {
        "publish": {"allow": [f"{subjects.root}.>", f"{JS_API}.>", f"{JS_ACK}.>", INBOX]},
        "subscribe": {"allow": subscribe_allow(subjects)},
    }


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` is one token, a final ``>`` one or more."""
    want = pattern.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return i == len(want) - 1 and len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def may_publish(permissions: Mapping[str, Any], subject: str) -> bool:
    """Whether a permissions object (as built here) lets its user publish on ``subject``."""
    allow: list[str] = permissions.get("publish", {}).get("allow", [])
    deny: list[str] = permissions.get("publish", {}).get("deny", [])
    return any(subject_matches(p, subject) for p in allow) and not any(subject_matches(p, subject) for p in deny)


def nats_auth_config(subjects: Subjects, passwords: Mapping[str, str], node: str | None = None) -> str:
    """A nats-server configuration fragment ``authorization { users = [ ... ] }`` with one user per service and
    the admin. ``passwords`` maps each service name and ``"admin"`` to its password; a missing, empty or unknown
    entry is an error naming the entry (never the value). The text holds the passwords: write it to a file only
    the server can read."""
    wanted = (*SERVICES, ADMIN)
    unknown = sorted(set(passwords) - set(wanted))
    if unknown:
        raise ValueError(f"passwords given for unknown users: {', '.join(unknown)}; known: {', '.join(wanted)}")
    missing = [name for name in wanted if not passwords.get(name)]
    if missing:
        raise ValueError(f"no password for: {', '.join(missing)}")
    bad = [name for name in wanted if _CONTROL_RE.search(passwords[name])]
    if bad:
        raise ValueError(f"password of {', '.join(bad)} has control characters")
    users: list[dict[str, Any]] = []
    for name in wanted:
        permissions = admin_permissions(subjects) if name == ADMIN else service_permissions(subjects, name, node)
        users.append({"user": user_name(subjects, name), "password": passwords[name], "permissions": permissions})
    body = json.dumps(users, indent=2, ensure_ascii=False)
    indented = body.replace("\n", "\n  ")
    return f"authorization {{\n  users = {indented}\n}}\n"
