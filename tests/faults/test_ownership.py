"""Session ownership under faults: a pod that lost a session never rolls it back, a stopped agent is silent, and
the registry forgets pods that are gone (but not pods that are merely silent)."""

from __future__ import annotations

import msgspec
import pytest

from shared.contract.checkpoint import LocateCheckpoint, SaveSessions, SaveSessionsReport
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.registry import codec
from shared.kv.agent import SaveReport
from shared.kv.manifest import CheckpointManifest, checkpoint_order, new_checkpoint_id, seal_manifest
from shared.kv.reports import report_event
from tests.faults.conftest import Mesh, Pod, expected
from tests.helpers import eventually


async def test_a_pod_that_lost_a_session_never_rolls_it_back(mesh: Mesh) -> None:
    """The issue's case: after a scale-down the removed pod's agent still answers; its stale copy of a session
    that moved and grew must never become the newest checkpoint. (Pods the cluster does not run: a claim never
    takes a session from a pod the cluster still runs, see test_attacks.)"""
    old = await mesh.add_pod("gone-1", "node-1", ["s1", "s2"], blocks=3)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=10))
    await eventually(lambda: any(v.drain_id == "d1" for v in mesh.verdicts))
    assert isinstance(mesh.verdicts[-1], DrainCompleted) and mesh.verdicts[-1].sessions_committed == 2
    # s1 moves: a pod on node-2 takes it (a new generation) and the conversation grows
    new = await mesh.add_pod("gone-2", "node-2")
    restored = await new.endpoint.restore("s1")
    assert [bytes(b) for b in restored.blocks] == expected("s1", 3)
    assert new.agent.generation("s1") > old.agent.generation("s1")
    new.grow("s1", 2)
    # the old pod keeps running (never stopped) and says it still holds s1: the registry is not moved back
    await mesh.announce(old)
    assert "s1" not in await mesh.sessions_on("node-1") and "s1" in await mesh.sessions_on("node-2")
    # its node is drained again: it is asked only for what it owns (s2); s1 is not saved by it
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d2", deadline_s=10))
    await eventually(lambda: any(v.drain_id == "d2" for v in mesh.verdicts))
    verdict = next(v for v in mesh.verdicts if v.drain_id == "d2")
    assert isinstance(verdict, DrainCompleted) and verdict.sessions_committed == 1
    # asked directly with the registry's view, the stale pod refuses; its own preStop save is refused by the service
    command = SaveSessions(pod="gone-1", generations={"s1": new.agent.generation("s1")})
    reply = await mesh.bus.request(mesh.subjects.for_event(command), command, timeout=10)
    assert isinstance(reply, SaveSessionsReport) and not reply.committed
    assert "refused" in reply.failed[0].reason
    final = await old.endpoint.final_save(deadline_s=10)  # s2: nothing new since d2 committed it, confirmed
    assert not final.committed and {c.session_id for c in final.kept} == {"s2"}
    assert [f.session_id for f in final.failed] == ["s1"] and "refused" in final.failed[0].reason
    # the session's newest checkpoint is still the one the new owner restored from; once it saves, its own
    third = await mesh.add_pod("gone-3", "node-3")
    assert [bytes(b) for b in (await third.endpoint.restore("s1")).blocks] == expected("s1", 3)
    # ...and now gone-2 lost s1 in turn; give it back by restoring on gone-2 again, grown, then saved
    back = await new.endpoint.restore("s1")
    assert len(back.blocks) == 3
    new.grow("s1", 2)
    assert await mesh.periodic_turn() >= 1
    fourth = await mesh.add_pod("gone-4", "node-3")
    assert [bytes(b) for b in (await fourth.endpoint.restore("s1")).blocks] == expected("s1", 5)
    await mesh.check(min_checkpoints=4, drains=["d1", "d2"])  # the preStop saved nothing twice


async def test_a_stopped_agent_stops_answering(mesh: Mesh) -> None:
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"])
    command = SaveSessions(pod="llama-1")
    assert isinstance(await mesh.bus.request(mesh.subjects.for_event(command), command, 10), SaveSessionsReport)
    await pod.endpoint.stop()
    with pytest.raises(TimeoutError):
        await mesh.bus.request(mesh.subjects.for_event(command), command, 1)


