"""The base every event derives from, and the rules that keep the wire stable.

Events are frozen, keyword-only msgspec Structs tagged by an explicit dotted ``kind``. Tags are written by hand,
never derived from class names, so renaming a class never changes the wire. Evolution is additive only: new
fields get defaults, and decoders ignore fields they do not know (a rolling upgrade mixes versions).
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, ClassVar

import msgspec

SCHEMA_VERSION = 1

# A name that becomes one NATS subject token (node names, session ids, deployments): letters, digits, '-', '_'
# and '.', nothing else (no spaces or wildcards). Kubernetes node names are DNS subdomains and have dots; in a
# subject each '.' is written as '_', which DNS names never contain, so the mapping is one-to-one for them.
_TOKEN = r"[A-Za-z0-9_\-][A-Za-z0-9_\-.]{0,252}"
TOKEN_PATTERN = rf"^{_TOKEN}$(?!\n)"
_TOKEN_RE = re.compile(_TOKEN)

Token = Annotated[
    str, msgspec.Meta(pattern=TOKEN_PATTERN, description="a name used as a subject token ('.' becomes '_')")
]

# Identifiers: one rule per kind, used wherever an id enters (events, requests, the CLI, HTTP paths, store paths).
# Kubernetes objects follow Kubernetes' own name rules (RFC 1123): nodes, pods and deployments are DNS subdomains,
# namespaces DNS labels. Session, checkpoint and drain ids are chosen by other systems: letters, digits, '-' and
# '_', starting with a letter or digit, at most 128 characters. No id holds '.', '/', a wildcard, a space or a
# control character, so none can climb out of a store folder, widen a subscription or break a subject.
_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_SUBDOMAIN = rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*"
_OPAQUE = r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}"

ID_RULES: dict[str, tuple[str, str]] = {
    "node": (_SUBDOMAIN, "a Kubernetes node name: lowercase letters, digits, '-' and '.', at most 253"),
    "pod": (_SUBDOMAIN, "a Kubernetes pod name: lowercase letters, digits, '-' and '.', at most 253"),
    "deployment": (_SUBDOMAIN, "a Kubernetes deployment name: lowercase letters, digits, '-' and '.', at most 253"),
    "namespace": (_LABEL, "a Kubernetes namespace: lowercase letters, digits and '-', at most 63"),
    "session": (_OPAQUE, "a session id: letters, digits, '-' and '_', starting with a letter or digit, at most 128"),
    "checkpoint": (_OPAQUE, "a checkpoint id: letters, digits, '-' and '_', at most 128"),
    "drain": (_OPAQUE, "a drain id: letters, digits, '-' and '_', starting with a letter or digit, at most 128"),
    "take": (_OPAQUE, "a take id: letters, digits, '-' and '_', starting with a letter or digit, at most 128"),
}
"""Each kind of identifier: its pattern (without anchors) and the rule in words, for error messages."""

_ID_RES = {kind: re.compile(pattern) for kind, (pattern, _) in ID_RULES.items()}


def id_problem(kind: str, value: object) -> str:
    """Why ``value`` is not a valid ``kind`` id ('' when it is): the one check every edge makes."""
    if not isinstance(value, str):
        return f"{kind} id must be a string, not {type(value).__name__}"
    if _ID_RES[kind].fullmatch(value) is None:
        shown = value if len(value) <= 80 else value[:80] + "..."
        return f"{kind} id {shown!r} is not valid: {ID_RULES[kind][1]}"
    return ""


def check_id(kind: str, value: str) -> str:
    """``value`` when it is a valid ``kind`` id; else ``ValueError`` naming the rule."""
    problem = id_problem(kind, value)
    if problem:
        raise ValueError(problem)
    return value


def _anchored(pattern: str, optional: bool = False) -> str:
    """The whole value, nothing more: ``$`` alone would also accept a trailing newline."""
    return rf"^(?:{pattern}){'?' if optional else ''}$(?!\n)"


NodeName = Annotated[str, msgspec.Meta(pattern=_anchored(_SUBDOMAIN), description=ID_RULES["node"][1])]
PodName = Annotated[str, msgspec.Meta(pattern=_anchored(_SUBDOMAIN), description=ID_RULES["pod"][1])]
DeploymentName = Annotated[str, msgspec.Meta(pattern=_anchored(_SUBDOMAIN), description=ID_RULES["deployment"][1])]
Namespace = Annotated[str, msgspec.Meta(pattern=_anchored(_LABEL), description=ID_RULES["namespace"][1])]
SessionId = Annotated[str, msgspec.Meta(pattern=_anchored(_OPAQUE), description=ID_RULES["session"][1])]
CheckpointId = Annotated[str, msgspec.Meta(pattern=_anchored(_OPAQUE), description=ID_RULES["checkpoint"][1])]
DrainId = Annotated[str, msgspec.Meta(pattern=_anchored(_OPAQUE), description=ID_RULES["drain"][1])]
# The same, or empty where the field is optional (an event that may not know it).
OptNodeName = Annotated[str, msgspec.Meta(pattern=_anchored(_SUBDOMAIN, True), description=ID_RULES["node"][1])]
OptPodName = Annotated[str, msgspec.Meta(pattern=_anchored(_SUBDOMAIN, True), description=ID_RULES["pod"][1])]
OptDeploymentName = Annotated[
    str, msgspec.Meta(pattern=_anchored(_SUBDOMAIN, True), description=ID_RULES["deployment"][1])
]
OptNamespace = Annotated[str, msgspec.Meta(pattern=_anchored(_LABEL, True), description=ID_RULES["namespace"][1])]
OptCheckpointId = Annotated[str, msgspec.Meta(pattern=_anchored(_OPAQUE, True), description=ID_RULES["checkpoint"][1])]
OptDrainId = Annotated[str, msgspec.Meta(pattern=_anchored(_OPAQUE, True), description=ID_RULES["drain"][1])]
OptTakeId = Annotated[str, msgspec.Meta(pattern=_anchored(_OPAQUE, True), description=ID_RULES["take"][1])]
OptModelVersion = Annotated[str, msgspec.Meta(max_length=256, description="a model version ('': not known)")]
"""A model version as engines name it (a Hugging Face revision, a tag); '' where the sender does not know it."""


def new_event_id() -> str:
    """A fresh, globally unique event id (the JetStream ``Nats-Msg-Id`` used for deduplication)."""
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


def is_token(value: str) -> bool:
    return isinstance(value, str) and _TOKEN_RE.fullmatch(value) is not None


def subject_token(value: str) -> str:
    """The subject token for a name: ``ip-10-0-0-1.ec2.internal`` is ``ip-10-0-0-1_ec2_internal``."""
    return value.replace(".", "_")


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """What every event carries besides its own fields.

    ``event_id`` is the deduplication key: a publisher that retries keeps it, so the stream stores the event once
    and handlers, which must be idempotent anyway, rarely see it twice.
    """

    family: ClassVar[str] = ""

    event_id: str = msgspec.field(default_factory=new_event_id)
    occurred_at: datetime = msgspec.field(default_factory=utcnow)
    source: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def kind(self) -> str:
        tag = type(self).__struct_config__.tag
        assert isinstance(tag, str)
        return tag
