"""``gpuwarden drain``, ``checkpoint``, ``uncordon`` and ``upgrade-driver``: acting on nodes, with progress for
people or one JSON document for scripts (the work is ``operations``' and the drain client's)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
from typing import Any

from shared.console.state import UsageError
from shared.contract.node import DrainCompleted
from shared.contract.registry import codec


def _check_deadline(deadline_s: float) -> None:
    """A drain's deadline the checkpoint service would refuse is refused here, before anything is cordoned or
    published."""
    from shared.contract.node import deadline_problem

    problem = deadline_problem(deadline_s)
    if problem:
        raise UsageError(f"--deadline {deadline_s:g}: {problem}")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Save every session on the node (a drain request, as the checkpoint service takes it): no cordon, no
    eviction. ``--wait`` prints the verdict. Named, asked and waited for by the one drain client."""
    from shared.clients.drains import DrainClient, InvalidDrain, RecordReader, drain_request

    _check_deadline(args.deadline)
    drain_id = args.drain_id or DrainClient.new_id(f"drain-{args.node}")
    try:
        drain_request(args.node, drain_id, args.reason, args.requested_by, args.deadline)
    except InvalidDrain as exc:
        raise UsageError(f"checkpoint: {exc}") from None

    async def main() -> int:
        from shared.console.client import open_mesh
        from shared.console.operations import known_node

        mesh = await open_mesh()
        bus = mesh.bus
        drains = DrainClient(bus.publish, args.requested_by, RecordReader(bus))
        try:
            if mesh.cluster is not None:  # a node the cluster lacks is refused here, before anything is published
                await known_node(mesh, args.node)
            async with drains.watch(bus, drain_id, args.node) if args.wait else contextlib.nullcontext() as verdict:
                await drains.ask(drain_id, args.node, args.reason, args.deadline)
                print(json.dumps({"drain_requested": args.node, "drain_id": drain_id}))
                if verdict is None:
                    return 0
                try:
                    result = await verdict.wait(args.deadline + 30)
                except TimeoutError:
                    print(json.dumps({"drain_id": drain_id, "verdict": "no verdict in time"}))
                    return 1
                print(codec.encode(result).decode())
                return 0 if isinstance(result, DrainCompleted) else 1
        finally:
            await mesh.close()

    return asyncio.run(main())


def cmd_drain_node(args: argparse.Namespace) -> int:
    _check_deadline(args.deadline)
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from shared.console import operations, render

    err = render.console(stderr=True)
    live = err.is_terminal and not args.json
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
    )
    tasks: dict[str, Any] = {}

    def report(phase: operations.DrainPhase, done: dict[str, Any]) -> None:
        if phase == "cordoned":
            total = done["sessions"]
            if live:
                tasks["save"] = progress.add_task(f"save {total} session(s)", total=max(total, 1))
            elif not args.json:
                err.print(f"{args.node} cordoned; saving {total} session(s)")
        elif phase == "saving" and live and "done" in done:
            progress.update(tasks["save"], completed=done["done"])
        elif phase == "saved":
            if live:
                progress.update(tasks["save"], completed=progress.tasks[0].total)
                tasks["evict"] = progress.add_task("evict pods", total=None)
            elif not args.json:
                err.print(f"saved {done['sessions']} session(s), {done['bytes']} bytes; evicting pods")
        elif phase == "evicting" and live:
            progress.update(tasks["evict"], description=f"evict pods ({done['pods_left']} left)")
        elif phase == "moving":
            if live:
                if "move" not in tasks:
                    progress.update(tasks["evict"], total=1, completed=1, description="evict pods (none left)")
                    tasks["move"] = progress.add_task("restore + verify elsewhere", total=max(done["total"], 1))
                progress.update(tasks["move"], completed=done["done"])

    async def main() -> int:
        from shared.console.client import open_mesh

        mesh = await open_mesh()
        try:
            with progress if live else contextlib.nullcontext():
                result = await operations.drain(
                    mesh,
                    args.node,
                    wait=args.wait,
                    timeout=args.timeout,
                    deadline_s=args.deadline,
                    reason=args.reason,
                    requested_by=args.requested_by,
                    drain_id=args.drain_id,
                    report=report,
                )
        finally:
            await mesh.close()
        if args.json:
            print(json.dumps(result.as_json()))
        if not result.ok:
            if not args.json:
                print(f"gpuwarden drain: {args.node}: {result.reason}", file=sys.stderr)
            return 1
        if not args.json:
            restored = [m for m in result.sessions if m.outcome == "restored"]
            ended = [m for m in result.sessions if m.outcome == "ended"]
            where = sorted({m.new_node for m in restored})
            line = (
                f"{args.node} drained: {result.sessions_committed} session(s) saved in {result.save_s:.1f}s, "
                f"{len(result.pods_evicted)} pod(s) evicted"
            )
            if args.wait:
                line += f", {len(restored)} restored and verified on {', '.join(where) or '-'}"
                line += f" ({len(ended)} ended by their clients)" if ended else ""
                line += f" in {result.save_s + result.evict_s + result.move_s:.1f}s"
            print(line + f"; still cordoned: `gpuwarden uncordon {args.node}`")
        return 0

    return asyncio.run(main())


