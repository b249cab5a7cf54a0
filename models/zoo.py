"""A model zoo: named recipes, trained on first use and cached.

Each name maps to a fixed :class:`Recipe` (config, task, lengths, steps, optimizer settings,
seed). A training seed other than the recipe's (``load(name, seed=1)``) is the same recipe with
that seed: a model of its own, cached in its own folder. ``load(name)`` returns the cached model
if the cache holds a finished run of exactly that recipe; otherwise it trains it (resuming an
interrupted run) and caches it. The cache folder's name includes a hash of the recipe, so a
changed recipe never returns a stale model.

Cache location: ``$NOPELENS_CACHE`` if set, else ``$XDG_CACHE_HOME/nopelens`` or
``~/.cache/nopelens``; models live in its ``zoo/`` subfolder.

Shipped models: the models of the default sweep come with the package, trained from their
recipes (seed 0) and stored under ``nopelens/models/shipped/<name>-<recipe digest>/`` as
checkpoints (safetensors weights; JSON with the recipe, seed, library versions and CPU of the
run; the loss curve). ``load`` uses a shipped copy when the cache has none, so a fresh machine
measures at once; ``load(name, shipped=False)`` (``nopelens train --zoo NAME``) trains from the
recipe instead, and :func:`compare_with_shipped` says whether the result is the shipped one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .checkpoint import METADATA_FILE, TrainedModel, load_checkpoint, read_metadata
from .config import DecoderConfig
from .tasks import Task, make_task
from .text import CORPORA
from .training import train

CACHE_ENV = "NOPELENS_CACHE"
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
"""Where the package keeps its shipped zoo models (package data)."""


@dataclass(frozen=True)
class Recipe:
    """Everything that determines a zoo model.

    Attributes:
        name: the zoo name.
        description: one line for humans.
        config: the decoder config.
        task: task name (see :data:`~nopelens.models.tasks.TASKS`).
        task_kwargs: the task's keyword arguments.
        steps: optimizer steps.
        train_kwargs: keyword arguments of :func:`~nopelens.models.training.train`
            (``batch_size``, ``min_len``, ``max_len``, ``lr``, ...).
        seed: model initialization and data seed.
        threads: torch and BLAS threads it trains on (the weights depend on it; see
            :func:`~nopelens.models.training.train`). In the recipe's JSON only when it is not 1,
            so recipes from before it existed keep their digests and cache folders.
    """

    name: str
    description: str
    config: DecoderConfig
    task: str
    steps: int
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    train_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    threads: int = 1

    def make_task(self) -> Task:
        return make_task(self.task, **self.task_kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dict(
            name=self.name,
            config=self.config.to_dict(),
            task=self.task,
            task_kwargs=self.task_kwargs,
            steps=self.steps,
            train_kwargs=self.train_kwargs,
            seed=self.seed,
            **({} if self.threads == 1 else {"threads": self.threads}),
        )

    @property
    def digest(self) -> str:
        """First 10 hex digits of the sha256 of the recipe's JSON (names its cache folder)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]

    def train(self, checkpoint_dir: str | Path | None = None, progress: bool = True, callback=None) -> TrainedModel:
        """Train the recipe (resuming from ``checkpoint_dir`` if it holds an unfinished run);
        ``callback`` as in :func:`~nopelens.models.training.train` (it does not change the result)."""
        return train(
            self.config,
            self.make_task(),
            self.steps,
            seed=self.seed,
            checkpoint_dir=checkpoint_dir,
            progress=progress,
            callback=callback,
            extra_metadata={"zoo_name": self.name, "zoo_recipe": self.digest},
            threads=self.threads,
            **self.train_kwargs,
        )


TEXT_LEN, TEXT_D_MODEL, TEXT_BATCH, TEXT_STEPS = 64, 128, 16, 4000


def _copy(method: str) -> Recipe:
    task = make_task("copy", n_symbols=COPY_SYMBOLS)
    config = DecoderConfig(
        d_vocab=task.d_vocab, n_ctx=task.seq_len(2 * COPY_MAX_LEN), n_layers=3, d_model=64, n_heads=4, position=method
    )
    return Recipe(
        name=f"copy-{method}-3l",
        description=f"3-layer {method} decoder trained to copy 1-{COPY_MAX_LEN} symbols (Kazemnejad copy task)",
        config=config,
        task="copy",
        task_kwargs={"n_symbols": COPY_SYMBOLS},
        steps=COPY_STEPS,
        train_kwargs=dict(batch_size=64, min_len=1, max_len=COPY_MAX_LEN, lr=3e-3),
    )