async def test_gone_pods_leave_the_registry_silent_ones_that_still_exist_do_not(mesh: Mesh) -> None:
    cluster = mesh.service.cluster
    assert cluster is not None
    await cluster.tick()  # schedules the spec's pods
    real = next(p.name for p in await cluster.pods(node="node-1"))
    ghost = await mesh.add_pod("ghost-1", "node-1", ["g1", "g2"], announce_s=0.2)
    hung = await mesh.add_pod(real, "node-1", ["h1"], announce_s=0.2)
    assert await mesh.sessions_on("node-1") == {"g1", "g2", "h1"}
    await ghost.endpoint.stop()  # deleted without a word: no preStop, no announcement ever again
    await hung.endpoint.stop()  # hung: silent, but the cluster still has the pod
    await eventually(lambda: mesh.service.registry.silent_pods(), timeout=5)
    await eventually(lambda: _both_silent(mesh, "ghost-1", real), timeout=5)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=2, grace_period_s=5))
    await eventually(lambda: any(v.drain_id == "d1" for v in mesh.verdicts))
    verdict = next(v for v in mesh.verdicts if v.drain_id == "d1")
    # the ghost's sessions were forgotten (their checkpoints, if any, stand); the hung pod's fail the drain
    assert isinstance(verdict, DrainFailed), verdict
    assert {f.session_id for f in verdict.failed_sessions} == {"h1"}
    assert await mesh.sessions_on("node-1") == {"h1"}
    assert "ghost-1" not in await mesh.service.registry.pods()
    await mesh.check(min_checkpoints=0, drains=["d1"])


async def _both_silent(mesh: Mesh, *pods: str) -> bool:
    return set(pods) <= set(await mesh.service.registry.silent_pods())


async def test_an_ended_session_is_retired_by_its_owner_only(mesh: Mesh) -> None:
    """Conversations end; their checkpoints must not pile up for ever, and only the owner may end one."""
    old = await mesh.add_pod("gone-1", "node-1", ["s1", "s2"])  # the cluster no longer runs it: s2 may move
    assert await mesh.periodic_turn() == 1
    new = await mesh.add_pod("llama-2", "node-2")
    await new.endpoint.restore("s2")  # s2 moves to llama-2
    old.endpoint.end_session("s2")  # a stale holder cannot end it
    old.endpoint.end_session("s1")
    await mesh.announce(old)
    await eventually(lambda: _no_checkpoints(mesh, "s1"))
    assert len(await mesh.service.registry.checkpoints("s2")) == 1
    assert await mesh.store.checkpoints("s1") == [] and len(await mesh.store.checkpoints("s2")) == 1
    assert await mesh.sessions_on("node-1") == set() and await mesh.sessions_on("node-2") == {"s2"}
    await mesh.check(min_checkpoints=1)


async def _no_checkpoints(mesh: Mesh, sid: str) -> bool:
    return not await mesh.service.registry.checkpoints(sid)


async def test_a_session_dropped_then_ended_is_retired_by_the_pod_that_owned_it_last(mesh: Mesh) -> None:
    """A preempted session: its pod dropped its blocks (and said so), then the conversation ended. That pod took
    its newest generation, so it still may retire it; another pod may not."""
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"])
    other = await mesh.add_pod("llama-2", "node-1")
    assert await mesh.periodic_turn() == 1
    pod.agent.forget_session("s1")  # preempted: no KV of it left on the pod
    await mesh.announce(pod)
    assert await mesh.sessions_on("node-1") == set()
    other.endpoint.end_session("s1")
    await mesh.announce(other)
    assert len(await mesh.service.registry.checkpoints("s1")) == 1  # not its to end
    pod.endpoint.end_session("s1")
    await mesh.announce(pod)
    await eventually(lambda: _no_checkpoints(mesh, "s1"))
    assert await mesh.store.checkpoints("s1") == []
    await mesh.check(min_checkpoints=0)


