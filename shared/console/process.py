"""``gpuwarden up`` and ``down``: the embedded default, in the foreground or in the background, and its end.

``up`` starts a NATS server with JetStream and a Redis server (unless their URLs are given), the six services as
separate processes (``python -m services.<name>``; the node-scoped ones once per node) and the simulated cluster
and workload, and keeps them running: a process that exits is started again. Each process's HTTP port is bound
by ``up`` itself when it plans the process and handed down as a listening socket (``GPUWARDEN_HTTP_FD``): the
port is held for the whole run, so a restarted process finds it still its own and never loops on a port another
program took meanwhile. With hollow nodes (``--hollow``, or ``hollow: true`` in the spec) each node-scoped service
is one process for every node (``GPUWARDEN_HOLLOW_NODES``, ``shared.host.hollow``), so a fleet of a thousand
simulated nodes is six service processes, not 3,003; ``--nodes N`` makes such a fleet (``node-1``..``node-N``)
from the spec's deployments. ``$GPUWARDEN_HOME/run.json`` says
where everything is: the URLs, every health URL, and the pid of every process the run started, which is what
``down`` stops and then checks. ``up --detach`` starts the same run in a session of its own, waits until every
process answers ``/readyz``, prints where things are and returns. ``gpuwarden service NAME`` is one service alone,
in the foreground (``python -m services.NAME``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shared.console.state import CommandError, alive, home, read_state, state_file
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import load_settings

SERVICES = ("driver", "device", "metrics", "scaler", "checkpoint", "router")
NODE_SCOPED = ("driver", "device", "metrics")


def _write_state(path: Path, state: dict[str, Any]) -> None:
    """Replace the state file at once: a reader never sees half of it."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


def live_pid(path: Path) -> int | None:
    """The pid of the run that wrote the state file ``path``, while that process lives."""
    try:
        pid = int(read_state(path).get("pid", 0))
    except (TypeError, ValueError):
        return None
    return pid if pid != os.getpid() and alive(pid) else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port of ``host`` and listening, inheritable by the processes ``up`` starts."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def check_ports(args: argparse.Namespace) -> None:
    for flag, port in (("--nats-port", args.nats_port), ("--redis-port", args.redis_port)):
        if port and not _port_free(port):
            raise CommandError(f"port {port} on 127.0.0.1 is taken; choose another with {flag}, or leave it out")


