"""`make test` runs the suite in pytest-xdist workers with ``--dist loadgroup``: the tests of one ``xdist_group``
(the vLLM engines' tests, group ``vllm``) run one after another on one worker, sharing their module's engines. The
groups are marked by pytest-xdist adding the group's name to each test's node id; where it cannot (pytest 9.2 keeps
node ids where pytest-xdist 3.8 no longer writes them: the reason pyproject.toml pins pytest below 9.2) they are
silently ignored, and every vLLM test starts engines of its own on any worker, beside the others. This test says so
instead."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("vllm")
def test_make_tests_xdist_groups_are_kept(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run with --dist loadgroup (make test runs it so)")
    assert request.node.nodeid.endswith("@vllm"), (
        f"pytest-xdist did not group this test ({request.node.nodeid}): pytest {pytest.__version__} and this "
        "pytest-xdist do not work together (see pyproject.toml)"
    )