async def test_an_older_agent_that_says_claim_still_takes_the_session(mesh: Mesh) -> None:
    """``take_session`` was called ``claim`` before: a locate from an agent of then, which sends only ``claim``,
    still hands out the session's next generation; one that sets neither changes nothing."""
    pod = await mesh.add_pod("llama-1", "node-1")
    subject = mesh.subjects.agent_command("locate", "llama-1")
    asked = {"session_id": "s9", "pod": "llama-1", "node": "node-1", "namespace": "llm", "deployment": "llama"}
    older = msgspec.json.decode(codec.encode(LocateCheckpoint(**asked)))
    del older["take_session"]
    looked = await pod.bus.nc.request(subject, msgspec.json.encode(older), timeout=5)
    assert msgspec.json.decode(looked.data)["generation"] == 0 and await mesh.service.registry.generation("s9") == 0
    older["claim"] = True
    taken = await pod.bus.nc.request(subject, msgspec.json.encode(older), timeout=5)
    assert msgspec.json.decode(taken.data)["generation"] == 1 == await mesh.service.registry.generation("s9")


async def test_a_restore_passes_over_another_pods_checkpoint_of_the_holders_generation(mesh: Mesh) -> None:
    """The holder fence of a restore's repair (``REPAIR``): a save refused as stale is deleted right after the
    refusal; a restore that lists the store before that must not take it as the newest. Here the store holds,
    unrecorded, a checkpoint of the generation s1's holder has, written by another pod (the stale save, or the
    other holder of a generation a claim lost in a Redis failover handed out twice), one sequence newer than the
    holder's: the restore takes the holder's."""
    holder = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    assert await mesh.periodic_turn() == 1
    recorded = await mesh.service.registry.newest_checkpoint("s1")
    assert recorded is not None
    mine = await mesh.store.manifest("s1", str(recorded["checkpoint_id"]))
    stale = await _saved_later(mesh, mine, pod="llama-9", node="node-9")
    await mesh.evict(holder)
    await _restored_passing_over(mesh, await mesh.add_pod("llama-2", "node-2"), mine.checkpoint_id, stale)


async def test_a_restore_passes_over_a_save_of_the_old_holder_made_after_the_session_moved(mesh: Mesh) -> None:
    """The seal fence of a restore's repair (``REPAIR``). s1 moves from llama-1 to llama-2 (a new generation,
    restored from llama-1's newest checkpoint); llama-1, still running, saves its copy once more, under its old
    generation, and the file is in the store before the refusal's deletion. llama-2 is evicted before it saved
    anything: the next restore takes what llama-2 restored (the seal of its generation), not llama-1's later save,
    which is never recorded."""
    old = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    assert await mesh.periodic_turn() == 1
    recorded = await mesh.service.registry.newest_checkpoint("s1")
    assert recorded is not None
    sealed = await mesh.store.manifest("s1", str(recorded["checkpoint_id"]))
    mover = await mesh.add_pod("llama-2", "node-2")
    await mesh.evict(old)
    moved = await mover.endpoint.restore("s1")
    assert moved.manifest.checkpoint_id == sealed.checkpoint_id
    assert mover.agent.generation("s1") > sealed.generation
    late = await _saved_later(mesh, sealed)  # llama-1's save after the move: same pod, its old generation
    await mesh.evict(mover)
    await _restored_passing_over(mesh, await mesh.add_pod("llama-3", "node-3"), sealed.checkpoint_id, late)


async def _saved_later(mesh: Mesh, after: CheckpointManifest, **written_by: str) -> CheckpointManifest:
    """A checkpoint of s1 one sequence after ``after``, of its generation, in the store and not recorded: a save
    the service refused and has not deleted yet (``written_by``: another pod and node than ``after``'s)."""
    later = seal_manifest(
        msgspec.structs.replace(
            after,
            checkpoint_id=new_checkpoint_id(after.generation, after.sequence + 1),
            sequence=after.sequence + 1,
            **written_by,
        )
    )
    await mesh.store.commit_manifest(later)
    assert checkpoint_order(later.checkpoint_id) > checkpoint_order(after.checkpoint_id)
    return later


async def _restored_passing_over(mesh: Mesh, rescuer: Pod, want: str, stale: CheckpointManifest) -> None:
    """``rescuer`` restores s1 from ``want``, never from ``stale``, which is not recorded either."""
    restored = await rescuer.endpoint.restore("s1")
    assert restored.manifest.checkpoint_id == want, restored.fell_back_from
    assert restored.fell_back_from == []
    assert [bytes(b) for b in restored.blocks] == expected("s1", 2)
    recorded_ids = {str(r["checkpoint_id"]) for r in await mesh.service.registry.checkpoints("s1")}
    assert stale.checkpoint_id not in recorded_ids
    assert stale.checkpoint_id in await mesh.store.checkpoints("s1")  # not deleted yet: the checker fences it too
    found = await mesh.check(min_checkpoints=1)
    assert found.fenced == 1


