"""Training: determinism, exact resume, recipe checks, the schedule, and exact-match evaluation."""

import dataclasses
import math

import pandas as pd
import pytest
import torch
from torch import nn

from nopelens.models import DecoderConfig
from nopelens.models.checkpoint import load_checkpoint
from nopelens.models.tasks import make_task
from nopelens.models.training import evaluate_exact_match, lr_at, train, validation_loss

TASK = make_task("copy", n_symbols=6)
CFG = DecoderConfig(d_vocab=TASK.d_vocab, n_ctx=TASK.seq_len(8), n_layers=1, d_model=16, n_heads=2, position="rope")
QUICK = dict(batch_size=8, min_len=1, max_len=4, lr=3e-3, progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def weights(trained):
    return {k: v.clone() for k, v in trained.model.state_dict().items()}


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_same_weights_other_seed_differs():
    a = weights(train(CFG, TASK, 6, seed=5, **QUICK))
    b = weights(train(CFG, TASK, 6, seed=5, **QUICK))
    c = weights(train(CFG, TASK, 6, seed=6, **QUICK))
    assert same_weights(a, b)
    assert not same_weights(a, c)


def test_interrupted_run_resumes_to_identical_weights(tmp_path):
    full = train(CFG, TASK, 12, seed=1, **QUICK)

    def interrupt(step, loss, model):
        if step == 10:
            raise KeyboardInterrupt

    ckpt = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(CFG, TASK, 12, seed=1, checkpoint_dir=ckpt, checkpoint_every=4, callback=interrupt, **QUICK)
    partial = load_checkpoint(ckpt)
    assert partial.metadata["step"] == 8 and partial.metadata["complete"] is False
    assert (ckpt / "training_state.safetensors").exists()

    seen = []
    resumed = train(
        CFG,
        TASK,
        12,
        seed=1,
        checkpoint_dir=ckpt,
        checkpoint_every=4,
        callback=lambda step, loss, model: seen.append(step),
        **QUICK,
    )
    assert seen == [9, 10, 11, 12]
    assert same_weights(weights(full), weights(resumed))
    pd.testing.assert_series_equal(full.loss_curve["loss"], resumed.loss_curve["loss"])
    assert list(resumed.loss_curve["step"]) == list(range(1, 13))

    finished = load_checkpoint(ckpt)
    assert finished.metadata["complete"] is True and not (ckpt / "training_state.safetensors").exists()
    # a finished run is returned as it is, without training again
    again = train(CFG, TASK, 12, seed=1, checkpoint_dir=ckpt, callback=lambda *a: pytest.fail("trained again"), **QUICK)
    assert same_weights(weights(again), weights(full))


def test_checkpoint_of_another_recipe_is_refused(tmp_path):
    ckpt = tmp_path / "run"
    train(CFG, TASK, 2, seed=0, checkpoint_dir=ckpt, **QUICK)
    with pytest.raises(ValueError, match="different recipe.*seed"):
        train(CFG, TASK, 2, seed=1, checkpoint_dir=ckpt, **QUICK)
    with pytest.raises(ValueError, match="different recipe.*steps"):
        train(CFG, TASK, 3, seed=0, checkpoint_dir=ckpt, **QUICK)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="not a nopelens checkpoint"):
        train(CFG, TASK, 2, checkpoint_dir=foreign, **QUICK)


def test_metadata_and_loss_curve_csv(tmp_path):
    trained = train(CFG, TASK, 5, seed=0, out_dir=tmp_path, **QUICK)
    meta = trained.metadata
    assert meta["task"] == {"name": "copy", "kwargs": {"n_symbols": 6}}
    assert meta["train_lengths"] == [1, 4] and meta["steps"] == 5 and meta["seed"] == 0
    assert set(meta["final_losses"]) == {"train", "validation"}
    curve = pd.read_csv(tmp_path / "loss_curve.csv")
    assert list(curve["step"]) == [1, 2, 3, 4, 5]
    assert curve["loss"].tolist() == pytest.approx(trained.loss_curve["loss"].tolist())
    # the first step's loss of a fresh model is near ln(d_vocab) (uniform predictions)
    assert abs(curve["loss"].iloc[0] - math.log(TASK.d_vocab)) < 0.3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "steps"),
        (dict(max_len=9), "n_ctx"),
        (dict(min_len=3, max_len=2), "min_len"),
        (dict(lr=-1.0), "lr"),
    ],
)
def test_bad_arguments(kwargs, match):
    cfg = CFG.replace(position="learned")
    args = dict(QUICK, **{k: v for k, v in kwargs.items() if k != "steps"})
    with pytest.raises(ValueError, match=match):
        train(cfg, TASK, kwargs.get("steps", 2), **args)


