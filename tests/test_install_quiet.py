"""``make install`` prints no warning of its own (issue #35: setuptools warned that ``project.license`` as a TOML
table is deprecated). The project's build configuration is read by setuptools itself, in a copy of the checkout in a
temporary folder (nothing is written into the checkout): its metadata and its wheel are built through the build
backend's hooks, and the wheel once more as ``pip`` builds it quietly (no network: no dependency, no isolated
build environment). Neither may say ``warning`` or ``deprecated``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARNING = re.compile(r"warn|deprecat|!!", re.IGNORECASE)
HOOKS = """
import sys
from setuptools import build_meta as backend

out = sys.argv[1]
backend.prepare_metadata_for_build_wheel(out)
print(backend.build_wheel(out))
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The files a build reads (``pyproject.toml``, the README and the packages it finds), copied."""
    copy = tmp_path / "src"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    for package in ("shared", "services", "tools"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return copy


def build_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # setuptools notes its absence
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def warnings_in(output: str) -> list[str]:
    return [line for line in output.splitlines() if WARNING.search(line)]


@pytest.mark.timeout(120)
def test_the_build_backend_reads_the_project_without_a_warning(checkout: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", HOOKS, str(out)],
        cwd=checkout,
        env=build_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].endswith(".whl"), done.stdout[-500:]
    assert not warnings_in(done.stdout + done.stderr), warnings_in(done.stdout + done.stderr)
    assert (out / "gpuwarden-0.1.0.dist-info" / "METADATA").read_text().count("License-Expression: Apache-2.0") == 1


@pytest.mark.timeout(120)
def test_pip_builds_it_quietly(checkout: Path, tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip, "-w", str(tmp_path), str(checkout)],
        env=build_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout + done.stderr).strip() == "", done.stdout + done.stderr
    assert list(tmp_path.glob("gpuwarden-*.whl"))
