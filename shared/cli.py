"""``gpuwarden``: run the mesh, start a service, and act on a running mesh as any other client of the bus would.

The CLI never imports a service: it starts them as processes (``python -m services.<name>``). Commands that
talk to a mesh find it through ``GPUWARDEN_NATS_URL``/``GPUWARDEN_REDIS_URL``, or else through the state file
that ``gpuwarden run`` writes (``$GPUWARDEN_HOME/run.json``), or else the defaults.

``GPUWARDEN_HOME`` (default ``.gpuwarden`` in the working directory) is the folder of ``gpuwarden run``: its state
file with the URLs and its pid, the processes' logs, the checkpoints it stores, and the data of the Redis it
starts (``redis/``, an append-only file), which a later run finds again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from shared.cli_rollout import add_rollout_parser
from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.registry import BY_KIND, codec
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import Subjects
from shared.plumbing.errors import ConfigConflict, InvalidConfig, ServerUnreachable, SettingsError
from shared.plumbing.settings import Settings, load_settings, public_url

SERVICES = ("driver", "device", "metrics", "scaler", "checkpoint")
NODE_SCOPED = ("driver", "device", "metrics")
DEFAULT_HOME = ".gpuwarden"


class UsageError(Exception):
    """Bad input on the command line: printed as one clear line, exit status 2."""


def home(env: Mapping[str, str] | None = None) -> Path:
    """The folder of ``gpuwarden run``'s state, logs, checkpoints and Redis data: ``GPUWARDEN_HOME``."""
    env = os.environ if env is None else env
    return Path(env.get("GPUWARDEN_HOME") or DEFAULT_HOME).expanduser().resolve()


def _state_file(env: Mapping[str, str]) -> Path:
    return home(env) / "run.json"


def _env_with_state() -> dict[str, str]:
    env = dict(os.environ)
    state_file = _state_file(env)
    if state_file.exists() and not (env.get("GPUWARDEN_NATS_URL") and env.get("GPUWARDEN_REDIS_URL")):
        state = json.loads(state_file.read_text())
        env.setdefault("GPUWARDEN_NATS_URL", state["nats_url"])
        env.setdefault("GPUWARDEN_REDIS_URL", state["redis_url"])
        env.setdefault("GPUWARDEN_ROOT", state.get("root", "gw"))
    return env


def _settings() -> Settings:
    return load_settings(_env_with_state())


def _read_json_arg(raw: str) -> bytes:
    if raw == "-":
        return sys.stdin.buffer.read()
    if raw.startswith("@"):
        try:
            return Path(raw[1:]).read_bytes()
        except OSError as exc:
            raise UsageError(f"{raw[1:]}: {exc.strerror}") from None
    return raw.encode()


# -- service ----------------------------------------------------------------------------------------------------
def cmd_service(args: argparse.Namespace) -> int:
    os.execv(sys.executable, [sys.executable, "-m", f"services.{args.name}"])
    return 0  # not reached


# -- publish / drain ------------------------------------------------------------------------------------------
async def _connect(settings: Settings, source: str) -> Any:
    from shared.plumbing.bus import Bus

    bus = await Bus.connect(settings.nats, Subjects(settings.root), source, connect_timeout=3.0)
    await bus.ensure_streams()
    return bus


def cmd_publish(args: argparse.Namespace) -> int:
    raw = _read_json_arg(args.event)
    try:
        event = codec.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        kinds = ", ".join(sorted(BY_KIND))
        raise UsageError(f"not a valid event: {exc} (kinds: {kinds})") from None
    settings = _settings()

    async def main() -> None:
        bus = await _connect(settings, "cli")
        try:
            await bus.publish(event)
        finally:
            await bus.close(1)

    asyncio.run(main())
    print(json.dumps({"published": event.kind, "event_id": event.event_id, "subject": _subject(settings, event)}))
    return 0


def _subject(settings: Settings, event: Any) -> str:
    return Subjects(settings.root).for_event(event)


