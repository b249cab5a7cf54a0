"""The probe batch the audit runs (two rows: plain and left-padded) and one audit run's records."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from nopelens.models.hooks import act_name
from nopelens.models.masks import CAUSAL, KeyWindow, visibility
from nopelens.models.methods import SCORE_BIAS
from nopelens.models.placement import model_device
from nopelens.models.positions import position_ids_from_mask

from .detector import detect
from .numerics import Tolerance, rotate
from .streaming import HeldBytes, hold_by_layer
from .subjects import Subject, audited_hook


@dataclass
class Probe:
    tokens: Int[Tensor, "batch pos"]
    mask: Int[Tensor, "batch pos"]
    ids: Int[Tensor, "batch pos"]  # expected: position_ids_from_mask(mask)
    n_pad: int

    @property
    def real(self) -> Bool[Tensor, "batch pos"]:
        return self.mask.bool()

    def allowed(self, keys: KeyWindow = CAUSAL) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """Visible (query, key) pairs whose query is a real token (``keys``: a layer's window or chunk)."""
        length = self.tokens.shape[1]
        return visibility(self.mask, length, length, keys=keys) & self.real[:, None, :, None]

    def blocked(self, keys: KeyWindow = CAUSAL) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """Hidden (query, key) pairs (future, padded, or outside a window or chunk) whose query is real."""
        length = self.tokens.shape[1]
        return ~visibility(self.mask, length, length, keys=keys) & self.real[:, None, :, None]


def make_probe(subject: Subject, eval_length: int, seed: int, tokens: Tensor | None) -> Probe:
    if tokens is None:
        generator = torch.Generator().manual_seed(seed)
        row = torch.randint(0, subject.d_vocab, (eval_length,), generator=generator)
        bos = subject.special_tokens.get("bos_token_id")
        if isinstance(bos, int) and not 0 <= bos < subject.d_vocab:
            raise ValueError(f"bos_token_id {bos} is outside the vocabulary (0..{subject.d_vocab - 1})")
        if isinstance(bos, int):
            row[0] = bos
    else:
        if tokens.dtype.is_floating_point or tokens.ndim not in (1, 2):
            raise ValueError(f"tokens must be int64 [pos] or [batch, pos], got {tuple(tokens.shape)} {tokens.dtype}")
        row = tokens.reshape(-1, tokens.shape[-1])[0].long().cpu()
        if int(row.min()) < 0 or int(row.max()) >= subject.d_vocab:
            raise ValueError(f"token ids must lie in [0, {subject.d_vocab})")
    length = row.shape[0]
    if length < 4:
        raise ValueError(f"the probe needs at least 4 tokens, got {length}")
    n_pad = max(1, length // 4)
    pad = subject.special_tokens.get("pad_token_id")
    pad = pad if isinstance(pad, int) and 0 <= pad < subject.d_vocab else 0
    padded = torch.cat([torch.full((n_pad,), pad), row[: length - n_pad]])
    token_batch = torch.stack([row, padded])
    mask = torch.ones_like(token_batch)
    mask[1, :n_pad] = 0
    device = device_of(subject)
    token_batch, mask = token_batch.to(device), mask.to(device)
    return Probe(token_batch, mask, position_ids_from_mask(mask), n_pad)


def unpadded(probe: Probe) -> Probe:
    """The probe's first (unpadded) row alone."""
    return Probe(probe.tokens[:1], probe.mask[:1], probe.ids[:1], 0)


def device_of(subject: Subject) -> torch.device:
    return model_device(subject.model)


LayerReducer = Callable[["Run", int], Any]
"""A step's per-layer part: reduces one layer's hooked tensors (a :class:`Run` holding that layer's
hooks alone) to the small record the step aggregates over the layers."""
LAYER_HOOK = re.compile(r"^blocks\.(\d+)\.attn\.")
"""The hooks held one layer at a time (a layer's attention internals); the others (``hook_embed``,
``hook_pos_embed``, ``blocks.0.hook_resid_pre``) are O(T) and kept for the whole run."""


@dataclass
class Run:
    """One audit forward pass of the probe.

    ``cache`` holds the hooks kept for the whole run; a layer's attention hooks (``[batch, head,
    T, T]`` scores and patterns among them) are held only while that layer's reducers run
    (:func:`stream`), so ``records`` keeps what each step needs of each layer, not the tensors.
    """

    subject: Subject
    probe: Probe
    logits: Tensor | None
    cache: dict[str, Tensor]
    seen_ids: Tensor | None
    tol: Tolerance
    records: dict[Callable, dict[int, Any]] = field(default_factory=dict)
    not_finite: list[tuple[str, tuple[bool, ...], bool]] = field(default_factory=list)
    """Per hook, in execution order: whether each batch row has a value that is not finite, and
    (patterns) whether row 1 has one outside its padded queries."""
    peak_attention_bytes: int = 0
    """The most bytes of ``[..., T, T]`` hook tensors held at once by this run's passes."""

    @property
    def logit_tol(self):
        """The tolerance of logits, through every block (:meth:`Tolerance.through`)."""
        return self.tol.through(self.subject.n_layers)

    @property
    def readings(self) -> list:
        """The per-layer NoPE detector's readings (:func:`~nopelens.analyses.audit.detector.detect`),
        measured once per run."""
        if not hasattr(self, "_readings"):
            held = HeldBytes(self.probe.tokens.shape[1])
            self._readings = detect(self.subject, self.probe.tokens, self.probe.mask, self.tol, held=held)
            self.peak_attention_bytes = max(self.peak_attention_bytes, held.peak)
        return self._readings

    def layer_records(self, key: Callable) -> dict[int, Any]:
        """What reducer ``key`` gave for each layer, in layer order (a reducer's error re-raised here,
        where the step reads it, as it would have been raised by the step itself)."""
        records = self.records[key]
        for layer in sorted(records):
            if isinstance(records[layer], _Raised):
                raise records[layer].error
        return {layer: records[layer] for layer in sorted(records)}

    def allowed(self, layer: int) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """The (query, key) pairs layer ``layer`` may read: causal, padding, and its window or chunk."""
        return self.probe.allowed(self.subject.key_window(layer))

    def blocked(self, layer: int) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """The pairs layer ``layer`` must give exactly zero weight (real queries only)."""
        return self.probe.blocked(self.subject.key_window(layer))

    def hook(self, layer: int, name: str) -> Tensor | None:
        return self.cache.get(act_name(name, layer))

    def qk(self, layer: int) -> tuple[Tensor, Tensor]:
        """The q and k entering a layer's scores, before rotation (after any q/k norm)."""
        q_name, k_name = self.subject.qk_names(layer)
        return self.subject.prepare_qk(self.hook(layer, q_name), self.hook(layer, k_name), layer)

    def content(self, layer: int, ids: Tensor | None = None, pairing: str | None = None, direction: int = 1) -> Tensor:
        """q.k * scale of a layer, with q and k rotated by the reference when the layer is RoPE
        (row-centred where the model records no pre-softmax scores, see :meth:`scores`)."""
        q, k = self.qk(layer)
        spec = self.subject.rope_spec(layer)
        if spec is not None:
            ids = self.probe.ids if ids is None else ids
            q = rotate(q, ids, spec.rotary_dim, spec.base, pairing or spec.pairing, direction)
            k = rotate(k, ids, spec.rotary_dim, spec.base, pairing or spec.pairing, direction)
        return self.comparable(self.subject.content_scores(q, k, layer))

    def scores(self, layer: int) -> Tensor:
        """The pre-softmax scores: ``hook_attn_scores``; where that hook carries something else (the
        pattern), log(``hook_pattern``) at allowed keys: the scores less a per-row constant, so both
        sides of every comparison are then row-centred (:meth:`comparable`)."""
        if self.subject.scores_trusted:
            return self.hook(layer, "hook_attn_scores").double()
        allowed = self.allowed(layer)
        log_pattern = self.hook(layer, "hook_pattern").double().clamp(min=1e-300).log()
        return self.comparable(log_pattern.masked_fill(~allowed, 0.0))

    def comparable(self, scores: Tensor) -> Tensor:
        """``scores`` as compared with the model's: as they are, or row-centred (minus the score of
        each query with itself) when only the pattern records them."""
        if self.subject.scores_trusted:
            return scores
        return scores - scores.diagonal(dim1=-2, dim2=-1)[..., :, None]

    def position_contribution(self, layer: int) -> Tensor | None:
        """The score a method adds: ``hook_pos_bias`` where hooked, else scores - content (HF)."""
        if not self.subject.layer_methods[layer].acts(SCORE_BIAS):
            return None
        recorded = self.hook(layer, "hook_pos_bias")
        if recorded is not None:
            return recorded.double()
        allowed = self.allowed(layer)
        return (self.scores(layer) - self.content(layer)).masked_fill(~allowed, 0.0)

    def first_not_finite(self, row: int) -> str | None:
        """The first hook, in execution order, whose values for batch row ``row`` are not finite
        (None: every hooked value is)."""
        return next((name for name, rows, _ in self.not_finite if row < len(rows) and rows[row]), None)

    @functools.cached_property
    def padded_row_not_finite(self) -> str | None:
        """Why the left-padded row cannot be compared, or None: its logits are not finite where the
        unpadded row's are. Names the first hook (in execution order) where the row is not finite,
        and says when that is only at the padded queries, which every key is hidden from (a fully
        masked softmax row: HF's eager attention takes the softmax in float32, where a float64
        model's mask minimum overflows to -inf, and the row's NaN reaches the real tokens through
        zero weights on NaN values)."""
        if self.probe.n_pad == 0 or not bool(torch.isfinite(self.logits[0]).all()):
            return None
        if bool(torch.isfinite(self.logits[1]).all()):
            return None
        first = self.first_not_finite(1)
        where = "" if first is None else f"; not finite first at {first}"
        if first is not None and first.endswith("hook_pattern"):
            beyond_padding = next(bad for name, _, bad in self.not_finite if name == first)
            if not beyond_padding:
                where += f", only in the rows of its {self.probe.n_pad} padded queries (every key hidden from them)"
        return f"the left-padded row's logits are not finite{where}"

    @property
    def ids_used(self) -> Tensor:
        return self.seen_ids.expand_as(self.probe.ids) if self.seen_ids is not None else self.probe.ids


@dataclass
class _Raised:
    error: Exception


def layer_of(name: str) -> int | None:
    """The block of a layer-held hook (:data:`LAYER_HOOK`), None for the others."""
    match = LAYER_HOOK.match(name)
    return None if match is None else int(match.group(1))


def stream(subject: Subject, probe: Probe, tol: Tolerance, reducers) -> Run:
    """Run the probe once, reducing each layer's attention hooks as soon as the layer is complete.

    Every audited hook of layer ``l`` (:func:`~.subjects.audited_hook`) is held until the first hook
    of a later layer fires (or the pass ends); then each reducer runs on a :class:`Run` holding that
    layer's hooks (and the run-wide ones), its record is kept, and the tensors are dropped: the pass
    holds one layer's attention at a time, not every layer's. Layers whose hooks never fire (a mixer
    that is no attention) are reduced with none.

    Args:
        subject, probe, tol: the model, the probe batch and the compute dtype's tolerance.
        reducers: the steps' per-layer parts (:data:`LayerReducer`); each is the key of its records.

    Returns:
        The :class:`Run`: logits, the run-wide hooks, the position ids used and the records.
    """
    kept: dict[str, Tensor] = {}
    run = Run(subject, probe, None, kept, None, tol, {reducer: {} for reducer in reducers})
    held = HeldBytes(probe.tokens.shape[1])
    batch = probe.tokens.shape[0]

    def check_finite(name, x):
        if x.shape[:1] == (batch,):
            rows = tuple(_not_finite(name, x[row]) for row in range(batch))
            beyond = (
                batch > 1
                and rows[1]
                and name.endswith("hook_pattern")
                and not bool(torch.isfinite(x[1][:, probe.n_pad :]).all())
            )
            run.not_finite.append((name, rows, beyond))

    def reduce(layer, tensors):
        view = Run(subject, probe, None, {**kept, **tensors}, seen[0] if seen else None, tol)
        for reducer in reducers:
            try:
                run.records[reducer][layer] = reducer(view, layer)
            except Exception as error:  # raised where the step reads it (after the finiteness refusal)
                run.records[reducer][layer] = _Raised(error)

    names = [name for name in subject.model.hook_dict if audited_hook(name)]
    hooks, finish = hold_by_layer(names, layer_of, reduce, kept, held, check_finite)
    with subject.capture_position_ids() as seen:
        run.logits = subject.forward(probe.tokens, probe.mask, None, hooks)
        finish()
    run.seen_ids = seen[0] if seen else None
    for layer in range(subject.n_layers):
        if reducers and layer not in run.records[reducers[0]]:
            reduce(layer, {})
    run.peak_attention_bytes = held.peak
    return run


def _not_finite(name: str, values: Tensor) -> bool:
    """NaN or inf in a hook's values; in pre-softmax scores, -inf is a mask and counts as finite."""
    if name.endswith("hook_attn_scores"):
        return bool((torch.isnan(values) | torch.isposinf(values)).any())
    return not bool(torch.isfinite(values).all())


def ids_list(ids: Tensor, real: Tensor) -> list[list[int]]:
    return [[int(p) for p, r in zip(row, rrow) if r] for row, rrow in zip(ids.tolist(), real.tolist())]
