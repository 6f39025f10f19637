"""``make gpu-check`` (``python -m tools.gpu_check``): skipped where there is no GPU, a full report against
the hand-written fake NVML, and a failing step reported with exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_nvml import EventData, FakeNvml, NVMLError
from tools.gpu_check import SKIPPED, main

ROOT = Path(__file__).resolve().parent.parent


def test_no_nvml_is_skipped_not_failed(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeNvml()
    fake.init_error = FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert main(["--xid-wait", "0"], nvml=fake) == 0
    out = capsys.readouterr().out
    assert out.startswith(SKIPPED)
    assert "NVML Shared Library Not Found" in out


def test_no_gpu_is_skipped_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeNvml()
    fake.gpus = []
    assert main(["--json", "--xid-wait", "0"], nvml=fake) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["status"] == "skipped"
    assert "sees no GPU" in found["reason"]


def test_this_machine() -> None:
    """The real pynvml, as ``make gpu-check`` runs it: skipped here without a GPU, a report where there is one."""
    run = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--json", "--xid-wait", "0.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    found = json.loads(run.stdout)
    if found["status"] == "skipped":
        assert found["reason"].startswith(SKIPPED)
    else:
        assert found["status"] == "ok" and found["devices"] and found["driver_version"]


def test_report_from_the_fake_nvml(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeNvml()
    fake.mig_modes["GPU-aaaa"] = 0
    fake.events.put(EventData(device=fake.gpus[1], eventType=8, eventData=79))
    assert main(["--xid-wait", "0.5"], nvml=fake) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "NVML: driver 550.54.15, CUDA 12.4, 2 GPU(s)"
    assert lines[1] == (
        "GPU 0  GPU-aaaa  NVIDIA H100 80GB HBM3  81920 MiB  bus 00000000:07:00.0  NUMA 0  NVLink peers: GPU-bbbb  "
        "MIG: disabled"
    )
    assert lines[2] == "  utilisation 75%  memory copy 30%  memory 20480/81920 MiB  350.5 W  61 C"
    assert lines[3].startswith("GPU 1  GPU-bbbb") and lines[3].endswith(
        "NUMA 1  NVLink peers: GPU-aaaa  MIG: not capable"
    )
    assert lines[5:] == ["health events in 0.5s:", "  GPU-bbbb: XID 79", "result: ok"]


def test_report_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeNvml()
    assert main(["--json", "--xid-wait", "0.1"], nvml=fake) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["status"] == "ok" and found["failures"] == []
    assert (found["driver_version"], found["cuda_version"]) == ("550.54.15", "12.4")
    assert [d["uuid"] for d in found["devices"]] == ["GPU-aaaa", "GPU-bbbb"]
    assert found["devices"][0]["nvlink_peers"] == ["GPU-bbbb"]
    assert found["devices"][1]["numa_node"] == 1
    assert found["utilisation"][0]["gpu_util"] == 75.0
    assert found["health_events"] == []


class BrokenSampling(FakeNvml):
    """GPUs that list fine but refuse a utilisation sample."""

    def nvmlDeviceGetUtilizationRates(self, h: object) -> object:
        raise NVMLError(999)


def test_a_failing_step_is_reported_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--xid-wait", "0"], nvml=BrokenSampling()) == 1
    out = capsys.readouterr().out
    assert "GPU 0  GPU-aaaa" in out
    assert "FAILED utilisation: NVML nvmlDeviceGetUtilizationRates on GPU GPU-aaaa failed: NVML error 999" in out
    assert out.rstrip().endswith("result: failed (1 step(s) failed)")


def test_negative_wait_is_refused() -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--xid-wait", "-1"], nvml=FakeNvml())
    assert refused.value.code == 2
