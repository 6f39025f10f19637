"""The README's "Five minutes with it", run as written on a fresh ``GPUWARDEN_HOME``: the commands of its console
blocks, in their order, and the shape of each output compared with the README's (issue #35: the walk did not
reproduce). Shape, not text: addresses, ids, counts and timings change from run to run; what each line says, the
tables' columns, the nodes and services named, and what a step claims (a drained node, an unhealthy GPU on a node
that has a pod) must be the same in the README and in the run. Each pattern below is checked against both.

About three minutes on a 2-core machine: marked ``long`` (``make faults`` runs it). No timing is asserted."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

pytestmark = [pytest.mark.long, pytest.mark.timeout(900)]


def walk_blocks(text: str) -> list[tuple[str, list[str]]]:
    """The (command, output lines) of every ``$ gpuwarden ...`` in the walk's console blocks, in order."""
    section = text.split("## Five minutes with it", 1)[1].split("\n## ", 1)[0]
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", section, re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:].strip(), []))
            elif steps:
                steps[-1][1].append(line)
    return steps


# -- the shape of each command's output -----------------------------------------------------------------------------
UP = [
    ("running", r"gpuwarden is running \(SIMULATED GPUs and cluster\)"),
    ("servers", r"  NATS   nats://127\.0\.0\.1:\d+   Redis redis://127\.0\.0\.1:\d+/0   root gw"),
    ("service", r"  (\S+@node-\d|scaler|checkpoint|router|sim)\s+http://127\.0\.0\.1:\d+/healthz"),
    ("home", r"  home   \S+   \(state, logs, checkpoints, Redis data\)"),
    ("try", r"  try:   gpuwarden status      gpuwarden drain node-1 --wait      gpuwarden events --follow"),
    ("pid", r"  pid \d+; `gpuwarden down` stops everything"),
]
DRAIN = [
    ("cordoned", r"node-1 cordoned; saving \d+ session\(s\)"),
    ("saved", r"saved \d+ session\(s\), \d+ bytes; evicting pods"),
    (
        "drained",
        r"node-1 drained: \d+ session\(s\) saved in \d+\.\ds, 1 pod\(s\) evicted, \d+ restored and verified on "
        r"(node-[23](, node-[23])*|-)( \(\d+ ended by their clients\))? in \d+\.\ds; still cordoned: "
        r"`gpuwarden uncordon node-1`",
    ),
]
UNCORDON = [("uncordoned", r"node-1 uncordoned")]
UPGRADE = [
    ("document", r"driver document v\d+: desired_version 560\.35\.03, auto_upgrade on"),
    (
        "node",
        r"node-\d: (waiting for a slot|upgrade-required|checkpoint-required|pod-deletion-required|upgrade-done|"
        r"drain-required|done) \(driver (550\.54\.15|560\.35\.03)\)",
    ),
    ("every", r"every node runs driver 560\.35\.03: node-1, node-2, node-3"),
]
EVENTS = [
    ("header", r"time\s+kind\s+source\s+what"),
    (
        "row",
        r"\d\d:\d\d:\d\d\.\d{3}\s+node\.drain\.(requested|completed)\s+(cli|checkpoint|driver/node-\d)\s+"
        r"node=node-\d drain_id=\S+.*",
    ),
]
DOWN = [("stopped", r"stopped: \d+ processes \(run pid \d+, its services, NATS and Redis\); none left")]


def kinds(lines: list[str], patterns: list[tuple[str, str]], where: str) -> list[tuple[str, tuple[Any, ...]]]:
    """Each line's kind (the first pattern it matches entirely) and that match's groups; a line none matches fails."""
    out = []
    for line in lines:
        for kind, pattern in patterns:
            if (m := re.fullmatch(pattern, line.rstrip())) is not None:
                out.append((kind, m.groups()))
                break
        else:
            raise AssertionError(f"{where}: a line of no known shape: {line!r}")
    return out


def squeeze(seq: list[str]) -> list[str]:
    """``seq`` with runs of one kind as one (as many rows, or upgrade steps, as a run happens to print)."""
    return [k for i, k in enumerate(seq) if i == 0 or seq[i - 1] != k]


SESSION_CELLS = [
    r"llama-[0-9a-f]+-\d+",  # session
    r"llama-\d+( \(moving\))?",  # pod
    r"node-\d",  # node
    r"\d+",  # gen
    r"-|\d+(\.\d)? (B|KiB|MiB|GiB)",  # bytes (none before a first checkpoint)
    r"-|\d+",  # tokens
    r"none yet|\d+(s|m|h) ago",  # last checkpoint
    r"yes|gen \d+|-",  # restored+verified
]


