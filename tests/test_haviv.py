"""``nopelens compare haviv`` (issue 45): the paper's values, the side-by-side run, its refusals."""

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
from schema import assert_folder_documented

from nopelens.analyses import haviv_paper as paper
from nopelens.analyses.cli import main
from nopelens.analyses.haviv import HAVIV_MODELS, claims, first_layer_at
from nopelens.analyses.haviv_figure import context_sentence
from nopelens.models import zoo
from nopelens.models.checkpoint import load_checkpoint
from nopelens.models.tasks import TextTask
from nopelens.probes import mad_chance

VERDICTS = {"reproduced", "direction only", "not reproduced", "not measured"}


def test_the_papers_values_are_its_released_data_with_their_source():
    # the paper's chance is L / 3 (continuous uniform), ours (L^2 - 1) / (3L): 3e-4 apart at L = 1024
    assert paper.PAPER_CHANCE_MAD == pytest.approx(1024 / 3, abs=1e-4) == pytest.approx(mad_chance(1024), abs=1e-3)
    nope = paper.paper_curve("nope")
    # the numbers the issue quotes from the released probe data: 0.99, 0.84, 0.23, 0.08, 0.05
    assert np.round(nope["mad_chance"][:5], 2).tolist() == [0.99, 0.84, 0.23, 0.08, 0.05]
    assert nope["depth"].iloc[-1] == 1 and len(nope) == paper.PAPER_LAYERS + 1
    assert paper.paper_curve("alibi")["mad_chance"].min() == pytest.approx(0.154, abs=5e-4)
    assert paper.paper_curve("rope") is None  # the paper trained no RoPE model: nothing invented
    table = paper.paper_table()
    assert table["source"].str.startswith(paper.REPOSITORY).all()
    ppl = table[table["quantity"] == "perplexity"].set_index(["dataset", "method"])["value"]
    assert ppl[("the_pile", "nope")] > ppl[("the_pile", "learned")] > ppl[("the_pile", "alibi")]


def test_the_comparison_zoo_differs_only_in_the_position_method():
    recipes = [zoo.recipe(name) for name in HAVIV_MODELS]
    assert [r.config.position for r in recipes] == list(zoo.HAVIV_METHODS)
    assert {r.config.n_layers for r in recipes} == {6} and {r.config.n_ctx for r in recipes} == {257}
    plain = [(r.config.to_dict() | {"position": None}, r.steps, r.train_kwargs, r.task_kwargs, r.seed) for r in recipes]
    assert all(entry == plain[0] for entry in plain)


def test_first_layer_and_context_sentence():
    curve = pd.DataFrame(dict(layer=[0, 1, 2, 3], ci_high=[1.0, 0.2, 0.09, 0.05]))
    assert first_layer_at(curve) == 2 and first_layer_at(curve, 0.01) == -1
    context = pd.DataFrame(dict(probe="mlp", measured=True, length=[64, 128, 256], first_layer=[1, 2, 3]))
    assert "moves deeper" in context_sentence(context)
    assert "does not move with" in context_sentence(context.assign(first_layer=2))
    assert "comes earlier" in context_sentence(context.assign(first_layer=[-1, 2, 2]))  # none: past the last layer
    assert "moves deeper" in context_sentence(context.assign(first_layer=[2, 3, -1]))
    assert "not move monotonically" in context_sentence(context.assign(first_layer=[2, 1, 3]))


