"""``python -m tools.fences``: proves that each ownership fence of the checkpoint registry has a test that fails
without it, and one that fails when it is drawn too tight.

The fences live in the registry's Lua scripts (``services/checkpoint/registry_scripts.py``): ``RECORD`` refuses a
save of an older generation (generation), of the holder's generation by another pod (holder), and calls stale (to be
deleted) an older generation's save that sorts after the current generation's seal (seal); ``REPAIR`` keeps the
last two for checkpoints a restore finds in the store. Each mutation below switches one of them off, or widens it,
in a copy of the tracked tree (the checkout is never touched), runs the fence tests there, and expects the named
tests to fail. A mutation no test notices is a fence no test guards: the run exits 1 naming it.

Run by ``make faults`` (35 s on 2 cores, 2026-12-07).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = "services/checkpoint/registry_scripts.py"
OWNERSHIP = "tests/faults/test_ownership.py"

_RECORD_GENERATION = "if gen < current then\n  why"
_RECORD_HOLDER = "elseif gen > 0 and gen == current and holder and holder ~= pod and held == gen then"
_STALE = "if (holder and gen == held and pod ~= holder) or (sealed and gen < current and cid > sealed) then"
_REPAIR = _STALE + "\n    table.insert(fenced, cid)"


@dataclass(frozen=True)
class Mutation:
    """One fence switched off or widened: the first appearance of ``before`` in the scripts (``RECORD`` comes
    before ``REPAIR``) becomes ``after``; every test of ``must_fail`` must fail then."""

    name: str
    before: str
    after: str
    must_fail: tuple[str, ...]

    def apply(self, text: str) -> str:
        if self.before not in text:
            raise LookupError(f"{self.name}: the fence's text is no longer in {SCRIPTS}; update tools/fences.py")
        return text.replace(self.before, self.after, 1)


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "RECORD generation fence off",
        _RECORD_GENERATION,
        "if false then\n  why",
        ("test_generation_fence_an_older_generations_save_is_never_recorded",),
    ),
    Mutation(
        "RECORD generation fence too tight (only the counter's own generation)",
        _RECORD_GENERATION,
        "if gen ~= current then\n  why",
        ("test_generation_fence_lets_the_holder_record_above_a_counter_redis_lost",),
    ),
    Mutation(
        "RECORD holder fence off",
        _RECORD_HOLDER,
        "elseif false then",
        ("test_holder_fence_another_pods_save_of_the_holders_generation_is_refused_and_deleted",),
    ),
    Mutation(
        "RECORD holder fence too tight (the holder itself too)",
        _RECORD_HOLDER,
        "elseif gen > 0 and gen == current and holder and held == gen then",
        ("test_holder_fence_lets_the_holder_record_its_own_generation",),
    ),
    Mutation(
        "RECORD seal fence off",
        _STALE,
        _STALE.replace(" or (sealed and gen < current and cid > sealed)", ""),
        ("test_seal_fence_an_old_holders_save_after_the_seal_is_stale_and_deleted",),
    ),
    Mutation(
        "RECORD seal fence too wide (whatever sorts before the seal too)",
        _STALE,
        _STALE.replace(" and cid > sealed", ""),
        ("test_seal_fence_keeps_a_save_made_before_the_session_moved",),
    ),
    Mutation(
        "REPAIR holder fence off",
        _REPAIR,
        _REPAIR.replace("(holder and gen == held and pod ~= holder) or ", ""),
        ("test_a_restore_passes_over_another_pods_checkpoint_of_the_holders_generation",),
    ),
    Mutation(
        "REPAIR seal fence off",
        _REPAIR,
        _REPAIR.replace(" or (sealed and gen < current and cid > sealed)", ""),
        ("test_a_restore_passes_over_a_save_of_the_old_holder_made_after_the_session_moved",),
    ),
)


def tracked_copy(into: Path) -> None:
    """The checkout's tracked files (as they are now, edits included) copied into ``into``."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for raw in names:
        if not raw:
            continue
        source = ROOT / raw.decode()
        if source.is_file() and not source.is_symlink():
            target = into / raw.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


def failed_tests(tree: Path, tests: Sequence[str]) -> set[str]:
    """The names of the tests among ``tests`` (in the ownership scenarios) that fail in ``tree``."""
    selector = " or ".join(tests)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", OWNERSHIP, "-k", selector],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    failed = {line.split("::", 1)[1].split(" ", 1)[0] for line in run.stdout.splitlines() if line.startswith("FAILED")}
    if run.returncode not in (0, 1):
        raise RuntimeError(
            f"pytest exited {run.returncode} in the mutated tree:\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
        )
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fences", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the mutations whose name contains this text")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or args.only.lower() in m.name.lower()]
    if not chosen:
        print(f"tools.fences: no mutation's name contains {args.only!r}", file=sys.stderr)
        return 2
    original = (ROOT / SCRIPTS).read_text()
    unguarded: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpuwarden-fences-") as tmp:
        tree = Path(tmp)
        tracked_copy(tree)
        baseline = failed_tests(tree, sorted({t for m in chosen for t in m.must_fail}))
        if baseline:
            print(f"tools.fences: the fence tests fail without any mutation: {sorted(baseline)}", file=sys.stderr)
            return 1
        for mutation in chosen:
            (tree / SCRIPTS).write_text(mutation.apply(original))
            failed = failed_tests(tree, mutation.must_fail)
            missed = [t for t in mutation.must_fail if t not in failed]
            failing = ", ".join(sorted(failed)) or "nothing failed"
            print(f"{'MISSED' if missed else 'caught'}: {mutation.name} -> {failing}")
            if missed:
                unguarded.append(mutation.name)
    if unguarded:
        print(f"tools.fences: no test guards {unguarded}", file=sys.stderr)
        return 1
    print(f"tools.fences: every one of {len(chosen)} fence mutations was caught by its test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
