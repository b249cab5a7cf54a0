"""Causal tests of where a model's position comes from: sink ablation, position directions, patching.

A probe shows that the absolute index is *readable*; these interventions ask whether it is *made*
by the attention sink and whether the model *uses* it (issue 14). Kazemnejad et al. 2023
(NeurIPS), App. C, Theorem 1, and seed ``004_150f630256efbd1c.txt``: a head that spreads its
attention over the i + 1 visible keys writes 1/(i + 1) of the first token's value, so in a NoPE
model the index should come from the first token.

Three interventions, each a set of TransformerLens hooks added for the forward passes of one
measurement and removed afterwards, also when a pass raises (``model.hooks(...)``, the context
manager of ``HookedRootModule`` and ``TransformerBridge`` alike). Hooks that index rows (the first
real token of each row, a per-row patched state) are made per batch
(:data:`~nopelens.probes.collect.BatchHooks`, :func:`sink_batch_hooks`), so each batch of a
batched pass gets its own rows' indices; a hook handed a batch of another size refuses it.

- **Sink ablation** (:func:`sink_ablation`). In block l, the first real token is removed from the
  keys of every later query: ``hook_attn_scores`` gets -inf at (query > first, key = first), so
  the softmax renormalizes over the other keys; the query at the first token keeps its only key.
  Or (``mean_value``) the first token's value (``hook_v``) is replaced by the mean value of the
  other real tokens of the evaluation batch, which keeps it in the denominator but makes it an
  ordinary token. Every later layer is then probed again (refitted probes: is the index still
  readable?), and the loss or exact match is measured.
- **Position directions** (:func:`direction_interventions`). The regression probe for the index
  at layer l, mapped back to the residual stream through its scaler, gives a direction w with
  prediction = (x - mean) . w + b. Project it out (x - ((x - mean) . w^) w^), or move every
  state by k w / |w|^2, so the probe reads i + k. Report what the next layers read and the loss.
- **Activation patching** (:func:`position_patching`). The residual stream at layer l, position
  i of a sequence is replaced by the same token's state in a left-shifted copy of the sequence
  (the token sits at i - s there); a regression probe at the last layer reads the index at i. The
  effect is normalized as TransformerLens' ``patching`` module normalizes it (``PatchingResult.normalized``):
  (patched - corrupted) / (clean - corrupted), with the original sequence as the "corrupted"
  run and the shifted copy as the "clean" source, so 1 means all of the index moved with the
  patched state and 0 means the later layers recomputed it from the context.

Probed samples are the tokens after the first real one (position >= 1): the first token is never
touched by a sink ablation, and as the only BOS it would be identified by its content alone.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float
from scipy import stats
from sklearn.metrics import r2_score
from torch import Tensor

from nopelens.models.hooks import act_name, act_names
from nopelens.models.io import write_csv_atomic
from nopelens.models.progress import progress_bar
from nopelens.probes import (
    Activations,
    BatchHooks,
    HookList,
    collect,
    hooks_added,
    hooks_for_batch,
    make_probe,
    probe_absolute_index,
    probe_relative_distance,
    resid_site,
    sequence_splits,
    stream,
)
from nopelens.probes.metrics import random_state
from nopelens.probes.stream import KeepBudget, Measurement, Sequences
from nopelens.probes.stream_probes import absolute_index_probes

from . import report, runs
from .reads import bilinear_mode
from .subjects import Subject, check_spec, qk_sites, resolve

SINK_MODES = ("remove_key", "mean_value")
"""How a sink ablation takes the first token out of a block's attention (see the module docstring)."""

MIN_READ_SHIFT = 0.5
"""Patching normalizes by the index shift the last layer reads between the copy and the original;
below this fraction of the true shift there is no scale, and ``moved`` is NaN with a note."""

PATTERN_TOLERANCE = 1e-6
"""Largest attention weight a removed key may keep for the ablation to count as applied."""



class NotApplicable(ValueError):
    """An intervention that cannot be measured right on this model; the message says why."""


# ----------------------------------------------------------------------------- hooks


@contextmanager
def intervention(model, hooks: HookList) -> Iterator[None]:
    """Add ``hooks`` (``[(hook name, fn(activation, hook))]``) for the passes inside the block.

    The hooks are removed when the block exits, also when a forward pass inside it raises
    (TransformerLens' ``model.hooks`` context manager; hooks the caller added before are kept).

    Raises:
        KeyError: if a hook name does not exist on the model, naming it.
    """
    with hooks_added(model, hooks):
        yield


def first_real_index(attention_mask: Tensor) -> Tensor:
    """Index of the first real token of each row ``[batch]`` (0 unless the row is left-padded)."""
    return attention_mask.long().argmax(-1)


def _check_rows(first: Tensor, n_rows: int, site: str) -> None:
    if first.shape[0] != n_rows:
        raise ValueError(f"a sink hook at {site} was made for {first.shape[0]} rows but sees a batch of {n_rows}: "
                         "make the hooks per batch (sink_batch_hooks), so each batch gets its own rows' first indices")


