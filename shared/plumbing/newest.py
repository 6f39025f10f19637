"""The newest stored message of each of many subjects of a stream, in a few requests whatever their number: what a
reader of the whole fleet asks (``gpuwarden status``: every node's newest inventory and drain, every deployment's
newest scale decision, each listed session's newest restore).

JetStream answers a batched direct get (``multi_last``, nats-server 2.11 and later) with the newest message of each
subject it names, up to 1,024 of them a request (more is refused whole, 413): ``BATCH_SUBJECTS`` subjects go in one
request, so 1,000 nodes cost one round trip where a direct get each cost 1,000. An older server (2.10: deploy/README.md
asks for 2.10+) does not know the field and refuses the request (408); so do a stream without direct gets and a server
that does not answer in time: those subjects are then read one direct get each, ``AT_ONCE`` at a time, as before.
A consumer with ``last_per_subject`` delivery would also work on 2.10, but it is server state to create and delete,
and it streamed 1,000 messages slower here than the direct gets it would replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js.client import JetStreamContext

BATCH_SUBJECTS = 1000
"""Subjects named in one batched direct get (the server answers at most 1,024 messages a request)."""
AT_ONCE = 64
"""Direct gets in flight at once where the server cannot batch them."""
REQUEST_S = 5.0
"""How long one batched request may take before its subjects are read one by one instead."""
_DIRECT_GET = "$JS.API.DIRECT.GET."


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One message as the stream stores it: where, at which sequence, and its body."""

    subject: str
    seq: int
    data: bytes


async def newest_messages(
    nc: Client,
    js: JetStreamContext,
    stream: str,
    subjects: Iterable[str],
    *,
    batched: bool = True,
    timeout: float = REQUEST_S,
) -> dict[str, StoredMessage]:
    """Subject -> its newest message in ``stream``, for each of ``subjects`` (literal subjects) that has one.
    ``batched``: ask in batches first (False reads one by one, as from a server without them). A subject that
    cannot be read now (the stream not answering) is left out, as one with no message is."""
    wanted = list(dict.fromkeys(subjects))
    found: dict[str, StoredMessage] = {}
    one_by_one = wanted
    if batched and wanted:
        chunks = [wanted[i : i + BATCH_SUBJECTS] for i in range(0, len(wanted), BATCH_SUBJECTS)]
        answers = await asyncio.gather(*(_batch(nc, stream, chunk, timeout) for chunk in chunks))
        one_by_one = []
        for chunk, answer in zip(chunks, answers, strict=True):
            if answer is None:
                one_by_one += chunk
            else:
                found.update(answer)
    if one_by_one:
        found.update(await _each(js, stream, one_by_one))
    return found


async def _batch(nc: Client, stream: str, subjects: list[str], timeout: float) -> dict[str, StoredMessage] | None:
    """One batched direct get of ``subjects``' newest messages; None when the server would not (or could not in
    ``timeout``) answer it, so that they are read one by one."""
    found: dict[str, StoredMessage] = {}
    ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is not None:  # the end: 204 (all sent), 404 (none of them has a message), else a refusal
            if not ended.done():
                ended.set_result(status in ("204", "404"))
            return
        subject = headers.get("Nats-Subject", "")
        with contextlib.suppress(ValueError):
            found[subject] = StoredMessage(subject, int(headers.get("Nats-Sequence", "0")), msg.data or b"")

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg)
    try:
        body = json.dumps({"multi_last": subjects, "batch": len(subjects)}).encode()
        await nc.publish(_DIRECT_GET + stream, body, reply=inbox)
        try:
            complete = await asyncio.wait_for(ended, timeout)
        except TimeoutError:
            return None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return found if complete else None


async def _each(js: JetStreamContext, stream: str, subjects: list[str]) -> dict[str, StoredMessage]:
    slots = asyncio.Semaphore(AT_ONCE)

    async def one(subject: str) -> Any:
        async with slots:
            try:
                return await js.get_last_msg(stream, subject)
            except Exception:  # none stored, or the stream not answering now
                return None

    raws = await asyncio.gather(*(one(s) for s in subjects))
    return {
        subject: StoredMessage(subject, int(raw.seq or 0), raw.data or b"")
        for subject, raw in zip(subjects, raws, strict=True)
        if raw is not None
    }
