"""``gpuwarden``: run the mesh, start a service, and act on a running mesh as any other client of the bus would.

The CLI never imports a service: it starts them as processes (``python -m services.<name>``). Commands that
talk to a mesh find it through ``GPUWARDEN_NATS_URL``/``GPUWARDEN_REDIS_URL``, or else through the state file
that ``gpuwarden run`` writes (``$GPUWARDEN_HOME/run.json``), or else the defaults.

``GPUWARDEN_HOME`` (default ``.gpuwarden`` in the working directory) is the folder of ``gpuwarden run``: its state
file with the URLs and its pid, the processes' logs, the checkpoints it stores, and the data of the Redis it
starts (``redis/``, an append-only file), which a later run finds again.

This module is the parser, and the one place where an error becomes a line and an exit status (``main``); each
command lives in ``shared.console`` beside what it does: ``process`` (up, down, service), ``observe`` (status,
events), ``nodes`` (drain, checkpoint, uncordon, upgrade-driver), ``messages`` (publish, deadletters, where),
``configdocs`` (config), ``metrics``, ``sim``, ``agent``, ``natsauth`` and ``rollout``.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from shared.console import agent, configdocs, messages, metrics, natsauth, nodes, observe, process, sim
from shared.console.process import NODE_SCOPED, SERVICES
from shared.console.rollout import add_rollout_parser
from shared.console.state import (
    DEFAULT_HOME,
    REDIS_ONLY,
    CommandError,
    UsageError,
    command_settings,
    console_settings,
    home,
)
from shared.plumbing.errors import ServerUnreachable, SettingsError
from shared.plumbing.settings import Settings, public_url

__all__ = ["DEFAULT_HOME", "NODE_SCOPED", "SERVICES", "home", "main"]


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


def _deployment_arg(value: str) -> str:
    """An argparse type: ``namespace/name`` of a deployment, each part by the contract's rule ('' for none)."""
    from shared.contract.base import id_problem

    if value == "":
        return value
    namespace, slash, name = value.partition("/")
    problem = id_problem("namespace", namespace) or id_problem("deployment", name) if slash else "not NAMESPACE/NAME"
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def _number(kind: type[int] | type[float], least: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` that is at least ``least`` (``above``: more than it)."""

    def parse(value: str) -> float:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if number < least or (above and number == least):
            raise argparse.ArgumentTypeError(f"{value}: must be {'more than' if above else 'at least'} {least:g}")
        return number

    parse.__name__ = kind.__name__
    return parse


COUNT = _number(int, 1)
"""How many of something to show or take: 1 or more."""
SECONDS = _number(float, 0, above=True)
"""A duration in seconds: more than 0."""


class Parser(argparse.ArgumentParser):
    """argparse as a newcomer needs it: a mistake prints the usage of the (sub)command it was made in and one line,
    ``gpuwarden <command>: ...``, with a suggestion for a near miss of a command, a choice or a flag; exit 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: {message}\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            if isinstance(action, argparse._SubParsersAction):  # said as "no command", not "argument COMMAND: ..."
                raise argparse.ArgumentError(None, f"no command {value!r}{_did_you_mean(str(value), names)}")
            raise argparse.ArgumentError(action, f"no choice {value!r}{_did_you_mean(str(value), names)}")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = _chosen(self, parsed)
            flags = [o for a in chosen._actions for o in a.option_strings]
            first = extras[0]
            more = f" (and {' '.join(extras[1:])})" if extras[1:] else ""
            if first.startswith("-"):
                chosen.error(f"no option {first}{more}{_did_you_mean(first.split('=', 1)[0], flags)}")
            chosen.error(f"unexpected argument {first}{more}")
        return parsed


def _did_you_mean(word: str, names: Sequence[str]) -> str:
    """'; did you mean X?' for the closest of ``names``, and what there is when few enough to list."""
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    there = f" (choose from {', '.join(names)})" if len(names) <= 8 else " (--help lists them)"
    return f"; did you mean {close[0]}?" if close else there


def _chosen(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command ``parsed`` went through: ``gpuwarden config set`` for ``config set ...``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            picked = action.choices.get(getattr(parsed, action.dest, None) or "")
            if isinstance(picked, argparse.ArgumentParser):
                return _chosen(picked, parsed)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from shared.sim.faults import add_fault_arguments

    parser = Parser(
        prog="gpuwarden",
        description=__doc__.splitlines()[0] if __doc__ else "",
        epilog="`gpuwarden COMMAND --help` explains a command; docs/cli.md explains them all, and the exit codes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "up", aliases=["run"], help="servers, the six services and the simulated cluster and workload (run: the same)"
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
    p.add_argument(
        "--sessions", type=int, default=10, help="simulated open conversations per deployment at a time (default 10)"
    )
    p.add_argument("--nats-port", type=int, default=0, help="port of the NATS server it starts (default: a free one)")
    p.add_argument("--redis-port", type=int, default=0, help="port of the Redis server it starts (default: a free one)")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        help="--detach: seconds to wait for /readyz (default 90, and 0.2 more per node past 100)",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        help="NATS behind the auth callout, as a real cluster runs it: every service under its own user, every "
        "SIMULATED pod's KV agent under its pod's token, the CLI as the admin (secrets under $GPUWARDEN_HOME/secure)",
    )
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=process.cmd_up)

    p = sub.add_parser("down", help="stop the mesh `gpuwarden up --detach` started (pids in $GPUWARDEN_HOME/run.json)")
    p.add_argument("--timeout", type=SECONDS, default=30.0, help="seconds to let it stop before SIGKILL (default 30)")
    p.set_defaults(func=process.cmd_down)

    p = sub.add_parser("status", help="nodes, GPUs, deployments, sessions and drains in flight")
    p.add_argument("--json", action="store_true", help="one JSON document (documented in docs/cli.md)")
    p.add_argument("--watch", action="store_true", help="a live table, refreshed every --interval seconds")
    p.add_argument("--interval", type=SECONDS, default=2.0, help="--watch: seconds between refreshes (default 2)")
    p.add_argument(
        "--sample",
        type=_number(float, 0),
        default=None,
        help="seconds to listen for every GPU's utilisation sample, reading the rest meanwhile (default 2.5 up to "
        "50 nodes, whose metrics are read every 2 s; none beyond: a large fleet's are read every 15 s)",
    )
    p.add_argument("--node", default="", type=_id_arg("node", optional=True), help="list only this node's sessions")
    p.add_argument("--pod", default="", type=_id_arg("pod", optional=True), help="list only this pod's sessions")
    p.add_argument(
        "--deployment", default="", type=_deployment_arg, help="list only this deployment's sessions (NAMESPACE/NAME)"
    )
    p.add_argument(
        "--sessions", type=_number(int, 0), default=100, help="list at most this many sessions (default 100)"
    )
    p.set_defaults(func=observe.cmd_status)

    p = sub.add_parser("events", help="the lifecycle events on the bus, as a table")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing events as they are published")
    p.add_argument("--kind", default="", help="only this kind, or every kind under a prefix (node.drain)")
    p.add_argument("--limit", type=COUNT, default=30, help="how many stored events to show first (default 30)")
    p.add_argument("--json", action="store_true", help="one JSON event per line")
    p.set_defaults(func=observe.cmd_events)

    p = sub.add_parser("drain", help="cordon NODE, save every session there, evict its pods (--wait: until restored)")
    p.add_argument("node", type=_id_arg("node"), help="the node to drain (`gpuwarden status` lists them)")
    p.add_argument("--wait", action="store_true", help="follow every session until restored and verified elsewhere")
    p.add_argument("--timeout", type=SECONDS, default=300.0, help="seconds for the whole drain (default 300)")
    p.add_argument(
        "--deadline",
        type=float,
        default=25.0,
        help="seconds the savers have: above 0, at most the pods' 30 s grace period (default 25)",
    )
    p.add_argument(
        "--drain-id",
        default="",
        type=_id_arg("drain", optional=True),
        help="name the drain (default drain-NODE-<8 hex digits>); the same id asked again is the same drain",
    )
    p.add_argument("--reason", default="maintenance", help="why, as the drain request says (default maintenance)")
    p.add_argument("--requested-by", default="cli", help="who asks, as the drain request says (default cli)")
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON document")
    p.set_defaults(func=nodes.cmd_drain_node)

    p = sub.add_parser("checkpoint", help="save every session on NODE (a drain request): no cordon, no eviction")
    p.add_argument("node", type=_id_arg("node"), help="the node whose sessions to save")
    p.add_argument(
        "--drain-id",
        default="",
        type=_id_arg("drain", optional=True),
        help="name the drain (default drain-NODE-<8 hex digits>); the same id asked again is the same drain",
    )
    p.add_argument("--reason", default="maintenance", help="why, as the drain request says (default maintenance)")
    p.add_argument("--requested-by", default="cli", help="who asks, as the drain request says (default cli)")
    p.add_argument(
        "--deadline",
        type=float,
        default=25.0,
        help="seconds the savers have: above 0, at most the pods' 30 s grace period (default 25)",
    )
    p.add_argument("--wait", action="store_true", help="wait for drain.completed or drain.failed")
    p.set_defaults(func=nodes.cmd_checkpoint)

    p = sub.add_parser("uncordon", help="make NODE schedulable again")
    p.add_argument("node", type=_id_arg("node"), help="the node to make schedulable")
    p.add_argument("--force", action="store_true", help="even while a driver upgrade holds the node (docs/drivers.md)")
    p.set_defaults(func=nodes.cmd_uncordon)

    p = sub.add_parser("upgrade-driver", help="roll driver VERSION over every node, sessions saved before evictions")
    p.add_argument("version", help="the driver version every node should run, e.g. 560.35.03")
    p.add_argument("--max-parallel", type=int, default=None, help="nodes upgraded at once (default: the document's)")
    p.add_argument("--wait", action="store_true", help="follow every node until it runs VERSION")
    p.add_argument("--timeout", type=SECONDS, default=900.0, help="--wait: seconds at most (default 900)")
    p.add_argument("--json", action="store_true", help="--wait: print the outcome as one JSON document")
    p.set_defaults(func=nodes.cmd_upgrade_driver)

    p = sub.add_parser("service", help="run one service in the foreground (python -m services.NAME)")
    p.add_argument(  # auth: the NATS auth callout of a secured mesh
        "name",
        choices=(*SERVICES, "auth"),
        help="the service: driver, device, metrics, scaler, checkpoint, router or auth",
    )
    p.set_defaults(func=process.cmd_service)

    p = sub.add_parser("publish", help="validate and publish one event (JSON, @file or - for stdin)")
    p.add_argument("event", help="the event as JSON (its `kind` says which; proto/events has the schemas)")
    p.set_defaults(func=messages.cmd_publish)

    p = sub.add_parser("config", help="read or compare-and-set a configuration document in Redis")
    csub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    documents = ", ".join(configdocs.DOCUMENTS)
    g = csub.add_parser("get", help="print a document and its version (exit 1 when none is stored yet)")
    g.add_argument("name", help=f"the document: {documents}")
    c = csub.add_parser(
        "set",
        help="write a document with compare-and-set: the whole document (--replace to reset fields it leaves out), or "
        "--merge only the fields given; prints what changed",
    )
    c.add_argument("name", help=f"the document: {documents}")
    c.add_argument("doc", help="the document's fields as JSON, @file or - for stdin")
    how = c.add_mutually_exclusive_group()
    how.add_argument(
        "--merge",
        action="store_true",
        help="change only the fields DOC gives (objects merged field by field); every other field stays as stored",
    )
    how.add_argument(
        "--replace",
        action="store_true",
        help="DOC is the whole document: fields it leaves out go back to their defaults (without it such a set is "
        "refused, naming them)",
    )
    c.add_argument("--expect-version", type=int, default=None, help="fail unless the stored version is this")
    c.add_argument("--by", default="cli", help="who writes it, as the document's updated_by says (default cli)")
    p.set_defaults(func=configdocs.cmd_config)

    p = sub.add_parser("deadletters", help="show the newest dead letters")
    p.add_argument("--limit", type=COUNT, default=20, help="how many of the newest to show (default 20)")
    p.set_defaults(func=messages.cmd_deadletters)

    p = sub.add_parser("metrics", help="GPU metrics sources")
    msub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    m = msub.add_parser("scrape", help="fetch one dcgm-exporter page; print per GPU and per pod what is derived")
    m.add_argument("url", help="e.g. http://10.0.0.7:9400/metrics")
    m.add_argument("--json", action="store_true", help="JSON: per-GPU entries keyed by UUID, and per pod")
    m.add_argument("--timeout", type=float, default=5.0, help="seconds for the fetch (default 5)")
    m.set_defaults(func=metrics.cmd_metrics_scrape)

    p = sub.add_parser("sim", help="the SIMULATED cluster, GPUs and workload")
    simsub = p.add_subparsers(dest="sim_command", required=True, metavar="ACTION")
    r = simsub.add_parser("run", help="run the simulation (python -m shared.sim)", add_help=False)
    r.add_argument("sim_args", nargs=argparse.REMAINDER, help="--rate, --sessions, --prompt-tokens, --new-tokens")
    r.set_defaults(func=sim.cmd_sim_run)
    f = simsub.add_parser("fault", help="inject a fault: xid, lose_gpu, driver_install, slow_copies, mig or kill_pod")
    add_fault_arguments(f)
    f.set_defaults(func=sim.cmd_sim_fault)
    lab = simsub.add_parser("label", help="label a simulated node: KEY=VALUE sets, KEY- removes (as kubectl label)")
    lab.add_argument("node", type=_id_arg("node"), help="the simulated node to label")
    lab.add_argument("labels", nargs="+", metavar="KEY=VALUE|KEY-", help="labels to set (KEY=VALUE) or remove (KEY-)")
    lab.set_defaults(func=sim.cmd_sim_label)
    sc = simsub.add_parser(
        "scale", help="set a simulated deployment's replicas, as `kubectl scale` (scale-in: lowest deletion cost first)"
    )
    sc.add_argument("deployment", type=_deployment_arg, help="the simulated deployment (NAMESPACE/NAME)")
    sc.add_argument("replicas", type=_number(int, 0), help="the replicas it should have (0 or more)")
    sc.set_defaults(func=sim.cmd_sim_scale)

    p = sub.add_parser("fault", help="inject a SIMULATED fault (the same as `gpuwarden sim fault`)")
    add_fault_arguments(p)
    p.set_defaults(func=sim.cmd_sim_fault)

    p = sub.add_parser("agent", help="talk to a pod's KV agent")
    asub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    f = asub.add_parser("final-save", help="preStop hook: save every session of the pod before it stops")
    f.add_argument(
        "--pod",
        default=console_settings().pod,
        type=_id_arg("pod", optional=True),
        help="default $GPUWARDEN_POD_NAME",
    )
    f.add_argument("--deadline", type=SECONDS, default=25.0, help="seconds the pod's agent has to save (default 25)")
    f.set_defaults(func=agent.cmd_agent_final_save)

    p = sub.add_parser("where", help="which pod holds SESSION's KV cache now (exit 1 when none does)")
    p.add_argument("session", type=_id_arg("session"), help="the session id (`gpuwarden status` lists sessions)")
    p.set_defaults(func=messages.cmd_where)

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
    p.set_defaults(func=natsauth.cmd_nats_auth)

    add_rollout_parser(sub, lambda: command_settings(REDIS_ONLY))

    p = sub.add_parser("schemas", help="write (or --check) the JSON Schema and AsyncAPI files in proto/events")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is not what it would write")
    p.set_defaults(func=cmd_schemas)
    return parser


def _unreachable(exc: BaseException) -> ServerUnreachable | None:
    """The server ``exc`` says did not answer, with the URL this command used; None for any other failure."""
    from shared.plumbing.bus import nats_unreachable
    from shared.plumbing.configsync import redis_unreachable

    if isinstance(exc, ServerUnreachable):
        return exc
    try:
        settings = command_settings(needs=())  # the URLs the command used (it checked they were named)
    except (SettingsError, CommandError, OSError, ValueError, KeyError):
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
    from shared.plumbing.configsync import command_timeouts

    try:
        with command_timeouts():  # a busy machine's slow Redis is not a gone one (services run in their own processes)
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
        if console_settings().debug:
            raise
        from shared.ports.cluster import ClusterError

        if isinstance(exc, ClusterError):
            print(f"gpuwarden {args.command}: {exc}", file=sys.stderr)
            return 1
        print(f"gpuwarden {args.command}: {type(exc).__name__}: {exc} (GPUWARDEN_DEBUG=1 shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
