"""Every NATS subject, JetStream stream and durable consumer name, and every Redis key, built from one root.

No other module writes a subject as a string literal. The root (``GPUWARDEN_ROOT``, default ``gw``) keeps
installations, and tests, apart on a shared server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from shared.contract.base import Event, id_problem, is_token, subject_token


class Delivery(Enum):
    """How a subject is carried: JetStream (durable, deduplicated) or core NATS (fire and forget telemetry)."""

    JETSTREAM = "jetstream"
    CORE = "core"


@dataclass(frozen=True, slots=True)
class Route:
    template: str  # relative to the root; ``{field}`` placeholders are filled from the event's fields
    delivery: Delivery
    description: str


# One route per event kind. The first token after the root is the family's stream partition.
ROUTES: dict[str, Route] = {
    "node.drain.requested": Route(
        "node.{node}.drain.requested", Delivery.JETSTREAM, "A drain of the node is asked for."
    ),
    "node.drain.completed": Route(
        "node.{node}.drain.completed", Delivery.JETSTREAM, "Every session on the node is checkpointed."
    ),
    "node.drain.failed": Route(
        "node.{node}.drain.failed", Delivery.JETSTREAM, "Some sessions on the node were not checkpointed."
    ),
    "node.cordoned": Route("node.{node}.cordoned", Delivery.JETSTREAM, "The node was cordoned."),
    "node.uncordoned": Route("node.{node}.uncordoned", Delivery.JETSTREAM, "The node was uncordoned."),
    "driver.upgrade.state": Route(
        "driver.{node}.upgrade.state", Delivery.JETSTREAM, "The node's driver upgrade state changed."
    ),
    "driver.installed": Route("driver.{node}.installed", Delivery.JETSTREAM, "A driver version was installed."),
    "driver.install.failed": Route(
        "driver.{node}.install.failed", Delivery.JETSTREAM, "A driver install or validation failed."
    ),
    "driver.install.command": Route(
        "cmd.driver.{node}.install", Delivery.CORE, "Request/reply: the node's driver agent installs a driver."
    ),
    "driver.validate.command": Route(
        "cmd.driver.{node}.validate", Delivery.CORE, "Request/reply: the node's driver agent validates its driver."
    ),
    "driver.versions.command": Route(
        "cmd.driver.{node}.versions", Delivery.CORE, "Request/reply: the node's driver agent reads its versions."
    ),
    "driver.agent.answer": Route(
        "driveragent.{node}.answer", Delivery.CORE, "A node's driver agent answers a command (the reply to it)."
    ),
    "device.inventory": Route("device.{node}.inventory", Delivery.JETSTREAM, "The node's GPU inventory."),
    "device.health.changed": Route(
        "device.{node}.health", Delivery.JETSTREAM, "A GPU became unhealthy or healthy again."
    ),
    "device.xid": Route("device.{node}.xid", Delivery.JETSTREAM, "An XID error on a GPU."),
    "device.mig.config": Route(
        "device.{node}.mig.config",
        Delivery.JETSTREAM,
        "The node's MIG layout is being applied, was applied, or failed.",
    ),
    "metrics.gpu.sample": Route("metrics.{node}.gpu", Delivery.CORE, "A per-GPU utilisation sample."),
    "metrics.deployment.utilisation": Route(
        "metrics.deployment.{namespace}.{deployment}", Delivery.CORE, "A deployment's windowed GPU utilisation."
    ),
    "scaler.decision": Route(
        "scaler.{namespace}.{deployment}.decision", Delivery.JETSTREAM, "A replica count decision and its inputs."
    ),
    "checkpoint.saved": Route(
        "checkpoint.{session_id}.saved", Delivery.JETSTREAM, "A session's checkpoint was committed."
    ),
    "checkpoint.failed": Route(
        "checkpoint.{session_id}.failed", Delivery.JETSTREAM, "A session's checkpoint could not be saved."
    ),
    "checkpoint.restored": Route(
        "checkpoint.{session_id}.restored", Delivery.JETSTREAM, "A session was restored from a checkpoint."
    ),
    "checkpoint.forgotten": Route(
        "checkpoint.{session_id}.forgotten",
        Delivery.JETSTREAM,
        "The registry forgot a recorded checkpoint whose files the scrub found gone or damaged in the store.",
    ),
    "checkpoint.save.command": Route(
        "cmd.kvagent.{pod}.save", Delivery.CORE, "Request/reply: a pod's KV agent saves sessions, then reports."
    ),
    "checkpoint.save.report": Route(
        "kvagent.{pod}.report", Delivery.CORE, "A KV agent's save report (the reply to a save command)."
    ),
    "checkpoint.save.progress": Route(
        "kvagent.{pod}.progress", Delivery.CORE, "A KV agent's progress through a save, after each round."
    ),
    "checkpoint.agent.sessions": Route(
        "kvagent.{pod}.sessions", Delivery.CORE, "A KV agent announces the sessions its pod holds."
    ),
    "checkpoint.agent.ack": Route(
        "kvagent.{pod}.sessions.ack", Delivery.CORE, "The checkpoint service's answer to an announcement (a reply)."
    ),
    "node.drain.query": Route(
        "cmd.checkpoint.drain",
        Delivery.CORE,
        "Request/reply: the recorded verdict of a drain (the driver's coordinator asks while it waits).",
    ),
    "node.drain.state": Route("cmd.checkpoint.drain.state", Delivery.CORE, "A drain's recorded verdict (a reply)."),
    "kv.sessions.query": Route(
        "cmd.checkpoint.sessions",
        Delivery.CORE,
        "Request/reply: a page of the sessions a node, pod or deployment holds.",
    ),
    "kv.sessions.page": Route("cmd.checkpoint.sessions.page", Delivery.CORE, "A page of sessions (a reply)."),
    "kv.fleet.query": Route(
        "cmd.checkpoint.fleet", Delivery.CORE, "Request/reply: session counts per node, pod and deployment."
    ),
    "kv.fleet.summary": Route("cmd.checkpoint.fleet.summary", Delivery.CORE, "Session counts (a reply)."),
    "checkpoint.locate": Route(
        "cmd.checkpoint.{pod}.locate",
        Delivery.CORE,
        "Request/reply: a pod asks where a session's newest committed checkpoint is (and takes the session).",
    ),
    "checkpoint.location": Route("kvagent.location.{session_id}", Delivery.CORE, "The answer to a locate request."),
    "kv.session.location": Route(
        "kv.session.{session_id}.location",
        Delivery.JETSTREAM,
        "Where a session's KV cache is after a change (placed, restored, saved, dropped, forgotten, ended).",
    ),
    "kv.session.where": Route(
        "cmd.checkpoint.where", Delivery.CORE, "Request/reply: which pod holds a session's KV cache now?"
    ),
    "kv.pod.load": Route(
        "kvagent.{pod}.load",
        Delivery.CORE,
        "A pod's load every few seconds: KV blocks used of its pool, time to first token (p90) of its requests.",
    ),
    "kv.session.prefetch.command": Route(
        "cmd.kvagent.{pod}.prefetch",
        Delivery.CORE,
        "Request/reply: the router asks a pod's KV agent to restore sessions ahead of their next request.",
    ),
    "kv.session.prefetched": Route(
        "kvagent.{pod}.prefetched", Delivery.CORE, "A KV agent's answer to a prefetch command (what it restored)."
    ),
    "model.prepare.command": Route(
        "cmd.kvagent.{pod}.prepare",
        Delivery.CORE,
        "Request/reply: a pod's KV agent makes a model version ready while serving the current one.",
    ),
    "model.prepare.report": Route(
        "kvagent.{pod}.prepared", Delivery.CORE, "A KV agent's answer to a prepare command (ready or failed)."
    ),
    "model.serving.query": Route(
        "cmd.checkpoint.{pod}.serving",
        Delivery.CORE,
        "Request/reply: a pod asks which model version its deployment serves now.",
    ),
    "kv.rollout.state": Route(
        "kv.rollout.{namespace}.{deployment}.state",
        Delivery.JETSTREAM,
        "A deployment's model rollout changed phase (preparing, switched, aborted): the serving version.",
    ),
    "config.applied": Route(
        "config.{name}.applied.{service}", Delivery.JETSTREAM, "A service applied a configuration version."
    ),
    "requests.inference": Route(
        "requests.{namespace}.{deployment}", Delivery.JETSTREAM, "An inference request for a deployment."
    ),
    "deadletter": Route("deadletter.{consumer}", Delivery.JETSTREAM, "A message no handler could take."),
}

_FIELD_RE = re.compile(r"\{(\w+)\}")
_ROOT_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]{0,31}$")


_COMPILED: dict[str, list[tuple[str, str]]] = {}


def _compiled(kind: str) -> list[tuple[str, str]]:
    """A route template as (literal, field) pairs, split once per kind: subjects are built on the hot path."""
    compiled = _COMPILED.get(kind)
    if compiled is None:
        template, compiled, last = ROUTES[kind].template, [], 0
        for match in _FIELD_RE.finditer(template):
            compiled.append((template[last : match.start()], match.group(1)))
            last = match.end()
        compiled.append((template[last:], ""))
        _COMPILED[kind] = compiled
    return compiled


_BUILT_LIMIT = 65_536  # subjects remembered per Subjects; a full memo starts over
_FIELDS: dict[type, tuple[str, ...]] = {}
_JETSTREAM: dict[type, bool] = {}


def _route_fields(cls: type[Event]) -> tuple[str, ...]:
    """The event fields a kind's subject is built from, in template order."""
    fields = _FIELDS.get(cls)
    if fields is None:
        tag = cls.__struct_config__.tag
        assert isinstance(tag, str)
        fields = _FIELDS[cls] = tuple(name for _, name in _compiled(tag) if name)
    return fields


