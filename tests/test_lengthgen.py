"""Length generalization side by side with Kazemnejad et al. 2023: tidy output, summary and verdict
arithmetic, the budget rule, plot files, resume, CLI."""

import fcntl
import os

import pandas as pd
import pytest
from pandas.testing import assert_frame_equal
from schema import assert_folder_documented
from scipy import stats

from nopelens.analyses import kazemnejad, lengthgen
from nopelens.analyses.cli import main
from nopelens.analyses.lengthgen import LengthGenSettings, run_lengthgen, summarize
from nopelens.analyses.lengthgen_pilot import chosen_budget, levelled_step

TINY = LengthGenSettings(
    train_max_len=3, n_layers=1, d_model=16, n_heads=2, steps=3, batch_size=4, n_symbols=4, n_eval=4, curve_points=2
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _record_runs(monkeypatch) -> list:
    """The (task, method, seed) of every run_lengthgen trains from now on, in order."""
    calls, real = [], lengthgen.run_one
    monkeypatch.setattr(lengthgen, "run_one", lambda *args, **kwargs: calls.append(args[:3]) or real(*args, **kwargs))
    return calls


def test_run_writes_tidy_table_summary_and_plots(tmp_path):
    results = run_lengthgen(
        tmp_path, TINY, tasks=("repeat", "copy"), methods=("nope", "learned"), seeds=(0, 1), progress=False
    )
    assert len(results) == 2 * 2 * 2 * 6  # tasks x methods x seeds x lengths 1..2L
    assert set(results["length"]) == set(range(1, 7))
    assert results.groupby(["task", "method", "seed"])["in_distribution"].sum().eq(3).all()
    on_disk = pd.read_csv(tmp_path / "lengthgen.csv")
    assert len(on_disk) == len(results)
    assert {"task", "method", "seed", "length", "exact_match", "token_accuracy", "in_distribution"} <= set(
        on_disk.columns
    )
    for name in (
        "summary.csv",
        "summary.md",
        "lengthgen.png",
        "lengthgen.svg",
        "curve.png",
        "attention_distance.png",
        "lengthgen.json",
        "models/copy/learned/seed1/model.safetensors",
    ):
        assert (tmp_path / name).stat().st_size > 0
    curve = pd.read_csv(tmp_path / "curve.csv")
    assert sorted(set(curve["step"])) == TINY.curve_steps() == [2, 3]
    final = curve[curve["step"] == 3].set_index(["task", "method", "seed"])["exact_match_longer"]
    longer = results[~results["in_distribution"]].groupby(["task", "method", "seed"])["exact_match"].mean()
    assert final.sort_index().to_numpy() == pytest.approx(
        longer.sort_index().to_numpy()
    )  # the curve ends where the table does
    distances = pd.read_csv(tmp_path / "attention_distance.csv")
    assert set(distances["model_a"]) == {"nope", "learned", "nope (second seed)"}
    assert (distances.loc[distances["model_a"] == distances["model_b"], "jsd_bits"] == 0).all()
    assert (tmp_path / "lengthgen.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert set(zip(summary["task"], summary["method"])) == {
        (t, m) for t in ("repeat", "copy") for m in ("nope", "learned")
    }
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp files left
    assert assert_folder_documented(tmp_path, "lengthgen") == [
        "attention_distance.csv",
        "claims.csv",
        "curve.csv",
        "distance_claims.csv",
        "lengthgen.csv",
        "summary.csv",
    ]
    mask = os.umask(0)
    os.umask(mask)
    for name in ("lengthgen.csv", "lengthgen.png"):  # what a plain open() gives, not mkstemp's 0o600
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask


def test_rerun_resumes_and_skips_finished_runs(tmp_path, monkeypatch):
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope",), seeds=(0,), progress=False, figures=False)
    calls = _record_runs(monkeypatch)
    results = run_lengthgen(
        tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False, figures=False
    )
    assert calls == [("repeat", "alibi", 0)]
    assert sorted(set(results["method"])) == ["alibi", "nope"]


@pytest.mark.slow
def test_worker_processes_give_the_same_numbers(tmp_path):
    """--jobs 2 trains in spawned workers; each model's weights depend on its seed and thread count only."""
    kwargs = dict(tasks=("repeat",), methods=("nope", "alibi"), seeds=(0, 1), progress=False, figures=False)
    alone = run_lengthgen(tmp_path / "one", TINY, **kwargs)
    pooled = run_lengthgen(tmp_path / "two", TINY, jobs=2, **kwargs)
    key = ["task", "method", "seed", "length"]
    columns = [*key, "exact_match", "token_accuracy", "loss", "final_train_loss"]
    assert_frame_equal(
        alone[columns].sort_values(key).reset_index(drop=True), pooled[columns].sort_values(key).reset_index(drop=True)
    )
    with pytest.raises(ValueError, match="--jobs must be >= 1"):
        run_lengthgen(tmp_path / "three", TINY, jobs=0, **kwargs)
    assert not (tmp_path / "three").exists()


def test_a_truncated_table_measures_the_cut_runs_again(tmp_path, monkeypatch, capsys):
    run_lengthgen(
        tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False, figures=False
    )
    whole = (tmp_path / "lengthgen.csv").read_text().splitlines()
    (tmp_path / "lengthgen.csv").write_text("\n".join(whole[:9]) + "\n")  # nope's 6 rows and 2 of alibi's
    calls = _record_runs(monkeypatch)
    results = run_lengthgen(
        tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False, figures=False
    )
    assert calls == [("repeat", "alibi", 0)] and len(results) == 12
    assert (
        "holds only part of repeat alibi seed 0 (a truncated or damaged file?); measuring it again"
        in capsys.readouterr().err
    )
    (tmp_path / "lengthgen.csv").write_bytes(b"\xff\xfe garbage")
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope",), seeds=(0,), progress=False, figures=False)
    assert "cannot be read" in capsys.readouterr().err


def test_a_damaged_curve_or_a_lost_model_is_measured_again(tmp_path, monkeypatch, capsys):
    kwargs = dict(tasks=("repeat",), methods=("nope", "alibi"), seeds=(0, 1), progress=False, figures=False)
    run_lengthgen(tmp_path, TINY, **kwargs)
    curve, distances = (pd.read_csv(tmp_path / f"{name}.csv") for name in ("curve", "attention_distance"))
    assert len(distances) > 0
    damaged = curve.astype({"validation_loss": object})
    damaged.loc[(damaged["method"] == "alibi") & (damaged["seed"] == 1), "validation_loss"] = "nan"
    cut = damaged[(damaged["method"] == "nope") & (damaged["seed"] == 1)].index[-1]
    damaged.drop(index=cut).to_csv(tmp_path / "curve.csv", index=False)  # and nope seed 1's last row cut
    calls = _record_runs(monkeypatch)
    run_lengthgen(tmp_path, TINY, **kwargs)
    assert sorted(calls) == [("repeat", "alibi", 1), ("repeat", "nope", 1)]
    assert "lacks or holds a damaged curve for 2 finished run(s)" in capsys.readouterr().err
    key = ["method", "seed", "step"]
    assert_frame_equal(
        pd.read_csv(tmp_path / "curve.csv").sort_values(key, ignore_index=True),
        curve.sort_values(key, ignore_index=True),
    )  # the same seeds: the same curve
    for folder in (tmp_path / "models").rglob("seed0"):
        for file in folder.iterdir():
            file.unlink()  # the saved models the distances need (each method's first seed)
    calls.clear()
    run_lengthgen(tmp_path, TINY, **kwargs)
    assert sorted(calls) == [("repeat", "alibi", 0), ("repeat", "nope", 0)]
    assert "2 saved model(s) the attention distances read cannot be loaded" in capsys.readouterr().err
    assert_frame_equal(pd.read_csv(tmp_path / "attention_distance.csv"), distances)  # nothing lost
    assert len(pd.read_csv(tmp_path / "lengthgen.csv")) == 4 * 6  # no run written twice


def test_a_narrower_rerun_says_what_the_summary_covers(tmp_path, capsys):
    kwargs = dict(tasks=("repeat",), methods=("nope",), progress=False, figures=False)
    run_lengthgen(tmp_path, TINY, seeds=(0, 1), **kwargs)
    capsys.readouterr()
    distances = (tmp_path / "attention_distance.csv").read_bytes()
    run_lengthgen(tmp_path, TINY, seeds=(0,), **kwargs)
    assert "also holds 1 run(s) not asked for this time (repeat nope 1)" in capsys.readouterr().err
    assert (tmp_path / "attention_distance.csv").read_bytes() == distances  # NoPE's second seed kept
    with pytest.raises(ValueError, match="--default-row-seeds 5 must be among --seeds 0"):
        run_lengthgen(tmp_path, TINY, seeds=(0,), default_row_seeds=(5,), **kwargs)
    descriptor = os.open(tmp_path, os.O_RDONLY)  # another process running in the folder
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    before = sorted((path, path.stat().st_mtime_ns) for path in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="is in use by another nopelens run; .* for this lengthgen run"):
        run_lengthgen(tmp_path, TINY, seeds=(0, 1, 2), **kwargs)
    os.close(descriptor)
    assert sorted((path, path.stat().st_mtime_ns) for path in tmp_path.rglob("*")) == before  # nothing touched


def test_a_cut_last_line_is_left_out_and_its_run_measured_again(tmp_path, monkeypatch, capsys):
    """A copy stopped half-way leaves a last line whose number is cut short, still a number."""
    kwargs = dict(tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False, figures=False)
    whole = run_lengthgen(tmp_path, TINY, **kwargs)
    for name in ("lengthgen.csv", "curve.csv"):
        text = (tmp_path / name).read_text()
        (tmp_path / name).write_text(text[: len(text) - 7])  # the last line's end, and its newline
    calls = _record_runs(monkeypatch)
    results = run_lengthgen(tmp_path, TINY, **kwargs)
    err = capsys.readouterr().err
    assert "lengthgen.csv ends in a cut line" in err and "curve.csv ends in a cut line" in err
    assert calls == [("repeat", "alibi", 0)]  # the run of the cut line, once
    key, columns = ["method", "length"], ["task", "method", "seed", "length", "n", "exact_match", "loss"]
    assert_frame_equal(
        results.sort_values(key, ignore_index=True)[columns], whole.sort_values(key, ignore_index=True)[columns]
    )  # the same numbers as before the cut (times aside)


DAMAGED_CELLS = [("exact_match", 2, None), ("seed", 1, "abc"), ("token_accuracy", 2, 7.5)] + [
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
        ("token_accuracy", 1, "nan"),
        ("loss", 2, -1),
        ("n", 1, 0),
        ("train_max_len", 2, 5),
        ("final_train_loss", 3, "inf"),
    ]
]  # the fast lane keeps a missing cell and a text cell; each costs a lengthgen run


