"""The zoo: names, recipes, cache location, train-once-then-load, same recipe same weights."""

import dataclasses

import pytest
import torch

from nopelens.models import zoo
from nopelens.models.tasks import make_task

REQUIRED = {
    "copy-nope-3l",
    "copy-rope-3l",
    "copy-alibi-3l",
    "copy-learned-3l",
    "text-nope-4l",
    "text-rope-4l",
    "text-learned-4l",
    "text-hybrid-4l",
    "previous-token-nope-2l",
}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_names_and_recipes():
    assert REQUIRED <= set(zoo.names())
    for name in zoo.names():
        spec = zoo.recipe(name)
        assert spec.name == name
        task = spec.make_task()
        assert spec.config.d_vocab >= task.d_vocab
        assert task.seq_len(spec.train_kwargs["max_len"]) <= spec.config.n_ctx
        layers = int(name.rsplit("-", 1)[1].rstrip("l"))
        assert spec.config.n_layers == layers
        assert spec.config.position_name in name or (
            name == "text-hybrid-4l" and spec.config.position_name == "rope+nope"
        )


def test_text_twins_differ_only_in_position():
    nope, learned = zoo.recipe("text-nope-4l"), zoo.recipe("text-learned-4l")
    assert nope.config.replace(position="learned") == learned.config
    assert (nope.steps, nope.train_kwargs, nope.task_kwargs, nope.seed) == (
        learned.steps,
        learned.train_kwargs,
        learned.task_kwargs,
        learned.seed,
    )


def test_hybrid_is_the_text_recipe_with_nope_in_the_last_layer():
    hybrid, rope = zoo.recipe("text-hybrid-4l"), zoo.recipe("text-rope-4l")
    assert hybrid.config.layer_positions == ("rope", "rope", "rope", "nope")  # SmolLM3's no_rope_layers [1, 1, 1, 0]
    assert rope.config.replace(position=("rope", "rope", "rope", "nope")) == hybrid.config
    assert (hybrid.steps, hybrid.train_kwargs, hybrid.task_kwargs, hybrid.seed) == (
        rope.steps,
        rope.train_kwargs,
        rope.task_kwargs,
        rope.seed,
    )


def test_unknown_name_lists_available():
    with pytest.raises(KeyError, match="copy-nope-3l"):
        zoo.recipe("copy-nope-99l")
    with pytest.raises(KeyError, match="available"):
        zoo.load("gpt-2")


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("NOPELENS_CACHE", str(tmp_path / "env"))
    assert zoo.cache_root() == tmp_path / "env"
    assert zoo.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("NOPELENS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert zoo.cache_root() == tmp_path / "xdg" / "nopelens"
    path = zoo.model_dir("copy-nope-3l")
    assert path.parent == tmp_path / "xdg" / "nopelens" / "zoo"
    assert path.name == f"copy-nope-3l-{zoo.recipe('copy-nope-3l').digest}"


def test_digest_changes_with_the_recipe():
    spec = zoo.recipe("copy-rope-3l")
    assert dataclasses.replace(spec, steps=spec.steps + 1).digest != spec.digest
    assert dataclasses.replace(spec, seed=1).digest != spec.digest
    assert zoo.recipe("copy-rope-3l").digest == spec.digest


@pytest.fixture
def tiny_recipe(monkeypatch):
    task = make_task("repeat", n_symbols=4)
    base = zoo.recipe("copy-nope-3l")
    spec = dataclasses.replace(
        base,
        name="tiny-test",
        config=base.config.replace(d_vocab=task.d_vocab, n_layers=1, d_model=16, n_heads=2),
        task="repeat",
        task_kwargs={"n_symbols": 4},
        steps=4,
        train_kwargs=dict(batch_size=4, min_len=1, max_len=3, lr=1e-3),
    )
    monkeypatch.setitem(zoo.RECIPES, "tiny-test", spec)
    return spec


def test_first_load_trains_and_caches_then_loads(tiny_recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NOPELENS_CACHE", str(tmp_path))
    assert not zoo.is_cached("tiny-test")
    first = zoo.load("tiny-test", progress=False)
    assert "training zoo model tiny-test" in capsys.readouterr().err
    assert zoo.is_cached("tiny-test")
    assert first.metadata["zoo_name"] == "tiny-test" and first.metadata["zoo_recipe"] == tiny_recipe.digest
    second = zoo.load("tiny-test", progress=False)
    assert "loaded cached zoo model tiny-test" in capsys.readouterr().err
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(tensor, second.model.state_dict()[name])
    # same recipe, trained again from nothing: identical weights (determinism on CPU)
    again = tiny_recipe.train(progress=False)
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(tensor, again.model.state_dict()[name])


def test_load_uses_the_cache_then_the_shipped_copy_then_trains(tiny_recipe, tmp_path, capsys, monkeypatch):
    """Issue 21: with an empty cache a shipped copy is loaded without training; `shipped=False` (what
    `nopelens train --zoo` asks) trains from the recipe, and the result is the shipped copy, bit for bit."""
    checkout = tmp_path / "checkout"  # ship() writes a source checkout's models/shipped/ only
    (checkout / "models").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    monkeypatch.setattr(zoo, "SHIPPED_DIR", checkout / "models" / "shipped")
    cache, empty = tmp_path / "cache", tmp_path / "empty"
    trained = zoo.load("tiny-test", cache_dir=cache, progress=False)
    assert not zoo.is_shipped("tiny-test")
    monkeypatch.setattr(zoo, "is_cached", lambda name, cache_dir=None, seed=0: cache_dir == cache)
    assert zoo.ship("tiny-test", cache) == zoo.shipped_dir("tiny-test") and zoo.is_shipped("tiny-test")
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("trained although a shipped copy exists")

    monkeypatch.setattr(zoo.Recipe, "train", no_training)
    shipped = zoo.load("tiny-test", cache_dir=empty, progress=False)
    assert "as shipped with nopelens" in capsys.readouterr().err
    assert all(torch.equal(t, trained.model.state_dict()[k]) for k, t in shipped.model.state_dict().items())
    monkeypatch.undo()
    monkeypatch.setitem(zoo.RECIPES, "tiny-test", tiny_recipe)
    monkeypatch.setattr(zoo, "SHIPPED_DIR", checkout / "models" / "shipped")
    again = zoo.load("tiny-test", cache_dir=empty, progress=False, shipped=False)
    assert "training zoo model tiny-test" in capsys.readouterr().err
    assert zoo.compare_with_shipped(again, "tiny-test") == "tiny-test: weights bit-identical to the shipped copy"
    with torch.no_grad():
        next(again.model.parameters()).add_(1e-3)
    line = zoo.compare_with_shipped(again, "tiny-test")
    assert (
        line.startswith(
            "tiny-test: weights differ from the shipped copy by up to 0.001 (shipped copy trained with torch "
        )
        and "  " not in line
        and " ," not in line
    ), line
    # a shipped copy of an older recipe is not used
    monkeypatch.setitem(zoo.RECIPES, "tiny-test", dataclasses.replace(tiny_recipe, steps=5))
    assert not zoo.is_shipped("tiny-test")
