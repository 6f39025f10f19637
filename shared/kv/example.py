"""A runnable example of the KV agent: ``python -m shared.kv.example [DIR]``.

An "inference server" registers two sessions whose KV blocks are numpy arrays (torch CPU/CUDA tensors, CuPy
arrays, buffer-protocol or DLPack objects work the same), saves them to a file store, changes one block and saves
again (only that block is written), then a second "pod" restores a session into its own preallocated blocks and
checks every byte. With no DIR it works in a temporary folder.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

import msgspec
import numpy as np

from shared.kv.agent import KvAgent
from shared.kv.filestore import FileStore
from shared.kv.presets import LLAMA_3_8B

# a small slice of the model keeps the example quick: 16 x 4 x 8 x 128 x 2 x 2 B = 256 KiB/block
LAYOUT = msgspec.structs.replace(LLAMA_3_8B, layers=4)


async def main(directory: str) -> int:
    store = FileStore(directory)
    rng = np.random.default_rng(7)

    server = KvAgent(store, pod="llama-0", node="node-1", namespace="llm", deployment="llama", layout=LAYOUT)
    pool = {sid: [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in range(8)] for sid in ("a", "b")}
    for sid, blocks in pool.items():
        server.register_session(sid)
        for block in blocks:
            server.append_block(sid, block)  # the engine's own memory: nothing is copied here

    first = await server.save(deadline_s=20, reason="example")
    print(f"saved {len(first.committed)} sessions, {first.bytes_written:,} bytes written")

    pool["a"][3][:] = 0  # the engine rewrote one full block of session a in place, and says so
    server.update_block("a", 3)
    second = await server.save(["a"])
    print(f"incremental save of a: {second.bytes_written:,} of {second.bytes_total:,} bytes written")

    other = KvAgent(store, pod="llama-1", node="node-2", namespace="llm", deployment="llama", layout=LAYOUT)
    preallocated = [np.empty(LAYOUT.block_bytes, dtype=np.uint8) for _ in range(8)]
    restored = await other.restore("a", into=preallocated)
    same = all(np.array_equal(x, y) for x, y in zip(preallocated, pool["a"], strict=True))
    print(f"restored a from {restored.manifest.checkpoint_id} on llama-1: byte for byte {same}")
    return 0 if same else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        raise SystemExit(asyncio.run(main(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        raise SystemExit(asyncio.run(main(tmp)))
