"""A session as the KV agent holds it (its blocks, tokens, ownership generation and versions), and what a save
of it needs to know: whether its last checkpoint still holds it, and which of its blocks are full (immutable from
now on, what a journal entry writes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.kv.buffers import Block
from shared.kv.manifest import CheckpointManifest, KvLayout


@dataclass
class Session:
    """``last``: the newest checkpoint this agent wrote or verified for the session, the only one whose chunks a
    later save may reference. ``generation``: the ownership generation this pod holds; ``sequence``: its saves."""

    session_id: str
    blocks: list[Block] = field(default_factory=list)
    token_count: int = 0
    last: CheckpointManifest | None = None
    generation: int = 0
    sequence: int = 0
    layout: KvLayout | None = None
    """The model (version, weights) that built this session's KV: its checkpoints carry it, and it never changes."""
    tokens_digest: str = ""
    """The engine's ``tokens_digest_of`` the ``token_count`` tokens, when it says (``set_tokens``); '' otherwise."""
    version: int = 0
    """Counts the engine's changes to the session (blocks, tokens): a save that finds the version it last
    committed has nothing new to write."""
    saved_version: int = -1
    """The version ``last`` holds (-1: none committed by this agent yet)."""
    nbytes: int = 0
    """Bytes of ``blocks``, kept as they change (never summed again)."""


def unchanged(session: Session) -> bool:
    """Whether the session's last checkpoint holds it as it is now, under the generation it is held under."""
    return (
        session.last is not None
        and session.version == session.saved_version
        and session.last.generation == session.generation
    )


def prefix_due(session: Session, layout: KvLayout) -> bool:
    """Whether the session's full blocks hold more tokens than its last checkpoint under the generation it is
    held under (a journal entry is due): never one that would hold fewer."""
    full = full_count(session, layout.block_tokens)
    if full == 0:
        return False
    last = session.last
    return last is None or last.generation != session.generation or full * layout.block_tokens > last.token_count


def full_count(session: Session, block_tokens: int) -> int:
    """How many of the session's first blocks are full (immutable from now on)."""
    if block_tokens <= 0:
        return 0
    return min(len(session.blocks), session.token_count // block_tokens)


def full_prefix(session: Session, block_tokens: int) -> tuple[list[Block], int, str, int]:
    """The session's full blocks, the tokens they hold, that many tokens' digest when it is the engine's (the
    prefix is the whole session), and the version it holds the session at (-1: only a prefix of it)."""
    full = full_count(session, block_tokens)
    whole = full * block_tokens == session.token_count and full == len(session.blocks)
    return (
        session.blocks[:full],
        full * block_tokens,
        session.tokens_digest if whole else "",
        session.version if whole else -1,
    )