@pytest.mark.parametrize("column, length, cell", DAMAGED_CELLS)
def test_a_damaged_cell_measures_only_its_run_again(tmp_path, monkeypatch, capsys, column, length, cell):
    run_lengthgen(
        tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False, figures=False
    )
    table = pd.read_csv(tmp_path / "lengthgen.csv").astype({column: object})
    table.loc[(table["method"] == "alibi") & (table["length"] == length), column] = cell
    table.to_csv(tmp_path / "lengthgen.csv", index=False)
    calls = _record_runs(monkeypatch)
    results = run_lengthgen(
        tmp_path, TINY, tasks=("repeat",), methods=("nope", "alibi"), seeds=(0,), progress=False, figures=False
    )
    assert calls == [("repeat", "alibi", 0)] and len(results) == 12
    assert results["seed"].dtype.kind == "i" and results["exact_match"].between(0, 1).all()
    assert (results["in_distribution"] == (results["length"] <= TINY.train_max_len)).all()
    assert "holds only part of repeat alibi seed 0" in capsys.readouterr().err


def test_other_settings_in_the_same_folder_are_refused(tmp_path):
    run_lengthgen(tmp_path, TINY, tasks=("repeat",), methods=("nope",), seeds=(0,), progress=False, figures=False)
    with pytest.raises(ValueError, match="other settings.*steps"):
        run_lengthgen(
            tmp_path,
            LengthGenSettings(**{**TINY.__dict__, "steps": 4}),
            tasks=("repeat",),
            methods=("nope",),
            seeds=(0,),
            figures=False,
        )