def remove_first_key_hook(first: Tensor) -> Callable:
    """A ``hook_attn_scores`` hook that blocks key ``first[b]`` for every query after it.

    Args:
        first: int64 ``[batch]``, the first real index of each row of the batch the hook will see.

    Returns:
        ``fn(scores [batch, head_index, query_pos, key_pos], hook)`` returning the scores with -inf
        at (query > first, key = first); the softmax then renormalizes over the other keys.
        Raises ValueError when handed a batch of another size than ``first`` (a hook made for
        other rows would block the wrong key of a left-padded row).
    """

    def hook(scores: Tensor, hook) -> Tensor:
        _check_rows(first, scores.shape[0], "hook_attn_scores")
        n_query, n_key = scores.shape[-2:]
        offset = n_key - n_query  # keys before the queries (a cache); 0 in a full pass
        key = torch.arange(n_key, device=scores.device)
        query = torch.arange(n_query, device=scores.device) + offset
        f = first.to(scores.device)[:, None, None]
        blocked = (key[None, None, :] == f) & (query[None, :, None] > f)
        return scores.masked_fill(blocked[:, None], float("-inf"))

    return hook


def replace_first_value_hook(first: Tensor, mean_value: Tensor) -> Callable:
    """A ``hook_v`` hook that sets the first real token's value to ``mean_value``.

    Args:
        first: int64 ``[batch]``, first real index per row of the batch the hook will see (a
            batch of another size raises ValueError).
        mean_value: ``[head_index, d_head]`` (the mean value of the other real tokens).
    """

    def hook(v: Tensor, hook) -> Tensor:
        _check_rows(first, v.shape[0], "hook_v")
        v = v.clone()
        rows = torch.arange(v.shape[0], device=v.device)
        v[rows, first.to(v.device)] = mean_value.to(v.device, v.dtype)
        return v

    return hook


def shift_hook(direction: Tensor, amount: float) -> Callable:
    """A residual hook adding ``amount * direction`` to every token's state."""

    def hook(resid: Tensor, hook) -> Tensor:
        return resid + amount * direction.to(resid.device, resid.dtype)

    return hook


def project_out_hook(direction: Tensor, center: Tensor) -> Callable:
    """A residual hook removing each state's component along ``direction`` about ``center``."""
    unit = direction / direction.norm()

    def hook(resid: Tensor, hook) -> Tensor:
        u, c = unit.to(resid.device, resid.dtype), center.to(resid.device, resid.dtype)
        return resid - ((resid - c) @ u)[..., None] * u

    return hook


# ----------------------------------------------------------------------------- sink ablation


def mean_values(model, tokens: Tensor, attention_mask: Tensor, blocks: Sequence[int]) -> dict[int, Tensor]:
    """Mean ``hook_v`` ``[head_index, d_head]`` per block over real tokens after the first of each row."""
    sites = act_names("v", blocks)
    acts = collect(model, tokens, sites, attention_mask=attention_mask, batch_size=32)
    later = acts.position > 0
    return {block: torch.from_numpy(acts.acts[site][later].mean(0)) for block, site in zip(blocks, sites)}


def sink_hooks(block: int, mode: str, first: Tensor, mean_value: Tensor | None = None) -> HookList:
    """The hooks of one sink ablation of ``block`` (``remove_key`` or ``mean_value``) for one batch
    whose rows have first real indices ``first`` (int64 ``[batch]``); for a batched pass use
    :func:`sink_batch_hooks`.

    Raises:
        ValueError: on an unknown mode, or ``mean_value`` without its mean value.
    """
    if mode == "remove_key":
        return [(act_name("attn_scores", block), remove_first_key_hook(first))]
    if mode == "mean_value":
        if mean_value is None:
            raise ValueError("mode 'mean_value' needs the mean value of the block")
        return [(act_name("v", block), replace_first_value_hook(first, mean_value))]
    raise ValueError(f"sink ablation mode must be one of {SINK_MODES}, got {mode!r}")


@dataclass(frozen=True)
class SinkBatchHooks:
    """One sink ablation of ``block`` as hooks made per batch (a
    :data:`~nopelens.probes.collect.BatchHooks`; build with :func:`sink_batch_hooks`). A dataclass,
    so it pickles and can be sent to shards (:func:`nopelens.probes.stream.run` with ``executor``)."""

    block: int
    mode: str
    mean_value: Tensor | None = None

    def __call__(self, rows: slice, attention_mask: Tensor) -> HookList:
        return sink_hooks(self.block, self.mode, first_real_index(attention_mask), self.mean_value)


def sink_batch_hooks(block: int, mode: str, mean_value: Tensor | None = None) -> SinkBatchHooks:
    """One sink ablation of ``block`` as hooks made per batch: each batch gets :func:`sink_hooks`
    with its own rows' first real indices (:func:`first_real_index` of its mask), so a left-padded
    row has its own first key removed however the sequences are batched.

    Raises:
        ValueError: as :func:`sink_hooks`, at once.
    """
    sink_hooks(block, mode, torch.zeros(1, dtype=torch.long), mean_value)  # check mode and mean value now
    return SinkBatchHooks(block, mode, mean_value)


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