async def test_a_pod_that_stops_after_the_registry_lost_its_writes_still_leaves(mesh: Mesh) -> None:
    """A Redis failover lost what the registry knew of llama-1 (its pod record: the next announcement no longer
    follows and is answered resync). llama-1's agent stops: its leaving announcement is answered resync, and the full
    announcement that follows must say it is leaving too (the announcing loop's own full announcement once cleared
    the mark), so another pod takes its session at once rather than being told it is held."""
    old = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    assert await mesh.periodic_turn() == 1
    await mesh.client.delete(mesh.subjects.redis_key("kv", "podinfo", "llama-1"))
    await mesh.evict(old)
    leaving = await mesh.client.hget(mesh.subjects.redis_key("kv", "podinfo", "llama-1"), "leaving")
    assert leaving == b"1"
    new = await mesh.add_pod("llama-2", "node-2")
    restored = await new.endpoint.restore("s1")
    assert [bytes(b) for b in restored.blocks] == expected("s1", 2)
    await mesh.check(min_checkpoints=1)


# -- the fences of recording a save (``RECORD``), each from both sides: the save it refuses, the save it lets by ---


async def _moved(mesh: Mesh) -> tuple[Pod, Pod, str]:
    """s1 saved by llama-1 under generation 1, then taken by llama-2 (generation 2, sealed at llama-1's newest
    checkpoint, which it restores). llama-1's agent stops, and still holds its copy (a pod still running)."""
    old = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    assert await mesh.periodic_turn() == 1
    seal = str((await mesh.service.registry.checkpoints("s1"))[0]["checkpoint_id"])
    await mesh.evict(old)
    new = await mesh.add_pod("llama-2", "node-2")
    assert (await new.endpoint.restore("s1")).manifest.checkpoint_id == seal
    assert (await mesh.service.registry.generation("s1"), new.agent.generation("s1")) == (2, 2)
    return old, new, seal


async def _reported(mesh: Mesh, pod: Pod, saved: SaveReport) -> SaveSessionsReport:
    """The pod's report of ``saved`` as its agent sends it (``cmd.checkpoint.record``), and the service's answer."""
    subject = mesh.subjects.agent_command("record", pod.name)
    answer = await mesh.bus.request(subject, report_event(pod.agent, saved), timeout=10)
    assert isinstance(answer, SaveSessionsReport)
    return answer


async def _recorded(mesh: Mesh, sid: str) -> list[str]:
    return [str(r["checkpoint_id"]) for r in await mesh.service.registry.checkpoints(sid)]


async def test_generation_fence_an_older_generations_save_is_never_recorded(mesh: Mesh) -> None:
    """The generation fence (``RECORD``: a save of a generation below the session's counter is refused). llama-1
    lost s1 to llama-2 and saves its copy on: the save is refused by name, never recorded, and the session's newest
    recorded checkpoint stays what llama-2 restored. Without the fence, llama-1's save would be the newest."""
    old, new, seal = await _moved(mesh)
    old.grow("s1", 1)
    late = await old.agent.save()
    answer = await _reported(mesh, old, late)
    assert not answer.committed and "refused" in answer.failed[0].reason and "generation 2" in answer.failed[0].reason
    assert late.committed[0].checkpoint_id not in await _recorded(mesh, "s1")
    assert (await _recorded(mesh, "s1"))[0] == seal
    assert [bytes(b) for b in (await new.endpoint.restore("s1")).blocks] == expected("s1", 2)
    await mesh.check(min_checkpoints=1)


async def test_generation_fence_lets_the_holder_record_above_a_counter_redis_lost(mesh: Mesh) -> None:
    """The generation fence refuses only generations below the counter: the holder's save under a generation above
    it (a Redis failover lost the claim's counter) is recorded, and the counter rises to it. A fence that asked for
    the counter's own generation would refuse the one pod that holds the session."""
    _, new, seal = await _moved(mesh)
    await mesh.client.delete(mesh.subjects.redis_key("kv", "generation", "s1"))
    new.grow("s1", 1)
    saved = await new.agent.save()
    answer = await _reported(mesh, new, saved)
    assert [c.session_id for c in answer.committed] == ["s1"] and not answer.failed
    assert await _recorded(mesh, "s1") == [saved.committed[0].checkpoint_id, seal]
    assert await mesh.service.registry.generation("s1") == 2
    await mesh.check(min_checkpoints=2)