def test_unknown_method_and_bad_settings():
    with pytest.raises(ValueError, match="unknown method"):
        run_lengthgen("/nonexistent", TINY, methods=("no-such-method",))
    with pytest.raises(ValueError, match="'repeat' is listed twice"):
        run_lengthgen("/nonexistent", TINY, tasks=("repeat", "copy", "repeat"))
    with pytest.raises(ValueError, match="'nope' is listed twice"):
        run_lengthgen("/nonexistent", TINY, methods=("nope", "nope"))
    with pytest.raises(ValueError, match="steps"):
        LengthGenSettings(steps=0)


def _rows(values: dict) -> pd.DataFrame:
    """Per-length rows: {(task, method): [(in-distribution, longer) per seed]}, sizes 1-2 and 3-4."""
    rows = []
    for (task, method), seeds in values.items():
        for seed, (inside, longer) in enumerate(seeds):
            for length, value in ((1, inside), (2, inside), (3, longer), (4, longer)):
                rows.append(
                    dict(
                        task=task,
                        method=method,
                        seed=seed,
                        length=length,
                        exact_match=value,
                        token_accuracy=value,
                        in_distribution=length <= 2,
                    )
                )
    return pd.DataFrame(rows)


def test_summary_arithmetic():
    summary = summarize(_rows({("copy", "nope"): [(1.0, 0.5), (0.8, 0.1)]}), n_symbols=4)
    row = summary.iloc[0]
    assert row["exact_match_in_distribution"] == pytest.approx(0.9)
    assert row["exact_match_longer"] == pytest.approx(0.3)
    half = stats.t.ppf(0.975, 1) * pd.Series([0.5, 0.1]).std() / 2**0.5
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((0.3 - half, 0.3 + half))
    assert row["seeds"] == 2 and row["per_seed"] == "0.500 0.100" and row["token_accuracy_floor"] == 0.25
    assert row["released"] == kazemnejad.RELEASED[("cmc", "NoPE")] == pytest.approx(0.305, abs=5e-4)
    assert row["released_in_ci"] and row["released_per_seed"] == "0.2896 0.2944 0.3322"
    assert row["paper_task"] == "cmc" and row["paper_method"] == "NoPE"


