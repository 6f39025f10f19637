"""The KV agent as a library an inference server installs alone: the ``gpuwarden-kv-agent`` distribution
(``agent/pyproject.toml``, docs/agent.md).

Its wheel is built once (without build isolation where this environment has the setuptools it needs, so nothing is
fetched for it), then:

- it holds every module its own modules import, and of ``shared.plumbing`` only those (a failure names the link to
  add or remove under ``agent/shared/``); nothing of the services, the simulation, the CLI or the adapters;
- it depends on exactly the third-party distributions its modules import (the engine adapters' torch,
  transformers and vLLM excepted: the inference server brings its own engine);
- installed into a fresh virtualenv with its dependencies and nothing else, the public surface imports, a
  ``KvAgent`` saves a session to a ``FileStore`` and another restores it byte for byte, and neither the services
  nor gRPC, Kubernetes, Redis or torch can be imported there. The dependencies come from this environment (linked
  into the virtualenv, so the check runs offline), and, in the ``long`` variant (``make faults`` or ``-m long``),
  from the package index, as a user's ``pip install`` gets them.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path

import msgspec
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from shared.contract.checkpoint import SaveSessions, SaveSessionsReport
from shared.contract.subjects import Subjects
from shared.kv import LLAMA_3_8B, AgentEndpoint, FileStore, KvAgent
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "agent"
NAME = "gpuwarden-kv-agent"

ENGINES = {"torch", "transformers", "vllm"}
"""Imported by the engine adapters only, and only when used: the server's own engine, never a dependency."""

NOT_SHIPPED = ("services", "tools", "shared.sim", "shared.console", "shared.cli", "shared.adapters", "shared.wiring")

ABSENT = (
    "services",
    "shared.sim",
    "shared.console",
    "shared.cli",
    "shared.adapters",
    "shared.wiring",
    "grpc",
    "kubernetes",
    "redis",
    "pynvml",
    "prometheus_api_client",
    "rich",
    "yaml",
    "torch",
)
"""What an inference server that installed the agent alone cannot import."""

ROUND_TRIP = r"""
import asyncio, importlib.metadata, importlib.util, sys, tempfile

import msgspec
import numpy as np

import shared.kv as kv

absent = sys.argv[1].split(",")
assert "site-packages" in kv.__file__, kv.__file__
assert importlib.metadata.version("gpuwarden-kv-agent") == sys.argv[2]
try:
    importlib.metadata.distribution("gpuwarden")
except importlib.metadata.PackageNotFoundError:
    pass
else:
    raise AssertionError("gpuwarden itself is installed")

lazy = {"TransformersEngine", "NatsObjectStore"}
missing = [name for name in kv.__all__ if name not in lazy and not hasattr(kv, name)]
assert not missing, f"not importable from shared.kv: {missing}"
assert kv.NatsObjectStore.__module__.startswith("shared.kv.objstore")
try:
    getattr(kv, "TransformersEngine")
except ModuleNotFoundError as exc:
    assert exc.name == "torch", exc
else:
    raise AssertionError("TransformersEngine imported without torch")

LAYOUT = msgspec.structs.replace(kv.LLAMA_3_8B, layers=2)


async def main(directory):
    store = kv.FileStore(directory)
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in range(3)]
    server = kv.KvAgent(store, pod="llama-0", node="node-1", namespace="llm", deployment="llama", layout=LAYOUT)
    server.register_session("chat-1")
    for block in blocks:
        server.append_block("chat-1", block)
    server.set_tokens("chat-1", 3 * LAYOUT.block_tokens)
    report = await server.save(deadline_s=30, reason="test")
    assert [m.session_id for m in report.committed] == ["chat-1"] and not report.failed, report

    other = kv.KvAgent(store, pod="llama-1", node="node-2", namespace="llm", deployment="llama", layout=LAYOUT)
    into = [np.empty(LAYOUT.block_bytes, dtype=np.uint8) for _ in blocks]
    restored = await other.restore("chat-1", into=into)
    assert restored.manifest.checkpoint_id == report.committed[0].checkpoint_id
    assert restored.manifest.token_count == 3 * LAYOUT.block_tokens
    assert all(np.array_equal(got, sent) for got, sent in zip(into, blocks, strict=True))


with tempfile.TemporaryDirectory() as tmp:
    asyncio.run(main(tmp))

imported = [name for name in absent if name in sys.modules]
assert not imported, f"imported: {imported}"
importable = [name for name in absent if importlib.util.find_spec(name) is not None]
assert not importable, f"importable: {importable}"
print("restored byte for byte")
"""


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=600)
    shown = " ".join(str(c) if len(str(c)) < 200 else "<script>" for c in command)
    assert done.returncode == 0, f"{shown}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _can_build_here() -> bool:
    """Whether this environment holds what ``agent/pyproject.toml`` builds with (else pip fetches it)."""
    for line in tomllib.loads((AGENT / "pyproject.toml").read_text())["build-system"]["requires"]:
        requirement = Requirement(line)
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            return False
        if not requirement.specifier.contains(installed, prereleases=True):
            return False
    return True


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("agent")
    # The links under agent/shared/ followed: the copy holds the sources themselves, and the build writes nothing
    # into the checkout.
    shutil.copytree(AGENT, work / "source", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    isolation = ["--no-build-isolation"] if _can_build_here() else []
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation, "-w", work / "dist", work / "source")
    (built,) = (work / "dist").glob("*.whl")
    return built


