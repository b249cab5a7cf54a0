"""Per-layer results where people look: the curves (layers.csv, load_run), the per-layer tables on the
screen and in summary.md (within 100 columns), --json, --metric, --threshold and --sites (issue 23)."""

import contextlib
import dataclasses
import io
import json

import pandas as pd
import pytest

from nopelens.analyses import load_run, report, runs
from nopelens.analyses.cli import main
from nopelens.analyses.sweep import DEFAULT_SITES, SweepSettings, layers, reads

ARGS = ["--n-sequences", "12", "--seq-len", "16", "--jobs", "1"]


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """``nopelens probe circuit`` on small settings, with progress on (stderr is not a terminal)."""
    out = tmp_path_factory.mktemp("probe") / "circuit"
    stdout, stderr = io.StringIO(), io.StringIO()  # capsys is per test; the run is shared by the module
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(["probe", "circuit", "--out", str(out), *ARGS]) == 0
    return out, stdout.getvalue(), stderr.getvalue()


def test_the_screen_shows_each_layer_with_its_ci_within_100_columns(probed):
    out, printed, progress = probed
    assert printed.strip().splitlines()[-1] == str(out), "it says where it wrote"
    assert max(len(line) for line in printed.splitlines()[:-1]) <= report.SCREEN_WIDTH
    assert_curves_first(printed, ["circuit"])
    curves = pd.read_csv(out / "layers.csv")
    row = curves[(curves["curve"] == "absolute_r2") & (curves["layer"] == 0)].iloc[0]
    cell = f"{row['value']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"
    assert cell in printed, "the layer-0 R² and its CI are printed"
    assert "1.00 [1.00, 1.00]*" in printed, "layer 1 clears the bar (Theorem 1)"
    assert "nopelens probe: " in progress and "nopelens sweep" not in progress, "the bar names the command"
    assert "circuit: pass 1" in progress, "the forward passes have their own bar, named by model"


def assert_curves_first(printed: str, models: list[str]) -> None:
    """Issue 49: the per-layer curves come first (each model's table), the first layer at a bar after."""
    lines = printed.splitlines()
    assert lines[0] == report.LAYER_HEADLINE and lines[2] == models[0], lines[:3]
    first_layer_table = next(i for i, line in enumerate(lines) if line.lstrip().startswith("model "))
    assert all(lines.index(model) < first_layer_table for model in models)


def test_a_read_whose_selectivity_is_low_says_so_next_to_its_value(probed):
    """The known answer: the circuit embeds its 8 token ids one-hot, so a probe fits the Hewitt & Liang
    control task (a random label per token id) exactly: it scores 1.00 as the index read does, and
    both absolute-index reads say their selectivity is low; reads without a control task say nothing."""
    out, printed, _ = probed
    low = layers.low_selectivity(pd.read_csv(out / "probes.csv"))
    assert set(low["curve"]) == {"absolute_acc", "absolute_r2"} and (low["selectivity"].abs() < 0.01).all()
    line = "abs. index R² 1.00 (layer 1): low selectivity 0.00, the control task scores 1.00"
    assert line in printed.splitlines() and line in (out / "summary.md").read_text().splitlines()
    # a read is judged at its best layer, and only where the control task scores more than half its value
    probes = pd.read_csv(out / "probes.csv")
    selective = probes.assign(selectivity=probes["value"] * 0.6)
    assert layers.low_selectivity(selective).empty


def test_summary_md_holds_the_per_layer_tables_and_links_only_written_figures(probed):
    out, _, _ = probed
    text = (out / "summary.md").read_text()
    assert text.startswith("# nopelens probe\n\n## Per layer\n"), "the curves come first"
    assert "### circuit" in text and text.index("### circuit") < text.index("## First layer at a bar")
    assert text.index("![per-layer probe curves](probes.png)") < text.index("## First layer at a bar")
    linked = [part.split(")")[0] for part in text.split("](")[1:]]
    assert linked and all((out / name).is_file() for name in linked), linked
    assert "variance.png" not in linked and not (out / "variance.png").exists(), "the circuit's outputs never vary"
    curves = pd.read_csv(out / "layers.csv")
    row = curves[(curves["curve"] == "relative_content_qk_r2") & (curves["layer"] == 1)].iloc[0]
    assert f"{row['value']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]".replace("-0.00", "0.00") in text


