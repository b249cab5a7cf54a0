"""Checkpoints: a directory of safetensors weights plus a JSON description. Nothing is unpickled.

A checkpoint directory holds

- ``nopelens.json``: the format marker, the decoder config, the task, training lengths, steps,
  seed, final losses, the nopelens version, and the sha256 of every other file;
- ``model.safetensors``: the model's ``state_dict`` (TransformerLens weight names); its header's
  metadata holds the sha256 of ``nopelens.json``'s description (everything but the weights' own
  sha256), so an edited JSON (a changed ``config.position`` or ``step``, a removed checksum) is
  refused. Checkpoints written before that digest existed carry none and load as before;
- ``loss_curve.csv`` (optional): one row per training step;
- ``training_state.safetensors`` (optional, unfinished runs): AdamW moments, to resume exactly.

Writing is atomic: the files go into a temporary sibling directory that then replaces the target
with ``os.replace``, so a reader sees the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from nopelens import __version__

from .config import DecoderConfig
from .decoder import Decoder
from .io import file_sha256, umask
from .tasks import TASKS, make_task

FORMAT = "nopelens-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "nopelens.json"
WEIGHTS_FILE = "model.safetensors"
LOSS_CURVE_FILE = "loss_curve.csv"
TRAINING_STATE_FILE = "training_state.safetensors"
DESCRIPTION_DIGEST = "nopelens_description_sha256"
"""Key in ``model.safetensors``'s header metadata: :func:`description_digest` of ``nopelens.json``."""


@dataclass
class TrainedModel:
    """A decoder with what is known about how it was made.

    Attributes:
        model: the decoder.
        metadata: the checkpoint's JSON dict (``config``, ``task``, ``train_lengths``, ``steps``,
            ``seed``, ``final_losses``, ``nopelens_version``, ...).
        loss_curve: one row per training step (``step``, ``loss``, ``lr``, ...); may be empty.
    """

    model: Decoder
    metadata: dict[str, Any] = field(default_factory=dict)
    loss_curve: pd.DataFrame = field(default_factory=pd.DataFrame)

    def __post_init__(self) -> None:
        spec = self.metadata.get("task")
        if getattr(self.model, "tokenizer", None) is None and isinstance(spec, dict):
            self.model.set_tokenizer(getattr(TASKS.get(spec.get("name")), "tokenizer", None))

    @property
    def config(self) -> DecoderConfig:
        return self.model.cfg

    @property
    def task(self):
        """The task the model was trained on, rebuilt from ``metadata["task"]``.

        Raises:
            KeyError: if the metadata names no task.
        """
        if "task" not in self.metadata:
            raise KeyError("this model's metadata names no task")
        spec = self.metadata["task"]
        return make_task(spec["name"], **spec.get("kwargs", {}))


def save_checkpoint(
    directory: str | Path,
    trained_or_model: TrainedModel | Decoder,
    metadata: dict[str, Any] | None = None,
    training_state: dict[str, Tensor] | None = None,
) -> Path:
    """Write a checkpoint directory atomically.

    Args:
        directory: the checkpoint directory; created, or replaced if it already is a checkpoint.
        trained_or_model: a :class:`TrainedModel` (its metadata and loss curve are written too) or
            a bare :class:`Decoder`.
        metadata: JSON-ready entries to add (they override the ``TrainedModel``'s). ``format``,
            ``format_version``, ``nopelens_version``, ``config`` and ``sha256`` are set here.
        training_state: extra tensors needed to resume training (optimizer moments).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: if ``directory`` exists and is not a nopelens checkpoint (it is never
            overwritten), or if the metadata is not JSON-serializable.
        TypeError: if ``trained_or_model`` is neither a TrainedModel nor a Decoder.
    """
    if isinstance(trained_or_model, TrainedModel):
        model, meta, curve = trained_or_model.model, dict(trained_or_model.metadata), trained_or_model.loss_curve
    elif isinstance(trained_or_model, Decoder):
        model, meta, curve = trained_or_model, {}, pd.DataFrame()
    else:
        raise TypeError(f"expected a TrainedModel or a Decoder, got {type(trained_or_model).__name__}")
    meta.update(metadata or {})
    meta.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        nopelens_version=__version__,
        config=model.cfg.to_dict(),
        dtype=str(model.embed.W_E.dtype).removeprefix("torch."),
    )
    target = Path(directory)
    if not may_hold_checkpoint(target):
        raise ValueError(f"{target} exists and is not a nopelens checkpoint; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp makes it 0o700; give what mkdir would
        files = []
        if training_state:
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in training_state.items()}, staging / TRAINING_STATE_FILE
            )
            files.append(TRAINING_STATE_FILE)
        if len(curve):
            curve.to_csv(staging / LOSS_CURVE_FILE, index=False)
            files.append(LOSS_CURVE_FILE)
        meta["sha256"] = {name: file_sha256(staging / name) for name in files}
        try:
            described = json.loads(json.dumps(meta))  # the description as read back: lists, string keys
        except TypeError as error:
            raise ValueError(f"checkpoint metadata is not JSON-serializable: {error}") from None
        # the weights go last: their header seals the description, and their own sha256 is then added to it
        state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
        save_file(state, staging / WEIGHTS_FILE, metadata={DESCRIPTION_DIGEST: description_digest(described)})
        files.append(WEIGHTS_FILE)
        meta["sha256"][WEIGHTS_FILE] = file_sha256(staging / WEIGHTS_FILE)
        text = json.dumps(described | {"sha256": meta["sha256"]}, indent=2, sort_keys=True)
        (staging / METADATA_FILE).write_text(text + "\n", encoding="utf-8")
        for name in files:  # safetensors writes owner-only files; give what open() would
            os.chmod(staging / name, 0o666 & ~umask())
        _swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def may_hold_checkpoint(path: Path) -> bool:
    """Whether a checkpoint may be written at ``path``: nothing there, an empty folder, or a checkpoint."""
    return not path.exists() or path.is_dir() and ((path / METADATA_FILE).exists() or not any(path.iterdir()))


