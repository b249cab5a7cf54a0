"""Length generalization: tidy output, summary arithmetic, plot files, resume, CLI."""

import os

import pandas as pd
import pytest
from schema import assert_folder_documented

from nopelens.analyses import lengthgen
from nopelens.analyses.cli import main
from nopelens.analyses.lengthgen import KAZEMNEJAD_2023, LengthGenSettings, run_lengthgen, summarize

TINY = LengthGenSettings(
    train_max_len=3, n_layers=1, d_model=16, n_heads=2, steps=3, batch_size=4, n_symbols=4, n_eval=4
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _record_runs(monkeypatch) -> list:
    """The (task, method, seed) of every run_lengthgen trains from now on, in order."""
    calls, real = [], lengthgen.run_one
    monkeypatch.setattr(lengthgen, "run_one", lambda *args, **kwargs: calls.append(args[:3]) or real(*args, **kwargs))
    return calls


def test_run_writes_tidy_table_summary_and_plots(tmp_path):
    results = run_lengthgen(
        tmp_path, TINY, tasks=("repeat", "copy"), methods=("nope", "learned"), seeds=(0,), progress=False
    )
    assert len(results) == 2 * 2 * 1 * 6  # tasks x methods x seeds x lengths 1..2L
    assert set(results["length"]) == set(range(1, 7))
    assert results.groupby(["task", "method", "seed"])["in_distribution"].sum().eq(3).all()
    on_disk = pd.read_csv(tmp_path / "lengthgen.csv")
    assert len(on_disk) == len(results)
    assert {"task", "method", "seed", "length", "exact_match", "token_accuracy", "in_distribution"} <= set(
        on_disk.columns
    )
    for name in ("summary.csv", "lengthgen.png", "lengthgen.svg", "lengthgen.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "lengthgen.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert set(zip(summary["task"], summary["method"])) == {
        (t, m) for t in ("repeat", "copy") for m in ("nope", "learned")
    }
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp files left
    assert assert_folder_documented(tmp_path, "lengthgen") == ["lengthgen.csv", "summary.csv"]
    mask = os.umask(0)
    os.umask(mask)
    for name in ("lengthgen.csv", "lengthgen.png"):  # what a plain open() gives, not mkstemp's 0o600
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask


def test_rerun_resumes_and_skips_finished_runs(tmp_path, monkeypatch):
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope",), seeds=(0,), progress=False)
    calls = _record_runs(monkeypatch)
    results = run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False)
    assert calls == [("repeat", "alibi", 0)]
    assert sorted(set(results["method"])) == ["alibi", "nope"]


def test_a_truncated_table_measures_the_cut_runs_again(tmp_path, monkeypatch, capsys):
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False)
    whole = (tmp_path / "lengthgen.csv").read_text().splitlines()
    (tmp_path / "lengthgen.csv").write_text("\n".join(whole[:9]) + "\n")  # nope's 6 rows and 2 of alibi's
    calls = _record_runs(monkeypatch)
    results = run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False)
    assert calls == [("repeat", "alibi", 0)] and len(results) == 12
    assert (
        "holds only part of repeat alibi seed 0 (a truncated or damaged file?); measuring it again"
        in capsys.readouterr().err
    )
    (tmp_path / "lengthgen.csv").write_bytes(b"\xff\xfe garbage")
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope",), seeds=(0,), progress=False)
    assert "cannot be read" in capsys.readouterr().err


DAMAGED_CELLS = [("exact_match", 2, None), ("seed", 1, "abc")] + [
    pytest.param(*cell, marks=pytest.mark.slow)
    for cell in [
        ("seed", 5, None),
        ("length", 3, "x"),
        ("exact_match", 2, "abc"),
        ("exact_match", 2, 7),
        ("exact_match", 4, "inf"),
        ("in_distribution", 2, "yes"),
        ("in_distribution", 1, False),
        ("seed", 2, 0.5),
        ("length", 6, -6),
        ("method", 3, "bogus"),
    ]
]  # the fast lane keeps a missing cell and a text cell; each costs a lengthgen run


@pytest.mark.parametrize("column, length, cell", DAMAGED_CELLS)
def test_a_damaged_cell_measures_only_its_run_again(tmp_path, monkeypatch, capsys, column, length, cell):
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False)
    table = pd.read_csv(tmp_path / "lengthgen.csv").astype({column: object})
    table.loc[(table["method"] == "alibi") & (table["length"] == length), column] = cell
    table.to_csv(tmp_path / "lengthgen.csv", index=False)
    calls = _record_runs(monkeypatch)
    results = run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False)
    assert calls == [("repeat", "alibi", 0)] and len(results) == 12
    assert results["seed"].dtype.kind == "i" and results["exact_match"].between(0, 1).all()
    assert (results["in_distribution"] == (results["length"] <= TINY.train_max_len)).all()
    err = capsys.readouterr().err
    assert "holds only part of repeat alibi seed 0" in err
    assert "exact_match_longer_std is empty in summary.csv for 2 task and method pair(s) with one seed" in err


def test_other_settings_in_the_same_folder_are_refused(tmp_path):
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope",), seeds=(0,), progress=False)
    with pytest.raises(ValueError, match="other settings.*steps"):
        run_lengthgen(
            tmp_path,
            LengthGenSettings(**{**TINY.__dict__, "steps": 4}),
            tasks=("repeat",),
            methods=("nope",),
            seeds=(0,),
        )


def test_unknown_method_and_bad_settings():
    with pytest.raises(ValueError, match="unknown method"):
        run_lengthgen("/nonexistent", TINY, methods=("no-such-method",))
    with pytest.raises(ValueError, match="steps"):
        LengthGenSettings(steps=0)


def test_summary_arithmetic():
    rows = []
    for seed, (inside, longer) in enumerate([(1.0, 0.5), (0.8, 0.1)]):
        for length in (1, 2):
            rows.append(
                dict(task="copy", method="nope", seed=seed, length=length, exact_match=inside, in_distribution=True)
            )
        for length in (3, 4):
            rows.append(
                dict(task="copy", method="nope", seed=seed, length=length, exact_match=longer, in_distribution=False)
            )
    summary = summarize(pd.DataFrame(rows))
    row = summary.iloc[0]
    assert row["exact_match_in_distribution"] == pytest.approx(0.9)
    assert row["exact_match_longer"] == pytest.approx(0.3)
    assert row["exact_match_longer_std"] == pytest.approx(pd.Series([0.5, 0.1]).std())
    assert row["seeds"] == 2 and row["kazemnejad_2023_repeat_copy"] == KAZEMNEJAD_2023["nope"] == 0.986


def test_cli_quick_subset(tmp_path, capsys):
    code = main(
        [
            "lengthgen",
            "--out",
            str(tmp_path),
            "--quick",
            "--tasks",
            "repeat",
            "--methods",
            "rope",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--threads",
            "1",
            "--quiet",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "rope" in out and "kazemnejad_2023_repeat_copy" in out
    assert (tmp_path / "lengthgen.svg").exists()
