"""Least-privilege NATS permissions: who may publish, subscribe and reach which JetStream consumer.

Every connection has an ``Identity`` (a service, the admin, the optional gateway, or one inference pod's KV agent),
proven by its credentials: a password, or a Kubernetes service-account token that the auth callout
(``services.auth``) reviews. ``permissions(subjects, identity)`` is what that identity may do; the callout signs it
into the user it hands the server, and ``nats_auth_config`` writes the same lists into a static ``authorization``
block for a server without a callout. This module is the one source of the allow-lists; every one is derived from
``ROUTES``, ``Subjects`` and the tables here (``PUBLISHES``, ``HEARS``, ``DURABLES``); the only subjects written
here are the fixed JetStream API, advisory and inbox prefixes.

What holds for every identity (docs/security.md has the table):

- Replies travel on inboxes of its own: ``_INBOX.<name>`` (``inbox_prefix``); it may subscribe there and under no
  other inbox, so nobody reads another's replies. It answers a request through ``allow_responses`` (one reply to
  a message it received), never through a publish right on inboxes.
- A service reaches only its own durable consumers (``DURABLES``): create, update, look up, pull, ack, delete and
  hear their max-deliveries advisory. Nobody else may, but the admin.
- A KV agent speaks only as its pod; the gateway only listens to locations and rollouts, reads their last values
  back (JetStream direct get on those subjects only) and asks ``where``.

Pure: no NATS client, no I/O, no logging. The passwords pass through ``nats_auth_config`` into the returned text
only; nothing here prints or logs them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.contract.base import id_problem, subject_token
from shared.contract.subjects import AGENT_VERBS, ROUTES, StreamSpec, Subjects, subject_matches

JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
INBOX_ROOT = "_INBOX"
ADVISORY_MAX_DELIVERIES = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"
ADMIN = "admin"
AGENT = "agent"  # the KV agents in inference pods
GATEWAY = "gateway"  # a KV-aware router (an inference gateway's endpoint picker): optional
AUTH = "auth"  # the auth callout's own user: the only one the server itself knows when a callout is configured
AUTH_CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"  # where nats-server sends its authorization requests

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
        "node.drain.query",  # asks the checkpoint service for the verdict of a drain it named
    ),
    "device": (
        "device.inventory",
        "device.health.changed",
        "device.xid",
        "device.mig.config",
        "node.drain.requested",  # the MIG controller saves every session on its node before changing the GPUs
        "node.drain.query",  # and asks the checkpoint service for that drain's recorded verdict
    ),
    "metrics": ("metrics.gpu.sample", "metrics.deployment.utilisation"),
    "scaler": ("scaler.decision",),
    "checkpoint": (
        "node.drain.completed",
        "node.drain.failed",
        "checkpoint.saved",
        "checkpoint.failed",
        "checkpoint.restored",
        "checkpoint.forgotten",
        "checkpoint.save.command",
        "kv.session.location",
        "kv.rollout.state",
        "model.prepare.command",
    ),
    "router": ("kv.session.prefetch.command",),  # it asks pods to restore sessions ahead of their next request
}

SERVICES: tuple[str, ...] = tuple(PUBLISHES)

# The core subjects each service subscribes to (the lifecycle events it consumes come through its durable
# consumers, ``DURABLES``; the replies to its own requests through its inbox). Kinds of ``ROUTES``, every field a
# wildcard.
HEARS: dict[str, tuple[str, ...]] = {
    "driver": ("driver.install.command", "driver.validate.command", "driver.versions.command"),  # its node agent
    "device": ("node.drain.completed", "node.drain.failed"),  # wake the MIG controller, which asks the record
    "metrics": ("metrics.gpu.sample",),  # the bus aggregator hears every node's samples
    "scaler": ("metrics.deployment.utilisation", "requests.inference", "kv.pod.load"),  # + pods' KV cache, TTFT
    "checkpoint": (
        "checkpoint.agent.sessions",  # announcements (answered)
        "kv.session.where",  # a gateway's (or the CLI's) question
        "kv.sessions.query",  # pages of sessions (the CLI's status)
        "kv.fleet.query",  # session counts (the CLI's status)
        "node.drain.query",  # a drain's recorded verdict (the drain client's: the CLI, driver, MIG controller)
    ),
    "router": ("kv.session.location", "kv.pod.load", "kv.rollout.state"),  # where sessions are, pods' KV load
}


@dataclass(frozen=True, slots=True)
class Durable:
    """A durable pull consumer a service creates: ``Subjects.durable(service, purpose[, node])`` on ``stream``
    (``events``, ``requests`` or ``deadletter``). ``per_node``: one per node, named after it."""

    service: str
    purpose: str
    stream: str = "events"
    per_node: bool = False

    def name(self, subjects: Subjects, node: str = "") -> str:
        return subjects.durable(self.service, self.purpose, node if self.per_node else "")

    def stream_spec(self, subjects: Subjects) -> StreamSpec:
        return {"events": subjects.events_stream, "requests": subjects.requests_stream}.get(
            self.stream, subjects.deadletter_stream
        )


# Every durable consumer a service creates (tests/test_security.py checks this against the services' sources).
DURABLES: tuple[Durable, ...] = (
    Durable("checkpoint", "drains"),
    Durable("checkpoint", "gpu-failures"),
    Durable("driver", "drain-verdicts"),
    Durable("device", "cordon", per_node=True),
    Durable("metrics", "inventory", per_node=True),
    Durable("scaler", "drains"),
    Durable("scaler", "rollouts"),
)

# The core subjects a KV agent publishes as its pod (announcements, save reports and progress), and the commands
# it sends the checkpoint service.
AGENT_PUBLISHES: tuple[str, ...] = (
    "checkpoint.agent.sessions",
    "checkpoint.save.report",
    "checkpoint.save.progress",
    "model.prepare.report",
    "kv.session.prefetched",  # its answer to the router's prefetch command
    "kv.pod.load",  # its pod's KV pool and time to first token, which the scaler hears (HEARS)
)
AGENT_REQUESTS: tuple[str, ...] = AGENT_VERBS

# Everyone ``nats_auth_config`` writes a user for; the optional ones only when given a password.
USERS: tuple[str, ...] = (*SERVICES, AGENT, ADMIN)
OPTIONAL_USERS: tuple[str, ...] = (GATEWAY,)
ROLES: tuple[str, ...] = (*SERVICES, AGENT, ADMIN, GATEWAY)

# Services that run one instance per node; their node-scoped subjects and consumers can be narrowed to one node.
NODE_SCOPED: frozenset[str] = frozenset({"driver", "device", "metrics"})

# Kinds a node-scoped service sends to every node, never narrowed to its own: the driver upgrade coordinator runs
# in whichever driver pod leads, and commands each node's driver agent.
ANY_NODE: frozenset[str] = frozenset({"driver.install.command", "driver.validate.command", "driver.versions.command"})

for _kind in ANY_NODE:
    if _kind not in ROUTES:
        raise RuntimeError(f"permissions: ANY_NODE names unknown event kind {_kind!r}")

for _table in (PUBLISHES, HEARS):
    for _service, _kinds in _table.items():
        for _kind in _kinds:
            if _kind not in ROUTES:  # a renamed kind must fail at import, not as a silent permission gap
                raise RuntimeError(f"permissions: {_service} names unknown event kind {_kind!r}")

for _durable in DURABLES:
    if _durable.service not in PUBLISHES or _durable.stream not in ("events", "requests", "deadletter"):
        raise RuntimeError(f"permissions: durable {_durable} names an unknown service or stream")

_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a connection is, as its credentials proved it. ``role``: one of ``ROLES``. ``node``: the node a
    node-scoped service runs on (empty: not narrowed). ``pod``/``namespace``: the KV agent's pod (empty for the
    shared agent user of a static configuration, which may speak as any pod)."""

    role: str
    node: str = ""
    pod: str = ""
    namespace: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; known: {', '.join(ROLES)}")
        for kind, value in (("node", self.node), ("pod", self.pod), ("namespace", self.namespace)):
            if value and id_problem(kind, value):
                raise ValueError(id_problem(kind, value))