def test_every_released_number_has_its_row_and_source():
    assert len(kazemnejad.RELEASED) == 5 * 5
    for task, paper_task in kazemnejad.PAPER_TASKS.items():
        for method in kazemnejad.PAPER_VARIANTS:
            assert (
                kazemnejad.released(task, method)
                == kazemnejad.RELEASED[(paper_task, kazemnejad.VARIANTS[method].paper_method)]
            )
    assert pd.isna(kazemnejad.released("copy", "nope_scaled"))  # a nopelens-default row is not the paper's model
    assert "results/sanity_check.jsonl" in kazemnejad.RELEASED_SOURCE
    quoted = {  # the table of the released means (issue 46), each to 3 decimals
        "rsc": (0.986, 0.771, 0.289, 0.0002, 0.000),
        "rsc2x": (0.974, 0.558, 0.194, 0.000, 0.000),
        "rdc": (0.967, 0.939, 0.170, 0.016, 0.000),
        "cmc": (0.305, 0.420, 0.331, 0.011, 0.028),
        "mc": (0.230, 0.242, 0.171, 0.077, 0.023),
    }
    for task, values in quoted.items():
        for method, value in zip(("NoPE", "T5 bias", "ALiBi", "Rotary", "APE"), values):
            per_seed = kazemnejad.RELEASED_PER_SEED[(task, method)]
            assert len(per_seed) == len(kazemnejad.RELEASED_SEEDS) and all(0 <= v <= 1 for v in per_seed)
            assert kazemnejad.RELEASED[(task, method)] == pytest.approx(value, abs=5e-4), (task, method)


