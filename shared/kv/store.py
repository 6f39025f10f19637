"""The checkpoint store port: packs of chunk bytes, and manifests that commit them.

A save writes the blocks that are new into one pack (large sequential writes, one durability barrier), then
commits one manifest per session. Readers only ever follow manifests, so a pack without a manifest is garbage
to be collected, never a half-visible checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.contract.base import id_problem
from shared.kv.manifest import CheckpointManifest, ChunkRef, ManifestInvalid, decode_manifest, verify_manifest


class StoreError(RuntimeError):
    """The store failed (disk full, write error, server gone). The message says which operation and why."""


class CheckpointNotFound(StoreError):
    pass


class InvalidId(CheckpointNotFound):
    """An id that no store path or object name is ever built from (``shared.contract.base.ID_RULES``): nothing
    by that name can be in the store."""


def checked_ids(session_id: str, checkpoint_id: str | None = None) -> None:
    """Raise ``InvalidId`` unless the session id (and checkpoint id) follow the contract's rules: every store
    checks here before it builds a path or an object name from them."""
    problem = id_problem("session", session_id)
    if not problem and checkpoint_id is not None:
        problem = id_problem("checkpoint", checkpoint_id)
    if problem:
        raise InvalidId(problem)


def checked_pack(pack_id: str) -> str:
    problem = id_problem("checkpoint", pack_id)
    if problem:
        raise InvalidId(problem.replace("checkpoint id", "pack id", 1))
    return pack_id


class ManifestCorrupt(StoreError):
    """A manifest that cannot be decoded or does not verify (its own digest, session or id): the checkpoint it
    would commit is unusable; a restore falls back over it."""


def load_manifest(data: bytes, session_id: str, checkpoint_id: str) -> CheckpointManifest:
    """Decode and verify the manifest a store holds for (session, checkpoint): every store reads through here."""
    try:
        manifest = decode_manifest(data)
    except Exception as exc:
        raise ManifestCorrupt(f"checkpoint {checkpoint_id}: manifest unreadable: {exc}") from exc
    try:
        verify_manifest(manifest, session_id, checkpoint_id)
    except ManifestInvalid as exc:
        raise ManifestCorrupt(str(exc)) from exc
    return manifest


class ChunkCorrupt(StoreError):
    """A chunk's bytes do not match its digest (bit flip, truncation) or cannot be decrypted."""

    def __init__(self, checkpoint_id: str, index: int, detail: str) -> None:
        super().__init__(f"checkpoint {checkpoint_id}: block {index} is corrupt: {detail}")
        self.checkpoint_id = checkpoint_id
        self.index = index


@dataclass(frozen=True, slots=True)
class PackInfo:
    pack_id: str
    size: int
    modified: float


class PackWriter(Protocol):
    pack_id: str

    async def append(self, chunks: Sequence[memoryview]) -> list[int]:
        """Append chunks in order; returns each one's offset in the pack."""
        ...

    async def commit(self) -> None:
        """Make every appended byte durable and the pack readable under ``pack_id``."""
        ...

    async def abort(self) -> None: ...


class CheckpointStore(Protocol):
    url: str

    def open_pack(self) -> PackWriter: ...

    async def commit_manifest(self, manifest: CheckpointManifest) -> None:
        """Durably and atomically make the checkpoint visible; after this it restores."""
        ...

    async def commit_manifests(self, manifests: Sequence[CheckpointManifest]) -> None:
        """``commit_manifest`` for many, at the cost of about one; each stays atomic on its own. On error some
        may be committed and others not: the caller reports all of them failed, which is conservative."""
        ...

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest: ...

    async def checkpoints(self, session_id: str) -> list[str]:
        """Checkpoint ids of a session whose manifests are in the store, newest (generation, sequence) first."""
        ...

    async def sessions(self) -> list[str]: ...

    async def read_chunks(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        """Read each chunk's stored bytes into its target (``len(target) == ref.length``). Raises
        ``ChunkCorrupt``-free ``StoreError`` when bytes are missing; digest checks are the caller's."""
        ...

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None: ...

    async def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]:
        """The stored size of each of these packs that exists (absent ones are left out); costs what it names."""
        ...

    async def manifests_present(self, checkpoints: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """Those of these (session id, checkpoint id) whose manifest the store holds (an invalid id names
        nothing); costs what it names, like ``pack_sizes``: the agent asks once per save round whether the
        checkpoints its sessions build on are still there."""
        ...

    async def packs(self) -> list[PackInfo]: ...

    async def delete_pack(self, pack_id: str) -> None: ...

    async def sweep_orphans(self, grace_s: float) -> int:
        """Delete what a killed or failed writer left behind (temporary files, chunks of aborted packs) once it is
        older than ``grace_s``; returns how many objects went."""
        ...

    async def close(self) -> None: ...