def check_sink_ablation(model, block: int, mode: str, tokens: Tensor, attention_mask: Tensor,
                        mean_value: Tensor | None = None) -> None:
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
        raise NotApplicable(f"{name} is fired after the attention is computed (edits are discarded); "
                            "the sink ablation would measure nothing")
    if mode == "remove_key":
        kept = max(float(np.abs(p[:, 1:, 0]).max()) for p in ablated.patterns[pattern_site])
        if kept > PATTERN_TOLERANCE:
            raise NotApplicable(f"after blocking key 0 at {name}, hook_pattern still gives it weight {kept:.3g}")
    if np.array_equal(clean.acts[out_site], ablated.acts[out_site]):
        raise NotApplicable(f"an edit at {name} does not change {out_site}: the hook is not on the computation path")


def later_tokens(acts: Activations, renumber: bool = False) -> Activations:
    """The samples at position >= 1 (the queries a sink ablation touches).

    With ``renumber``, positions count from the second token (position - 1), as the distance
    pair sampler needs positions 0..n - 1; distances i - j are unchanged by it.
    """
    keep = acts.position > 0
    return Activations(
        acts={site: array[keep] for site, array in acts.acts.items()},
        sequence_id=acts.sequence_id[keep], position=acts.position[keep] - int(renumber), token=acts.token[keep],
    )


@dataclass(frozen=True)
class ProbeSettings:
    """How the interventions re-probe: folds, bootstrap replicates, seed, tasks, controls, whether to
    read relative distance from q.k, and the bilinear read (``outer``/``elementwise``; default:
    outer up to :data:`~nopelens.analyses.reads.MAX_OUTER_FEATURES` features per pair, as the sweep)."""

    n_splits: int = 5
    n_boot: int = 200
    seed: int = 0
    tasks: tuple[str, ...] = ("classification", "regression")
    controls: bool = True
    relative: bool = True
    bilinear: str | None = None


def reprobe(model, tokens: Tensor, attention_mask: Tensor, from_layer: int, n_layers: int,
            settings: ProbeSettings, hooks: HookList | BatchHooks = (),
            subject: Subject | None = None) -> pd.DataFrame:
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
        relative = probe_relative_distance(later_tokens(collected, renumber=True), sites=[], feature_kinds=(), attention=qk, bilinear=mode,
                                           tasks=("regression",), controls=settings.controls,
                                           pairs_per_distance=min(64, int(tokens.shape[0])), **common)
        relative["layer"] = relative["block"] + 1
        frames.append(relative)
    return pd.concat(frames, ignore_index=True)


def behavior(model, tokens: Tensor, attention_mask: Tensor, targets: Tensor | None = None,
             loss_mask: Tensor | None = None, hooks: HookList | BatchHooks = (),
             check_finite: bool = False) -> pd.DataFrame:
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
        loss_mask = torch.cat([(attention_mask[:, 1:] * attention_mask[:, :-1]).bool(),
                               torch.zeros_like(tokens[:, :1], dtype=torch.bool)], dim=1)
    rows = []
    with torch.no_grad():
        for start in range(0, tokens.shape[0], 32):
            part = slice(start, min(start + 32, tokens.shape[0]))
            with intervention(model, hooks_for_batch(hooks, part, attention_mask[part])):
                logits = _logits(model(tokens[part], attention_mask=attention_mask[part])).float()
            mask = loss_mask[part].to(logits.device)
            if check_finite and not bool(torch.isfinite(logits[mask]).all()):
                raise ValueError("the model's logits are not finite (NaN or inf) on the clean sequences: check its "
                                 "weights for NaN or inf")
            target = targets[part].to(logits.device)
            nats = F.cross_entropy(logits.transpose(1, 2), target, reduction="none") * mask
            right = (logits.argmax(-1) == target) & mask
            for row in range(logits.shape[0]):
                rows.append(dict(sequence=start + row, loss=float(nats[row].sum() / mask[row].sum()),
                                 exact_match=float(bool(right[row].sum() == mask[row].sum()))))
    return pd.DataFrame(rows)


def _logits(output) -> Tensor:
    return output.logits if hasattr(output, "logits") else output


def behavior_change(clean: pd.DataFrame, changed: pd.DataFrame, n_boot: int, seed: int) -> list[dict]:
    """Mean loss and exact match, clean and changed, with a paired bootstrap CI of the change."""
    rows = []
    for metric in ("loss", "exact_match"):
        delta = changed[metric].to_numpy() - clean[metric].to_numpy()
        low, high = _mean_ci(delta, n_boot, seed)
        rows.append(dict(metric=metric, clean=float(clean[metric].mean()), value=float(changed[metric].mean()),
                         delta=float(delta.mean()), delta_ci_low=low, delta_ci_high=high))
    return rows


