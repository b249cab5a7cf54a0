"""What every intervention measures before and after: the index re-probed at later layers
(:func:`reprobe`) and the model's loss and exact match (:func:`behavior`), on the tokens after the
first real one (:func:`later_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from scipy import stats
from torch import Tensor

from nopelens.probes import (
    Activations,
    BatchHooks,
    HookList,
    collect,
    hooks_for_batch,
    probe_absolute_index,
    probe_relative_distance,
    resid_site,
)
from nopelens.probes.metrics import random_state

from ..subjects import Subject, qk_sites
from ..sweep.reads import bilinear_mode
from .hooks import intervention


def later_tokens(acts: Activations, renumber: bool = False) -> Activations:
    """The samples at position >= 1 (the queries a sink ablation touches).

    With ``renumber``, positions count from the second token (position - 1), as the distance
    pair sampler needs positions 0..n - 1; distances i - j are unchanged by it.
    """
    keep = acts.position > 0
    return Activations(
        acts={site: array[keep] for site, array in acts.acts.items()},
        sequence_id=acts.sequence_id[keep],
        position=acts.position[keep] - int(renumber),
        token=acts.token[keep],
    )


def subset_sequences(acts: Activations, n_sequences: int) -> Activations:
    """The samples of the first ``n_sequences`` sequences (ids 0 .. n - 1) of ``acts``."""
    keep = acts.sequence_id < n_sequences
    return Activations(
        acts={site: array[keep] for site, array in acts.acts.items()},
        sequence_id=acts.sequence_id[keep],
        position=acts.position[keep],
        token=acts.token[keep],
    )


@dataclass(frozen=True)
class ProbeSettings:
    """How the interventions re-probe: folds, bootstrap replicates, seed, tasks, controls, whether to
    read relative distance from q.k, and the bilinear read (``outer``/``elementwise``; default:
    outer up to :data:`~nopelens.analyses.sweep.reads.MAX_OUTER_FEATURES` features per pair, as the sweep)."""

    n_splits: int = 5
    n_boot: int = 200
    seed: int = 0
    tasks: tuple[str, ...] = ("classification", "regression")
    controls: bool = True
    relative: bool = True
    bilinear: str | None = None


def reprobe(
    model,
    tokens: Tensor,
    attention_mask: Tensor,
    from_layer: int,
    n_layers: int,
    settings: ProbeSettings,
    hooks: HookList | BatchHooks = (),
    subject: Subject | None = None,
) -> pd.DataFrame:
    """Probe absolute index at layers ``from_layer .. n_layers`` and the q.k distance read of the
    blocks whose queries and keys come from those layers, under ``hooks`` (the same for every
    batch, or made per batch). ``subject`` (of ``model``), when given, says which q/k hooks fire
    (:func:`~nopelens.analyses.subjects.qk_sites`: a bridge may list rotated q/k hooks that never fire).

    Returns:
        :data:`~nopelens.probes.linear.RESULT_COLUMNS` rows; a q.k read of block b is at layer b + 1.
    """
    residual = [resid_site(layer) for layer in range(from_layer, n_layers + 1)]
    blocks = range(from_layer, n_layers) if settings.relative else ()
    qk = [pair for pair in (qk_sites(model if subject is None else subject, block) for block in blocks) if pair]
    sites = residual + [site for pair in qk for site in pair]
    collected = collect(model, tokens, sites, attention_mask=attention_mask, batch_size=32, hooks=hooks)
    acts = later_tokens(collected)
    common = dict(n_splits=settings.n_splits, n_boot=settings.n_boot, seed=settings.seed)
    frames = [probe_absolute_index(acts, sites=residual, tasks=settings.tasks, controls=settings.controls, **common)]
    if qk:
        mode = settings.bilinear or bilinear_mode(acts, qk[0][0])
        relative = probe_relative_distance(
            later_tokens(collected, renumber=True),
            sites=[],
            feature_kinds=(),
            attention=qk,
            bilinear=mode,
            tasks=("regression",),
            controls=settings.controls,
            pairs_per_distance=min(64, int(tokens.shape[0])),
            **common,
        )
        relative["layer"] = relative["block"] + 1
        frames.append(relative)
    return pd.concat(frames, ignore_index=True)


def behavior(
    model,
    tokens: Tensor,
    attention_mask: Tensor,
    targets: Tensor | None = None,
    loss_mask: Tensor | None = None,
    hooks: HookList | BatchHooks = (),
    check_finite: bool = False,
) -> pd.DataFrame:
    """Per-sequence loss (nats per scored token) and exact match under ``hooks`` (the same for
    every batch of 32 sequences, or made per batch).

    Args:
        tokens, attention_mask: ``[batch, pos]``.
        targets, loss_mask: what each position should predict and where it is scored (a task's
            :class:`~nopelens.models.tasks.Batch`); default: the next token at every real position
            whose next token is real.
        check_finite: refuse logits that are not finite at a scored position (the clean run: no
            change of its loss could be measured).

    Returns:
        One row per sequence: ``sequence``, ``loss``, ``exact_match`` (every scored argmax right).

    Raises:
        ValueError: with ``check_finite``, on a scored logit that is NaN or inf.
    """
    if targets is None:
        targets = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
        loss_mask = torch.cat(
            [
                (attention_mask[:, 1:] * attention_mask[:, :-1]).bool(),
                torch.zeros_like(tokens[:, :1], dtype=torch.bool),
            ],
            dim=1,
        )
    rows = []
    with torch.no_grad():
        for start in range(0, tokens.shape[0], 32):
            part = slice(start, min(start + 32, tokens.shape[0]))
            with intervention(model, hooks_for_batch(hooks, part, attention_mask[part])):
                logits = _logits(model(tokens[part], attention_mask=attention_mask[part])).float()
            mask = loss_mask[part].to(logits.device)
            if check_finite and not bool(torch.isfinite(logits[mask]).all()):
                raise ValueError(
                    "the model's logits are not finite (NaN or inf) on the clean sequences: check its "
                    "weights for NaN or inf"
                )
            target = targets[part].to(logits.device)
            nats = F.cross_entropy(logits.transpose(1, 2), target, reduction="none") * mask
            right = (logits.argmax(-1) == target) & mask
            for row in range(logits.shape[0]):
                rows.append(
                    dict(
                        sequence=start + row,
                        loss=float(nats[row].sum() / mask[row].sum()),
                        exact_match=float(bool(right[row].sum() == mask[row].sum())),
                    )
                )
    return pd.DataFrame(rows)


def _logits(output) -> Tensor:
    return output.logits if hasattr(output, "logits") else output


def behavior_change(clean: pd.DataFrame, changed: pd.DataFrame, n_boot: int, seed: int) -> list[dict]:
    """Mean loss and exact match, clean and changed, with a paired bootstrap CI of the change."""
    rows = []
    for metric in ("loss", "exact_match"):
        delta = changed[metric].to_numpy() - clean[metric].to_numpy()
        low, high = _mean_ci(delta, n_boot, seed)
        rows.append(
            dict(
                metric=metric,
                clean=float(clean[metric].mean()),
                value=float(changed[metric].mean()),
                delta=float(delta.mean()),
                delta_ci_low=low,
                delta_ci_high=high,
            )
        )
    return rows


def _mean_ci(values: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap 95 % CI of a mean (SciPy); a constant sample has a zero-width CI."""
    if np.ptp(values) == 0:
        return float(values[0]), float(values[0])
    result = stats.bootstrap(
        (values,), np.mean, n_resamples=n_boot, method="percentile", random_state=random_state(seed)
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