def cmd_drain(args: argparse.Namespace) -> int:
    drain_id = args.drain_id or f"drain-{uuid.uuid4().hex[:12]}"
    try:
        event = DrainRequested(
            node=args.node,
            drain_id=drain_id,
            reason=args.reason,
            requested_by=args.requested_by,
            deadline_s=args.deadline,
        )
        msgspec.json.decode(codec.encode(event), type=DrainRequested)  # same validation as any consumer
    except msgspec.ValidationError as exc:
        raise UsageError(f"drain: {exc}") from None
    settings = _settings()

    async def main() -> int:
        from shared.plumbing.bus import Bus

        bus: Bus = await _connect(settings, "cli")
        verdict: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            if args.wait:
                subjects = bus.subjects

                async def on_verdict(ev: DrainCompleted | DrainFailed) -> None:
                    if ev.drain_id == drain_id and not verdict.done():
                        verdict.set_result(ev)

                await bus.subscribe(
                    subjects.pattern("node.drain.completed", node=args.node), on_verdict, (DrainCompleted,)
                )
                await bus.subscribe(subjects.pattern("node.drain.failed", node=args.node), on_verdict, (DrainFailed,))
            await bus.publish(event)
            print(json.dumps({"drain_requested": args.node, "drain_id": drain_id}))
            if not args.wait:
                return 0
            try:
                result = await asyncio.wait_for(verdict, timeout=args.deadline + 30)
            except TimeoutError:
                print(json.dumps({"drain_id": drain_id, "verdict": "no verdict in time"}))
                return 1
            print(codec.encode(result).decode())
            return 0 if isinstance(result, DrainCompleted) else 1
        finally:
            await bus.close(1)

    return asyncio.run(main())


# -- config ---------------------------------------------------------------------------------------------------
def cmd_config(args: argparse.Namespace) -> int:
    from shared.plumbing.configsync import ConfigStore, redis_client

    settings = _settings()

    async def main() -> int:
        client = redis_client(settings.redis)
        store = ConfigStore(client, Subjects(settings.root))
        try:
            if args.action == "get":
                found = await store.read(args.name)
                if found is None:
                    print(json.dumps({"name": args.name, "version": 0, "doc": None}))
                    return 1
                out = {"name": args.name, "version": found.version, "updated_by": found.updated_by}
                out["doc"] = msgspec.to_builtins(found.doc)
                print(json.dumps(out, indent=2))
                return 0
            raw = _read_json_arg(args.doc)
            expected = args.expect_version
            if expected is None:
                current = await store.read(args.name)
                expected = current.version if current else 0
            version = await store.write_raw(args.name, raw, expected, args.by)
            print(json.dumps({"name": args.name, "version": version}))
            return 0
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except (InvalidConfig, ConfigConflict) as exc:
        raise UsageError(str(exc)) from None


# -- dead letters ---------------------------------------------------------------------------------------------
def cmd_deadletters(args: argparse.Namespace) -> int:
    settings = _settings()

    async def main() -> int:
        bus = await _connect(settings, "cli")
        try:
            stream = bus.subjects.deadletter_stream.name
            info = await bus.js.stream_info(stream)
            last = info.state.last_seq
            first = max(info.state.first_seq, last - args.limit + 1)
            for seq in range(first, last + 1):
                try:
                    raw = await bus.js.get_msg(stream, seq)
                except Exception:
                    continue
                letter = codec.decode(raw.data or b"")
                if isinstance(letter, DeadLetter):
                    print(
                        json.dumps(
                            {
                                "seq": seq,
                                "subject": letter.origin_subject,
                                "consumer": letter.consumer,
                                "reason": letter.reason,
                                "payload": letter.payload.decode("utf-8", "replace")[:200],
                            }
                        )
                    )
            return 0
        finally:
            await bus.close(1)

    return asyncio.run(main())


# -- run: the embedded default --------------------------------------------------------------------------------
def _live_pid(state_file: Path) -> int | None:
    """The pid of the ``gpuwarden run`` that wrote ``state_file``, while that process lives."""
    try:
        pid = int(json.loads(state_file.read_text()).get("pid", 0))
    except (OSError, ValueError, AttributeError):
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def cmd_run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    env.setdefault("GPUWARDEN_ROOT", "gw")
    env.setdefault("GPUWARDEN_BACKEND", "sim")
    try:
        load_settings(env)
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    nodes = [n for n in args.nodes.split(",") if n]
    if not nodes and env["GPUWARDEN_BACKEND"] == "sim":
        from shared.sim.spec import SpecError, load_spec

        try:
            nodes = [n.name for n in load_spec(env.get("GPUWARDEN_SIM_SPEC")).nodes]
        except SpecError as exc:
            raise UsageError(str(exc)) from None
    if not nodes:
        raise UsageError("--nodes: at least one node name")
    base = home(env)
    state_file = _state_file(env)
    other = _live_pid(state_file)
    if other is not None:
        raise UsageError(
            f"already running as pid {other} with GPUWARDEN_HOME={base}; stop it first or set another GPUWARDEN_HOME"
        )
    log_dir = base / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    owned: list[Any] = []
    try:
        _start_servers(env, base, owned)
        return _run_mesh(args, env, nodes, base, state_file, log_dir, owned)
    finally:
        for server in owned:
            server.cleanup()  # the Redis data folder stays for the next run
        state_file.unlink(missing_ok=True)


