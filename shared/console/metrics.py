"""``gpuwarden metrics scrape``: the metrics service's scrape of one page, run as a process (the CLI imports no
service)."""

from __future__ import annotations

import argparse
import os
import sys


def cmd_metrics_scrape(args: argparse.Namespace) -> int:
    """Runs ``services.metrics.scrape_cli`` as a process: the CLI imports no service."""
    argv = [sys.executable, "-m", "services.metrics.scrape_cli", args.url, "--timeout", str(args.timeout)]
    if args.json:
        argv.append("--json")
    os.execv(sys.executable, argv)
    return 0  # not reached
