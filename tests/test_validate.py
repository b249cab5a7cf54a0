"""Issue 10 §5: the known-answer suite. The suite runs once (module fixture); every row asserts its value."""

from __future__ import annotations

import pandas as pd
import pytest
from schema import assert_documented

from nopelens.analyses import validate
from nopelens.analyses.cli import main


@pytest.fixture(scope="module")
def suite() -> pd.DataFrame:
    return validate.run_suite()


def test_the_suite_produces_every_row_once(suite):
    assert list(suite["name"]) == list(validate.ROW_NAMES)


@pytest.mark.parametrize("name", validate.ROW_NAMES)
def test_known_answer(suite, name):
    row = suite.set_index("name").loc[name]
    assert row["passed"], (
        f"{name}: expected {row['comparison']} {row['expected']:.6g} ± {row['tolerance']:.3g}, "
        f"measured {row['measured']:.6g}"
    )


@pytest.mark.parametrize(
    "comparison, measured, passed",
    [
        ("==", 1.05, True),
        ("==", 1.2, False),
        ("<=", 1.1, True),
        ("<=", 1.2, False),
        (">=", 0.9, True),
        (">=", 0.8, False),
        ("==", float("nan"), False),
    ],
)
def test_row_verdicts(comparison, measured, passed):
    row = validate.Row("x", "m", "q", 1.0, measured, comparison, 0.1, "d")
    assert row.passed is passed


def test_validate_command_prints_rows_writes_the_report_and_exits_1_on_a_failed_row(
    suite, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(validate, "run_suite", lambda seed: suite)
    out = tmp_path / "docs" / "known_answers.md"
    code = main(["validate", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == (0 if suite["passed"].all() else 1)
    assert all(name in printed for name in validate.ROW_NAMES)
    text = out.read_text()
    assert "| row" in text and all(name in text for name in validate.ROW_NAMES)
    assert not list(out.parent.glob(".*")), "atomic write leaves no temporary file"
    assert_documented(out.with_suffix(".csv"), "validate: known_answers.csv")

    failing = suite.assign(passed=[True] * (len(suite) - 1) + [False])
    monkeypatch.setattr(validate, "run_suite", lambda seed: failing)
    assert main(["validate", "--out", "-"]) == 1
    passing = suite.assign(passed=True)
    monkeypatch.setattr(validate, "run_suite", lambda seed: passing)
    assert main(["validate", "--out", "-"]) == 0
    assert "FAIL" not in capsys.readouterr().out.split("rows pass")[-1]


def test_validate_writes_into_a_run_folder_by_default(suite, tmp_path, monkeypatch, capsys):
    """Not docs/known_answers.md of whatever folder it runs from: runs/validate/ there."""
    monkeypatch.setattr(validate, "run_suite", lambda seed: suite)
    monkeypatch.chdir(tmp_path)
    main(["validate"])
    assert sorted(p.name for p in (tmp_path / "runs" / "validate").iterdir()) == [
        "known_answers.csv",
        "known_answers.md",
    ]
    assert not (tmp_path / "docs").exists()
    assert "runs/validate/known_answers.md" in capsys.readouterr().out
    main(["validate", "--out", "elsewhere"])
    assert (tmp_path / "elsewhere" / "known_answers.md").is_file()


def test_validate_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--help"])
    assert exit_info.value.code == 0
    assert "nopelens validate --out" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(8))
def test_the_bos_and_constant_content_answers_hold_at_every_seed(seed, one_thread):
    """Layer 0 of an untrained NoPE model on BOS + one repeated token has two distinct rows, so no
    class varies within itself: LDA must not read round-off as a covariance (seed 3 gave accuracy 0)."""
    rows = validate.check_bos_constant(seed)
    assert all(row.passed for row in rows), [(row.name, row.measured, row.expected) for row in rows]
