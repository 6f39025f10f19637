"""``gpuwarden events``: the lifecycle events on the bus as a table, the newest stored ones and then, with
``--follow``, each as it is published."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime
from typing import Any

import msgspec

from shared.console.client import MeshClient
from shared.contract.base import Event
from shared.contract.registry import BY_KIND, codec

_ENVELOPE = ("kind", "event_id", "occurred_at", "source", "schema_version")


def kinds_matching(prefix: str) -> list[str]:
    """Event kinds named by ``--kind``: the kind itself, or every kind under a dotted prefix (``node.drain``)."""
    return sorted(k for k in BY_KIND if k == prefix or k.startswith(prefix + "."))


def summary(event: Event, width: int = 110) -> str:
    """The event's own fields as ``name=value``, empty and default values left out, within ``width``."""
    fields = msgspec.to_builtins(event)
    parts = []
    for name, value in fields.items():
        if name in _ENVELOPE or value in ("", None, [], {}, 0, 0.0, False):
            continue
        if isinstance(value, list | dict):
            text = f"{name}=[{len(value)}]" if isinstance(value, list) else f"{name}={{{len(value)}}}"
        elif isinstance(value, float):
            text = f"{name}={value:.3g}"
        else:
            text = f"{name}={value}"
        parts.append(text)
    line = " ".join(parts)
    return line if len(line) <= width else line[: width - 1] + "…"


def row(event: Event) -> tuple[str, str, str, str]:
    at = event.occurred_at.astimezone().strftime("%H:%M:%S.%f")[:-3] if isinstance(event.occurred_at, datetime) else ""
    return at, event.kind, event.source, summary(event)


def line(cells: tuple[str, str, str, str], width: int) -> str:
    """One row of the table, cut to ``width``: fixed columns, then the summary."""
    at, kind, source, what = cells
    text = f"{at:<12}  {kind:<30}  {source:<18}  {what}"
    return text if len(text) <= width else text[: width - 1] + "…"


async def stored(mesh: MeshClient, kinds: list[str] | None, limit: int) -> list[Event]:
    """The newest ``limit`` lifecycle events of these kinds in the stream, oldest first."""
    stream = mesh.subjects.events_stream.name
    info = await mesh.bus.js.stream_info(stream)
    out: list[Event] = []
    seq = info.state.last_seq
    scanned = 0
    while seq >= max(1, info.state.first_seq) and len(out) < limit and scanned < 20_000:
        scanned += 1
        try:
            raw = await mesh.bus.js.get_msg(stream, seq)
        except Exception:
            seq -= 1
            continue
        seq -= 1
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            event = codec.decode(raw.data or b"")
            if kinds is None or event.kind in kinds:
                out.append(event)
    return list(reversed(out))


async def listen(mesh: MeshClient, kinds: list[str] | None, on_event: Callable[[Event], None]) -> None:
    """Call ``on_event`` with every lifecycle event (and, when ``kinds`` names telemetry, that too) published from
    now on; returns once subscribed."""
    s = mesh.subjects
    subjects = set(s.events_stream.subjects)
    if kinds is not None:
        subjects = {s.pattern(k) for k in kinds}
    accepted: tuple[type[Event], ...] = tuple(BY_KIND[k] for k in (kinds or sorted(BY_KIND)))

    async def handler(event: Any) -> None:
        if kinds is None or event.kind in kinds:
            on_event(event)

    for subject in sorted(subjects):
        await mesh.bus.subscribe(subject, handler, accepted, name="cli-events")


async def page_then_follow(
    mesh: MeshClient, kinds: list[str] | None, limit: int, show: Callable[[list[Event]], None], follow: bool
) -> int:
    """The newest ``limit`` stored events, then (``follow``) each new one until cancelled, none lost between the
    two: the subscription starts first and what it hears meanwhile is shown after the page, less what the page
    already showed. Returns how many stored events it showed (without ``follow``)."""
    heard: list[Event] = []
    live = False

    def on_event(event: Event) -> None:
        if live:
            show([event])
        else:
            heard.append(event)

    if follow:
        await listen(mesh, kinds, on_event)
    page = await stored(mesh, kinds, limit)
    show(page)
    if not follow:
        return len(page)
    shown = {e.event_id for e in page}
    show([e for e in heard if e.event_id not in shown])
    live = True
    await asyncio.Event().wait()
    return len(page)  # not reached: following ends with the command
