"""The bucket's layout and encodings: object names to subjects, the meta message, chunk sequences, digests.

Pure functions and values over bytes and strings; no connection. The layout is the Object Store protocol's
(see the package docstring), so ``nats obj`` and every client library read what this package writes."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shared.kv.store import StoreError, checked_ids

BUCKET_RE = re.compile(r"^[A-Za-z0-9_-]+$")
SEQUENCES_HEADER = "Gpuwarden-Chunk-Sequences"
PACK_PREFIX = "packs/"
SESSION_PREFIX = "sessions/"

MAX_CHUNK_SIZE = 1024 * 1024  # 256 KiB..1 MiB measured alike; 1 MiB: fewer messages, 2 MiB blocks align
WINDOW_BYTES = 16 * 1024 * 1024  # outstanding publish acks, and bytes per pull request pair, per object
READ_CONCURRENCY = 2  # chunk runs read at once (each with its own consumer)
HASH_BACKLOG = 16  # chunk payloads queued for the hashing thread before the reader waits
INLINE_HASH_BYTES = 256 * 1024  # appends smaller than this are hashed on the event loop


def meta_subject(bucket: str, name: str) -> str:
    """The subject of one object's meta message (rolled up: its last message is the object's current meta)."""
    return f"$O.{bucket}.M.{b64name(name)}"


def chunk_subject(bucket: str, nuid: str) -> str:
    """The subject every chunk of one written object is published on, in order."""
    return f"$O.{bucket}.C.{nuid}"


INDEX_TOKEN = "index"
"""Under the chunk subjects, ``index.<session>.<checkpoint>``: a per-session index of manifests. Never a chunk
subject (a nuid is one token), inside the bucket's stream (``$O.<bucket>.C.>``), and ignored by other Object
Store clients, which only follow the nuids that metas name."""


def index_subject(bucket: str, session_id: str, checkpoint_id: str) -> str:
    """The index entry of one manifest: listing a session's checkpoints reads the subjects under
    ``index_prefix(bucket, session)``, not the whole bucket. Ids are subject tokens by the contract's rules."""
    checked_ids(session_id, checkpoint_id)
    return f"{index_prefix(bucket, session_id)}{checkpoint_id}"


def index_prefix(bucket: str, session_id: str = "") -> str:
    """``$O.<bucket>.C.index.`` (every entry), or with ``session_id`` that session's entries' prefix."""
    if session_id:
        checked_ids(session_id)
        return f"$O.{bucket}.C.{INDEX_TOKEN}.{session_id}."
    return f"$O.{bucket}.C.{INDEX_TOKEN}."


def b64name(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


def name_from_b64(token: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def byte_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _parse_mtime(text: str | None) -> float:
    if not text:
        return 0.0
    value = text.replace("Z", "+00:00")
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", value)
    if match and match.group(2) and len(match.group(2)) > 7:  # Go writes nanoseconds; Python reads micro
        value = match.group(1) + match.group(2)[:7] + match.group(3)
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return 0.0


def encode_sequences(seqs: Sequence[int]) -> str:
    """Chunk stream sequences, ascending, as runs: ``start+count`` then ``gap+count`` (gap from the previous
    run's last sequence). One run when no other publisher interleaved: ``1024+256``."""
    runs: list[str] = []
    prev_end = 0
    i = 0
    while i < len(seqs):
        j = i
        while j + 1 < len(seqs) and seqs[j + 1] == seqs[j] + 1:
            j += 1
        runs.append(f"{seqs[i] - prev_end}+{j - i + 1}")
        prev_end = seqs[j]
        i = j + 1
    return ",".join(runs)


def decode_sequences(text: str) -> list[int]:
    seqs: list[int] = []
    prev_end = 0
    for run in text.split(","):
        gap, count = run.split("+")
        start = prev_end + int(gap)
        seqs.extend(range(start, start + int(count)))
        prev_end = seqs[-1]
    return seqs


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What the meta message says about one object."""

    name: str
    nuid: str
    size: int
    chunks: int
    digest: str
    chunk_size: int
    modified: float
    seqs: list[int] | None
    deleted: bool = False

    def chunk_length(self, index: int) -> int:
        return self.chunk_size if index < self.chunks - 1 else self.size - self.chunk_size * (self.chunks - 1)

    @classmethod
    def parse(cls, data: bytes) -> ObjectMeta:
        info = json.loads(data)
        options = info.get("options") or {}
        headers = info.get("headers") or {}
        seqs = None
        raw = headers.get(SEQUENCES_HEADER)
        if isinstance(raw, list) and raw:
            raw = raw[0]
        size = int(info.get("size") or 0)
        chunks = int(info.get("chunks") or 0)
        if isinstance(raw, str) and raw:
            try:
                seqs = decode_sequences(raw)
            except ValueError:
                seqs = None
            if seqs is not None and len(seqs) != chunks:
                seqs = None
        chunk_size = int(options.get("max_chunk_size") or 0)
        if chunks > 1 and chunk_size <= 0:
            raise ValueError("multi-chunk object without options.max_chunk_size")
        if chunks == 1:
            chunk_size = chunk_size or size
        return cls(
            name=info["name"],
            nuid=info.get("nuid") or "",
            size=size,
            chunks=chunks,
            digest=info.get("digest") or "",
            chunk_size=chunk_size,
            modified=_parse_mtime(info.get("mtime")),
            seqs=seqs,
            deleted=bool(info.get("deleted")),
        )


def sha_digest(h: Any) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(h.digest()).decode()


def digest_bytes(text: str) -> bytes | None:
    if not text.upper().startswith("SHA-256="):
        return None
    try:
        return base64.urlsafe_b64decode(text[len("SHA-256=") :])
    except ValueError:
        return None


def update_all(h: Any, views: Sequence[memoryview]) -> None:
    for view in views:
        h.update(view)


def object_label(name: str) -> str:
    """How errors name an object: ``pack <id>`` for packs, ``object <name>`` for the rest."""
    return f"pack {name[len(PACK_PREFIX) :]}" if name.startswith(PACK_PREFIX) else f"object {name}"


def manifest_name(session_id: str, checkpoint_id: str) -> str:
    checked_ids(session_id, checkpoint_id)
    return f"{SESSION_PREFIX}{session_id}/{checkpoint_id}.json"


def _ack_tokens(reply: str) -> list[str]:
    tokens = reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>
        return tokens
    if len(tokens) >= 11:  # with <domain>.<account hash> after ACK, and a random token at the end
        return tokens[:2] + tokens[4:11]
    raise StoreError(f"unexpected JetStream reply subject {reply!r}")


def stream_seq(reply: str) -> int:
    return int(_ack_tokens(reply)[5])


def stream_time(reply: str) -> float:
    return int(_ack_tokens(reply)[7]) / 1e9
