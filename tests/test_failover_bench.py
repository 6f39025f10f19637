"""bench.failover at its quick size: a 3-server NATS cluster of its own, a server SIGKILLed under a publishing and
requesting client (stream leader, then meta leader), the figures written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KEYS = {
    f"{figure}_{kind}"
    for figure in ("publish_worst_s", "request_worst_s", "rounds_after_kill", "clients_of_dead_server")
    for kind in ("stream", "meta")
}


def test_bench_failover_quick_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.failover", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "failover" and KEYS <= set(data), KEYS - set(data)
    assert data["rounds_after_kill_stream"] > 0 and data["rounds_after_kill_meta"] > 0
