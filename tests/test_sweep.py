"""The main job on its --quick setting: known answers of the controls, the run folder, resuming."""

import dataclasses

import pandas as pd
import pytest
from schema import assert_documented, assert_folder_documented

from nopelens.analyses import report
from nopelens.analyses.cli import main
from nopelens.analyses.sweep import SweepSettings, seeds, sweep, versions

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("run") / "sweep"
    mp = pytest.MonkeyPatch()
    mp.setenv("NOPELENS_CACHE", str(cache))
    result = sweep(SweepSettings.quick(), out, progress=False)
    report.write_run(result, SweepSettings.quick(), "nopelens sweep --quick", versions())  # as the CLI renders it
    yield result, out
    mp.undo()


def linear(result, model, target, metric, features=None):
    rows = result.probes
    rows = rows[
        (rows["model"] == model)
        & (rows["probe"] == "linear")
        & (rows["split"] == "grouped")
        & (rows["target"] == target)
        & (rows["metric"] == metric)
        & rows["layer"].notna()
    ]
    if features == "resid":
        rows = rows[rows["site"].str.contains("hook_resid_")]
    elif features is not None:
        rows = rows[rows["features"].str.startswith(features)]
    return rows.set_index("layer")


def test_circuit_absolute_index_at_chance_at_layer_0_and_exact_at_layer_1(quick_run):
    result, _ = quick_run
    r2 = linear(result, "circuit", "absolute_index", "r2", "resid")["value"]
    accuracy = linear(result, "circuit", "absolute_index", "accuracy", "resid")["value"]
    assert r2.loc[0] < 0.2, "only the BOS flag distinguishes position 0 at the embeddings"
    assert r2.loc[1] >= 0.9995 and accuracy.loc[1] == 1.0
    summary = result.summary.set_index("model")
    assert summary.loc["circuit", "absolute_r2"] == 1
    assert summary.loc["circuit", "relative_content_qk_r2"] == 2, "the Theorem 2 head is block 1's attention"
    assert summary.loc["circuit", "relative_score_r2"] == 2, "block 1's own scores read i - j"


def test_untrained_nope_without_bos_recovers_nothing_and_shrinks_variance(quick_run):
    result, _ = quick_run
    summary = result.summary.set_index("model")
    for column in ("absolute_acc", "absolute_r2", "relative_pairs_r2", "relative_score_r2", "relative_content_qk_r2"):
        assert summary.loc["untrained-nope", column] == -1, column
    assert -1.3 < summary.loc["untrained-nope", "variance_slope_block0"] < -0.7


def test_constant_input_recovers_nothing_at_any_layer(quick_run):
    """Every token one id, no BOS: one state at every position, so every read is at chance."""
    result, _ = quick_run
    summary = result.summary.set_index("model")
    for column in ("absolute_acc", "absolute_r2", "relative_pairs_r2", "relative_score_r2", "relative_content_qk_r2"):
        assert summary.loc["constant-nope", column] == -1, column
    assert summary.loc["constant-nope", "best_absolute_r2"] <= 0.05


def test_selectivity_next_to_every_linear_score(quick_run):
    result, _ = quick_run
    rows = result.probes[
        (result.probes["probe"] == "linear")
        & result.probes["metric"].isin(["accuracy", "r2"])
        & (result.probes["split"] == "grouped")
    ]
    one_token = rows["model"] == "constant-nope"  # one token type: the control task is undefined
    assert rows.loc[~one_token, "selectivity"].notna().all()
    assert rows.loc[one_token, "selectivity"].isna().all()
    control = result.probes[result.probes["probe"] == "control"]
    assert len(control) > 0


def test_run_folder_holds_tables_figures_and_summary(quick_run):
    result, out = quick_run
    for name in (
        "probes.csv",
        "sinks.csv",
        "variance.csv",
        "summary.csv",
        "layers.csv",
        "summary.md",
        "probes.png",
        "sites.png",
        "sinks.png",
        "variance.png",
    ):
        assert (out / name).is_file(), name
    assert not list(out.glob("*.svg")), "SVG only on request (--svg)"
    assert not (out / "summary_per_seed.csv").exists(), "one training seed: no per-seed tables"
    summary = (out / "summary.md").read_text()
    assert "circuit" in summary and "Command:" in summary and "Versions:" in summary
    assert "*Head scores*" in summary and "*Content q·k*" in summary, "summary.md says which read is which"
    assert set(pd.read_csv(out / "probes.csv")["model"]) == set(result.summary["model"])
    assert not list(out.rglob(".*.csv")), "no temporary files left behind"


