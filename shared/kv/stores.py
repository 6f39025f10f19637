"""Choose the checkpoint store from ``GPUWARDEN_CHECKPOINT_STORE``: ``file:///abs/path`` or ``nats://<bucket>``."""

from __future__ import annotations

import re
from typing import Any

from shared.kv.filestore import FileStore
from shared.kv.store import CheckpointStore

_BUCKET = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


def open_store(url: str, nc: Any = None) -> CheckpointStore:
    if url.startswith("file:///"):
        return FileStore(url.removeprefix("file://"))
    if url.startswith("nats://"):
        bucket = url.removeprefix("nats://").strip("/")
        if not _BUCKET.match(bucket):
            raise ValueError(f"GPUWARDEN_CHECKPOINT_STORE={url!r}: bucket names are letters, digits, '_' and '-'")
        if nc is None:
            raise ValueError(f"GPUWARDEN_CHECKPOINT_STORE={url!r}: the object store needs a NATS connection")
        from shared.kv.objstore import NatsObjectStore

        return NatsObjectStore(nc, bucket)  # type: ignore[return-value]
    raise ValueError(f"GPUWARDEN_CHECKPOINT_STORE={url!r}: expected file:///absolute/path or nats://<bucket>")
