"""The filesystem / PersistentVolume store (``file:///path``).

Layout under the root::

    packs/<pack_id>.pack                         chunk bytes, appended sequentially
    sessions/<session_id>/<checkpoint_id>.json   one manifest per committed checkpoint

Every file is written under a temporary name, fsynced, renamed into place, and its directory fsynced, so a crash
at any point leaves either the old state or the new one. Packs are committed before the manifests that reference
them; a manifest is the last thing written.
"""

from __future__ import annotations

import asyncio
import errno
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from shared.kv.manifest import CheckpointManifest, ChunkRef, decode_manifest, encode_manifest
from shared.kv.store import CheckpointNotFound, PackInfo, StoreError

_IOV_MAX = 512


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _io_error(what: str, exc: OSError) -> StoreError:
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return StoreError(f"{what}: {reason}")


class FilePackWriter:
    def __init__(self, store: FileStore) -> None:
        self.store = store
        self.pack_id = uuid.uuid4().hex
        self.final = store.packs_dir / f"{self.pack_id}.pack"
        self.temp = store.packs_dir / f".tmp-{self.pack_id}.pack"
        self.fd: int | None = None
        self.size = 0

    def _append(self, chunks: Sequence[memoryview]) -> list[int]:
        if self.fd is None:
            self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        offsets = []
        for chunk in chunks:
            offsets.append(self.size)
            self.size += len(chunk)
        for start in range(0, len(chunks), _IOV_MAX):
            batch = list(chunks[start : start + _IOV_MAX])
            while batch:
                written = os.writev(self.fd, batch)
                while batch and written >= len(batch[0]):
                    written -= len(batch[0])
                    batch.pop(0)
                if batch and written:
                    batch[0] = batch[0][written:]
        return offsets

    async def append(self, chunks: Sequence[memoryview]) -> list[int]:
        try:
            return await asyncio.to_thread(self._append, chunks)
        except OSError as exc:
            raise _io_error(f"writing pack {self.pack_id}", exc) from exc

    def _commit(self) -> None:
        if self.fd is None:
            self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.rename(self.temp, self.final)
        _fsync_dir(self.store.packs_dir)

    async def commit(self) -> None:
        try:
            await asyncio.to_thread(self._commit)
        except OSError as exc:
            await self.abort()
            raise _io_error(f"committing pack {self.pack_id}", exc) from exc

    async def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.temp.unlink(missing_ok=True)


class FileStore:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.packs_dir = self.root / "packs"
        self.sessions_dir = self.root / "sessions"
        try:
            self.packs_dir.mkdir(parents=True, exist_ok=True)
            self.sessions_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _io_error(f"creating the store at {self.root}", exc) from exc
        self._fds: dict[str, int] = {}

    def open_pack(self) -> FilePackWriter:
        return FilePackWriter(self)

    def _commit_manifest(self, manifest: CheckpointManifest) -> None:
        directory = self.sessions_dir / manifest.session_id
        created = not directory.exists()
        directory.mkdir(exist_ok=True)
        if created:
            _fsync_dir(self.sessions_dir)
        final = directory / f"{manifest.checkpoint_id}.json"
        temp = directory / f".tmp-{manifest.checkpoint_id}.json"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            data = encode_manifest(manifest)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, final)
        _fsync_dir(directory)

    async def commit_manifest(self, manifest: CheckpointManifest) -> None:
        try:
            await asyncio.to_thread(self._commit_manifest, manifest)
        except OSError as exc:
            raise _io_error(f"committing checkpoint {manifest.checkpoint_id}", exc) from exc

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest:
        path = self.sessions_dir / session_id / f"{checkpoint_id}.json"
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id} for session {session_id}") from None
        except OSError as exc:
            raise _io_error(f"reading checkpoint {checkpoint_id}", exc) from exc
        try:
            return decode_manifest(data)
        except Exception as exc:
            raise StoreError(f"checkpoint {checkpoint_id}: manifest unreadable: {exc}") from exc

    async def checkpoints(self, session_id: str) -> list[str]:
        directory = self.sessions_dir / session_id
        try:
            names = await asyncio.to_thread(os.listdir, directory)
        except FileNotFoundError:
            return []
        return sorted((n[:-5] for n in names if n.endswith(".json") and not n.startswith(".")), reverse=True)

    async def sessions(self) -> list[str]:
        return sorted(p for p in await asyncio.to_thread(os.listdir, self.sessions_dir) if not p.startswith("."))

    def _read(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        fds: dict[str, int] = {}
        try:
            for ref, target in zip(refs, targets, strict=True):
                fd = fds.get(ref.pack)
                if fd is None:
                    try:
                        fd = fds[ref.pack] = os.open(self.packs_dir / f"{ref.pack}.pack", os.O_RDONLY)
                    except FileNotFoundError:
                        raise StoreError(f"pack {ref.pack} is missing") from None
                got = os.preadv(fd, [target], ref.offset)
                if got != ref.length:
                    raise StoreError(f"pack {ref.pack} is truncated: wanted {ref.length} bytes at {ref.offset}")
        finally:
            for fd in fds.values():
                os.close(fd)

    async def read_chunks(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        try:
            await asyncio.to_thread(self._read, refs, targets)
        except OSError as exc:
            raise _io_error("reading chunks", exc) from exc

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        path = self.sessions_dir / session_id / f"{checkpoint_id}.json"
        path.unlink(missing_ok=True)
        await asyncio.to_thread(_fsync_dir, path.parent) if path.parent.exists() else None

    async def packs(self) -> list[PackInfo]:
        def scan() -> list[PackInfo]:
            out = []
            for entry in os.scandir(self.packs_dir):
                if entry.name.endswith(".pack") and not entry.name.startswith("."):
                    st = entry.stat()
                    out.append(PackInfo(entry.name[:-5], st.st_size, st.st_mtime))
            return out

        return await asyncio.to_thread(scan)

    async def delete_pack(self, pack_id: str) -> None:
        (self.packs_dir / f"{pack_id}.pack").unlink(missing_ok=True)

    async def close(self) -> None:
        return None
