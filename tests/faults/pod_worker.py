"""An inference pod in its own process, for tests that kill it without a preStop.

Usage: python -m tests.faults.pod_worker NATS_URL ROOT STORE_DIR POD NODE SESSION
It takes SESSION from the checkpoint service, serves save commands, and grows the session by one block every
50 ms (at most 400), printing the number of blocks it holds after each.
"""

from __future__ import annotations

import asyncio
import sys

from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.plumbing.bus import Bus
from shared.plumbing.settings import NatsSettings
from tests.kvkit import LAYOUT, block_content


async def main(url: str, root: str, store_dir: str, pod: str, node: str, session: str) -> None:
    bus = await Bus.connect(NatsSettings(servers=(url,)), Subjects(root), f"agent/{pod}")
    agent = KvAgent(FileStore(store_dir), pod=pod, node=node, namespace="llm", deployment="llama", layout=LAYOUT)
    endpoint = AgentEndpoint(agent, bus, announce_s=0.2)
    await endpoint.start_session(session)
    await endpoint.start()
    for i in range(400):
        agent.append_block(session, block_content(session, i, LAYOUT.block_bytes))
        print(i + 1, flush=True)
        await asyncio.sleep(0.05)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:7]))
