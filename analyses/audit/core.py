"""The audit itself: wrap the model, build the probe batch, run the ten steps, assemble the report."""

from __future__ import annotations

from typing import Any, Callable

import torch
from jaxtyping import Int
from torch import Tensor
from transformers import PreTrainedModel

from nopelens.models import Decoder
from nopelens.models.adapters import HookedHFModel, HookedModule, load_hf_model
from nopelens.models.placement import model_device
from nopelens.probes import stream as probes_stream

from .hf import BridgeSubject, HookedSubject
from .hooked import audit_hooked
from .numerics import Tolerance
from .probe import Run, make_probe, stream, unpadded
from .report import AuditReport, StepResult, make_step
from .steps_lookups import rotations_and_lookups_layer, step5_rotations_and_lookups
from .steps_positions import origin_and_sign_layer, step1_position_ids, step2_origin_and_sign, step4_absolute_additions
from .steps_runtime import step8_interventions, step9_cached_decoding, step10_lengths
from .steps_scores import (
    masks_layer,
    score_parts_layer,
    softmax_layer,
    step3_masks_vs_biases,
    step6_score_parts,
    step7_softmax,
)
from .subjects import DecoderSubject, Subject


def make_subject(model: Any, name: str | None) -> tuple[Subject, dict[str, Any]]:
    """Wrap a Decoder, a TrainedModel, a TransformerBridge, a HookedHFModel or an HF model for the
    audit (here, not in :mod:`.subjects`, which :mod:`.hf` builds on: no import loop)."""
    metadata: dict[str, Any] = {}
    if hasattr(model, "model") and hasattr(model, "metadata") and isinstance(model.model, Decoder):
        metadata = dict(model.metadata or {})
        model = model.model
    if isinstance(model, Decoder):
        return DecoderSubject(model, name or f"Decoder({model.cfg.position_name})"), metadata
    if hasattr(model, "original_model") and hasattr(model, "blocks"):
        return BridgeSubject(model, name or type(model.original_model).__name__), metadata

    if isinstance(model, HookedHFModel):
        return HookedSubject(model, name or type(model.original_model).__name__), metadata
    if isinstance(model, PreTrainedModel):
        return make_subject(load_hf_model(model), name or type(model).__name__)[0], metadata
    raise TypeError(
        f"audit needs a nopelens Decoder, a TrainedModel, a TransformerBridge, a HookedHFModel or an HF causal LM; "
        f"got {type(model).__name__}"
    )


STEPS: list[Callable[[Run, int, dict], StepResult]] = [
    lambda run, shift, meta: step1_position_ids(run),
    lambda run, shift, meta: step2_origin_and_sign(run),
    lambda run, shift, meta: step3_masks_vs_biases(run),
    lambda run, shift, meta: step4_absolute_additions(run),
    lambda run, shift, meta: step5_rotations_and_lookups(run, shift),
    lambda run, shift, meta: step6_score_parts(run),
    lambda run, shift, meta: step7_softmax(run),
    lambda run, shift, meta: step8_interventions(run, shift),
    lambda run, shift, meta: step9_cached_decoding(run),
    lambda run, shift, meta: step10_lengths(run, meta),
]
"""Seed 002's audit order; each step takes the run, step 8's shift and the metadata."""
LAYER_REDUCERS = (origin_and_sign_layer, masks_layer, rotations_and_lookups_layer, score_parts_layer, softmax_layer)
"""The per-layer parts of steps 2, 3, 5, 6 and 7, run on each layer's hooks as the probe's forward
pass reaches the next layer (:func:`~.probe.stream`): the audit holds one layer's attention at a time."""
SPARSE_STEPS = (3, 5, 7, 8)
"""Steps whose checks assume the layer's mask is the static causal / window rule (masks, the
detector's compared entries and the rotation checks, softmax rows, interventions): not applicable
on a model whose indexer drops keys by content (DSA past ``index_topk``)."""
SPARSE_LAYOUT_CHECKS = {1: "left-padding invariance", 9: "cached logits = full forward"}
"""Checks that compare one sequence laid out two ways (left-padded; decoded through the cache):
with a DSA indexer past ``index_topk`` they may differ in the model itself, since its ReLU'd index
scores tie (exactly 0) and ``topk`` breaks ties by key index, which padding and cached decoding
change. Dropped (with the reason in the step's evidence); the step's other checks stand."""


