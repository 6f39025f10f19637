"""``gpuwarden status`` and ``events``: what the mesh holds now and what happened, as tables for people (``--watch``,
``--follow``) or as JSON (the work is ``snapshot``'s and ``events``')."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import functools
import sys
from typing import Any

from shared.console.state import CommandError, UsageError
from shared.contract.registry import BY_KIND, codec


def cmd_status(args: argparse.Namespace) -> int:
    from shared.console import render, snapshot

    take = functools.partial(
        snapshot.take, node=args.node, pod=args.pod, deployment=args.deployment, max_sessions=args.sessions
    )

    async def main() -> int:
        from shared.console.client import open_mesh

        mesh = await open_mesh(read_only=True)
        samples = snapshot.SampleListener(mesh)
        try:
            await samples.start()
            if not args.watch:
                status = await take(mesh, samples, args.sample)
                if args.json:
                    sys.stdout.write(snapshot.to_json(status).decode() + "\n")
                else:
                    render.console().print(render.status_tables(status))
                return 0
            from rich.live import Live

            status = await take(mesh, samples, args.sample)
            with Live(render.status_tables(status), console=render.console(), auto_refresh=False) as live:
                while True:
                    await asyncio.sleep(args.interval)
                    again = await take(mesh, samples)
                    live.update(render.status_tables(again), refresh=True)
        finally:
            await samples.stop()
            await mesh.close()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0


def cmd_events(args: argparse.Namespace) -> int:
    from shared.console import events, render

    kinds = None
    if args.kind:
        kinds = events.kinds_matching(args.kind)
        if not kinds:
            names = sorted({k.rsplit(".", i)[0] for k in BY_KIND for i in range(k.count(".") + 1)})
            close = difflib.get_close_matches(args.kind, names, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            families = ", ".join(sorted({k.split(".")[0] for k in BY_KIND}))
            raise UsageError(f"--kind {args.kind}: no such event kind{hint} (kinds begin {families})")
    out = render.console()

    printed = False

    def show(found: list[Any]) -> None:
        nonlocal printed
        if args.json:
            for event in found:
                sys.stdout.write(codec.encode(event).decode() + "\n")
            sys.stdout.flush()
            return
        width = out.width
        if not printed and found:
            out.print(events.line(("time", "kind", "source", "what"), width), style="bold")
            printed = True
        for event in found:
            out.print(events.line(events.row(event), width))

    async def main() -> int:
        from shared.console.client import open_mesh

        mesh = await open_mesh(read_only=True)
        try:
            shown = await events.page_then_follow(mesh, kinds, args.limit, show, args.follow)
        finally:
            await mesh.close()
        if not shown:  # as grep: nothing matched is exit 1, and said
            what = f"of kind {args.kind} " if args.kind else ""
            raise CommandError(f"no event {what}is stored in {mesh.subjects.events_stream.name} (yet)")
        return 0

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0
