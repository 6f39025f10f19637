"""``gpuwarden config get|set``: a configuration document in Redis read, or written by compare-and-set."""

from __future__ import annotations

import argparse
import asyncio
import json

import msgspec

from shared.console.state import UsageError, command_settings, read_json_arg
from shared.contract.subjects import Subjects
from shared.plumbing.errors import ConfigConflict, InvalidConfig


def cmd_config(args: argparse.Namespace) -> int:
    from shared.plumbing.configsync import ConfigStore, redis_client

    settings = command_settings()

    async def main() -> int:
        client = redis_client(settings.redis)
        store = ConfigStore(client, Subjects(settings.root))
        try:
            if args.action == "get":
                found = await store.read(args.name)
                if found is None:
                    print(json.dumps({"name": args.name, "version": 0, "doc": None}))
                    return 1
                out = {"name": args.name, "version": found.version, "updated_by": found.updated_by}
                out["doc"] = msgspec.to_builtins(found.doc)
                print(json.dumps(out, indent=2))
                return 0
            raw = read_json_arg(args.doc)
            expected = args.expect_version
            if expected is None:
                current = await store.read(args.name)
                expected = current.version if current else 0
            version = await store.write_raw(args.name, raw, expected, args.by)
            print(json.dumps({"name": args.name, "version": version}))
            return 0
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except (InvalidConfig, ConfigConflict) as exc:
        raise UsageError(str(exc)) from None