def audit(
    model: Any,
    eval_length: int = 16,
    *,
    tokens: Int[Tensor, "... pos"] | None = None,
    metadata: dict[str, Any] | None = None,
    train_lengths: tuple[int, int] | list[int] | None = None,
    shift: int = 3,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    name: str | None = None,
) -> AuditReport:
    """Run seed 002's ten-step position audit on a model.

    The probe batch is two rows: ``eval_length`` tokens (random with ``seed`` unless ``tokens`` is
    given; an HF model's BOS id first), and the same tokens left-padded by ``eval_length // 4``
    pads. Every step reports pass / fail / not_applicable and its evidence; see the module
    docstring for what each step checks. The model is run in eval mode under ``torch.no_grad``
    and every submodule's training flag is restored afterwards.

    Args:
        model: a nopelens ``Decoder``, a ``TrainedModel`` (its metadata gives training lengths),
            a TransformerLens ``TransformerBridge`` from
            :func:`~nopelens.models.adapters.bridge_hf_model`, an HF causal LM (bridged here,
            which modifies it in place), or any module hooked by
            :func:`~nopelens.models.anymodel.hook_any` or a ``HookedModule`` (no declared position
            method: each step runs where what it needs is recorded, :mod:`.hooked`).
        eval_length: probe length in tokens, >= 4; at most the learned table's rows.
        tokens: optional int64 token ids ``[pos]`` (or ``[batch, pos]``: the first row is used).
        metadata: checkpoint metadata (``train_lengths`` = [min, max] and similar keys), merged
            over a ``TrainedModel``'s.
        train_lengths: training lengths, overriding the metadata.
        shift: the constant added to every position in step 8's shift intervention, >= 1.
        seed: seed of the random probe tokens.
        atol: agreement means max |a - b| <= atol + rtol * max |reference|; default: the
            tolerance of the model's compute dtype (:meth:`Tolerance.for_dtype`: float32 1e-5 and
            1e-4, bfloat16 and float16 4 eps).
        rtol: see ``atol``.
        name: label of the model in the report.

    Returns:
        An :class:`AuditReport`.

    Raises:
        TypeError: if ``model`` is of an unsupported type.
        ValueError: on a probe shorter than 4 tokens, longer than a learned table, a non-positive
            shift, train_lengths that are not [min, max] with 1 <= min <= max, or an HF config
            whose position method cannot be read.
    """
    meta = {}
    if isinstance(model, HookedModule):  # hook_any or a hand map: no declared position method
        subject = None
    else:
        subject, meta = make_subject(model, name)
    meta.update(metadata or {})
    if train_lengths is not None:
        if len(train_lengths) != 2 or not 1 <= train_lengths[0] <= train_lengths[1]:
            raise ValueError(f"train_lengths must be [min, max] with 1 <= min <= max, got {list(train_lengths)}")
        meta["train_lengths"] = list(train_lengths)
    if tokens is not None:
        eval_length = tokens.shape[-1]
    if not isinstance(eval_length, int) or eval_length < 4:
        raise ValueError(f"eval_length must be an integer >= 4, got {eval_length!r}")
    if not isinstance(shift, int) or shift < 1:
        raise ValueError(f"shift must be an integer >= 1, got {shift!r}")
    if subject is None:
        return audit_hooked(model, eval_length, tokens, seed, (atol, rtol), meta, name)
    if subject.max_positions is not None and eval_length > subject.max_positions:
        raise ValueError(
            f"eval_length={eval_length} is past the learned position table ({subject.max_positions} "
            "rows): those positions cannot be computed at all"
        )
    if not subject.attention_layers:
        raise ValueError(
            "the model has no attention layer (every block is a state-space, linear-attention or MLP "
            "block): the audit checks how attention reads positions, so there is nothing to audit"
        )
    shortfall = _memory_shortfall(subject, eval_length)
    if shortfall is not None:
        raise ValueError(shortfall)
    tol = Tolerance.for_dtype(subject.compute_dtype, atol, rtol)
    subject.position_limit = 2 * eval_length + shift + 64
    module = subject.model
    flags = [(m, m.training) for m in module.modules()]  # each submodule's own flag, restored below
    module.eval()
    try:
        with torch.no_grad():
            probe = make_probe(subject, eval_length, seed, tokens)
            run = stream(subject, probe, tol, LAYER_REDUCERS)
            if not bool(torch.isfinite(run.logits[0]).all()):  # nothing to compare: refused, not failed
                first = run.first_not_finite(0)
                where = (
                    f"first at {first}"
                    if first
                    else "every attention hook the audit caches is finite: "
                    "an MLP, the final norm or the unembedding gives them"
                )
                raise ValueError(
                    f"the model's logits are not finite on the probe's unpadded row (NaN or inf; {where}): "
                    "check its weights for NaN or inf"
                )
            steps = [STEPS[0](run, shift, meta)]
            left_out = run.padded_row_not_finite
            if left_out is not None:  # step 1 fails on it; the other steps read the unpadded row alone
                alone = unpadded(probe)
                run = stream(subject, alone, tol, LAYER_REDUCERS)
            steps += [run_step(run, shift, meta) for run_step in STEPS[1:]]
            reason = subject.unverifiable()
            if reason is not None:  # the position steps: not_applicable with the reason, never a false fail
                steps = [
                    make_step(step.number, [], {}, "", reason) if step.number in (2, 4, 5, 6, 8) else step
                    for step in steps
                ]
            sparse = subject.sparse_reason(int(probe.real.sum(-1).max()))
            if sparse is not None:  # the steps that hold patterns against a static mask
                steps = [_without_sparse(step, sparse) for step in steps]
    finally:
        for m, training in flags:
            m.training = training
    probe_record = {
        "tokens": probe.tokens.tolist(),
        "attention_mask": probe.mask.tolist(),
        "position_ids_from_mask": probe.ids.tolist(),
        "left_padding": probe.n_pad,
        "eval_length": eval_length,
        "seed": seed if tokens is None else None,
        "special_tokens": subject.special_tokens,
        "compute_dtype": tol.dtype,
        "tolerance": {"atol": tol.atol, "rtol": tol.rtol},
    }
    if left_out is not None:
        probe_record["padded_row_left_out"] = f"steps 2-10 read the unpadded row alone: {left_out}"
    model = subject.describe()
    if hasattr(run, "_readings") and sparse is None:  # the per-layer detector ran (step 5) on a static mask
        model["measured_layer_positions"] = [r.reading for r in run.readings]
    return AuditReport(model, probe_record, steps)


