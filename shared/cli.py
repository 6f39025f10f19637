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
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from shared.console.process import DEFAULT_HOME, NODE_SCOPED, SERVICES, home, state_file
from shared.console.rollout import add_rollout_parser
from shared.console.state import CommandError, read_state
from shared.contract.deadletter import DeadLetter
from shared.contract.node import DrainCompleted
from shared.contract.registry import BY_KIND, codec
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import Subjects
from shared.plumbing.errors import ConfigConflict, InvalidConfig, ServerUnreachable, SettingsError
from shared.plumbing.settings import Settings, load_settings, public_url

__all__ = ["DEFAULT_HOME", "NODE_SCOPED", "SERVICES", "home", "main"]


class UsageError(Exception):
    """Bad input on the command line: printed as one clear line, exit status 2."""


def _state_file(env: Mapping[str, str]) -> Path:
    return state_file(env)


def _env_with_state() -> dict[str, str]:
    env = dict(os.environ)
    state = read_state(_state_file(env))
    if state.get("nats_url") and not (env.get("GPUWARDEN_NATS_URL") and env.get("GPUWARDEN_REDIS_URL")):
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
async def _connect(settings: Settings, source: str, streams: bool = True) -> Any:
    """A bus for one command; ``streams``: make sure the streams exist first (the admin's commands; a pod's
    preStop hook, under its KV agent's user, may not look streams up)."""
    from shared.plumbing.bus import Bus

    bus = await Bus.connect(settings.nats, Subjects(settings.root), source, connect_timeout=3.0)
    if streams:
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


