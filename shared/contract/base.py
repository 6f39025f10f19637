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
TOKEN_PATTERN = r"^[A-Za-z0-9_\-][A-Za-z0-9_\-.]{0,252}$"
_TOKEN_RE = re.compile(TOKEN_PATTERN)

Token = Annotated[
    str, msgspec.Meta(pattern=TOKEN_PATTERN, description="a name used as a subject token ('.' becomes '_')")
]


def new_event_id() -> str:
    """A fresh, globally unique event id (the JetStream ``Nats-Msg-Id`` used for deduplication)."""
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


def is_token(value: str) -> bool:
    return bool(_TOKEN_RE.match(value))


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