def user_name(subjects: Subjects, service: str) -> str:
    """The NATS user of ``service`` (or ``"admin"``, ``"agent"``, ``"gateway"``, ``"auth"``) under this root:
    ``<root>-<service>``."""
    return f"{subjects.root}-{service}"


def identity_name(subjects: Subjects, identity: Identity) -> str:
    """The name a connection of ``identity`` carries (the user's name, its inbox's token): ``<root>-<role>``, and
    for one pod's KV agent ``<root>-agent-<pod>`` (a pod name's dots become ``_``, which no pod name has, so no
    two pods share a name)."""
    if identity.role == AGENT and identity.pod:
        return f"{user_name(subjects, AGENT)}-{subject_token(identity.pod)}"
    return user_name(subjects, identity.role)


def inbox_prefix(name: str) -> str:
    """The reply inbox prefix of the user ``name``: ``_INBOX.<name>`` (one token; dots become ``_``). The client
    sets it (nats-py's ``inbox_prefix``), the server lets only that user subscribe under it."""
    if not name or _CONTROL_RE.search(name) or any(c in name for c in " *>"):
        raise ValueError(f"user name {name!r} cannot name an inbox")
    return f"{INBOX_ROOT}.{subject_token(name)}"


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _own_inbox(name: str) -> str:
    return inbox_prefix(name) + ".>"