def _check_deadline(deadline_s: float) -> None:
    """A drain's deadline the checkpoint service would refuse is refused here, before anything is cordoned or
    published."""
    from shared.contract.node import deadline_problem

    problem = deadline_problem(deadline_s)
    if problem:
        raise UsageError(f"--deadline {deadline_s:g}: {problem}")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Save every session on the node (a drain request, as the checkpoint service takes it): no cordon, no
    eviction. ``--wait`` prints the verdict. Named, asked and waited for by the one drain client."""
    from shared.plumbing.drains import DrainClient, InvalidDrain, drain_request

    _check_deadline(args.deadline)
    drain_id = args.drain_id or DrainClient.new_id(f"drain-{args.node}")
    try:
        drain_request(args.node, drain_id, args.reason, args.requested_by, args.deadline)
    except InvalidDrain as exc:
        raise UsageError(f"checkpoint: {exc}") from None
    settings = _settings()

    async def main() -> int:
        from shared.plumbing.bus import Bus

        bus: Bus = await _connect(settings, "cli")
        drains = DrainClient(bus.publish, args.requested_by)
        try:
            async with drains.watch(bus, drain_id, args.node) if args.wait else contextlib.nullcontext() as verdict:
                await drains.ask(drain_id, args.node, args.reason, args.deadline)
                print(json.dumps({"drain_requested": args.node, "drain_id": drain_id}))
                if verdict is None:
                    return 0
                try:
                    result = await verdict.wait(args.deadline + 30)
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


# -- up / down: the embedded default -------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    from shared.console import process

    if not args.detach:
        return process.run_foreground(args)
    argv = ["--nodes", args.nodes, "--rate", str(args.rate), "--gpus-per-node", str(args.gpus_per_node)]
    argv += ["--nats-port", str(args.nats_port), "--redis-port", str(args.redis_port)]
    if args.hollow is not None:
        argv.append("--hollow" if args.hollow else "--no-hollow")
    if args.seconds is not None:
        argv += ["--seconds", str(args.seconds)]
    return process.run_detached(args, argv)


def cmd_down(args: argparse.Namespace) -> int:
    from shared.console import process

    process.stop(os.environ, timeout=args.timeout)
    return 0


# -- status / events ------------------------------------------------------------------------------------------
def _open_mesh() -> Any:
    from shared.console.client import MeshClient, read_state

    return MeshClient.open(_settings(), read_state(_state_file(os.environ)))


def cmd_status(args: argparse.Namespace) -> int:
    from shared.console import render, snapshot

    async def main() -> int:
        mesh = await _open_mesh()
        samples = snapshot.SampleListener(mesh)
        try:
            await samples.start()
            if not args.watch:
                status = await snapshot.take(mesh, samples, args.sample, node=args.node, max_sessions=args.sessions)
                if args.json:
                    sys.stdout.write(snapshot.to_json(status).decode() + "\n")
                else:
                    render.console().print(render.status_tables(status))
                return 0
            from rich.live import Live

            status = await snapshot.take(mesh, samples, args.sample, node=args.node, max_sessions=args.sessions)
            with Live(render.status_tables(status), console=render.console(), auto_refresh=False) as live:
                while True:
                    await asyncio.sleep(args.interval)
                    again = await snapshot.take(mesh, samples, node=args.node, max_sessions=args.sessions)
                    live.update(render.status_tables(again), refresh=True)
        finally:
            await samples.stop()
            await mesh.close()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0


def cmd_events(args: argparse.Namespace) -> int:
    from shared.console import events, render

    kinds = None
    if args.kind:
        kinds = events.kinds_matching(args.kind)
        if not kinds:
            raise UsageError(f"--kind {args.kind}: no such event kind (kinds: {', '.join(sorted(BY_KIND))})")
    out = render.console()

    printed = False

    def show(found: list[Any]) -> None:
        nonlocal printed
        if args.json:
            for event in found:
                sys.stdout.write(codec.encode(event).decode() + "\n")
            sys.stdout.flush()
            return
        width = out.width
        if not printed:
            out.print(events.line(("time", "kind", "source", "what"), width), style="bold")
            printed = True
        for event in found:
            out.print(events.line(events.row(event), width))

    async def main() -> int:
        mesh = await _open_mesh()
        try:
            await events.page_then_follow(mesh, kinds, args.limit, show, args.follow)
            return 0
        finally:
            await mesh.close()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0


# -- drain / uncordon / upgrade-driver --------------------------------------------------------------------------
def cmd_drain_node(args: argparse.Namespace) -> int:
    _check_deadline(args.deadline)
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from shared.console import operations, render

    err = render.console(stderr=True)
    live = err.is_terminal and not args.json
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
    )
    tasks: dict[str, Any] = {}

    def report(phase: operations.DrainPhase, done: dict[str, Any]) -> None:
        if phase == "cordoned":
            total = done["sessions"]
            if live:
                tasks["save"] = progress.add_task(f"save {total} session(s)", total=max(total, 1))
            elif not args.json:
                err.print(f"{args.node} cordoned; saving {total} session(s)")
        elif phase == "saved":
            if live:
                progress.update(tasks["save"], completed=progress.tasks[0].total)
                tasks["evict"] = progress.add_task("evict pods", total=None)
            elif not args.json:
                err.print(f"saved {done['sessions']} session(s), {done['bytes']} bytes; evicting pods")
        elif phase == "evicting" and live:
            progress.update(tasks["evict"], description=f"evict pods ({done['pods_left']} left)")
        elif phase == "moving":
            if live:
                if "move" not in tasks:
                    progress.update(tasks["evict"], total=1, completed=1, description="evict pods (none left)")
                    tasks["move"] = progress.add_task("restore + verify elsewhere", total=max(done["total"], 1))
                progress.update(tasks["move"], completed=done["done"])

    async def main() -> int:
        mesh = await _open_mesh()
        try:
            with progress if live else contextlib.nullcontext():
                result = await operations.drain(
                    mesh,
                    args.node,
                    wait=args.wait,
                    timeout=args.timeout,
                    deadline_s=args.deadline,
                    reason=args.reason,
                    requested_by=args.requested_by,
                    drain_id=args.drain_id,
                    report=report,
                )
        finally:
            await mesh.close()
        if args.json:
            print(json.dumps(result.as_json()))
        if not result.ok:
            if not args.json:
                print(f"gpuwarden drain: {args.node}: {result.reason}", file=sys.stderr)
            return 1
        if not args.json:
            restored = [m for m in result.sessions if m.outcome == "restored"]
            ended = [m for m in result.sessions if m.outcome == "ended"]
            where = sorted({m.new_node for m in restored})
            line = (
                f"{args.node} drained: {result.sessions_committed} session(s) saved in {result.save_s:.1f}s, "
                f"{len(result.pods_evicted)} pod(s) evicted"
            )
            if args.wait:
                line += f", {len(restored)} restored and verified on {', '.join(where) or '-'}"
                line += f" ({len(ended)} ended by their clients)" if ended else ""
                line += f" in {result.save_s + result.evict_s + result.move_s:.1f}s"
            print(line + f"; still cordoned: `gpuwarden uncordon {args.node}`")
        return 0

    return asyncio.run(main())


def cmd_uncordon(args: argparse.Namespace) -> int:
    from shared.console import operations

    async def main() -> int:
        mesh = await _open_mesh()
        try:
            changed = await operations.uncordon(mesh, args.node, force=args.force)
        finally:
            await mesh.close()
        print(f"{args.node} uncordoned" if changed else f"{args.node} was schedulable already")
        return 0

    return asyncio.run(main())


def cmd_upgrade_driver(args: argparse.Namespace) -> int:
    from shared.contract.configdocs import DRIVER_VERSION_PATTERN

    if not re.match(DRIVER_VERSION_PATTERN, args.version):
        raise UsageError(f"{args.version!r} is not a driver version like 560.35.03")
    if args.max_parallel is not None and args.max_parallel < 1:
        raise UsageError("--max-parallel must be at least 1")
    from rich.progress import BarColumn, Progress, TextColumn

    from shared.console import operations, render

    err = render.console(stderr=True)
    live = err.is_terminal and not args.json
    progress = Progress(
        TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.fields[state]}"), console=err
    )
    tasks: dict[str, Any] = {}
    last: dict[str, str] = {}
    latest: list[Any] = []
    steps = len(operations.STATE_ORDER)

    def report(nodes: list[Any]) -> None:
        latest[:] = nodes
        for n in nodes:
            state = "done" if operations.node_done(n, args.version) else n.state or "waiting for a slot"
            if live:
                if n.node not in tasks:
                    tasks[n.node] = progress.add_task(n.node, total=steps, state="")
                at = (
                    steps
                    if state == "done"
                    else operations.STATE_ORDER.index(n.state) + 1
                    if n.state in operations.STATE_ORDER
                    else 0
                )
                progress.update(tasks[n.node], completed=at, state=f"{state} ({n.version or '?'})")
            elif not args.json and last.get(n.node) != state:
                err.print(f"{n.node}: {state} (driver {n.version or '?'})")
            last[n.node] = state

    async def main() -> int:
        mesh = await _open_mesh()
        try:
            version = await operations.set_driver(mesh, args.version, args.max_parallel)
            if not args.json:
                print(f"driver document v{version}: desired_version {args.version}, auto_upgrade on")
            if not args.wait:
                return 0
            with progress if live else contextlib.nullcontext():
                ok, why = await operations.follow_upgrade(
                    mesh,
                    args.version,
                    args.timeout,
                    report,
                    lambda why: err.print(f"upgrade-driver: {why}", markup=False),
                )
            nodes = latest
        finally:
            await mesh.close()
        if args.json:
            print(json.dumps({"version": args.version, "ok": ok, "reason": why, "nodes": [n.__dict__ for n in nodes]}))
        elif ok:
            print(f"every node runs driver {args.version}: {', '.join(n.node for n in nodes)}")
        else:
            print(f"gpuwarden upgrade-driver: {why}", file=sys.stderr)
        return 0 if ok else 1

    return asyncio.run(main())


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
        bus = await _connect(settings, "prestop", streams=False)
        try:
            reply = await bus.request(bus.subjects.for_event(command), command, timeout=args.deadline + 2)
        finally:
            await bus.close(1)
        print(codec.encode(reply).decode())
        return 0 if isinstance(reply, SaveSessionsReport) and not reply.failed else 1

    return asyncio.run(main())


def cmd_where(args: argparse.Namespace) -> int:
    """One line: which pod holds the session's KV cache now (exit 0), or why none does (exit 1)."""
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
    """Print a nats-server authorization block. With ``--issuer-seed-file``: the auth callout's (its own user, from
    DIR's ``auth`` password file, and the issuer's public key; every other user is the callout's to authenticate,
    ``services.auth``). Without: a static block of one least-privilege user per service, the KV agents, an admin,
    and a gateway (a KV-aware router) when DIR has a ``gateway`` password file."""
    from shared.contract.permissions import AUTH, OPTIONAL_USERS, USERS, nats_auth_config, nats_callout_config

    settings = _settings()
    directory = Path(args.password_dir)
    if args.issuer_seed_file:
        path = directory / AUTH
        try:
            password = path.read_text().strip()
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror} (the auth callout's own password)") from None
        issuer = _issuer_public_key(Path(args.issuer_seed_file))
        try:
            print(nats_callout_config(Subjects(settings.root), password, issuer, timeout_s=args.timeout))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return 0
    passwords: dict[str, str] = {}
    for user in USERS:
        path = directory / user
        try:
            passwords[user] = path.read_text().strip()
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror} (one file per user holding its password)") from None
    for user in OPTIONAL_USERS:  # a user of its own only when its password file is there
        path = directory / user
        if path.exists():
            try:
                passwords[user] = path.read_text().strip()
            except OSError as exc:
                raise UsageError(f"{path}: {exc.strerror}") from None
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