def _mean_ci(values: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap 95 % CI of a mean (SciPy); a constant sample has a zero-width CI."""
    if np.ptp(values) == 0:
        return float(values[0]), float(values[0])
    result = stats.bootstrap((values,), np.mean, n_resamples=n_boot, method="percentile",
                             random_state=random_state(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def sink_ablation(model, tokens: Tensor, attention_mask: Tensor, n_layers: int, settings: ProbeSettings,
                  modes: Sequence[str] = SINK_MODES, blocks: Sequence[int] | None = None,
                  targets: Tensor | None = None, loss_mask: Tensor | None = None,
                  progress: bool = False, subject: Subject | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
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
        condition="clean", ablated_block=np.nan)
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


# ----------------------------------------------------------------------------- position directions


@dataclass(frozen=True)
class IndexDirection:
    """The absolute-index direction of a ridge probe, in residual-stream units.

    prediction(x) = (x - center) . weights + intercept, from the ``Pipeline(RoundoffScaler,
    GroupedRidgeCV)`` of :func:`~nopelens.probes.make_probe` (penalty chosen by CV grouped by
    sequence): weights = coef / scale, center = the scaler's mean (features whose spread is only
    round-off have infinite scale, hence weight 0).

    Attributes:
        layer: DESIGN.md layer the probe reads.
        weights: ``[d_model]``, positions per unit of residual stream.
        center: ``[d_model]``.
        intercept: the prediction at ``center``.
    """

    layer: int
    weights: Tensor
    center: Tensor
    intercept: float

    @classmethod
    def fit(cls, acts: Activations, layer: int, seed: int = 0) -> "IndexDirection":
        """Fit a regression probe for the index on every sample of ``acts`` at ``layer``."""
        site = resid_site(layer)
        pipeline = make_probe("regression", seed=seed, dtype=acts.dtype(site)).fit(
            acts.features(site), acts.position, linear__groups=acts.sequence_id)
        scaler, ridge = pipeline[0], pipeline[-1]
        weights = torch.as_tensor(ridge.coef_ / scaler.scale_, dtype=torch.float64)
        if not bool(torch.isfinite(weights).all()) or float(weights.norm()) == 0:
            raise ValueError(f"the index probe at layer {layer} has no usable direction (zero or non-finite weights)")
        return cls(layer, weights.float(), torch.as_tensor(scaler.mean_, dtype=torch.float32), float(ridge.intercept_))

    def predict(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "..."]:
        """The probe's index read of residual states."""
        return (resid.double() - self.center.double()) @ self.weights.double() + self.intercept

    def shift(self, k: float) -> HookList:
        """Hooks moving every state at this layer by k w / |w|^2 (the probe then reads i + k)."""
        step = self.weights.double() / self.weights.double().pow(2).sum()
        return [(resid_site(self.layer), shift_hook(step.float(), k))]

    def project_out(self) -> HookList:
        """Hooks removing the states' component along w (about the probe's center)."""
        return [(resid_site(self.layer), project_out_hook(self.weights, self.center))]


def clean_probe_reads(clean: Activations, changed: Activations, site: str, n_splits: int, seed: int) -> tuple[float, float]:
    """Out-of-fold: fit an index probe on the clean states of the fitting sequences and read the
    changed states of the held-out ones. Returns (R^2 of that read, mean read minus clean read)."""
    y, groups = clean.position, clean.sequence_id
    X_clean, X_changed = clean.features(site), changed.features(site)
    read_clean, read_changed = np.empty(len(y)), np.empty(len(y))
    for fit, score in sequence_splits(groups, n_splits):
        probe = make_probe("regression", seed=seed, dtype=clean.dtype(site)).fit(
            X_clean[fit], y[fit], linear__groups=groups[fit])
        read_clean[score], read_changed[score] = probe.predict(X_clean[score]), probe.predict(X_changed[score])
    r2 = r2_score(y, read_changed)
    return float(r2), float(np.mean(read_changed - read_clean))


