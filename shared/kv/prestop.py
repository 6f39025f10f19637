"""The preStop hook of an inference pod that installed the KV agent alone: ``gpuwarden-kv-prestop`` (or
``python -m shared.kv.prestop``) does what ``gpuwarden agent final-save`` does (that command calls ``final_save``
here), without gpuwarden's CLI.

It asks the pod's KV agent, over NATS, for the pod's last save (``final_save_command``: what changed since each
session's last checkpoint is written, the rest named to be confirmed, so that sessions a drain just committed are
not saved twice), hands the report to the checkpoint service to record (``record_report``: the asker records, as
the service does with the saves it asks for), prints what was recorded as JSON, and exits 0 when no session failed.
The pod is ``--pod`` or ``$GPUWARDEN_POD_NAME``; the connection is gpuwarden's own settings (``connect_bus``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence

import msgspec

from shared.contract.base import Event
from shared.contract.checkpoint import SaveSessions, SaveSessionsReport
from shared.contract.registry import codec
from shared.kv.endpoint import connect_bus
from shared.kv.reports import final_save_command, record_report
from shared.plumbing.errors import SettingsError


def prestop_command(pod: str, deadline_s: float) -> SaveSessions:
    """The command, validated as the agent will decode it; ``ValueError`` naming what is wrong."""
    try:
        command = final_save_command(pod, deadline_s)
        return msgspec.json.decode(codec.encode(command), type=SaveSessions)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


async def final_save(command: SaveSessions, env: Mapping[str, str] | None = None) -> Event:
    """Send the pod's agent ``command`` and have the checkpoint service record its report: what the service
    recorded, the agent's own report when the service did not answer, or what the bus got instead of a report (a
    dead letter naming why). ``TimeoutError`` when no agent answers within the deadline."""
    bus = await connect_bus(f"prestop/{command.pod}", env)
    try:
        reply = await bus.request(bus.subjects.for_event(command), command, timeout=command.deadline_s + 2)
        if not isinstance(reply, SaveSessionsReport):
            return reply
        recorded = await record_report(bus, command.pod, reply)
        return recorded if recorded is not None else reply
    finally:
        await bus.close(1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpuwarden-kv-prestop", description="preStop hook: save every session of the pod before it stops"
    )
    parser.add_argument("--pod", default=os.environ.get("GPUWARDEN_POD_NAME", ""), help="default $GPUWARDEN_POD_NAME")
    parser.add_argument("--deadline", type=float, default=25.0, help="seconds the save may take (default 25)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="gpuwarden-kv-prestop: %(name)s: %(message)s")  # no chatter
    if not args.pod:
        parser.error("no pod: pass --pod or set GPUWARDEN_POD_NAME")
    try:
        command = prestop_command(args.pod, args.deadline)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        reply = asyncio.run(final_save(command))
    except TimeoutError:
        print(f"gpuwarden-kv-prestop: pod {command.pod}'s KV agent did not answer", file=sys.stderr)
        return 1
    except (ConnectionError, SettingsError) as exc:  # NATS unreachable (it names the URL), or a setting is wrong
        print(f"gpuwarden-kv-prestop: {exc}", file=sys.stderr)
        return 1
    print(codec.encode(reply).decode())
    return 0 if isinstance(reply, SaveSessionsReport) and not reply.failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
