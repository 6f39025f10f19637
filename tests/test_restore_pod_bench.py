"""bench.restore_pod runs end to end at its quick sizes and writes the figures it promises. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench import restore_pod


def test_bench_restore_pod_restores_every_session_and_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "restore_pod.json"
    assert restore_pod.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "restore_pod" and data["mode"] == "quick"
    small, large = restore_pod.QUICK_SIZES
    assert data[f"restored_{small}"] == small and data[f"restored_{large}"] == large  # every session came back
    for n in (small, large):
        assert data[f"restore_s_{n}"] > 0 and data[f"service_cpu_s_{n}"] >= 0 and data[f"pods_cpu_s_{n}"] > 0
    assert data["linear_growth"] == large / small and data["restore_growth"] > 0
    assert [t["key"] for t in data["targets"]] == ["restore_growth"]
