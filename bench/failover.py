"""What a NATS failover costs a gpuwarden client: a 3-server cluster on loopback (``NatsCluster``), the events stream
R3, one client publishing lifecycle events (``Bus.publish``, JetStream) and one sending requests (``Bus.request``)
to a responder, back to back. One server is SIGKILLed: the events stream's leader, then (on a fresh cluster) the
JetStream meta leader. For each, the longest publish and the longest request from the kill until ``window_s``
later, how many of the two clients were connected to the server that died, and whether it led the stream too
(the meta leader often does).

``python -m bench.failover [--quick] [--out PATH] [--strict]`` writes ``bench/results/failover.json`` (it always
starts its own cluster: ``--nats-url`` is not used). Every figure is one run's; read them against the machine's
load (``machine.load_avg``).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.common import BenchOptions, Target, exit_code, finish, machine_info, parse_args
from shared.contract.node import NodeCordoned
from shared.contract.sessions import SessionLocation, WhereIsSession
from shared.contract.subjects import Subjects
from shared.host.devservers import NatsCluster
from shared.plumbing.bus import Bus
from shared.plumbing.settings import NatsSettings

NAME = "failover"
TARGETS = (
    Target("request_worst_s_stream", "<=", 2.0, "a request in flight is sent again at once, not after its timeout"),
    Target("request_worst_s_meta", "<=", 2.0, "a request in flight is sent again at once, not after its timeout"),
)
"""A publish waits for a new stream leader when the dead server led the stream (NATS' Raft election, seconds): a
figure to know, not a target of gpuwarden's."""


def _port_of(bus: Bus) -> int:
    url = bus.nc.connected_url
    return int(url.port or 0) if url is not None else 0


async def _strike(kind: str, window_s: float) -> dict[str, float]:
    cluster = NatsCluster().start()
    subjects = Subjects("bench" + secrets.token_hex(4))
    settings = NatsSettings(servers=cluster.urls, replicas=3)
    publisher = await Bus.connect(settings, subjects, "bench-publisher")
    responder = await Bus.connect(settings, subjects, "bench-responder")
    try:
        await publisher.ensure_streams()
        subject = subjects.command("checkpoint", "where")

        async def answer(query: WhereIsSession) -> SessionLocation:
            return SessionLocation(session_id=query.session_id, sequence=0, held=False, reason="unknown")

        await responder.serve(subject, answer, (WhereIsSession,))
        for _ in range(20):  # warm
            await publisher.publish(NodeCordoned(node="node-1", by="bench"))
            await publisher.request(subject, WhereIsSession(session_id="s1"), 10)
        info = await publisher.js.stream_info(subjects.events_stream.name)
        stream_leader = str(info.cluster.leader if info.cluster else "")
        victim = stream_leader if kind == "stream" else cluster.wait_for_meta_leader()
        dead_port = cluster.by_name(victim).port
        orphans = [b for b in (publisher, responder) if _port_of(b) == dead_port]
        killed = time.monotonic()
        cluster.kill(victim)
        worst_publish = worst_request = 0.0
        count = 0
        while time.monotonic() - killed < window_s:
            started = time.monotonic()
            await publisher.publish(NodeCordoned(node="node-1", by="bench"))
            worst_publish = max(worst_publish, time.monotonic() - started)
            started = time.monotonic()
            await publisher.request(subject, WhereIsSession(session_id="s1"), 30)
            worst_request = max(worst_request, time.monotonic() - started)
            count += 1
        return {
            f"publish_worst_s_{kind}": round(worst_publish, 3),
            f"request_worst_s_{kind}": round(worst_request, 3),
            f"rounds_after_kill_{kind}": count,
            f"clients_of_dead_server_{kind}": len(orphans),
            f"dead_server_led_the_stream_{kind}": victim == stream_leader,
        }
    finally:
        await publisher.close(1)
        await responder.close(1)
        cluster.cleanup()


async def measure(window_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in ("stream", "meta"):
        results.update(await _strike(kind, window_s))
    return results


def run(options: BenchOptions) -> dict[str, Any]:
    window_s = 10.0 if options.quick else 20.0
    results = asyncio.run(measure(window_s))
    return finish(options, results, TARGETS, {"window_s": window_s, "servers": 3, "replicas": 3}, machine_info())


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(NAME, "What a NATS failover costs a client: worst publish and request across a SIGKILL.", argv)
    return exit_code(options, run(options))


if __name__ == "__main__":
    sys.exit(main())