def test_the_curves_are_the_reads_probe_rows(probed):
    """layers.csv holds each read's own rows of probes.csv, nothing recomputed, and load_run returns them."""
    out, _, _ = probed
    probes = pd.read_csv(out / "probes.csv")
    run = load_run(out)
    for read in reads.SWEEP_READS:
        rows = read.rows(probes).set_index("layer")
        curve = run.curve(read.column, "circuit")
        assert list(curve.index) == list(rows.index), read.column
        assert (curve["value"] == rows["value"]).all() and (curve["ci_low"] == rows["ci_low"]).all()
    mad = run.curve(layers.MAD_CHANCE, "circuit")
    assert mad.loc[1, "value"] == pytest.approx(0, abs=1e-3) and 0.5 < mad.loc[0, "value"] < 1
    assert set(run.tables) >= {"probes", "sinks", "summary", "layers"}
    wide = run.curve("absolute_r2")
    assert list(wide.columns) == ["circuit"] and wide.loc[1, "circuit"] == pytest.approx(1)
    with pytest.raises(KeyError, match="curves: absolute_acc"):
        run.curve("no_such_curve")
    # a folder from before layers.csv: the same curves, computed from probes.csv and sinks.csv
    (out / "layers.csv").rename(out / "layers.bak")
    try:
        recomputed = load_run(out).curves
    finally:
        (out / "layers.bak").rename(out / "layers.csv")
    pd.testing.assert_frame_equal(recomputed.reset_index(drop=True), run.curves, check_dtype=False)