def durables_of(subjects: Subjects, service: str, node: str = "") -> list[tuple[StreamSpec, str]]:
    """(stream, durable name) of every durable consumer ``service`` creates. A per-node one is named only with
    ``node``: without it the service gets none of them (a name cannot be wildcarded in part)."""
    return [
        (d.stream_spec(subjects), d.name(subjects, node))
        for d in DURABLES
        if d.service == service and (node or not d.per_node)
    ]


def consumer_api(subjects: Subjects, service: str, node: str = "") -> list[str]:
    """What ``service`` needs of JetStream: look its streams up (and nothing of anyone else's); create, update,
    look up, pull from, ack and delete its own durable consumers and read back what their max-deliveries
    advisory names. The advisories themselves are in ``subscribe``."""
    allowed = [f"{JS_API}.STREAM.INFO.{spec.name}" for spec in subjects.streams]
    for spec, durable in durables_of(subjects, service, node):
        allowed += [
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{spec.name}.{durable}",
            f"{JS_API}.CONSUMER.CREATE.{spec.name}.{durable}",
            f"{JS_API}.CONSUMER.CREATE.{spec.name}.{durable}.>",
            f"{JS_API}.CONSUMER.INFO.{spec.name}.{durable}",
            f"{JS_API}.CONSUMER.DELETE.{spec.name}.{durable}",  # repairing a consumer that drifted
            f"{JS_API}.CONSUMER.MSG.NEXT.{spec.name}.{durable}",
            f"{JS_API}.STREAM.MSG.GET.{spec.name}",  # the message a max-deliveries advisory names
            f"{JS_ACK}.{spec.name}.{durable}.>",
        ]
    if service == "scaler":  # queue depth: the workload consumers' counts (no message), as KEDA's NATS scaler
        allowed.append(f"{JS_API}.CONSUMER.INFO.{subjects.requests_stream.name}.*")
    if service == "router":  # at start, the newest location of each session read back: no consumer, no other event
        allowed.append(f"{JS_API}.DIRECT.GET.{subjects.events_stream.name}.{subjects.pattern('kv.session.location')}")
    return _unique(allowed)


def publish_allow(subjects: Subjects, service: str, node: str | None = None) -> list[str]:
    """What ``service`` may publish. With ``node``, a node-scoped service's node subjects name that node only."""
    if service not in PUBLISHES:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    scoped = bool(node) and service in NODE_SCOPED
    fields: dict[str, str] = {"node": node} if scoped and node else {}
    events = [subjects.pattern(kind, **({} if kind in ANY_NODE else fields)) for kind in PUBLISHES[service]]
    applied = subjects.pattern("config.applied", service=service)
    return _unique(
        [
            *events,
            applied,
            *subjects.deadletter_stream.subjects,
            *consumer_api(subjects, service, node if scoped and node else ""),
        ]
    )


def subscribe_allow(subjects: Subjects, service: str, node: str | None = None) -> list[str]:
    """What ``service`` may subscribe to: the core subjects it hears, the commands it answers, its inbox
    (``_INBOX.<root>-<service>``) and its own consumers' max-deliveries advisories."""
    scoped = node if node and service in NODE_SCOPED else ""
    heard = [subjects.pattern(kind) for kind in HEARS[service]]
    if service == "checkpoint":
        heard += [subjects.agent_commands(verb) for verb in AGENT_VERBS]
    if service == "device":
        heard.append(subjects.command("sim", "fault"))  # a SIMULATED node's fault injection (tests, `gpuwarden fault`)
    advisories = [
        f"{ADVISORY_MAX_DELIVERIES}.{spec.name}.{name}" for spec, name in durables_of(subjects, service, scoped)
    ]
    return _unique([*heard, _own_inbox(user_name(subjects, service)), *advisories])


