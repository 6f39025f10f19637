"""Periodic checkpoints follow the ``checkpoint`` document; a pod killed without its preStop restores from its
last periodic checkpoint elsewhere, byte for byte, losing at most what it did in one interval."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from shared.contract.configdocs import CheckpointPolicy
from shared.plumbing.configsync import ConfigStore
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually


async def test_a_pod_killed_without_prestop_restores_from_its_last_periodic_checkpoint(mesh: Mesh) -> None:
    await ConfigStore(mesh.client, mesh.subjects).write("checkpoint", CheckpointPolicy(periodic_interval_s=0.5), 1, "t")
    await eventually(lambda: mesh.service.policy().periodic_interval_s == 0.5)
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "tests.faults.pod_worker", mesh.settings.nats.servers[0], mesh.subjects.root,
            str(mesh.store.root), "llama-7", "node-1", "chat-1",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )  # fmt: skip
    held = [0]

    def read_progress() -> None:
        assert worker.stdout is not None
        for line in worker.stdout:
            held[0] = int(line)

    reader = asyncio.get_running_loop().run_in_executor(None, read_progress)
    try:
        # several periodic checkpoints go by while the conversation grows
        await eventually(lambda: _periodic(mesh, "chat-1", 3), timeout=60)
        worker.send_signal(signal.SIGKILL)  # no preStop, no final save
        worker.wait(10)
        await reader
        newest = (await mesh.service.registry.checkpoints("chat-1"))[0]
        other = await mesh.add_pod("llama-8", "node-2")
        restored = await other.endpoint.restore("chat-1")
        blocks = len(restored.blocks)
        assert restored.manifest.checkpoint_id == newest["checkpoint_id"] and not restored.fell_back_from
        assert [bytes(b) for b in restored.blocks] == expected("chat-1", blocks)
        assert 0 < blocks <= held[0]
        print(f"killed holding {held[0]} blocks; restored {blocks} (interval 0.5 s, one block per 50 ms)")
        await mesh.check(min_checkpoints=3)
    finally:
        if worker.poll() is None:
            worker.kill()


async def _periodic(mesh: Mesh, sid: str, count: int) -> bool:
    return len(await mesh.service.registry.checkpoints(sid)) >= count
