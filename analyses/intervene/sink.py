"""Sink ablation: the first real token taken out of one block's attention (:data:`SINK_MODES`),
checked to take effect (:func:`check_sink_ablation`), then the later layers re-probed and the
behaviour measured (:func:`sink_ablation`); and the sweep's cheap form of it, streamed
(:func:`sink_ablation_drop_streamed`) or from clean activations in memory (:func:`sink_ablation_drop`,
the same measurement with the clean states replayed), which give :func:`sink_ablation`'s
``remove_key`` numbers."""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from nopelens.models.hooks import act_name, act_names
from nopelens.models.progress import progress_bar
from nopelens.probes import Activations, collect, resid_site, stream
from nopelens.probes.stream import KeepBudget, Measurement, Sequences
from nopelens.probes.stream_probes import absolute_index_probes

from ..subjects import Subject
from .hooks import SINK_MODES, NotApplicable, sink_batch_hooks
from .measure import ProbeSettings, behavior, behavior_change, reprobe, subset_sequences

PATTERN_TOLERANCE = 1e-6
"""Largest attention weight a removed key may keep for the ablation to count as applied."""


def mean_values(model, tokens: Tensor, attention_mask: Tensor, blocks: Sequence[int]) -> dict[int, Tensor]:
    """Mean ``hook_v`` ``[head_index, d_head]`` per block over real tokens after the first of each row."""
    sites = act_names("v", blocks)
    acts = collect(model, tokens, sites, attention_mask=attention_mask, batch_size=32)
    later = acts.position > 0
    return {block: torch.from_numpy(acts.acts[site][later].mean(0)) for block, site in zip(blocks, sites)}


CHECK_TOKENS = 16
"""Real tokens per sequence :func:`check_sink_ablation` runs on."""


