"""What a model spec names, read before any model is loaded: the specs of the controls and the
prefixes (``hf:``, ``constant-``), whether a training seed changes the model
(:func:`has_training_seed`), what measuring it will take (:func:`planned_work`, for the sweep's
ETA), whether its evaluation sequences have a fixed length (:func:`fixed_length`), the name the
tables give it (:func:`display_name`), and what it reads besides its settings
(:func:`input_fingerprint`, :func:`input_changes`), so a rerun can tell whether a finished part
still stands for it. :mod:`nopelens.analyses.subjects` loads the model and its evaluation batch.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

from nopelens.models import zoo
from nopelens.models.checkpoint import METADATA_FILE
from nopelens.models.hf_loading import HFInput
from nopelens.models.io import file_sha256

from .factory import FACTORY_PREFIX, factory_fingerprint
from .sweep.eta import MEASURE_OVERHEAD_TOKENS, TaskWork

CONTROL_SPECS = ("circuit", "untrained-nope", "constant-nope")
HF_PREFIX = "hf:"
CONSTANT_PREFIX = "constant-"

QUICK_BATCH = 4
"""Training batch of a quick (smoke-test) model: a few steps on a few sequences exercise training,
which is all a smoke test asks; the numbers mean nothing."""


def has_training_seed(spec: str) -> bool:
    """Whether a training seed changes the model ``spec`` names: zoo models (trained once per seed),
    ``untrained-nope`` and ``constant-*`` (their random weights). A checkpoint, an HF directory and
    the hand-set circuit are one fixed model each."""
    if spec == "untrained-nope" or spec.startswith(CONSTANT_PREFIX):
        return True
    if spec in CONTROL_SPECS or spec.startswith((HF_PREFIX, FACTORY_PREFIX)) or "/" in spec or Path(spec).exists():
        return False
    return True


def planned_work(spec: str, n_sequences: int, seq_len: int, train_seed: int = 0, quick_steps: int | None = None):
    """What measuring ``spec`` will take, before it runs, for the sweep's ETA
    (:class:`~nopelens.analyses.sweep.eta.TaskWork`): a zoo model trains first when it is not cached
    (always with ``quick_steps``); every other spec only loads or builds. The size of a checkpoint
    or HF directory is not read ahead: its work is marked not estimated.
    """
    n_layers, steps, train_work = 4, 0, 0.0
    built = spec == "circuit" or spec in CONTROL_SPECS or spec.startswith(CONSTANT_PREFIX)
    if spec.startswith((HF_PREFIX, FACTORY_PREFIX)) or (not built and ("/" in spec or Path(spec).exists())):
        return TaskWork(0, 0.0, 0.0, estimated=False)
    if spec == "circuit":
        n_layers = 2
    elif not (
        spec in CONTROL_SPECS or spec.startswith((CONSTANT_PREFIX, HF_PREFIX)) or "/" in spec or Path(spec).exists()
    ):
        recipe = zoo.recipe(spec, train_seed)
        config = recipe.config
        n_layers = config.n_layers
        if quick_steps is not None or not (zoo.is_cached(spec, seed=train_seed) or zoo.is_shipped(spec, train_seed)):
            steps = recipe.steps if quick_steps is None else quick_steps
            batch = recipe.train_kwargs.get("batch_size", 64) if quick_steps is None else QUICK_BATCH
            tokens = batch * (recipe.train_kwargs.get("max_len", 16) + 1)
            parameters = config.n_layers * 12 * config.d_model**2 + 2 * config.d_vocab * config.d_model
            train_work = float(steps) * tokens * parameters
    return TaskWork(steps, train_work, float((n_layers + 1) * (n_sequences * seq_len + MEASURE_OVERHEAD_TOKENS)))


def fixed_length(spec: str) -> str | None:
    """Why ``seq_len`` does not set the length of ``spec``'s evaluation sequences, or None.

    A model of a synthetic task (copy, Bigram-Backcopy, ...) is read on fresh samples of its task
    at its longest training length (``subjects._evaluation_batch``), so that every sequence covers
    every trained position; text models, the circuit, the controls and ``hf:DIR`` models take
    ``seq_len``. Read from the zoo recipe or the checkpoint's ``nopelens.json``, without loading
    weights (an unreadable checkpoint gives None: loading it reports the problem).
    """
    if spec in CONTROL_SPECS or spec.startswith((CONSTANT_PREFIX, HF_PREFIX, FACTORY_PREFIX)):
        return None
    if "/" in spec or Path(spec).exists():
        for meta_path in (Path(spec) / METADATA_FILE, Path(spec) / "checkpoint" / METADATA_FILE):
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                task, lengths = meta["task"]["name"], meta.get("train_lengths") or [None, None]
                break
            except (OSError, ValueError, KeyError, TypeError):
                continue
        else:
            return None
        longest = lengths[1]
    else:
        try:
            recipe = zoo.recipe(spec)
        except KeyError:
            return None  # check_spec names it
        task, longest = recipe.task, recipe.train_kwargs.get("max_len")
    if task == "text":
        return None
    trained = f" (max_len {longest})" if longest is not None else ""
    return (
        f"{spec} is a {task}-task model, read on {task} samples of its longest training length{trained}, "
        "so that every sequence covers every trained position"
    )


def input_fingerprint(spec: str, hf_input: HFInput | None = None) -> dict[str, Any] | None:
    """What a measurement of ``spec`` reads besides its settings, so that a rerun into the same run
    folder can tell whether a finished part still stands for the model and text it would read now.

    For a model in a directory (``hf:DIR``, or a nopelens checkpoint directory): each file directly
    in it that loading the model reads (:data:`MODEL_FILES`: its config, weights and tokenizer; not
    a README, nor a run folder's own files when ``--out`` is inside it), by size and modification
    time in ns (as ``make`` and ``git`` notice a change; hashing a checkpoint of hundreds of GB would
    cost minutes on every rerun). With ``--text FILE``, also the sha256 of the text. A file that
    cannot be read is left out: the measurement itself reports it. ``factory:``: its source's sha256.

    Returns:
        ``{"files": {name: [bytes, mtime_ns]}, "text_sha256": hex or absent}``; None for the zoo and
        control models (zoo weights are checked against their sha256 when loaded).
    """
    if spec.startswith(HF_PREFIX):
        directory = Path(spec[len(HF_PREFIX) :])
    elif Path(spec).is_dir():  # a nopelens checkpoint directory (subjects.resolve reads an existing path as one)
        directory = Path(spec)
    else:
        return factory_fingerprint(spec) if spec.startswith(FACTORY_PREFIX) else None
    files = {}
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        try:
            if path.is_file() and is_model_file(path.name):
                stat = path.stat()
                files[path.name] = [stat.st_size, stat.st_mtime_ns]
        except OSError:
            continue
    fingerprint: dict[str, Any] = {"files": files}
    text = hf_input.text if hf_input is not None and spec.startswith(HF_PREFIX) else None
    if text is not None:
        try:
            fingerprint["text_sha256"] = file_sha256(Path(text))
        except OSError:
            pass
    return fingerprint


MODEL_FILES = (
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "nopelens.json",
)
"""The files of a model directory that loading it reads (fnmatch patterns): an HF model's config,
weights and tokenizer, a nopelens checkpoint's metadata and weights."""


def is_model_file(name: str) -> bool:
    """Whether a file of a model directory is one loading the model reads (:data:`MODEL_FILES`).

    >>> [is_model_file(n) for n in ("model-00001-of-00002.safetensors", "tokenizer.json", "README.md", "sweep.json")]
    [True, True, False, False]
    """
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILES)


