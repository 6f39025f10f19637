"""The NATS JetStream Object Store (``nats://<bucket>``): checkpoints reachable from every node.

The bucket is a normal Object Store, so ``nats obj ls/get`` and every client library read it:

    stream     OBJ_<bucket>
    chunks     $O.<bucket>.C.<nuid>              one message per ``chunk_size`` bytes, in order
    meta       $O.<bucket>.M.<base64url(name)>   the ObjectInfo JSON (name, nuid, size, chunks, SHA-256 digest,
                                                 mtime, options.max_chunk_size), rolled up per subject
    objects    packs/<pack_id>                   chunk bytes of one save round
               sessions/<session_id>/<checkpoint_id>.json   one manifest per committed checkpoint

As in the Object Store protocol, the meta message is the commit: chunks are published and acknowledged first,
then the meta message makes the object visible. Packs are committed before the manifests that reference them,
and a manifest is the last thing written, so a save that fails anywhere leaves no visible checkpoint.

Throughput path:

- writes publish chunk messages with ``publish_async`` under a bounded window of outstanding acknowledgements;
  blocks that are at least a chunk long are published straight from the caller's memory, only the seams
  between blocks go through a one-chunk staging buffer; the object's SHA-256 is computed in a worker thread
  while the event loop publishes;
- reads compute which chunks hold the wanted byte ranges and fetch exactly those messages through an ephemeral
  pull consumer that starts at the first wanted chunk's stream sequence, with large batches, copying each
  payload straight into the caller's preallocated targets (no per-object accumulation; nats-py's own ``get()``
  concatenates ``bytes`` and is quadratic in the object size).

The stream sequence of every chunk comes from its publish acknowledgement and is recorded, run-length
encoded, in the meta's ``headers`` (``Gpuwarden-Chunk-Sequences``), which other tools carry along and ignore.
Objects without it (written by another client) are read from their first chunk. Every delivered chunk's
stream sequence and length are checked against the meta, so a deleted or short chunk is reported as a
truncated pack, never silently shifted bytes. The object's SHA-256 is verified whenever a whole object is
read (manifests always; packs when a restore reads all of one). Per-block integrity stays with the caller's
digests (``ChunkRef.digest``), which also catch corruption that happened before the bytes reached NATS.

Deleting an object purges its meta subject first (it disappears at once), then its chunks. A write aborted
while the server was unreachable leaves chunks without a meta; ``sweep_orphans`` purges them once old enough.

Durability is the server's: use replicas 3 and ``sync_interval: always`` for checkpoints that must survive
power loss (by default the server fsyncs every 2 minutes).

The package by role: ``codec`` (the layout, the meta message, chunk sequences, digests; no connection),
``stream`` (the bucket's JetStream stream: API requests, purges, ephemeral pull consumers), ``writer`` (one
object's chunks, then its commit), ``reader`` (which chunks to read, and reading them into the caller's memory),
``store`` (``NatsObjectStore``, the ``CheckpointStore`` over all of them).
"""

from shared.kv.objstore.codec import (
    MAX_CHUNK_SIZE,
    PACK_PREFIX,
    SEQUENCES_HEADER,
    SESSION_PREFIX,
    ObjectMeta,
    decode_sequences,
    encode_sequences,
)
from shared.kv.objstore.store import NatsObjectStore
from shared.kv.objstore.stream import ObjectStream
from shared.kv.objstore.writer import NatsPackWriter, ObjectWriter

__all__ = [
    "MAX_CHUNK_SIZE",
    "PACK_PREFIX",
    "SEQUENCES_HEADER",
    "SESSION_PREFIX",
    "NatsObjectStore",
    "NatsPackWriter",
    "ObjectMeta",
    "ObjectStream",
    "ObjectWriter",
    "decode_sequences",
    "encode_sequences",
]
