"""The probe batch the audit runs (two rows: plain and left-padded) and one audit run's records."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from nopelens.models.hooks import act_name
from nopelens.models.masks import CAUSAL, KeyWindow, visibility
from nopelens.models.methods import SCORE_BIAS
from nopelens.models.positions import position_ids_from_mask

from .detector import detect
from .numerics import Tolerance, rotate
from .subjects import Subject


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
    return next(subject.model.parameters()).device


@dataclass
class Run:
    subject: Subject
    probe: Probe
    logits: Tensor
    cache: Any
    seen_ids: Tensor | None
    tol: Tolerance

    @property
    def logit_tol(self):
        """The tolerance of logits, through every block (:meth:`Tolerance.through`)."""
        return self.tol.through(self.subject.n_layers)

    @property
    def readings(self) -> list:
        """The per-layer NoPE detector's readings (:func:`~nopelens.analyses.audit.detector.detect`),
        measured once per run."""
        if not hasattr(self, "_readings"):
            self._readings = detect(self.subject, self.probe.tokens, self.probe.mask, self.tol)
        return self._readings

    def allowed(self, layer: int) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """The (query, key) pairs layer ``layer`` may read: causal, padding, and its window or chunk."""
        return self.probe.allowed(self.subject.key_window(layer))

    def blocked(self, layer: int) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """The pairs layer ``layer`` must give exactly zero weight (real queries only)."""
        return self.probe.blocked(self.subject.key_window(layer))

    def hook(self, layer: int, name: str) -> Tensor | None:
        key = act_name(name, layer)
        return self.cache[key] if key in self.cache.keys() else None

    def qk(self, layer: int) -> tuple[Tensor, Tensor]:
        """The q and k entering a layer's scores, before rotation (after any q/k norm)."""
        q_name, k_name = self.subject.qk_names(layer)
        return self.subject.prepare_qk(self.hook(layer, q_name), self.hook(layer, k_name), layer)

    def content(self, layer: int, ids: Tensor | None = None, pairing: str | None = None,
                direction: int = 1) -> Tensor:
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
        """The first cached hook, in execution order, whose values for batch row ``row`` are not
        finite (None: every cached value is)."""
        batch = self.probe.tokens.shape[0]
        return next((name for name in self.cache.keys()
                     if self.cache[name].shape[:1] == (batch,) and _not_finite(name, self.cache[name][row])), None)

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
            bad = ~torch.isfinite(self.cache[first][1])  # [head, query, key]
            if not bool(bad[:, self.probe.n_pad:].any()):
                where += f", only in the rows of its {self.probe.n_pad} padded queries (every key hidden from them)"
        return f"the left-padded row's logits are not finite{where}"

    @property
    def ids_used(self) -> Tensor:
        return self.seen_ids.expand_as(self.probe.ids) if self.seen_ids is not None else self.probe.ids


def _not_finite(name: str, values: Tensor) -> bool:
    """NaN or inf in a hook's values; in pre-softmax scores, -inf is a mask and counts as finite."""
    if name.endswith("hook_attn_scores"):
        return bool((torch.isnan(values) | torch.isposinf(values)).any())
    return not bool(torch.isfinite(values).all())


def ids_list(ids: Tensor, real: Tensor) -> list[list[int]]:
    return [[int(p) for p, r in zip(row, rrow) if r] for row, rrow in zip(ids.tolist(), real.tolist())]