def test_quick_run_writes_every_table_and_resumes(tmp_path, capsys, one_thread):
    args = ["compare", "haviv", "--quick", "--models", "text-nope-4l", "--contexts", "16", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "## Claims" in out and "Only one window length" not in out
    table = pd.read_csv(tmp_path / "haviv.csv")
    assert set(table["source"]) == {"nopelens", "haviv2022"}
    ours = table[table["source"] == "nopelens"]
    assert set(ours["probe"]) == {"ridge", "mlp"} and set(ours["n_positions"]) == {17, 65}
    fits = ours.groupby(["n_positions", "probe", "layer"])["fit"].agg(sorted)
    assert all(fit == ["control", "linear", "shuffled"] for fit in fits)  # each probe with both controls
    assert "control task: ridge / MLP" in (tmp_path / "haviv.md").read_text()
    floors = ours.groupby("probe")["floor"].first()
    assert floors["ridge"] == pytest.approx(3 * 65**2 / (4 * (65**2 - 1)), abs=0.01) and floors["mlp"] == 1
    assert (ours["n_sequences"] == 12).all()  # the kept sample, said in every row
    written = pd.read_csv(tmp_path / "haviv.csv", dtype=str)
    assert set(written["n_sequences"].dropna()) == {"12"} and set(written["n_train_seeds"].dropna()) == {"1"}
    assert (
        (tmp_path / "summary.md").read_text().startswith("**Quick mode (`--quick`)")
    )  # its numbers are a smoke test's
    loss = pd.read_csv(tmp_path / "losses.csv").iloc[0]
    unseen = TextTask().windows(64, "unseen")  # the documents none of whose 64-byte strings is in training
    assert loss["unseen_bytes"] == unseen.loss_mask.sum() and 0 < loss["unseen_bits_per_byte"] < 8
    assert loss["unseen_bits_per_byte"] > loss["bits_per_byte"]  # mostly copied text is the easier
    claims_table = pd.read_csv(tmp_path / "claims.csv")
    assert len(claims_table) == 5 and all(v.split(":")[0] in VERDICTS for v in claims_table["verdict"])
    training = pd.read_csv(tmp_path / "training.csv")
    curve = load_checkpoint(zoo.shipped_dir("text-nope-4l")).loss_curve  # 4000 steps: a 66-step window
    assert set(training["window"]) == {66} and training["step"].iloc[-1] == 4000 and len(training) <= 301
    last_66 = curve["loss"].iloc[-66:].mean() / np.log(2)
    assert training["train_bits_per_byte"].iloc[-1] == pytest.approx(last_66)
    assert (
        training.loc[training["tenth"] == "last", "step"].min()
        > 3600
        >= training.loc[training["tenth"] == "before", "step"].max() - 400
    )  # the rule's two tenths, marked
    for name in ("losses.csv", "context.csv", "haviv.md", "summary.md", "haviv.png", "haviv.svg", "training.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert_folder_documented(tmp_path, "compare haviv")
    assert main(args) == 0  # a rerun reads the finished parts back
    assert "already measured" in capsys.readouterr().out
    assert pd.read_csv(tmp_path / "haviv.csv").equals(table)
    # a model added to the folder: the finished parts are read back, only the new one is probed
    assert main([*args[:4], "text-nope-4l,text-rope-4l", *args[5:]]) == 0
    out = capsys.readouterr().out
    assert out.count("already measured") == 2 and "text-rope-4l at 64 bytes: probed" in out
    both = pd.read_csv(tmp_path / "haviv.csv")
    assert set(both["model"].dropna()) >= {"text-nope-4l", "text-rope-4l"}
    pd.testing.assert_frame_equal(
        both[both["model"] == "text-nope-4l"].reset_index(drop=True),
        table[table["model"] == "text-nope-4l"].reset_index(drop=True),
    )


@pytest.mark.slow
def test_worker_processes_give_the_same_tables(tmp_path, capsys):
    args = ["compare", "haviv", "--quick", "--models", "text-nope-4l", "--contexts", "16", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--out", str(tmp_path / "two"), "--jobs", "2"]) == 0
    for name in ("haviv.csv", "context.csv", "claims.csv"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert main([*args, "--out", str(tmp_path / "three"), "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err and not (tmp_path / "three").exists()


def test_untrained_zoo_and_bad_input_are_one_line_and_exit_2(tmp_path, capsys):
    missing = [name for name in HAVIV_MODELS if not (zoo.is_cached(name) or zoo.is_shipped(name))]
    if missing:
        assert main(["compare", "haviv", "--out", str(tmp_path / "zoo")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"nopelens train --zoo {missing[0]}" in err
        assert not (tmp_path / "zoo").exists()
    assert main(["compare", "haviv", "--quick", "--models", "circuit", "--out", str(tmp_path / "c")]) == 2
    assert "not a text model" in capsys.readouterr().err and not (tmp_path / "c").exists()
    assert (
        main(["compare", "haviv", "--quick", "--models", "text-nope-4l,text-nope-4l", "--out", str(tmp_path / "d")])
        == 2
    )
    assert "lists text-nope-4l twice" in capsys.readouterr().err and not (tmp_path / "d").exists()
    for args in (["compare", "haviv", "--contexts", "a,b"], ["compare", "nobody"]):
        with pytest.raises(SystemExit) as exit:
            main(args)
        assert exit.value.code == 2
    capsys.readouterr()
    quick = ["compare", "haviv", "--quick", "--models", "text-nope-4l"]
    for extra, said in (
        (["--contexts", "16,16"], "lists a length twice"),
        (["--n-sequences", str(10**20)], "at most 10,000,000 windows"),
    ):
        assert main([*quick, *extra, "--out", str(tmp_path / "e")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err and not (tmp_path / "e").exists()
    shutil.copytree(zoo.shipped_dir("text-nope-4l"), tmp_path / "x" / "ck")
    shutil.copytree(zoo.shipped_dir("text-rope-4l"), tmp_path / "x_ck")
    for models, said in (
        (f"{tmp_path}/x/ck,{tmp_path}/x_ck", "would share the part folder"),
        (f"text-nope-4l,{tmp_path}/x/ck", "both use nope positions"),  # each claim reads one curve per method
    ):
        assert main(["compare", "haviv", "--quick", "--models", models, "--out", str(tmp_path / "f")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err and not (tmp_path / "f").exists()


def test_a_part_of_another_or_changed_model_or_with_a_damaged_record_is_not_reused(tmp_path, capsys, one_thread):
    shutil.copytree(zoo.shipped_dir("text-nope-4l"), tmp_path / "ck")
    args = ["compare", "haviv", "--quick", "--models", str(tmp_path / "ck"), "--contexts", "16", "--quiet"]
    out = ["--out", str(tmp_path / "run")]
    assert main([*args, *out]) == 0
    table = pd.read_csv(tmp_path / "run" / "haviv.csv")
    part = next((tmp_path / "run" / "parts").glob("*-L16")) / "done.json"
    record = json.loads(part.read_text())
    del record["reads_positions"]
    part.write_text(json.dumps(record))  # valid JSON, a field gone
    capsys.readouterr()
    assert main([*args, *out]) == 0
    assert "lacks reads_positions" in capsys.readouterr().err
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "run" / "haviv.csv"), table)
    weights = tmp_path / "ck" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # retrained in place
    assert main([*args, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was measured on other files" in err and "model.safetensors changed" in err


def test_claims_without_models_say_not_measured():
    empty = pd.DataFrame(
        columns=["source", "probe", "fit", "model", "n_positions", "method", "layer", "mad_chance", "ci_low", "ci_high"]
    )
    verdicts = claims(empty, pd.DataFrame(columns=["model", "method", "reads_positions", "bits_per_byte"]))["verdict"]
    assert (verdicts == "not measured").all()


def test_the_loss_claim_is_judged_on_unseen_text_and_says_which_models_were_not_trained_enough():
    empty = pd.DataFrame(
        columns=["source", "probe", "fit", "model", "n_positions", "method", "layer", "mad_chance", "ci_low", "ci_high"]
    )

    def verdict(nope_all, nope_unseen, trained=(True, True), unseen_bytes=100, corpus=("help", "help")):
        loss = pd.DataFrame(
            dict(
                model=["a", "b"],
                method=["nope", "learned"],
                reads_positions=[False, True],
                bits_per_byte=[nope_all, 1.0],
                unseen_bits_per_byte=[nope_unseen, 2.0] if unseen_bytes else [np.nan, np.nan],
                unseen_bytes=unseen_bytes,
                trained_enough=list(trained),
                corpus=corpus,
            )
        )
        return claims(empty, loss).set_index("claim")["verdict"].iloc[-1]

    assert verdict(1.02, 2.04) == "reproduced"  # NoPE worst by 2 % on unseen text
    assert verdict(1.50, 1.90) == "not reproduced: NoPE is not the worst"  # the whole validation set is not judged
    assert verdict(1.50, 3.00).startswith("direction only")
    assert verdict(1.02, np.nan, unseen_bytes=0) == "reproduced"  # no unseen text: every validation byte
    assert verdict(1.02, 2.04, trained=(True, False)) == (
        "reproduced (learned: not trained to the levelling-off rule, see losses.csv)"
    )
    assert verdict(1.02, 2.04, corpus=("help", "mine.txt")) == "not measured: the losses are of different text"


def test_each_panel_is_drawn_in_its_method_colour():
    """Issue 49: one fixed colour per position method in every figure, this one's panels included."""
    from matplotlib.colors import to_hex

    from nopelens.analyses.haviv_figure import PAPER_COLOR, haviv_figure
    from nopelens.analyses.palette import method_color

    rows = [
        dict(
            source="nopelens",
            fit="linear",
            n_positions=65,
            model=f"m-{method}",
            method=method,
            probe=probe,
            depth=layer / 2,
            mad_chance=0.5,
            ci_low=0.4,
            ci_high=0.6,
            floor=floor,
        )
        for method in ("rope", "nope")
        for probe, floor in (("ridge", 0.75), ("mlp", 1.0))
        for layer in range(3)
    ]
    rows.append(dict(source="haviv2022", method="nope", depth=0.0, mad_chance=0.99))
    figure = haviv_figure(pd.DataFrame(rows))
    for ax, method in zip(figure.axes, ("rope", "nope")):
        drawn = {to_hex(line.get_color()) for line in ax.lines} - {to_hex(PAPER_COLOR)}
        assert drawn == {to_hex(method_color(method))} and ax.title.get_color() == method_color(method)
    assert method_color("rope") != method_color("nope")


def test_over_training_seeds_is_the_mean_with_a_ci_over_the_runs_and_the_shared_windows():
    from nopelens.analyses.haviv import over_training_seeds

    point = dict(source="nopelens", model="m", method="nope", probe="mlp", fit="linear", n_positions=65, layer=1)
    point.update(n_layers=4, depth=0.25, floor=1.0, n_sequences=12, n_sequences_drawn=12, reference="measured")
    seeds = pd.DataFrame(
        [
            {**point, "train_seed": s, "mad": 2 * v, "chance": 2.0, "mad_chance": v, "ci_low": v - w, "ci_high": v + w}
            for s, (v, w) in enumerate([(0.1, 0.02), (0.2, 0.03), (0.3, 0.04)])
        ]
    )
    row = over_training_seeds(seeds).iloc[0]
    runs = 4.302653 * 0.1 / np.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    half = np.hypot(runs, 0.03)  # and the seeds' mean bootstrap half-width, in quadrature
    assert row["mad_chance"] == pytest.approx(0.2) and row["mad"] == pytest.approx(0.4)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((0.2 - half, 0.2 + half), abs=1e-6)
    assert row["n_train_seeds"] == 3 and row["ci_over"] == "training runs and windows" and "train_seed" not in row
    one = over_training_seeds(seeds.iloc[:1]).iloc[0]  # one seed: its own row and bootstrap CI
    assert (one["mad_chance"], one["ci_low"], one["ci_high"]) == pytest.approx((0.1, 0.08, 0.12))
    assert one["ci_over"] == "windows"
    # seeds that agree: the windows' CI, not one of width 0 (their windows are the same windows)
    same = over_training_seeds(seeds.assign(mad_chance=0.3, ci_low=0.25, ci_high=0.35)).iloc[0]
    assert (same["ci_low"], same["ci_high"]) == pytest.approx((0.25, 0.35))


def test_training_seeds_are_parts_of_their_own_averaged_in_the_tables(tmp_path, capsys, monkeypatch, one_thread):
    """--seeds 0,1: each seed of a zoo model is measured as its own part; haviv.csv holds the mean
    with a CI over the runs, seeds.csv each seed, context.csv each seed's first layer; a checkpoint
    (one trained model) is refused with --seeds, and an untrained seed is named."""
    import dataclasses

    base = zoo.recipe("text-nope-4l")
    tiny = dataclasses.replace(
        base,
        name="tiny-text",
        config=base.config.replace(n_layers=1, d_model=16, n_heads=2, n_ctx=33),
        steps=3,
        train_kwargs=dict(batch_size=2, min_len=32, max_len=32, lr=1e-3),
    )
    monkeypatch.setitem(zoo.RECIPES, "tiny-text", tiny)
    monkeypatch.setenv("NOPELENS_CACHE", str(tmp_path / "zoo"))
    args = ["compare", "haviv", "--quick", "--models", "tiny-text", "--contexts", "16", "--quiet"]
    assert main([*args, "--seeds", "0,1", "--out", str(tmp_path / "run")]) == 2
    assert "tiny-text, tiny-text (seed 1): not trained yet" in capsys.readouterr().err
    for seed in (0, 1):
        zoo.load("tiny-text", seed=seed, progress=False)
    assert main([*args, "--seeds", "0,1", "--out", str(tmp_path / "run")]) == 0
    parts = sorted(p.name for p in (tmp_path / "run" / "parts").iterdir())
    assert parts == ["tiny-text-L16", "tiny-text-L32", "tiny-text-seed1-L16", "tiny-text-seed1-L32"]
    seeds = pd.read_csv(tmp_path / "run" / "seeds.csv")
    ours = pd.read_csv(tmp_path / "run" / "haviv.csv").query("source == 'nopelens'")
    assert len(seeds) == 2 * len(ours) and (ours["n_train_seeds"] == 2).all()
    assert (ours["ci_over"] == "training runs and windows").all()
    means = seeds.groupby(["probe", "fit", "n_positions", "layer"])["mad_chance"].mean()
    got = ours.set_index(["probe", "fit", "n_positions", "layer"])["mad_chance"]
    pd.testing.assert_series_equal(got.sort_index(), means.sort_index(), check_names=False)
    context = pd.read_csv(tmp_path / "run" / "context.csv", dtype={"seed_first_layers": str})
    assert all(len(each.split()) == 2 for each in context.loc[context["measured"], "seed_first_layers"])
    assert set(pd.read_csv(tmp_path / "run" / "losses.csv")["train_seed"]) == {0, 1}
    assert_folder_documented(tmp_path / "run", "compare haviv")
    # parts from before training seeds (no train_seed) are read back as seed 0's, not measured again
    from nopelens.analyses.runs import read_part, write_part

    for name in ("tiny-text-L16", "tiny-text-L32"):
        part = tmp_path / "run" / "parts" / name
        tables, meta = read_part(part, ["probes"])
        meta.pop("train_seed")
        write_part(part, {"probes": tables["probes"].drop(columns="train_seed")}, meta)
    capsys.readouterr()
    assert main([*args[:-1], "--seeds", "0,1", "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.count("already measured") == 4
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "run" / "seeds.csv"), seeds)
    reread = pd.read_csv(tmp_path / "run" / "context.csv", dtype={"seed_first_layers": str})
    pd.testing.assert_frame_equal(reread, context)
    checkpoint = str(zoo.model_dir("tiny-text"))
    assert main([*args, "--models", checkpoint, "--seeds", "0,1", "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "is not one (a checkpoint is one trained model)" in err and not (tmp_path / "ck").exists()
