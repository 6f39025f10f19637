"""``gpuwarden rollout DEPLOYMENT VERSION [--wait]``: begin a model rollout (a compare-and-set of the ``models``
document) and, with ``--wait``, show its progress until the checkpoint service switches or aborts it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from shared.console.state import CommandError, named
from shared.contract.subjects import Subjects
from shared.plumbing.errors import InvalidConfig
from shared.plumbing.settings import Settings


def add_rollout_parser(sub: Any, settings: Callable[[], Settings]) -> None:
    p = sub.add_parser("rollout", help="move DEPLOYMENT (namespace/name) to model VERSION without mixing versions")
    p.add_argument("deployment", help="namespace/name")
    p.add_argument("version", help="the model version to serve, as the pods' engine names it")
    p.add_argument("--from", dest="from_version", default="", help="the version served now, if none is recorded")
    p.add_argument("--pinned", choices=("finish", "end"), default="finish", help="what sessions of the old version do")
    p.add_argument("--end-reason", default="", help="why sessions are ended (with --pinned end)")
    p.add_argument("--prepare-timeout", type=float, default=120.0, help="seconds the pods have to get ready")
    p.add_argument("--min-ready", type=float, default=1.0, help="fraction of the pods that must be ready (0-1]")
    p.add_argument("--wait", action="store_true", help="show progress until switched or aborted")
    p.add_argument("--by", default="cli", help="who asks, as the models document records it (default cli)")
    p.set_defaults(func=lambda args: cmd_rollout(args, settings()))


async def known_deployment(settings: Settings, namespace: str, name: str) -> None:
    """``CommandError`` naming the deployments there are, unless the cluster has ``namespace/name``; nothing is
    checked where no cluster can be read (a real backend without a Kubernetes configuration)."""
    from shared.ports.cluster import ClusterError, ClusterPort
    from shared.wiring import Wiring

    wiring = Wiring(settings, Subjects(settings.root))
    cluster: ClusterPort | None = wiring.attached_cluster()
    try:
        if cluster is None:
            cluster = await wiring.cluster()
        found = await cluster.deployments()
    except ClusterError:
        return
    finally:
        if cluster is not None:
            await cluster.close()
    if not any(d.namespace == namespace and d.name == name for d in found):
        there = named(f"{d.namespace}/{d.name}" for d in found)
        raise CommandError(f"no deployment {namespace}/{name} in the cluster (deployments: {there})")


def cmd_rollout(args: argparse.Namespace, settings: Settings) -> int:
    from shared.clients.rollouts import RolloutRefused, begin_rollout, deployment_key, read_models
    from shared.plumbing.configsync import ConfigStore, redis_client

    namespace, _, name = args.deployment.partition("/")
    if not namespace or not name:
        print(f"gpuwarden rollout: {args.deployment!r} is not namespace/name", file=sys.stderr)
        return 2

    async def main() -> int:
        await known_deployment(settings, namespace, name)
        client = redis_client(settings.redis)
        store = ConfigStore(client, Subjects(settings.root))
        try:
            rollout = await begin_rollout(
                store,
                namespace,
                name,
                args.version,
                from_version=args.from_version,
                pinned_sessions=args.pinned,
                end_reason=args.end_reason,
                prepare_timeout_s=args.prepare_timeout,
                min_ready=args.min_ready,
                by=args.by,
            )
            print(json.dumps({"rollout_id": rollout.rollout_id, "from": rollout.from_version, "to": args.version}))
            if not args.wait:
                return 0
            key, started = deployment_key(namespace, name), time.monotonic()
            while True:
                _, doc = await read_models(store)
                current = doc.deployments[key].rollout
                if current is None or current.rollout_id != rollout.rollout_id:
                    print("gpuwarden rollout: the rollout was replaced", file=sys.stderr)
                    return 1
                if current.phase != "preparing":
                    print(json.dumps({"phase": current.phase, "reason": current.reason, "failed": current.failed}))
                    return 0 if current.phase == "switched" else 1
                print(f"preparing {key} -> {args.version}: {time.monotonic() - started:.0f}s", file=sys.stderr)
                await asyncio.sleep(1.0)
        except (RolloutRefused, InvalidConfig) as exc:
            print(f"gpuwarden rollout: {exc}", file=sys.stderr)
            return 2
        finally:
            await client.aclose()

    return asyncio.run(main())