def service_permissions(
    subjects: Subjects, service: str, node: str | None = None, bucket: str | None = None
) -> dict[str, Any]:
    """The NATS ``permissions`` object of ``service``'s user. With ``bucket``, the checkpoint service may also read,
    purge and list every bucket of that checkpoint store (``checkpoint_store_custodian``): it reads what the agents
    report and deletes what retention lets go, in every pod's bucket."""
    allow = publish_allow(subjects, service, node)
    result: dict[str, Any] = {
        "publish": {"allow": allow},
        "subscribe": {"allow": subscribe_allow(subjects, service, node)},
        "allow_responses": True,
    }
    if bucket is not None and service == "checkpoint":
        custodian = checkpoint_store_custodian(subjects, bucket)
        result["publish"] = {"allow": _unique([*allow, *custodian["allow"]]), "deny": custodian["deny"]}
    return result


def object_store_api(bucket: str) -> list[str]:
    """What writing and reading checkpoints in the Object Store bucket ``bucket`` takes (shared.kv.objstore), when
    one user owns the whole bucket; the bucket itself is created by the admin."""
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


# -- the checkpoint store on NATS: one bucket per pod ----------------------------------------------------------------
#
# ``nats://<bucket>`` is a family of Object Store buckets (shared.kv.objstore.family): each pod writes its packs and
# manifests into a bucket of its own, ``<bucket>-<owner>`` (``pod_bucket``), and names each manifest in the family's
# index stream, ``OBJIDX_<bucket>`` (subjects ``$O.<bucket>.I.<session>.<checkpoint>.<owner>``), where any reader
# finds a session's checkpoints with one request. A pack's id ends with its owner (``<32 hex>-<owner>``), so a
# manifest that references another pod's blocks says which bucket they are in. The bucket ``<bucket>`` itself is
# the single bucket of earlier versions: still read, never written.
#
# Reads go through JetStream direct gets (``$JS.API.DIRECT.GET.<stream>``), never consumers: a consumer's pull
# subject names the consumer, and a right to pull from any consumer of any stream would reach the services'
# durables. A direct get on any stream is allowed, less the installation's own streams (``subjects.streams``): the
# buckets are created as pods appear, and a stream name is one subject token, which no permission can match by
# prefix. What JetStream holds beyond them in the same account (another installation's streams) is readable too:
# isolate installations by account, as for the admin.

INDEX_TOKEN = "I"
_OWNER_MAX = 80


def bucket_owner(pod: str) -> str:
    """The token that names ``pod``'s bucket and ends its pack ids: the pod's name, dots as ``_`` (``subject_token``);
    a name longer than 80 characters is cut and ended with a digest of the whole, so that a pack id stays within
    the 128 characters of an id."""
    token = subject_token(pod)
    if len(token) <= _OWNER_MAX:
        return token
    import hashlib

    return f"{token[: _OWNER_MAX - 13]}-{hashlib.sha256(pod.encode()).hexdigest()[:12]}"


def pod_bucket(bucket: str, owner: str) -> str:
    """The bucket of one pod (``owner``: its ``bucket_owner`` token) in the family ``bucket``: ``<bucket>-<owner>``."""
    return f"{bucket}-{owner}"


def index_stream(bucket: str) -> str:
    """The family's index stream: ``OBJIDX_<bucket>`` (no Object Store bucket's stream is named so)."""
    return f"OBJIDX_{bucket}"


def index_subjects(bucket: str) -> str:
    """Every entry of the family's index: ``$O.<bucket>.I.>`` (no Object Store stream's subjects: those are
    ``$O.<bucket>.C.>`` and ``$O.<bucket>.M.>``)."""
    return f"$O.{bucket}.{INDEX_TOKEN}.>"


def _contract_stream_denials(subjects: Subjects, *apis: str) -> list[str]:
    """``$JS.API.<api>.<stream>`` (and ``.>`` under it) for each of the installation's own streams."""
    denied: list[str] = []
    for spec in subjects.streams:
        for api in apis:
            denied += [f"{JS_API}.{api}.{spec.name}", f"{JS_API}.{api}.{spec.name}.>"]
    return denied


