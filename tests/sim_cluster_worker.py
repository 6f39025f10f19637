"""A separate process that drives the simulated cluster for ``tests/test_sim_cluster.py``.

``python -m tests.sim_cluster_worker <redis-url> <root>`` reads one JSON command per line on stdin and answers
each with one JSON line on stdout: ``{"ok": result}`` or ``{"error": "..."}``. The spec comes from
``GPUWARDEN_SIM_SPEC``, as it does for a service.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from shared.contract.subjects import Subjects
from shared.plumbing.settings import RedisSettings
from shared.sim.cluster import SimCluster


async def serve(redis_url: str, root: str) -> None:
    cluster: SimCluster | None = None
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            op, args = command["op"], command.get("args", [])
            try:
                if op == "create":
                    cluster = await SimCluster.create(RedisSettings(url=redis_url), Subjects(root))
                    result: Any = {"created": cluster.created}
                else:
                    assert cluster is not None, "send create first"
                    result = await run(cluster, op, args)
                reply: dict[str, Any] = {"ok": result}
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        if cluster is not None:
            await cluster.close()


async def run(cluster: SimCluster, op: str, args: list[Any]) -> Any:
    match op:
        case "cordon":
            await cluster.cordon(*args)
        case "uncordon":
            await cluster.uncordon(*args)
        case "scale":
            await cluster.scale(*args)
        case "evict":
            return (await cluster.evict(*args)).value
        case "prestop_done":
            await cluster.mark_prestop_done(*args)
        case "label_burst":
            node, prefix, count = args
            for i in range(count):
                await cluster.set_node_labels(node, {f"{prefix}-{i}": str(i)})
        case _:
            raise ValueError(f"unknown op {op!r}")
    return None


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
