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
import contextlib
import ctypes
import errno
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from shared.kv.manifest import CheckpointManifest, ChunkRef, encode_manifest, newest_first
from shared.kv.store import (
    CheckpointNotFound,
    InvalidId,
    PackInfo,
    StoreError,
    checked_ids,
    checked_pack,
    load_manifest,
)

_IOV_MAX = 512
T = TypeVar("T")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _find_syncfs() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux: each manifest gets its own fsync
        return None


_SYNCFS = _find_syncfs()


def _syncfs(path: Path) -> None:
    """Flush everything written to the filesystem holding ``path`` (Linux ``syncfs``): one barrier for a batch."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def _io_error(what: str, exc: OSError) -> StoreError:
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return StoreError(f"{what}: {reason}")


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _io_pool(threads: int) -> ThreadPoolExecutor:
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-io")
    return pool


def _split(items: list[T], parts: int) -> list[list[T]]:
    """Contiguous groups of about equal count (items are similar in size: KV blocks)."""
    size = max(1, -(-len(items) // parts))
    return [items[i : i + size] for i in range(0, len(items), size)]


def _pwrite_all(fd: int, group: Sequence[tuple[int, memoryview]]) -> None:
    i = 0
    while i < len(group):
        start = group[i][0]
        batch = [group[i][1]]
        i += 1
        while i < len(group) and len(batch) < _IOV_MAX and group[i][0] == start + sum(len(b) for b in batch):
            batch.append(group[i][1])
            i += 1
        offset = start
        while batch:
            written = os.pwritev(fd, batch, offset)
            offset += written
            while batch and written >= len(batch[0]):
                written -= len(batch[0])
                batch.pop(0)
            if batch and written:
                batch[0] = batch[0][written:]


def _pread_all(fds: dict[str, int], group: Sequence[tuple[ChunkRef, memoryview]]) -> str:
    for ref, target in group:
        got = os.preadv(fds[ref.pack], [target], ref.offset)
        if got != ref.length:
            return f"pack {ref.pack} is truncated: wanted {ref.length} bytes at {ref.offset}, got {got}"
    return ""


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
        fd = self.fd
        groups = _split(list(zip(offsets, chunks, strict=True)), self.store.io_threads)
        list(_io_pool(self.store.io_threads).map(lambda group: _pwrite_all(fd, group), groups))
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
    """``io_threads`` positional reads or writes run at once: virtual and NVMe disks need a queue depth above one
    to reach their sequential rate; each thread still moves large contiguous ranges."""

    def __init__(self, root: Path | str, io_threads: int = 4) -> None:
        self.root = Path(root)
        self.io_threads = max(1, io_threads)
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

    def _write_temp(self, manifest: CheckpointManifest, sync: bool = True) -> Path:
        checked_ids(manifest.session_id, manifest.checkpoint_id)
        directory = self.sessions_dir / manifest.session_id
        directory.mkdir(exist_ok=True)
        temp = directory / f".tmp-{manifest.checkpoint_id}.json"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(encode_manifest(manifest))
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return temp

    def _commit_manifests(self, manifests: Sequence[CheckpointManifest]) -> None:
        """Each manifest: temp file, fsync, rename, directory fsync. A batch pays two flushes of the store's
        filesystem instead (``syncfs``: the temp files, then the renames), whatever its size; every manifest is
        still atomic on its own (a rename), and none is visible before its bytes are durable."""
        if len(manifests) > 1 and _SYNCFS is not None:
            temps = [self._write_temp(m, sync=False) for m in manifests]
            _syncfs(self.root)
            for manifest, temp in zip(manifests, temps, strict=True):
                os.rename(temp, temp.parent / f"{manifest.checkpoint_id}.json")
            _syncfs(self.root)
            return
        pool = _io_pool(self.io_threads)
        new_dirs = [m.session_id for m in manifests if not (self.sessions_dir / m.session_id).exists()]
        temps = list(pool.map(self._write_temp, manifests))
        if new_dirs:
            _fsync_dir(self.sessions_dir)
        for manifest, temp in zip(manifests, temps, strict=True):
            os.rename(temp, temp.parent / f"{manifest.checkpoint_id}.json")
        list(pool.map(_fsync_dir, {temp.parent for temp in temps}))

    async def commit_manifests(self, manifests: Sequence[CheckpointManifest]) -> None:
        if not manifests:
            return
        try:
            await asyncio.to_thread(self._commit_manifests, manifests)
        except OSError as exc:
            raise _io_error(f"committing {len(manifests)} checkpoint(s)", exc) from exc

    async def commit_manifest(self, manifest: CheckpointManifest) -> None:
        await self.commit_manifests([manifest])

    async def manifest(self, session_id: str, checkpoint_id: str) -> CheckpointManifest:
        checked_ids(session_id, checkpoint_id)
        path = self.sessions_dir / session_id / f"{checkpoint_id}.json"
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id} for session {session_id}") from None
        except OSError as exc:
            raise _io_error(f"reading checkpoint {checkpoint_id}", exc) from exc
        return load_manifest(data, session_id, checkpoint_id)

    async def checkpoints(self, session_id: str) -> list[str]:
        checked_ids(session_id)
        directory = self.sessions_dir / session_id
        try:
            names = await asyncio.to_thread(os.listdir, directory)
        except FileNotFoundError:
            return []
        return newest_first([n[:-5] for n in names if n.endswith(".json") and not n.startswith(".")])

    async def sessions(self) -> list[str]:
        return sorted(p for p in await asyncio.to_thread(os.listdir, self.sessions_dir) if not p.startswith("."))

    def _read(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        fds: dict[str, int] = {}
        try:
            for ref in refs:
                if ref.pack not in fds:
                    try:
                        fds[ref.pack] = os.open(self.packs_dir / f"{checked_pack(ref.pack)}.pack", os.O_RDONLY)
                    except FileNotFoundError:
                        raise StoreError(f"pack {ref.pack} is missing") from None
                    os.posix_fadvise(fds[ref.pack], 0, 0, os.POSIX_FADV_SEQUENTIAL)
            work = sorted(zip(refs, targets, strict=True), key=lambda rt: (rt[0].pack, rt[0].offset))
            groups = _split(work, self.io_threads)
            for error in _io_pool(self.io_threads).map(lambda group: _pread_all(fds, group), groups):
                if error:
                    raise StoreError(error)
        finally:
            for fd in fds.values():
                os.close(fd)

    async def read_chunks(self, refs: Sequence[ChunkRef], targets: Sequence[memoryview]) -> None:
        try:
            await asyncio.to_thread(self._read, refs, targets)
        except OSError as exc:
            raise _io_error("reading chunks", exc) from exc

    async def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> None:
        checked_ids(session_id, checkpoint_id)
        path = self.sessions_dir / session_id / f"{checkpoint_id}.json"
        path.unlink(missing_ok=True)
        await asyncio.to_thread(_fsync_dir, path.parent) if path.parent.exists() else None

    async def pack_sizes(self, pack_ids: Iterable[str]) -> dict[str, int]:
        """The size of each named pack that exists: one stat each, never a listing of the folder."""

        def sizes() -> dict[str, int]:
            found = {}
            for pack_id in set(pack_ids):
                with contextlib.suppress(FileNotFoundError):
                    found[pack_id] = os.stat(self.packs_dir / f"{checked_pack(pack_id)}.pack").st_size
            return found

        return await asyncio.to_thread(sizes)

    async def manifests_present(self, checkpoints: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """One stat each, never a listing of a session's folder."""

        def present() -> set[tuple[str, str]]:
            found = set()
            for session_id, checkpoint_id in set(checkpoints):
                with contextlib.suppress(InvalidId):
                    checked_ids(session_id, checkpoint_id)
                    if os.path.isfile(self.sessions_dir / session_id / f"{checkpoint_id}.json"):
                        found.add((session_id, checkpoint_id))
            return found

        return await asyncio.to_thread(present)

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
        (self.packs_dir / f"{checked_pack(pack_id)}.pack").unlink(missing_ok=True)

    def _sweep(self, grace_s: float) -> int:
        """Temporary files (``.tmp-*``) of packs and manifests whose writer died or hit a full disk: nothing
        references them, and after ``grace_s`` without a change nothing is still writing them."""
        cutoff = time.time() - grace_s
        gone = 0
        folders = [self.packs_dir]
        with os.scandir(self.sessions_dir) as entries:
            folders += [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        for folder in folders:
            try:
                with os.scandir(folder) as entries:
                    temps = [e for e in entries if e.name.startswith(".tmp-") and e.is_file(follow_symlinks=False)]
                for entry in temps:
                    with contextlib.suppress(FileNotFoundError):
                        if entry.stat().st_mtime < cutoff:
                            os.unlink(entry.path)
                            gone += 1
            except FileNotFoundError:
                continue
        return gone

    async def sweep_orphans(self, grace_s: float) -> int:
        try:
            return await asyncio.to_thread(self._sweep, grace_s)
        except OSError as exc:
            raise _io_error("collecting temporary files", exc) from exc

    async def close(self) -> None:
        return None
