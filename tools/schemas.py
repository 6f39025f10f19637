"""JSON Schema and AsyncAPI documents generated from the event Structs, so other systems need not read Python.

The Structs in ``shared.contract`` are the single source of truth; the files under ``proto/events/`` are derived
from them and committed so that consumers in other languages, and reviewers, see every change to the wire.
Output is byte-for-byte deterministic, which lets ``--check`` (and the drift test) catch a Struct edited
without regenerating the files.

    python -m tools.schemas            # write proto/events/
    python -m tools.schemas --check    # exit 1, naming the files that differ
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import msgspec

from shared.contract.base import SCHEMA_VERSION, Event
from shared.contract.registry import BY_KIND, EVENT_TYPES, FAMILIES
from shared.contract.subjects import ROUTES, Delivery, Subjects

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO_ROOT / "proto" / "events"

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_BASE_URL = "https://gpuwarden.dev/schemas/events"
ASYNCAPI_FILE = "asyncapi.json"
ASYNCAPI_VERSION = "3.0.0"
CONTENT_TYPE = "application/json"
NATS_SERVER = "nats"
NATS_HOST = "127.0.0.1:4222"
DEFAULT_ROOT = "gw"

# Kinds that systems outside gpuwarden publish; the AsyncAPI document is written from such a system's point of
# view, so these are what it sends and every other kind is what it receives.
EXTERNALLY_PUBLISHED: frozenset[str] = frozenset({"node.drain.requested", "requests.inference", "kv.session.where"})

_COMPONENT_REF = "#/components/schemas/{name}"
_FIELD_RE = re.compile(r"\{(\w+)\}")
_TOKEN_TEXT = "1-128 letters, digits, '_' or '-'"

Document = dict[str, Any]


def _kind(event_type: type[Event]) -> str:
    tag = event_type.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def _schema_file(family: str) -> str:
    return f"{family}.schema.json"


def family_schema(family: str) -> Document:
    """The JSON Schema of one family: the union of its events, discriminated by ``kind``.

    msgspec keeps referenced Structs under ``$defs`` with local refs, so each file stands alone.
    """
    types = FAMILIES[family]
    union: Any = Union[types]  # noqa: UP007
    kinds = ", ".join(_kind(t) for t in types)
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"{SCHEMA_BASE_URL}/{family}.json",
        "title": f"gpuwarden {family} events",
        "description": (
            f"One event of the gpuwarden '{family}' family ({kinds}), as JSON on the bus. "
            f"The 'kind' property says which; schema_version {SCHEMA_VERSION}. "
            "Evolution is additive: decoders must ignore properties they do not know."
        ),
        **msgspec.json.schema(union),
    }


def _channel_id(kind: str) -> str:
    first, *rest = kind.split(".")
    return first + "".join(part.capitalize() for part in rest)


def _stream_pattern(kind: str) -> str:
    """The stream's name with the root written as ``{ROOT}``, found the way publishers find it."""
    subjects = Subjects(DEFAULT_ROOT)
    spec = subjects.stream_for(subjects.pattern(kind))
    if spec is None:
        raise LookupError(f"{kind} is routed over JetStream but no stream covers {subjects.pattern(kind)}")
    prefix = DEFAULT_ROOT.upper()
    assert spec.name.startswith(prefix)
    return "{ROOT}" + spec.name[len(prefix) :]


def _delivery_text(kind: str) -> str:
    route = ROUTES[kind]
    if route.delivery is Delivery.JETSTREAM:
        return (
            f"Delivered over JetStream, stream `{_stream_pattern(kind)}` (ROOT is the root upper-cased, "
            "'-' written '_'); the Nats-Msg-Id header is the event_id, so retried publishes are stored once."
        )
    return "Delivered over core NATS, fire and forget: a lost message is replaced by the next one."


def _parameters(kind: str, payload: Document) -> Document:
    properties: Document = payload.get("properties", {})
    params: Document = {
        "root": {
            "description": "The installation root (GPUWARDEN_ROOT): keeps installations apart on one server.",
            "default": DEFAULT_ROOT,
        }
    }
    for name in _FIELD_RE.findall(ROUTES[kind].template):
        if name not in properties:
            raise LookupError(f"route of {kind} uses {{{name}}}, which is not a field of the event")
        params[name] = {"description": f"The event's '{name}' field: one subject token ({_TOKEN_TEXT})."}
    return params