def _start_servers(env: dict[str, str], base: Path, owned: list[Any]) -> None:
    """Start NATS and Redis unless their URLs are given; Redis keeps its data in ``base/redis`` (AOF)."""
    from shared.plumbing.devservers import NatsServer, RedisServer

    if not env.get("GPUWARDEN_NATS_URL"):
        nats_server = NatsServer()
        owned.append(nats_server)
        env["GPUWARDEN_NATS_URL"] = nats_server.start().url
    if not env.get("GPUWARDEN_REDIS_URL"):
        redis_server = RedisServer(dir=base / "redis", persistent=True)
        owned.append(redis_server)
        env["GPUWARDEN_REDIS_URL"] = redis_server.start().url


def _run_mesh(
    args: argparse.Namespace,
    env: dict[str, str],
    nodes: list[str],
    base: Path,
    state_file: Path,
    log_dir: Path,
    servers: list[Any],
) -> int:
    """Start the plan's processes and keep them, and the servers this run started, running until stopped: a
    process or server that exits is started again (a server on its own port and folder)."""
    from shared.plumbing.devservers import free_port

    checkpoints = f"file://{base / 'checkpoints'}"
    plan: list[tuple[str, str, dict[str, str]]] = []
    for name in SERVICES:
        for node in nodes if name in NODE_SCOPED else [nodes[0]]:
            child = dict(env, GPUWARDEN_NODE=node, GPUWARDEN_HTTP_ADDR=f"127.0.0.1:{free_port()}")
            child.setdefault("GPUWARDEN_CHECKPOINT_STORE", checkpoints)
            # one machine's disk, every writer on it: packs nothing references go after a minute, not ten
            child.setdefault("GPUWARDEN_CHECKPOINT_GC_S", "30")
            child.setdefault("GPUWARDEN_CHECKPOINT_GC_GRACE_S", "60")
            child.setdefault("GPUWARDEN_SCALER_ADDR", f"127.0.0.1:{free_port()}")
            if name == "metrics" and env["GPUWARDEN_BACKEND"] == "sim":  # scrape the simulated exporters
                child.setdefault("GPUWARDEN_METRICS_SOURCE", "dcgm")
                child.setdefault("GPUWARDEN_METRICS_AGGREGATE", "bus" if node == nodes[0] else "off")
            label = f"{name}@{node}" if name in NODE_SCOPED else name
            plan.append((label, f"services.{name}", child))
    sim_env = dict(env, GPUWARDEN_NODE=nodes[0], GPUWARDEN_HTTP_ADDR=f"127.0.0.1:{free_port()}")
    sim_env.setdefault("GPUWARDEN_CHECKPOINT_STORE", checkpoints)
    if env["GPUWARDEN_BACKEND"] == "sim":
        plan.append(("sim", "shared.sim", sim_env))
    state: dict[str, Any] = {
        "pid": os.getpid(),
        "nats_url": env["GPUWARDEN_NATS_URL"],
        "redis_url": env["GPUWARDEN_REDIS_URL"],
        "root": env["GPUWARDEN_ROOT"],
        "simulated": env["GPUWARDEN_BACKEND"] == "sim",
        "services": {label: "http://" + child["GPUWARDEN_HTTP_ADDR"] + "/healthz" for label, _, child in plan},
        "logs": str(log_dir),
    }
    state_file.write_text(json.dumps(state, indent=2))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    extra = {"sim": ["--rate", str(args.rate)]}

    def launch(label: str, module: str, child: dict[str, str]) -> None:
        out = open(log_dir / f"{label.replace('@', '-')}.log", "ab")
        procs[label] = subprocess.Popen(
            [sys.executable, "-m", module, *extra.get(label, [])], env=child, stdout=out, stderr=out
        )

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    for label, name, child in plan:
        launch(label, name, child)
    banner = "gpuwarden is running" + (" (SIMULATED GPUs and cluster)" if state["simulated"] else "")
    print(banner)
    print(f"  NATS   {state['nats_url']}   Redis {state['redis_url']}   root {state['root']}")
    for label, url in state["services"].items():
        print(f"  {label:<18} {url}")
    print(f"  home   {base}   (state, logs, checkpoints, Redis data)")
    print("  try:   .venv/bin/gpuwarden drain node-1 --wait      (Ctrl-C stops everything)")
    sys.stdout.flush()
    started = time.monotonic()
    restarts: dict[str, int] = {}
    try:
        while not stopping and (args.seconds is None or time.monotonic() - started < args.seconds):
            time.sleep(0.5)
            for server in servers:
                if server.proc is not None and server.proc.poll() is not None and not stopping:
                    kind = type(server).__name__
                    print(f"  {kind} exited with {server.proc.returncode}; restarting on {server.url}", flush=True)
                    try:
                        server.start()
                    except RuntimeError as exc:  # tried again on the next round
                        print(f"  {kind} did not start again: {exc}", flush=True)
            for label, name, child in plan:
                proc = procs[label]
                if proc.poll() is not None and not stopping:
                    restarts[label] = restarts.get(label, 0) + 1
                    print(f"  {label} exited with {proc.returncode}; restarting (#{restarts[label]})", flush=True)
                    time.sleep(min(restarts[label], 5))
                    launch(label, name, child)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    print("stopped")
    return 0


