"""A simulated inference engine's KV block pool: a fixed number of blocks shared by the sessions one pod runs.

Pure bookkeeping (no I/O, no clock), the part of a paged-attention scheduler that decides who holds how many
blocks. When a session needs blocks the pool lacks, the pool preempts as vLLM does with recompute preemption:
the most recently arrived running session gives all its blocks back, and is recomputed from its tokens when it
is next scheduled (re-arriving then, so it goes to the back). The session asking is never its own victim: a
pool that cannot hold one longest session is refused when the spec is loaded.
"""

from __future__ import annotations


class PoolTooSmall(ValueError):
    """A session asked for more blocks than the whole pool has."""


class BlockPool:
    """``capacity`` blocks; ``used`` never exceeds it. Sessions are kept in the order they arrived."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a KV block pool needs at least one block, not {capacity}")
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.preemptions = 0
        self._held: dict[str, int] = {}  # session -> blocks, oldest arrival first

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def held(self, session_id: str) -> int:
        return self._held.get(session_id, 0)

    def sessions(self) -> list[str]:
        """Running sessions, oldest arrival first."""
        return list(self._held)

    def reserve(self, session_id: str, blocks: int) -> list[str]:
        """Let ``session_id`` hold ``blocks`` blocks (a session never shrinks here; asking for fewer than it holds
        changes nothing). A session new to the pool arrives now. While the pool is short, the most recently
        arrived other session is preempted: it loses every block it held. Returns the preempted sessions, in the
        order they were chosen; the caller drops their KV and recomputes them later."""
        if blocks > self.capacity:
            raise PoolTooSmall(f"session {session_id!r} needs {blocks} KV blocks; the pool has {self.capacity} in all")
        current = self._held.setdefault(session_id, 0)
        extra = blocks - current
        if extra <= 0:
            return []
        preempted: list[str] = []
        while self.free < extra:
            victim = next(s for s in reversed(self._held) if s != session_id)
            self.used -= self._held.pop(victim)
            self.preemptions += 1
            preempted.append(victim)
        self._held[session_id] = blocks
        self.used += extra
        self.peak = max(self.peak, self.used)
        return preempted

    def release(self, session_id: str) -> int:
        """The session ended or was dropped: its blocks are free again. Returns how many it held."""
        freed = self._held.pop(session_id, 0)
        self.used -= freed
        return freed