@pytest.mark.slow
def test_json_threshold_and_metric_reread_the_folder_without_measuring_again(probed, capsys):
    out, _, _ = probed
    assert main(["probe", "circuit", "--out", str(out), *ARGS, "--quiet", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert "already measured" in captured.err
    assert [r["column"] for r in data["reads"]] == list(reads.read_columns())
    layer_rows = pd.DataFrame(data["layers"])
    on_disk = pd.read_csv(out / "layers.csv")
    assert len(layer_rows) == len(on_disk) and layer_rows["value"].tolist() == pytest.approx(on_disk["value"].tolist())
    assert data["summary"][0]["absolute_r2"] == 1
    assert all(type(data["summary"][0][column]) is int for column in reads.read_columns()), "first layers are ints"

    originals = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}  # the stamp and parts too
    assert (
        main(["probe", "circuit", "--out", str(out), *ARGS, "--quiet", "--metric", "spearman", "--threshold", "0.5"])
        == 0
    )
    captured = capsys.readouterr()
    assert "already measured" in captured.err
    # issue 49: the re-read writes beside the original, never over it
    assert {path: path.read_bytes() for path in originals} == originals
    summary = pd.read_csv(out / "summary-spearman-0.5.csv")
    assert "absolute_spearman" in summary and "absolute_r2" not in summary, "a Spearman layer under its own name"
    assert summary.loc[0, "absolute_acc"] == 1 and summary.loc[0, "absolute_spearman"] == 1
    assert "abs. index acc ≥ 0.5" in captured.out and "Spearman ρ ≥ 0.5" in captured.out
    assert set(pd.read_csv(out / "layers-spearman-0.5.csv")["threshold"].dropna()) == {0.5}
    text = (out / "summary-spearman-0.5.md").read_text()
    assert (
        "Spearman ρ ≥ 0.5" in text
        and "(probes-spearman-0.5.png)" in text
        and (out / "probes-spearman-0.5.png").is_file()
    )
    assert main(["probe", "circuit", "--out", str(out), *ARGS, "--quiet"]) == 0  # back to the defaults
    assert "absolute_r2" in pd.read_csv(out / "summary.csv") and (out / "summary-spearman-0.5.md").is_file()
    capsys.readouterr()


def test_summary_md_says_what_each_model_was_read_on(probed):
    """Issue 49: per model, the sequences and tokens per sequence actually read, beside the settings."""
    out, _, _ = probed
    text = (out / "summary.md").read_text()
    assert "## What was measured" in text
    measured = text[text.index("## What was measured") :]
    row = next(line for line in measured.splitlines() if line.startswith("| circuit "))
    assert [cell.strip() for cell in row.strip("|").split("|")] == ["circuit", "12", "16", "yes"]  # ARGS
    done = json.loads(next(out.glob("parts/circuit/done.json")).read_text())
    assert done["read"] == {"sequences": 12, "tokens": [16, 16]}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--metric", "f1"], "unknown metric 'f1'"),
        (["--metric", "mad"], "--threshold mad=2"),
        (["--metric", "mad", "--threshold", "2"], "accuracy cannot exceed 1"),
        (["--threshold", "mad=x"], "BAR or METRIC=BAR"),
        (["--threshold", "1.5"], "cannot exceed 1"),
        (["--metric", "sideways=r2"], "regression or classification"),
        (["--threshold", "mad=2"], "no read uses mad (they use accuracy, r2; choose it with --metric)"),
        (["--threshold", "mad=-1"], "no read uses mad"),
        (["--threshold", "r2=0.5,r2=0.7"], "gives the bar of r2 twice"),
        (["--threshold", "0.5,0.7"], "gives a bare bar twice"),
        (["--metric", "regression=spearman,regression=r2"], "names the regression metric twice"),
        (["--threshold", "-3"], "accuracy is never below 0, so every layer would clear it"),
        (["--metric", "spearman", "--threshold", "spearman=-1"], "spearman is never below -1"),
        (["--sites", "resid,attn_in"], "unknown site kind 'attn_in'"),
        (["--sites", "attn_out"], "--sites must include resid"),
    ],
)
def test_bad_reads_and_sites_are_one_line_before_any_work(flags, message, tmp_path, capsys):
    assert main(["probe", "circuit", "--out", str(tmp_path / "x"), *ARGS, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x" / "parts").exists()


def test_choose_reads_replaces_the_metric_of_the_task_that_reports_it():
    chosen = reads.choose_reads("classification=within_one,regression=mad", threshold="0.5,mad=2")
    assert [(r.column, r.metric) for r in chosen[:2]] == [
        ("absolute_within_one", "within_one"),
        ("absolute_mad", "mad"),
    ]
    assert chosen[1].header == "abs. index MAD ≤ 2" and not chosen[1].higher_is_better
    assert chosen[0].threshold == 0.5, "the bare bar for the others"
    assert reads.choose_reads() == reads.SWEEP_READS


def test_sites_choose_what_is_measured_and_keep_old_digests(tmp_path, capsys):
    default = SweepSettings(models=("circuit",))
    assert default.sites == DEFAULT_SITES and "sites" not in default.to_dict()
    assert default.digest() == runs.settings_digest(
        {
            k: v
            for k, v in dataclasses.asdict(default).items()
            if k
            not in ("sites", "hf_input", "streamed", "batch_size", "keep_mib", "sink_ablation", "memory_mib", "layers")
        },
        ignore=("train_seeds",),
    )
    out = tmp_path / "resid"
    assert main(["probe", "circuit", "--out", str(out), *ARGS, "--quiet", "--sites", "resid,resid_mid"]) == 0
    sites = set(pd.read_csv(out / "probes.csv")["site"])
    assert "blocks.0.hook_resid_mid" in sites and "blocks.0.hook_attn_out" not in sites
    assert main(["probe", "circuit", "--out", str(out), *ARGS, "--quiet"]) == 2, "a folder keeps its sites"
    assert "sites" in capsys.readouterr().err


def test_fit_width_splits_columns_and_repeats_the_row_labels():
    table = pd.DataFrame({"model": ["a", "b"], **{f"column {i}": ["0.93 [0.91, 0.95]"] * 2 for i in range(8)}})
    parts = report.fit_width(table, lambda t: t.to_string(index=False), width=60)
    assert len(parts) > 1 and all(max(len(line) for line in part.splitlines()) <= 60 for part in parts)
    headers = [part.splitlines()[0].split("  ") for part in parts]
    assert all(part.splitlines()[1].lstrip().startswith("a") for part in parts), "every part keeps the model column"
    assert sum(part.count("column") for part in parts) == 8 and len(headers) == len(parts)


@pytest.mark.slow
def test_a_copy_task_model_says_it_was_read_at_its_own_length(tmp_path, monkeypatch):
    """Issue 49: a copy-task model is read at its longest training length (23 tokens with BOS), not at
    --seq-len; summary.md's table says so beside the settings line's seq_len."""
    monkeypatch.setenv("NOPELENS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "copy"
    assert main(["probe", "copy-nope-3l", "--quick", "--out", str(out), "--quiet"]) == 0
    text = (out / "summary.md").read_text()
    row = next(line for line in text[text.index("## What was measured") :].splitlines() if line.startswith("| copy"))
    assert [cell.strip() for cell in row.strip("|").split("|")][1:] == ["24", "23", "yes"]
    assert "seq_len=32" in text and "seq_len is the length asked for" in text