def test_vocab_too_small():
    with pytest.raises(ValueError, match="d_vocab"):
        train(CFG.replace(d_vocab=5), TASK, 2, **QUICK)


def test_schedule_warmup_then_cosine_to_floor():
    rates = [lr_at(s, 100, 1e-3, 10, 0.1) for s in range(100)]
    assert rates[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(rates[:9], rates[1:10]))
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    assert rates[-1] == pytest.approx(1e-4, rel=0.01) and min(rates[10:]) >= 1e-4


class Oracle(nn.Module):
    """Predicts the next token from the (teacher-forced) input; optionally wrong at one position."""

    def __init__(self, d_vocab, wrong_from_end=None):
        super().__init__()
        self.d_vocab, self.wrong_from_end = d_vocab, wrong_from_end
        self.dummy = nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.dummy.device

    def forward(self, tokens):
        nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1).clone()
        if self.wrong_from_end is not None:
            nxt[:, -self.wrong_from_end - 1] = (nxt[:, -self.wrong_from_end - 1] + 1) % self.d_vocab
        return torch.nn.functional.one_hot(nxt, self.d_vocab).float() * 10


def test_exact_match_counts_whole_answers():
    task = make_task("copy", n_symbols=6)
    perfect = evaluate_exact_match(Oracle(task.d_vocab), task, [1, 3, 5], n=20)
    assert perfect["exact_match"].tolist() == [1.0, 1.0, 1.0]
    assert perfect["token_accuracy"].tolist() == [1.0, 1.0, 1.0]
    assert perfect["in_distribution"].isna().all()
    # wrong on the last scored token (EOS): every answer fails, token accuracy n/(n+1)
    flawed = evaluate_exact_match(Oracle(task.d_vocab, wrong_from_end=1), task, [1, 3, 5], n=20)
    assert flawed["exact_match"].tolist() == [0.0, 0.0, 0.0]
    assert flawed["token_accuracy"].tolist() == pytest.approx([1 / 2, 3 / 4, 5 / 6])


def test_exact_match_default_lengths_from_metadata():
    trained = train(CFG, TASK, 2, seed=0, **QUICK)
    table = evaluate_exact_match(trained, TASK, n=4)
    assert table["length"].tolist() == list(range(1, 9))
    assert table["in_distribution"].tolist() == [True] * 4 + [False] * 4
    with pytest.raises(ValueError, match="lengths"):
        evaluate_exact_match(trained.model, TASK)


def test_text_validation_loss_covers_the_validation_stream():
    task = make_task("text")
    cfg = DecoderConfig(d_vocab=258, n_ctx=65, n_layers=1, d_model=16, n_heads=2)
    model = train(cfg, task, 1, batch_size=2, min_len=64, max_len=64, progress=False).model
    loss = validation_loss(model, task, 64, 64)
    assert abs(loss - math.log(258)) < 0.5  # an almost untrained model is near uniform


@pytest.mark.slow
def test_previous_token_is_learned_by_a_two_layer_nope_model():
    task = make_task("previous_token", n_symbols=8)
    cfg = DecoderConfig(d_vocab=task.d_vocab, n_ctx=17, n_layers=2, d_model=32, n_heads=2, position="nope")
    trained = train(cfg, task, 150, batch_size=32, min_len=4, max_len=16, lr=1e-2, progress=False)
    assert trained.metadata["final_losses"]["validation"] < 0.2 < trained.loss_curve["loss"].iloc[0]