def _text(
    method: str | tuple[str, ...],
    label: str | None = None,
    what: str | None = None,
    n_layers: int = 4,
    length: int = TEXT_LEN,
    d_model: int = TEXT_D_MODEL,
    batch: int = TEXT_BATCH,
    steps: int = TEXT_STEPS,
    corpus: str = "help",
) -> Recipe:
    config = DecoderConfig(
        d_vocab=258, n_ctx=length + 1, n_layers=n_layers, d_model=d_model, n_heads=4, position=method
    )
    return Recipe(
        name=f"text{'' if length == TEXT_LEN else length}-{label or method}-{n_layers}l",
        description=f"{n_layers}-layer {what or method} byte-level language model of {CORPORA[corpus][1]}, "
        f"{length}-byte windows",
        config=config,
        task="text",
        task_kwargs={"path": None, "validation_fraction": 0.1, **({} if corpus == "help" else {"corpus": corpus})},
        steps=steps,
        train_kwargs=dict(batch_size=batch, min_len=length, max_len=length, lr=2e-3),
    )


def _bigram_backcopy(method: str, n_layers: int) -> Recipe:
    task_kwargs = {"n_symbols": BB_SYMBOLS, "n_triggers": BB_TRIGGERS}
    task = make_task("bigram_backcopy", **task_kwargs)
    config = DecoderConfig(
        d_vocab=task.d_vocab,
        n_ctx=task.seq_len(BB_LEN),
        n_layers=n_layers,
        d_model=BB_D_MODEL,
        n_heads=1,
        position=method,
    )
    return Recipe(
        name=f"bb-{method}-{n_layers}l",
        description=f"{n_layers}-layer one-head {method} decoder trained on Bigram-Backcopy (Guo et al. 2024: "
        "bigram chain of help-text bytes, the token after a trigger copies the one before it)",
        config=config,
        task="bigram_backcopy",
        task_kwargs=task_kwargs,
        steps=BB_STEPS,
        train_kwargs=dict(batch_size=BB_BATCH, min_len=BB_LEN, max_len=BB_LEN, lr=BB_LR),
    )


COPY_METHODS = ("nope", "rope", "alibi", "learned", "t5")
TEXT_METHODS = ("nope", "rope", "learned")
HAVIV_METHODS = ("nope", "learned", "sinusoidal", "alibi", "rope")
HAVIV_LAYERS, HAVIV_LEN, HAVIV_STEPS, HAVIV_CORPUS = 6, 256, 6000, "python_docs"
"""The comparison zoo of issue 45 (Haviv et al. 2022 side by side, ``nopelens compare haviv``): five
decoders identical but for the position method, 6 layers, d_model 128, 256-byte windows, batch 16
(4,096 bytes a step, as the 4-layer text recipes), 6000 steps. Width and steps were chosen from a
measured 0.67-0.77 s per step on one thread (NoPE and ALiBi; 13 steps each at load 1.6 on the 2-core
development machine): 67-77 minutes per model, under the 90 minutes the issue allows. A 512-byte
context at the same bytes per step measured 1.3-1.7 s per step (over 2 hours): not in the zoo.

The text is CPython's help topics and standard-library docstrings (2.4 MB of training text, about
ten passes in 6000 steps). The first zoo of this recipe read the help topics alone (439 KB, 56
passes); every model failed the levelling-off rule fixed before training: the validation loss was
25-282 % above the training loss, the models had memorized their text. That in-distribution
failure, not the probes, chose the larger text; the rule, width and steps stay as they were."""
COPY_SYMBOLS, COPY_MAX_LEN, COPY_STEPS = 32, 10, 1500
HYBRID_LAYERS = ("rope", "rope", "rope", "nope")
BB_SYMBOLS, BB_TRIGGERS, BB_LEN, BB_D_MODEL, BB_BATCH, BB_STEPS, BB_LR = 64, 3, 63, 64, 32, 1500, 3e-3
BB_MODELS = (("rope", 2), ("nope", 3))
"""Bigram-Backcopy models: RoPE finds the previous token in one block; NoPE first needs a block
that makes position (Kazemnejad et al. 2023, Thm 1) before one can attend one step back."""

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        *(_copy(m) for m in COPY_METHODS),
        *(_text(m) for m in TEXT_METHODS),
        *(
            _text(m, n_layers=HAVIV_LAYERS, length=HAVIV_LEN, steps=HAVIV_STEPS, corpus=HAVIV_CORPUS)
            for m in HAVIV_METHODS
        ),
        *(_bigram_backcopy(m, n) for m, n in BB_MODELS),
        # the hybrid pattern real NoPE models ship (SmolLM3, Llama 4: NoPE in every fourth layer)
        _text(HYBRID_LAYERS, "hybrid", "hybrid (RoPE in layers 0-2, NoPE in layer 3, as SmolLM3 and Llama 4)"),
        Recipe(
            name="previous-token-nope-2l",
            description="2-layer NoPE decoder whose logits at p predict the token at p - 1",
            config=DecoderConfig(d_vocab=20, n_ctx=33, n_layers=2, d_model=64, n_heads=4, position="nope"),
            task="previous_token",
            task_kwargs={"n_symbols": 16},
            steps=400,
            train_kwargs=dict(batch_size=64, min_len=8, max_len=32, lr=3e-3),
        ),
    ]
}


