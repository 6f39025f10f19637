"""Where a session restores from, and who holds it: a pod locating a session gets its checkpoints newest
(generation, sequence) first, those the store holds and those the registry recorded (the store is the last word
on what was committed: newer ones a Redis failover made the registry lose are recorded again); with
``take_session`` the pod takes the session under its next generation, above every generation a checkpoint
carries, unless a pod that still runs holds it or it belongs to another deployment. A pod's report of a restore
moves the session to it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.contract.checkpoint import CheckpointLocation, LocateCheckpoint, SessionRestored
from shared.kv.manifest import CheckpointManifest, checkpoint_order, lost_pack, newest_first
from shared.kv.store import CheckpointNotFound, StoreError

from .ports import Claim
from .replica import Replica

log = logging.getLogger(__name__)

RESTORE_CANDIDATES = 16
"""Checkpoints a restore is offered, newest first."""


@dataclass(frozen=True)
class RestoreCandidates:
    """What a restore of one session may use: ``ids`` newest (generation, sequence) first; ``floor`` the newest
    generation any checkpoint of the session carries (the next one handed out is above it); ``from_store`` the
    ids the registry had lost and got back from the store; ``bytes_total`` of the first; ``listed``: whether the
    store was listed (else the registry's alone)."""

    ids: list[str]
    floor: int
    from_store: list[str]
    bytes_total: int
    listed: bool = True


class Restores:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    async def on_locate(self, event: LocateCheckpoint) -> CheckpointLocation:
        """The session's checkpoints, newest (generation, sequence) first: those the store holds and those the
        registry recorded (``_candidates``). With ``take_session``, the asking pod takes the session under its
        next generation, above every generation the checkpoints carry: each take is a new generation (what makes a
        stale holder's saves refusable), and the same take sent again (its ``take_id``) is answered with the
        generation it was given, changing nothing."""
        found = await self._candidates(event.session_id)
        candidates = found.ids
        generation, taken_from, taken_gen = 0, "", 0
        if event.takes_session:
            seal = (candidates[0] if candidates else "") if found.listed else None
            claim = await self._claim(event, found.floor, seal)
            if claim.refused:
                return CheckpointLocation(
                    session_id=event.session_id,
                    found=False,
                    store=self.replica.store.url,
                    refused=claim.refused,
                    holder=claim.holder if claim.refused.startswith("held") else "",
                )
            generation, taken_from, taken_gen = claim.generation, claim.taken_from, claim.taken_from_generation
        if not candidates:
            return CheckpointLocation(
                session_id=event.session_id,
                found=False,
                store=self.replica.store.url,
                generation=generation,
                taken_from=taken_from,
                taken_from_generation=taken_gen,
            )
        await self.replica.registry.record_restore(event.session_id, candidates[0], event.pod, event.node)
        return CheckpointLocation(
            session_id=event.session_id,
            found=True,
            checkpoint_id=candidates[0],
            store=self.replica.store.url,
            bytes_total=found.bytes_total,
            generation=generation,
            candidates=candidates,
            from_store=found.from_store,
            taken_from=taken_from,
            taken_from_generation=taken_gen,
        )

    async def _claim(self, event: LocateCheckpoint, floor: int, seal: str | None) -> Claim:
        """The asking pod takes the session, unless another pod that is alive holds it: then the cluster is asked
        whether that pod still runs (a pod being evicted keeps its lease until its agent stops), and only a pod
        that does not run any more gives the session up. Refusals name why; nothing changes. ``seal``: the newest
        checkpoint the store holds (None when it was not listed): what the old holder saves after it is stale."""
        registry = self.replica.registry
        refused = self.replica.metrics.refused
        args = (event.session_id, event.pod, event.node, event.namespace, event.deployment, floor)
        claim = await registry.claim(*args, seal=seal, take=event.take_id)
        gone = self._listed if event.prefetch else self._runs  # a prefetch waits until the holder has left
        if claim.refused == "held" and not await gone(claim.holder, claim.holder_node):
            claim = await registry.claim(*args, force=True, seal=seal, take=event.take_id)
        if claim.location is not None:
            await self.replica.publish_locations([claim.location])
        if claim.refused == "held":
            refused.labels("claim").inc()
            return Claim(0, None, f"held by pod {claim.holder}, which is alive: its requests go there", claim.holder)
        if claim.refused == "deployment":
            refused.labels("claim").inc()
            return Claim(0, None, f"the session belongs to deployment {claim.holder}", claim.holder)
        if claim.refused == "take":
            refused.labels("claim").inc()
            return Claim(0, None, f"take id {event.take_id} was another pod's take of the session")
        return claim

    async def _runs(self, pod: str, node: str) -> bool:
        """Whether the cluster has ``pod`` running (not terminating, not gone). When the cluster cannot say, the
        pod is taken to run: a session is never taken from a pod that may still serve it."""
        try:
            pods = await self.replica.cluster.pods(node=node or None)
        except Exception as exc:
            log.warning("cluster unreadable; the holder is taken to run", extra={"pod": pod, "error": str(exc)})
            return True
        return any(p.name == pod and p.phase == "Running" for p in pods)

    async def _listed(self, pod: str, node: str) -> bool:
        """Whether the cluster still lists ``pod`` in any phase (a terminating pod may still be saving): what a
        prefetch asks before it takes a session. When the cluster cannot say, the pod is taken to be listed."""
        try:
            pods = await self.replica.cluster.pods(node=node or None)
        except Exception as exc:
            log.warning("cluster unreadable; the holder is taken to be listed", extra={"pod": pod, "error": str(exc)})
            return True
        return any(p.name == pod for p in pods)

    async def _candidates(self, session_id: str) -> RestoreCandidates:
        """What a restore of the session may use. The store is the last word on what was committed (Redis
        replicates asynchronously: a failover loses its last writes), so every checkpoint of the session the
        store holds is a candidate, with those the registry recorded. One the registry lacks that is newer than
        all it recorded is verified (its manifest) and recorded again; one the registry recorded whose manifest
        the store no longer has is forgotten (and still offered, so that the restore says it passed over it). The
        floor for the next generation is the newest generation of any of them. When the store cannot be listed,
        the registry's stand alone.

        Costs one listing of the session in the store (a per-session index in every store), plus one manifest
        read per checkpoint the two disagree on (none while they agree)."""
        store = self.replica.store
        registry = self.replica.registry
        found = await registry.checkpoints(session_id, RESTORE_CANDIDATES)
        recorded = {str(r["checkpoint_id"]): r for r in found}
        try:
            stored = await store.checkpoints(session_id)
        except StoreError as exc:
            log.warning(
                "store not listed; restore candidates from the registry alone",
                extra={"session": session_id, "error": str(exc)},
            )
            ids = newest_first(list(recorded))
            first = recorded.get(ids[0], {}) if ids else {}
            return RestoreCandidates(
                ids,
                max((checkpoint_order(c)[0] for c in ids), default=0),
                [],
                int(first.get("bytes_total", 0)),
                listed=False,
            )
        listed = set(stored)
        gone = set()
        for cid in [c for c in recorded if c not in listed]:
            try:
                await store.manifest(session_id, cid)
            except CheckpointNotFound:
                await registry.forget_checkpoint(session_id, cid)
                gone.add(cid)
                log.warning(
                    "recorded checkpoint gone from the store; forgotten",
                    extra={"session": session_id, "checkpoint": cid},
                )
            except StoreError:
                pass  # there but unreadable: the restore passes over it and says why
        newest = max((checkpoint_order(c) for c in recorded if c not in gone), default=None)
        bytes_total = {cid: int(r.get("bytes_total", 0)) for cid, r in recorded.items()}
        verified = []
        for cid in stored[:RESTORE_CANDIDATES]:
            if cid in recorded or (newest is not None and checkpoint_order(cid) < newest):
                continue
            try:
                manifest = await store.manifest(session_id, cid)
            except StoreError as exc:  # still a candidate: the restore passes over it and says why
                log.warning("unrecorded checkpoint unreadable", extra={"session": session_id, "error": str(exc)})
                continue
            verified.append(manifest)
            bytes_total[cid] = manifest.bytes_total
        from_store: list[str] = []
        verified = await self._whole(verified)
        if verified:
            repaired = await registry.repair_checkpoints(session_id, verified, store.url)
            if repaired.fenced:  # stale saves whose files are not deleted yet: never a restore's candidates
                listed.difference_update(repaired.fenced)
                self.replica.metrics.refused.labels("repair").inc(len(repaired.fenced))
                log.warning(
                    "stale saves not deleted yet (another pod's of the holder's generation, or an older generation's"
                    " after the current one's seal): passed over",
                    extra={"session": session_id, "checkpoints": repaired.fenced},
                )
            from_store = [m.checkpoint_id for m in verified if m.checkpoint_id not in repaired.fenced]
            if from_store:
                self.replica.metrics.repaired.inc(len(from_store))
                log.warning(
                    "the registry lacked the newest checkpoints of a session: taken from the store and recorded again",
                    extra={"session": session_id, "checkpoints": from_store, "newest_recorded": newest and newest[2]},
                )
        ids = newest_first(list(listed | set(recorded)))
        floor = max((checkpoint_order(c)[0] for c in ids), default=0)
        ids = ids[:RESTORE_CANDIDATES]
        return RestoreCandidates(ids, floor, from_store, bytes_total.get(ids[0], 0) if ids else 0)

    async def _whole(self, manifests: list[CheckpointManifest]) -> list[CheckpointManifest]:
        """Of the checkpoints only the store knows, those whose packs are all there and long enough (one look at
        their packs): one the scrub forgot because a pack of it was lost is not recorded again (it stays a
        candidate, which the restore passes over and says why). All of them when the packs cannot be looked at."""
        if not manifests:
            return manifests
        try:
            sizes = await self.replica.store.pack_sizes({ref.pack for m in manifests for ref in m.blocks})
        except StoreError as exc:
            log.warning("packs of unrecorded checkpoints not looked at", extra={"error": str(exc)})
            return manifests
        return [m for m in manifests if not lost_pack(m, sizes)]

    async def on_restored(self, event: SessionRestored) -> SessionRestored:
        """Idempotent: a repeated report publishes ``checkpoint.restored`` again (deduplicated by its event id)
        but no second location; a report of a pod that no longer holds the generation publishes no location."""
        metrics = self.replica.metrics
        if event.fell_back_from:
            metrics.fallbacks.inc(len(event.fell_back_from))
            log.warning(
                "restore passed over newer checkpoints",
                extra={"session": event.session_id, "used": event.checkpoint_id, "why": event.fell_back_from},
            )
        metrics.restores.inc()
        if event.tokens_recomputed:
            metrics.tokens_recomputed.inc(event.tokens_recomputed)
        await self.replica.ctx.publish(event)
        location = await self.replica.registry.note_restored(
            event.session_id, event.pod, event.generation, event.checkpoint_id
        )
        if location is not None:
            await self.replica.publish_locations([location])
        return event
