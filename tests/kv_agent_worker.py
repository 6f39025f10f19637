"""A KV agent in its own process, for tests that kill it mid-save.

Usage: python -m tests.kv_agent_worker NATS_URL ROOT STORE_DIR POD NODE SESSIONS BLOCK_MIB BLOCKS
It saves once (the previous committed checkpoint), rewrites every block, prints "ready", and serves save commands.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.kv.manifest import KvLayout
from shared.plumbing.bus import Bus
from shared.plumbing.settings import NatsSettings


def layout(block_mib: int) -> KvLayout:
    return KvLayout(
        model_id="m",
        model_version="1",
        tokenizer_id="t",
        dtype="float16",
        block_tokens=16,
        layers=block_mib * 16,
        kv_heads=8,
        head_dim=128,
    )  # 16 tokens x layers x 8 x 128 x 2 x 2 B = block_mib MiB


async def main(url: str, root: str, store_dir: str, pod: str, node: str, sessions: int, mib: int, blocks: int) -> None:
    bus = await Bus.connect(NatsSettings(servers=(url,)), Subjects(root), f"agent/{pod}")
    agent = KvAgent(FileStore(store_dir), pod=pod, node=node, namespace="llm", deployment="llama", layout=layout(mib))
    arrays: list[np.ndarray] = []
    for s in range(sessions):
        sid = f"{pod}-s{s}"
        agent.register_session(sid)
        for b in range(blocks):
            array = np.full(agent.layout.block_bytes, (s * 31 + b) % 251, dtype=np.uint8)
            arrays.append(array)
            agent.append_block(sid, array)
    await agent.save(reason="first")
    for array in arrays:
        array += 1
    for s in range(sessions):
        for b in range(blocks):
            agent.update_block(f"{pod}-s{s}", b)
    endpoint = AgentEndpoint(agent, bus, announce_s=0.5)
    await endpoint.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], a[3], a[4], int(a[5]), int(a[6]), int(a[7])))