def names() -> list[str]:
    """The zoo's model names, sorted."""
    return sorted(RECIPES)


def recipe(name: str, seed: int = 0) -> Recipe:
    """The recipe of a zoo model, trained with training seed ``seed`` (initialization and data).

    Raises:
        KeyError: on an unknown name; the message lists the available ones.
        ValueError: on a negative seed.
    """
    if name not in RECIPES:
        raise KeyError(f"unknown zoo model {name!r}; available: {', '.join(names())}")
    if seed < 0:
        raise ValueError(f"training seed must be >= 0, got {seed}")
    return RECIPES[name] if seed == RECIPES[name].seed else replace(RECIPES[name], seed=seed)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where the zoo caches models: ``cache_dir``, else ``$NOPELENS_CACHE``, else the user cache."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nopelens"


def model_dir(name: str, cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """The checkpoint directory of a zoo model: ``<cache>/zoo/<name>-<recipe digest>`` for training
    seed 0 (where it has always been), ``<cache>/zoo/<name>-seed<seed>-<recipe digest>`` otherwise.
    The digest covers the seed, so each seed has a folder of its own either way."""
    return cache_root(cache_dir) / "zoo" / _folder_name(name, seed)


def _folder_name(name: str, seed: int) -> str:
    label = name if seed == 0 else f"{name}-seed{seed}"
    return f"{label}-{recipe(name, seed).digest}"


def is_cached(name: str, cache_dir: str | Path | None = None, seed: int = 0) -> bool:
    """True when the cache holds a finished run of ``name``'s current recipe with training seed ``seed``."""
    return _holds_finished_run(model_dir(name, cache_dir, seed), recipe(name, seed))


def shipped_dir(name: str, seed: int = 0) -> Path:
    """Where the package keeps the shipped copy of ``name`` (training seed ``seed``), if it has one:
    ``nopelens/models/shipped/`` plus the cache folder's name."""
    return SHIPPED_DIR / _folder_name(name, seed)


def is_shipped(name: str, seed: int = 0) -> bool:
    """True when the package ships a finished run of ``name``'s current recipe with training seed ``seed``."""
    return _holds_finished_run(shipped_dir(name, seed), recipe(name, seed))


def _holds_finished_run(path: Path, spec: Recipe) -> bool:
    if not (path / METADATA_FILE).is_file():
        return False
    try:
        meta = read_metadata(path)
    except ValueError:
        return False
    return bool(meta.get("complete")) and meta.get("zoo_recipe") == spec.digest


def load(
    name: str,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    seed: int = 0,
    shipped: bool = True,
    announce: bool = True,
) -> TrainedModel:
    """The zoo model ``name``: from the cache, else the copy shipped with the package, else trained
    (and cached).

    Prints one line to stderr saying which happened (a loaded one only with ``announce``; training
    always says so).

    Args:
        name: one of :func:`names`.
        cache_dir: cache root; default ``$NOPELENS_CACHE`` or the user cache directory.
        progress: show the training progress bar.
        seed: training seed (initialization and data order); 0 is the recipe's own.
        shipped: use the shipped copy when the cache has none; False trains from the recipe.
        announce: say which copy was loaded (a command's ``--quiet`` leaves it out).

    Raises:
        KeyError: on an unknown name (the message lists the available ones).
        ValueError: if the cached or shipped checkpoint is corrupted (delete a cached folder to
            retrain; reinstall nopelens for a shipped one), or on a negative seed.
    """
    spec = recipe(name, seed)
    path = model_dir(name, cache_dir, seed)
    label = name if seed == 0 else f"{name} (seed {seed})"
    if is_cached(name, cache_dir, seed):
        trained = _load(path, f"delete {path} to retrain {name}")
        if announce:
            print(f"nopelens: loaded cached zoo model {label} from {path}", file=sys.stderr)
        return trained
    if shipped and is_shipped(name, seed):
        trained = _load(shipped_dir(name, seed), "reinstall nopelens, or train it with `nopelens train --zoo`")
        # no retrain hint: `nopelens train --help` has it, and this line stays within 100 columns
        if announce:
            print(f"nopelens: loaded zoo model {label} as shipped with nopelens", file=sys.stderr)
        return trained
    print(f"nopelens: training zoo model {label} ({spec.steps} steps); it will be cached in {path}", file=sys.stderr)
    return spec.train(checkpoint_dir=path, progress=progress)


def _load(path: Path, remedy: str) -> TrainedModel:
    try:
        return load_checkpoint(path)
    except ValueError as error:
        raise ValueError(f"{error}; {remedy}") from None


def compare_with_shipped(trained: TrainedModel, name: str, seed: int = 0) -> str:
    """One line: whether ``trained`` (a run of ``name``'s recipe) has the shipped copy's weights.

    Bit-identical weights are expected on the CPU (model, family and vector instructions), torch
    version and thread count the shipped copy records (its ``environment``); elsewhere the order of
    floating-point sums may differ, and the line gives the largest weight difference.
    """
    if not is_shipped(name, seed):
        return f"no shipped copy of {name} (seed {seed}) to compare with"
    shipped = load_checkpoint(shipped_dir(name, seed))
    ours, theirs = trained.model.state_dict(), shipped.model.state_dict()
    largest = max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in theirs)
    if largest == 0:
        return f"{name}: weights bit-identical to the shipped copy"
    env = shipped.metadata.get("environment", {})
    cpu = " ".join(str(env[key]) for key in ("cpu", "cpu_family", "cpu_capability") if env.get(key)) or "?"
    return (
        f"{name}: weights differ from the shipped copy by up to {largest:.3g} (shipped copy trained with "
        f"torch {env.get('torch', '?')} on {cpu}, {env.get('torch_threads', '?')} thread(s); the order of "
        f"floating-point sums differs between CPUs)"
    )