def test_every_column_of_every_table_is_documented(quick_run):
    """docs/schema.md describes every column (and listed value) of the folder's tables, of its parts,
    and of the tables several training seeds add."""
    result, out = quick_run
    written = assert_folder_documented(out, "sweep")
    assert {"probes.csv", "layers.csv", "summary.csv", "sinks.csv", "variance.csv", "sink_ablation.csv"} <= set(written)
    two_seeds = pd.concat([result.summary_per_seed, result.summary_per_seed.assign(train_seed=1)])
    assert_documented(two_seeds, "sweep: summary_per_seed.csv")
    assert_documented(seeds.over_seeds(two_seeds), "sweep: summary.csv")
    assert_documented(
        seeds.probes_over_seeds(pd.concat([result.probes, result.probes.assign(train_seed=1)])),
        "sweep: probes_over_seeds.csv",
    )


def test_rerun_resumes_and_other_settings_are_refused(quick_run, capsys):
    result, out = quick_run
    for part in (out / "parts").iterdir():
        (part / "probes.csv").write_text((part / "probes.csv").read_text())  # touch: contents unchanged
    for name in ("summary_per_seed.csv", "probes_over_seeds.csv"):  # as a run over two training seeds left them
        (out / name).write_text("train_seed\n0\n1\n")
    (out / "probes.svg").write_text("<svg/>")  # as a run with --svg left it
    code = main(["sweep", "--quick", "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0
    assert not (out / "summary_per_seed.csv").exists() and not (out / "probes_over_seeds.csv").exists()
    assert not (out / "probes.svg").exists() and (out / "probes.png").exists()
    assert captured.err.count("already measured") == len(result.summary)
    code = main(["sweep", "--quick", "--seed", "3", "--out", str(out)])
    assert code == 2
    assert "other settings" in capsys.readouterr().err


def test_the_quick_smoke_test_has_its_own_default_folder(monkeypatch):
    """`nopelens sweep --quick` right after `nopelens sweep` must not meet the main job's folder (it
    was refused there as "made with other settings")."""
    from nopelens.analyses.cli import sweep as cli_sweep

    folders = []

    def record(args, settings, out, name):
        folders.append(out)
        raise ValueError("stop here")

    monkeypatch.setattr(cli_sweep, "_sweep", record)
    for args in (["sweep", "--quiet"], ["sweep", "--quick", "--quiet"], ["sweep", "--quick", "--out", "mine"]):
        assert main(args) == 2
    assert folders == ["runs/sweep", "runs/sweep-quick", "mine"]


def test_one_pass_and_planned_streamed_runs_give_the_same_tables_past_64_positions(one_thread):
    """Issue 38: the sweep's one pass (every feature kept) and a planned streamed run (batches of 4,
    nothing kept: a second pass) bin positions past 64 classes and draw pairs at 64 spread distances
    (one set of settings, :class:`~nopelens.analyses.sweep.reads.ProbeInput`'s), so their tables agree at
    any length."""
    import numpy as np
    import torch

    from nopelens.analyses.subjects import resolve
    from nopelens.analyses.sweep import analyse_subject

    settings = SweepSettings(
        models=("untrained-nope",), n_sequences=6, seq_len=80, n_boot=10, n_splits=3, sink_ablation=False
    )
    planned = dataclasses.replace(settings, streamed=True, batch_size=4, keep_mib=0)
    subject = resolve("untrained-nope", 6, 80, seed=0, progress=False)
    key = ["site", "target", "features", "task", "probe", "split", "metric"]
    with torch.no_grad():
        memory, streamed = (
            analyse_subject(subject, chosen)["probes"].sort_values(key).reset_index(drop=True)
            for chosen in (settings, planned)
        )
        assert subject.info["streamed"]["second_pass_batches"] == [0, 1]
    assert "absolute_index//2" in set(memory["target"])  # 80 positions in 64 classes: bins of 2
    pd.testing.assert_frame_equal(memory[key], streamed[key])
    for column in ("value", "ci_low", "ci_high", "n_samples", "selectivity"):
        np.testing.assert_allclose(
            streamed[column].astype(float),
            memory[column].astype(float),
            rtol=1e-8,
            atol=1e-8,
            equal_nan=True,
            err_msg=column,
        )


def test_unknown_model_is_one_line_pointing_to_the_zoo(capsys, tmp_path):
    assert main(["sweep", "--models", "gpt-17", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nopelens train --list" in err[0] and "did you mean" not in err[0]


def test_a_misspelt_zoo_name_suggests_the_close_ones(capsys, tmp_path):
    assert main(["sweep", "--models", "text-nope-4", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean text-nope-4l" in err[0]


def test_sink_ablation_section(quick_run):
    """Theorem 1: the circuit's index at layer 1 is all from the first token; block 1 adds none."""
    result, out = quick_run
    table = result.sink_ablation[result.sink_ablation["model"] == "circuit"].set_index("block")
    assert table.loc[0, "drop"] > 0.95 and table.loc[0, "r2_ablated"] < 0.05
    assert abs(table.loc[1, "drop"]) < 1e-3
    assert set(result.sink_ablation["model"]) == set(result.summary["model"])
    assert (out / "sink_ablation.csv").is_file() and (out / "sink_ablation.png").is_file()
    assert "## Sink ablation" in (out / "summary.md").read_text()


def test_a_sweep_of_models_whose_attention_output_never_varies_writes_no_variance_figure(tmp_path):
    """constant-nope alone: every variance is 0, so there is nothing to draw on log axes (it used to
    crash the figure with a bare KeyError after probing)."""
    out = tmp_path / "constant"
    assert main(["sweep", "--models", "constant-nope", "--no-controls", "--quick", "--out", str(out)]) == 0
    assert (out / "summary.md").is_file() and not (out / "variance.png").exists()


def test_two_sweeps_of_other_models_draw_each_method_in_the_same_colour(quick_run, tmp_path, monkeypatch):
    """Colours followed the order of models: NoPE pink and RoPE blue in one run's probes.png, the
    reverse in another (issue 49). Read from the artists each run's figures were drawn with: the
    default quick sweep's, and a sweep of other models in another order."""
    import matplotlib.colors

    drawn = {}
    save = report.save_figure

    def keep(fig, stem, formats=("png", "svg")):
        drawn[str(stem)] = fig
        return save(fig, stem, formats)

    def styles(out):
        probes, sites = drawn[str(out / "probes")], drawn[str(out / "sites")]
        lines = {
            line.get_label(): (matplotlib.colors.to_hex(line.get_color()), line.get_linestyle())
            for ax in probes.axes
            for line in ax.lines
            if not line.get_label().startswith("_")
        }
        titles = {
            ax.get_title().split("\n")[0]: matplotlib.colors.to_hex(ax.title.get_color())
            for ax in sites.axes
            if ax.get_visible()
        }
        return lines, titles

    monkeypatch.setattr(report, "save_figure", keep)
    result, out = quick_run
    report.write_run(result, SweepSettings.quick(), "nopelens sweep --quick", versions())  # the same files again
    (a, a_titles) = styles(out)
    rope, nope = "text-rope-4l (30 steps)", "text-nope-4l (30 steps)"  # the quick run's briefly trained models
    other = tmp_path / "other"
    assert (
        main(
            [
                "sweep",
                "--models",
                "untrained-nope,constant-rope",
                "--no-controls",
                "--quick",
                "--n-sequences",
                "16",
                "--seq-len",
                "16",
                "--jobs",
                "1",
                "--quiet",
                "--out",
                str(other),
            ]
        )
        == 0
    )
    (b, b_titles) = styles(other)
    assert set(b) == {"untrained-nope", "constant-rope"} and {rope, nope, "circuit", "constant-nope"} <= set(a)
    assert a["untrained-nope"] == b["untrained-nope"], "a model keeps its colour and style, whatever comes with it"
    assert a[rope][0] == b["constant-rope"][0] == a_titles[rope] == b_titles["constant-rope"], (
        "one colour for RoPE, in every run and figure"
    )
    assert a[nope][0] == a["circuit"][0] == b["untrained-nope"][0] != a[rope][0]
    assert (a[nope][1], a["circuit"][1], a["untrained-nope"][1], a["constant-nope"][1], b["constant-rope"][1]) == (
        "-",
        "--",
        ":",
        "-.",
        "-.",
    ), "controls in their own line style"


def test_a_rerun_with_no_figures_removes_the_earlier_figures(quick_run):
    """Last in this file: it changes the shared run folder. The tables would otherwise sit beside figures
    of an earlier run that this run did not draw."""
    result, out = quick_run
    assert list(out.glob("*.png"))
    assert main(["sweep", "--quick", "--out", str(out), "--quiet", "--no-figures"]) == 0
    assert not list(out.glob("*.png")) and not list(out.glob("*.svg"))
    assert (out / "probes.csv").is_file() and "![" not in (out / "summary.md").read_text()


def test_the_quick_sweep_prints_its_curves_first_within_100_columns(quick_run, capsys):
    """Issue 49: ``nopelens sweep --quick`` (here re-reading the fixture's finished folder) prints each
    model's per-layer curves first, the first-layer table after them, no line over 100 columns."""
    from test_layers import assert_curves_first

    result, out = quick_run
    assert main(["sweep", "--quick", "--out", str(out), "--quiet", "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= report.SCREEN_WIDTH
    assert_curves_first(printed, list(result.summary["model"]))


@pytest.mark.slow
def test_a_default_probe_of_the_circuit_prints_its_curves_first_within_100_columns(tmp_path, capsys):
    from test_layers import assert_curves_first

    assert main(["probe", "circuit", "--out", str(tmp_path / "circuit"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= report.SCREEN_WIDTH
    assert_curves_first(printed, ["circuit"])
