"""The local servers' start: a port another process took between choosing and binding it is named as such, and a
NATS cluster starts again on fresh ports instead of failing (parallel test workers race for free ports)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from shared.host import devservers
from shared.host.devservers import NatsCluster, NatsServer, PortTaken


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_a_taken_port_is_port_taken_with_the_servers_log(taken_port: int) -> None:
    server = NatsServer(monitor_port=taken_port)
    try:
        with pytest.raises(PortTaken, match="address already in use"):
            server.start()
    finally:
        server.cleanup()


def test_a_cluster_starts_again_on_fresh_ports_when_one_was_taken(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen: list[int] = []
    really_free = devservers.free_port

    def first_one_taken() -> int:
        port = really_free() if chosen else taken_port
        chosen.append(port)
        return port

    monkeypatch.setattr(devservers, "free_port", first_one_taken)
    cluster = NatsCluster()
    try:
        cluster.start()
        assert len(cluster.alive()) == 3
        assert taken_port not in {s.cluster_port for s in cluster.servers}
        assert chosen[0] == taken_port
    finally:
        cluster.cleanup()