def asyncapi() -> Document:
    """One AsyncAPI 3.0 document covering every route: a channel, an operation and a message per kind."""
    _, schemas = msgspec.json.schema_components(EVENT_TYPES, ref_template=_COMPONENT_REF)
    unmatched = set(BY_KIND) ^ set(ROUTES)
    if unmatched:
        raise LookupError(f"event kinds without a route, or routes without an event: {sorted(unmatched)}")

    channels: Document = {}
    operations: Document = {}
    messages: Document = {}
    for kind, event_type in BY_KIND.items():
        route = ROUTES[kind]
        message_id = event_type.__name__
        channel_id = _channel_id(kind)
        action = "send" if kind in EXTERNALLY_PUBLISHED else "receive"
        doc = (event_type.__doc__ or "").strip()

        message: Document = {
            "name": kind,
            "title": message_id,
            "summary": route.description,
            "contentType": CONTENT_TYPE,
            "payload": {"$ref": _COMPONENT_REF.format(name=message_id)},
        }
        if doc:
            message["description"] = doc
        messages[message_id] = message

        channels[channel_id] = {
            "address": "{root}." + route.template,
            "title": kind,
            "summary": route.description,
            "description": f"{route.description} {_delivery_text(kind)}",
            "parameters": _parameters(kind, schemas[message_id]),
            "messages": {message_id: {"$ref": f"#/components/messages/{message_id}"}},
        }

        verb = "Publish" if action == "send" else "Consume"
        operations[f"{action}{channel_id[0].upper()}{channel_id[1:]}"] = {
            "action": action,
            "title": f"{verb} {kind}",
            "summary": route.description,
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{message_id}"}],
        }

    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "gpuwarden",
            "version": f"{SCHEMA_VERSION}.0.0",
            "description": (
                "Events of gpuwarden, the event-driven GPU operator. Written from the point of view of a "
                "system integrating with it: such a system sends drain and inference requests (and asks where "
                "sessions are) and receives every other event. Every subject starts with the installation "
                "root. Evolution is additive: decoders must ignore properties they do not know."
            ),
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": {
            NATS_SERVER: {
                "host": NATS_HOST,
                "protocol": "nats",
                "description": "A local NATS server with JetStream enabled.",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


def _dump(document: Document) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def render() -> dict[str, bytes]:
    """Every generated file, by name relative to the output directory, as the exact bytes to commit."""
    files = {_schema_file(family): _dump(family_schema(family)) for family in FAMILIES}
    files[ASYNCAPI_FILE] = _dump(asyncapi())
    return dict(sorted(files.items()))


def _stale(directory: Path, rendered: dict[str, bytes]) -> list[Path]:
    return sorted(p for p in directory.glob("*.json") if p.name not in rendered)


def write(directory: Path = DEFAULT_DIR) -> list[Path]:
    """Write every rendered file into ``directory`` and delete ``*.json`` files it no longer produces.

    Files whose bytes are already right are left untouched so their mtimes do not trigger rebuilds. Returns
    the paths of all rendered files.
    """
    rendered = render()
    directory.mkdir(parents=True, exist_ok=True)
    for path in _stale(directory, rendered):
        path.unlink()
    paths = []
    for name, data in rendered.items():
        path = directory / name
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
        paths.append(path)
    return paths


def check(directory: Path = DEFAULT_DIR) -> list[str]:
    """What ``write`` would change in ``directory``: one line per missing, differing or stale file."""
    rendered = render()
    problems = [f"{directory / p.name}: stale, no longer generated" for p in _stale(directory, rendered)]
    for name, data in rendered.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_bytes() != data:
            problems.append(f"{path}: differs from the generated file")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.schemas",
        description="Generate the JSON Schema and AsyncAPI files of the event contract.",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if any file is not what would be written"
    )
    parser.add_argument(
        "directory",
        nargs="?",
        type=Path,
        default=DEFAULT_DIR,
        help=f"output directory (default {DEFAULT_DIR})",
    )
    args = parser.parse_args(argv)
    directory: Path = args.directory

    if args.check:
        problems = check(directory)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("event schemas are out of date: run `make schemas`", file=sys.stderr)
            return 1
        return 0

    for path in write(directory):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
