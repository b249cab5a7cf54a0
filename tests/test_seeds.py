"""Training seeds: zoo cache folders per seed, sweep tasks, and numbers over seeds."""

import math

import pandas as pd
import pytest

from nopelens.analyses import report
from nopelens.analyses.cli.options import parse_seeds
from nopelens.analyses.sweep import SweepSettings, seeds
from nopelens.models import zoo


def test_seed_0_keeps_its_cache_folder_and_other_seeds_get_their_own(tmp_path):
    assert (
        zoo.model_dir("text-nope-4l", tmp_path)
        == tmp_path / "zoo" / f"text-nope-4l-{zoo.RECIPES['text-nope-4l'].digest}"
    )
    one, two = (zoo.model_dir("text-nope-4l", tmp_path, seed=s) for s in (1, 2))
    assert one.name.startswith("text-nope-4l-seed1-") and two.name.startswith("text-nope-4l-seed2-")
    assert (
        zoo.recipe("text-nope-4l", 1).seed == 1
        and zoo.recipe("text-nope-4l", 1).digest != zoo.recipe("text-nope-4l").digest
    )
    assert not zoo.is_cached("text-nope-4l", tmp_path, seed=1)
    with pytest.raises(ValueError, match="seed"):
        zoo.recipe("text-nope-4l", -1)


def test_sweep_tasks_repeat_seeded_models_only():
    settings = SweepSettings(models=("text-nope-4l", "circuit", "untrained-nope"), train_seeds=(0, 1, 2))
    assert settings.tasks() == [
        ("text-nope-4l", 0),
        ("text-nope-4l", 1),
        ("text-nope-4l", 2),
        ("circuit", 0),
        ("untrained-nope", 0),
        ("untrained-nope", 1),
        ("untrained-nope", 2),
    ]


def test_training_seeds_do_not_change_the_run_folder_digest():
    """Adding seeds to a run folder measures only the new ones; folders from before seeds resume."""
    base = SweepSettings(models=("circuit",))
    assert SweepSettings(models=("circuit",), train_seeds=(0, 1)).digest() == base.digest()
    assert base.digest() != SweepSettings(models=("circuit",), seed=1).digest()


@pytest.mark.parametrize("seeds_", [(), (1, 1), (-1, 0)])
def test_bad_seed_lists_are_refused(seeds_):
    with pytest.raises(ValueError, match="seed"):
        SweepSettings(models=("circuit",), train_seeds=seeds_)


def test_parse_seeds():
    assert parse_seeds("0,1, 2") == (0, 1, 2)
    for bad in ("", " ", "0,x", "1.5", "1,,2", "1,", ",1", "0,1,0", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def _per_seed():
    return pd.DataFrame(
        dict(
            model=["a", "a", "a", "b"],
            train_seed=[0, 1, 2, 0],
            absolute_acc=[1, 1, 2, 1],
            absolute_r2=[1, -1, 1, 3],
            relative_pairs_r2=[0, 0, 0, 1],
            relative_score_r2=[2, 2, 2, -1],
            relative_content_qk_r2=[2, 3, 2, math.nan],
            best_absolute_r2=[0.9, 0.95, 1.0, 0.5],
            variance_slope_block0=[-1.0, -0.9, -1.1, math.nan],
        )
    )


def test_over_seeds_agreed_layer_per_seed_layers_mean_and_spread():
    summary = seeds.over_seeds(_per_seed()).set_index("model")
    a = summary.loc["a"]
    assert a["n_seeds"] == 3
    assert (a["absolute_acc"], a["absolute_acc_per_seed"]) == (2, "1/1/2"), "all seeds agree only from layer 2"
    assert (a["absolute_r2"], a["absolute_r2_per_seed"]) == (-1, "1/-1/1"), "one seed never recovers it"
    assert (a["relative_content_qk_r2"], a["relative_content_qk_r2_per_seed"]) == (3, "2/3/2")
    assert math.isnan(summary.loc["b", "relative_content_qk_r2"]), "no site for that read: n/a, not a layer"
    assert a["best_absolute_r2"] == pytest.approx(0.95)
    assert a["best_absolute_r2_seed_sd"] == pytest.approx(0.05)
    assert math.isnan(summary.loc["b", "best_absolute_r2_seed_sd"]), "one seed has no spread"


def test_summary_table_shows_agreed_and_per_seed_layers_and_mean_plus_minus_sd():
    table = report.summary_table(seeds.over_seeds(_per_seed()))
    row = table.iloc[0]
    assert row["abs. index acc ≥ 0.9"] == "2 (1/1/2)"
    assert row["abs. index R² ≥ 0.9"] == "none (1/none/1)"
    assert row["best abs. R²"] == "0.95 ± 0.050"
    assert table.iloc[1]["abs. index R² ≥ 0.9"] == "3"
    assert table.iloc[1][report.summary_headers()["relative_content_qk_r2"]] == "n/a"


def test_probes_over_seeds_mean_spread_and_ci():
    rows = pd.DataFrame(
        dict(
            model="a",
            site="s",
            layer=1,
            metric="r2",
            probe="linear",
            train_seed=[0, 1, 2],
            value=[0.8, 0.9, 1.0],
            ci_low=[0.7, 0.8, 0.9],
            ci_high=[0.85, 0.95, 1.0],
            selectivity=0.1,
        )
    )
    table = seeds.probes_over_seeds(rows)
    assert len(table) == 1
    row = table.iloc[0]
    assert row["value"] == pytest.approx(0.9) and row["seed_sd"] == pytest.approx(0.1)
    assert (row["seed_min"], row["seed_max"], row["n_seeds"]) == (0.8, 1.0, 3)
    assert row["ci_low"] == pytest.approx(0.8) and row["ci_high"] == pytest.approx(0.9333333)


@pytest.mark.slow
def test_train_seeds_train_once_per_seed(tmp_path):
    from nopelens.analyses.cli import main
    from nopelens.models.checkpoint import read_metadata

    common = [
        "train",
        "--task",
        "copy",
        "--steps",
        "2",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--batch-size",
        "4",
        "--max-len",
        "3",
        "--quiet",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main([*common, "--seeds", "0,1"]) == 0
    assert [read_metadata(tmp_path / f"seed{s}" / "checkpoint")["seed"] for s in (0, 1)] == [0, 1]
    assert main([*common, "--seeds", "0", "--seed", "3"]) == 2


def test_sink_ablation_over_seeds_means_and_a_status_every_seed_shares():
    rows = pd.DataFrame(
        dict(
            model="a",
            block=[0, 0, 1, 1],
            train_seed=[0, 1, 0, 1],
            r2_clean=[0.9, 0.7, 0.5, 0.5],
            r2_ablated=[0.5, 0.5, 0.4, math.nan],
            drop=[0.4, 0.2, 0.1, math.nan],
            status=["measured", "measured", "measured", "not_applicable"],
        )
    )
    table = seeds.sink_ablation_over_seeds(rows).set_index("block")
    assert table.loc[0, "r2_clean"] == pytest.approx(0.8) and table.loc[0, "drop"] == pytest.approx(0.3)
    assert list(table["status"]) == ["measured", "not_applicable"]