# -- foreground -------------------------------------------------------------------------------------------------
def run_foreground(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    env.setdefault("GPUWARDEN_ROOT", "gw")
    env.setdefault("GPUWARDEN_BACKEND", "sim")
    try:
        load_settings(env)
    except SettingsError as exc:
        raise CommandError(str(exc)) from None
    base = home(env)
    nodes, hollow = _fleet(args, env, base)
    path = state_file(env)
    other = live_pid(path)
    if other is not None:
        raise CommandError(
            f"already running as pid {other} with GPUWARDEN_HOME={base}; `gpuwarden down` stops it, or set another "
            "GPUWARDEN_HOME"
        )
    check_ports(args)
    log_dir = base / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    owned: list[Any] = []
    secure = _secure(args, env, base)
    try:
        _start_servers(env, base, owned, args, secure)
        return _run_mesh(args, env, nodes, base, path, log_dir, owned, hollow, secure)
    finally:
        for server in owned:
            server.cleanup()  # the Redis data folder stays for the next run
        path.unlink(missing_ok=True)


FLEET_SPEC = "fleet-spec.json"
"""The spec ``up --nodes N`` writes under ``GPUWARDEN_HOME`` (and hands every process as ``GPUWARDEN_SIM_SPEC``)."""
QUICK_METRICS_UP_TO = 50
"""Up to this many nodes the metrics services read their exporters every 2 s (``gpuwarden status`` hears every GPU
soon); a larger simulated fleet reads every 15 s, as Prometheus scrapes dcgm-exporter."""


def _fleet(args: argparse.Namespace, env: dict[str, str], base: Path) -> tuple[list[str], bool]:
    """The nodes of the run and whether they are hollow. ``--nodes N`` writes a spec of N nodes (the spec's
    deployments, driver and CUDA versions kept) and points ``GPUWARDEN_SIM_SPEC`` at it."""
    raw = str(args.nodes).strip()
    simulated = env["GPUWARDEN_BACKEND"] == "sim"
    asked: bool | None = getattr(args, "hollow", None)
    if not simulated:
        if asked or raw.isdigit():
            raise CommandError("--hollow and --nodes N make a simulated fleet: GPUWARDEN_BACKEND=sim")
        nodes = [n for n in raw.split(",") if n]
        if not nodes:
            raise CommandError("--nodes: at least one node name")
        return nodes, False
    import msgspec

    from shared.sim.spec import FleetSpec, GpuSpec, SpecError, load_spec

    try:
        spec = load_spec(env=env)
    except SpecError as exc:
        raise CommandError(str(exc)) from None
    hollow = spec.hollow if asked is None else asked
    if raw.isdigit():
        count = int(raw)
        if count < 1 or args.gpus_per_node < 1:
            raise CommandError("--nodes N and --gpus-per-node: at least 1")
        fleet = FleetSpec(count=count, gpus=[GpuSpec(count=args.gpus_per_node)])
        written = {
            "driver_version": spec.driver_version,
            "cuda_version": spec.cuda_version,
            "fleets": [msgspec.to_builtins(fleet)],
            "deployments": msgspec.to_builtins(spec.deployments),
            "hollow": hollow,
        }
        base.mkdir(parents=True, exist_ok=True)
        target = base / FLEET_SPEC
        target.write_text(json.dumps(written, indent=1))
        env["GPUWARDEN_SIM_SPEC"] = str(target)
        try:
            load_spec(str(target))  # the deployments must still fit the fleet's GPUs
        except SpecError as exc:
            raise CommandError(str(exc)) from None
        return fleet.names(), hollow
    nodes = [n for n in raw.split(",") if n] or [n.name for n in spec.nodes]
    return nodes, hollow


def _claims(env: dict[str, str]) -> bool:
    """Whether the simulation's spec has a deployment whose pods ask for GPUs by DRA claim."""
    if env["GPUWARDEN_BACKEND"] != "sim":
        return False
    from shared.sim.spec import load_spec

    return any(d.claim is not None for d in load_spec(env=env).deployments)


def _dra_env(env: dict[str, str], folder: Path) -> dict[str, str]:
    """A device service of the simulation as a DRA driver beside the device plugin (``both``), its kubelet
    folders under the run's home (no kubelet dials them here; its ResourceSlices are what the simulated
    scheduler reads), unless the environment names them."""
    wanted = {
        "GPUWARDEN_DEVICE_API": "both",
        "GPUWARDEN_DRA_PLUGIN_DIR": str(folder / "plugin"),
        "GPUWARDEN_DRA_REGISTRY_DIR": str(folder / "registry"),
        "GPUWARDEN_CDI_DIR": str(folder / "cdi"),
    }
    for path in ("GPUWARDEN_DRA_PLUGIN_DIR", "GPUWARDEN_DRA_REGISTRY_DIR", "GPUWARDEN_CDI_DIR"):
        Path(env.get(path, wanted[path])).mkdir(parents=True, exist_ok=True)
    return {k: env.get(k, v) for k, v in wanted.items()}


SECURE_DIR = "secure"
"""Under ``GPUWARDEN_HOME``, ``up --secure``'s passwords, issuer seed, server configuration and pods' tokens."""


def _secure(args: argparse.Namespace, env: dict[str, str], base: Path) -> Any:
    """``--secure``: the secrets of the run (kept from an earlier one), or None. It needs the NATS server it
    starts: an external one's configuration is not ``up``'s to write."""
    if not getattr(args, "secure", False):
        return None
    if env.get("GPUWARDEN_NATS_URL"):
        raise CommandError("--secure configures the NATS server it starts: leave GPUWARDEN_NATS_URL unset")
    from shared.console.secure import callout_secrets

    return callout_secrets(base / SECURE_DIR)


def _start_servers(
    env: dict[str, str], base: Path, owned: list[Any], args: argparse.Namespace, secure: Any = None
) -> None:
    """Start NATS and Redis unless their URLs are given; Redis keeps its data in ``base/redis`` (AOF). With
    ``secure`` (``CalloutSecrets``), NATS knows one user, the auth callout's: everyone else is the callout's."""
    from shared.host.devservers import NatsServer, RedisServer, free_port

    try:
        if not env.get("GPUWARDEN_NATS_URL"):
            config = None
            if secure is not None:
                from shared.console.secure import write_server_config
                from shared.contract.subjects import Subjects

                config = write_server_config(base / SECURE_DIR / "nats.conf", Subjects(env["GPUWARDEN_ROOT"]), secure)
            nats_server = NatsServer(port=args.nats_port or free_port(), config=config)
            owned.append(nats_server)
            env["GPUWARDEN_NATS_URL"] = nats_server.start().url
        if not env.get("GPUWARDEN_REDIS_URL"):
            redis_server = RedisServer(port=args.redis_port or free_port(), dir=base / "redis", persistent=True)
            owned.append(redis_server)
            env["GPUWARDEN_REDIS_URL"] = redis_server.start().url
    except RuntimeError as exc:  # a missing binary, a server that would not start: one line
        raise CommandError(str(exc)) from None


def reserved_port() -> socket.socket:
    """A port of loopback held for the run: bound with SO_REUSEPORT and never listening, so that no other process
    can take it (an unrelated bind is refused) while a process told to share it (``GPUWARDEN_ROUTER_SHARE_PORT``)
    binds and listens there, as often as it is started again."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _router_env(env: Mapping[str, str], reserve: Callable[[], socket.socket]) -> dict[str, str]:
    """Where the router listens (``GPUWARDEN_ROUTER_ADDR``, else a port of loopback ``reserve`` holds for the run)
    and its pool (``GPUWARDEN_ROUTER_POOL``, else with the simulation its spec's first deployment), and, with the
    simulation, the same for its gateway: the simulated requests of that pool go through the router."""
    if env.get("GPUWARDEN_ROUTER_ADDR"):
        found = {"GPUWARDEN_ROUTER_ADDR": env["GPUWARDEN_ROUTER_ADDR"]}
    else:
        port = reserve().getsockname()[1]
        found = {"GPUWARDEN_ROUTER_ADDR": f"127.0.0.1:{port}", "GPUWARDEN_ROUTER_SHARE_PORT": "on"}
    pool = env.get("GPUWARDEN_ROUTER_POOL", "")
    if env.get("GPUWARDEN_BACKEND") == "sim":
        from shared.sim.spec import load_spec

        deployments = load_spec(env=env).deployments
        if not pool and deployments:
            pool = f"{deployments[0].namespace}/{deployments[0].name}"
        host, _, port = found["GPUWARDEN_ROUTER_ADDR"].rpartition(":")
        reach = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
        found["GPUWARDEN_SIM_ROUTER"] = f"{reach}:{port}"
        if pool:
            found["GPUWARDEN_SIM_ROUTER_POOL"] = pool
    if pool:
        found["GPUWARDEN_ROUTER_POOL"] = pool
    return found


def _run_mesh(
    args: argparse.Namespace,
    env: dict[str, str],
    nodes: list[str],
    base: Path,
    path: Path,
    log_dir: Path,
    servers: list[Any],
    hollow: bool = False,
    secure: Any = None,
) -> int:
    """Start the plan's processes and keep them, and the servers this run started, running until stopped: a
    process or server that exits is started again (a server on its own port and folder). With ``secure``
    (``CalloutSecrets``): the auth service first, then the streams (the admin's to create), then every service
    under its own user and the simulation as the admin, each of its pods' KV agents with its own pod's token."""
    from shared.contract.subjects import Subjects
    from shared.host.hollow import node_list

    checkpoints = f"file://{base / 'checkpoints'}"
    listeners: dict[str, socket.socket] = {}

    def reserve_router_port() -> socket.socket:
        sock = listeners["router-reserved"] = reserved_port()
        return sock

    router = _router_env(env, reserve_router_port)
    claims = _claims(env)
    plan: list[tuple[str, str, dict[str, str]]] = []
    subjects = Subjects(env["GPUWARDEN_ROOT"])

    def http(label: str) -> dict[str, str]:
        """The HTTP listener of ``label``'s process: bound here, now, and held while the run lasts."""
        sock = listeners[label] = listening_socket()
        return {"GPUWARDEN_HTTP_ADDR": f"127.0.0.1:{sock.getsockname()[1]}", "GPUWARDEN_HTTP_FD": str(sock.fileno())}

    def as_user(name: str) -> dict[str, str]:
        if secure is None:
            return {}
        from shared.console.secure import user_env

        return user_env(subjects, secure, name)

    if secure is not None:
        from shared.console.secure import auth_env
        from shared.kv.stores import parse_store_url

        store = env.get("GPUWARDEN_CHECKPOINT_STORE", checkpoints)
        kind, where, _ = parse_store_url(store)
        auth = dict(env, GPUWARDEN_NODE=nodes[0], **http("auth"))
        auth.update(auth_env(subjects, secure, where if kind == "nats" else ""))
        plan.append(("auth", "services.auth", auth))

    for name in SERVICES:
        hosted = name in NODE_SCOPED and hollow
        for node in nodes if name in NODE_SCOPED and not hollow else [nodes[0]]:
            label = f"{name}@hollow" if hosted else f"{name}@{node}" if name in NODE_SCOPED else name
            child = dict(env, GPUWARDEN_NODE=node, **http(label), **as_user(name))
            if hosted:
                child["GPUWARDEN_HOLLOW_NODES"] = node_list(nodes)
            child.setdefault("GPUWARDEN_CHECKPOINT_STORE", checkpoints)
            # one machine's disk, every writer on it: packs nothing references go after a minute, not ten
            child.setdefault("GPUWARDEN_CHECKPOINT_GC_S", "30")
            child.setdefault("GPUWARDEN_CHECKPOINT_GC_GRACE_S", "60")
            child.setdefault("GPUWARDEN_SCALER_ADDR", "127.0.0.1:0")  # KEDA is not here: any free port
            if name == "device" and claims:  # the spec's pods ask for GPUs by DRA claim: publish slices
                child.update(_dra_env(child, base / "dra" / ("hollow" if hosted else node)))
            if name == "router":
                child.update((k, v) for k, v in router.items() if k.startswith("GPUWARDEN_ROUTER_"))
            if name == "metrics" and env["GPUWARDEN_BACKEND"] == "sim":  # scrape the simulated exporters
                child.setdefault("GPUWARDEN_METRICS_SOURCE", "dcgm")
                child.setdefault("GPUWARDEN_METRICS_AGGREGATE", "bus" if node == nodes[0] else "off")
                quick = len(nodes) <= QUICK_METRICS_UP_TO  # `gpuwarden status` hears every GPU soon
                child.setdefault("GPUWARDEN_METRICS_INTERVAL_S", "2" if quick else "15")
            plan.append((label, f"services.{name}", child))
    if env["GPUWARDEN_BACKEND"] == "sim":
        sim_env = dict(env, GPUWARDEN_NODE=nodes[0], **http("sim"), **as_user("admin"))
        sim_env.setdefault("GPUWARDEN_CHECKPOINT_STORE", checkpoints)
        for key, value in router.items():  # its requests go through the router, as a gateway's do
            if key.startswith("GPUWARDEN_SIM_"):
                sim_env.setdefault(key, value)
        if secure is not None:  # the simulated cluster and workload as the admin; each pod's agent as its pod
            sim_env["GPUWARDEN_SIM_TOKEN_DIR"] = str(base / SECURE_DIR / "tokens")
        plan.append(("sim", "shared.sim", sim_env))
    state: dict[str, Any] = {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "nats_url": env["GPUWARDEN_NATS_URL"],
        "redis_url": env["GPUWARDEN_REDIS_URL"],
        "root": env["GPUWARDEN_ROOT"],
        "simulated": env["GPUWARDEN_BACKEND"] == "sim",
        "nodes": len(nodes),
        "hollow": hollow,
        "services": {label: "http://" + child["GPUWARDEN_HTTP_ADDR"] + "/healthz" for label, _, child in plan},
        "logs": str(log_dir),
        "pids": {},
    }
    if secure is not None:  # how the CLI connects: as the admin (``state.command_env``)
        state["secure"] = as_user("admin")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    extra = {"sim": ["--rate", str(args.rate), "--sessions", str(args.sessions)]}

    def record() -> None:
        pids = {label: p.pid for label, p in procs.items()}
        for server in servers:
            if server.proc is not None:
                pids[type(server).__name__.removesuffix("Server").lower()] = server.proc.pid
        state["pids"] = pids
        _write_state(path, state)

    def launch(label: str, module: str, child: dict[str, str]) -> None:
        out = open(log_dir / f"{label.replace('@', '-')}.log", "ab")
        procs[label] = subprocess.Popen(
            [sys.executable, "-m", module, *extra.get(label, [])],
            env=child,
            stdout=out,
            stderr=out,
            pass_fds=(listeners[label].fileno(),),
        )

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    for label, name, child in plan:
        launch(label, name, child)
        if label == "auth":  # nobody connects until the callout answers; the streams are the admin's to create
            record()
            _wait_ready(state["services"]["auth"], procs["auth"], log_dir / "auth.log")
            _ensure_streams(dict(env, **as_user("admin")))
    record()
    if not args.quiet:
        print(banner(state, base))
        print("  Ctrl-C stops everything", flush=True)
    started = time.monotonic()
    restarts: dict[str, int] = {}
    try:
        while not stopping and (args.seconds is None or time.monotonic() - started < args.seconds):
            time.sleep(0.5)
            changed = False
            for server in servers:
                if server.proc is not None and server.proc.poll() is not None and not stopping:
                    kind = type(server).__name__
                    print(f"  {kind} exited with {server.proc.returncode}; restarting on {server.url}", flush=True)
                    try:
                        server.start()
                        changed = True
                    except RuntimeError as exc:  # tried again on the next round
                        print(f"  {kind} did not start again: {exc}", flush=True)
            for label, name, child in plan:
                proc = procs[label]
                if proc.poll() is not None and not stopping:
                    restarts[label] = restarts.get(label, 0) + 1
                    print(f"  {label} exited with {proc.returncode}; restarting (#{restarts[label]})", flush=True)
                    backoff = time.monotonic() + min(restarts[label], 5)
                    while not stopping and time.monotonic() < backoff:  # a stop ends the back-off at once
                        time.sleep(0.1)
                    if stopping:
                        break
                    launch(label, name, child)
                    changed = True
            if changed:
                record()
    finally:
        # In order: the simulated cluster and workload first (its requests and pods would otherwise call on services
        # already gone, and its teardown compete with theirs for the CPU), then the services, then the auth callout
        # they authenticate through; NATS and Redis after this returns (run_foreground).
        for group in (["sim"], [label for label in procs if label not in ("sim", "auth")], ["auth"]):
            _stop_all({label: procs[label] for label in group if label in procs})
        for sock in listeners.values():
            sock.close()
    print("stopped", flush=True)
    return 0


STOP_WAIT_S = 15.0
"""How long ``up`` waits for a process it sent SIGTERM before it kills it."""


def _stop_all(procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every process of ``procs`` at once, then wait for each (``STOP_WAIT_S`` in all; then SIGKILL)."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    for label, proc in procs.items():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"  {label} did not stop within {STOP_WAIT_S:g} s of SIGTERM; killed", flush=True)
            proc.kill()
            proc.wait()


def banner(state: dict[str, Any], base: Path) -> str:
    simulated = " (SIMULATED GPUs and cluster)" if state.get("simulated") else ""
    if state.get("secure"):
        simulated += ", secured: every service and pod under its own identity (auth callout)"
    lines = [
        f"gpuwarden is running{simulated}",
        f"  NATS   {state['nats_url']}   Redis {state['redis_url']}   root {state['root']}",
    ]
    lines += [f"  {label:<18} {url}" for label, url in state.get("services", {}).items()]
    lines.append(f"  home   {base}   (state, logs, checkpoints, Redis data)")
    lines.append("  try:   gpuwarden status      gpuwarden drain node-1 --wait      gpuwarden events --follow")
    return "\n".join(lines)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _ready(url):
        if proc.poll() is not None:
            raise CommandError(f"the auth service exited: {_last_words(log)} (log: {log})")
        if time.monotonic() > deadline:
            raise CommandError(f"the auth service was not ready within {timeout:g}s (log: {log})")
        time.sleep(0.2)


def _ensure_streams(env: dict[str, str]) -> None:
    """The streams, created as the admin (a service may look them up, never create them on a secured server), and
    with a ``nats://`` checkpoint store its index (``shared.kv.objstore.family``), before any pod saves."""
    import asyncio

    from shared.contract.subjects import Subjects
    from shared.plumbing.bus import Bus

    async def ensure() -> None:
        settings = load_settings(env)
        bus = await Bus.connect(settings.nats, Subjects(settings.root), "up", connect_timeout=5.0)
        try:
            await bus.ensure_streams()
            store = env.get("GPUWARDEN_CHECKPOINT_STORE", "")
            if store.startswith("nats://"):
                from shared.kv.objstore.family import PodBuckets
                from shared.kv.stores import parse_store_url

                _, bucket, options = parse_store_url(store)
                await PodBuckets(bus.nc, bucket, **options).index.ensure()
        finally:
            await bus.close(1.0)

    asyncio.run(ensure())


# -- detached -----------------------------------------------------------------------------------------------------
def _ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url.removesuffix("/healthz") + "/readyz", timeout=1.0) as answer:
            return bool(answer.status == 200)
    except Exception:
        return False


def _last_words(log: Path) -> str:
    """The line of the run's log that says why it stopped (its last non-empty one)."""
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1].removeprefix("gpuwarden up: ")
    return "no output"


def ready_timeout(nodes: str) -> float:
    """How long ``up --detach`` waits by default: 90 s, and 0.2 s more per node past 100 (``--nodes``: a count, or
    names)."""
    raw = nodes.strip()
    count = int(raw) if raw.isdigit() else len([n for n in raw.split(",") if n])
    return 90.0 + 0.2 * max(0, count - 100)


def _end_session(proc: subprocess.Popen[bytes], path: Path) -> None:
    """End what is left of a detached run and everything it started (its session's process group): a run stopped
    before it wrote its state file is not found by ``stop``. SIGTERM, ``STOP_WAIT_S``, then SIGKILL to the group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_WAIT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    path.unlink(missing_ok=True)


def run_detached(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``gpuwarden up`` (without ``--detach``) in a session of its own, wait until every process it lists
    answers ``/readyz``, print where things are."""
    env = dict(os.environ)
    base = home(env)
    path = state_file(env)
    other = live_pid(path)
    if other is not None:
        raise CommandError(f"already running as pid {other} with GPUWARDEN_HOME={base}; `gpuwarden down` stops it")
    check_ports(args)
    (base / "logs").mkdir(parents=True, exist_ok=True)
    log = base / "logs" / "up.log"
    with open(log, "ab") as out:
        out.truncate(0)
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", *argv, "--quiet"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    timeout = args.ready_timeout if args.ready_timeout is not None else ready_timeout(str(args.nodes))
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {}
    waiting = ["the run's state file"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CommandError(f"the mesh did not start: {_last_words(log)} (log: {log})")
        state = read_state(path)
        if state.get("pid") == proc.pid:
            waiting = [label for label, url in state.get("services", {}).items() if not _ready(url)]
            if not waiting:
                break
        time.sleep(0.3)
    else:
        stop(env, quiet=True)
        _end_session(proc, path)
        raise CommandError(
            f"the mesh was not ready within {timeout:g}s (--ready-timeout), still waiting for "
            f"{', '.join(waiting)} (log: {log}); stopped it again"
        )
    print(banner(state, base))
    print(f"  pid {proc.pid}; `gpuwarden down` stops everything", flush=True)
    return 0


# -- down ---------------------------------------------------------------------------------------------------------
def _ours(pid: int) -> bool:
    """The pid still runs a program a run starts (not a stranger that got the number since)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return alive(pid)
    return any(word in cmdline for word in (b"python", b"nats-server", b"redis-server", b"shared.cli", b"gpuwarden"))


def stop(env: Mapping[str, str], *, quiet: bool = False, timeout: float = 30.0) -> int:
    """Stop the run of ``GPUWARDEN_HOME``: SIGTERM to the run (it stops its processes and servers), then anything
    it started that is still there, by the pids it recorded. Returns how many processes were stopped."""
    path = state_file(env)
    state = read_state(path)
    main = int(state.get("pid", 0) or 0)
    recorded = [int(p) for p in (state.get("pids") or {}).values() if str(p).isdigit()]
    if not state or (not alive(main) and not any(alive(p) for p in recorded)):
        path.unlink(missing_ok=True)
        if not quiet:
            print(f"nothing to stop: no mesh is running under GPUWARDEN_HOME={home(env)}")
        return 0
    everyone = [p for p in [main, *recorded] if alive(p) and _ours(p)]
    if alive(main):
        os.kill(main, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive(main):
        time.sleep(0.1)
    left = [p for p in recorded if alive(p) and _ours(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in left):
        time.sleep(0.1)
    for pid in [main, *left]:
        if alive(pid) and _ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    survivors = [p for p in [main, *recorded] if alive(p)]
    if survivors:
        raise CommandError(f"processes {survivors} did not stop")
    path.unlink(missing_ok=True)
    if not quiet:
        print(f"stopped: {len(everyone)} processes (run pid {main}, its services, NATS and Redis); none left")
    return len(everyone)


# -- the commands -------------------------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    if not args.detach:
        return run_foreground(args)
    argv = ["--nodes", args.nodes, "--rate", str(args.rate), "--gpus-per-node", str(args.gpus_per_node)]
    argv += ["--sessions", str(args.sessions)]
    argv += ["--nats-port", str(args.nats_port), "--redis-port", str(args.redis_port)]
    if args.hollow is not None:
        argv.append("--hollow" if args.hollow else "--no-hollow")
    if args.seconds is not None:
        argv += ["--seconds", str(args.seconds)]
    if getattr(args, "secure", False):
        argv.append("--secure")
    return run_detached(args, argv)


def cmd_down(args: argparse.Namespace) -> int:
    stop(os.environ, timeout=args.timeout)
    return 0


def cmd_service(args: argparse.Namespace) -> int:
    os.execv(sys.executable, [sys.executable, "-m", f"services.{args.name}"])
    return 0  # not reached