# -- metrics ----------------------------------------------------------------------------------------------------
def cmd_metrics_scrape(args: argparse.Namespace) -> int:
    """Runs ``services.metrics.scrape_cli`` as a process: the CLI imports no service."""
    argv = [sys.executable, "-m", "services.metrics.scrape_cli", args.url, "--timeout", str(args.timeout)]
    if args.json:
        argv.append("--json")
    os.execv(sys.executable, argv)
    return 0  # not reached


# -- sim, agent, nats-auth ------------------------------------------------------------------------------------
def cmd_sim_run(args: argparse.Namespace) -> int:
    env = _env_with_state()
    os.execve(sys.executable, [sys.executable, "-m", "shared.sim", *args.sim_args], env)
    return 0  # not reached


def cmd_sim_fault(args: argparse.Namespace) -> int:
    from shared.sim.faults import run_fault

    return run_fault(args, _settings())


_LABEL_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def label_changes(items: list[str]) -> dict[str, str | None]:
    """``KEY=VALUE`` sets a label, ``KEY-`` removes it (kubectl's spelling); keys and values as Kubernetes allows."""
    changes: dict[str, str | None] = {}
    for item in items:
        if item.endswith("-") and "=" not in item:
            key, value = item[:-1], None
        elif "=" in item:
            key, value = item.split("=", 1)
        else:
            raise UsageError(f"sim label: {item!r}: expected KEY=VALUE or KEY-")
        if not _LABEL_KEY_RE.match(key):
            raise UsageError(f"sim label: {key!r} is not a label key ([prefix/]name, name up to 63 characters)")
        if value is not None and not _LABEL_VALUE_RE.match(value):
            raise UsageError(f"sim label: {value!r} is not a label value (up to 63 letters, digits, '-', '_', '.')")
        changes[key] = value
    return changes


def cmd_sim_label(args: argparse.Namespace) -> int:
    """Label a SIMULATED node, as ``kubectl label node`` does a real one (e.g. ``nvidia.com/mig.config``)."""
    from shared.plumbing.configsync import redis_client
    from shared.sim.cluster import SimCluster

    changes = label_changes(args.labels)
    settings = _settings()

    async def main() -> int:
        cluster = SimCluster(redis_client(settings.redis), Subjects(settings.root), owns_client=True)
        try:
            if await cluster.node(args.node) is None:
                names = ", ".join(n.name for n in await cluster.nodes()) or "none: is the simulation running?"
                raise UsageError(f"sim label: no simulated node {args.node!r} (nodes: {names})")
            await cluster.set_node_labels(args.node, changes)
            node = await cluster.node(args.node)
        finally:
            await cluster.close()
        print(json.dumps(dict(node.labels) if node else {}, indent=2, sort_keys=True))
        return 0

    return asyncio.run(main())


