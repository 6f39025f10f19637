"""docs/configuration.md's variable table is what the code reads and documents: nothing undocumented, nothing
stale, and the committed table is the generated one."""

from __future__ import annotations

from tools import envdoc


def test_every_variable_the_code_reads_is_documented_and_the_table_is_current() -> None:
    variables, problems = envdoc.collect()
    assert problems == []
    names = {v.name for v in variables}
    assert {"GPUWARDEN_NATS_URL", "GPUWARDEN_HOME", "GPUWARDEN_METRICS_SOURCE", "GPUWARDEN_MIG_RETRY_S"} <= names
    assert envdoc.main(["--check"]) == 0


def test_a_stale_table_is_found(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stale = tmp_path / "configuration.md"
    stale.write_text(f"# Configuration\n\n{envdoc.BEGIN}\n| old |\n{envdoc.END}\n")
    monkeypatch.setattr(envdoc, "TARGET", stale)
    assert envdoc.main(["--check"]) == 1
    assert envdoc.main([]) == 0 and envdoc.main(["--check"]) == 0
    assert "`GPUWARDEN_REDIS_URL`" in stale.read_text()
