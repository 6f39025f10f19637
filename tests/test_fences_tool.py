"""``python -m tools.fences`` (run whole by ``make faults``) at a tiny size: one fence switched off in a copy of the
tree is caught by its test, and a mutation whose fence text is gone is an error naming it, not a pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tools import fences


def test_one_fence_switched_off_is_caught_by_its_test_and_the_checkout_is_untouched() -> None:
    before = (fences.ROOT / fences.SCRIPTS).read_text()
    run = subprocess.run(
        [sys.executable, "-m", "tools.fences", "--only", "RECORD holder fence off"],
        cwd=fences.ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "caught: RECORD holder fence off -> test_holder_fence_another_pods_save" in run.stdout
    assert (fences.ROOT / fences.SCRIPTS).read_text() == before


def test_a_fence_whose_text_moved_is_an_error_not_a_pass() -> None:
    mutation = fences.Mutation("gone", "no such fence", "x", ("test_x",))
    with pytest.raises(LookupError, match="gone: the fence's text is no longer in"):
        mutation.apply("local x = 1")


def test_an_unknown_mutation_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert fences.main(["--only", "nothing like it"]) == 2
    assert "no mutation's name contains 'nothing like it'" in capsys.readouterr().err


def test_a_mutation_no_test_notices_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 'mutation' that changes nothing stands for a fence no test guards: the run names it and exits 1."""
    same = fences.Mutation(
        "holder fence unchanged",
        fences._RECORD_HOLDER,
        fences._RECORD_HOLDER,
        ("test_holder_fence_another_pods_save_of_the_holders_generation_is_refused_and_deleted",),
    )
    monkeypatch.setattr(fences, "MUTATIONS", (same,))
    assert fences.main([]) == 1
    out = capsys.readouterr()
    assert "MISSED: holder fence unchanged -> nothing failed" in out.out
    assert "no test guards ['holder fence unchanged']" in out.err
