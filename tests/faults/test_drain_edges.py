"""Drains at their edges: deadlines out of range from the CLI and from any other system, and every node drained while
a model rollout and a driver upgrade run. Nothing waits for ever and nothing deadlocks: the CLI refuses before it
cordons or publishes; a request another system sends gets its failed verdict and leaves the node alone; the upgrade
does not stall behind cordons it did not make. The invariant checker runs after each."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from shared.clients.drains import DrainClient, RecordReader
from shared.clients.rollouts import begin_rollout, deployment_key, read_models
from shared.console import operations
from shared.console.client import CommandError, MeshClient
from shared.contract.configdocs import DriverPolicy
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested, NodeCordoned
from shared.contract.registry import codec
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from tests.faults.fleet import NEW_DRIVER, NODES, SPEC, fleet
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(300)

OUT_OF_RANGE = ("40", "0", "-5")  # beyond the pods' 30 s grace period, zero, negative
EVERY_POD_MAY_GO = msgspec.structs.replace(
    SPEC, deployments=[msgspec.structs.replace(SPEC.deployments[0], max_unavailable=SPEC.deployments[0].replicas)]
)
"""The deployment's PodDisruptionBudget lets every pod go: with a tighter one, draining every node blocks on it (as
``kubectl drain`` does), which is the budget's job, not a deadlock."""


def cli_env(settings: Settings, home: Path) -> dict[str, str]:
    return dict(
        os.environ,
        GPUWARDEN_HOME=str(home),
        GPUWARDEN_NATS_URL=",".join(settings.nats.servers),
        GPUWARDEN_REDIS_URL=settings.redis.url,
        GPUWARDEN_ROOT=settings.root,
    )