def direction_interventions(model, tokens: Tensor, attention_mask: Tensor, n_layers: int, settings: ProbeSettings,
                            layers: Sequence[int] | None = None, shifts: Sequence[int] = (4,),
                            targets: Tensor | None = None, loss_mask: Tensor | None = None,
                            progress: bool = False) -> pd.DataFrame:
    """Project out or shift the index direction at each layer; read the next layers and the loss.

    For each intervened layer l (default 1 .. n_layers - 1) and each later layer l' >= l, one row
    per intervention (``project_out``, ``shift`` with ``k``): ``r2_refit`` (a probe refitted on the
    changed states, out of fold), ``r2_clean_probe`` and ``read_shift`` (an out-of-fold probe fitted
    on clean states reads the changed ones: R^2, and mean read minus clean read, in positions;
    ``read_shift / k`` is the fraction of the shift the later layer carries), and ``loss_delta``
    and ``exact_match_delta`` of the whole model with their paired CIs. ``progress``: a bar over
    the intervened layers.
    """
    layers = list(range(1, n_layers)) if layers is None else list(layers)
    sites = [resid_site(layer) for layer in range(n_layers + 1)]
    clean = later_tokens(collect(model, tokens, sites, attention_mask=attention_mask, batch_size=32))
    clean_behavior = behavior(model, tokens, attention_mask, targets, loss_mask, check_finite=True)
    rows = []
    for layer in progress_bar(layers, desc="index directions", unit="layer", disable=not progress):
        direction = IndexDirection.fit(clean, layer, settings.seed)
        for name, k, hooks in [("project_out", 0, direction.project_out())] + [
                ("shift", k, direction.shift(k)) for k in shifts]:
            with intervention(model, hooks):
                changed = later_tokens(collect(model, tokens, sites[layer:], attention_mask=attention_mask, batch_size=32))
            effect = {f"{row['metric']}_{key}": row[key] for row in behavior_change(
                clean_behavior, behavior(model, tokens, attention_mask, targets, loss_mask, hooks),
                settings.n_boot, settings.seed) for key in ("delta", "delta_ci_low", "delta_ci_high")}
            refit = probe_absolute_index(changed, sites=sites[layer:], tasks=("regression",), controls=False,
                                         n_splits=settings.n_splits, n_boot=settings.n_boot, seed=settings.seed)
            refit = refit[(refit["probe"] == "linear") & (refit["metric"] == "r2")].set_index("site")
            for read_layer in range(layer, n_layers + 1):
                site = resid_site(read_layer)
                r2_clean_probe, read_shift = clean_probe_reads(clean, changed, site, settings.n_splits, settings.seed)
                rows.append(dict(intervention=name, k=k, layer=layer, read_layer=read_layer,
                                 r2_refit=refit.loc[site, "value"], r2_refit_ci_low=refit.loc[site, "ci_low"],
                                 r2_refit_ci_high=refit.loc[site, "ci_high"], r2_clean_probe=r2_clean_probe,
                                 read_shift=read_shift, **effect))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- activation patching


def shifted_copy(tokens: Tensor, shift: int, keep_first: bool) -> Tensor:
    """The sequences with ``shift`` tokens dropped after the first (``keep_first``, e.g. BOS) or at the start.

    The token at index i >= shift (+1 with ``keep_first``) of ``tokens`` sits at i - shift in the copy.
    """
    start = 1 if keep_first else 0
    if not 1 <= shift <= tokens.shape[1] - start - 2:
        raise ValueError(f"shift must lie in 1..{tokens.shape[1] - start - 2} for sequences of {tokens.shape[1]} tokens, got {shift}")
    return torch.cat([tokens[:, :start], tokens[:, start + shift:]], dim=1)


def position_patching(model, tokens: Tensor, n_layers: int, settings: ProbeSettings, shift: int | None = None,
                      positions: Sequence[int] | None = None, keep_first: bool = True,
                      progress: bool = False) -> pd.DataFrame:
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
            raise ValueError(f"patched positions must lie in {low}..{length - 1} (the copy holds those tokens), got {position}")
    read_site = resid_site(n_layers)
    sites = act_names("resid_pre", n_layers)
    original = collect(model, tokens, sites + [read_site])
    source = collect(model, copy, sites + [read_site])
    probe = make_probe("regression", seed=settings.seed, dtype=original.dtype(read_site)).fit(
        original.features(read_site), original.position, linear__groups=original.sequence_id)
    clean_cache = {site: torch.from_numpy(source.acts[site]).reshape(len(copy), copy.shape[1], -1) for site in sites}
    read_r2, _ = clean_probe_reads(original, original, read_site, settings.n_splits, settings.seed)
    read_original = probe.predict(original.features(read_site)).reshape(tokens.shape)
    read_copy = probe.predict(source.features(read_site)).reshape(copy.shape)

    rows = []
    for position in progress_bar(positions, desc="position patching", unit="position", disable=not progress):
        before, after = read_original[:, position], read_copy[:, position - shift]
        for layer, site in enumerate(sites):
            replacement = torch.from_numpy(source.acts[site]).reshape(len(copy), copy.shape[1], -1)[:, position - shift]
            patched = collect(model, tokens, [read_site], batch_size=32,
                              hooks=lambda rows, mask, site=site, replacement=replacement: [
                                  (site, patch_position_hook(position, replacement[rows]))])
            patched_read = probe.predict(patched.features(read_site)).reshape(tokens.shape)[:, position]
            scale = float(np.mean(after - before))
            if abs(scale) < MIN_READ_SHIFT * shift:
                moved = low_ci = high_ci = float("nan")
                note = (f"the last layer does not read the copy's index shift (copy - original = {scale:.2f}, "
                        f"not about -{shift}): no scale to normalize by")
            else:
                moved, low_ci, high_ci = _ratio_of_means(patched_read - before, after - before, settings.n_boot,
                                                          settings.seed)
                note = ""
            rows.append(dict(layer=layer, position=position, shift=shift, read_layer=n_layers, read_r2=read_r2,
                             original_read=float(before.mean()), copy_read=float(after.mean()),
                             patched_read=float(patched_read.mean()), moved=moved,
                             moved_ci_low=low_ci, moved_ci_high=high_ci, note=note))
    return pd.DataFrame(rows)


