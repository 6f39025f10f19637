"""Tables and progress for people (``rich``); scripts read ``--json`` instead."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from shared.console.snapshot import MeshStatus, NodeView, SessionView


def _mib(value: float | None) -> str:
    return "?" if value is None else f"{value / 1024:.1f}G" if value >= 1024 else f"{value:.0f}M"


def _bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def restored_column(session: SessionView) -> str:
    """The ``restored+verified`` column: ``yes`` when the pod holding the session restored it from a checkpoint
    under the generation it holds and every digest checked out; ``gen N`` when its last verified restore was under
    an earlier generation N (on another pod; this one took it since without a restore: started afresh or recomputed);
    ``-`` when it was never restored from a checkpoint (started, or recomputed from its tokens, where it is)."""
    if session.verified_after_restore:
        return "yes"
    if session.restored_generation is not None:
        return f"gen {session.restored_generation}"
    return "-"


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    seconds = max(0.0, now - at)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def needs_attention(node: NodeView) -> bool:
    """Cordoned, not ready, upgrading (or failed to), or with an unhealthy GPU: listed first in a large fleet."""
    upgrading = node.upgrade_state not in ("", "upgrade-done") or bool(node.upgrade_failure)
    return not node.schedulable or not node.ready or upgrading or any(not g.healthy for g in node.gpus)


def status_tables(status: MeshStatus, *, max_sessions: int = 40, max_nodes: int = 40) -> Group:
    """The snapshot as tables. A fleet of more than ``max_nodes`` nodes is summarised: its counts in the title,
    and ``max_nodes`` rows, those that need attention first (``needs_attention``); ``--json`` lists every node."""
    now = status.taken_at
    listed = status.nodes
    title = "nodes" + (" (SIMULATED)" if status.simulated else "")
    attention = [n for n in status.nodes if needs_attention(n)]
    if len(status.nodes) > max_nodes:
        gpu_count = sum(len(n.gpus) for n in status.nodes)
        unhealthy = sum(1 for n in status.nodes for g in n.gpus if not g.healthy)
        cordoned = sum(1 for n in status.nodes if not n.schedulable)
        title += f": {len(status.nodes)}, {gpu_count} GPUs ({unhealthy} unhealthy), {cordoned} cordoned"
        first = {n.name for n in attention[:max_nodes]}
        listed = attention[:max_nodes] + [n for n in status.nodes if n.name not in first][: max_nodes - len(first)]
    nodes = Table(title=title, title_justify="left")
    for column in ("node", "schedulable", "driver", "upgrade", "pods", "sessions", "GPUs (health util mem MIG)"):
        nodes.add_column(column)
    if len(listed) < len(status.nodes):
        hidden = len(status.nodes) - len(listed)
        more = len(attention) - sum(1 for n in listed if needs_attention(n))
        nodes.caption = (
            f"... and {hidden} more nodes ({len(attention)} need attention: cordoned, not ready, upgrading or with a "
            f"GPU unhealthy, listed first; {more} of them not listed): --json lists every node"
        )
    for node in listed:
        gpus = []
        for gpu in node.gpus:
            health = "ok" if gpu.healthy else "UNHEALTHY"
            util = "?" if gpu.util_percent is None else f"{gpu.util_percent:.0f}%"
            mem = f"{_mib(gpu.memory_used_mib)}/{_mib(gpu.memory_total_mib)}"
            mig = f" MIG {','.join(m.profile for m in gpu.mig)}" if gpu.mig_enabled else ""
            gpus.append(f"{gpu.index}:{health} {util} {mem}{mig}")
        upgrade = node.upgrade_state or "-"
        if node.upgrade_failure:
            upgrade += f" ({node.upgrade_failure})"
        nodes.add_row(
            node.name,
            "yes" if node.schedulable else Text("cordoned", style="yellow"),
            node.driver_version or "?",
            upgrade,
            str(len(node.pods)),
            str(node.sessions),
            "\n".join(gpus) or "-",
        )
    deployments = Table(title="deployments", title_justify="left")
    for column in ("deployment", "replicas", "desired", "model", "why", "requests landed"):
        deployments.add_column(column)  # the same columns whether or not a router has picked yet (scripts read them)
    for dep in status.deployments:
        desired = str(dep.desired) + (f" (scaler {dep.scaler_desired})" if dep.scaler_desired is not None else "")
        model = dep.serving_version or "-"
        if (r := dep.rollout) is not None and r.phase == "preparing":
            model += f" -> {r.to_version} preparing ({len(r.ready)} ready, {len(r.failed)} failed)"
        elif r is not None:
            model += f" (rollout {r.from_version} -> {r.to_version} {r.phase})"
        why = f"by {dep.scaler_signal}: {dep.why}" if dep.scaler_signal else dep.why
        deployments.add_row(f"{dep.namespace}/{dep.name}", str(dep.replicas), desired, model, why, _landed(dep.landed))
    total = status.sessions_total if status.sessions_total is not None else len(status.sessions)
    moving = f", {status.sessions_moving} moving" if status.sessions_moving else ""
    sessions = Table(title=f"sessions ({total}{moving})", title_justify="left")
    for column in ("session", "pod", "node", "gen", "bytes", "tokens", "last checkpoint", "restored+verified"):
        sessions.add_column(column)
    for session in status.sessions[:max_sessions]:
        last = session.last_checkpoint
        verified = restored_column(session)
        sessions.add_row(
            session.id,
            session.pod if session.state == "held" else Text(f"{session.pod} (moving)", style="yellow"),
            session.node,
            str(session.generation),
            _bytes(session.bytes) if last else "-",  # nothing saved yet: no size to show
            str(session.tokens) if last else "-",
            _ago(last.at, now) if last else "none yet",
            verified,
        )
    shown = min(len(status.sessions), max_sessions)
    if status.sessions_error:
        sessions.caption = f"sessions unknown: {status.sessions_error}"
    elif total > shown:
        sessions.caption = (
            f"... and {total - shown} more (--node NODE, --pod POD, --deployment NS/NAME, --sessions N, --json)"
        )
    parts: list[Any] = [nodes, deployments, sessions]
    if status.drains:
        drains = Table(title="drains in flight", title_justify="left")
        for column in ("drain", "node", "saves", "committed", "pods left", "sessions left"):
            drains.add_column(column)
        for d in status.drains:
            drains.add_row(d.id, d.node, d.state, str(d.sessions_committed), str(d.pods_left), str(d.sessions_left))
        parts.append(drains)
    down = {k: v for k, v in status.services.items() if v != "ok"}
    if down:
        parts.append(Text("services not ok: " + ", ".join(f"{k} {v}" for k, v in down.items()), style="red"))
    if status.simulation:
        sim = status.simulation
        parts.append(
            Text(
                "simulation: "
                + "  ".join(
                    f"{k} {sim.get(k, 0)}" for k in ("requests", "served", "restored", "started_fresh", "ended", "lost")
                ),
                style="dim",
            )
        )
    parts.append(Text(time.strftime("as of %H:%M:%S", time.localtime(now)), style="dim"))
    return Group(*parts)


def _landed(landed: dict[str, int] | None) -> str:
    """The router's landings of one deployment: on the holder, prefetched, cold (restored on the request), and the
    rest when there are any; '-' when no router picks for it."""
    if not landed:
        return "-"
    shown = [f"{k.replace('_', ' ')} {landed.get(k, 0)}" for k in ("holder", "prefetched", "cold")]
    shown += [
        f"{k.replace('_', ' ')} {v}" for k, v in landed.items() if k not in ("holder", "prefetched", "cold") and v
    ]
    return ", ".join(shown)


def console(stderr: bool = False) -> Console:
    """A terminal's own width; into a pipe or a file $COLUMNS or 160 (rich would take 80 and wrap every table)."""
    found = Console(stderr=stderr, highlight=False)
    if found.is_terminal:
        return found
    import os

    columns = os.environ.get("COLUMNS", "")
    return Console(stderr=stderr, highlight=False, width=int(columns) if columns.isdigit() else 160)
