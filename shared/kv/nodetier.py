"""The KV journal's node tier: each full block written to the node's local disk as it fills, so that a pod killed
(OOM, engine crash) costs each session at most its last block when the session goes on on the same node, while the
shared store (a PersistentVolume, the NATS object store) is written only every ``spill_s`` and at the planned
saves. A node lost takes its tier with it: its sessions go on from the shared store (at most ``spill_s`` of
decoding recomputed).

Layout, under the node's directory (a hostPath every pod of the node mounts)::

    <root>/<session>/<pod>.g<generation>.log   the blocks this pod's journal made full under that generation
    <root>/.usage/<pod>                        the bytes of this pod's logs (the node's budget sums these)

A log is a sequence of records, each a header (marker, block index, stored length, plain size, nonce length, the
block's xxh3-128 digest) and its bytes, sealed with the pod's chunk cipher when the store's checkpoints are. A log is
appended without fsync: a pod killed leaves what it wrote in the node's page cache, and a node lost loses the tier
either way. A record cut short by the kill is the log's end. A log is deleted once the shared store holds and the
registry records what it holds (``rotate``), and when its session ends or leaves the pod (``forget``); logs of pods
that died are swept after ``keep_s``.

Trust: a log is read only for the pod and generation the checkpoint service names as the session's previous taker
(``CheckpointLocation.taken_from``), on top of the newest recorded checkpoint, and only where every block both hold
has the same digest; every block read is verified against its digest. So a log never rolls a session back nor
mixes two histories: at worst it is passed over and the tokens after the shared checkpoint are recomputed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shared.contract.base import check_id
from shared.kv.crypto import ChunkCipher
from shared.kv.manifest import CheckpointManifest
from shared.kv.manifest import digest as block_digest
from shared.kv.store import checked_ids

if TYPE_CHECKING:
    from shared.kv.agent import KvAgent

log = logging.getLogger(__name__)

MARKER = b"GWNT"
HEADER = struct.Struct("<4sIIIH32s")
"""marker, block index, stored length, plain size, nonce length, digest (32 ascii hex digits)."""
USAGE = ".usage"
DEFAULT_KEEP_S = 3600.0


def _checked_pod(pod: str) -> str:
    """A pod name as the contract allows it (``ValueError`` otherwise): it becomes part of a file name here."""
    return check_id("pod", pod)


@dataclass
class TierStats:
    blocks: int = 0
    bytes_written: int = 0
    rotations: int = 0


@dataclass(frozen=True)
class Tail:
    """What a node log adds to a restored checkpoint: blocks ``start``, ``start + 1``, ... verified."""

    start: int
    blocks: list[bytes]
    why_not: str = ""
    """Why the log was passed over ('' when it was read, or there was none)."""


class NodeTier:
    """One pod's view of its node's tier: it appends its own logs and reads the logs of the pod a session came from.
    ``budget_bytes``: the most the node's tier should hold (every pod's logs); 0: no budget."""

    def __init__(
        self,
        root: Path | str,
        pod: str,
        *,
        cipher: ChunkCipher | None = None,
        budget_bytes: int = 0,
        keep_s: float = DEFAULT_KEEP_S,
    ) -> None:
        self.root = Path(root)
        self.pod = _checked_pod(pod)
        self.cipher = cipher
        self.budget_bytes = budget_bytes
        self.keep_s = keep_s
        self.stats = TierStats()
        self._logged: dict[str, tuple[int, int]] = {}
        """Each session's log: (the generation it is written under, the next block index it takes)."""
        self._sizes: dict[str, int] = {}
        """Bytes of each session's log (this pod's)."""

    # -- what the journal writes ----------------------------------------------------------------------------------
    def path(self, session_id: str, pod: str, generation: int) -> Path:
        checked_ids(session_id)
        return self.root / session_id / f"{_checked_pod(pod)}.g{int(generation)}.log"

    def next_block(self, session_id: str, generation: int) -> int:
        """The first block index the session's log lacks under ``generation`` (0 for a new log)."""
        gen, nxt = self._logged.get(session_id, (generation, 0))
        return nxt if gen == generation else 0

    def begin(self, session_id: str, generation: int, first_block: int) -> None:
        """The pod took the session under ``generation`` holding blocks the shared store has up to ``first_block``
        (a restore): its log starts there (an older log of the session goes)."""
        self._delete(session_id)
        self._logged[session_id] = (generation, first_block)

    @property
    def bytes_held(self) -> int:
        """Bytes of this pod's logs."""
        return sum(self._sizes.values())

    async def append(self, batch: Sequence[tuple[str, int, int, Sequence[tuple[memoryview, str]]]]) -> int:
        """Append blocks to the sessions' logs: (session, generation, the index of the first block, each block's
        bytes and digest), one thread hop for the whole batch. Returns the bytes written. A session taken again
        under another generation starts a new log (the old one is deleted)."""
        written = await asyncio.to_thread(self._append, batch)
        self.stats.bytes_written += written
        await asyncio.to_thread(self.note_usage)
        return written

    def _append(self, batch: Sequence[tuple[str, int, int, Sequence[tuple[memoryview, str]]]]) -> int:
        total = 0
        for session_id, generation, start, blocks in batch:
            if not blocks:
                continue
            gen, _ = self._logged.get(session_id, (generation, 0))
            if gen != generation:
                self._delete(session_id)
            path = self.path(session_id, self.pod, generation)
            path.parent.mkdir(parents=True, exist_ok=True)
            parts: list[bytes | memoryview] = []
            for offset, (view, dg) in enumerate(blocks):
                nonce, data = b"", view
                if self.cipher is not None:
                    nonce, sealed = self.cipher.seal(view, dg)
                    data = memoryview(sealed)
                parts.append(HEADER.pack(MARKER, start + offset, len(data), len(view), len(nonce), dg.encode()))
                parts += [nonce, data]
            with open(path, "ab") as f:
                size = f.tell()
                f.writelines(parts)
                end = f.tell()
            total += end - size
            self._sizes[session_id] = end
            self._logged[session_id] = (generation, start + len(blocks))
            self.stats.blocks += len(blocks)
        return total

    def rotate(self, session_id: str, generation: int, spilled_blocks: int) -> None:
        """The shared store holds, and the registry records, the session's first ``spilled_blocks`` blocks under
        ``generation``: its log is no longer needed; the next block logged is the one after them."""
        gen, nxt = self._logged.get(session_id, (generation, 0))
        if gen != generation:
            return  # the session was taken again since: its log is of the newer generation
        self._delete(session_id)
        self._logged[session_id] = (generation, max(spilled_blocks, nxt))
        self.stats.rotations += 1

    def forget(self, session_id: str) -> None:
        """The session ended or left the pod: its log goes."""
        self._delete(session_id)
        self._logged.pop(session_id, None)

    def _delete(self, session_id: str) -> None:
        gen = self._logged.get(session_id, (None, 0))[0]
        self._sizes.pop(session_id, None)
        if gen is None:
            return
        try:
            self.path(session_id, self.pod, gen).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("node tier: a log not deleted", extra={"session": session_id, "error": str(exc)})

    def sessions(self) -> list[str]:
        """Sessions this pod keeps a log position for (a log, or the block its next log starts at)."""
        return list(self._logged)

    def sessions_by_size(self) -> list[tuple[str, int]]:
        """This pod's logs, largest first: what the budget compacts first."""
        return sorted(self._sizes.items(), key=lambda kv: kv[1], reverse=True)

    # -- the node's budget ------------------------------------------------------------------------------------------
    def note_usage(self) -> None:
        """Write down this pod's bytes for the node's budget (``node_bytes``)."""
        usage = self.root / USAGE
        usage.mkdir(parents=True, exist_ok=True)
        tmp = usage / f".{self.pod}.tmp"
        tmp.write_text(str(self.bytes_held))
        os.replace(tmp, usage / self.pod)

    def node_bytes(self) -> int:
        """What every pod of the node says its logs hold (one small file each)."""
        total = 0
        try:
            entries = list(os.scandir(self.root / USAGE))
        except FileNotFoundError:
            return self.bytes_held
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.name == self.pod:
                total += self.bytes_held
                continue
            try:
                total += int(Path(entry.path).read_text() or 0)
            except (OSError, ValueError):
                continue
        return total

    def over_budget(self) -> int:
        """How many bytes the node's tier holds above its budget (0 within it, or without one)."""
        if self.budget_bytes <= 0:
            return 0
        return max(0, self.node_bytes() - self.budget_bytes)

    def sweep(self) -> int:
        """Delete logs and usage notes other pods have not written for ``keep_s`` (pods that died and whose sessions
        went on elsewhere long ago; this pod's own logs are its to delete). Returns how many files went."""
        cutoff = time.time() - self.keep_s
        own = (f"{self.pod}.g", self.pod)
        gone = 0
        if not self.root.is_dir():
            return 0
        for directory in os.scandir(self.root):
            if not directory.is_dir():
                continue
            for entry in os.scandir(directory.path):
                if entry.name == own[1] or entry.name.startswith(own[0]):
                    continue
                try:
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        gone += 1
                except OSError:
                    continue
            if directory.name != USAGE:
                try:
                    os.rmdir(directory.path)  # only when empty
                except OSError:
                    pass
        return gone

    # -- what a restore reads ---------------------------------------------------------------------------------------
    async def continue_session(
        self,
        agent: KvAgent,
        session_id: str,
        manifest: CheckpointManifest,
        generation: int,
        came_from: str = "",
        came_from_generation: int = 0,
    ) -> Tail:
        """After ``agent`` restored ``manifest`` of the session under ``generation``: this pod's log of it starts
        after what the store holds, and the blocks ``came_from``'s log of ``came_from_generation`` holds after the
        checkpoint (``read_tail``) are appended to the session (``KvAgent.continue_with``). What the log added."""
        bt = manifest.layout.block_tokens
        full = manifest.token_count // bt if bt else 0
        self.begin(session_id, generation, full)
        if not came_from:
            return Tail(full, [])
        have = [ref.digest for ref in manifest.blocks[:full]]
        block_size = manifest.blocks[0].size if manifest.blocks else 0
        tail = await self.read_tail(session_id, came_from, came_from_generation, have, block_size)
        if tail.blocks:
            agent.continue_with(session_id, full, [np.frombuffer(bytearray(b), dtype=np.uint8) for b in tail.blocks])
        return tail

    async def read_tail(self, session_id: str, pod: str, generation: int, have: Sequence[str], block_size: int) -> Tail:
        """The blocks after ``have`` (the digests of the restored checkpoint's full blocks) that ``pod``'s log of
        ``generation`` holds, each verified. Nothing when there is no log, when it disagrees with ``have`` on a block
        both hold (another history), or from the first block that is missing, cut short or fails its digest."""
        return await asyncio.to_thread(self._read_tail, session_id, pod, generation, list(have), block_size)

    def _read_tail(self, session_id: str, pod: str, generation: int, have: list[str], block_size: int) -> Tail:
        start = len(have)
        try:
            data = self.path(session_id, pod, generation).read_bytes()
        except FileNotFoundError:
            return Tail(start, [])
        except (OSError, ValueError) as exc:
            return Tail(start, [], f"unreadable: {exc}")
        records: dict[int, tuple[str, bytes, bytes, int]] = {}
        at = 0
        while at + HEADER.size <= len(data):
            marker, index, length, size, nonce_len, dg = HEADER.unpack_from(data, at)
            end = at + HEADER.size + nonce_len + length
            if marker != MARKER or end > len(data):
                break  # the end of what the pod wrote before it died
            nonce = data[at + HEADER.size : at + HEADER.size + nonce_len]
            records[index] = (dg.decode("ascii", "replace"), nonce, data[at + HEADER.size + nonce_len : end], size)
            at = end
        for index, known in enumerate(have):
            if index in records and records[index][0] != known:
                return Tail(start, [], f"block {index} differs from the restored checkpoint's: another history")
        blocks: list[bytes] = []
        why = ""
        index = start
        while index in records:
            dg, nonce, stored, size = records[index]
            try:
                plain = self.cipher.open(memoryview(stored), nonce, dg) if self.cipher is not None else stored
            except ValueError as exc:
                why = f"block {index}: {exc}"
                break
            if nonce and self.cipher is None:
                why = f"block {index} is encrypted and this pod has no key"
                break
            if len(plain) != size or (block_size and size != block_size) or block_digest(plain) != dg:
                why = f"block {index} fails its digest or size"
                break
            blocks.append(bytes(plain))
            index += 1
        return Tail(start, blocks, why)
