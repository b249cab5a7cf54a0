"""`nopelens dynamics` (issue 21): log-spaced checkpoints of a zoo recipe's own run, measured with the
sweep's probes; the answers it gives; resuming; the CLI."""

import dataclasses

import pandas as pd
import pytest
import torch

from nopelens.analyses import dynamics
from nopelens.analyses.cli import main
from nopelens.analyses.cli.dynamics import render
from nopelens.models import zoo
from nopelens.models.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tiny_bb(monkeypatch):
    """A Bigram-Backcopy recipe small enough to train in a second."""
    base = zoo.recipe("bb-rope-2l")
    spec = dataclasses.replace(
        base,
        name="tiny-bb",
        config=base.config.replace(n_layers=1, d_model=16, n_ctx=21),
        steps=20,
        train_kwargs=dict(batch_size=8, min_len=20, max_len=20, lr=3e-3),
    )
    monkeypatch.setitem(zoo.RECIPES, "tiny-bb", spec)
    return spec


def test_checkpoint_steps_are_log_spaced_from_the_initialization():
    assert dynamics.checkpoint_steps(4000, 12)[:4] == [0, 1, 2, 5] and dynamics.checkpoint_steps(4000, 12)[-1] == 4000
    assert dynamics.checkpoint_steps(3, 12) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        dynamics.checkpoint_steps(10, 1)


def test_run_keeps_the_recipes_own_weights_measures_every_checkpoint_and_resumes(tiny_bb, tmp_path, monkeypatch):
    settings = dynamics.DynamicsSettings("tiny-bb", n_checkpoints=3, n_sequences=8, n_boot=10, n_splits=3)
    table = dynamics.run(settings, tmp_path, progress=False)
    steps = dynamics.checkpoint_steps(20, 3)
    assert sorted(table["step"].unique()) == steps
    last = load_checkpoint(dynamics.step_dir(tmp_path, "checkpoints", 20)).model.state_dict()
    again = tiny_bb.train(progress=False).model.state_dict()  # snapshots do not change the run
    assert all(torch.equal(t, again[k]) for k, t in last.items())
    first = load_checkpoint(dynamics.step_dir(tmp_path, "checkpoints", 0)).model.state_dict()
    from nopelens.models import Decoder

    init = Decoder(tiny_bb.config, seed=tiny_bb.seed).state_dict()
    assert all(torch.equal(t, init[k]) for k, t in first.items())
    measures = set(table["measure"])
    assert {
        "absolute_r2",
        "score_read_r2",
        "sink_rate",
        "validation_loss",
        "backcopy_accuracy",
        "first_mass",
        "previous_mass",
    } <= measures
    sink = table[table["measure"] == "sink_rate"]
    assert (sink["ci_low"] <= sink["value"]).all() and (sink["value"] <= sink["ci_high"]).all()
    assert (tmp_path / "dynamics.csv").is_file() and not (tmp_path / "summary.md").exists()
    assert "# tiny-bb through training" in render(table, "tiny-bb", tmp_path)  # the CLI's rendering
    for name in ("summary.md", "dynamics.png"):
        assert (tmp_path / name).is_file()
    # resuming: nothing is trained or measured again
    monkeypatch.setattr(zoo.Recipe, "train", lambda *a, **k: pytest.fail("trained again"))
    monkeypatch.setattr(dynamics, "measure_step", lambda *a, **k: pytest.fail("measured again"))
    pd.testing.assert_frame_equal(dynamics.run(settings, tmp_path, progress=False), table)
    with pytest.raises(ValueError, match="other settings"):
        dynamics.run(dataclasses.replace(settings, n_boot=11), tmp_path, progress=False)


def table_of(rows):
    frame = pd.DataFrame(rows)
    return frame.reindex(columns=dynamics.TABLE_COLUMNS)


def test_first_steps_answers_known_tables():
    rows = []
    for step, r2, rate_low, loss in (
        (0, 0.1, 0.0, 4.0),
        (10, 0.95, 0.0, 3.0),
        (100, 0.97, 0.2, 1.2),
        (1000, 0.98, 0.3, 1.0),
    ):
        rows += [
            dict(step=step, measure="absolute_r2", layer=1, value=r2, ci_low=r2 - 0.02, ci_high=r2 + 0.02),
            dict(step=step, measure="sink_rate", value=rate_low + 0.1, ci_low=rate_low, ci_high=rate_low + 0.2),
            dict(step=step, measure="validation_loss", value=loss),
        ]
    answers = dynamics.first_steps(table_of(rows))
    # R² CI low 0.93 >= 0.9 first at step 10; 90 % of the 4.0 -> 1.0 drop (loss <= 1.3) first at step 100
    assert answers["absolute_r2"] == {1: 10} and answers["learned"] == 100 and answers["sink"] == 100
    assert "from step 100, at the same checkpoint as the task is learned" in dynamics.summary_markdown(
        table_of(rows), "m"
    )
    never = [dict(r, ci_low=0.0) if r["measure"] == "sink_rate" else r for r in rows]
    assert dynamics.first_steps(table_of(never))["sink"] is None


def test_cli_quick_and_bad_input(tmp_path, capsys, monkeypatch, tiny_bb):
    assert (
        main(
            [
                "dynamics",
                "tiny-bb",
                "--quick",
                "--checkpoints",
                "2",
                "--n-sequences",
                "6",
                "--n-boot",
                "10",
                "--out",
                str(tmp_path / "run"),
                "--quiet",
            ]
        )
        == 0
    )
    assert "tiny-bb through training" in capsys.readouterr().out
    assert main(["dynamics", "no-such-model", "--out", str(tmp_path / "x")]) == 2
    assert "unknown zoo model" in capsys.readouterr().err
    assert main(["dynamics", "tiny-bb", "--checkpoints", "1", "--out", str(tmp_path / "y")]) == 2