def check_source_checkout() -> None:
    """Refuse to ship into an installed package: shipping writes ``models/shipped/`` of a source
    checkout (the folder that holds ``pyproject.toml``), never into site-packages.

    Raises:
        ValueError: if nopelens is not imported from a source checkout.
    """
    if not (SHIPPED_DIR.parent.parent / "pyproject.toml").is_file():
        raise ValueError(
            f"--ship writes into a source checkout's models/shipped/, but nopelens is imported from "
            f"{SHIPPED_DIR.parent.parent} (an installed package); install the checkout with `pip install -e .`"
        )


def ship(name: str, cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Copy the cached finished run of ``name`` into the package's shipped models (for maintainers:
    run in a source checkout after a recipe change; older shipped copies of ``name`` are removed).

    Raises:
        ValueError: if the cache holds no finished run of the current recipe, or nopelens is not
            imported from a source checkout (:func:`check_source_checkout`).
    """
    check_source_checkout()
    if not is_cached(name, cache_dir, seed):
        raise ValueError(
            f"the cache holds no finished run of {name} (seed {seed}); train it first (`nopelens train --zoo {name}`)"
        )
    target = shipped_dir(name, seed)
    label = name if seed == 0 else f"{name}-seed{seed}"
    for old in SHIPPED_DIR.glob(f"{label}-*"):
        if old.is_dir() and old.name.removeprefix(f"{label}-").isalnum():
            shutil.rmtree(old)
    shutil.copytree(model_dir(name, cache_dir, seed), target)
    return target