def _issuer_public_key(path: Path) -> str:
    """The public key of the account seed in ``path``, written afresh (mode 0600) when there is none yet. The
    seed itself is never printed: it goes to the auth service alone (``GPUWARDEN_AUTH_ISSUER_SEED_FILE``)."""
    import nkeys

    if not path.exists():
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror}") from None
        with os.fdopen(fd, "wb") as out:
            out.write(bytes(seed) + b"\n")
        print(
            f"gpuwarden nats-auth: wrote a new issuer seed to {path} (give it to the auth service only)",
            file=sys.stderr,
        )
    try:
        public = nkeys.from_seed(bytearray(path.read_bytes().strip())).public_key.decode()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    except Exception:
        raise UsageError(f"{path}: not an nkey seed") from None
    if not public.startswith("A"):
        raise UsageError(f"{path}: not an account seed (its public key must start with A)")
    return str(public)


# -- schemas --------------------------------------------------------------------------------------------------
def cmd_schemas(args: argparse.Namespace) -> int:
    """The development tool ``python -m tools.schemas``, for a source checkout (it writes into its proto/events)."""
    try:
        from tools import schemas
    except ModuleNotFoundError as exc:
        if exc.name != "tools":
            raise
        raise UsageError("gpuwarden schemas needs a source checkout (its tools/ package): run it there") from None
    return schemas.main(["--check"] if args.check else [])


