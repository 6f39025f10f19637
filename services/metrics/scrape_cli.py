"""``gpuwarden metrics scrape URL [--json]`` (``python -m services.metrics.scrape_cli``): fetch one dcgm-exporter
page and print what the metrics service derives from it, per GPU and per pod, for people debugging a node.

Exit status: 0 read (problems in the page are listed, not fatal), 1 the page could not be fetched, 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from shared.adapters.exposition import ExpositionParser
from shared.adapters.metrics import DcgmScrape
from shared.ports.metrics import MetricsSourceError, SourceRead

from .aggregate import Aggregator, deployment_from_pod_name
from .samples import observation

FIELDS = (
    "gpu_util",
    "mem_copy_util",
    "mem_used_mib",
    "mem_free_mib",
    "mem_reserved_mib",
    "power_w",
    "temperature_c",
    "xid",
    "energy_mj",
)


def derive(read: SourceRead) -> dict[str, Any]:
    """Per-GPU entries keyed by UUID (``<uuid>/gi<N>`` for a MIG instance) and per-pod figures of one read.
    An unknown value is null, never 0."""
    gpus: dict[str, Any] = {}
    for r in sorted(read.readings, key=lambda r: (r.node, r.gpu, r.gpu_instance_id)):
        entry: dict[str, Any] = {"gpu_util": r.util}
        entry.update({f: r.values.get(f) for f in FIELDS if f != "gpu_util"})
        entry.update(
            node=r.node,
            gpu=r.gpu,
            uuid=r.uuid,
            model=r.model,
            mig_profile=r.mig_profile or None,
            gpu_instance_id=r.gpu_instance_id or None,
            pod=r.pod or None,
            namespace=r.namespace or None,
            container=r.container or None,
            invalid=sorted(set(r.invalid)),
        )
        gpus[r.key] = entry
    aggregator = Aggregator(window_s=1.0, stale_after_s=1.0)
    for r in read.readings:
        aggregator.observe(observation(r, read.read_at))
    pods = {
        f"{a.namespace}/{a.name}": {
            "deployment": deployment_from_pod_name(a.name),
            "gpus": a.gpus,
            "mean_util": a.mean_util,
            "max_util": a.max_util,
            "mem_pressure": a.mem_pressure,
        }
        for a in aggregator.aggregates(read.read_at)
        if a.scope == "pod"
    }
    return {
        "url": read.source,
        "read_at": read.read_at,
        "series": read.series,
        "gpus": gpus,
        "pods": pods,
        "problems": read.problems,
    }


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(derived: dict[str, Any]) -> str:
    lines = [f"{derived['url']}: {len(derived['gpus'])} GPU(s), {derived['series']} samples"]
    lines.append(f"  {'GPU':<52} {'util%':>6} {'used MiB':>9} {'free MiB':>9} {'W':>6} {'C':>4}  pod")
    for key, g in derived["gpus"].items():
        pod = f"{g['namespace']}/{g['pod']}" if g["pod"] else "-"
        lines.append(
            f"  {key:<52} {_fmt(g['gpu_util']):>6} {_fmt(g['mem_used_mib'], 0):>9} {_fmt(g['mem_free_mib'], 0):>9} "
            f"{_fmt(g['power_w']):>6} {_fmt(g['temperature_c'], 0):>4}  {pod}"
        )
    if derived["pods"]:
        lines.append(f"  {'pod':<40} {'gpus':>4} {'mean%':>6} {'max%':>6} {'mem':>5}")
        for name, p in derived["pods"].items():
            lines.append(
                f"  {name:<40} {p['gpus']:>4} {_fmt(p['mean_util']):>6} {_fmt(p['max_util']):>6} "
                f"{_fmt(p['mem_pressure'], 2):>5}"
            )
    for problem in derived["problems"]:
        lines.append(f"  problem: {problem}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuwarden metrics scrape", description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the exporter page, e.g. http://10.0.0.7:9400/metrics")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for the whole fetch (default 5)")
    parser.add_argument(
        "--parser", choices=("cached", "reference"), default="reference", help="exposition parser (default reference)"
    )
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://", "https://")):
        print(f"gpuwarden metrics scrape: {args.url!r}: expected an http:// or https:// URL", file=sys.stderr)
        return 2

    async def scrape_once() -> SourceRead:
        source = DcgmScrape(args.url, timeout=args.timeout, parser=ExpositionParser(engine=args.parser))
        try:
            return await source.read()
        finally:
            await source.close()

    try:
        read = asyncio.run(scrape_once())
    except MetricsSourceError as exc:
        print(f"gpuwarden metrics scrape: {exc}", file=sys.stderr)
        return 1
    derived = derive(read)
    print(json.dumps(derived, indent=2) if args.json else render(derived))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