def status_shape(lines: list[str], where: str) -> dict[str, Any]:
    """The tables of ``gpuwarden status``: their titles and columns, every node row, every session row's cells
    checked, the simulation's line; returns what a step claims about the nodes."""
    text = [line.rstrip() for line in lines]
    titles = [t for t in text if re.fullmatch(r"nodes \(SIMULATED\)|deployments|sessions \(\d+(, \d+ moving)?\)", t)]
    assert [t.split(" (")[0] for t in titles] == ["nodes", "deployments", "sessions"], f"{where}: {titles}"
    headers = [[c.strip() for c in t.strip("┃").split("┃")] for t in text if t.startswith("┃")]
    assert headers == [
        ["node", "schedulable", "driver", "upgrade", "pods", "sessions", "GPUs (health util mem MIG)"],
        ["deployment", "replicas", "desired", "model", "why", "requests landed"],
        ["session", "pod", "node", "gen", "bytes", "tokens", "last checkpoint", "restored+verified"],
    ], f"{where}: {headers}"
    rows = [[c.strip() for c in t.strip("│").split("│")] for t in text if t.startswith("│")]
    nodes: dict[str, dict[str, Any]] = {}
    current = ""
    for cells in rows:
        if len(cells) == 7:  # a node, or its next GPU
            if cells[0]:
                current = cells[0]
                assert re.fullmatch(r"yes|cordoned", cells[1]) and re.fullmatch(r"\d+", cells[4]), f"{where}: {cells}"
                nodes[current] = {"pods": int(cells[4]), "sessions": int(cells[5]), "gpus": []}
            assert re.fullmatch(r"\d:(ok|UNHEALTHY) (\d+%|\?) \d+M/79\.6G", cells[6]), f"{where}: {cells}"
            nodes[current]["gpus"].append(cells[6].split()[0])
        elif len(cells) == 6:
            assert cells[0] == "llm/llama" and re.fullmatch(r"\d+", cells[1]), f"{where}: {cells}"
            landed = r"-|holder \d+, prefetched \d+, cold \d+(, [a-z ]+ \d+)*"
            assert re.fullmatch(landed, cells[5]), f"{where}: {cells[5]!r} is not {landed!r}"
        else:
            assert len(cells) == 8, f"{where}: {cells}"
            for cell, pattern in zip(cells, SESSION_CELLS, strict=True):
                assert re.fullmatch(pattern, cell), f"{where}: {cell!r} is not {pattern!r} in {cells}"
            assert (cells[6] == "none yet") == (cells[4] == "-"), f"{where}: a size without a checkpoint: {cells}"
    assert sorted(nodes) == ["node-1", "node-2", "node-3"], f"{where}: {sorted(nodes)}"
    sim = [t for t in text if t.startswith("simulation:")]
    assert len(sim) == 1 and re.fullmatch(
        r"simulation: requests \d+  served \d+  restored \d+  started_fresh \d+  ended \d+  lost 0", sim[0]
    ), f"{where}: {sim}"
    assert re.fullmatch(r"as of \d\d:\d\d:\d\d", text[-1]), f"{where}: {text[-1]!r}"
    return nodes


def compare(command: str, written: list[str], seen: list[str], step: int) -> None:
    """The shape of the README's output of ``command`` and of the run's agree."""
    sub = command.split()[1]
    here = f"step {step} `{command}`"
    if sub == "up":
        a, b = kinds(written, UP, f"README {here}"), kinds(seen, UP, f"run {here}")
        assert [k for k, _ in a] == [k for k, _ in b], f"{here}: {written} vs {seen}"
        assert [g for k, g in a if k == "service"] == [g for k, g in b if k == "service"], here
    elif sub == "status":
        claims = [status_shape(written, f"README {here}"), status_shape(seen, f"run {here}")]
        if step > 4:  # after the XID: the GPU the fault names is unhealthy, on a node that has a pod
            node, gpu = FAULT
            for nodes in claims:
                assert f"{gpu}:UNHEALTHY" in nodes[node]["gpus"] and nodes[node]["pods"] >= 1, f"{here}: {nodes}"
    elif sub == "fault":
        for lines in (written, seen):
            (line,) = [x for x in lines if x.strip()]
            answer = json.loads(line)
            node, gpu = FAULT
            assert answer["ok"] is True and answer["simulated"] is True, answer
            assert re.fullmatch(rf"XID 79 raised on {node} GPU {gpu} \(GPU-[0-9a-f-]+\)", answer["applied"]), answer
    else:
        patterns = {"drain": DRAIN, "uncordon": UNCORDON, "upgrade-driver": UPGRADE, "events": EVENTS, "down": DOWN}
        a, b = kinds(written, patterns[sub], f"README {here}"), kinds(seen, patterns[sub], f"run {here}")
        assert squeeze([k for k, _ in a]) == squeeze([k for k, _ in b]), f"{here}: {written} vs {seen}"


FAULT = ("node-2", "0")
"""Where the walk's XID is raised: a node that still has a pod after node-1's drain and uncordon."""


def test_the_readme_walk_reproduces(tmp_path: Path) -> None:
    steps = walk_blocks(README.read_text())
    commands = [command for command, _ in steps]
    assert [c.split()[:2] for c in commands] == [
        ["gpuwarden", word]
        for word in ("up", "status", "drain", "uncordon", "fault", "status", "upgrade-driver", "events", "down")
    ], commands
    assert f"--node {FAULT[0]} --gpu {FAULT[1]}" in commands[4], commands[4]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env.update(GPUWARDEN_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), COLUMNS="160")
    ran: list[str] = []
    try:
        for step, (command, written) in enumerate(steps):
            argv = shlex.split(command)[1:]
            done = subprocess.run(  # stdout and stderr in one pipe, in the order a terminal shows them
                [sys.executable, "-m", "shared.cli", *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=300,
            )
            seen = done.stdout.splitlines()
            ran.append(f"$ {command}  (exit {done.returncode})\n" + "\n".join(seen))
            assert done.returncode == 0, "\n\n".join(ran)
            compare(command, [w for w in written if w.strip()], [s for s in seen if s.strip()], step)
    finally:
        print("\n\n".join(ran))
        subprocess.run(
            [sys.executable, "-m", "shared.cli", "down"], env=env, capture_output=True, text=True, timeout=120
        )
