"""``gpuwarden drain --wait`` follows the drained sessions by subscription (``SessionMoves``): a restore is heard as
it is published, one stored before the subscription began is looked up once, a restore on the drained node or
under a generation not newer than the drained one does not count, and a session that ended for any reason (its
client closed it; its pod ended it: expired, or at its context limit) is ended. The drain's save progress is heard
from the agents' ``checkpoint.save.progress`` (``SaveProgressListener``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shared.console.client import MeshClient
from shared.console.operations import MovedSession, SessionMoves
from shared.console.saveprogress import SaveProgressListener
from shared.contract.checkpoint import SaveProgress, SessionRestored
from shared.contract.requests import InferenceRequest
from shared.contract.sessions import SessionLocation
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from tests.helpers import eventually


def restored(session: str, node: str, pod: str, generation: int, **fields: Any) -> SessionRestored:
    return SessionRestored(
        session_id=session,
        checkpoint_id=f"{session}-c{generation}",
        node=node,
        pod=pod,
        generation=generation,
        **fields,
    )


async def test_restores_are_heard_or_looked_up_and_only_newer_ones_elsewhere_count(
    settings: Settings, subjects: Subjects, bus: Bus
) -> None:
    await bus.ensure_streams()
    mesh = MeshClient(settings, bus, None, None)
    sessions = [
        MovedSession("s-before", "pod-a", 3),
        MovedSession("s-heard", "pod-a", 3),
        MovedSession("s-closed", "pod-a", 3),
        MovedSession("s-newer", "pod-a", 5),
    ]
    await bus.publish(restored("s-before", "node-2", "pod-b", 4))  # before anyone listened: looked up
    progress: list[dict[str, Any]] = []
    async with SessionMoves(mesh, "node-1", sessions) as moves:
        follow = asyncio.create_task(moves.follow(time.monotonic() + 60, lambda phase, done: progress.append(done)))
        await eventually(lambda: progress and progress[-1]["done"] == 1)
        await bus.publish(restored("s-heard", "node-1", "pod-a2", 4))  # back on the drained node: not moved
        await bus.publish(restored("s-newer", "node-2", "pod-c", 5))  # the generation drained: not newer
        await bus.publish(restored("s-heard", "node-3", "pod-d", 4, fell_back_from=["s-heard-c5: corrupt"]))
        await bus.publish(InferenceRequest(namespace="llm", deployment="llama", session_id="s-closed"))
        await bus.publish(restored("s-newer", "node-2", "pod-e", 6))
        assert await asyncio.wait_for(follow, 30)
    by_id = {m.id: m for m in sessions}
    assert (by_id["s-before"].outcome, by_id["s-before"].new_pod) == ("restored", "pod-b")
    assert (by_id["s-heard"].outcome, by_id["s-heard"].new_node, by_id["s-heard"].new_pod) == (
        "restored",
        "node-3",
        "pod-d",
    )
    assert by_id["s-heard"].fell_back_from == ["s-heard-c5: corrupt"]
    assert by_id["s-heard"].checkpoint_id == "s-heard-c4"
    assert by_id["s-closed"].outcome == "ended"
    assert (by_id["s-newer"].outcome, by_id["s-newer"].new_pod) == ("restored", "pod-e")
    assert progress[-1] == {"done": 4, "total": 4}


async def test_a_session_not_restored_in_time_is_reported_waiting(
    settings: Settings, subjects: Subjects, bus: Bus
) -> None:
    await bus.ensure_streams()
    mesh = MeshClient(settings, bus, None, None)
    sessions = [MovedSession("s-late", "pod-a", 1), MovedSession("s-moved", "pod-a", 1)]
    async with SessionMoves(mesh, "node-1", sessions) as moves:
        await bus.publish(restored("s-moved", "node-2", "pod-b", 2))
        assert not await moves.follow(time.monotonic() + 1.0, lambda phase, done: None)
    assert [m.outcome for m in sessions] == ["", "restored"]


def ended(session: str, sequence: int) -> SessionLocation:
    """What the registry publishes when the pod holding a session ends it (expired, or at its context limit)."""
    return SessionLocation(session_id=session, sequence=sequence, reason="ended", held=False, generation=3)


async def test_a_session_that_expires_mid_drain_counts_as_ended(
    settings: Settings, subjects: Subjects, bus: Bus
) -> None:
    await bus.ensure_streams()
    mesh = MeshClient(settings, bus, None, None)
    sessions = [
        MovedSession("s-expired-before", "pod-a", 3),
        MovedSession("s-expired", "pod-a", 3),
        MovedSession("s-saved", "pod-a", 3),
        MovedSession("s-moved", "pod-a", 3),
    ]
    await bus.publish(ended("s-expired-before", 7))  # before anyone listened: looked up
    progress: list[dict[str, Any]] = []
    async with SessionMoves(mesh, "node-1", sessions) as moves:
        follow = asyncio.create_task(moves.follow(time.monotonic() + 60, lambda phase, done: progress.append(done)))
        await eventually(lambda: progress and progress[-1]["done"] == 1)
        saved = SessionLocation(session_id="s-saved", sequence=8, reason="saved", held=True, generation=3)
        await bus.publish(saved)  # a save is no end
        await bus.publish(ended("s-expired", 9))
        await bus.publish(restored("s-moved", "node-2", "pod-b", 4))
        await eventually(lambda: progress[-1]["done"] == 3)
        assert not follow.done()
        await bus.publish(ended("s-saved", 10))
        assert await asyncio.wait_for(follow, 30)
    assert [m.outcome for m in sessions] == ["ended", "ended", "ended", "restored"]


async def test_the_drains_save_progress_sums_its_pods_batches(bus: Bus) -> None:
    heard: list[tuple[int, int]] = []
    async with SaveProgressListener(bus, "d1", ["pod-a", "pod-b"], lambda n, b: heard.append((n, b))) as listener:

        def progress(pod: str, done: int, total: int, drain_id: str = "d1") -> SaveProgress:
            return SaveProgress(
                pod=pod, drain_id=drain_id, sessions_done=done, sessions_total=total, bytes_done=done * 10
            )

        for event in (
            progress("pod-a", 2, 4),  # a round of pod-a's first batch
            progress("pod-a", 4, 4),  # its end
            progress("pod-b", 3, 3),
            progress("pod-c", 9, 9),  # another node's pod: not this drain's
            progress("pod-a", 4, 9, drain_id="d2"),  # another drain
            progress("pod-a", 4, 4),  # pod-a's second batch, ended: counted on top of the first
        ):
            await bus.publish(event)
        await eventually(lambda: heard and heard[-1][0] == 11)
    counts = [n for n, _ in heard]  # one subscription per pod: the pods' events may interleave either way
    assert len(counts) == 4 and counts == sorted(counts), counts
    assert (listener.sessions_done, listener.bytes_done) == (11, 110)