async def stored(bus: Bus, subject: str) -> bool:
    """Whether the events stream holds a message on ``subject``."""
    try:
        await bus.js.get_last_msg(bus.subjects.events_stream.name, subject)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def test_the_cli_refuses_a_deadline_out_of_range_before_it_cordons_or_publishes(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: object, tmp_path: Path
) -> None:
    await bus.ensure_streams()
    cluster = await SimCluster.create(settings.redis, subjects, SPEC)
    env = cli_env(settings, tmp_path)
    try:
        runs = {
            (command, deadline): subprocess.Popen(
                [sys.executable, "-m", "shared.cli", command, "node-1", "--deadline", deadline],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for command in ("drain", "checkpoint")
            for deadline in OUT_OF_RANGE
        }
        for (command, deadline), proc in runs.items():
            out, err = await asyncio.to_thread(proc.communicate, timeout=60)
            lines = err.strip().splitlines()
            assert proc.returncode == 2 and out == "", (command, deadline, out, err)
            assert len(lines) == 1 and lines[0].startswith(f"gpuwarden {command}: --deadline {deadline}:"), err
            assert ("grace period" if deadline == "40" else "positive") in lines[0], lines[0]
        node = await cluster.node("node-1")
        assert node is not None and node.schedulable
        requested = subjects.pattern("node.drain.requested", node="node-1")
        cordoned = subjects.for_event(NodeCordoned(node="node-1", by="x"))
        assert not await stored(bus, requested) and not await stored(bus, cordoned)
        # the same command with a deadline in range does publish: the check above can see a request
        ok = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "shared.cli", "checkpoint", "node-1", "--deadline", "5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ok.returncode == 0, ok.stderr
        assert await stored(bus, requested)
    finally:
        await cluster.close()


def forged(node: str, drain_id: str, deadline_s: float) -> bytes:
    """A drain request with a deadline no gpuwarden client sends, as any other system may publish it."""
    raw = msgspec.json.decode(codec.encode(DrainRequested(node=node, drain_id=drain_id)))
    raw["deadline_s"] = deadline_s
    return msgspec.json.encode(raw)


async def test_a_request_out_of_range_from_another_system_gets_its_failed_verdict_and_nobody_waits_it_out(
    settings: Settings, tmp_path: Path
) -> None:
    async with fleet(settings, tmp_path) as f:
        sessions = await f.begin(6)
        subject = f.subjects.for_event(DrainRequested(node="node-1", drain_id="x"))
        drains = {f"other-{i}": float(d) for i, d in enumerate(OUT_OF_RANGE)}
        for drain_id, deadline in drains.items():
            await f.bus.js.publish(subject, forged("node-1", drain_id, deadline))
        await eventually(lambda: set(drains) <= set(f.verdicts), timeout=30)
        await f.one_verdict_each(list(drains))
        for drain_id in drains:
            (verdict,) = f.verdicts[drain_id]
            assert isinstance(verdict, DrainFailed) and verdict.node == "node-1", verdict
            assert "deadline_s" in verdict.reason, verdict.reason
            # what `drain --wait` waits with asks the drain's record: found even when published before it listened
            client = DrainClient(f.mesh.bus.publish, "test", RecordReader(f.mesh.bus))
            async with client.watch(f.mesh.bus, drain_id, "node-1") as watch:
                found = await watch.wait(10)
            assert isinstance(found, DrainFailed) and found.drain_id == drain_id
        node = await f.cluster.node("node-1")
        assert node is not None and node.schedulable  # nobody cordoned it on the request's behalf
        requested = f.subjects.pattern("node.drain.requested", node="node-1")
        last = await f.mesh.last_event(requested)
        assert isinstance(last, DrainRequested) and last.drain_id in drains  # the driver asked for no drain of its own
        await f.talk(sessions)  # the sessions on node-1 are served where they were
        assert f.workload.stats.restored == 0
        f.sessions_intact(sessions)
        # and a deadline in range, from the CLI, is run and waited for
        saved = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "shared.cli", "checkpoint", "node-1", "--deadline", "5", "--wait"],
            env=cli_env(f.settings, tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert saved.returncode == 0, saved.stdout + saved.stderr
        asked, answered = (msgspec.json.decode(line) for line in saved.stdout.splitlines())
        assert answered["kind"] == "node.drain.completed" and answered["drain_id"] == asked["drain_id"]
        await f.check(min_checkpoints=answered["sessions_committed"], drains=[*drains, asked["drain_id"]])


async def test_draining_every_node_during_a_rollout_and_a_driver_upgrade_deadlocks_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    """Every node drained (cordoned, sessions saved, pods evicted), a model rollout and a driver upgrade with
    ``max_unavailable`` 1, all at once: every drain gets its verdict, the rollout switches, and every node ends on
    the new driver although the drains' cordons use up the budget; the nodes stay cordoned (the drains' cordons
    are a person's) until uncordoned, and then the fleet serves again. (The sessions begun on the old model version
    have no pod of that version left to restore into: a rollout's business, tested in tests/test_model_rollout.py.)"""
    async with fleet(settings, tmp_path, EVERY_POD_MAY_GO) as f:
        await f.begin(12)
        store = ConfigStore(f.client, f.subjects)
        policy = DriverPolicy(
            desired_version=NEW_DRIVER,
            auto_upgrade=True,
            max_parallel_upgrades=1,
            max_unavailable="1",
            drain_timeout_s=60,
        )
        drain_ids = [f"all-{node}" for node in NODES]
        results = await asyncio.gather(
            *(
                operations.drain(
                    f.mesh,
                    node,
                    wait=False,
                    timeout=120,
                    deadline_s=20,
                    reason="maintenance",
                    requested_by="test",
                    drain_id=drain_id,
                )
                for node, drain_id in zip(NODES, drain_ids, strict=True)
            ),
            begin_rollout(store, "llm", "llama", "2", from_version="1", prepare_timeout_s=20, min_ready=0.5, by="t"),
            store.write("driver", policy, 0, "test"),
        )
        for result in results[: len(NODES)]:
            assert isinstance(result, operations.DrainResult)
            assert result.ok and result.verdict == "completed", result.reason

        async def switched() -> bool:
            _, doc = await read_models(store)
            entry = doc.deployments.get(deployment_key("llm", "llama"))
            return entry is not None and entry.serving_version == "2"

        await eventually(switched, timeout=60)
        await eventually(lambda: f.upgraded(NEW_DRIVER), timeout=180, interval=0.2)
        nodes = await f.cluster.nodes()
        assert not any(n.schedulable for n in nodes)  # the drains' cordons outlive the upgrade
        assert all(isinstance(f.verdicts[d][0], DrainCompleted) for d in drain_ids)
        await f.one_verdict_each(sorted(f.verdicts))  # the drains and the upgrade's own

        for node in NODES:
            assert await operations.uncordon(f.mesh, node)
        await eventually(lambda: len(f.workload.runtimes) == 3, timeout=60)
        fresh = [f"after-{i}" for i in range(6)]
        await f.talk(fresh)  # the fleet serves again, on the new model version
        assert {r.agent.layout.model_version for r in f.workload.runtimes.values()} == {"2"}
        f.sessions_intact(fresh)
        await f.check(min_checkpoints=12, drains=drain_ids)


async def test_uncordon_while_the_upgrade_holds_the_node_needs_force(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: object
) -> None:
    """``uncordon`` is refused while the upgrade holds a node's cordon, allowed where it holds none (waiting in
    ``upgrade-required``, or done), and ``--force`` overrides; a cordon by a person during an upgrade is marked so
    that the upgrade leaves it."""
    from shared.contract.annotations import UPGRADE_STATE_LABEL, UPGRADE_WAS_CORDONED_ANNOTATION

    await bus.ensure_streams()
    cluster = await SimCluster.create(settings.redis, subjects, SPEC)
    mesh = await MeshClient.open(settings, {})
    try:
        await cluster.update_node("node-1", labels={UPGRADE_STATE_LABEL: "checkpoint-required"}, schedulable=False)
        with pytest.raises(CommandError, match="--force"):
            await operations.uncordon(mesh, "node-1")
        assert await operations.uncordon(mesh, "node-1", force=True)
        node = await cluster.node("node-1")
        assert node is not None and node.schedulable
        await operations.cordon(mesh, "node-1", "by-hand-1")  # a person's cordon, mid-upgrade
        node = await cluster.node("node-1")
        assert node is not None and node.annotations.get(UPGRADE_WAS_CORDONED_ANNOTATION) == "true"

        await cluster.update_node("node-2", labels={UPGRADE_STATE_LABEL: "upgrade-required"}, schedulable=False)
        assert await operations.uncordon(mesh, "node-2")  # waiting for a slot holds no cordon
        assert not await operations.uncordon(mesh, "node-2")  # schedulable already
    finally:
        await mesh.close()
        await cluster.close()
