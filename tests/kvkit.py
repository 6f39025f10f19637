"""The KV agent's test kit: a small layout, deterministic block contents, an agent on a store, and a byte flipper.

Shared by the agent's tests and the fault scenarios; a test module imports from here, never from another test module.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np

from shared.kv.agent import KvAgent
from shared.kv.crypto import ChunkCipher
from shared.kv.filestore import FileStore
from shared.kv.presets import LLAMA_3_8B

LAYOUT = msgspec.structs.replace(LLAMA_3_8B, layers=2, kv_heads=2, head_dim=64)
# 16 tokens x 2 x 2 x 64 x 2 x 2 B = 16 KiB per block


def block_content(session_id: str, index: int, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(uuid.uuid5(uuid.NAMESPACE_URL, f"{session_id}/{index}").bytes[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def make_agent(store: FileStore, pod: str = "llama-1", cipher: ChunkCipher | None = None) -> KvAgent:
    return KvAgent(store, pod=pod, node="node-1", namespace="llm", deployment="llama", layout=LAYOUT, cipher=cipher)


def fill(agent: KvAgent, session_id: str, blocks: int) -> list[np.ndarray]:
    agent.register_session(session_id)
    arrays = [block_content(session_id, i, LAYOUT.block_bytes).reshape(2, -1) for i in range(blocks)]
    for a in arrays:
        agent.append_block(session_id, a)
    return arrays


def flip_byte(store: FileStore, pack: str, offset: int) -> None:
    path = store.packs_dir / f"{pack}.pack"
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path``: a real ENOSPC. Needs root, as the tests and CI run."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