def input_changes(recorded: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """What differs between two :func:`input_fingerprint` results, in words (empty: nothing, or a
    part recorded before fingerprints existed).

    >>> before = {"config.json": [1, 5], "a.safetensors": [2, 5], "README.md": [3, 5]}
    >>> now = {"config.json": [1, 6], "b.safetensors": [2, 5], "README.md": [4, 6]}
    >>> input_changes({"files": before}, {"files": now})
    ['config.json changed', 'a.safetensors is gone', 'b.safetensors is new']
    >>> input_changes({"files": {}, "text_sha256": "00"}, {"files": {}, "text_sha256": "ff"})
    ['the --text file changed']
    """
    if recorded is None or current is None:
        return []
    # a part recorded when every file counted: only the model's files compare
    before, now = (
        {name: value for name, value in side.get("files", {}).items() if is_model_file(name)}
        for side in (recorded, current)
    )
    changes = [f"{name} changed" for name in sorted(set(before) & set(now)) if list(before[name]) != list(now[name])]
    changes += [f"{name} is gone" for name in sorted(set(before) - set(now))]
    changes += [f"{name} is new" for name in sorted(set(now) - set(before))]
    for key, what in (("text_sha256", "the --text file"), ("factory_sha256", "the factory's source file")):
        changes += [f"{what} changed"] if recorded.get(key) != current.get(key) else []
    return changes


def display_name(spec: str) -> str:
    """The name the tables give the model ``spec`` names: ``hf:`` and the directory's own name for
    an HF model (as :func:`~nopelens.analyses.subjects.resolve` names it), else the spec.

    >>> display_name("hf:/models/smol/"), display_name("hf:./smol"), display_name("text-nope-4l")
    ('hf:smol', 'hf:smol', 'text-nope-4l')
    """
    if spec.startswith(HF_PREFIX):
        return f"{HF_PREFIX}{Path(spec[len(HF_PREFIX) :]).name}"
    return spec