ROWS_HELD = 6
"""The most batch rows whose attention one pass holds: the detector's three copies (original,
re-spaced, shifted ids) of the two-row probe (:func:`~.detector.detect`)."""


def _memory_shortfall(subject: Subject, eval_length: int) -> str | None:
    """Why one layer's attention arrays cannot fit the memory free on the model's device, or None:
    the audit holds one layer's scores and pattern ``[n_heads, T, T]`` at a time, of at most
    :data:`ROWS_HELD` rows (a floor of what it needs; the forward passes and the float64 reductions
    add more), whatever the number of layers."""
    item = torch.finfo(subject.compute_dtype).bits // 8
    need = ROWS_HELD * 2 * subject.n_heads * eval_length**2 * item
    device = model_device(subject.model)
    free = probes_stream.available_memory(device)
    if need <= free:
        return None
    return (
        f"eval_length {eval_length:,} needs at least {need / 2**20:,.1f} MiB for one layer's scores and patterns "
        f"({ROWS_HELD} rows x [{subject.n_heads}, {eval_length:,}, {eval_length:,}], twice), more than the "
        f"{free / 2**20:,.1f} MiB free on {device.type}; give a smaller --eval-length"
    )


def _without_sparse(step: StepResult, sparse: str) -> StepResult:
    """``step`` as it stands where a DSA indexer selects keys by content (reason ``sparse``): the
    :data:`SPARSE_STEPS` not applicable, the :data:`SPARSE_LAYOUT_CHECKS` dropped, the rest kept."""
    if step.number in SPARSE_STEPS:
        return make_step(step.number, [], {}, "", sparse)
    dropped = SPARSE_LAYOUT_CHECKS.get(step.number)
    if dropped is None or step.status == "not_applicable":
        return step
    checks = [c for c in step.checks if c.name != dropped]
    evidence = {
        **step.evidence,
        "not_checked": f"{dropped}: {sparse}; which keys it keeps can change with the "
        "sequence's layout (its index scores tie and top-k breaks ties by key index)",
    }
    summary = step.summary if step.status == "pass" else f"the checks other than {dropped} pass"
    return make_step(step.number, checks, evidence, summary, sparse, step.warnings)