def cmd_agent_final_save(args: argparse.Namespace) -> int:
    """The preStop hook of an inference pod: ask the pod's KV agent to save everything, wait for the report."""
    from shared.contract.checkpoint import SaveSessions, SaveSessionsReport

    settings = _settings()
    try:
        command = SaveSessions(pod=args.pod, deadline_s=args.deadline, reason="prestop")
        msgspec.json.decode(codec.encode(command), type=SaveSessions)
    except msgspec.ValidationError as exc:
        raise UsageError(f"agent final-save: {exc}") from None

    async def main() -> int:
        bus = await _connect(settings, "prestop")
        try:
            reply = await bus.request(bus.subjects.for_event(command), command, timeout=args.deadline + 2)
        finally:
            await bus.close(1)
        print(codec.encode(reply).decode())
        return 0 if isinstance(reply, SaveSessionsReport) and not reply.failed else 1

    return asyncio.run(main())


def cmd_where(args: argparse.Namespace) -> int:
    """One line: which pod holds the session's KV cache now (exit 0), or why none does (exit 1)."""
    from shared.contract.base import is_token

    if not is_token(args.session):
        raise UsageError(f"{args.session!r} is not a session id (letters, digits, '-', '_' and '.')")
    settings = _settings()

    async def main() -> int:
        bus = await _connect(settings, "cli")
        try:
            answer = await bus.request(
                bus.subjects.command("checkpoint", "where"), WhereIsSession(session_id=args.session), 5.0
            )
        finally:
            await bus.close(1)
        if not isinstance(answer, SessionLocation):
            raise UsageError(f"the checkpoint service answered: {getattr(answer, 'reason', answer.kind)}")
        print(where_line(answer))
        return 0 if answer.held else 1

    return asyncio.run(main())


def where_line(at: SessionLocation) -> str:
    """A ``kv.session.location`` as one line for people."""
    saved = f", checkpoint {at.checkpoint_id} ({at.token_count} tokens)" if at.checkpoint_id else ""
    if at.held:
        return f"{at.session_id}: pod {at.pod} on node {at.node}, generation {at.generation}{saved}"
    if at.reason == "unknown":
        return f"{at.session_id}: unknown (no pod holds it, no checkpoint)"
    last = f", last on pod {at.previous_pod}" if at.previous_pod else ""
    return f"{at.session_id}: held by no pod ({at.reason}{last}){saved}"


