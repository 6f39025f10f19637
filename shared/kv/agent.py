"""The KV agent: the inference server's sessions, saved to a checkpoint store and restored byte for byte.

Usage, inside an inference server::

    agent = KvAgent(store, pod="llama-7", node="node-1", namespace="llm", deployment="llama", layout=layout)
    agent.register_session("s-42")
    agent.append_block("s-42", block_tensor)      # as the session grows; full blocks never change again
    agent.set_tokens("s-42", 4096)
    report = await agent.save(["s-42"], deadline_s=20)
    restored = await agent.restore("s-42", into=preallocated_blocks)

Invariants the agent relies on, as paged-attention engines guarantee them: a full block is immutable; only the
session's last block may still change, so the agent copies that one before hashing it.

Ownership: each session carries the generation its pod took when it started or restored it (from the checkpoint
service). A save names the generation it expects; a session this pod holds under another generation is refused,
never written, so a pod that lost a session can never roll it back. Incremental saves reuse only blocks of a
checkpoint this agent wrote or verified itself, and never a chunk it found corrupt or one the store no longer
holds: each save round asks the store once whether the checkpoints and packs it would build on are still there
(``_still_stored``), and writes again the blocks of any that are gone or cut short. Bytes go from the
engine's memory to the store directly (through a reused pinned staging buffer for GPU memory); the checkpoint
service only decides, orders and records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from shared.kv.buffers import Block, Staging, as_block
from shared.kv.crypto import ChunkCipher
from shared.kv.manifest import (
    CheckpointManifest,
    ChunkRef,
    KvLayout,
    check_compatible,
    checkpoint_order,
    digest,
    new_checkpoint_id,
    seal_manifest,
)
from shared.kv.reading import read_verified
from shared.kv.session import Session, full_count, full_prefix, prefix_due, unchanged
from shared.kv.store import CheckpointNotFound, CheckpointStore, ChunkCorrupt, StoreError

log = logging.getLogger(__name__)

ROUND_BYTES = 256 * 1024 * 1024  # commit a pack and its sessions' manifests at least this often
BATCH_BYTES = 64 * 1024 * 1024  # bytes handed to the store per write call


class SessionUnknown(KeyError):
    pass


class DeadlineExceeded(TimeoutError):
    pass


@dataclass(frozen=True)
class SaveFailure:
    session_id: str
    reason: str


@dataclass
class SaveReport:
    """``not_held``: sessions asked for by generation that this pod does not hold (ended, or preempted: it has no
    KV of them to save)."""

    committed: list[CheckpointManifest] = field(default_factory=list)
    failed: list[SaveFailure] = field(default_factory=list)
    not_held: list[str] = field(default_factory=list)
    unchanged: int = 0
    """Sessions a ``changed_only`` save passed over: their last checkpoint holds them as they are."""
    kept: list[CheckpointManifest] = field(default_factory=list)
    """The last checkpoint of each session a ``changed_only`` save passed over (``unchanged`` of them): what holds
    it, for a caller that has it confirmed as recorded rather than written again (the pod's last save)."""

    @property
    def bytes_total(self) -> int:
        return sum(m.bytes_total for m in self.committed)

    @property
    def bytes_written(self) -> int:
        return sum(m.bytes_written for m in self.committed)


@dataclass
class RestoredSession:
    """``fell_back_from``: each newer checkpoint that was passed over, as ``"<checkpoint id>: <why>"``."""

    manifest: CheckpointManifest
    blocks: list[Any]
    fell_back_from: list[str] = field(default_factory=list)
    node_blocks: int = 0
    """Full blocks the node tier's journal added after the checkpoint (``shared.kv.nodetier``)."""
    node_tokens: int = 0
    """The positions the session holds with them (0 when none were added)."""

    @property
    def tokens(self) -> int:
        """The positions the restored KV holds: the checkpoint's, or more with blocks from the node tier."""
        return self.node_tokens if self.node_blocks else self.manifest.token_count


class KvAgent:
    """Owns nothing but references: the engine keeps its memory; the agent keeps the list of blocks."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        pod: str,
        node: str,
        namespace: str,
        deployment: str,
        layout: KvLayout,
        cipher: ChunkCipher | None = None,
        staging_bytes: int = BATCH_BYTES,
    ) -> None:
        self.store = store
        self.pod = pod
        self.node = node
        self.namespace = namespace
        self.deployment = deployment
        self.layout = layout
        """The layout new sessions start on: the model version the pod serves now."""
        self.layouts: dict[str, KvLayout] = {layout.model_version: layout}
        """Every model version the pod holds ready, by version (the serving one, one being prepared, one that
        sessions pinned to it still run on)."""
        self.cipher = cipher
        self._sessions: dict[str, Session] = {}
        self._staging_bytes = staging_bytes
        self._staging: Staging | None = None
        self._save_lock = asyncio.Lock()
        self._corrupt: set[tuple[str, int]] = set()  # (pack, offset) of chunks found corrupt: never referenced
        self._lost: dict[str, int] = {}
        """Packs the store lost (-> 0) or holds cut short (-> the bytes left), as a save round found them: a chunk
        past that is never referenced again; its block is written again. One entry per damaged pack."""
        self._bytes = 0
        self._changes: dict[str, int | None] | None = None
        self._grown: set[str] | None = None

    # -- what changed, for announcements ------------------------------------------------------------------------
    def track_changes(self) -> None:
        """Keep a journal of sessions taken (with their generation) and dropped, for ``take_changes``: what the
        pod's announcements carry instead of every session it holds. Off until asked for (a library use without
        announcements keeps no journal)."""
        if self._changes is None:
            self._changes = {}

    def take_changes(self) -> dict[str, int | None]:
        """Sessions taken (-> the generation held now) or dropped (-> None) since the last call; empties the
        journal."""
        changes, self._changes = self._changes or {}, {} if self._changes is not None else None
        return changes

    def track_growth(self) -> None:
        """Keep the set of sessions whose tokens changed, for ``take_grown``: what the journal looks at instead of
        every session the pod holds. Off until asked for."""
        if self._grown is None:
            self._grown = set()

    def take_grown(self) -> set[str]:
        """Sessions whose tokens changed since the last call (some may hold a newly full block); empties the set."""
        grown, self._grown = self._grown or set(), set() if self._grown is not None else None
        return grown

    def _grew(self, session_id: str) -> None:
        if self._grown is not None:
            self._grown.add(session_id)

    def _changed(self, session_id: str, generation: int | None) -> None:
        if self._changes is not None:
            self._changes[session_id] = generation

    @property
    def bytes_held(self) -> int:
        """Bytes of every session's blocks, kept as blocks come and go."""
        return self._bytes

    # -- what the engine calls ----------------------------------------------------------------------------------
    def register_session(
        self, session_id: str, token_count: int = 0, generation: int = 0, layout: KvLayout | None = None
    ) -> None:
        """A new session (or nothing, when it is already held). ``generation``: the one the checkpoint service
        gave this pod for it (``AgentEndpoint.start_session``); 0 where no service fences ownership. ``layout``:
        the model version it runs on (default: the one the pod serves now); it stays pinned to it."""
        if layout is not None and layout.model_version not in self.layouts:
            raise ValueError(f"pod {self.pod} does not hold model version {layout.model_version!r}")
        if session_id not in self._sessions:
            self._sessions[session_id] = Session(
                session_id, token_count=token_count, generation=generation, layout=layout or self.layout
            )
            self._changed(session_id, generation)

    # -- model versions -------------------------------------------------------------------------------------------
    def hold(self, layout: KvLayout) -> None:
        """The pod holds ``layout``'s model version ready (its weights loaded): sessions may run on it."""
        self.layouts[layout.model_version] = layout

    def serve(self, version: str) -> bool:
        """New sessions start on ``version`` from now on (it must be held). Says whether that changed anything;
        sessions already held stay on the version that built their KV."""
        if version not in self.layouts:
            raise ValueError(f"pod {self.pod} does not hold model version {version!r}")
        changed = self.layout.model_version != version
        self.layout = self.layouts[version]
        return changed

    def release(self, version: str) -> bool:
        """Drop a version that is neither served nor holding a session. Says whether it was dropped."""
        if version == self.layout.model_version or self.sessions_on(version):
            return False
        return self.layouts.pop(version, None) is not None

    def session_layout(self, session_id: str) -> KvLayout:
        return self._layout_of(self._session(session_id))

    def sessions_on(self, version: str) -> list[str]:
        return [s.session_id for s in self._sessions.values() if self._layout_of(s).model_version == version]

    def _layout_of(self, session: Session) -> KvLayout:
        return session.layout or self.layout

    def generation(self, session_id: str) -> int:
        return self._session(session_id).generation

    def append_block(self, session_id: str, buffer: Any, tokens: int | None = None) -> None:
        session = self._session(session_id)
        block = as_block(buffer)
        session.blocks.append(block)
        session.nbytes += block.nbytes
        self._bytes += block.nbytes
        session.version += 1
        session.token_count = (
            tokens if tokens is not None else session.token_count + self._layout_of(session).block_tokens
        )
        session.tokens_digest = ""  # of other tokens now; the engine says again with set_tokens
        self._grew(session_id)

    def update_block(self, session_id: str, index: int, buffer: Any = None) -> None:
        """Block ``index`` changed in place (or is now ``buffer``): the next save reads and hashes it again.

        Paged-attention engines never change a full block, so the agent remembers each full block's digest once
        it is checkpointed and does not read it again; an engine that does rewrite blocks says so here."""
        session = self._session(session_id)
        blocks = session.blocks
        old = blocks[index]
        blocks[index] = as_block(buffer) if buffer is not None else Block(old.obj, old.nbytes, old.host, old.device)
        session.nbytes += blocks[index].nbytes - old.nbytes
        self._bytes += blocks[index].nbytes - old.nbytes
        session.version += 1

    def set_tokens(self, session_id: str, token_count: int, tokens_digest: str = "") -> None:
        """The session's KV holds ``token_count`` positions; ``tokens_digest``: ``tokens_digest_of`` their token ids,
        when the engine knows them (its checkpoints then carry it, and a restore into another conversation can be
        refused without reading a block)."""
        session = self._session(session_id)
        if (session.token_count, session.tokens_digest) != (token_count, tokens_digest):
            session.version += 1
            self._grew(session_id)
        session.token_count = token_count
        session.tokens_digest = tokens_digest

    def truncate(self, session_id: str, block_count: int) -> None:
        """Keep only the session's first ``block_count`` blocks (the conversation was rewritten from there on): the
        token count drops to what they hold. The next save writes the session as it now is."""
        session = self._session(session_id)
        removed = sum(b.nbytes for b in session.blocks[max(0, block_count) :])
        session.nbytes -= removed
        self._bytes -= removed
        session.version += 1
        del session.blocks[max(0, block_count) :]
        session.token_count = min(session.token_count, max(0, block_count) * self._layout_of(session).block_tokens)
        session.tokens_digest = ""

    def forget_session(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._bytes -= session.nbytes
            self._changed(session_id, None)

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def tokens(self, session_id: str) -> int:
        return self._session(session_id).token_count

    def session_tokens_digest(self, session_id: str) -> str:
        """The digest of the session's tokens the engine gave with ``set_tokens`` ('' when it gave none)."""
        return self._session(session_id).tokens_digest

    def blocks(self, session_id: str) -> list[Any]:
        """The engine's own block objects, in order."""
        return [b.obj for b in self._session(session_id).blocks]

    def session_bytes(self, session_id: str) -> int:
        return self._session(session_id).nbytes

    def _session(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionUnknown(f"session {session_id!r} is not registered on pod {self.pod}") from None

    # -- save -----------------------------------------------------------------------------------------------------
    async def save(
        self,
        session_ids: Sequence[str] | None = None,
        deadline_s: float | None = None,
        reason: str = "",
        progress: Callable[[SaveReport, int], Awaitable[None]] | None = None,
        generations: Mapping[str, int] | None = None,
        changed_only: bool = False,
        rewrite: Iterable[str] = (),
        full_blocks_only: bool = False,
    ) -> SaveReport:
        """Checkpoint the sessions (all when None). Each session ends committed or failed with a reason; a
        session that fails never leaves a visible partial checkpoint, and its previous checkpoint still
        restores. Incremental: blocks whose digest the session's last checkpoint already holds are referenced,
        not written again.

        ``generations``: the generation the caller expects this pod to hold for each session; a session held
        under another generation is refused (it moved: saving it would roll it back) and nothing of it is
        written.

        ``changed_only``: a session whose last checkpoint (written or verified here, under the generation it is
        held under) holds it as it is now writes nothing (periodic saves, the pod's last save): counted in
        ``unchanged``, its last checkpoint named in ``kept``.

        ``progress`` hears the report after each committed round and at the end, once per state, with the number of
        sessions the save ends committed or failed (the report's ``committed`` plus ``failed`` reach it last).

        ``rewrite``: sessions (of those saved) that write every block again, referencing nothing of an earlier
        checkpoint, and are saved even when ``changed_only`` finds them unchanged: the checkpoint service found a
        pack their last checkpoint references lost or damaged (``SaveSessions.rewrite``). Without it a save
        still writes again what the store lost (``_still_stored``); this covers what only a read finds (rot).

        ``full_blocks_only`` (the journal, ``shared.kv.journal``): each session's checkpoint holds only its full
        blocks (immutable: never written twice), a prefix of the session; a session is saved only when that
        prefix holds more tokens than its last checkpoint (so a journal entry never holds less than what came
        before it, under the same generation), and is otherwise passed over without a word (not ``unchanged``)."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        rewritten = set(rewrite)
        async with self._save_lock:
            report = SaveReport()
            todo: list[Session] = []
            for sid in session_ids if session_ids is not None else list(self._sessions):
                session = self._sessions.get(sid)
                expected = None if generations is None else generations.get(sid)
                if session is None and expected is not None:
                    report.not_held.append(sid)
                elif session is None:
                    report.failed.append(SaveFailure(sid, f"not registered on pod {self.pod}"))
                elif expected is not None and expected != session.generation:
                    report.failed.append(
                        SaveFailure(
                            sid,
                            f"refused: pod {self.pod} holds generation {session.generation} of the session, the "
                            f"current one is {expected}; a stale copy is never saved",
                        )
                    )
                elif full_blocks_only and not prefix_due(session, self._layout_of(session)):
                    continue
                elif changed_only and sid not in rewritten and unchanged(session):
                    assert session.last is not None  # _unchanged says so
                    report.unchanged += 1
                    report.kept.append(session.last)
                else:
                    todo.append(session)
            total = len(todo) + len(report.failed)  # every session of the save ends committed or failed
            round_: list[Session] = []
            round_bytes = 0
            for session in todo:
                round_.append(session)
                round_bytes += session.nbytes
                if round_bytes >= ROUND_BYTES:
                    await self._save_round(round_, deadline, reason, report, rewritten, full_blocks_only)
                    round_, round_bytes = [], 0
                    if progress is not None:
                        await progress(report, total)
            if round_:
                await self._save_round(round_, deadline, reason, report, rewritten, full_blocks_only)
            if progress is not None and (round_ or not todo):  # the end, unless the last round was just heard
                await progress(report, total)
            return report

    def _staging_for(self, nbytes: int) -> Staging:
        if self._staging is None or self._staging.nbytes < nbytes:
            self._staging = Staging(max(nbytes, self._staging_bytes))
        return self._staging

    def _reusable(self, session: Session) -> dict[str, ChunkRef]:
        """Chunks a save may reference instead of writing: those of the checkpoint this agent last wrote or
        verified for the session, less any it found corrupt since and any the store lost (``_lost``)."""
        if session.last is None:
            return {}
        return {ref.digest: ref for ref in session.last.blocks if self._usable(ref)}

    def _usable(self, ref: ChunkRef) -> bool:
        if (ref.pack, ref.offset) in self._corrupt:
            return False
        left = self._lost.get(ref.pack)
        return left is None or ref.offset + ref.length <= left

    async def _still_stored(self, sessions: Sequence[Session], rewrite: set[str]) -> dict[str, dict[str, ChunkRef]]:
        """What each session of a round may reference (``_reusable``), once the store says the checkpoints they
        build on are still there: a session whose last manifest is gone references nothing of it (retention marks
        packs through manifests, so its packs may go at any time), and a pack that is gone or shorter than a
        chunk it should hold is remembered in ``_lost``, its blocks written again. Sessions in ``rewrite``
        reference nothing.

        Costs two store calls per round whatever it holds, one ``manifests_present`` for the sessions and one
        ``pack_sizes`` for the distinct packs their last checkpoints reference (a stat or a meta read each, the
        same the checkpoint service pays to verify the round's report), never one per block; packs already known
        lost are not asked about again. A round of unchanged sessions under ``changed_only`` never gets here."""
        bases = {s.session_id: s.last for s in sessions if s.last is not None and s.session_id not in rewrite}
        if not bases:
            return {}
        present = await self.store.manifests_present((sid, m.checkpoint_id) for sid, m in bases.items())
        gone = [m.checkpoint_id for sid, m in bases.items() if (sid, m.checkpoint_id) not in present]
        bases = {sid: m for sid, m in bases.items() if (sid, m.checkpoint_id) in present}
        packs = {ref.pack for m in bases.values() for ref in m.blocks if self._usable(ref)}
        sizes = await self.store.pack_sizes(packs) if packs else {}
        lost: dict[str, int] = {}
        for m in bases.values():
            for ref in m.blocks:
                if ref.pack in packs and self._usable(ref) and ref.offset + ref.length > sizes.get(ref.pack, 0):
                    lost[ref.pack] = sizes.get(ref.pack, 0)
        self._lost.update(lost)
        if gone or lost:
            log.warning(
                "the store lost what saves built on; those blocks are written again",
                extra={"pod": self.pod, "checkpoints": gone[:20], "packs": sorted(lost)[:20], "lost": len(lost)},
            )
        by_id = {s.session_id: s for s in sessions}
        return {sid: self._reusable(by_id[sid]) for sid in bases}

    async def _save_round(
        self,
        sessions: list[Session],
        deadline: float | None,
        reason: str,
        report: SaveReport,
        rewrite: set[str],
        full_blocks_only: bool = False,
    ) -> None:
        writer = self.store.open_pack()
        pending: list[tuple[Session, list[ChunkRef | None], int, int, str, int]] = []
        digested: list[tuple[Block, str]] = []  # full blocks hashed in this round: remembered once committed
        batch: list[memoryview] = []
        batch_slots: list[tuple[list[ChunkRef | None], int, str, int, bytes]] = []
        batch_bytes = 0

        async def flush() -> None:
            nonlocal batch, batch_slots, batch_bytes
            if not batch:
                return
            offsets = await writer.append(batch)
            for (slots, index, dg, size, nonce), offset, data in zip(batch_slots, offsets, batch, strict=True):
                slots[index] = ChunkRef(
                    digest=dg, size=size, pack=writer.pack_id, offset=offset, length=len(data), nonce=nonce
                )
            batch, batch_slots, batch_bytes = [], [], 0

        try:
            reusable = await self._still_stored(sessions, rewrite)
            for session in sessions:
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded("deadline passed before the session was written")
                known = reusable.get(session.session_id, {})
                blocks = list(session.blocks)
                token_count, digest_of_tokens, version = session.token_count, session.tokens_digest, session.version
                block_tokens = self._layout_of(session).block_tokens
                full_blocks = token_count // block_tokens if block_tokens else len(blocks)
                if full_blocks_only:
                    blocks, token_count, digest_of_tokens, version = full_prefix(session, block_tokens)
                slots: list[ChunkRef | None] = [None] * len(blocks)
                written = 0
                todo: list[int] = []
                for i, block in enumerate(blocks):
                    known_ref = known.get(block.digest) if i < full_blocks and block.digest else None
                    if known_ref is not None and known_ref.size == block.nbytes:
                        slots[i] = known_ref  # a full block already checkpointed: not read, not hashed again
                    else:
                        todo.append(i)
                views = await self._host_views([blocks[i] for i in todo])
                for i, view in zip(todo, views, strict=True):
                    block = blocks[i]
                    if i >= full_blocks or block.on_device:
                        view = memoryview(bytes(view))  # may still change, or sits in reused staging
                    dg = digest(view)
                    if i < full_blocks:
                        digested.append((block, dg))
                    ref = known.get(dg)
                    if ref is not None and ref.size == len(view):
                        slots[i] = ref
                        continue
                    nonce = b""
                    data = view
                    if self.cipher is not None:
                        nonce, sealed = self.cipher.seal(view, dg)
                        data = memoryview(sealed)
                    batch.append(data)
                    batch_slots.append((slots, i, dg, len(view), nonce))
                    batch_bytes += len(data)
                    written += len(data)
                    if batch_bytes >= BATCH_BYTES:
                        await flush()
                        if deadline is not None and time.monotonic() > deadline:
                            raise DeadlineExceeded("deadline passed while writing")
                pending.append((session, slots, written, token_count, digest_of_tokens, version))
            await flush()
            await writer.commit()
        except (StoreError, DeadlineExceeded, OSError) as exc:
            await writer.abort()
            why = f"deadline exceeded: {exc}" if isinstance(exc, DeadlineExceeded) else str(exc)
            for session in sessions:
                report.failed.append(SaveFailure(session.session_id, why))
            log.warning("checkpoint round failed", extra={"sessions": len(sessions), "error": why})
            return
        now = datetime.now(UTC)
        for session, *_ in pending:
            session.sequence += 1
        manifests = [
            seal_manifest(
                CheckpointManifest(
                    checkpoint_id=new_checkpoint_id(session.generation, session.sequence),
                    session_id=session.session_id,
                    namespace=self.namespace,
                    deployment=self.deployment,
                    pod=self.pod,
                    node=self.node,
                    layout=self._layout_of(session),
                    token_count=token_count,
                    blocks=[s for s in slots if s is not None],
                    created_at=now,
                    parent_id=session.last.checkpoint_id if session.last else "",
                    key_id=self.cipher.key_id if self.cipher else "",
                    bytes_written=written,
                    reason=reason,
                    generation=session.generation,
                    sequence=session.sequence,
                    tokens_digest=digest_of_tokens,
                )
            )
            for session, slots, written, token_count, digest_of_tokens, _ in pending
        ]
        try:
            await self.store.commit_manifests(manifests)
        except StoreError as exc:
            report.failed += [SaveFailure(m.session_id, str(exc)) for m in manifests]
            return
        for (session, *_, version), manifest in zip(pending, manifests, strict=True):
            session.last = manifest
            if version >= 0:  # a prefix (``full_blocks_only``) holds the session as it is only when it is all of it
                session.saved_version = version
            report.committed.append(manifest)
        for block, dg in digested:
            block.digest = dg

    async def full_blocks_from(self, session_id: str, start: int) -> tuple[int, list[tuple[memoryview, str]]]:
        """The session's full blocks from index ``start`` on, in host memory with their digests (each hashed once;
        a full block never changes again), and the generation they are held under: what the journal's node tier
        logs. Copied out of device memory through the agent's staging, under the save lock."""
        async with self._save_lock:
            session = self._session(session_id)
            full = full_count(session, self._layout_of(session).block_tokens)
            blocks = session.blocks[start:full]
            if not blocks:
                return session.generation, []
            views = await self._host_views(blocks)
            out: list[tuple[memoryview, str]] = []
            for block, view in zip(blocks, views, strict=True):
                if block.on_device:
                    view = memoryview(bytes(view))  # the staging is reused by the next copy
                if not block.digest:
                    block.digest = digest(view)
                out.append((view, block.digest))
            return session.generation, out

    def last_checkpoint(self, session_id: str) -> CheckpointManifest | None:
        """The checkpoint this agent last wrote or restored of the session (None when none, or not held)."""
        session = self._sessions.get(session_id)
        return session.last if session is not None else None

    def continue_with(self, session_id: str, keep: int, tail: Sequence[Any]) -> int:
        """After a restore: keep the session's first ``keep`` blocks and append ``tail`` (full blocks a node log
        held, verified), each full. The session's last checkpoint stays what it was restored from (the shared
        store's), so the next save writes the tail's blocks to the store. Returns the tokens held now."""
        session = self._session(session_id)
        block_tokens = self._layout_of(session).block_tokens
        self.truncate(session_id, keep)
        for block in tail:
            self.append_block(session_id, block, tokens=session.token_count + block_tokens)
        return session.token_count

    async def _host_views(self, blocks: list[Block]) -> list[memoryview]:
        device = [b for b in blocks if b.on_device]
        if not device:
            return [b.host for b in blocks if b.host is not None]
        staging = self._staging_for(sum(b.nbytes for b in device))
        copied = iter(await asyncio.to_thread(staging.device_to_host, device))
        return [next(copied) if b.on_device else b.host for b in blocks]  # type: ignore[misc]

    # -- restore --------------------------------------------------------------------------------------------------
    async def restore(
        self,
        session_id: str,
        checkpoint_id: str | None = None,
        into: Sequence[Any] | None = None,
        fall_back: bool = True,
        candidates: Sequence[str] | None = None,
        generation: int = 0,
    ) -> RestoredSession:
        """Restore a session's newest good checkpoint, verifying the manifest and every chunk digest.

        Which checkpoints: ``candidates`` (newest first, as the checkpoint service recorded them), else
        ``checkpoint_id`` and the older ones in the store, else every one in the store, newest (generation,
        sequence) first. A missing, unreadable, corrupt or mis-named checkpoint is passed over for the next one
        when ``fall_back`` (the result says which and why); a checkpoint for another model, version, tokenizer,
        dtype or layout is refused outright, never skipped.

        ``into``: the engine's own preallocated blocks to fill in place (host or device); otherwise new host
        arrays are returned. The session is then held by this agent under ``generation``."""
        if candidates is not None:
            ids = list(candidates)
        else:
            ids = await self.store.checkpoints(session_id)
            if checkpoint_id:
                older = [i for i in ids if checkpoint_order(i) < checkpoint_order(checkpoint_id)]
                ids = [checkpoint_id, *older] if fall_back else [checkpoint_id]
        if not ids:
            raise CheckpointNotFound(f"session {session_id!r} has no committed checkpoint")
        failures: list[str] = []
        only_missing = True
        for cid in ids:
            manifest: CheckpointManifest | None = None
            try:
                manifest = await self.store.manifest(session_id, cid)
                # a session restores only into the model version that built it, if this pod holds it
                held = self.layouts.get(manifest.layout.model_version, self.layout)
                check_compatible(manifest, held)
                blocks = await read_verified(self.store, self.cipher, manifest, into, self._staging_for)
            except StoreError as exc:
                if isinstance(exc, ChunkCorrupt) and manifest is not None and 0 <= exc.index < len(manifest.blocks):
                    ref = manifest.blocks[exc.index]
                    self._corrupt.add((ref.pack, ref.offset))
                only_missing = only_missing and type(exc) is CheckpointNotFound
                log.warning(
                    "checkpoint unusable; trying an older one", extra={"session": session_id, "error": str(exc)}
                )
                failures.append(f"{cid}: {exc}")
                if not fall_back:
                    raise
                continue
            restored_blocks = [as_block(b) for b in blocks]
            for block, ref in zip(restored_blocks, manifest.blocks, strict=True):
                block.digest = ref.digest  # verified just now
            previous = self._sessions.get(session_id)
            nbytes = sum(b.nbytes for b in restored_blocks)
            self._bytes += nbytes - (previous.nbytes if previous is not None else 0)
            self._sessions[session_id] = Session(
                session_id,
                restored_blocks,
                manifest.token_count,
                manifest,
                generation=generation,
                layout=held,
                tokens_digest=manifest.tokens_digest,
                saved_version=0,
                nbytes=nbytes,
            )
            self._changed(session_id, generation)
            return RestoredSession(manifest, blocks, failures)
        summary = f"no usable checkpoint of session {session_id!r}: " + " | ".join(failures)
        if only_missing:
            raise CheckpointNotFound(summary)
        raise ChunkCorrupt(ids[-1], -1, summary)
