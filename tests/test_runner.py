"""The service runner: the five services start on it, answer their probes over HTTP, report Redis loss as
degraded health while they keep working, and shut down in order."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from services.device.service import DeviceService
from services.driver.service import DriverService
from services.metrics.service import MetricsService
from services.scaler.config import ScalerSettings
from services.scaler.service import ScalerService
from shared.console import events
from shared.contract.config import ConfigApplied
from shared.contract.configdocs import CheckpointPolicy, DriverPolicy
from shared.contract.node import DrainCompleted, DrainRequested
from shared.contract.subjects import Subjects
from shared.host.runner import ServiceContext, start_service
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, redis_client
from shared.plumbing.settings import HostPort, Settings, load_settings
from shared.wiring import Wiring
from tests.helpers import eventually, fetch, get, with_redis
from tests.servers import RedisServer, free_port


async def health_status(port: int) -> str:
    return str(json.loads((await fetch(port, "/healthz"))[1])["status"])


async def test_all_five_services_start_report_health_and_follow_their_events(
    settings: Settings, bus: Bus, tmp_path: Path
) -> None:
    checkpoints = CheckpointService(CheckpointSettings(store=f"file://{tmp_path}"))
    services = [
        DriverService(),
        DeviceService(),
        MetricsService(),
        ScalerService(ScalerSettings(listen=HostPort("127.0.0.1", 0))),
        checkpoints,
    ]
    running = [await start_service(s, settings, Wiring) for s in services]
    try:
        for r in running:
            status, body = await fetch(r.http_port, "/readyz")
            assert status == 200, body
            health = json.loads((await fetch(r.http_port, "/healthz"))[1])
            assert health["status"] == "ok" and health["simulated"] is True
        driver, device, metrics, scaler, checkpoint = running
        await bus.publish(DrainRequested(node="node-1", drain_id="d1"))
        await bus.publish(DrainCompleted(node="node-1", drain_id="d1"))
        await eventually(lambda: checkpoint.ctx.status["drains"] == {"d1": "completed"})  # no sessions there
        await eventually(lambda: driver.ctx.status["drain_verdicts"].get("d1") == "completed")
        await eventually(lambda: "node-1" in metrics.ctx.status["gpus"])  # the device's inventory reached it
        await eventually(lambda: scaler.ctx.status["drains_in_flight"] == {})
        status, text = await fetch(checkpoint.http_port, "/metrics")
        assert status == 200
        assert b'gpuwarden_messages_total{consumer="checkpoint-drains",outcome="ack"} 1.0' in text
        assert b'gpuwarden_connection_up{dependency="nats"} 1.0' in text
        assert (await fetch(checkpoint.http_port, "/nope"))[0] == 404
        assert isinstance(device.ctx.status.get("node_cordoned"), bool)
    finally:
        for r in running:
            await r.stop(grace=1)


async def test_config_change_reaches_service_and_is_announced(settings: Settings, bus: Bus) -> None:
    running = await start_service(DriverService(), settings, Wiring)
    client = redis_client(settings.redis)
    try:
        await ConfigStore(client, bus.subjects).write("driver", DriverPolicy(desired_version="560.35.03"), 0, "t")
        await eventually(lambda: (c := running.ctx.config.current("driver")) and c.version == 1)
        health = json.loads((await fetch(running.http_port, "/healthz"))[1])
        assert health["config_versions"] == {"driver": 1}
        _, text = await fetch(running.http_port, "/metrics")
        assert b'gpuwarden_config_version{name="driver"} 1.0' in text
    finally:
        await client.aclose()
        await running.stop(grace=1)


async def test_redis_down_is_degraded_health_not_a_crash(settings: Settings, own_redis: RedisServer) -> None:
    settings = with_redis(settings, own_redis.url)
    client = redis_client(settings.redis)
    await ConfigStore(client, Subjects(settings.root)).write(
        "driver", DriverPolicy(desired_version="550.54.15"), 0, "t"
    )
    await client.aclose()
    running = await start_service(DriverService(), settings, Wiring)
    try:
        assert await eventually(lambda: health_status(running.http_port)) == "ok"
        own_redis.stop()
        await eventually(lambda: _is(health_status(running.http_port), "degraded"))
        health = json.loads((await fetch(running.http_port, "/healthz"))[1])
        assert health["components"]["redis"]["ok"] is False
        assert health["config_versions"] == {"driver": 1}  # still running on the last good document
        assert (await fetch(running.http_port, "/readyz"))[0] == 200
        await asyncio.get_running_loop().run_in_executor(None, own_redis.start)
        await eventually(lambda: _is(health_status(running.http_port), "ok"))
    finally:
        await running.stop(grace=1)


async def _is(value: object, expected: str) -> bool:
    return await value == expected  # type: ignore[misc]


def test_service_process_starts_answers_and_stops_on_sigterm(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    env = dict(
        os.environ,
        GPUWARDEN_NATS_URL=settings.nats.servers[0],
        GPUWARDEN_REDIS_URL=settings.redis.url,
        GPUWARDEN_ROOT=settings.root,
        GPUWARDEN_NODE="node-9",
        GPUWARDEN_HTTP_ADDR=f"127.0.0.1:{port}",
        GPUWARDEN_CHECKPOINT_STORE=f"file://{tmp_path}",
    )
    proc = subprocess.Popen([sys.executable, "-m", "services.checkpoint"], env=env, stderr=subprocess.PIPE)
    try:
        deadline = 30.0
        start = time.monotonic()
        while time.monotonic() - start < deadline:
            try:
                if get(port, "/readyz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("service never became ready")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        lines = [json.loads(line) for line in proc.stderr.read().decode().splitlines() if line.startswith("{")]  # type: ignore[union-attr]
        messages = [entry["msg"] for entry in lines]
        assert "started" in messages and "stopped" in messages
        assert all(entry["service"] == "checkpoint" for entry in lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_settings_exit_with_a_clear_message(settings: Settings) -> None:
    env = dict(os.environ, GPUWARDEN_BACKEND="quantum", GPUWARDEN_NATS_URL=settings.nats.servers[0])
    result = subprocess.run(
        [sys.executable, "-m", "services.scaler"], env=env, capture_output=True, timeout=30, text=True
    )
    assert result.returncode == 2
    assert "GPUWARDEN_BACKEND='quantum': expected 'sim' or 'real'" in result.stderr


@pytest.mark.parametrize(
    ("service", "variable"),
    [
        ("driver", "GPUWARDEN_DRIVER_RECONCILE_S"),
        ("device", "GPUWARDEN_DEVICE_INVENTORY_S"),
        ("metrics", "GPUWARDEN_METRICS_INTERVAL_S"),
        ("scaler", "GPUWARDEN_SCALER_REFRESH_S"),
        ("checkpoint", "GPUWARDEN_CHECKPOINT_GC_S"),
    ],
)
def test_every_service_says_which_of_its_own_settings_is_bad_in_one_line(
    settings: Settings, service: str, variable: str
) -> None:
    env = dict(os.environ, **{variable: "soon"}, GPUWARDEN_NATS_URL=settings.nats.servers[0])
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}"], env=env, capture_output=True, timeout=30, text=True
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{service}: {variable}='soon'"), result.stderr


def test_settings_defaults_and_errors() -> None:
    s = load_settings({})
    assert s.nats.servers == ("nats://127.0.0.1:4222",)
    assert s.redis.url == "redis://127.0.0.1:6379/0"
    assert s.root == "gw" and s.backend == "sim"
    with pytest.raises(Exception, match="GPUWARDEN_HTTP_ADDR"):
        load_settings({"GPUWARDEN_HTTP_ADDR": "nope"})
    with pytest.raises(Exception, match="GPUWARDEN_NATS_TLS_CERT is set but GPUWARDEN_NATS_TLS_KEY is not"):
        load_settings({"GPUWARDEN_NATS_TLS_CERT": __file__})
    assert replace(s, root="x").root == "x"


class _Pages:
    """A service with read-only HTTP routes of its own, beside the probes."""

    name = "pages"
    config_names: tuple[str, ...] = ()

    async def start(self, ctx: ServiceContext) -> None:
        async def page(method: str, path: str) -> tuple[str, str, bytes]:
            if path.endswith("/boom"):
                raise RuntimeError("page broke")
            return "200 OK", "text/plain", f"{method} {path}".encode()

        ctx.add_route("/pages/", page)
        with pytest.raises(ValueError, match="shadow the probes"):
            ctx.add_route("/healthz", page)


async def test_a_service_adds_routes_to_the_one_http_endpoint(settings: Settings) -> None:
    running = await start_service(_Pages(), settings, Wiring)
    try:
        assert await fetch(running.http_port, "/pages/a?x=1") == (200, b"GET /pages/a")
        status, body = await fetch(running.http_port, "/pages/boom")
        assert status == 500 and b"RuntimeError: page broke" in body
        assert (await fetch(running.http_port, "/healthz"))[0] == 200  # the probes are still the runner's
        status, body = await fetch(running.http_port, "/elsewhere")
        assert status == 404 and b"/pages/..." in body
    finally:
        await running.stop(grace=1)


class _Port:
    """A port that counts its closes and refuses use once closed (what a restarted loop must never meet)."""

    def __init__(self, name: str, closed: list[str]) -> None:
        self.name = name
        self.closed = closed
        self.uses = 0

    def use(self) -> None:
        if self.name in self.closed:
            raise RuntimeError(f"{self.name} used after it was closed")
        self.uses += 1

    async def close(self) -> None:
        self.closed.append(self.name)


class _Crashy:
    """Opens two ports at start, hands them to ``on_stop``; its loop uses one and crashes on its first run."""

    name = "crashy"
    config_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.order: list[str] = []
        self.runs = 0
        self.first = _Port("first", self.closed)
        self.second = _Port("second", self.closed)

    async def start(self, ctx: ServiceContext) -> None:
        ctx.on_stop(self.first.close)
        ctx.on_stop(lambda: self.order.append("sync hook"))
        ctx.on_stop(self._fails)
        ctx.on_stop(self.second.close)
        ctx.spawn(self.loop, "crashy-loop")

    async def _fails(self) -> None:
        self.order.append("failing hook")
        raise OSError("cannot close")

    async def loop(self) -> None:
        self.runs += 1
        self.second.use()
        if self.runs == 1:
            raise ValueError("one bad iteration")
        while True:
            self.second.use()
            await asyncio.sleep(0.01)


async def test_stop_hooks_run_once_newest_first_and_a_restarted_loop_keeps_its_open_port(settings: Settings) -> None:
    service = _Crashy()
    running = await start_service(service, settings)
    await eventually(lambda: service.runs >= 2 and service.second.uses >= 3, timeout=10)
    assert service.closed == []  # the crash closed nothing: the restarted run uses the same, open port
    await running.stop(grace=1)
    assert service.closed == ["second", "first"]  # newest first, each once; the failing hook did not stop the rest
    assert service.order == ["failing hook", "sync hook"]
    await running.ctx.run_stop_hooks()  # nothing left to run
    assert service.closed == ["second", "first"]


class _NeedsPorts:
    name = "needs-ports"
    config_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.closed: list[str] = []

    async def start(self, ctx: ServiceContext) -> None:
        ctx.on_stop(_Port("opened-before", self.closed).close)
        ctx.backends.gpus()


async def test_a_service_without_backends_fails_to_start_clearly_and_closes_what_it_opened(
    settings: Settings,
) -> None:
    service = _NeedsPorts()
    with pytest.raises(RuntimeError, match=r"needs-ports: started without backends; start it with run\(service"):
        await start_service(service, settings)
    assert service.closed == ["opened-before"]


async def test_the_wiring_hands_simulated_ports_for_backend_sim(settings: Settings, subjects: Subjects) -> None:
    wiring = Wiring(settings, subjects)
    gpus = wiring.gpus()
    owners = wiring.pod_owners()
    try:
        assert wiring.simulated and gpus.simulated
        assert owners is not None
    finally:
        await gpus.close()
        if owners is not None:
            await owners.close()
    real = Wiring(replace(settings, backend="real"), subjects)
    assert not real.simulated and real.pod_owners() is None and await real.exporter_url() is None
    assert real.gpus().simulated is False


async def test_an_events_source_names_a_node_only_for_a_node_scoped_service(
    settings: Settings, bus: Bus, tmp_path: Path
) -> None:
    """Both run on node-1: the driver (node-scoped) speaks as ``driver/node-1``; the checkpoint service, which
    answers for the whole cluster, as ``checkpoint`` alone (the events table's source column read
    ``checkpoint/node-1`` for verdicts about node-2, issue #35)."""
    checkpoint = CheckpointService(CheckpointSettings(store=f"file://{tmp_path}"))
    running = [
        await start_service(DriverService(), settings, Wiring),
        await start_service(checkpoint, settings, Wiring),
    ]
    client = redis_client(settings.redis)
    try:
        store = ConfigStore(client, bus.subjects)
        await store.write("driver", DriverPolicy(desired_version="560.35.03"), 0, "t")
        await store.write("checkpoint", CheckpointPolicy(periodic_interval_s=30.0), 0, "t")
        mesh = SimpleNamespace(bus=bus, subjects=bus.subjects)  # what the events table reads of a command's mesh

        async def announced() -> list[ConfigApplied] | None:
            stored = await events.stored(mesh, ["config.applied"], 20)  # type: ignore[arg-type]
            found = [e for e in stored if isinstance(e, ConfigApplied) and e.name in ("driver", "checkpoint")]
            return found if {e.service for e in found} == {"driver", "checkpoint"} else None

        found = await eventually(announced, interval=0.2)
        assert {e.service: e.source for e in found} == {"driver": "driver/node-1", "checkpoint": "checkpoint"}
        shown = [events.line(events.row(e), 200) for e in found]
        assert any("  checkpoint  " in text for text in shown) and not any("checkpoint/node-1" in t for t in shown)
    finally:
        await client.aclose()
        for r in running:
            await r.stop(grace=1)