def _sources(wheel: Path) -> dict[str, str]:
    """Module name -> source of every Python file in the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name.removesuffix(".py").replace("/", ".").removesuffix(".__init__"): archive.read(name).decode()
            for name in archive.namelist()
            if name.endswith(".py")
        }


def _metadata(wheel: Path) -> tuple[str, list[str]]:
    """The wheel's version and its Requires-Dist lines."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(name).decode())
    return message["Version"], message.get_all("Requires-Dist") or []


def _imported(source: str) -> set[str]:
    """Every dotted name an import statement names (``from a.b import c``: ``a.b`` and ``a.b.c``), at module
    level or inside a function alike."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"a relative import: {ast.unparse(node)}"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of this repository."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _with_parents(modules: Iterable[str]) -> set[str]:
    return {".".join(m.split(".")[:i]) for m in modules for i in range(1, len(m.split(".")) + 1)}


def test_the_wheel_holds_what_its_modules_import_and_nothing_of_the_services(wheel: Path) -> None:
    sources = _sources(wheel)
    shipped = set(sources)
    needed = _with_parents(
        name
        for source in sources.values()
        for name in _imported(source)
        if name.startswith("shared.") and _is_module(name)
    )
    assert not needed - shipped, f"imported but not shipped (add links under agent/shared/): {sorted(needed - shipped)}"
    plumbing = {m for m in shipped if m.startswith("shared.plumbing.")}
    unneeded = plumbing - needed
    assert not unneeded, f"shipped but imported by none (remove their links under agent/shared/): {sorted(unneeded)}"
    assert {"shared.kv", "shared.kv.agent", "shared.kv.endpoint", "shared.kv.engines.vllm"} <= shipped
    wrong = sorted(m for m in shipped if m.startswith(NOT_SHIPPED) or not m.startswith("shared"))
    assert not wrong, f"shipped, but not the agent's: {wrong}"


def test_the_wheel_depends_on_exactly_what_its_modules_import(wheel: Path) -> None:
    """Each third-party package a shipped module imports (the engines' excepted) is a dependency, and each
    dependency is imported by one: found through this environment's own installed distributions."""
    tops = {
        name.split(".")[0]
        for source in _sources(wheel).values()
        for name in _imported(source)
        if not name.startswith("shared")
    }
    third_party = tops - set(sys.stdlib_module_names) - {"__future__"} - ENGINES
    by_package = importlib.metadata.packages_distributions()
    unknown = sorted(t for t in third_party if t not in by_package)
    assert not unknown, f"imported, but from no installed distribution: {unknown}"
    imported = {canonicalize_name(d) for t in third_party for d in by_package[t]}
    _, requires = _metadata(wheel)
    declared = {canonicalize_name(Requirement(r).name) for r in requires}
    assert declared == imported, (
        f"declared only: {sorted(declared - imported)}; imported only: {sorted(imported - declared)}"
    )


def test_the_agent_is_versioned_with_gpuwarden(wheel: Path) -> None:
    gpuwarden = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    agent = tomllib.loads((AGENT / "pyproject.toml").read_text())["project"]
    version, _ = _metadata(wheel)
    assert agent["name"] == NAME and agent["version"] == gpuwarden["version"] == version
    assert agent["requires-python"] == gpuwarden["requires-python"]


def _link_requirements(requires: Iterable[str], into: Path) -> None:
    """Link the files of each required distribution, and of what they require in turn, from this environment into
    ``into``: a virtualenv given ``into`` on its path has those distributions and no other."""
    seen: set[str] = set()
    todo = list(requires)
    while todo:
        requirement = Requirement(todo.pop())
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        key = canonicalize_name(requirement.name)
        if key in seen:
            continue
        seen.add(key)
        distribution = importlib.metadata.distribution(requirement.name)
        assert distribution.files, f"{requirement.name}: installed without a RECORD"
        site = Path(str(distribution.locate_file("")))
        for top in {f.parts[0] for f in distribution.files if f.parts[0] != ".."}:
            if not (into / top).exists():
                (into / top).symlink_to(site / top)
        todo.extend(distribution.requires or [])


@pytest.fixture(
    scope="module",
    params=["from this environment", pytest.param("from the package index", marks=pytest.mark.long)],
)
def installed(request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding the agent and its dependencies, and nothing else: its directory."""
    work = tmp_path_factory.mktemp("installed")
    venv = work / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python, "install", "--quiet")
    if request.param == "from this environment":
        _run(*pip, "--no-deps", "--no-index", wheel)
        linked = work / "dependencies"
        linked.mkdir()
        _link_requirements(_metadata(wheel)[1], linked)
        site = _run(python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
        (Path(site) / "agent-dependencies.pth").write_text(f"{linked}\n")
    else:
        _run(*pip, wheel)
    return venv


def test_installed_alone_the_agent_saves_and_restores_without_the_services(
    installed: Path, wheel: Path, tmp_path: Path
) -> None:
    version, _ = _metadata(wheel)
    out = _run(installed / "bin" / "python", "-I", "-c", ROUND_TRIP, ",".join(ABSENT), version, cwd=tmp_path)
    assert out.splitlines()[-1] == "restored byte for byte"


async def test_installed_alone_the_prestop_hook_has_the_agent_save(
    installed: Path, bus: Bus, subjects: Subjects, settings: Settings, tmp_path: Path
) -> None:
    """``gpuwarden-kv-prestop`` from the virtualenv, as the pod's preStop hook runs it, asks the agent (here, in
    this process) for its final save, and has it recorded (here, by a stand-in that records everything)."""
    store = FileStore(str(tmp_path / "checkpoints"))
    layout = msgspec.structs.replace(LLAMA_3_8B, layers=2)
    agent = KvAgent(store, pod="llama-0", node="node-1", namespace="llm", deployment="llama", layout=layout)
    agent.register_session("chat-1")
    agent.append_block("chat-1", bytearray(range(256)) * (layout.block_bytes // 256))
    endpoint = AgentEndpoint(agent, bus)
    recorded: list[SaveSessionsReport] = []

    async def record(report: SaveSessionsReport) -> SaveSessionsReport:
        recorded.append(report)
        return report

    await bus.serve(subjects.for_event(SaveSessions(pod="llama-0")), endpoint.on_save, (SaveSessions,))
    await bus.serve(subjects.agent_command("record", "llama-0"), record, (SaveSessionsReport,))
    env = {"GPUWARDEN_NATS_URL": settings.nats.servers[0], "GPUWARDEN_ROOT": subjects.root}
    done = await asyncio.to_thread(
        subprocess.run,
        [str(installed / "bin" / "gpuwarden-kv-prestop"), "--pod", "llama-0", "--deadline", "10"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = msgspec.json.decode(done.stdout, type=SaveSessionsReport)
    assert [c.session_id for c in report.committed] == ["chat-1"] and not report.failed
    assert [r.committed for r in recorded] == [report.committed]
    assert await store.checkpoints("chat-1") == [report.committed[0].checkpoint_id]