def cmd_uncordon(args: argparse.Namespace) -> int:
    from shared.console import operations

    async def main() -> int:
        from shared.console.client import open_mesh

        mesh = await open_mesh()
        try:
            changed = await operations.uncordon(mesh, args.node, force=args.force)
        finally:
            await mesh.close()
        print(f"{args.node} uncordoned" if changed else f"{args.node} was schedulable already")
        return 0

    return asyncio.run(main())


def cmd_upgrade_driver(args: argparse.Namespace) -> int:
    from shared.contract.configdocs import DRIVER_VERSION_PATTERN

    if not re.match(DRIVER_VERSION_PATTERN, args.version):
        raise UsageError(f"{args.version!r} is not a driver version like 560.35.03")
    if args.max_parallel is not None and args.max_parallel < 1:
        raise UsageError("--max-parallel must be at least 1")
    from rich.progress import BarColumn, Progress, TextColumn

    from shared.console import operations, render

    err = render.console(stderr=True)
    live = err.is_terminal and not args.json
    progress = Progress(
        TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.fields[state]}"), console=err
    )
    tasks: dict[str, Any] = {}
    last: dict[str, str] = {}
    latest: list[Any] = []
    steps = len(operations.STATE_ORDER)

    def report(nodes: list[Any]) -> None:
        latest[:] = nodes
        for n in nodes:
            state = "done" if operations.node_done(n, args.version) else n.state or "waiting for a slot"
            if live:
                if n.node not in tasks:
                    tasks[n.node] = progress.add_task(n.node, total=steps, state="")
                at = (
                    steps
                    if state == "done"
                    else operations.STATE_ORDER.index(n.state) + 1
                    if n.state in operations.STATE_ORDER
                    else 0
                )
                progress.update(tasks[n.node], completed=at, state=f"{state} ({n.version or '?'})")
            elif not args.json and last.get(n.node) != state:
                err.print(f"{n.node}: {state} (driver {n.version or '?'})")
            last[n.node] = state

    async def main() -> int:
        from shared.console.client import open_mesh

        mesh = await open_mesh()
        try:
            version = await operations.set_driver(mesh, args.version, args.max_parallel)
            if not args.json:
                print(f"driver document v{version}: desired_version {args.version}, auto_upgrade on")
            if not args.wait:
                return 0
            with progress if live else contextlib.nullcontext():
                ok, why = await operations.follow_upgrade(
                    mesh,
                    args.version,
                    args.timeout,
                    report,
                    lambda why: err.print(f"upgrade-driver: {why}", markup=False),
                )
            nodes = latest
        finally:
            await mesh.close()
        if args.json:
            print(json.dumps({"version": args.version, "ok": ok, "reason": why, "nodes": [n.__dict__ for n in nodes]}))
        elif ok:
            print(f"every node runs driver {args.version}: {', '.join(n.node for n in nodes)}")
        else:
            print(f"gpuwarden upgrade-driver: {why}", file=sys.stderr)
        return 0 if ok else 1

    return asyncio.run(main())