def test_train_command_writes_checkpoint_and_reports(tmp_path, capsys):
    from nopelens.analyses.cli import main

    args = [
        "train",
        "--task",
        "repeat",
        "--steps",
        "3",
        "--out",
        str(tmp_path),
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--max-len",
        "3",
        "--batch-size",
        "4",
        "--quiet",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "exact match" in out and "on training lengths" in out
    assert load_checkpoint(tmp_path / "checkpoint").metadata["steps"] == 3
    assert len(pd.read_csv(tmp_path / "loss_curve.csv")) == 3
    assert main(["train", "--list"]) == 0
    assert "previous-token-nope-2l" in capsys.readouterr().out
    assert main(["train", "--task", "copy"]) == 2  # --out missing: a one-line user error
    assert "--out" in capsys.readouterr().err


def test_train_command_reads_the_built_in_corpus_it_is_given(tmp_path, capsys):
    from nopelens.analyses.cli import main

    small = ["--steps", "1", "--layers", "1", "--d-model", "16", "--heads", "2", "--max-len", "8", "--quiet"]
    assert main(["train", "--task", "text", "--corpus", "python_docs", "--out", str(tmp_path / "docs"), *small]) == 0
    task = load_checkpoint(tmp_path / "docs" / "checkpoint").metadata["task"]
    assert task == {"name": "text", "kwargs": {"path": None, "validation_fraction": 0.1, "corpus": "python_docs"}}
    for bad, said in (
        (["--task", "copy", "--corpus", "python_docs"], "--corpus only applies to --task text"),
        (["--task", "text", "--corpus", "python_docs", "--text-file", "x.txt"], "not both"),
        (["--task", "text", "--corpus", "help", "--text-file", "x.txt"], "not both"),
    ):
        capsys.readouterr()
        assert main(["train", *bad, "--out", str(tmp_path / "bad"), *small]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_training_runs_on_one_thread_by_default_and_the_count_is_part_of_the_recipe(tmp_path):
    """Issue 23: "same recipe and seed, same weights" holds as written: the thread count, which the
    weights depend on, is 1 unless the recipe says otherwise, and a checkpoint made with another count
    is not resumed."""
    from nopelens.analyses.cli import build_parser
    from nopelens.models import zoo

    torch.set_num_threads(2)  # what torch would use on a 2-core machine
    seen = []
    trained = train(
        CFG,
        TASK,
        2,
        seed=0,
        checkpoint_dir=tmp_path / "one",
        callback=lambda step, loss, model: seen.append(torch.get_num_threads()),
        **QUICK,
    )
    assert seen == [1, 1] and trained.metadata["torch_threads"] == 1
    assert torch.get_num_threads() == 2, "the caller's thread count is restored"
    assert "threads" not in trained.metadata, "1 thread is the recipe's default: old checkpoints still resume"
    with pytest.raises(ValueError, match="differs in threads"):
        train(CFG, TASK, 2, seed=0, checkpoint_dir=tmp_path / "one", threads=2, **QUICK)
    two = train(CFG, TASK, 2, seed=0, threads=2, **QUICK)
    assert two.metadata["threads"] == 2 and two.metadata["torch_threads"] == 2

    with pytest.raises(ValueError, match=r"differs in task\.kwargs\.n_symbols\)"):
        train(CFG, make_task("copy", n_symbols=5), 2, seed=0, checkpoint_dir=tmp_path / "one", **QUICK)

    recipe = zoo.recipe("text-nope-4l")
    assert recipe.threads == 1 and "threads" not in recipe.to_dict(), "zoo digests and cache folders unchanged"
    assert dataclasses.replace(recipe, threads=2).digest != recipe.digest
    for argv in (["train", "--task", "copy", "--out", "x"], ["lengthgen"]):
        assert build_parser(argv).parse_args(argv).threads == 1, argv
    from nopelens.analyses.cli import main

    assert main(["train", "--zoo", "text-nope-4l", "--threads", "2"]) == 2, "a zoo recipe fixes its thread count"