def patch_position_hook(position: int, replacement: Float[Tensor, "batch d_model"]) -> Callable:
    """A residual hook that puts ``replacement[b]`` at ``position`` of row b of the batch it sees
    (a batch of another size than ``replacement`` raises ValueError: make it per batch)."""

    def hook(resid: Tensor, hook) -> Tensor:
        if resid.shape[0] != replacement.shape[0]:
            raise ValueError(f"a patch made for {replacement.shape[0]} rows sees a batch of {resid.shape[0]}")
        resid = resid.clone()
        resid[:, position] = replacement.to(resid.device, resid.dtype)
        return resid

    return hook


def _ratio_of_means(numerator: np.ndarray, denominator: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float]:
    """mean(numerator) / mean(denominator) with a paired percentile bootstrap CI over sequences (SciPy)."""
    if np.mean(denominator) == 0:
        raise ValueError("the copy and the original read the same index: the patching effect has no scale")
    ratio = float(np.mean(numerator) / np.mean(denominator))
    if np.ptp(numerator) == 0 and np.ptp(denominator) == 0:
        return ratio, ratio, ratio
    result = stats.bootstrap((numerator, denominator), lambda a, b, axis=-1: a.mean(axis) / b.mean(axis),
                             paired=True, vectorized=True, n_resamples=n_boot, method="percentile",
                             random_state=random_state(seed))
    return ratio, float(result.confidence_interval.low), float(result.confidence_interval.high)


# ----------------------------------------------------------------------------- the sweep's section


def sink_ablation_drop(model, tokens: Tensor, attention_mask: Tensor, n_layers: int, clean: Activations,
                       n_splits: int = 5, n_boot: int = 200, seed: int = 0,
                       max_sequences: int | None = None) -> pd.DataFrame:
    """Per block l, absolute-index R^2 at layer l + 1, clean and with the first key removed in block l.

    The cheap form of :func:`sink_ablation` for the sweep: regression probes only, no controls,
    the clean states taken from activations already collected, and each ablated pass stopped at
    layer l + 1. Tokens after the first real one are probed (see the module docstring). On the
    same sequences and probe settings its R^2 values (and CIs) are those of :func:`sink_ablation`'s
    ``remove_key`` rows at layer l + 1: the sweep and ``nopelens intervene`` give one number. (The
    sweep once probed only its first 16 sequences, and the smaller fits read text-nope-4l's
    block-0 ablation as R^2 0.81 -> -0.04 where 80 sequences read 0.92 -> 0.42.)
    :func:`sink_ablation_drop_streamed` gives the same table in memory that does not grow with
    the tokens.

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
    common = dict(tasks=("regression",), controls=False, n_splits=n_splits, n_boot=n_boot, seed=seed)
    later_clean = later_tokens(clean)
    refused = refused_sink_blocks(model, n_layers, tokens, attention_mask)
    rows = []
    for block in range(n_layers):
        if block in refused:
            rows.append(_drop_row(block, note=refused[block]))
            continue
        site = resid_site(block + 1)
        ablated = later_tokens(collect(model, tokens, [site], attention_mask=attention_mask, batch_size=32,
                                       hooks=sink_batch_hooks(block, "remove_key")))
        rows.append(_drop_row(block, *(_linear_r2(probe_absolute_index(acts, sites=[site], **common), site)
                                      for acts in (later_clean, ablated))))
    return pd.DataFrame(rows, columns=DROP_COLUMNS)


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


def later_token_probes(sequences: Sequences, layers: Sequence[int], n_splits: int = 5, n_boot: int = 200,
                       seed: int = 0, keep: KeepBudget | int | str | None = "auto") -> Measurement:
    """The sink ablation's probe, streamed: regression for the index, no controls, on the tokens
    after the first real one (:func:`later_tokens`) at residual ``layers`` (DESIGN.md numbering);
    its table is :func:`~nopelens.probes.linear.probe_absolute_index`'s on the same samples
    (:func:`~nopelens.probes.stream_probes.absolute_index_probes` with ``min_position=1``).

    Raises:
        ValueError: as :func:`~nopelens.probes.stream_probes.absolute_index_probes` (too few
            sequences with a second token for the folds).
    """
    return absolute_index_probes(sequences, [resid_site(layer) for layer in layers], tasks=("regression",),
                                 controls=False, n_splits=n_splits, n_boot=n_boot, seed=seed, keep=keep,
                                 min_position=1)


def sink_ablation_drop_streamed(model, sequences: Sequences, n_layers: int, clean: pd.DataFrame,
                                refused: dict[int, str], n_splits: int = 5, n_boot: int = 200, seed: int = 0,
                                keep: KeepBudget | int | str | None = "auto", batch_size: int = 32,
                                progress: str | None = None) -> pd.DataFrame:
    """:func:`sink_ablation_drop`'s table, streamed (:func:`nopelens.probes.stream.run`): memory
    does not grow with the tokens past the keep budget.

    Per block l that is not ``refused``: one streamed run with block l's first real key removed
    (:func:`sink_batch_hooks`, each batch its own rows' first indices), probing layer l + 1 on the
    tokens after the first (:func:`later_token_probes`); each forward pass stops after that layer,
    so the n blocks cost about (n + 1) / 2 full passes (twice that for batches whose features do
    not fit the keep budget). The clean R^2 comes from ``clean``, the same probes measured in the
    caller's clean run (which hooks the sweep's sites, as the in-memory clean states were
    collected). On the same sequences, sites and settings the numbers equal
    :func:`sink_ablation_drop`'s up to float round-off of the sums (tests: 1e-8).

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
        (ablated,) = stream.run(model, sequences, [probe], batch_size=batch_size,
                                hooks=sink_batch_hooks(block, "remove_key"),
                                progress=progress and f"{progress}: sink ablation, block {block}")
        rows.append(_drop_row(block, _linear_r2(clean, site), _linear_r2(ablated, site)))
    return pd.DataFrame(rows, columns=DROP_COLUMNS)


