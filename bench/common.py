"""What every benchmark shares: the command line, a NATS server of its own, percentiles, targets and the report.

Each benchmark is ``python -m bench.<name> [--quick] [--nats-url URL] [--out PATH] [--strict]``. Without
``--nats-url`` it starts a private ``nats-server`` (JetStream, temporary store, free port) so a server already
running on the machine is never disturbed. It writes one JSON document, by default ``bench/results/<name>.json``:
the measured figures at the top level, then ``targets`` (each target, the value measured and whether it passed),
``params`` (the sizes used) and ``machine`` (where it ran).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class BenchOptions:
    name: str
    quick: bool
    nats_url: str | None
    out: Path
    strict: bool = False

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "full"


def default_out(name: str) -> Path:
    return RESULTS_DIR / f"{name}.json"


def parse_args(name: str, description: str = "", argv: Sequence[str] | None = None) -> BenchOptions:
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes and short runs (a smoke run, seconds)")
    parser.add_argument(
        "--nats-url",
        default=None,
        help="NATS server to use (default: start a private nats-server on a free port with a temporary store)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"where the JSON goes (default bench/results/{name}.json)"
    )
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)
    return BenchOptions(
        name=name,
        quick=args.quick,
        nats_url=args.nats_url,
        out=args.out or default_out(name),
        strict=args.strict,
    )


@contextlib.contextmanager
def nats_server(url: str | None = None) -> Iterator[str]:
    """The URL given, or a private JetStream server for the duration of the block (stopped and removed after)."""
    if url:
        yield url
        return
    from shared.host.devservers import NatsServer

    server = NatsServer().start()
    try:
        yield server.url
    finally:
        server.cleanup()


def drop_cache(path: Path) -> None:
    """Every file under ``path`` (or the file itself) out of the page cache, so that the next read comes from the
    disk: fsync, then ``posix_fadvise(DONTNEED)``, which needs no privilege for files one can open."""
    files = [str(path)] if path.is_file() else [os.path.join(r, n) for r, _, names in os.walk(path) for n in names]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- statistics -------------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} is not within 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(seconds: Sequence[float], prefix: str) -> dict[str, float]:
    """p50, p90, p99, max and mean of latencies given in seconds, as ``<prefix>_p50_ms`` ... in milliseconds."""
    if not seconds:
        return {}
    ms = [s * 1000.0 for s in seconds]
    return {
        f"{prefix}_p50_ms": round(percentile(ms, 50), 3),
        f"{prefix}_p90_ms": round(percentile(ms, 90), 3),
        f"{prefix}_p99_ms": round(percentile(ms, 99), 3),
        f"{prefix}_max_ms": round(max(ms), 3),
        f"{prefix}_mean_ms": round(sum(ms) / len(ms), 3),
    }


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


# -- targets ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A figure a benchmark must reach: ``results[key] <op> threshold`` with op ``>=`` or ``<=``."""

    key: str
    op: str
    threshold: float
    description: str

    def check(self, results: dict[str, Any]) -> dict[str, Any]:
        measured = results.get(self.key)
        if not isinstance(measured, int | float) or isinstance(measured, bool) or math.isnan(measured):
            passed = False
            measured = None
        elif self.op == ">=":
            passed = measured >= self.threshold
        elif self.op == "<=":
            passed = measured <= self.threshold
        else:
            raise ValueError(f"target {self.key}: unknown operator {self.op!r}")
        return {
            "key": self.key,
            "target": f"{self.op} {self.threshold:g}",
            "op": self.op,
            "threshold": self.threshold,
            "measured": measured,
            "passed": passed,
            "description": self.description,
        }


# -- where it ran -----------------------------------------------------------------------------------------------
def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def nats_server_binary_version() -> str | None:
    """The version of the nats-server binary the project would start, if there is one."""
    try:
        from shared.host.devservers import nats_server_binary

        out = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True, timeout=5)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.split()[-1].lstrip("v") if text else None


def machine_info(nats_server_version: str | None = None) -> dict[str, Any]:
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "nats_py": _package_version("nats-py"),
        "msgspec": _package_version("msgspec"),
        "nats_server": nats_server_version or nats_server_binary_version(),
        "load_avg": _load_avg(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _load_avg() -> list[float] | None:
    """1, 5 and 15 minute load averages: on a shared machine, read the figures against them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


# -- the report -------------------------------------------------------------------------------------------------
def build_report(
    options: BenchOptions,
    results: dict[str, Any],
    targets: Sequence[Target],
    params: dict[str, Any],
    machine: dict[str, Any],
) -> dict[str, Any]:
    checked = [t.check(results) for t in targets]
    return {
        "benchmark": options.name,
        "mode": options.mode,
        **results,
        "targets": checked,
        "targets_passed": all(t["passed"] for t in checked),
        "params": params,
        "machine": machine,
    }


def write_report(report: dict[str, Any], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    tmp.replace(out)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:,.1f}"
        return f"{value:.3f}"
    return str(value)


def render_table(report: dict[str, Any]) -> str:
    skip = {"benchmark", "mode", "targets", "targets_passed", "params", "machine"}
    rows = [(k, _fmt(v)) for k, v in report.items() if k not in skip and not isinstance(v, dict | list)]
    width = max((len(k) for k, _ in rows), default=10)
    machine = report.get("machine", {})
    lines = [
        f"== bench.{report.get('benchmark')} ({report.get('mode')}) — "
        f"{machine.get('cpu_count')} CPUs, Python {machine.get('python')}, nats-server {machine.get('nats_server')}",
    ]
    lines += [f"  {k:<{width}}  {v:>14}" for k, v in rows]
    targets = report.get("targets") or []
    if targets:
        lines.append("  targets:")
        twidth = max(len(t["key"]) for t in targets)
        for t in targets:
            verdict = "PASS" if t["passed"] else "FAIL"
            lines.append(
                f"    [{verdict}] {t['key']:<{twidth}}  {_fmt(t['measured']):>12}  (target {t['target']})"
                f"  {t['description']}"
            )
    return "\n".join(lines)


def finish(
    options: BenchOptions,
    results: dict[str, Any],
    targets: Sequence[Target],
    params: dict[str, Any],
    machine: dict[str, Any],
) -> dict[str, Any]:
    """Build the report, write it to ``options.out``, print the table; returns the report."""
    report = build_report(options, results, targets, params, machine)
    path = write_report(report, options.out)
    print(render_table(report))
    print(f"  written to {path}")
    sys.stdout.flush()
    return report


def exit_code(options: BenchOptions, report: dict[str, Any]) -> int:
    return 1 if options.strict and not report.get("targets_passed", False) else 0


class Counting:
    """A port whose calls are counted by name (what a component asks of the registry or the store), passing every
    call through to ``inner``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted
