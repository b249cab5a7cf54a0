"""Activation patching: how much of the index moves with a residual state patched in from a
left-shifted copy of the sequence (:func:`position_patching`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch
from scipy import stats
from torch import Tensor

from nopelens.models.hooks import act_names
from nopelens.models.progress import progress_bar
from nopelens.probes import collect, make_probe, resid_site
from nopelens.probes.metrics import random_state

from .directions import clean_probe_reads
from .hooks import patch_position_hook
from .measure import ProbeSettings

MIN_READ_SHIFT = 0.5
"""Patching normalizes by the index shift the last layer reads between the copy and the original;
below this fraction of the true shift there is no scale, and ``moved`` is NaN with a note."""


def shifted_copy(tokens: Tensor, shift: int, keep_first: bool) -> Tensor:
    """The sequences with ``shift`` tokens dropped after the first (``keep_first``, e.g. BOS) or at the start.

    The token at index i >= shift (+1 with ``keep_first``) of ``tokens`` sits at i - shift in the copy.
    """
    start = 1 if keep_first else 0
    if not 1 <= shift <= tokens.shape[1] - start - 2:
        raise ValueError(
            f"shift must lie in 1..{tokens.shape[1] - start - 2} for sequences of {tokens.shape[1]} tokens, got {shift}"
        )
    return torch.cat([tokens[:, :start], tokens[:, start + shift :]], dim=1)


def position_patching(
    model,
    tokens: Tensor,
    n_layers: int,
    settings: ProbeSettings,
    shift: int | None = None,
    positions: Sequence[int] | None = None,
    keep_first: bool = True,
    progress: bool = False,
) -> pd.DataFrame:
    """How much of the index moves with a residual state patched in from a left-shifted copy.

    For each patch layer l in 0 .. n_layers - 1 (``blocks.{l}.hook_resid_pre``) and position i,
    the original sequences run with the state at (l, i) replaced by the copy's state of the same
    token (at i - shift). (TransformerLens' ``patching.generic_activation_patch`` patches an index
    from the same index of the clean run and reads ``model.cfg.device``, which a ``Decoder``'s
    config does not have, so the loop is here; its normalization is kept.) A regression
    probe fitted on clean final-layer states reads the index at i in the last layer. ``moved`` =
    mean(patched - original) / mean(copy - original) over sequences (TransformerLens'
    normalization (patched - corrupted) / (clean - corrupted), as a ratio of means, which stays
    defined when one sequence's two reads coincide), with a paired bootstrap CI over sequences.

    Args:
        model: a ``Decoder`` or bridged HF model, in eval mode.
        tokens: ``[batch, pos]`` without padding.
        n_layers: number of blocks.
        settings: seed, bootstrap replicates and folds.
        shift: s, default a quarter of the length.
        positions: positions i to patch (default four, evenly spread over the patchable range).
        keep_first: keep the first token (BOS) in the copy.
        progress: a bar over the patched positions.

    Returns:
        One row per (patch layer, position): ``layer``, ``position``, ``read_layer``, ``read_r2``
        (out-of-fold R^2 of the last-layer probe on clean states), ``original_read``,
        ``copy_read``, ``patched_read`` (means), ``moved`` and its CI, and ``note``: where the last
        layer does not read the copy's shift (|mean(copy - original)| < :data:`MIN_READ_SHIFT` *
        shift, e.g. a RoPE model whose residual stream holds little index) ``moved`` is NaN and the
        note says why.
    """
    length, start = tokens.shape[1], 1 if keep_first else 0
    shift = max(1, length // 4) if shift is None else shift
    copy = shifted_copy(tokens, shift, keep_first)
    low = start + shift
    if positions is None:
        positions = sorted(set(np.linspace(low, length - 1, 4).round().astype(int).tolist()))
    for position in positions:
        if not low <= position < length:
            raise ValueError(
                f"patched positions must lie in {low}..{length - 1} (the copy holds those tokens), got {position}"
            )
    read_site = resid_site(n_layers)
    sites = act_names("resid_pre", n_layers)
    original = collect(model, tokens, sites + [read_site])
    source = collect(model, copy, sites + [read_site])
    probe = make_probe("regression", seed=settings.seed, dtype=original.dtype(read_site)).fit(
        original.features(read_site), original.position, linear__groups=original.sequence_id
    )
    read_r2, _ = clean_probe_reads(original, original, read_site, settings.n_splits, settings.seed)
    read_original = probe.predict(original.features(read_site)).reshape(tokens.shape)
    read_copy = probe.predict(source.features(read_site)).reshape(copy.shape)

    rows = []
    for position in progress_bar(positions, desc="position patching", unit="position", disable=not progress):
        before, after = read_original[:, position], read_copy[:, position - shift]
        for layer, site in enumerate(sites):
            replacement = torch.from_numpy(source.acts[site]).reshape(len(copy), copy.shape[1], -1)[:, position - shift]
            patched = collect(
                model,
                tokens,
                [read_site],
                batch_size=32,
                hooks=lambda rows, mask, site=site, replacement=replacement: [
                    (site, patch_position_hook(position, replacement[rows]))
                ],
            )
            patched_read = probe.predict(patched.features(read_site)).reshape(tokens.shape)[:, position]
            scale = float(np.mean(after - before))
            if abs(scale) < MIN_READ_SHIFT * shift:
                moved = low_ci = high_ci = float("nan")
                note = (
                    f"the last layer does not read the copy's index shift (copy - original = {scale:.2f}, "
                    f"not about -{shift}): no scale to normalize by"
                )
            else:
                moved, low_ci, high_ci = _ratio_of_means(
                    patched_read - before, after - before, settings.n_boot, settings.seed
                )
                note = ""
            rows.append(
                dict(
                    layer=layer,
                    position=position,
                    shift=shift,
                    read_layer=n_layers,
                    read_r2=read_r2,
                    original_read=float(before.mean()),
                    copy_read=float(after.mean()),
                    patched_read=float(patched_read.mean()),
                    moved=moved,
                    moved_ci_low=low_ci,
                    moved_ci_high=high_ci,
                    note=note,
                )
            )
    return pd.DataFrame(rows)


def _ratio_of_means(
    numerator: np.ndarray, denominator: np.ndarray, n_boot: int, seed: int
) -> tuple[float, float, float]:
    """mean(numerator) / mean(denominator) with a paired percentile bootstrap CI over sequences (SciPy)."""
    if np.mean(denominator) == 0:
        raise ValueError("the copy and the original read the same index: the patching effect has no scale")
    ratio = float(np.mean(numerator) / np.mean(denominator))
    if np.ptp(numerator) == 0 and np.ptp(denominator) == 0:
        return ratio, ratio, ratio
    result = stats.bootstrap(
        (numerator, denominator),
        lambda a, b, axis=-1: a.mean(axis) / b.mean(axis),
        paired=True,
        vectorized=True,
        n_resamples=n_boot,
        method="percentile",
        random_state=random_state(seed),
    )
    return ratio, float(result.confidence_interval.low), float(result.confidence_interval.high)