def _id_arg(kind: str, optional: bool = False) -> Callable[[str], str]:
    """An argparse type: a ``kind`` id by the contract's one rule (``shared.contract.base.ID_RULES``)."""
    from shared.contract.base import id_problem

    def parse(value: str) -> str:
        problem = "" if optional and value == "" else id_problem(kind, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = f"{kind} id"
    return parse


def build_parser() -> argparse.ArgumentParser:
    from shared.sim.faults import add_fault_arguments

    parser = argparse.ArgumentParser(prog="gpuwarden", description=__doc__.splitlines()[0] if __doc__ else "")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "up", aliases=["run"], help="servers, the five services and the simulated cluster and workload (run: the same)"
    )
    p.add_argument("--detach", action="store_true", help="run in the background; `gpuwarden down` stops it")
    p.add_argument(
        "--nodes",
        default="",
        help="N: a simulated fleet of N nodes, node-1..node-N, of --gpus-per-node GPUs each (the spec's deployments "
        "on it); or comma-separated node names of the spec (default: the simulation spec's nodes)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="--nodes N: GPUs of each node (default 8)")
    p.add_argument(
        "--hollow",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hollow nodes: every node's driver, device and metrics agents in one process per service kind, not "
        "one process per service and node (default: as the spec's `hollow` says)",
    )
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--rate", type=float, default=2.0, help="simulated inference requests per second")
    p.add_argument("--nats-port", type=int, default=0, help="port of the NATS server it starts (default: a free one)")
    p.add_argument("--redis-port", type=int, default=0, help="port of the Redis server it starts (default: a free one)")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        help="--detach: seconds to wait for /readyz (default 90, and 0.2 more per node past 100)",
    )
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop the mesh `gpuwarden up --detach` started (pids in $GPUWARDEN_HOME/run.json)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to let it stop before SIGKILL (default 30)")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("status", help="nodes, GPUs, deployments, sessions and drains in flight")
    p.add_argument("--json", action="store_true", help="one JSON document (documented in docs/cli.md)")
    p.add_argument("--watch", action="store_true", help="a live table, refreshed every --interval seconds")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--sample", type=float, default=2.5, help="seconds to wait for every GPU's utilisation sample")
    p.add_argument("--node", default="", type=_id_arg("node", optional=True), help="list only this node's sessions")
    p.add_argument("--sessions", type=int, default=500, help="list at most this many sessions (default 500)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("events", help="the lifecycle events on the bus, as a table")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing events as they are published")
    p.add_argument("--kind", default="", help="only this kind, or every kind under a prefix (node.drain)")
    p.add_argument("--limit", type=int, default=30, help="how many stored events to show first (default 30)")
    p.add_argument("--json", action="store_true", help="one JSON event per line")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("drain", help="cordon NODE, save every session there, evict its pods (--wait: until restored)")
    p.add_argument("node", type=_id_arg("node"))
    p.add_argument("--wait", action="store_true", help="follow every session until restored and verified elsewhere")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole drain (default 300)")
    p.add_argument(
        "--deadline",
        type=float,
        default=25.0,
        help="seconds the savers have: above 0, at most the pods' 30 s grace period (default 25)",
    )
    p.add_argument("--drain-id", default="", type=_id_arg("drain", optional=True))
    p.add_argument("--reason", default="maintenance")
    p.add_argument("--requested-by", default="cli")
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON document")
    p.set_defaults(func=cmd_drain_node)

    p = sub.add_parser("checkpoint", help="save every session on NODE (a drain request): no cordon, no eviction")
    p.add_argument("node", type=_id_arg("node"))
    p.add_argument("--drain-id", default="", type=_id_arg("drain", optional=True))
    p.add_argument("--reason", default="maintenance")
    p.add_argument("--requested-by", default="cli")
    p.add_argument(
        "--deadline",
        type=float,
        default=25.0,
        help="seconds the savers have: above 0, at most the pods' 30 s grace period (default 25)",
    )
    p.add_argument("--wait", action="store_true", help="wait for drain.completed or drain.failed")
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("uncordon", help="make NODE schedulable again")
    p.add_argument("node", type=_id_arg("node"))
    p.add_argument("--force", action="store_true", help="even while a driver upgrade holds the node (docs/drivers.md)")
    p.set_defaults(func=cmd_uncordon)

    p = sub.add_parser("upgrade-driver", help="roll driver VERSION over every node, sessions saved before evictions")
    p.add_argument("version")
    p.add_argument("--max-parallel", type=int, default=None, help="nodes upgraded at once (default: the document's)")
    p.add_argument("--wait", action="store_true", help="follow every node until it runs VERSION")
    p.add_argument("--timeout", type=float, default=900.0, help="--wait: seconds at most (default 900)")
    p.add_argument("--json", action="store_true", help="--wait: print the outcome as one JSON document")
    p.set_defaults(func=cmd_upgrade_driver)

    p = sub.add_parser("service", help="run one service in the foreground (python -m services.NAME)")
    p.add_argument("name", choices=(*SERVICES, "auth"))  # auth: the NATS auth callout of a secured mesh
    p.set_defaults(func=cmd_service)

    p = sub.add_parser("publish", help="validate and publish one event (JSON, @file or - for stdin)")
    p.add_argument("event")
    p.set_defaults(func=cmd_publish)

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
    lab.add_argument("node", type=_id_arg("node"))
    lab.add_argument("labels", nargs="+", metavar="KEY=VALUE|KEY-")
    lab.set_defaults(func=cmd_sim_label)

    p = sub.add_parser("fault", help="inject a SIMULATED fault (the same as `gpuwarden sim fault`)")
    add_fault_arguments(p)
    p.set_defaults(func=cmd_sim_fault)

    p = sub.add_parser("agent", help="talk to a pod's KV agent")
    asub = p.add_subparsers(dest="action", required=True)
    f = asub.add_parser("final-save", help="preStop hook: save every session of the pod before it stops")
    f.add_argument(
        "--pod",
        default=os.environ.get("GPUWARDEN_POD_NAME", ""),
        type=_id_arg("pod", optional=True),
        help="default $GPUWARDEN_POD_NAME",
    )
    f.add_argument("--deadline", type=float, default=25.0)
    f.set_defaults(func=cmd_agent_final_save)

    p = sub.add_parser("where", help="which pod holds SESSION's KV cache now (exit 1 when none does)")
    p.add_argument("session", type=_id_arg("session"))
    p.set_defaults(func=cmd_where)

    p = sub.add_parser("nats-auth", help="print a nats-server authorization block (static, or the auth callout's)")
    p.add_argument("--password-dir", required=True, help="folder with one file per user holding its password")
    p.add_argument("--node", default="", type=_id_arg("node", True), help="scope the node-scoped services to this node")
    p.add_argument(
        "--pod", default="", type=_id_arg("pod", True), help="scope the KV agents' user to this pod (default: any pod)"
    )
    p.add_argument("--bucket", default="", help="let the KV agents use this Object Store bucket (nats://<bucket>)")
    p.add_argument(
        "--issuer-seed-file",
        default="",
        help="the auth callout's account seed (written afresh when missing): print the callout's block instead",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds the server waits for the callout (default 5)")
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
    except CommandError as exc:
        print(f"gpuwarden {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        down = _unreachable(exc)
        if down is not None:
            print(f"gpuwarden {args.command}: {down.server} at {down.url} is unreachable", file=sys.stderr)
            return 1
        if isinstance(exc, OSError | TimeoutError):
            print(f"gpuwarden {args.command}: cannot reach the mesh: {exc}", file=sys.stderr)
            return 1
        if os.environ.get("GPUWARDEN_DEBUG"):
            raise
        from shared.ports.cluster import ClusterError

        if isinstance(exc, ClusterError):
            print(f"gpuwarden {args.command}: {exc}", file=sys.stderr)
            return 1
        print(f"gpuwarden {args.command}: {type(exc).__name__}: {exc} (GPUWARDEN_DEBUG=1 shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