@pytest.mark.parametrize(
    "nope, rope, verdict",
    [
        ([0.99, 0.97, 0.98], [0.0, 0.01, 0.0], "reproduced"),  # released difference 0.986 inside the CI
        ([0.50, 0.52, 0.48], [0.0, 0.01, 0.0], "direction only"),  # right side, far from 0.986
        ([0.0, 0.3, 0.0], [0.0, 0.0, 0.1], "not reproduced"),  # the CI holds 0
        ([0.0, 0.0, 0.01], [0.5, 0.6, 0.55], "not reproduced"),  # the other side
    ],
)
def test_verdicts_survive_their_known_answers(nope, rope, verdict):
    results = _rows({("repeat", "nope"): [(1.0, v) for v in nope], ("repeat", "rope"): [(1.0, v) for v in rope]})
    claims = kazemnejad.ranking_verdicts(results)
    assert claims["claim"].tolist() == ["NoPE above Rotary"] and claims["verdict"].tolist() == [verdict]
    assert claims["released_difference"].iloc[0] == pytest.approx(0.986 - 0.0002, abs=1e-3)


def test_a_released_tie_is_no_claim():
    results = _rows({("copy", "nope"): [(1, 0.3), (1, 0.3)], ("copy", "alibi"): [(1, 0.3), (1, 0.3)]})
    assert kazemnejad.ranking_verdicts(results).empty  # released 0.305 against 0.331


def test_the_budget_rule_reads_only_the_in_distribution_loss():
    curve = pd.DataFrame({"step": [50, 100, 150, 200], "validation_loss": [3.0, 1.0, 0.35, 0.3]})
    assert levelled_step(curve) == 200  # 0.35 > 0.3 + 0.01 * (3.0 - 0.3); the last quarter gave 0.05 < 5 % of 2.7
    assert levelled_step(curve, share=0.9) == 150  # 0.35 <= 0.3 + 0.1 * 2.7
    assert levelled_step(curve.assign(validation_loss=1.0)) == 50  # flat from the start
    assert levelled_step(curve.assign(validation_loss=[4.5, 4.0, 3.5, 3.1])) is None  # still falling: not levelled
    pilot = pd.concat([curve.assign(levelled_step=150.0), curve.assign(levelled_step=float("nan"))])
    assert chosen_budget(pilot) == 150 and chosen_budget(pilot.iloc[4:]) is None


def test_an_unlearned_task_tests_no_claim():
    results = _rows({("repeat", "nope"): [(0.2, 0.0), (0.1, 0.0)], ("repeat", "rope"): [(1.0, 0.0), (1.0, 0.0)]})
    claims = kazemnejad.ranking_verdicts(results)
    assert claims["verdict"].tolist() == ["not reproduced"] and "not learned in distribution" in claims["why"].iloc[0]


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
    assert "rope" in out and "released" in out
    assert (tmp_path / "lengthgen.svg").exists()


