"""Choose the checkpoint store from ``GPUWARDEN_CHECKPOINT_STORE``.

    file:///absolute/path          FileStore on a filesystem or PersistentVolume
    nats://<bucket>                PodBuckets: JetStream Object Store buckets reachable from every node, one per
    nats://<bucket>?replicas=3     pod (``<bucket>-<pod>``, created on first use with file storage and the given
                                   replicas), so that a pod writes and deletes only its own checkpoints
                                   (``shared.kv.objstore.family``); the single bucket ``<bucket>`` of earlier
                                   versions is still read

The NATS store rides on the service's existing connection (its credentials, TLS and reconnects), so ``nc`` is
required for ``nats://`` and the URL carries no server address.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from nats.aio.client import Client

from shared.kv.filestore import FileStore
from shared.kv.store import CheckpointStore
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Parse, documented, setting

VARIABLE = "GPUWARDEN_CHECKPOINT_STORE"
FORMS = "file:///absolute/path or nats://<bucket>[?replicas=N]"
DEFAULT_URL = "file:///var/lib/gpuwarden/checkpoints"
"""Where checkpoints go when ``GPUWARDEN_CHECKPOINT_STORE`` is not set (as ``DOCUMENTED`` says)."""
_BUCKET = re.compile(r"^[A-Za-z0-9_-]{1,240}$")


def parse_store_url(url: str) -> tuple[str, str, dict[str, Any]]:
    """``("file", path, {})`` or ``("nats", bucket, options)``; ``ValueError`` naming the variable and the allowed
    forms for anything else. Settings can call this to fail at start-up, before any connection exists."""
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path.startswith("/") or path.rstrip("/") == "":
            raise ValueError(f"{VARIABLE}={url!r}: the path must be absolute and not '/': expected {FORMS}")
        return "file", path, {}
    if url.startswith("nats://"):
        parts = urlsplit(url)
        bucket = parts.netloc
        if parts.path not in ("", "/") or parts.fragment or not _BUCKET.match(bucket):
            raise ValueError(
                f"{VARIABLE}={url!r}: the bucket name is letters, digits, '_' and '-' only: expected {FORMS}"
            )
        options: dict[str, Any] = {}
        for key, values in parse_qs(parts.query, keep_blank_values=True).items():
            if key != "replicas":
                raise ValueError(f"{VARIABLE}={url!r}: unknown option {key!r}: expected {FORMS}")
            try:
                options["replicas"] = int(values[-1])
            except ValueError:
                raise ValueError(f"{VARIABLE}={url!r}: replicas must be a number from 1 to 5") from None
            if not 1 <= options["replicas"] <= 5:
                raise ValueError(f"{VARIABLE}={url!r}: replicas must be a number from 1 to 5")
        return "nats", bucket, options
    raise ValueError(f"{VARIABLE}={url!r}: expected {FORMS}")


def open_store(url: str, nc: Client | None = None, pod: str = "") -> CheckpointStore:
    """The store a ``GPUWARDEN_CHECKPOINT_STORE`` value names (see ``parse_store_url``). ``nats://`` needs the
    service's connected client, and writes only as ``pod`` (an inference pod's KV agent; without it the store reads
    and deletes, as the checkpoint service does)."""
    kind, where, options = parse_store_url(url)
    if kind == "file":
        return FileStore(where)
    if nc is None:
        raise ValueError(f"{VARIABLE}={url!r}: the NATS object store needs a connected NATS client (nc)")
    from shared.kv.objstore.family import PodBuckets

    return PodBuckets(nc, where, pod=pod, **options)


def _store_url(name: str, raw: str) -> str:
    try:
        parse_store_url(raw)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    return raw


@dataclass(frozen=True)
class StoreSettings:
    url: str = setting(
        VARIABLE,
        DEFAULT_URL,
        "checkpoint, agents: `file:///path` or `nats://bucket`",
        parse=Parse(_store_url),
    )
    """A URL ``parse_store_url`` accepts."""


DOCUMENTED = documented(StoreSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""