class SubjectError(ValueError):
    """A subject cannot be built: a field is not a valid subject token."""


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


AGENT_VERBS: tuple[str, ...] = ("locate", "record", "restored", "serving")
"""What a pod's KV agent asks the checkpoint service, each on a subject that names the pod
(``<root>.cmd.checkpoint.<pod>.<verb>``): only that pod's credentials may publish there, and the service
refuses a body that names another pod."""


@dataclass(frozen=True, slots=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    description: str


class Subjects:
    """Names under one root. ``Subjects("gw").for_event(DrainRequested(node="n1", ...))`` is
    ``gw.node.n1.drain.requested``; the stream of lifecycle events is ``GW_EVENTS``."""

    def __init__(self, root: str = "gw") -> None:
        if not _ROOT_RE.match(root):
            raise ValueError(
                f"GPUWARDEN_ROOT {root!r} is not valid: a letter, then up to 31 letters, digits, '_' or '-'"
            )
        self.root = root
        self._stream_prefix = root.upper().replace("-", "_")
        self._built: dict[tuple[Any, ...], str] = {}
        self._patterns: dict[str, str] = {}

    # -- events -------------------------------------------------------------------------------------------------
    def route(self, kind: str) -> Route:
        return ROUTES[kind]

    def for_event(self, event: Event) -> str:
        """The event's subject. Built once per (kind, routing values) and remembered: most publishers send the
        same few subjects over and over, and validating the tokens costs more than the rest of a publish."""
        fields = _route_fields(type(event))
        try:
            key = (type(event), *[getattr(event, name) for name in fields])
            subject = self._built.get(key)
        except TypeError:  # an unhashable routing value: not a token, so _build says why
            return self._build(event)
        if subject is None:
            subject = self._build(event)
            if len(self._built) >= _BUILT_LIMIT:
                self._built.clear()
            self._built[key] = subject
        return subject

    def _build(self, event: Event) -> str:
        parts = [self.root, "."]
        for literal, name in _compiled(event.kind):
            parts.append(literal)
            if name:
                value = getattr(event, name)
                if not isinstance(value, str) or not is_token(value):
                    raise SubjectError(
                        f"{event.kind}: field {name}={value!r} is not a subject token "
                        "(letters, digits, '-', '_' and '.')"
                    )
                parts.append(value.replace(".", "_"))
        return "".join(parts)

    def pattern(self, kind: str, **fields: str) -> str:
        """A subscription pattern for ``kind``: given fields are filled, the others become ``*``."""
        template = ROUTES[kind].template

        def fill(match: re.Match[str]) -> str:
            value = fields.get(match.group(1))
            if value is None:
                return "*"
            if not is_token(value):
                raise SubjectError(f"{match.group(1)}={value!r} is not a subject token")
            return subject_token(value)

        return f"{self.root}.{_FIELD_RE.sub(fill, template)}"

    def subject_problem(self, event: Event, subject: str) -> str:
        """Why ``event`` may not arrive on ``subject`` ('' when it may): an event that came on its kind's own
        subject family must name, in its body, exactly what the subject names (the node, pod, session or
        deployment). The subject is what the sender's credentials allowed; the body is what it wrote."""
        fields = _route_fields(type(event))
        if not fields:
            return ""
        try:
            expected = self.for_event(event)
        except SubjectError as exc:
            return str(exc)
        if subject == expected:
            return ""
        pattern = self._patterns.get(event.kind)
        if pattern is None:
            pattern = self._patterns[event.kind] = self.pattern(event.kind)
        if not subject_matches(pattern, subject):
            return ""  # carried on another subject (a command): its own scope check applies there
        named = ", ".join(f"{name}={getattr(event, name)!r}" for name in fields)
        return f"subject {subject} does not name what the body does ({named}: {expected})"

    def node_of(self, subject: str, kind: str) -> str:
        """The node a subject of ``kind`` (a route with a ``{node}`` field) names, as the node's name ('' when
        the subject is not one of ``kind``'s, or names no valid node)."""
        pattern = self.pattern(kind).split(".")
        tokens = subject.split(".")
        if not subject_matches(".".join(pattern), subject) or "*" not in pattern:
            return ""
        node = tokens[pattern.index("*")].replace("_", ".")  # the inverse of subject_token for DNS names
        return node if not id_problem("node", node) else ""

    def is_jetstream(self, event: Event) -> bool:
        jetstream = _JETSTREAM.get(type(event))
        if jetstream is None:
            jetstream = _JETSTREAM[type(event)] = ROUTES[event.kind].delivery is Delivery.JETSTREAM
        return jetstream

    # -- streams ------------------------------------------------------------------------------------------------
    @property
    def events_stream(self) -> StreamSpec:
        families = ("node", "driver", "device", "scaler", "checkpoint", "kv", "config")
        return StreamSpec(
            name=f"{self._stream_prefix}_EVENTS",
            subjects=tuple(f"{self.root}.{f}.>" for f in families),
            description="gpuwarden lifecycle events",
        )

    @property
    def requests_stream(self) -> StreamSpec:
        return StreamSpec(
            name=f"{self._stream_prefix}_REQUESTS",
            subjects=(f"{self.root}.requests.>",),
            description="gpuwarden inference request queues, one subject per deployment",
        )

    @property
    def deadletter_stream(self) -> StreamSpec:
        return StreamSpec(
            name=f"{self._stream_prefix}_DEADLETTER",
            subjects=(f"{self.root}.deadletter.>",),
            description="gpuwarden dead letters: messages no handler could take, with the reason",
        )

    @property
    def streams(self) -> tuple[StreamSpec, ...]:
        return (self.events_stream, self.requests_stream, self.deadletter_stream)

    def stream_for(self, subject: str) -> StreamSpec | None:
        for spec in self.streams:
            for pattern in spec.subjects:
                if subject.startswith(pattern[:-1]):
                    return spec
        return None

    def deadletter(self, consumer: str) -> str:
        return f"{self.root}.deadletter.{consumer}"

    # -- durable consumers --------------------------------------------------------------------------------------
    def durable(self, service: str, purpose: str, scope: str = "") -> str:
        """Durable consumer name: one per service and purpose (and node, for node-scoped services)."""
        parts = [p for p in (service, purpose, scope) if p]
        for p in parts:
            if not is_token(p):
                raise SubjectError(f"consumer name part {p!r} is not a token")
        return "-".join(subject_token(p) for p in parts)

    # -- core request/reply commands ----------------------------------------------------------------------------
    def agent_command(self, verb: str, pod: str) -> str:
        """Where pod ``pod``'s KV agent sends ``verb`` (one of ``AGENT_VERBS``) to the checkpoint service."""
        if verb not in AGENT_VERBS:
            raise SubjectError(f"agent verb {verb!r} is not one of {', '.join(AGENT_VERBS)}")
        return self.command("checkpoint", verb, scope=pod)

    def agent_commands(self, verb: str) -> str:
        """The checkpoint service's subscription for ``verb`` from every pod (the pod is the wildcard token)."""
        if verb not in AGENT_VERBS:
            raise SubjectError(f"agent verb {verb!r} is not one of {', '.join(AGENT_VERBS)}")
        return f"{self.root}.cmd.checkpoint.*.{verb}"

    def command(self, service: str, verb: str, scope: str = "") -> str:
        parts = [p for p in ("cmd", service, scope, verb) if p]
        for p in parts:
            if not is_token(p):
                raise SubjectError(f"command subject part {p!r} is not a token")
        return ".".join((self.root, *(subject_token(p) for p in parts)))

    # -- Redis keys ---------------------------------------------------------------------------------------------
    def config_key(self, name: str) -> str:
        if not is_token(name):
            raise SubjectError(f"config name {name!r} is not a token")
        return f"{self.root}:config:{name}"

    @property
    def config_channel(self) -> str:
        return f"{self.root}:config:changed"

    def redis_key(self, *parts: str) -> str:
        return ":".join((self.root, *parts))
