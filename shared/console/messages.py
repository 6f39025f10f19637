"""``gpuwarden publish``, ``deadletters`` and ``where``: one message to or from the bus (an event published, the
dead letters read, the checkpoint service asked where a session is)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import msgspec

from shared.console.state import NATS_ONLY, CommandError, UsageError, command_settings, read_json_arg
from shared.contract.deadletter import DeadLetter
from shared.contract.registry import BY_KIND, codec
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import Subjects
from shared.plumbing.settings import Settings


def cmd_publish(args: argparse.Namespace) -> int:
    raw = read_json_arg(args.event)
    try:
        event = codec.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        kinds = ", ".join(sorted(BY_KIND))
        raise UsageError(f"not a valid event: {exc} (kinds: {kinds})") from None
    settings = command_settings(NATS_ONLY)

    async def main() -> None:
        from shared.console.client import command_bus

        bus = await command_bus(settings)
        try:
            await bus.publish(event)
        finally:
            await bus.close(1)

    asyncio.run(main())
    print(json.dumps({"published": event.kind, "event_id": event.event_id, "subject": _subject(settings, event)}))
    return 0


def _subject(settings: Settings, event: Any) -> str:
    return Subjects(settings.root).for_event(event)


def cmd_deadletters(args: argparse.Namespace) -> int:
    settings = command_settings(NATS_ONLY)

    async def main() -> int:
        from shared.console.client import command_bus

        bus = await command_bus(settings, read_only=True)
        try:
            stream = bus.subjects.deadletter_stream.name
            info = await bus.js.stream_info(stream)
            last = info.state.last_seq
            first = max(info.state.first_seq, last - args.limit + 1)
            for seq in range(first, last + 1):
                try:
                    raw = await bus.js.get_msg(stream, seq)
                except Exception:
                    continue
                letter = codec.decode(raw.data or b"")
                if isinstance(letter, DeadLetter):
                    print(
                        json.dumps(
                            {
                                "seq": seq,
                                "subject": letter.origin_subject,
                                "consumer": letter.consumer,
                                "reason": letter.reason,
                                "payload": letter.payload.decode("utf-8", "replace")[:200],
                            }
                        )
                    )
            return 0
        finally:
            await bus.close(1)

    return asyncio.run(main())


def cmd_where(args: argparse.Namespace) -> int:
    """One line: which pod holds the session's KV cache now (exit 0), or why none does (exit 1)."""
    settings = command_settings(NATS_ONLY)

    async def main() -> int:
        from shared.console.client import command_bus

        bus = await command_bus(settings, read_only=True)
        try:
            answer = await bus.request(
                bus.subjects.command("checkpoint", "where"), WhereIsSession(session_id=args.session), 5.0
            )
        except TimeoutError as exc:
            raise CommandError(
                f"the checkpoint service did not answer ({exc}): is it running? `gpuwarden status` lists the services"
            ) from None
        finally:
            await bus.close(1)
        if not isinstance(answer, SessionLocation):
            raise CommandError(f"the checkpoint service answered: {getattr(answer, 'reason', answer.kind)}")
        if answer.reason == "unknown" and not answer.held:
            raise CommandError(
                f"no session {args.session!r} is known: no pod holds it, no checkpoint of it is recorded "
                "(`gpuwarden status` lists sessions)"
            )
        print(where_line(answer))
        return 0 if answer.held else 1

    return asyncio.run(main())


def where_line(at: SessionLocation) -> str:
    """A ``kv.session.location`` as one line for people."""
    saved = f", checkpoint {at.checkpoint_id} ({at.token_count} tokens)" if at.checkpoint_id else ""
    if at.held:
        return f"{at.session_id}: pod {at.pod} on node {at.node}, generation {at.generation}{saved}"
    if at.reason == "unknown":
        return f"{at.session_id}: unknown (no pod holds it, no checkpoint)"
    last = f", last on pod {at.previous_pod}" if at.previous_pod else ""
    return f"{at.session_id}: held by no pod ({at.reason}{last}){saved}"