def description_digest(meta: dict[str, Any]) -> str:
    """The sha256 of a checkpoint's JSON description: every entry but the weights' own sha256
    (which cannot describe itself), serialized canonically (sorted keys, no spaces, integral
    numbers as integers), so a tool that only reformats the file keeps it valid.

    Args:
        meta: the checkpoint's JSON dict, as :func:`json.loads` gives it.

    Returns:
        64 hex digits.

    Example:
        >>> a = {"step": 3, "sha256": {"model.safetensors": "ab"}}
        >>> description_digest(a) == description_digest({**a, "sha256": {"model.safetensors": "cd"}})
        True
        >>> description_digest(a) == description_digest({**a, "step": 4})
        False
        >>> description_digest(a) == description_digest({**a, "step": 3.0})  # one JSON number
        True
    """
    digests = {name: value for name, value in meta.get("sha256", {}).items() if name != WEIGHTS_FILE}
    described = _canonical_numbers({**meta, "sha256": digests})
    return hashlib.sha256(json.dumps(described, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _canonical_numbers(value: Any) -> Any:
    """``value`` with every integral float as an int: JSON has one number type, and tools that
    rewrite a file (jq, JavaScript) write ``10000.0`` as ``10000``, which Python reads as an int."""
    if isinstance(value, dict):
        return {key: _canonical_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_canonical_numbers(item) for item in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _check_description(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a ``nopelens.json`` edited after the checkpoint was written (its digest differs from the
    one the weights' header records); a checkpoint without the digest (older) passes."""
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        return  # named by the loader that needs the weights
    try:
        with safe_open(weights, framework="pt") as handle:
            recorded = (handle.metadata() or {}).get(DESCRIPTION_DIGEST)
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"checkpoint {path}: {WEIGHTS_FILE} is corrupted ({error})") from None
    if recorded is not None and recorded != description_digest(meta):
        raise ValueError(
            f"checkpoint {path}: {METADATA_FILE} was edited after the checkpoint was written (its "
            f"description no longer matches the digest sealed in {WEIGHTS_FILE}); restore it or retrain"
        )


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is moved aside first, then deleted."""
    if not target.exists():
        os.replace(staging, target)
        return
    retired = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(target, retired)
    try:
        os.replace(staging, target)
    except BaseException:  # e.g. Ctrl-C between the two renames: put the old checkpoint back
        if not target.exists():
            os.replace(retired, target)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def checkpoint_dir(path: str | Path) -> Path:
    """``path``, or its ``checkpoint/`` subfolder when ``path`` is a training run folder.

    ``nopelens train --out RUN`` writes its checkpoint to ``RUN/checkpoint``; users pass either.
    """
    path = Path(path)
    inner = path / "checkpoint"
    if not (path / METADATA_FILE).exists() and (inner / METADATA_FILE).is_file():
        return inner
    return path


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The JSON of a checkpoint directory, after checking it is a nopelens checkpoint.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if it is not a nopelens checkpoint (no or unreadable ``nopelens.json``, wrong
            format marker, a newer format version). An edited JSON is refused by the loaders
            (:func:`load_checkpoint`, :func:`load_training_state`), which read the weights' header.
    """
    path = checkpoint_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a nopelens checkpoint: a checkpoint is a directory holding "
            f"{WEIGHTS_FILE} and {METADATA_FILE}"
        )
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a nopelens checkpoint: it has no {METADATA_FILE}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (
        UnicodeDecodeError,
        ValueError,
        RecursionError,
    ) as error:  # JSONDecodeError, a 4300-digit integer, deep nesting
        raise ValueError(
            f"{meta_path} is corrupted (not valid JSON: {type(error).__name__}: {str(error)[:200]})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path} is not a nopelens checkpoint: format marker is {found!r}, expected {FORMAT!r}")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format version {version!r}; this nopelens reads up to {FORMAT_VERSION}"
        )
    digests = meta.get("sha256", {})
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise ValueError(f"{meta_path} is corrupted: 'sha256' must map file names to hex digests, got {digests!r:.80}")
    if not isinstance(meta.get("config"), dict):
        raise ValueError(
            f"{meta_path} is corrupted: 'config' must be a dict of DecoderConfig fields, got {meta.get('config')!r:.80}"
        )
    return meta


def _verify_file(path: Path, name: str, meta: dict[str, Any]) -> None:
    file = path / name
    if not file.is_file():
        raise ValueError(f"checkpoint {path} is missing {name}")
    expected = meta.get("sha256", {}).get(name)
    if expected is None:
        raise ValueError(f"checkpoint {path} records no sha256 for {name}; it was not written by save_checkpoint")
    if file_sha256(file) != expected:
        raise ValueError(f"checkpoint {path}: {name} is corrupted (its sha256 differs from the one recorded)")


def _load_tensors(path: Path, name: str, meta: dict[str, Any]) -> dict[str, Tensor]:
    _verify_file(path, name, meta)
    try:
        return load_file(path / name)
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"checkpoint {path}: {name} is corrupted ({error})") from None


def check_state_dict(model: Decoder, tensors: dict[str, Tensor], source: str = "checkpoint") -> None:
    """Refuse weights that do not fit ``model``: missing or extra tensors, wrong shapes or dtypes.

    Raises:
        ValueError: naming the missing, extra, mis-shaped, non-float or non-finite tensors.
    """
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        parts = [f"{what} tensors {names}" for what, names in (("missing", missing), ("extra", extra)) if names]
        raise ValueError(f"{source} does not match its config: " + "; ".join(parts))
    wrong = [
        f"{name}: config gives {expected[name]}, weights have {tuple(tensors[name].shape)}"
        for name in sorted(expected)
        if tuple(tensors[name].shape) != expected[name]
    ]
    if wrong:
        raise ValueError(f"{source}: config shapes do not match the weights: " + "; ".join(wrong))
    not_float = sorted(name for name, t in tensors.items() if not t.dtype.is_floating_point)
    if not_float:
        raise ValueError(f"{source}: tensors {not_float} are not floating point")
    not_finite = sorted(name for name, t in tensors.items() if not bool(torch.isfinite(t).all()))
    if not_finite:
        raise ValueError(f"{source}: tensors {not_finite} hold NaN or Inf")


def load_checkpoint(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> TrainedModel:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: the checkpoint directory, or the training run folder holding it as ``checkpoint/``.
        device: where to put the model (default CPU).
        dtype: parameter dtype of the loaded model; default the dtype the weights were saved in
            (that of ``embed.W_E``), so a bfloat16 model comes back bfloat16. Another dtype casts
            the weights (e.g. ``torch.float32`` to compute in full precision).

    Returns:
        A :class:`TrainedModel` in eval mode, with the loss curve if the checkpoint has one.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if it is not a nopelens checkpoint, a file is corrupted (bad JSON, sha256
            mismatch, unreadable safetensors), the JSON was edited after the checkpoint was written
            (:func:`description_digest`), the config is invalid, or tensors are missing, extra, or
            shaped differently from what the config gives.
    """
    path = checkpoint_dir(path)
    meta = read_metadata(path)
    try:
        config = DecoderConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"checkpoint {path} has an invalid config: {error}") from None
    tensors = _load_tensors(path, WEIGHTS_FILE, meta)
    _check_description(path, meta)
    if dtype is None:
        saved = tensors.get("embed.W_E")
        dtype = saved.dtype if saved is not None and saved.dtype.is_floating_point else torch.float32
    model = Decoder(config, dtype=dtype)
    check_state_dict(model, tensors, source=f"checkpoint {path}")
    model.load_state_dict(tensors, strict=True)
    model.to(device).eval()
    curve = pd.DataFrame()
    if LOSS_CURVE_FILE in meta.get("sha256", {}):
        _verify_file(path, LOSS_CURVE_FILE, meta)
        curve = pd.read_csv(io.StringIO((path / LOSS_CURVE_FILE).read_text(encoding="utf-8")))
    return TrainedModel(model, meta, curve)


def load_training_state(path: str | Path) -> dict[str, Tensor]:
    """The resume tensors of an unfinished run's checkpoint (empty dict if it has none).

    Raises:
        ValueError: if the checkpoint is invalid, its JSON was edited after it was written, or the
            file is corrupted.
    """
    path = Path(path)
    meta = read_metadata(path)
    _check_description(path, meta)
    if TRAINING_STATE_FILE not in meta.get("sha256", {}):
        return {}
    return _load_tensors(path, TRAINING_STATE_FILE, meta)