def _linear_r2(table: pd.DataFrame, site: str) -> pd.Series:
    """The grouped linear probe's R^2 row of ``site`` in a probe table."""
    hit = table[(table["site"] == site) & (table["probe"] == "linear") & (table["metric"] == "r2")
                & (table["split"] == "grouped")]
    if hit.empty:
        raise KeyError(f"no linear R^2 of {site} in the probe table")
    return hit.iloc[0]


DROP_COLUMNS = ("block", "layer", "r2_clean", "r2_clean_ci_low", "r2_clean_ci_high", "r2_ablated", "r2_ablated_ci_low",
                "r2_ablated_ci_high", "drop", "status", "note")
"""The sink ablation table's columns, in order (whichever block comes first)."""


def _drop_row(block: int, clean: pd.Series | None = None, ablated: pd.Series | None = None, note: str = "") -> dict:
    """One row of the sink ablation table; without scores, a ``not_applicable`` row with ``note``."""
    row = dict(block=block, layer=block + 1)
    if clean is None:
        return dict(row, status="not_applicable", note=note)
    return dict(row, r2_clean=clean["value"], r2_clean_ci_low=clean["ci_low"], r2_clean_ci_high=clean["ci_high"],
                r2_ablated=ablated["value"], r2_ablated_ci_low=ablated["ci_low"],
                r2_ablated_ci_high=ablated["ci_high"], drop=clean["value"] - ablated["value"], status="measured",
                note="")


def subset_sequences(acts: Activations, n_sequences: int) -> Activations:
    """The samples of the first ``n_sequences`` sequences (ids 0 .. n - 1) of ``acts``."""
    keep = acts.sequence_id < n_sequences
    return Activations(acts={site: array[keep] for site, array in acts.acts.items()},
                       sequence_id=acts.sequence_id[keep], position=acts.position[keep], token=acts.token[keep])


# ----------------------------------------------------------------------------- nopelens intervene's run folder
#
# ``run_intervene`` writes: ``sink_probes.csv`` (every re-probe, clean and ablated, with ``delta``),
# ``sink_behavior.csv`` (loss and exact match per ablation, with paired CIs), ``directions.csv``,
# ``patching.csv``, ``summary.csv`` (one row per ablated block), the figure ``intervene.png``/``.svg``
# and the stamp ``intervene.json``. Each table is written atomically once it is done, so an
# interrupted run resumes from the tables already there (same settings only).


@dataclass(frozen=True)
class InterveneSettings:
    """What ``nopelens intervene`` measures; equal settings give equal numbers on CPU."""

    model: str
    n_sequences: int = 80  # the sweep's: its compact sink ablation then gives the same numbers
    seq_len: int = 64
    seed: int = 0
    n_splits: int = 5
    n_boot: int = 200
    modes: tuple[str, ...] = SINK_MODES
    shift: int = 4
    quick_steps: int | None = None

    def probes(self) -> ProbeSettings:
        return ProbeSettings(n_splits=self.n_splits, n_boot=self.n_boot, seed=self.seed)