async def test_holder_fence_another_pods_save_of_the_holders_generation_is_refused_and_deleted(mesh: Mesh) -> None:
    """The holder fence (``RECORD``: a save of the current generation by a pod other than its holder is refused,
    and is stale: the refusal deletes it). llama-9 was handed s1's generation too (a claim a Redis failover lost
    handed it out twice) and saves under it; llama-1 holds that generation: llama-9's save is refused, deleted, and
    llama-1's checkpoint stays the newest. Without the fence, llama-9's save would be recorded as the newest."""
    holder = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    assert await mesh.periodic_turn() == 1
    (mine,) = await _recorded(mesh, "s1")
    other = await mesh.add_pod("llama-9", "node-9")
    other.agent.register_session("s1", generation=1)  # what the lost claim gave it
    other.grow("s1", 2)
    theirs = await other.agent.save()
    assert theirs.committed[0].generation == 1
    answer = await _reported(mesh, other, theirs)
    assert not answer.committed and "held by pod llama-1" in answer.failed[0].reason
    assert await _recorded(mesh, "s1") == [mine]
    assert theirs.committed[0].checkpoint_id not in await mesh.store.checkpoints("s1")  # stale: deleted
    await mesh.check(min_checkpoints=1)
    assert holder.agent.generation("s1") == 1


async def test_holder_fence_lets_the_holder_record_its_own_generation(mesh: Mesh) -> None:
    """The holder fence refuses only another pod: after a refused save of its generation by another pod, the
    holder's own next save under that generation is recorded, as every save of its before. A fence on the
    generation alone would refuse the holder too."""
    holder = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    assert await mesh.periodic_turn() == 1
    holder.grow("s1", 1)
    saved = await holder.agent.save()
    answer = await _reported(mesh, holder, saved)
    assert [c.session_id for c in answer.committed] == ["s1"] and not answer.failed
    assert (await _recorded(mesh, "s1"))[0] == saved.committed[0].checkpoint_id
    await mesh.check(min_checkpoints=2)


async def test_seal_fence_an_old_holders_save_after_the_seal_is_stale_and_deleted(mesh: Mesh) -> None:
    """The seal fence (``RECORD``: a refused save of an older generation that sorts after the current
    generation's seal was made after that claim, by a pod that had lost the session: stale, and deleted by the
    refusal). Without the fence it would be refused and kept: a file no restore may take, left in the store."""
    old, _, seal = await _moved(mesh)
    old.grow("s1", 1)
    late = await old.agent.save()
    assert late.committed[0].checkpoint_id > seal
    assert late.committed[0].checkpoint_id in await mesh.store.checkpoints("s1")
    answer = await _reported(mesh, old, late)
    assert not answer.committed
    assert late.committed[0].checkpoint_id not in await mesh.store.checkpoints("s1")
    found = await mesh.check(min_checkpoints=1)
    assert found.store_only == 0


async def test_seal_fence_keeps_a_save_made_before_the_session_moved(mesh: Mesh) -> None:
    """The seal fence deletes only what sorts after the seal: llama-1's save made before s1 moved, whose report
    arrives only after the move, is refused (llama-1 no longer holds the generation) but kept: it was committed
    while llama-1 held the session, and a refusal never deletes what someone committed. A fence on the generation
    alone would delete it."""
    old = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    old.grow("s1", 1)
    early = await old.agent.save()  # committed; its report is late
    old.grow("s1", 1)
    assert await mesh.periodic_turn() == 1  # the next save, reported and recorded: the newest
    await mesh.evict(old)
    new = await mesh.add_pod("llama-2", "node-2")
    restored = await new.endpoint.restore("s1")
    assert restored.manifest.checkpoint_id > early.committed[0].checkpoint_id  # the seal
    answer = await _reported(mesh, old, early)
    assert not answer.committed and "refused" in answer.failed[0].reason
    assert early.committed[0].checkpoint_id in await mesh.store.checkpoints("s1")  # kept
    assert early.committed[0].checkpoint_id not in await _recorded(mesh, "s1")
    found = await mesh.check(min_checkpoints=1)
    assert found.store_only == 1 and found.fenced == 0  # older than the newest recorded: no problem, no fence
