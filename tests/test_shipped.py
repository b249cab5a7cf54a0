"""The zoo models shipped inside the package (issue 21): present for the current recipes, described,
packaged, used on a fresh machine, and reproduced by retraining from the recipe."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nopelens.analyses.haviv import HAVIV_MODELS
from nopelens.analyses.sweep import DEFAULT_MODELS
from nopelens.models import zoo
from nopelens.models.checkpoint import load_checkpoint, read_metadata
from nopelens.models.training import environment

SHIPPED = (*DEFAULT_MODELS["text"], *HAVIV_MODELS)
"""The default sweep's models and the Haviv comparison zoo (issue 45): no command they run trains."""
REPO = Path(__file__).resolve().parents[1]
CURVE_STEPS = 100
pytestmark = pytest.mark.usefixtures("one_thread")


def same_environment(meta: dict) -> bool:
    """Bitwise reproduction is promised on the CPU (model name, family and the vector instructions
    torch uses), torch and thread count the shipped run records; a copy that does not record one of
    them is compared within round-off."""
    here = environment()
    return all(
        meta["environment"].get(key) == here[key]
        for key in ("torch", "cpu", "cpu_family", "cpu_capability", "machine", "torch_threads")
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_every_default_model_ships_for_its_current_recipe(name):
    assert zoo.is_shipped(name), f"{name}: no shipped copy of the current recipe; `nopelens train --zoo {name} --ship`"
    meta = read_metadata(zoo.shipped_dir(name))
    spec = zoo.recipe(name)
    assert (meta["zoo_recipe"], meta["seed"], meta["steps"], meta["complete"]) == (spec.digest, 0, spec.steps, True)
    assert meta["config"] == spec.config.to_dict() and meta["task"]["name"] == spec.task
    assert {"torch", "numpy", "python", "cpu"} <= set(meta["environment"]) and meta["train_seconds"] > 0
    trained = load_checkpoint(zoo.shipped_dir(name))
    assert len(trained.loss_curve) == spec.steps and trained.loss_curve["step"].tolist()[:2] == [1, 2]


def test_only_current_recipes_ship_and_the_size_is_small():
    folders = sorted(p for p in zoo.SHIPPED_DIR.iterdir() if p.is_dir())
    assert [p.name for p in folders] == sorted(zoo.shipped_dir(name).name for name in SHIPPED)
    size = sum(f.stat().st_size for p in folders for f in p.iterdir())
    assert size < 48e6, f"shipped models take {size / 1e6:.1f} MB"  # 12 MB + 5 x 5.3 MB as trained


def test_pyproject_packages_every_shipped_file():
    """`pip install .` (not editable) copies package data only where pyproject lists it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["nopelens.models"]
    package = REPO / config["tool"]["setuptools"]["package-dir"]["nopelens.models"]
    listed = {p.relative_to(package) for pattern in patterns for p in package.glob(pattern)}
    source = package / "shipped"  # the checkout's, whether nopelens is installed editable or not
    files = {f.relative_to(package) for p in source.iterdir() if p.is_dir() for f in p.iterdir()}
    assert files and files == listed
    installed = {
        f.relative_to(zoo.SHIPPED_DIR.parent) for p in zoo.SHIPPED_DIR.iterdir() if p.is_dir() for f in p.iterdir()
    }
    assert installed == files  # what the imported package holds is what the checkout ships


def test_an_empty_cache_loads_the_shipped_models_without_training(tmp_path, monkeypatch, capsys):
    def no_training(*args, **kwargs):
        raise AssertionError("trained although the model ships")

    monkeypatch.setattr(zoo.Recipe, "train", no_training)
    for name in SHIPPED:
        trained = zoo.load(name, cache_dir=tmp_path, progress=False)
        assert trained.metadata["zoo_recipe"] == zoo.recipe(name).digest
    assert capsys.readouterr().err.count("as shipped with nopelens") == len(SHIPPED)
    assert not any(tmp_path.iterdir())  # nothing was trained into the cache


class _Stop(Exception):
    pass


def first_losses(spec, steps: int) -> list[float]:
    """The recipe's own run (same total steps, so the same schedule), stopped after ``steps`` steps."""
    losses = []

    def record(step, loss, model):
        losses.append(loss)
        if step == steps:
            raise _Stop

    with pytest.raises(_Stop):
        spec.train(progress=False, callback=record)
    return losses


@pytest.mark.slow  # training: 3-7 s a recipe
@pytest.mark.parametrize("name", ["text-nope-4l", "bb-rope-2l", "bb-nope-3l"])
def test_retraining_the_first_100_steps_reproduces_the_recorded_loss_curve(name):
    """The recorded curve is the recipe's: exactly on the shipped run's CPU and torch, within float
    round-off of a different sum order elsewhere. (text-rope-4l and text-hybrid-4l share the text
    recipe's code path; 100 of their steps cost 12 s each and are left to the slow test's CPU time.)"""
    shipped = load_checkpoint(zoo.shipped_dir(name))
    recorded = shipped.loss_curve["loss"].to_numpy()[:CURVE_STEPS]
    ours = np.array(first_losses(zoo.recipe(name), CURVE_STEPS))
    if same_environment(shipped.metadata):
        assert np.array_equal(ours, recorded)
    else:
        np.testing.assert_allclose(ours, recorded, rtol=1e-3)
    assert ours[-1] < ours[0] - 0.5  # it learned: a curve that cannot fail to match is no test


@pytest.mark.slow
def test_retraining_a_shipped_model_fully_gives_its_weights():
    """bb-rope-2l (the cheapest shipped recipe, about 90 CPU s): bit-identical weights on the shipped
    run's CPU, torch and thread count; elsewhere the same extreme-token summary within 0.02 (attention
    masses) and the same validation loss within 1e-3 nats."""
    name = "bb-rope-2l"
    shipped = load_checkpoint(zoo.shipped_dir(name))
    ours = zoo.recipe(name).train(progress=False)
    if same_environment(shipped.metadata):
        for key, tensor in shipped.model.state_dict().items():
            assert torch.equal(tensor, ours.model.state_dict()[key]), key
        assert zoo.compare_with_shipped(ours, name) == f"{name}: weights bit-identical to the shipped copy"
        return
    from nopelens.analyses.extreme_tokens import measure
    from nopelens.analyses.subjects import from_trained

    tables = [measure(from_trained(t, name, 40, 64), n_boot=0)["heads"] for t in (shipped, ours)]
    for column in ("first_mass", "previous_mass"):
        np.testing.assert_allclose(tables[0][column], tables[1][column], atol=0.02)
    assert math.isclose(
        shipped.metadata["final_losses"]["validation"], ours.metadata["final_losses"]["validation"], abs_tol=1e-3
    )


def test_ship_refuses_an_installed_package_before_training(tmp_path, monkeypatch, capsys):
    """``train --zoo NAME --ship`` writes a source checkout's models/shipped/; imported from an
    installed package (no pyproject.toml two levels up) it refuses in one line, before training."""
    from nopelens.analyses.cli import main

    installed = tmp_path / "site-packages" / "nopelens" / "models" / "shipped"
    installed.mkdir(parents=True)
    monkeypatch.setattr(zoo, "SHIPPED_DIR", installed)
    monkeypatch.setattr(zoo, "load", lambda *args, **kwargs: pytest.fail("trained before refusing"))
    assert main(["train", "--zoo", "bb-rope-2l", "--ship", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "installed package" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="source checkout"):
        zoo.ship("bb-rope-2l", tmp_path / "cache")