def test_distance_verdicts_on_hand_set_distances():
    def table(**jsd):
        return pd.DataFrame(
            [
                dict(task="copy", model_a="nope", model_b=name.replace("_", " "), layer=layer, jsd_bits=value)
                for name, value in jsd.items()
                for layer in (0, 1)
            ]
        )

    paper = table(t5=0.1, alibi=0.2, rope=0.5, sinusoidal=0.6, nope_second_seed=0.05)
    verdicts = kazemnejad.distance_verdicts(paper, second="nope second seed")
    assert verdicts["verdict"].tolist() == ["reproduced"] * 3
    swapped = kazemnejad.distance_verdicts(
        table(t5=0.5, alibi=0.2, rope=0.1, sinusoidal=0.6, nope_second_seed=0.3), second="nope second seed"
    )
    assert swapped["verdict"].tolist() == ["not reproduced"] * 3
    untested = kazemnejad.distance_verdicts(paper, second="nope second seed", unlearned=frozenset({"copy"}))
    assert untested["verdict"].tolist() == ["not reproduced"] * 3 and untested["why"].str.contains("no test").all()


def test_cli_bad_input_is_one_line_and_loses_nothing(tmp_path, capsys):
    assert (
        main(
            [
                "lengthgen",
                "--out",
                str(tmp_path),
                "--quick",
                "--tasks",
                "repeat",
                "--methods",
                "nope",
                "--seeds",
                "0",
                "--steps",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    before = (tmp_path / "lengthgen.csv").read_bytes()
    capsys.readouterr()
    for argv in (
        ["--train-max-len", "0"],  # a bad setting
        ["--steps", "3"],  # another run's settings in the folder
        ["--pilot", "--methods", "alibi"],  # options the pilot would ignore
        ["--pilot", "--seeds", "7", "--jobs", "2"],
    ):
        assert main(["lengthgen", "--out", str(tmp_path), "--quick", "--quiet", *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (tmp_path / "lengthgen.csv").read_bytes() == before


def test_cli_pilot_logs_only_the_in_distribution_loss(tmp_path, capsys):
    assert (
        main(
            ["lengthgen", "--pilot", "--quick", "--tasks", "repeat", "--steps", "8", "--out", str(tmp_path), "--quiet"]
        )
        == 0
    )
    pilot = pd.read_csv(tmp_path / "pilot.csv")
    assert set(pilot["method"]) == {"nope", "rope"} and sorted(set(pilot["step"])) == list(range(1, 9))
    assert pilot["exact_match_in_distribution"].between(0, 1).all()
    assert assert_folder_documented(tmp_path, "lengthgen") == ["pilot.csv"]
    assert "budget by the in-distribution rule" in capsys.readouterr().out
    assert not (tmp_path / "lengthgen.csv").exists()
    before = (tmp_path / "pilot.csv").read_bytes()
    pilot_args = ["lengthgen", "--pilot", "--quick", "--tasks", "repeat", "--steps", "8", "--quiet", "--out"]
    assert main([*pilot_args, str(tmp_path)]) == 2  # the record that fixed a budget is never overwritten
    assert "holds a pilot already" in capsys.readouterr().err and (tmp_path / "pilot.csv").read_bytes() == before
    comparison = ["lengthgen", "--quick", "--tasks", "repeat", "--methods", "nope", "--seeds", "0", "--quiet"]
    assert main([*comparison, "--train-max-len", "3", "--out", str(tmp_path / "other")]) == 0
    assert main([*pilot_args, str(tmp_path / "other")]) == 2  # a comparison of another length
    err = capsys.readouterr().err
    assert "holds a lengthgen comparison with other settings (train_max_len: " in err and len(err.splitlines()) == 1
    assert main([*comparison, "--out", str(tmp_path / "same")]) == 0
    assert main([*pilot_args, str(tmp_path / "same")]) == 0  # beside the comparison it fixed: steps may differ
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text('{"settings": {}, "command": "sweep"}')
    assert (
        main([*pilot_args, str(tmp_path / "sweep")]) == 2 and "holds a run of nopelens sweep" in capsys.readouterr().err
    )
    assert main([*pilot_args, str(tmp_path / "same" / "models")]) == 2  # inside a comparison, not beside it
    assert "holds files of its own; a pilot writes into a new or empty folder" in capsys.readouterr().err