def checkpoint_store_reader(subjects: Subjects, bucket: str) -> dict[str, list[str]]:
    """``{"allow": [...], "deny": [...]}`` for a publish list: read every bucket of the family ``bucket`` (stream
    info and direct gets on any stream but the installation's own). Nothing here writes or purges."""
    return {
        "allow": [f"{JS_API}.STREAM.INFO.*", f"{JS_API}.DIRECT.GET.*"],
        "deny": _contract_stream_denials(subjects, "DIRECT.GET"),
    }


def checkpoint_store_writer(subjects: Subjects, bucket: str, pod: str) -> dict[str, list[str]]:
    """An agent's rights on the family ``bucket``: write, purge and delete in its own pod's bucket only; name its own
    checkpoints in the index (entries ending with its owner token, no purge there); read every bucket
    (``checkpoint_store_reader``); look up none of the installation's own streams but the dead letters'. It creates
    no stream, not even its own bucket: a stream's configuration names its subjects, and a pod creating its bucket
    could claim another pod's. The checkpoint service creates each pod's bucket when it first hears the pod."""
    owner = bucket_owner(pod)
    own = pod_bucket(bucket, owner)
    stream = f"OBJ_{own}"
    reader = checkpoint_store_reader(subjects, bucket)
    allow = [
        f"$O.{own}.>",
        f"$O.{bucket}.{INDEX_TOKEN}.*.*.{owner}",
        f"{JS_API}.STREAM.PURGE.{stream}",
        f"{JS_API}.STREAM.MSG.DELETE.{stream}",
        *reader["allow"],
    ]
    looked_up = [spec for spec in subjects.streams if spec.name != subjects.deadletter_stream.name]
    deny = [*reader["deny"], *(f"{JS_API}.STREAM.INFO.{spec.name}" for spec in looked_up)]
    return {"allow": allow, "deny": deny}


def checkpoint_store_custodian(subjects: Subjects, bucket: str) -> dict[str, list[str]]:
    """The checkpoint service's rights on the family ``bucket``: read every bucket, list the streams (to find
    every pod's bucket), create each pod's bucket (when it first hears the pod) and the index stream, purge in any
    bucket (retention, refused saves, orphans), and index the manifests of the single bucket of earlier versions
    that have no index entry yet. It creates and purges none of the installation's own streams. A stream name is one
    subject token, so "any bucket of the family" is any stream but those."""
    reader = checkpoint_store_reader(subjects, bucket)
    allow = [
        *reader["allow"],
        f"{JS_API}.STREAM.NAMES",
        f"{JS_API}.STREAM.PURGE.*",
        f"{JS_API}.STREAM.CREATE.*",
        f"$O.{bucket}.C.index.>",  # indexing the single bucket's manifests (shared.kv.objstore.codec.INDEX_TOKEN)
    ]
    denied = _contract_stream_denials(subjects, "STREAM.PURGE", "STREAM.CREATE")
    return {"allow": allow, "deny": [*reader["deny"], *denied]}


