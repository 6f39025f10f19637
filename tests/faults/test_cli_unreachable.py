"""Every CLI command that needs a server says in one line which one does not answer, and exits non-zero: no
traceback, no client library's chatter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared.host.devservers import free_port

DRIVER_POLICY = '{"desired_version": "560.35.03"}'

NEEDS_REDIS = [
    ["config", "get", "driver"],
    ["config", "set", "driver", DRIVER_POLICY],
    ["sim", "label", "node-1", "nvidia.com/mig.config=all-1g.10gb"],
    ["sim", "fault", "xid", "--node", "node-1", "--gpu", "0", "--code", "79"],
]
NEEDS_NATS = [
    ["drain", "node-1"],
    ["checkpoint", "node-1"],
    ["uncordon", "node-1"],
    ["status"],
    ["events"],
    ["upgrade-driver", "560.35.03"],
    ["deadletters"],
    ["agent", "final-save", "--pod", "llama-1", "--deadline", "1"],
    ["where", "s1"],
]


def test_commands_say_in_one_line_which_server_is_unreachable(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    redis_url = f"redis://gw:s3cret@127.0.0.1:{port}/0"
    nats_url = f"nats://127.0.0.1:{port}"
    env = dict(
        os.environ,
        GPUWARDEN_HOME=str(tmp_path),  # no state file of a running mesh either
        GPUWARDEN_REDIS_URL=redis_url,
        GPUWARDEN_NATS_URL=nats_url,
    )
    runs = {
        tuple(argv): subprocess.Popen(
            [sys.executable, "-m", "shared.cli", *argv],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in NEEDS_REDIS + NEEDS_NATS
    }
    expected = {
        **{tuple(a): f"Redis at redis://gw:***@127.0.0.1:{port}/0 is unreachable" for a in NEEDS_REDIS},
        **{tuple(a): f"NATS at {nats_url} is unreachable" for a in NEEDS_NATS},
    }
    for argv, proc in runs.items():
        out, err = proc.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert proc.returncode == 1, (argv, proc.returncode, err)
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith("gpuwarden ") and lines[0].endswith(expected[argv]), (argv, err)
        assert "s3cret" not in err and out == "", (argv, out, err)
