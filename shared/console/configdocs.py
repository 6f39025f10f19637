"""``gpuwarden config get|set``: a configuration document in Redis read, or written by compare-and-set.

``set`` says what it changes (every field whose value differs, before and after) and never resets a field the
user did not name without being told to: ``--merge`` changes only the fields given (an object is merged field by
field, anything else replaced), ``--replace`` makes the given document the whole document (what it leaves out
goes back to its default), and a plain ``set`` that would reset a stored field is refused, naming the fields.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
from typing import Any

import msgspec

from shared.console.state import REDIS_ONLY, CommandError, UsageError, command_settings, read_json_arg
from shared.contract.configdocs import CONFIG_DOCUMENTS
from shared.contract.subjects import Subjects
from shared.plumbing.errors import ConfigConflict, InvalidConfig

DOCUMENTS = tuple(sorted(CONFIG_DOCUMENTS))


def known_document(name: str) -> None:
    """``UsageError`` naming the documents there are (and the nearest) unless ``name`` is one."""
    if name in CONFIG_DOCUMENTS:
        return
    close = difflib.get_close_matches(name, DOCUMENTS, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise UsageError(f"no configuration document {name!r}{hint} (documents: {', '.join(DOCUMENTS)})")


def merged(stored: Any, given: Any) -> Any:
    """``given`` laid over ``stored``: objects field by field (recursively), anything else replaced."""
    if isinstance(stored, dict) and isinstance(given, dict):
        out = dict(stored)
        for key, value in given.items():
            out[key] = merged(stored.get(key), value)
        return out
    return given


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Each top-level field whose value differs: ``[before, after]`` (``None`` where a field is absent)."""
    return {k: [before.get(k), after.get(k)] for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)}


def defaults(name: str) -> Any:
    """The document every service uses while none is stored: its defaults ({} for one without them all)."""
    try:
        return CONFIG_DOCUMENTS[name]()
    except TypeError:
        return {}


def plan_write(name: str, stored: Any, raw: bytes, *, merge: bool, replace: bool) -> tuple[bytes, dict[str, list[Any]]]:
    """The document to write and what it changes, from the stored one (None: none yet) and what the user gave.
    Refuses (``UsageError``) a plain set that would reset a field the user left out, naming each."""
    from shared.plumbing.configsync import parse_document

    try:
        given = json.loads(raw)
    except ValueError as exc:
        raise UsageError(f"config {name!r}: not valid JSON: {exc}") from None
    if not isinstance(given, dict):
        raise UsageError(f"config {name!r}: a document is a JSON object of fields, not {type(given).__name__}")
    before: dict[str, Any] = msgspec.to_builtins(stored if stored is not None else defaults(name))
    wanted = merged(before, given) if merge else given
    after: dict[str, Any] = msgspec.to_builtins(parse_document(name, json.dumps(wanted)))  # InvalidConfig if wrong
    changed = changes(before, after)
    if not merge and not replace:
        reset = {k: v for k, v in changed.items() if k not in given}
        if reset:
            fields = ", ".join(f"{k} {json.dumps(v[0])} -> {json.dumps(v[1])}" for k, v in reset.items())
            raise UsageError(
                f"this would reset what {name} holds and the document leaves out: {fields}. `config set --merge` "
                "changes only the fields given; `config set --replace` replaces the whole document"
            )
    return json.dumps(after).encode(), changed


def cmd_config(args: argparse.Namespace) -> int:
    from shared.plumbing.configsync import ConfigStore, redis_client

    known_document(args.name)
    settings = command_settings(REDIS_ONLY)
    raw = read_json_arg(args.doc) if args.action == "set" else b""

    async def main() -> int:
        client = redis_client(settings.redis)
        store = ConfigStore(client, Subjects(settings.root))
        try:
            current = await store.read(args.name)
            if args.action == "get":
                if current is None:
                    raise CommandError(
                        f"no {args.name} document is stored yet: every service uses its defaults (`gpuwarden config "
                        f"set {args.name} JSON` writes one)"
                    )
                out = {"name": args.name, "version": current.version, "updated_by": current.updated_by}
                out["doc"] = msgspec.to_builtins(current.doc)
                print(json.dumps(out, indent=2))
                return 0
            expected = current.version if current else 0
            if args.expect_version is not None and args.expect_version != expected:
                raise ConfigConflict(args.name, args.expect_version, expected)
            doc, changed = plan_write(
                args.name, current.doc if current else None, raw, merge=args.merge, replace=args.replace
            )
            version = expected
            if changed or current is None:
                version = await store.write_raw(args.name, doc, expected, args.by)
            print(json.dumps({"name": args.name, "from_version": expected, "version": version, "changed": changed}))
            return 0
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except (InvalidConfig, ConfigConflict) as exc:
        raise UsageError(str(exc)) from None