def agent_permissions(
    subjects: Subjects, pod: str | None = None, bucket: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """The KV agents' user. With ``pod``, the agent may speak only as that pod and hear only that pod's save
    commands (a user per pod: what the auth callout issues for a pod's service-account token); without, as any
    pod (a static configuration's shared agent user). With ``bucket`` and ``pod``, it may write checkpoints only in
    its own pod's bucket of the family ``nats://<bucket>`` and read every bucket of it
    (``checkpoint_store_writer``); with ``bucket`` alone (the shared agent user), it owns the one bucket
    ``bucket`` (``object_store_api``). Nothing else of JetStream but storing a dead letter.
    It never publishes lifecycle events: the checkpoint service records what agents report. It answers save and
    prepare commands through ``allow_responses``. ``name``: the user's name, which names its inbox (default
    ``identity_name``: ``<root>-agent-<pod>``, or ``<root>-agent`` for any pod)."""
    fields: dict[str, str] = {"pod": pod} if pod else {}
    own = [subjects.pattern(kind, **fields) for kind in AGENT_PUBLISHES]
    save_command = subjects.pattern("checkpoint.save.command", **fields)  # the preStop hook asks its own agent
    prepare_command = subjects.pattern("model.prepare.command", **fields)
    prefetch_command = subjects.pattern("kv.session.prefetch.command", **fields)
    rollouts = subjects.pattern("kv.rollout.state")  # a rollout's switch, heard by every agent
    requests = (
        [subjects.agent_command(verb, pod) for verb in AGENT_REQUESTS]
        if pod
        else [subjects.agent_commands(verb) for verb in AGENT_REQUESTS]
    )
    deadletters = subjects.deadletter_stream
    publish = [*own, save_command, *requests, *deadletters.subjects, f"{JS_API}.STREAM.INFO.{deadletters.name}"]
    deny: list[str] = []
    if bucket is not None and pod:
        store = checkpoint_store_writer(subjects, bucket, pod)
        publish += store["allow"]
        deny = store["deny"]
    elif bucket is not None:
        publish += object_store_api(bucket)
    inbox = _own_inbox(name or identity_name(subjects, Identity(AGENT, pod=pod or "")))
    allowed: dict[str, Any] = {"allow": _unique(publish)}
    if deny:
        allowed["deny"] = deny
    return {
        "publish": allowed,
        "subscribe": {"allow": [save_command, prepare_command, prefetch_command, rollouts, inbox]},
        "allow_responses": True,
    }


def gateway_permissions(subjects: Subjects) -> dict[str, Any]:
    """A KV-aware router's user: it hears where sessions move (``kv.session.location``) and rollouts switching
    (``kv.rollout.state``), reads the newest of either back from the events stream with a JetStream direct get
    on exactly those subjects (``$JS.API.DIRECT.GET.<stream>.<subject>``: no consumer, no other event), and asks
    the checkpoint service where a session is (``where``). It publishes nothing else: no event, no command, no
    reply."""
    events = subjects.events_stream.name
    locations = subjects.pattern("kv.session.location")
    rollouts = subjects.pattern("kv.rollout.state")
    publish = [
        subjects.command("checkpoint", "where"),
        f"{JS_API}.DIRECT.GET.{events}.{locations}",
        f"{JS_API}.DIRECT.GET.{events}.{rollouts}",
    ]
    inbox = _own_inbox(user_name(subjects, GATEWAY))
    return {"publish": {"allow": publish}, "subscribe": {"allow": [locations, rollouts, inbox]}}


def admin_permissions(subjects: Subjects) -> dict[str, Any]:
    """The operator's user: everything under the root, the whole JetStream API (streams are created here), acks
    and replies. Note ``$JS.API.>`` is account-wide: isolate installations that share a server by account."""
    advisories = [f"{ADVISORY_MAX_DELIVERIES}.{spec.name}.>" for spec in subjects.streams]
    return {
        "publish": {"allow": [f"{subjects.root}.>", f"{JS_API}.>", f"{JS_ACK}.>"]},
        "subscribe": {"allow": [f"{subjects.root}.>", _own_inbox(user_name(subjects, ADMIN)), *advisories]},
        "allow_responses": True,
    }


def auth_permissions() -> dict[str, Any]:
    """The auth callout's own user: it hears the server's authorization requests and answers each once; nothing
    else (``AUTH_CALLOUT_SUBJECT``)."""
    return {
        "publish": {"deny": [">"]},
        "subscribe": {"allow": [AUTH_CALLOUT_SUBJECT]},
        "allow_responses": True,
    }


def permissions(subjects: Subjects, identity: Identity, bucket: str | None = None) -> dict[str, Any]:
    """What ``identity`` may do, as a nats-server ``permissions`` object (``publish``, ``subscribe``,
    ``allow_responses``). ``bucket``: the Object Store bucket of the checkpoints, when they are kept in NATS."""
    if identity.role == ADMIN:
        return admin_permissions(subjects)
    if identity.role == GATEWAY:
        return gateway_permissions(subjects)
    if identity.role == AGENT:
        return agent_permissions(subjects, identity.pod or None, bucket)
    return service_permissions(subjects, identity.role, identity.node or None, bucket)


def may_publish(permissions: Mapping[str, Any], subject: str) -> bool:
    """Whether a permissions object (as built here) lets its user publish on ``subject``."""
    allow: list[str] = permissions.get("publish", {}).get("allow", [])
    deny: list[str] = permissions.get("publish", {}).get("deny", [])
    return any(subject_matches(p, subject) for p in allow) and not any(subject_matches(p, subject) for p in deny)


def may_subscribe(permissions: Mapping[str, Any], subject: str) -> bool:
    """Whether a permissions object lets its user subscribe to ``subject``, a wildcard too: as nats-server
    decides it, the subscription must lie inside one allowed pattern (``_INBOX.>`` is not inside
    ``_INBOX.gw-x.>``)."""
    allow: list[str] = permissions.get("subscribe", {}).get("allow", [])
    return any(_covers(p, subject) for p in allow)


def _covers(pattern: str, subject: str) -> bool:
    """Whether every subject ``subject`` (which may hold wildcards) matches is matched by ``pattern``."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or have[i] == ">" or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def nats_auth_config(
    subjects: Subjects,
    passwords: Mapping[str, str],
    node: str | None = None,
    pod: str | None = None,
    bucket: str | None = None,
) -> str:
    """A static nats-server configuration fragment ``authorization { users = [ ... ] }`` (no auth callout): one
    user per service, the KV agents' user (scoped by ``pod`` and ``bucket``, see ``agent_permissions``) and the
    admin, and each of ``OPTIONAL_USERS`` given a password (the gateway: ``gateway_permissions``). ``passwords``
    maps each name of ``USERS`` to its password; a missing, empty or unknown entry is an error naming the entry
    (never the value). Without ``node`` the node-scoped services get no durable consumer (their names name the
    node): use ``--node`` on a one-node server, or the auth callout (``nats_callout_config``). The text holds the
    passwords: write it to a file only the server can read."""
    names = _checked_passwords(passwords, (*USERS, *OPTIONAL_USERS), USERS)
    users: list[dict[str, Any]] = []
    for name in names:
        if name == AGENT:  # one user for the agents (of ``pod``, or of any pod): its name is its inbox's
            perms = agent_permissions(subjects, pod, bucket, name=user_name(subjects, AGENT))
        elif name in SERVICES:
            perms = service_permissions(subjects, name, node, bucket)
        else:
            perms = permissions(subjects, Identity(name), bucket)
        users.append({"user": user_name(subjects, name), "password": passwords[name], "permissions": perms})
    return _authorization_block(users)


def nats_callout_config(subjects: Subjects, auth_password: str, issuer_public_key: str, timeout_s: float = 5.0) -> str:
    """A nats-server configuration fragment for the auth callout: the callout's own user (``<root>-auth``, the
    one user the server knows, allowed only to answer authorization requests) and the ``auth_callout`` block
    naming the issuer account's public key, whose seed only the auth service holds. Every other connection is
    handed to the callout, which answers with a user carrying ``permissions(...)`` of the identity it proved.
    The text holds the callout user's password: write it to a file only the server can read."""
    _checked_passwords({AUTH: auth_password}, (AUTH,), (AUTH,))
    if not re.fullmatch(r"A[A-Z2-7]{55}", issuer_public_key):
        raise ValueError("the issuer must be an account public key (56 characters starting with A)")
    if not 0.5 <= timeout_s <= 60:
        raise ValueError(f"callout timeout {timeout_s}: expected 0.5 to 60 seconds")
    auth_user = user_name(subjects, AUTH)
    users = [{"user": auth_user, "password": auth_password, "permissions": auth_permissions()}]
    callout = json.dumps({"issuer": issuer_public_key, "auth_users": [auth_user]})
    return _authorization_block(users, extra=[f"timeout: {timeout_s:g}", f"auth_callout {callout}"])


def _checked_passwords(passwords: Mapping[str, str], known: tuple[str, ...], required: tuple[str, ...]) -> list[str]:
    unknown = sorted(set(passwords) - set(known))
    if unknown:
        raise ValueError(f"passwords given for unknown users: {', '.join(unknown)}; known: {', '.join(known)}")
    missing = [name for name in required if not passwords.get(name)]
    if missing:
        raise ValueError(f"no password for: {', '.join(missing)}")
    names = [*required, *(name for name in known if name in passwords and name not in required)]
    empty = [name for name in names if not passwords[name]]
    if empty:
        raise ValueError(f"no password for: {', '.join(empty)}")
    bad = [name for name in names if _CONTROL_RE.search(passwords[name])]
    if bad:
        raise ValueError(f"password of {', '.join(bad)} has control characters")
    return names


def _authorization_block(users: list[dict[str, Any]], extra: Iterable[str] = ()) -> str:
    body = json.dumps(users, indent=2, ensure_ascii=False)
    indented = body.replace("\n", "\n  ")
    lines = "".join(f"  {line}\n" for line in extra)
    return f"authorization {{\n  users = {indented}\n{lines}}}\n"
