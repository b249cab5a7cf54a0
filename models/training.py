"""Training: AdamW, linear warmup then cosine decay, gradient clipping, resumable checkpoints.

Determinism: the model is initialized from ``seed`` and the batch of step t is sampled from a
generator seeded with (seed, t), so a run resumed from a checkpoint (weights plus AdamW moments)
sees the same batches and ends with the same weights as an uninterrupted run, on CPU.

Right padding never reaches a real token under a causal mask (a pad sits after every real token
of its row), so training and evaluation run without an attention mask; the logits at real
positions are the same as with one, and the fused attention kernel stays usable.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from .checkpoint import (
    METADATA_FILE,
    TrainedModel,
    load_checkpoint,
    load_training_state,
    may_hold_checkpoint,
    read_metadata,
    save_checkpoint,
)
from .config import DecoderConfig
from .decoder import Decoder
from .io import write_csv_atomic
from .progress import progress_bar
from .tasks import Batch, Task, TextTask
from .threads import limited_threads

TRAIN_STREAM, EVAL_STREAM, VALIDATION_STREAM = 0, 1, 2

__all__ = [
    "TrainedModel",
    "train",
    "evaluate_exact_match",
    "validation_loss",
    "lr_at",
    "stream_seed",
]


def stream_seed(seed: int, stream: int, index: int) -> int:
    """A 63-bit seed for item ``index`` of random stream ``stream`` of a run seeded ``seed``.

    Uses numpy's ``SeedSequence``, so nearby (seed, stream, index) triples give unrelated seeds.

    Example:
        >>> stream_seed(0, 0, 1) == stream_seed(0, 0, 1) != stream_seed(0, 0, 2)
        True
    """
    state = np.random.SeedSequence([seed, stream, index]).generate_state(1, np.uint64)[0]
    return int(state) & (2**63 - 1)


def lr_at(step: int, steps: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning rate at ``step`` (0-based): linear warmup, then cosine decay to ``min_lr_ratio * lr``.

    Warmup goes ``lr * (step + 1) / warmup_steps``; afterwards
    ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2`` with ``t`` the fraction of the decay phase
    done (nanoGPT's schedule, Loshchilov & Hutter 2017).

    Example:
        >>> [round(lr_at(s, 10, 1.0, 2, 0.1), 3) for s in (0, 1, 2, 9)]
        [0.5, 1.0, 1.0, 0.134]
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, steps - warmup_steps)
    progress = (step - warmup_steps) / decay_steps
    min_lr = min_lr_ratio * lr
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _masked_loss(logits: Tensor, batch: Batch) -> Tensor:
    return F.cross_entropy(logits[batch.loss_mask], batch.targets[batch.loss_mask])


def _param_groups(model: Decoder, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and tables (ndim >= 2), none on biases and norm weights (nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    return {
        f"adamw.{index}.{key}": torch.as_tensor(value)
        for index, state in optimizer.state_dict()["state"].items()
        for key, value in state.items()
    }


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor]) -> None:
    state_dict = optimizer.state_dict()
    state: dict[int, dict[str, Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    n_params = sum(len(g["params"]) for g in state_dict["param_groups"])
    if state and sorted(state) != list(range(n_params)):
        raise ValueError(f"the checkpoint's optimizer state covers {len(state)} parameters, the model has {n_params}")
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


def _normalized(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def _check_lengths(task: Task, config: DecoderConfig, min_len: int, max_len: int) -> None:
    if not task.min_length <= min_len <= max_len:
        raise ValueError(f"need {task.min_length} <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if config.d_vocab < task.d_vocab:
        raise ValueError(f"config.d_vocab={config.d_vocab} is smaller than task {task.name!r}'s d_vocab={task.d_vocab}")
    if isinstance(task, TextTask):  # the validation loss after the last step reads whole windows of max_len
        task.windows(max_len, split="validation", max_windows=1)
    if config.max_positions is not None and task.seq_len(max_len) > config.max_positions:
        raise ValueError(
            f"a {task.name} sequence of length {max_len} has {task.seq_len(max_len)} tokens, more than "
            f"the learned position table's n_ctx={config.max_positions}"
        )


def train(
    config: DecoderConfig,
    task: Task,
    steps: int,
    *,
    batch_size: int = 64,
    min_len: int = 1,
    max_len: int = 16,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.1,
    grad_clip: float = 1.0,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    callback: Callable[[int, float, Decoder], None] | None = None,
    extra_metadata: dict[str, Any] | None = None,
    threads: int = 1,
    desc: str | None = None,
) -> TrainedModel:
    """Train a :class:`Decoder` on ``task``.

    The batch of step t holds ``batch_size`` sequences with lengths uniform in
    ``[min_len, max_len]``, sampled from a generator seeded with ``stream_seed(seed, 0, t)``. The
    loss is the mean cross-entropy (nats) over the scored positions (``Batch.loss_mask``).

    Args:
        config: the model's configuration.
        task: a :class:`~nopelens.models.tasks.Task`.
        steps: number of optimizer steps, >= 1.
        batch_size: sequences per step.
        min_len: the smallest training problem size (see the task's docstring).
        max_len: the largest training problem size.
        lr: peak learning rate of AdamW (betas 0.9, 0.95).
        weight_decay: decoupled weight decay on matrices and tables.
        warmup_steps: linear warmup length; default 5 % of ``steps``.
        min_lr_ratio: the cosine decay ends at ``min_lr_ratio * lr``.
        grad_clip: maximum global gradient norm.
        seed: initializes the model and seeds every batch.
        checkpoint_dir: if given, the run is checkpointed there every ``checkpoint_every`` steps
            and at the end. If it already holds this recipe's unfinished run, training resumes from
            it; if it holds this recipe's finished run, that model is returned without training.
        checkpoint_every: steps between checkpoints; default ``max(1, steps // 10)``.
        out_dir: if given, the loss curve is written to ``out_dir/loss_curve.csv``.
        progress: show a tqdm bar with the loss and tokens per second.
        callback: called as ``callback(step, loss, model)`` after each step (step counts from 1);
            it may raise (e.g. KeyboardInterrupt) to stop the run, which resumes from its last checkpoint.
        extra_metadata: JSON-ready entries added to the metadata (e.g. a zoo name).
        threads: torch and BLAS threads while training and evaluating (default 1). The weights
            depend on it (reductions split differently), so it is part of the recipe: a
            checkpoint made with another count is not resumed. (Written into the metadata's
            recipe only when it is not 1, so checkpoints from before it existed still resume.)
        desc: the progress bar's label (default ``train <task> <position method>``).

    Returns:
        A :class:`TrainedModel`; ``metadata`` holds the recipe, ``final_losses`` (``train``: mean
        of the last 10 % of steps; ``validation``: :func:`validation_loss`), ``train_seconds``.

    Raises:
        ValueError: on invalid arguments, or if ``checkpoint_dir`` holds a checkpoint of a
            different recipe (it is never overwritten).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not all(math.isfinite(value) for value in (lr, grad_clip, weight_decay)):
        raise ValueError(f"lr, grad_clip and weight_decay must be finite, got {lr}, {grad_clip}, {weight_decay}")
    too_large = torch.finfo(torch.float32).max  # the optimizer holds them next to float32 weights
    if max(abs(lr), abs(grad_clip), abs(weight_decay)) > too_large:
        raise ValueError(
            f"lr, grad_clip and weight_decay must be at most {too_large:.3g} (float32), got {lr}, "
            f"{grad_clip}, {weight_decay}"
        )
    if batch_size < 1 or lr <= 0 or grad_clip <= 0 or not 0 <= min_lr_ratio <= 1 or weight_decay < 0:
        raise ValueError(
            f"invalid hyperparameters: batch_size={batch_size}, lr={lr}, grad_clip={grad_clip}, "
            f"min_lr_ratio={min_lr_ratio}, weight_decay={weight_decay}"
        )
    _check_lengths(task, config, min_len, max_len)
    _make_folders([Path(folder) for folder in (checkpoint_dir and Path(checkpoint_dir).parent, out_dir) if folder])
    warmup_steps = max(1, steps // 20) if warmup_steps is None else warmup_steps
    checkpoint_every = max(1, steps // 10) if checkpoint_every is None else checkpoint_every
    if warmup_steps < 0 or checkpoint_every < 1:
        raise ValueError(f"warmup_steps must be >= 0 and checkpoint_every >= 1, got {warmup_steps}, {checkpoint_every}")
    hyper = dict(
        batch_size=batch_size,
        lr=lr,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        min_lr_ratio=min_lr_ratio,
        grad_clip=grad_clip,
        betas=[0.9, 0.95],
    )
    recipe = _normalized(
        dict(
            config=config.to_dict(),
            task={"name": task.name, "kwargs": task.kwargs},
            train_lengths=[min_len, max_len],
            steps=steps,
            seed=seed,
            training=hyper,
            **({} if threads == 1 else {"threads": threads}),
        )
    )
    with limited_threads(threads):
        return _train(
            config,
            task,
            steps,
            recipe,
            batch_size,
            min_len,
            max_len,
            lr,
            weight_decay,
            warmup_steps,
            min_lr_ratio,
            grad_clip,
            seed,
            checkpoint_dir,
            checkpoint_every,
            out_dir,
            progress,
            callback,
            extra_metadata,
            desc or f"train {task.name} {config.position_name}",
        )


def _train(
    config,
    task,
    steps,
    recipe,
    batch_size,
    min_len,
    max_len,
    lr,
    weight_decay,
    warmup_steps,
    min_lr_ratio,
    grad_clip,
    seed,
    checkpoint_dir,
    checkpoint_every,
    out_dir,
    progress,
    callback,
    extra_metadata,
    desc,
) -> TrainedModel:
    model = Decoder(config, seed=seed)
    optimizer = torch.optim.AdamW(_param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95))
    start, rows, seconds_before = 0, [], 0.0
    if checkpoint_dir is not None and not may_hold_checkpoint(Path(checkpoint_dir)):
        raise ValueError(f"checkpoint_dir {checkpoint_dir} exists and is not a nopelens checkpoint; refusing to use it")
    if checkpoint_dir is not None and (Path(checkpoint_dir) / METADATA_FILE).exists():
        resumed = _resume(Path(checkpoint_dir), recipe, model, optimizer, progress)
        if isinstance(resumed, TrainedModel):
            return resumed
        start, rows, seconds_before = resumed

    model.train()
    bar = progress_bar(total=steps, initial=start, disable=not progress, desc=desc, leave=False)
    clock, cpu_clock = time.perf_counter(), time.process_time()
    tokens_seen = 0
    try:
        for step in range(start, steps):
            batch = task.sample(batch_size, min_len, max_len, stream_seed(seed, TRAIN_STREAM, step))
            rate = lr_at(step, steps, lr, warmup_steps, min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = rate
            loss = _masked_loss(model(batch.tokens), batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()

            tokens_seen += batch.tokens.numel()
            elapsed = time.perf_counter() - clock
            value = loss.item()
            if not math.isfinite(value):
                raise ValueError(
                    f"training loss became {value} at step {step + 1} (lr {rate:.3g}); the run diverged, "
                    "so nothing past the last checkpoint was saved; lower --lr"
                )
            rows.append(
                dict(step=step + 1, loss=value, lr=rate, grad_norm=float(grad_norm), elapsed_s=seconds_before + elapsed)
            )
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{tokens_seen / max(elapsed, 1e-9):,.0f}")
            if callback is not None:
                callback(step + 1, value, model)
            if checkpoint_dir is not None and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
                meta = dict(recipe, step=step + 1, complete=False, **(extra_metadata or {}))
                save_checkpoint(
                    checkpoint_dir,
                    TrainedModel(model, meta, pd.DataFrame(rows)),
                    training_state=_optimizer_tensors(optimizer),
                )
    finally:
        bar.close()

    model.eval()
    curve = pd.DataFrame(rows)
    train_seconds = seconds_before + time.perf_counter() - clock
    tail = max(1, steps // 10)
    final_losses = {
        "train": float(curve["loss"].tail(tail).mean()),
        "validation": validation_loss(model, task, min_len, max_len, seed=seed, progress=progress),
    }
    meta = dict(
        recipe,
        step=steps,
        complete=True,
        final_losses=final_losses,
        train_seconds=train_seconds,
        cpu_seconds_this_session=time.process_time() - cpu_clock,
        torch_threads=torch.get_num_threads(),
        environment=environment(),
        **(extra_metadata or {}),
    )
    trained = TrainedModel(model, meta, curve)
    if checkpoint_dir is not None:
        save_checkpoint(checkpoint_dir, trained)
    if out_dir is not None:
        write_csv_atomic(curve, Path(out_dir) / "loss_curve.csv")
    return trained


def environment() -> dict[str, str]:
    """What the bitwise result of a training run depends on besides its recipe: library versions,
    the CPU and the torch thread count (floating-point sums may be ordered differently elsewhere).

    The CPU is its model name, its family and model numbers, and the vector instructions torch's
    kernels use (``torch.backends.cpu.get_cpu_capability``): a virtual machine may call several
    generations by one name ("AMD EPYC"), and AVX2 and AVX-512 kernels order their sums differently.
    """
    cpu = _cpu_info()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpu": cpu.get("model name", platform.processor() or "unknown"),
        "cpu_family": f"{cpu.get('cpu family', '?')}/{cpu.get('model', '?')}",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": str(torch.get_num_threads()),
    }


def _cpu_info() -> dict[str, str]:
    """The first processor's fields in Linux ``/proc/cpuinfo`` (empty elsewhere)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def _make_folders(folders: list[Path]) -> None:
    """Create the output folders before training, so a path blocked by a file fails at once, not at the first save."""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ValueError(f"cannot create folder {folder}: it, or a folder above it, is a file") from None


def _differing_settings(recipe: dict, meta: dict, prefix: str = "") -> list[str]:
    """The recipe's settings that ``meta`` holds otherwise, named down to the nested key (``task.kwargs.corpus``)."""
    differing = []
    for key in sorted(recipe):
        ours, theirs = recipe[key], meta.get(key)
        if isinstance(ours, dict) and isinstance(theirs, dict):
            differing += _differing_settings({**dict.fromkeys(theirs), **ours}, theirs, f"{prefix}{key}.")
        elif ours != theirs:
            differing.append(f"{prefix}{key}")
    return differing


def _resume(path: Path, recipe: dict, model: Decoder, optimizer, progress: bool):
    """Load a matching checkpoint: the finished TrainedModel, or (step, loss rows, seconds) to go on."""
    meta = read_metadata(path)
    differing = _differing_settings(recipe, meta)
    if differing:
        raise ValueError(
            f"checkpoint {path} was made by a different recipe (differs in {', '.join(differing)}); "
            "use another checkpoint directory or delete this one"
        )
    trained = load_checkpoint(path)
    if meta.get("complete"):
        if progress:
            print(f"nopelens: {path} already holds this finished run; loaded it")
        return trained
    model.load_state_dict(trained.model.state_dict())
    _restore_optimizer(optimizer, load_training_state(path))
    rows = trained.loss_curve.to_dict("records") if len(trained.loss_curve) else []
    seconds = float(rows[-1]["elapsed_s"]) if rows else 0.0
    if progress:
        print(f"nopelens: resuming {path} from step {meta['step']}")
    return int(meta["step"]), rows, seconds


@torch.no_grad()
def _scored(
    model: Decoder, batch: Batch, chunk: int = 256, progress: bool = False, desc: str = "evaluating"
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (all scored predictions right, number right, summed nats) over ``batch``."""
    exact, right, nats = [], [], []
    starts = range(0, len(batch), chunk)
    for start in progress_bar(starts, desc=desc, unit="batch", leave=False, disable=not progress or len(starts) < 2):
        tokens = batch.tokens[start : start + chunk].to(model.device)
        mask = batch.loss_mask[start : start + chunk].to(model.device)
        targets = batch.targets[start : start + chunk].to(model.device)
        logits = model(tokens).float()
        correct = (logits.argmax(-1) == targets) & mask
        loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none") * mask
        exact.append((correct.sum(-1) == mask.sum(-1)).cpu())
        right.append(correct.sum(-1).cpu())
        nats.append(loss.sum(-1).cpu())
    return torch.cat(exact), torch.cat(right), torch.cat(nats)


def validation_loss(
    model: Decoder | TrainedModel,
    task: Task,
    min_len: int,
    max_len: int,
    seed: int = 0,
    n: int = 512,
    progress: bool = False,
    split: str = "validation",
) -> float:
    """Mean cross-entropy in nats per scored token on held-out data.

    For :class:`~nopelens.models.tasks.TextTask` this is every byte of the ``split`` documents
    (``validation``, or ``unseen``: those of them that share no 64-byte string with the training
    text), in non-overlapping windows of ``max_len`` bytes (each window starts from BOS). For
    synthetic tasks it is ``n`` fresh sequences from a random stream training never uses.
    Divide by ln 2 for bits per token (per byte for text; times
    ``task.bytes_per_character()`` for bits per character). ``progress``: a bar over the batches.

    Raises:
        ValueError: on a ``split`` other than ``validation`` for a synthetic task, or as
            :meth:`~nopelens.models.tasks.TextTask.windows`.
    """
    model = model.model if isinstance(model, TrainedModel) else model
    if isinstance(task, TextTask):
        batch = task.windows(max_len, split=split)
    elif split != "validation":
        raise ValueError(f"split {split!r} is a text split; the {task.name} task has fresh validation sequences only")
    else:
        batch = task.sample(n, min_len, max_len, stream_seed(seed, VALIDATION_STREAM, 0))
    was_training = model.training
    model.eval()
    _, _, nats = _scored(model, batch, progress=progress, desc="validation loss")
    model.train(was_training)
    return float(nats.sum() / batch.loss_mask.sum())


def evaluate_exact_match(
    model: Decoder | TrainedModel,
    task: Task,
    lengths: list[int] | range | None = None,
    n: int = 256,
    seed: int = 0,
    progress: bool = False,
) -> pd.DataFrame:
    """Exact match by length bin: the share of sequences whose every scored prediction is right.

    With teacher forcing, "every argmax right" equals "greedy decoding reproduces the answer".

    Args:
        model: a decoder, or a TrainedModel (its ``train_lengths`` label the rows).
        task: the task to sample from.
        lengths: problem sizes to test. Default (TrainedModel only): ``min_len .. 2 * max_len`` of
            its training lengths (in-distribution, then up to twice the longest).
        n: sequences per length.
        seed: evaluation seed (a stream training never uses).
        progress: a bar over the lengths.

    Returns:
        Tidy DataFrame, one row per length: ``task``, ``length``, ``n``, ``exact_match``,
        ``token_accuracy``, ``loss`` (nats per scored token), and ``in_distribution`` (None when
        the training lengths are unknown).

    Raises:
        ValueError: if ``lengths`` is missing for a bare decoder, or a length is out of range (for
            ``learned`` positions, past ``n_ctx``).
    """
    train_lengths = None
    if isinstance(model, TrainedModel):
        train_lengths = model.metadata.get("train_lengths")
        model = model.model
    if lengths is None:
        if train_lengths is None:
            raise ValueError("give lengths, or a TrainedModel whose metadata has train_lengths")
        lengths = range(train_lengths[0], 2 * train_lengths[1] + 1)
    was_training = model.training
    model.eval()
    rows = []
    for length in progress_bar(
        list(lengths), desc="exact match by length", unit="length", leave=False, disable=not progress
    ):
        batch = task.sample(n, length, length, stream_seed(seed, EVAL_STREAM, int(length)))
        exact, right, nats = _scored(model, batch)
        scored = batch.loss_mask.sum()
        rows.append(
            dict(
                task=task.name,
                length=int(length),
                n=n,
                exact_match=float(exact.float().mean()),
                token_accuracy=float(right.sum() / scored),
                loss=float(nats.sum() / scored),
                in_distribution=None if train_lengths is None else bool(train_lengths[0] <= length <= train_lengths[1]),
            )
        )
    model.train(was_training)
    return pd.DataFrame(rows)