def first_real_tokens(tokens: Tensor, attention_mask: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Each row's first ``n`` real tokens, left-padded to one length (the pad slots repeat the
    row's first token, masked out).

    Args:
        tokens, attention_mask: ``[batch, pos]``; every row has a real token.
        n: tokens to keep per row, >= 1.

    Returns:
        ``(tokens, attention_mask)``, ``[batch, min(n, longest row)]``.

    Example:
        >>> tokens, mask = first_real_tokens(torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7]]),
        ...                                  torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 3)
        >>> tokens.tolist(), mask.tolist()
        ([[5, 5, 6], [4, 5, 6]], [[0, 1, 1], [1, 1, 1]])
    """
    real = [row[keep.bool()][:n] for row, keep in zip(tokens, attention_mask)]
    width = max(len(row) for row in real)
    padded = torch.stack([torch.cat([row[:1].expand(width - len(row)), row]) for row in real])
    mask = torch.stack([(torch.arange(width) >= width - len(row)).long() for row in real])
    return padded, mask


def check_sink_ablation(
    model, block: int, mode: str, tokens: Tensor, attention_mask: Tensor, mean_value: Tensor | None = None
) -> None:
    """Check on two sequences that the ablation reaches the attention output, or refuse.

    A bridged HF attention that delegates to the HF module fires ``hook_attn_scores`` after the
    fact, so an edit there changes nothing (TransformerLens warns); a model without the hook
    point cannot be ablated at all. Checked: the hook point exists, no edit is discarded, the
    removed key has weight <= :data:`PATTERN_TOLERANCE` in ``hook_pattern`` (``remove_key``), and
    the block's attention output changes. The two sequences are cut to their first
    :data:`CHECK_TOKENS` real tokens (left-padded to one length), so the patterns the check reads
    do not grow with the sequence length.

    Raises:
        NotApplicable: with a one-line reason.
    """
    tokens, attention_mask = first_real_tokens(tokens[:2], attention_mask[:2], CHECK_TOKENS)
    hooks = sink_batch_hooks(block, mode, mean_value)
    name = hooks(slice(0, 2), attention_mask)[0][0]
    if name not in model.hook_dict:
        raise NotApplicable(f"no hook point {name}: the sink cannot be ablated in block {block}")
    pattern_site, out_site = act_name("pattern", block), act_name("attn_out", block)
    needed = [pattern_site, out_site] if mode == "remove_key" else [out_site]
    unverifiable = [site for site in needed if site not in model.hook_dict]
    if unverifiable:
        raise NotApplicable(f"no hook point {unverifiable[0]} to check that the ablation in block {block} took effect")
    sites = needed
    clean = collect(model, tokens, sites, attention_mask=attention_mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ablated = collect(model, tokens, sites, attention_mask=attention_mask, hooks=hooks)
    if any("discarded" in str(w.message) for w in caught):
        raise NotApplicable(
            f"{name} is fired after the attention is computed (edits are discarded); "
            "the sink ablation would measure nothing"
        )
    if mode == "remove_key":
        kept = max(float(np.abs(p[:, 1:, 0]).max()) for p in ablated.patterns[pattern_site])
        if kept > PATTERN_TOLERANCE:
            raise NotApplicable(f"after blocking key 0 at {name}, hook_pattern still gives it weight {kept:.3g}")
    if np.array_equal(clean.acts[out_site], ablated.acts[out_site]):
        raise NotApplicable(f"an edit at {name} does not change {out_site}: the hook is not on the computation path")


def sink_ablation(
    model,
    tokens: Tensor,
    attention_mask: Tensor,
    n_layers: int,
    settings: ProbeSettings,
    modes: Sequence[str] = SINK_MODES,
    blocks: Sequence[int] | None = None,
    targets: Tensor | None = None,
    loss_mask: Tensor | None = None,
    progress: bool = False,
    subject: Subject | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Ablate the first real token in each block; re-probe every later layer and measure behaviour.

    Args:
        model: a ``Decoder`` or bridged HF model.
        tokens, attention_mask: evaluation sequences ``[batch, pos]`` (>= ``n_splits`` of them).
        n_layers: number of blocks.
        settings: probe settings.
        modes: subset of :data:`SINK_MODES`.
        blocks: blocks to ablate (default all).
        targets, loss_mask: as :func:`behavior`.
        progress: a bar over the (mode, block) ablations.
        subject: the subject of ``model``, whose description says which q/k hooks fire (:func:`reprobe`).

    Returns:
        ``(probes, behaviour)``. ``probes``: the probe rows of the clean run (``condition ==
        "clean"``, ``block`` of the ablation NaN) and of each ablation (``condition`` = mode,
        ``ablated_block``), at layers after the ablated block, with ``clean_value`` and ``delta``.
        ``behaviour``: loss and exact match per ablation with paired CIs of the change. An
        ablation refused on this model (:class:`NotApplicable`) gives a behaviour row with
        ``status == "not_applicable"`` and its reason.
    """
    for mode in modes:
        if mode not in SINK_MODES:
            raise ValueError(f"sink ablation mode must be one of {SINK_MODES}, got {mode!r}")
    blocks = list(range(n_layers)) if blocks is None else list(blocks)
    for block in blocks:
        if not 0 <= block < n_layers:
            raise ValueError(f"block {block} is outside 0..{n_layers - 1}")
    ablations = [(mode, block) for mode in modes for block in blocks]
    bar = progress_bar(total=len(ablations) + 1, desc="sink ablation", unit="probe set", disable=not progress)
    bar.set_postfix_str("clean")
    clean = reprobe(model, tokens, attention_mask, 1, n_layers, settings, subject=subject).assign(
        condition="clean", ablated_block=np.nan
    )
    clean_behavior = behavior(model, tokens, attention_mask, targets, loss_mask, check_finite=True)
    means = mean_values(model, tokens, attention_mask, blocks) if "mean_value" in modes else {}
    probe_frames, behavior_rows = [clean], []
    bar.update()
    for mode, block in ablations:
        bar.set_postfix_str(f"{mode}, block {block}")
        mean_value = means.get(block)
        try:
            check_sink_ablation(model, block, mode, tokens, attention_mask, mean_value)
        except NotApplicable as reason:
            behavior_rows.append(dict(condition=mode, ablated_block=block, status="not_applicable", note=str(reason)))
            bar.update()
            continue
        hooks = sink_batch_hooks(block, mode, mean_value)
        table = reprobe(model, tokens, attention_mask, block + 1, n_layers, settings, hooks, subject)
        probe_frames.append(table.assign(condition=mode, ablated_block=block))
        changed = behavior(model, tokens, attention_mask, targets, loss_mask, hooks)
        for row in behavior_change(clean_behavior, changed, settings.n_boot, settings.seed):
            behavior_rows.append(dict(condition=mode, ablated_block=block, status="measured", note="", **row))
        bar.update()
    bar.close()
    probes = with_clean_values(pd.concat(probe_frames, ignore_index=True))
    return probes, pd.DataFrame(behavior_rows)


PROBE_KEY = ["site", "target", "task", "features", "probe", "split", "metric"]


def with_clean_values(probes: pd.DataFrame) -> pd.DataFrame:
    """Add ``clean_value`` (the same probe row without intervention) and ``delta`` = value - clean."""
    clean = probes[probes["condition"] == "clean"].set_index(PROBE_KEY)["value"].rename("clean_value")
    merged = probes.join(clean, on=PROBE_KEY)
    return merged.assign(delta=merged["value"] - merged["clean_value"])


# ----------------------------------------------------------------------------- the sweep's form


def sink_ablation_drop(
    model,
    tokens: Tensor,
    attention_mask: Tensor,
    n_layers: int,
    clean: Activations,
    n_splits: int = 5,
    n_boot: int = 200,
    seed: int = 0,
    max_sequences: int | None = None,
) -> pd.DataFrame:
    """Per block l, absolute-index R^2 at layer l + 1, clean and with the first key removed in block l.

    The cheap form of :func:`sink_ablation` for the sweep: regression probes only, no controls,
    the clean states taken from activations already collected, and each ablated pass stopped at
    layer l + 1. Tokens after the first real one are probed (see :mod:`nopelens.analyses.intervene`). On the
    same sequences and probe settings its R^2 values (and CIs) are those of :func:`sink_ablation`'s
    ``remove_key`` rows at layer l + 1: the sweep and ``nopelens intervene`` give one number. (The
    sweep once probed only its first 16 sequences, and the smaller fits read text-nope-4l's
    block-0 ablation as R^2 0.81 -> -0.04 where 80 sequences read 0.92 -> 0.42.) It is
    :func:`sink_ablation_drop_streamed` with every batch kept, the clean probes replayed from
    ``clean`` (:func:`~nopelens.probes.stream.replay`).

    Args:
        model, tokens, attention_mask, n_layers: the subject.
        clean: activations of the same tokens holding every residual layer 1 .. n_layers.
        n_splits, n_boot, seed: probe folds, bootstrap replicates and seed.
        max_sequences: probe only the first this many sequences (None, the default: all).

    Returns:
        One row per block: ``block``, ``layer``, ``r2_clean`` and ``r2_ablated`` with CIs, ``drop``
        (clean - ablated), ``status`` (``measured`` or ``not_applicable``, where
        :func:`check_sink_ablation` refuses the block) and ``note``.
    """
    if max_sequences is not None:
        tokens, attention_mask = tokens[:max_sequences], attention_mask[:max_sequences]
        clean = subset_sequences(clean, len(tokens))
    sequences = Sequences.of(tokens, attention_mask)
    refused = refused_sink_blocks(model, n_layers, tokens, attention_mask)
    layers = [block + 1 for block in range(n_layers) if block not in refused]
    clean_table = None
    if layers:  # else every block is refused: no probe to fit
        probes = later_token_probes(sequences, layers, n_splits, n_boot, seed, keep=None)
        (clean_table,) = stream.replay(clean, [probes], sequences=sequences)
    return sink_ablation_drop_streamed(
        model, sequences, n_layers, clean_table, refused, n_splits, n_boot, seed, keep=None
    )


def refused_sink_blocks(model, n_layers: int, tokens: Tensor, attention_mask: Tensor) -> dict[int, str]:
    """Block -> why its first key cannot be removed and checked (:func:`check_sink_ablation`,
    ``remove_key``, on two sequences); the blocks not listed can be ablated."""
    refused = {}
    for block in range(n_layers):
        try:
            check_sink_ablation(model, block, "remove_key", tokens, attention_mask)
        except NotApplicable as reason:
            refused[block] = str(reason)
    return refused


def later_token_probes(
    sequences: Sequences,
    layers: Sequence[int],
    n_splits: int = 5,
    n_boot: int = 200,
    seed: int = 0,
    keep: KeepBudget | int | str | None = "auto",
) -> Measurement:
    """The sink ablation's probe, streamed: regression for the index, no controls, on the tokens
    after the first real one (:func:`later_tokens`) at residual ``layers`` (DESIGN.md numbering);
    its table is :func:`~nopelens.probes.stream_probes.probe_absolute_index`'s on the same samples
    (:func:`~nopelens.probes.stream_probes.absolute_index_probes` with ``min_position=1``).

    Raises:
        ValueError: as :func:`~nopelens.probes.stream_probes.absolute_index_probes` (too few
            sequences with a second token for the folds).
    """
    return absolute_index_probes(
        sequences,
        [resid_site(layer) for layer in layers],
        tasks=("regression",),
        controls=False,
        n_splits=n_splits,
        n_boot=n_boot,
        seed=seed,
        keep=keep,
        min_position=1,
    )


def sink_ablation_drop_streamed(
    model,
    sequences: Sequences,
    n_layers: int,
    clean: pd.DataFrame,
    refused: dict[int, str],
    n_splits: int = 5,
    n_boot: int = 200,
    seed: int = 0,
    keep: KeepBudget | int | str | None = "auto",
    batch_size: int = 32,
    progress: str | None = None,
) -> pd.DataFrame:
    """:func:`sink_ablation_drop`'s table, streamed (:func:`nopelens.probes.stream.run`): memory
    does not grow with the tokens past the keep budget.

    Per block l that is not ``refused``: one streamed run with block l's first real key removed
    (:func:`sink_batch_hooks`, each batch its own rows' first indices), probing layer l + 1 on the
    tokens after the first (:func:`later_token_probes`); each forward pass stops after that layer,
    so the n blocks cost about (n + 1) / 2 full passes (twice that for batches whose features do
    not fit the keep budget). The clean R^2 comes from ``clean``, the same probes measured in the
    caller's clean run (which hooks the sweep's sites, as the clean states of
    :func:`sink_ablation_drop`, this with every batch kept, were collected).

    Args:
        model: the hooked model.
        sequences: the token set (:meth:`~nopelens.probes.stream.Sequences.of`).
        n_layers: number of blocks.
        clean: :func:`later_token_probes`'s result on the clean model, holding layer l + 1 of
            every block not refused.
        refused: :func:`refused_sink_blocks` (their rows are ``not_applicable`` with the reason).
        n_splits, n_boot, seed: probe folds, bootstrap replicates and seed.
        keep: the keep budget (shared with the caller's measurements).
        batch_size: sequences per forward pass.
        progress: a label for a bar per ablated run (None: no bar).

    Returns:
        One row per block, the columns of :func:`sink_ablation_drop`.

    Raises:
        KeyError: if ``clean`` lacks the layer of a block to ablate.
        ValueError: as :func:`later_token_probes` and :func:`~nopelens.probes.stream.run`.
    """
    rows = []
    for block in range(n_layers):
        if block in refused:
            rows.append(_drop_row(block, note=refused[block]))
            continue
        site = resid_site(block + 1)
        probe = later_token_probes(sequences, [block + 1], n_splits, n_boot, seed, keep)
        (ablated,) = stream.run(
            model,
            sequences,
            [probe],
            batch_size=batch_size,
            hooks=sink_batch_hooks(block, "remove_key"),
            progress=progress and f"{progress}: sink ablation, block {block}",
        )
        rows.append(_drop_row(block, _linear_r2(clean, site), _linear_r2(ablated, site)))
    return pd.DataFrame(rows, columns=DROP_COLUMNS)


def _linear_r2(table: pd.DataFrame, site: str) -> pd.Series:
    """The grouped linear probe's R^2 row of ``site`` in a probe table."""
    hit = table[
        (table["site"] == site)
        & (table["probe"] == "linear")
        & (table["metric"] == "r2")
        & (table["split"] == "grouped")
    ]
    if hit.empty:
        raise KeyError(f"no linear R^2 of {site} in the probe table")
    return hit.iloc[0]


DROP_COLUMNS = (
    "block",
    "layer",
    "r2_clean",
    "r2_clean_ci_low",
    "r2_clean_ci_high",
    "r2_ablated",
    "r2_ablated_ci_low",
    "r2_ablated_ci_high",
    "drop",
    "status",
    "note",
)
"""The sink ablation table's columns, in order (whichever block comes first)."""


def _drop_row(block: int, clean: pd.Series | None = None, ablated: pd.Series | None = None, note: str = "") -> dict:
    """One row of the sink ablation table; without scores, a ``not_applicable`` row with ``note``."""
    row = dict(block=block, layer=block + 1)
    if clean is None:
        return dict(row, status="not_applicable", note=note)
    return dict(
        row,
        r2_clean=clean["value"],
        r2_clean_ci_low=clean["ci_low"],
        r2_clean_ci_high=clean["ci_high"],
        r2_ablated=ablated["value"],
        r2_ablated_ci_low=ablated["ci_low"],
        r2_ablated_ci_high=ablated["ci_high"],
        drop=clean["value"] - ablated["value"],
        status="measured",
        note="",
    )