def sink_summary(probes: pd.DataFrame, behavior: pd.DataFrame) -> pd.DataFrame:
    """One row per (mode, ablated block) l: absolute-index R^2 and accuracy at layer l + 1, the q.k
    distance read of block l + 1 (``qk_*``; none after the last block), each clean -> ablated, and the change in loss and exact match."""
    linear = probes[(probes["probe"] == "linear") & (probes["condition"] != "clean")]
    absolute = (linear["target"] == "absolute_index") & (linear["layer"] == linear["ablated_block"] + 1)
    next_read = (linear["target"] == "relative_distance") & (linear["block"] == linear["ablated_block"] + 1)
    linear = linear[absolute | next_read]
    rows = []
    for (mode, block), group in linear.groupby(["condition", "ablated_block"], sort=False):
        row = dict(condition=mode, ablated_block=int(block), next_layer=int(block) + 1)
        for name, target, metric, features in (("abs_r2", "absolute_index", "r2", "token"),
                                               ("abs_acc", "absolute_index", "accuracy", "token"),
                                               ("qk_r2", "relative_distance", "r2", None)):
            hit = group[(group["target"] == target) & (group["metric"] == metric)]
            if features is not None:
                hit = hit[hit["features"] == features]
            if len(hit):
                first = hit.iloc[0]
                row.update({f"{name}_clean": first["clean_value"], f"{name}": first["value"],
                            f"{name}_ci_low": first["ci_low"], f"{name}_ci_high": first["ci_high"],
                            f"{name}_delta": first["delta"]})
        measured = behavior[(behavior["condition"] == mode) & (behavior["ablated_block"] == block)]
        for _, b in measured.iterrows():
            if b.get("status") == "measured":
                row.update({f"{b['metric']}_delta": b["delta"], f"{b['metric']}_delta_ci_low": b["delta_ci_low"],
                            f"{b['metric']}_delta_ci_high": b["delta_ci_high"]})
        rows.append(row)
    return pd.DataFrame(rows)


def run_intervene(settings: InterveneSettings, out: Path, progress: bool = True) -> dict[str, pd.DataFrame]:
    """Measure ``settings.model`` and write (or resume) the run folder ``out``.

    Raises:
        ValueError: on settings that differ from the ones ``out`` was made with, fewer sequences
            than folds, or as :func:`~nopelens.analyses.subjects.resolve`.
        KeyError, FileNotFoundError: on a model spec that names nothing.
    """
    check_spec(settings.model)
    if settings.n_sequences < settings.n_splits:
        raise ValueError(f"{settings.n_sequences} sequences are fewer than the {settings.n_splits} folds; "
                         f"use --n-sequences {settings.n_splits} or more")
    for mode in settings.modes:
        if mode not in SINK_MODES:
            raise ValueError(f"unknown sink ablation mode {mode!r}; choose from {', '.join(SINK_MODES)}")
    if settings.shift == 0:
        raise ValueError("--shift must be non-zero (it is the k of 'as if the index were i + k')")
    if settings.seq_len < 4:  # shifted_copy: BOS, at least one dropped token and two more
        raise ValueError(f"--seq-len {settings.seq_len} is too short for position patching: it needs at least 4 tokens")
    runs.claim(out, "intervene", dataclasses.asdict(settings))
    say = (lambda text: print(f"nopelens: {text}", file=sys.stderr)) if progress else (lambda text: None)
    say(f"{settings.model}: loading")
    subject = resolve(settings.model, settings.n_sequences, settings.seq_len, settings.seed, progress,
                      settings.quick_steps)
    tables: dict[str, pd.DataFrame] = {}
    with torch.no_grad():
        tables.update(runs.cached_tables(out, ("sink_probes", "sink_behavior"), lambda: _sink(subject, settings, progress),
                                         say, "sink ablation"))
        tables.update(runs.cached_tables(out, ("directions",), lambda: _directions(subject, settings, progress), say,
                                         "index directions"))
        tables.update(runs.cached_tables(out, ("patching",), lambda: _patching(subject, settings, progress), say,
                                         "position patching"))
    tables["summary"] = sink_summary(tables["sink_probes"], tables["sink_behavior"]).assign(model=subject.name)
    write_csv_atomic(tables["summary"], out / "summary.csv")
    report.save_figure(report.intervention_figure(tables, subject.name), out / "intervene")
    return tables


def _sink(subject: Subject, settings: InterveneSettings, progress: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    probes, behavior = sink_ablation(subject.model, subject.tokens, subject.attention_mask, subject.n_layers,
                                        settings.probes(), settings.modes, targets=subject.targets,
                                        loss_mask=subject.loss_mask, progress=progress, subject=subject)
    return probes.assign(model=subject.name), behavior.assign(model=subject.name)


def _directions(subject: Subject, settings: InterveneSettings, progress: bool) -> tuple[pd.DataFrame]:
    if subject.n_layers < 2:
        return (pd.DataFrame({"note": ["one block: no layer has a later layer to read"]}),)
    table = direction_interventions(subject.model, subject.tokens, subject.attention_mask, subject.n_layers,
                                       settings.probes(), shifts=(settings.shift,), targets=subject.targets,
                                       loss_mask=subject.loss_mask, progress=progress)
    return (table.assign(model=subject.name),)


def _patching(subject: Subject, settings: InterveneSettings, progress: bool) -> tuple[pd.DataFrame]:
    if not bool(subject.attention_mask.all()):
        return (pd.DataFrame({"note": ["padded sequences: position patching needs sequences without padding"]}),)
    table = position_patching(subject.model, subject.tokens, subject.n_layers, settings.probes(),
                                 keep_first=subject.has_bos, progress=progress)
    return (table.assign(model=subject.name),)
