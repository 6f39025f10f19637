"""The CLI as a newcomer meets it, without a mesh running: no mesh is one line that says how to start one, a
read-only command pointed at a NATS that is not a mesh's creates nothing there, every usage mistake prints the
subcommand's usage and a suggestion (exit 2), every lookup that matches nothing names what exists (exit 1), and
``config set`` states what it changes and never resets a field the user did not name unasked.

Commands run in this process (``shared.cli.main``), with the environment a user would have."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from shared import cli
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import NatsSettings
from shared.sim.cluster import SimCluster
from tests.conftest import Servers

NO_MESH = (
    "no mesh is running under GPUWARDEN_HOME={home}{why}; `gpuwarden up --detach` starts one there, or set "
    "GPUWARDEN_NATS_URL and GPUWARDEN_REDIS_URL to reach one elsewhere"
)


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A newcomer's shell: a home of its own with nothing running, no GPUWARDEN_ variable set."""
    for name in list(os.environ):
        if name.startswith("GPUWARDEN_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    monkeypatch.setenv("GPUWARDEN_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "200")
    yield home


def gpuwarden(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    """Exit status, stdout and stderr's lines of one command."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own exit
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def mesh_env(monkeypatch: pytest.MonkeyPatch, servers: Servers, root: str) -> None:
    monkeypatch.setenv("GPUWARDEN_NATS_URL", servers.nats_url)
    monkeypatch.setenv("GPUWARDEN_REDIS_URL", servers.redis_url)
    monkeypatch.setenv("GPUWARDEN_ROOT", root)


NEEDS_A_MESH = [
    ["status"],
    ["events"],
    ["where", "s1"],
    ["deadletters"],
    ["drain", "node-1"],
    ["checkpoint", "node-1"],
    ["uncordon", "node-1"],
    ["upgrade-driver", "560.35.03"],
    ["config", "get", "driver"],
    ["config", "set", "driver", "{}"],
    ["publish", '{"kind": "node.cordoned", "node": "node-1"}'],
    ["rollout", "llm/llama", "v2"],
    ["sim", "label", "node-1", "a=b"],
    ["fault", "xid", "--node", "node-1", "--gpu", "0", "--code", "79"],
    ["agent", "final-save", "--pod", "llama-1"],
]


def test_no_mesh_is_one_line_that_says_how_to_start_one(user: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NATS and Redis listen on their default ports on this machine: a command that fell back to them would not
    say this."""
    for argv in NEEDS_A_MESH:
        code, out, err = gpuwarden(capsys, *argv)
        assert (code, out, err) == (1, "", [f"gpuwarden {argv[0]}: " + NO_MESH.format(home=user, why="")]), argv
    assert not user.exists()  # nothing written either


def test_a_run_that_ended_or_half_the_urls_is_no_mesh_either(
    user: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, servers: Servers
) -> None:
    user.mkdir()
    (user / "run.json").write_text(json.dumps({"pid": 2**22 + 7, "nats_url": servers.nats_url, "redis_url": "x"}))
    ended = f" (its run.json names pid {2**22 + 7}, which has ended)"
    assert gpuwarden(capsys, "status") == (1, "", ["gpuwarden status: " + NO_MESH.format(home=user, why=ended)])

    (user / "run.json").unlink()
    monkeypatch.setenv("GPUWARDEN_NATS_URL", servers.nats_url)
    half = "; GPUWARDEN_NATS_URL alone is not enough: set GPUWARDEN_REDIS_URL too"
    assert gpuwarden(capsys, "config", "get", "driver") == (
        1,
        "",
        ["gpuwarden config: " + NO_MESH.format(home=user, why=half)],
    )


def test_read_only_commands_create_nothing_in_a_nats_that_is_not_a_mesh(
    user: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, servers: Servers, root: str
) -> None:
    """Another program's NATS and Redis (this machine's, under a root nobody uses): ``status``, ``events``,
    ``where`` and ``deadletters`` say no mesh is there, ``config get`` that no document is; no stream, consumer
    or key is left behind."""
    mesh_env(monkeypatch, servers, root)
    streams = [spec.name for spec in Subjects(root).streams]
    line = (
        f"no gpuwarden mesh with root {root!r} at NATS {servers.nats_url}: its stream(s) {', '.join(streams)} are "
        "missing (another program's NATS, another GPUWARDEN_ROOT, or streams deleted); nothing was created; "
        "`gpuwarden up --detach` starts a mesh"
    )
    for argv in (["status"], ["events"], ["events", "--follow"], ["where", "s1"], ["deadletters"]):
        assert gpuwarden(capsys, *argv) == (1, "", [f"gpuwarden {argv[0]}: {line}"]), argv
    assert gpuwarden(capsys, "config", "get", "driver") == (
        1,
        "",
        [
            "gpuwarden config: no driver document is stored yet: every service uses its defaults (`gpuwarden "
            "config set driver JSON` writes one)"
        ],
    )

    async def left_behind() -> tuple[list[str], list[bytes]]:
        bus = await Bus.connect(NatsSettings(servers=(servers.nats_url,)), Subjects(root), "test")
        try:
            missing = await bus.missing_streams()
        finally:
            await bus.close(1)
        client = aioredis.Redis.from_url(servers.redis_url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{root}*")]
        finally:
            await client.aclose()
        return missing, keys

    assert asyncio.run(left_behind()) == (streams, [])


USAGE_MISTAKES = [
    (["drian"], "gpuwarden: no command 'drian'; did you mean drain?"),
    (["drain", "--wiat", "node-1"], "gpuwarden drain: no option --wiat; did you mean --wait?"),
    (["status", "--jsn"], "gpuwarden status: no option --jsn; did you mean --json?"),
    (["status", "extra"], "gpuwarden status: unexpected argument extra"),
    (["events", "--limit", "-1"], "gpuwarden events: argument --limit: -1: must be at least 1"),
    (["deadletters", "--limit", "0"], "gpuwarden deadletters: argument --limit: 0: must be at least 1"),
    (["status", "--sessions", "-3"], "gpuwarden status: argument --sessions: -3: must be at least 0"),
    (["status", "--interval", "0"], "gpuwarden status: argument --interval: 0: must be more than 0"),
    (["drain", "node-1", "--timeout", "soon"], "gpuwarden drain: argument --timeout: 'soon' is not a number"),
    (["config", "sett", "driver", "{}"], "gpuwarden config: no command 'sett'; did you mean set?"),
    (
        ["config", "set", "driver", "{}", "--merge", "--replace"],
        "gpuwarden config set: argument --replace: not allowed with argument --merge",
    ),
    (["service", "checkpiont"], "gpuwarden service: argument name: no choice 'checkpiont'; did you mean checkpoint?"),
    (["drain"], "gpuwarden drain: the following arguments are required: node"),
]


@pytest.mark.parametrize(("argv", "line"), USAGE_MISTAKES, ids=[" ".join(m[0]) for m in USAGE_MISTAKES])
def test_a_usage_mistake_prints_its_subcommands_usage_and_the_near_miss(
    user: Path, capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    """The usage of the (sub)command the mistake was made in (``gpuwarden drain``'s for ``drain --wiat``), then
    one line that starts with that (sub)command; exit 2."""
    code, out, err = gpuwarden(capsys, *argv)
    assert (code, out) == (2, "")
    assert err[0].startswith(f"usage: {line.split(':')[0]} ") and err[-1] == line, err
    assert all(not text.startswith("gpuwarden") for text in err[:-1]), err  # the usage, then the one line


def test_every_argument_has_help() -> None:
    def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in set(action.choices.values()):
                    yield from parsers(sub)

    missing = [
        f"{p.prog} {a.dest}"
        for p in parsers(cli.build_parser())
        for a in p._actions
        if not isinstance(a, argparse._SubParsersAction) and not a.help
    ]
    assert missing == []


@pytest.fixture
def cluster(servers: Servers, root: str) -> Iterator[None]:
    """The simulated cluster (node-1..node-3) and the streams of a mesh under ``root``, as a running one has them."""

    async def make() -> None:
        bus = await Bus.connect(NatsSettings(servers=(servers.nats_url,)), Subjects(root), "test")
        try:
            await bus.ensure_streams()
        finally:
            await bus.close(1)
        client = aioredis.Redis.from_url(servers.redis_url)
        await SimCluster.create(client, Subjects(root))
        await client.aclose()

    async def remove() -> None:
        bus = await Bus.connect(NatsSettings(servers=(servers.nats_url,)), Subjects(root), "test")
        for spec in Subjects(root).streams:
            await bus.js.delete_stream(spec.name)
        await bus.close(1)
        client = aioredis.Redis.from_url(servers.redis_url)
        keys = [k async for k in client.scan_iter(match=f"{root}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(make())
    yield
    asyncio.run(remove())


def test_a_lookup_that_matches_nothing_names_what_exists(
    user: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    servers: Servers,
    root: str,
    cluster: None,
) -> None:
    mesh_env(monkeypatch, servers, root)
    nodes = "(nodes: node-1, node-2, node-3)"
    expected: list[tuple[list[str], int, str]] = [
        (["status", "--node", "node-9"], 1, f"gpuwarden status: --node node-9: no such node in the cluster {nodes}"),
        (["drain", "node-9"], 1, f"gpuwarden drain: no node 'node-9' in the cluster {nodes}"),
        (["checkpoint", "node-9"], 1, f"gpuwarden checkpoint: no node 'node-9' in the cluster {nodes}"),
        (["uncordon", "node-9"], 1, f"gpuwarden uncordon: no node 'node-9' in the cluster {nodes}"),
        (
            ["events", "--kind", "node.drain"],
            1,
            f"gpuwarden events: no event of kind node.drain is stored in {Subjects(root).events_stream.name} (yet)",
        ),
        (
            ["events", "--kind", "node.drian"],
            2,
            "gpuwarden events: --kind node.drian: no such event kind; did you mean node.drain? (kinds begin "
            "checkpoint, config, deadletter, device, driver, kv, metrics, model, node, requests, scaler)",
        ),
        (
            ["config", "get", "drvier"],
            2,
            "gpuwarden config: no configuration document 'drvier'; did you mean driver? (documents: checkpoint, "
            "driver, mig, models)",
        ),
        (
            ["sim", "fault", "xid", "--node", "node-9", "--gpu", "0", "--code", "79"],
            2,  # a fault request that names what the spec lacks is a bad request, as a bad --code is
            "gpuwarden sim fault: $.node: 'node-9' has no simulated GPUs (nodes: node-1, node-2, node-3)",
        ),
    ]
    for argv, code, line in expected:
        assert gpuwarden(capsys, *argv) == (code, "", [line]), argv


def test_config_set_states_what_it_changes_and_resets_nothing_unasked(
    user: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, servers: Servers, root: str
) -> None:
    """The example docs/architecture.md gives, then the mistake the issue found: a set that leaves out a field
    the stored document holds (``auto_upgrade``) is refused, naming it; ``--merge`` changes only what it names,
    ``--replace`` resets on purpose, and a set that changes nothing writes nothing."""
    mesh_env(monkeypatch, servers, root)

    def config(*argv: str) -> tuple[int, Any, list[str]]:
        code, out, err = gpuwarden(capsys, "config", *argv)
        return code, json.loads(out) if out else None, err

    try:
        first = config("set", "driver", '{"desired_version": "550.54.15", "auto_upgrade": true}')
        assert first == (
            0,
            {
                "name": "driver",
                "from_version": 0,
                "version": 1,
                "changed": {"desired_version": ["", "550.54.15"], "auto_upgrade": [False, True]},
            },
            [],
        )
        refused = config("set", "driver", '{"desired_version": "560.35.03"}')
        assert refused == (
            2,
            None,
            [
                "gpuwarden config: this would reset what driver holds and the document leaves out: auto_upgrade "
                "true -> false. `config set --merge` changes only the fields given; `config set --replace` replaces "
                "the whole document"
            ],
        )
        merged = config("set", "driver", "--merge", '{"desired_version": "560.35.03"}')
        assert merged == (
            0,
            {
                "name": "driver",
                "from_version": 1,
                "version": 2,
                "changed": {"desired_version": ["550.54.15", "560.35.03"]},
            },
            [],
        )
        assert config("set", "driver", "--merge", '{"desired_version": "560.35.03"}') == (
            0,
            {"name": "driver", "from_version": 2, "version": 2, "changed": {}},
            [],
        )
        replaced = config("set", "driver", "--replace", '{"desired_version": "560.35.03"}')
        assert replaced == (
            0,
            {"name": "driver", "from_version": 2, "version": 3, "changed": {"auto_upgrade": [True, False]}},
            [],
        )
        code, shown, _ = config("get", "driver")
        assert code == 0 and shown["version"] == 3 and shown["doc"]["auto_upgrade"] is False
        assert config("set", "driver", "--merge", '{"auto_upgrade": "yes"}')[0::2] == (
            2,
            ["gpuwarden config: config 'driver': Expected `bool`, got `str` - at `$.auto_upgrade`"],
        )
    finally:

        async def clean() -> None:
            client = aioredis.Redis.from_url(servers.redis_url)
            keys = [k async for k in client.scan_iter(match=f"{root}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

        asyncio.run(clean())
