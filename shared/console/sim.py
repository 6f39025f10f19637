"""``gpuwarden sim run|fault|label|scale`` (and ``fault``): the SIMULATED cluster driven as a person drives a real
one: the simulation started, a fault injected, a node labelled, a deployment scaled."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys

from shared.console.state import REDIS_ONLY, CommandError, UsageError, command_env, command_settings
from shared.contract.subjects import Subjects


def cmd_sim_run(args: argparse.Namespace) -> int:
    env = command_env()
    os.execve(sys.executable, [sys.executable, "-m", "shared.sim", *args.sim_args], env)
    return 0  # not reached


def cmd_sim_fault(args: argparse.Namespace) -> int:
    from shared.sim.faults import run_fault

    return run_fault(args, command_settings())


_LABEL_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def label_changes(items: list[str]) -> dict[str, str | None]:
    """``KEY=VALUE`` sets a label, ``KEY-`` removes it (kubectl's spelling); keys and values as Kubernetes allows."""
    changes: dict[str, str | None] = {}
    for item in items:
        if item.endswith("-") and "=" not in item:
            key, value = item[:-1], None
        elif "=" in item:
            key, value = item.split("=", 1)
        else:
            raise UsageError(f"sim label: {item!r}: expected KEY=VALUE or KEY-")
        if not _LABEL_KEY_RE.match(key):
            raise UsageError(f"sim label: {key!r} is not a label key ([prefix/]name, name up to 63 characters)")
        if value is not None and not _LABEL_VALUE_RE.match(value):
            raise UsageError(f"sim label: {value!r} is not a label value (up to 63 letters, digits, '-', '_', '.')")
        changes[key] = value
    return changes


def cmd_sim_label(args: argparse.Namespace) -> int:
    """Label a SIMULATED node, as ``kubectl label node`` does a real one (e.g. ``nvidia.com/mig.config``)."""
    from shared.plumbing.configsync import redis_client
    from shared.sim.cluster import SimCluster

    changes = label_changes(args.labels)
    settings = command_settings(REDIS_ONLY)

    async def main() -> int:
        cluster = SimCluster(redis_client(settings.redis), Subjects(settings.root), owns_client=True)
        try:
            if await cluster.node(args.node) is None:
                names = ", ".join(n.name for n in await cluster.nodes()) or "none: is the simulation running?"
                raise UsageError(f"sim label: no simulated node {args.node!r} (nodes: {names})")
            await cluster.set_node_labels(args.node, changes)
            node = await cluster.node(args.node)
        finally:
            await cluster.close()
        print(json.dumps(dict(node.labels) if node else {}, indent=2, sort_keys=True))
        return 0

    return asyncio.run(main())


def cmd_sim_scale(args: argparse.Namespace) -> int:
    """Set a SIMULATED deployment's replicas, as ``kubectl scale deployment`` does a real one's: its ReplicaSet
    removes the pods with the lowest ``controller.kubernetes.io/pod-deletion-cost`` first (the router's), each
    through its preStop save. Prints the deployment's replicas and its pods' phases after the change."""
    from shared.plumbing.configsync import redis_client
    from shared.sim.cluster import SimCluster

    namespace, _, name = str(args.deployment).partition("/")
    settings = command_settings(REDIS_ONLY)

    async def main() -> int:
        cluster = SimCluster(redis_client(settings.redis), Subjects(settings.root), owns_client=True)
        try:
            known = await cluster.deployments()
            if not any((d.namespace, d.name) == (namespace, name) for d in known):
                names = ", ".join(f"{d.namespace}/{d.name}" for d in known) or "none: is the simulation running?"
                raise CommandError(f"sim scale: no simulated deployment {args.deployment!r} (deployments: {names})")
            await cluster.scale(namespace, name, int(args.replicas))
            await cluster.tick()  # its ReplicaSet acts at once: pods made, or chosen to go (Terminating)
            pods = {p.name: p.phase for p in await cluster.pods(namespace=namespace) if p.deployment == name}
        finally:
            await cluster.close()
        print(json.dumps({"deployment": args.deployment, "replicas": int(args.replicas), "pods": pods}, indent=2))
        return 0

    return asyncio.run(main())
