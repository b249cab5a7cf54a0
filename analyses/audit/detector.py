"""Which layers use positions, measured rather than read from a config: the per-layer NoPE detector.

A config can say a layer is NoPE and be wrong (SmolLM3's ``no_rope_layers`` is read both ways in
public: transformers issue 43756), and nopelens' own family rules can be wrong. The detector asks
the model. Every layer's input is held fixed at what a normal run gave it (``blocks.{l}.hook_resid_pre``
patched from that run), and the position ids are changed twice:

1. *re-spaced*: strictly increasing with random gaps of 1 to :data:`MAX_GAP` tokens, the first
   real token still at 0, so every offset i - j changes;
2. *shifted*: every position plus :data:`SHIFT`, so no offset changes.

With its input fixed, a layer that reads no positions computes exactly what it computed before
(NoPE: only the causal mask carries order): bitwise, since the same kernels run on the same inputs,
so ``nope`` needs a change of exactly zero; a nonzero change within round-off (a partial rotation
of a few dims in bfloat16) is ``undetermined`` and decides nothing. A layer that reads them changes under re-spacing; a
relative one (RoPE, ALiBi, a relative bias) does not change under the shift, an absolute one does.
What is compared is the layer's own attention as its softmax sees it: its pre-softmax scores where
the model records them, taken relative to the query's own key (a constant per query row, such as
Bloom's ALiBi term m_h j, never reaches the pattern), else the log of its pattern, at the keys the
layer may read; for a layer that is no softmax attention (a linear-attention or SSM mixer), the
block's output. "Unchanged" means within the compute dtype's relative tolerance
(:class:`~nopelens.analyses.audit.numerics.Tolerance` ``rtol`` of the scores' or outputs' scale;
row-centred log-pattern values are score differences, so the same, but at least twice ``rtol``,
the round-off of two pattern entries relative to themselves); a NoPE layer is in fact bitwise
unchanged. A change that is one factor
per query row (the scores times c_i) is a query temperature, ``query_scaled``. A layer whose scores
are flat to that tolerance (q.k about 0, uniform attention)
cannot show a rotation: it is reported ``flat`` and never counted as agreeing or disagreeing.

transformers treats position ids with gaps as *packed sequences* and masks across them when no
``attention_mask`` is passed (``find_packed_sequence_indices`` in ``transformers/masking_utils.py``);
the detector always passes the mask, so the re-spaced ids change positions and nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from nopelens.models.hooks import act_name, act_names
from nopelens.models.masks import visibility
from nopelens.models.positions import position_ids_from_mask

from .numerics import Tolerance
from .streaming import HeldBytes, hold_by_layer
from .subjects import Subject

MAX_GAP = 4
"""Re-spaced position ids step by 1 to MAX_GAP tokens."""
SHIFT = 5
"""The constant added to every position id in the shift run."""
READINGS = ("nope", "query_scaled", "relative", "absolute", "flat", "undetermined", "not_measured")
NOPE, QUERY_SCALED, RELATIVE, ABSOLUTE, FLAT, UNDETERMINED, NOT_MEASURED = READINGS
"""What the detector can say of a layer: reads no positions; only scales each query's scores by a
factor of its position (a temperature, Beam's NoPE layers); reads offsets only; reads absolute
positions; too flat to tell; changed, but by no more than round-off; not measured (the model takes
no position ids)."""


@dataclass
class LayerReading:
    """The detector's reading of one layer.

    Attributes:
        layer: block index.
        reading: one of :data:`READINGS`.
        declared: what the layer's declared method implies (``nope``, ``relative``, ``absolute``).
        quantity: what was compared: ``scores``, ``pattern`` or ``output``.
        respaced_change: max |change| under re-spaced ids (layer input fixed).
        shifted_change: max |change| under shifted ids, or None when not needed.
        spread: max over query rows of the spread of the compared quantity over the keys it reads.
        tolerance: the bar for "unchanged" (and for "flat").
    """

    layer: int
    reading: str
    declared: str
    quantity: str
    respaced_change: float | None = None
    shifted_change: float | None = None
    spread: float | None = None
    tolerance: float | None = None

    @property
    def agrees(self) -> bool | None:
        """True/False when the reading is definite, None when it is ``flat`` or ``not_measured`` or
        the declared method is unknown. A declared query scale may also read ``nope`` (its factor
        can be within round-off at the probe's positions)."""
        if self.reading in (FLAT, UNDETERMINED, NOT_MEASURED) or self.declared == "unknown":
            return None
        return self.reading == self.declared or (self.declared == QUERY_SCALED and self.reading == NOPE)

    def describe(self) -> str:
        if self.reading == NOT_MEASURED:
            return f"layer {self.layer}: not measured"
        text = (
            f"layer {self.layer} declared {self.declared}, measured {self.reading}: {self.quantity} change "
            f"{self.respaced_change:.3g} under re-spaced positions"
        )
        if self.shifted_change is not None:
            text += f", {self.shifted_change:.3g} under positions + {SHIFT}"
        if self.reading == FLAT:
            text += f"; its {self.quantity} are flat (spread {self.spread:.3g}), so a rotation could not show"
        if self.reading == UNDETERMINED:
            text += "; nonzero but within round-off, so it decides nothing"
        return text + f" (tolerance {self.tolerance:.3g})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def declared_reading(subject: Subject, layer: int) -> str:
    """What a layer's declared method implies the detector will read (``unknown`` where the
    subject does not know the layer's method)."""
    if subject.layer_names[layer] == "unknown":
        return "unknown"
    method = subject.layer_methods[layer]
    if not method.reads_positions:
        scale = subject.query_scale(layer)
        return QUERY_SCALED if scale is not None and scale.by == "position" else NOPE
    return ABSOLUTE if method.absolute else RELATIVE


def respaced_ids(ids: Tensor, mask: Tensor, seed: int = 0, limit: int | None = None) -> Tensor:
    """Strictly increasing position ids with random gaps of 1..MAX_GAP, first real token at 0.

    Padded entries keep their ids. With ``limit`` (a learned table's rows) the gaps shrink so the
    last id stays below it.

    Example:
        >>> ids = torch.tensor([[0, 1, 2, 3]]); mask = torch.ones_like(ids)
        >>> new = respaced_ids(ids, mask, seed=0)
        >>> int(new[0, 0]), bool((new.diff() >= 1).all()), bool((new != ids).any())
        (0, True, True)
    """
    generator = torch.Generator().manual_seed(seed)
    gaps = torch.randint(1, MAX_GAP + 1, tuple(ids.shape), generator=generator).to(ids.device)
    real = mask.bool()
    if limit is not None:
        n_real = int(real.sum(-1).max())
        room = (limit - 1) // max(1, n_real - 1) if n_real > 1 else MAX_GAP
        gaps = gaps.clamp(max=max(1, min(MAX_GAP, room)))
    gaps = gaps * real
    first = real.long().argmax(-1, keepdim=True)
    gaps.scatter_(1, first, 0)  # the first real token stays at 0
    new = gaps.cumsum(-1)
    return torch.where(real, new, ids)


def detect(
    subject: Subject, tokens: Tensor, mask: Tensor, tol: Tolerance, seed: int = 0, held=None
) -> list[LayerReading]:
    """Measure, per layer, whether it reads positions (module docstring).

    The original, re-spaced and shifted ids run as one batch (the probe's rows repeated): every
    block's input in the second and third copies is replaced by the first copy's, and each layer
    is read as soon as its hooks fire, so one layer's scores (or pattern) of the three copies are
    held at a time (:func:`~.streaming.hold_by_layer`).

    Args:
        subject: the audit's model.
        tokens, mask: int64 ``[batch, pos]``, the probe batch (left padding allowed).
        tol: the compute dtype's tolerance.
        seed: seed of the re-spacing gaps.
        held: a :class:`~.streaming.HeldBytes` that counts the bytes held (optional).

    Returns:
        One :class:`LayerReading` per layer (``not_measured`` everywhere when the model takes no
        position ids).
    """
    declared = [declared_reading(subject, layer) for layer in range(subject.n_layers)]
    attention = set(subject.attention_layers)
    quantity = {
        layer: ("scores" if subject.scores_trusted else "pattern") if layer in attention else "output"
        for layer in range(subject.n_layers)
    }
    if not subject.takes_positions:
        return [LayerReading(l, NOT_MEASURED, declared[l], quantity[l]) for l in range(subject.n_layers)]
    ids = position_ids_from_mask(mask)
    variants = [ids, respaced_ids(ids, mask, seed, subject.max_positions)]
    if subject.max_positions is None or int(ids.max()) + SHIFT < subject.max_positions:
        variants.append(ids + SHIFT)
    rows, copies = tokens.shape[0], len(variants)
    sites = {_site(layer, quantity[layer]): layer for layer in range(subject.n_layers)}
    readings: dict[int, LayerReading] = {}

    def read(layer, tensors):
        values = tensors[_site(layer, quantity[layer])].split(rows)
        readings[layer] = _reading(subject, layer, declared[layer], quantity[layer], mask, tol, *values)

    def hold_first(x, hook):  # every copy's block input is the first copy's
        return x[:rows].repeat(copies, *([1] * (x.ndim - 1)))

    held = held if held is not None else HeldBytes(tokens.shape[1])
    hooks, finish = hold_by_layer(
        [n for n in subject.model.hook_dict if n in sites], sites.get, read, {}, held, clone=True
    )
    # the reads first: a bridge may alias block l's resid_post (a site) with block l + 1's resid_pre
    hooks += [(name, hold_first) for name in act_names("resid_pre", subject.n_layers)]
    subject.forward(tokens.repeat(copies, 1), mask.repeat(copies, 1), torch.cat(variants), hooks)
    finish()
    return [readings[layer] for layer in range(subject.n_layers)]


def _reading(
    subject: Subject,
    layer: int,
    declared: str,
    kind: str,
    mask: Tensor,
    tol: Tolerance,
    base: Tensor,
    changed: Tensor,
    shifted: Tensor | None = None,
) -> LayerReading:
    """One layer's reading from its quantity with the original, re-spaced and shifted ids."""
    where = _compared(subject, layer, kind, mask)
    before = _as_softmax_sees(base, kind, where)
    scale = float(before[where.expand_as(before)].abs().max())
    # log p_ij - log p_ii = s_ij - s_ii: the round-off of scores of that scale, and at least that of
    # two pattern entries relative to themselves (2 rtol)
    bound = tol.rtol * (max(2.0, scale) if kind == "pattern" else scale)
    spread = _spread(before, where)
    after = _as_softmax_sees(changed, kind, where)
    delta = _change(after, before, where)
    shift = None
    if delta > bound:
        shift = _change(_as_softmax_sees(shifted, kind, where), before, where) if shifted is not None else None
        reading = RELATIVE if shift is not None and shift <= bound else ABSOLUTE
        if shift is None:
            reading = RELATIVE if declared == RELATIVE else ABSOLUTE
        if kind != "output" and _row_scaled(after, before, where, bound):
            reading = QUERY_SCALED
    elif spread <= bound:
        reading = FLAT
    else:  # a layer that reads no positions computes bitwise the same; round-off-sized changes decide nothing
        reading = NOPE if delta == 0.0 else UNDETERMINED
    return LayerReading(layer, reading, declared, kind, delta, shift, spread, bound)


def _site(layer: int, quantity: str) -> str:
    return act_name({"scores": "attn_scores", "pattern": "pattern", "output": "resid_post"}[quantity], layer)


def _compared(subject: Subject, layer: int, quantity: str, mask: Tensor) -> Tensor:
    """The entries compared: keys the layer may read from real queries, or the real tokens' outputs."""
    real = mask.bool()
    if quantity == "output":
        return real[:, :, None]
    length = mask.shape[1]
    return visibility(mask, length, length, keys=subject.key_window(layer)) & real[:, None, :, None]


def _as_softmax_sees(values: Tensor, quantity: str, where: Tensor) -> Tensor:
    """Scores, or log-pattern values, relative to the query's own key (log p_ij - log p_ii =
    s_ij - s_ii: the same numbers), or outputs as they are (float64; entries outside ``where`` 0)."""
    values = values.double()
    if quantity == "pattern":
        values = values.clamp(min=1e-300).log()
    if quantity in ("scores", "pattern"):
        own = values.diagonal(dim1=-2, dim2=-1)[..., :, None]
        values = (values - own).masked_fill(~where.expand_as(values), 0.0)
    return values


def _row_scaled(after: Tensor, before: Tensor, where: Tensor, bound: float) -> bool:
    """Whether the change is one factor per query row (scores times c_i), to ``bound``: a query
    temperature, which no rotation or offset bias gives. A row with one compared key besides its own
    fits any factor, so with no row of two or more (a window of 2) the test cannot tell: False."""
    where = where.expand_as(before)
    own = torch.eye(where.shape[-1], dtype=torch.bool, device=where.device)
    if not bool(((where & ~own).sum(-1) >= 2).any()):
        return False
    a, b = after.masked_fill(~where, 0.0), before.masked_fill(~where, 0.0)
    norm = (b * b).sum(-1, keepdim=True)
    factor = torch.where(norm > 0, (a * b).sum(-1, keepdim=True) / norm.clamp(min=1e-300), torch.ones_like(norm))
    return float((a - factor * b).abs().max()) <= bound


def _change(after: Tensor, before: Tensor, where: Tensor) -> float:
    diff = (after.double() - before.double()).abs()[where.expand_as(before)]
    return float(diff.max()) if diff.numel() else 0.0


def _spread(values: Tensor, where: Tensor) -> float:
    """Max over rows of (max - min) of ``values`` at the compared entries (keys of one query row)."""
    values = values.double()
    if values.ndim == 4:  # [batch, head, query, key]: the spread within each query row
        where = where.expand_as(values)
        high = values.masked_fill(~where, float("-inf")).amax(-1)
        low = values.masked_fill(~where, float("inf")).amin(-1)
        spread = (high - low)[where.any(-1)]
    else:  # block outputs [batch, pos, d_model]: their spread over the real tokens
        picked = values[where.expand_as(values)]
        spread = picked.max() - picked.min() if picked.numel() else torch.zeros(())
    return float(spread.max()) if spread.numel() else 0.0