def cmd_nats_auth(args: argparse.Namespace) -> int:
    """Print a nats-server authorization block: one least-privilege user per service, the KV agents, an admin."""
    from shared.contract.permissions import USERS, nats_auth_config

    settings = _settings()
    directory = Path(args.password_dir)
    passwords: dict[str, str] = {}
    for user in USERS:
        path = directory / user
        try:
            passwords[user] = path.read_text().strip()
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror} (one file per user holding its password)") from None
    try:
        print(
            nats_auth_config(
                Subjects(settings.root),
                passwords,
                node=args.node or None,
                pod=args.pod or None,
                bucket=args.bucket or None,
            )
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return 0


# -- schemas --------------------------------------------------------------------------------------------------
def cmd_schemas(args: argparse.Namespace) -> int:
    from shared.contract import schemas

    return schemas.main(["--check"] if args.check else [])


def build_parser() -> argparse.ArgumentParser:
    from shared.sim.faults import add_fault_arguments

    parser = argparse.ArgumentParser(prog="gpuwarden", description=__doc__.splitlines()[0] if __doc__ else "")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="servers, the five services and the simulated cluster, in the foreground")
    p.add_argument("--nodes", default="", help="comma-separated node names (default: the simulation spec's nodes)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--rate", type=float, default=2.0, help="simulated inference requests per second")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("service", help="run one service in the foreground (python -m services.NAME)")
    p.add_argument("name", choices=SERVICES)
    p.set_defaults(func=cmd_service)

    p = sub.add_parser("publish", help="validate and publish one event (JSON, @file or - for stdin)")
    p.add_argument("event")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("drain", help="ask for a drain of NODE: save every KV cache there first")
    p.add_argument("node")
    p.add_argument("--drain-id", default="")
    p.add_argument("--reason", default="maintenance")
    p.add_argument("--requested-by", default="cli")
    p.add_argument("--deadline", type=float, default=25.0, help="seconds the savers have (default 25)")
    p.add_argument("--wait", action="store_true", help="wait for drain.completed or drain.failed")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("config", help="read or compare-and-set a configuration document in Redis")
    csub = p.add_subparsers(dest="action", required=True)
    g = csub.add_parser("get")
    g.add_argument("name")
    s = csub.add_parser("set")
    s.add_argument("name")
    s.add_argument("doc", help="JSON, @file or - for stdin")
    s.add_argument("--expect-version", type=int, default=None, help="fail unless the stored version is this")
    s.add_argument("--by", default="cli")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("deadletters", help="show the newest dead letters")
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(func=cmd_deadletters)

    p = sub.add_parser("metrics", help="GPU metrics sources")
    msub = p.add_subparsers(dest="action", required=True)
    m = msub.add_parser("scrape", help="fetch one dcgm-exporter page; print per GPU and per pod what is derived")
    m.add_argument("url", help="e.g. http://10.0.0.7:9400/metrics")
    m.add_argument("--json", action="store_true", help="JSON: per-GPU entries keyed by UUID, and per pod")
    m.add_argument("--timeout", type=float, default=5.0, help="seconds for the fetch (default 5)")
    m.set_defaults(func=cmd_metrics_scrape)

    p = sub.add_parser("sim", help="the SIMULATED cluster, GPUs and workload")
    simsub = p.add_subparsers(dest="sim_command", required=True)
    r = simsub.add_parser("run", help="run the simulation (python -m shared.sim)", add_help=False)
    r.add_argument("sim_args", nargs=argparse.REMAINDER, help="--rate, --sessions, --prompt-tokens, --new-tokens")
    r.set_defaults(func=cmd_sim_run)
    f = simsub.add_parser("fault", help="inject a fault: xid, lose_gpu, driver_install, slow_copies or mig")
    add_fault_arguments(f)
    f.set_defaults(func=cmd_sim_fault)
    lab = simsub.add_parser("label", help="label a simulated node: KEY=VALUE sets, KEY- removes (as kubectl label)")
    lab.add_argument("node")
    lab.add_argument("labels", nargs="+", metavar="KEY=VALUE|KEY-")
    lab.set_defaults(func=cmd_sim_label)

    p = sub.add_parser("agent", help="talk to a pod's KV agent")
    asub = p.add_subparsers(dest="action", required=True)
    f = asub.add_parser("final-save", help="preStop hook: save every session of the pod before it stops")
    f.add_argument("--pod", default=os.environ.get("GPUWARDEN_POD_NAME", ""), help="default $GPUWARDEN_POD_NAME")
    f.add_argument("--deadline", type=float, default=25.0)
    f.set_defaults(func=cmd_agent_final_save)

    p = sub.add_parser("where", help="which pod holds SESSION's KV cache now (exit 1 when none does)")
    p.add_argument("session")
    p.set_defaults(func=cmd_where)

    p = sub.add_parser("nats-auth", help="print a nats-server authorization block, one user per service")
    p.add_argument("--password-dir", required=True, help="folder with one file per user holding its password")
    p.add_argument("--node", default="", help="scope the node-scoped services to this node")
    p.add_argument("--pod", default="", help="scope the KV agents' user to this pod (default: any pod)")
    p.add_argument("--bucket", default="", help="let the KV agents use this Object Store bucket (nats://<bucket>)")
    p.set_defaults(func=cmd_nats_auth)

    add_rollout_parser(sub, _settings)

    p = sub.add_parser("schemas", help="write (or --check) the JSON Schema and AsyncAPI files in proto/events")
    p.add_argument("--check", action="store_true")
    p.set_defaults(func=cmd_schemas)
    return parser


def _unreachable(exc: BaseException) -> ServerUnreachable | None:
    """The server ``exc`` says did not answer, with the URL this command used; None for any other failure."""
    from shared.plumbing.bus import nats_unreachable
    from shared.plumbing.configsync import redis_unreachable

    if isinstance(exc, ServerUnreachable):
        return exc
    try:
        settings = _settings()
    except (SettingsError, OSError, ValueError, KeyError):
        settings = Settings()
    if redis_unreachable(exc):
        return ServerUnreachable("Redis", public_url(settings.redis.url))
    if nats_unreachable(exc):
        return ServerUnreachable("NATS", ", ".join(public_url(s) for s in settings.nats.servers))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="gpuwarden: %(name)s: %(message)s")  # no clients' chatter
    try:
        return int(args.func(args))
    except (UsageError, SettingsError) as exc:
        print(f"gpuwarden {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        down = _unreachable(exc)
        if down is not None:
            print(f"gpuwarden {args.command}: {down.server} at {down.url} is unreachable", file=sys.stderr)
            return 1
        if isinstance(exc, OSError | TimeoutError):
            print(f"gpuwarden {args.command}: cannot reach the mesh: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
