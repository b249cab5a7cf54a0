"""Audit steps 1, 2 and 4: which position ids the model used, their origin and sign, and the
absolute position vectors it adds."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from nopelens.models.methods import QK_ROTATION

from .numerics import agree, max_err
from .probe import Run, ids_list
from .report import Check, StepResult, by_reason, make_step


# ----------------------------------------------------------------------------- step 1
def step1_position_ids(run: Run) -> StepResult:
    """Step 1: the tokens, padding and special tokens of the probe, and the position ids used.

    Reads the ids the model actually used (the subject's own position evidence) and compares them
    with ``position_ids_from_mask`` at every real token; then checks that the left-padded row's
    logits equal the unpadded row's (left-padding invariance).
    """
    s, p = run.subject, run.probe
    checks, evidence = (
        [],
        {
            "tokens": p.tokens.tolist(),
            "attention_mask": p.mask.tolist(),
            "special_tokens": s.special_tokens,
            "expected_position_ids": ids_list(p.ids, p.real),
        },
    )
    if run.seen_ids is not None:
        seen = run.ids_used
        evidence["recorded_position_ids"] = ids_list(seen, p.real)
        bad = (seen != p.ids) & p.real
        detail = "position ids the model used equal position_ids_from_mask at every real token"
        if bad.any():
            b, i = bad.nonzero()[0].tolist()
            used = int(seen[b, i])
            used_text = "a position that cannot be decoded from its evidence" if used < 0 else f"position {used}"
            detail = f"row {b} token {i} used {used_text}, the mask gives {int(p.ids[b, i])}"
            if used >= 0 and b == 1 and used - int(p.ids[b, i]) == p.n_pad:
                detail += f": the left padding of {p.n_pad} is not subtracted"
        checks.append(Check("position ids derived from the mask", not bad.any(), detail))
    else:
        evidence["recorded_position_ids"] = "not observable: the model exposes no position evidence"
    n_real = p.tokens.shape[1] - p.n_pad
    reference = run.logits[0, :n_real]
    padded = run.logits[1, p.n_pad :]
    compared = f"logits of the left-padded row's {n_real} real tokens vs the same tokens unpadded"
    not_finite = run.padded_row_not_finite
    checks.append(
        agree(
            "left-padding invariance",
            padded,
            reference,
            run.logit_tol,
            compared if not_finite is None else f"{compared}: {not_finite}",
        )
    )
    evidence["left_padding"] = p.n_pad
    return make_step(
        1, checks, evidence, "probe batch recorded; left-padded row uses mask-derived ids and gives the unpadded logits"
    )


# ----------------------------------------------------------------------------- step 2
def step2_origin_and_sign(run: Run) -> StepResult:
    """Step 2: the index origin (first real token at 0) and each method's signed-offset convention.

    Per layer, the method's declarations choose the check: a q/k rotation must reproduce the
    scores as R(+p theta) (not R(-p theta)); a linear bias fitted against i - j must have the
    declared positive slopes; a table lookup must match at the declared offset, not the mirrored one.
    """
    s, p = run.subject, run.probe
    checks: list[Check] = []
    unreadable: dict[int, str] = {}
    evidence: dict[str, Any] = {
        "convention": "query i, key j, positions from 0; relative distance i - j >= 0 for visible keys; "
        "ALiBi bias -m_h (i - j); Shaw offset clip(j - i, -k, k); RoPE dot product depends on n - m "
        "(seed 002, column-vector convention)",
    }
    if run.seen_ids is not None and s.uses_positions:
        first = p.mask.argmax(-1)
        origin = run.ids_used.gather(1, first[:, None])[:, 0]
        evidence["first_real_token_position"] = origin.tolist()
        checks.append(
            Check(
                "index origin",
                bool((origin == 0).all()),
                f"first real token of each row at positions {origin.tolist()} (expected 0)",
            )
        )
    for layer, (layer_checks, layer_evidence, why) in run.layer_records(origin_and_sign_layer).items():
        checks += layer_checks
        evidence.update(layer_evidence)
        if why is not None:
            unreadable[layer] = why
    reason = None
    if not checks:
        reason = (
            by_reason(unreadable)
            if unreadable
            else "no position method with an origin or signed offset (NoPE: only the causal mask)"
        )
    relative = len(checks) > 1 or (checks and checks[0].name != "index origin")
    summary = (
        "first real token at 0; every relative method has its declared sign"
        if relative
        else "first real token of every row at position 0"
    )
    return make_step(2, checks, evidence, summary, reason)


def origin_and_sign_layer(run: Run, layer: int) -> tuple[list[Check], dict[str, Any], str | None]:
    """Step 2's part of one layer: the check its method's declarations choose (none, or the
    reason it cannot be read), and its evidence."""
    s, method = run.subject, run.subject.layer_methods[layer]
    checks: list[Check] = []
    evidence: dict[str, Any] = {}
    why = None
    if method.reads_positions and s.offset_zero_only(layer):
        why = (
            f"{s.key_window(layer).describe()}: each query sees only its own key (offset 0), "
            "so no offset's sign can show"
        )
        evidence[f"layer{layer}_offset_sign"] = f"not checked: {why}"
    elif method.acts(QK_ROTATION) and s.qk_unreadable(layer) is not None:
        why = s.qk_unreadable(layer)
        evidence[f"layer{layer}_rotation_direction"] = f"not checked: {why}"
    elif method.acts(QK_ROTATION):
        checks.append(_rotation_direction_check(run, layer, evidence))
    elif method.bias_kind == "linear":
        checks.append(_linear_bias_sign_check(run, layer, evidence))
    elif method.bias_kind == "lookup" and s.reads_tables:
        checks.append(_lookup_sign_check(run, layer, evidence))
    return checks, evidence, why


def _linear_bias_sign_check(run: Run, layer: int, evidence: dict) -> Check:
    """Fit bias_ij - bias_ii = -m_h (i - j) per head; expect m_h > 0, equal to the declared slopes."""
    p, method = run.probe, run.subject.layer_methods[layer]
    bias = run.position_contribution(layer)
    allowed = run.allowed(layer)[:, 0]
    distance = (p.ids[:, :, None] - p.ids[:, None, :]).double()  # i - j
    centered = bias - bias.diagonal(dim1=-2, dim2=-1)[..., :, None]
    fitted = []
    for h in range(run.subject.n_heads):
        c = centered[:, h][allowed]
        dd = distance[allowed]
        fitted.append(float(-(c * dd).sum() / (dd * dd).sum()))
    expected = run.subject.alibi_slopes(layer).tolist()
    evidence[f"layer{layer}_{method.name}_fitted_slopes"] = fitted
    evidence[f"layer{layer}_{method.name}_expected_slopes"] = expected
    err = max(abs(a - b) for a, b in zip(fitted, expected))
    bound = run.tol.of(torch.tensor(expected))
    penalizes = all(f > 0 for f in fitted)
    if not penalizes:
        verdict = "the bias REWARDS distant keys (sign flipped)"
    elif err > bound:
        ratios = [f / e for f, e in zip(fitted, expected) if e != 0]
        scale = f"{float(np.median(ratios)):.3g}x" if ratios else "other than"
        verdict = f"the bias penalizes distant keys, with slopes {scale} the declared m_h"
    else:
        verdict = "the bias penalizes distant keys with the declared slopes"
    return Check(
        f"layer {layer} {method.label} sign and slopes",
        penalizes and err <= bound,
        f"{verdict}: bias vs distance i - j fits slopes {[round(f, 5) for f in fitted]}, declared "
        f"+m_h = {[round(e, 5) for e in expected]}",
        err,
        bound,
    )


def _lookup_sign_check(run: Run, layer: int, evidence: dict) -> Check:
    """The recorded bias is the table at the declared relative ids, not at the mirrored ones."""
    p, s = run.probe, run.subject
    method, attn = s.layer_methods[layer], s.attention(layer)
    q = run.hook(layer, "hook_q").double()
    allowed = run.allowed(layer)
    rows = method.relative_ids(s.declaration, p.ids, p.ids)
    try:
        declared = method.reference_bias(attn, q, rows)
    except IndexError as error:  # the layer's table is smaller than the declaration needs
        return Check(
            f"layer {layer} {method.label} offset sign",
            False,
            f"the layer's {method.table_name} cannot be read at the ids of the declaration: {error}",
        )
    mirrored = method.reference_bias(attn, q, rows.transpose(1, 2))
    observed = run.position_contribution(layer)
    e_dec, e_mir = max_err(observed, declared, allowed), max_err(observed, mirrored, allowed)
    evidence[f"layer{layer}_{method.name}_error_j_minus_i"] = e_dec
    evidence[f"layer{layer}_{method.name}_error_i_minus_j"] = e_mir
    bound = run.tol.of(declared)
    return Check(
        f"layer {layer} {method.label} offset sign",
        e_dec <= bound,
        f"hook_pos_bias vs {method.table_name} at the declared offset {method.declared_offset}: "
        f"error {e_dec:.3g}; at the mirrored offset {method.mirrored_offset}: error {e_mir:.3g}",
        e_dec,
        bound,
    )


def _rotation_direction_check(run: Run, layer: int, evidence: dict) -> Check:
    """Which rotation sense reproduces the scores: R(+p theta) (declared) or R(-p theta).

    Both pairings are tried, so a pairing fault (step 5) does not read as a sign fault here.
    """
    scores = observed_content(run, layer)
    allowed = run.allowed(layer)
    errors = {
        (pairing, direction): max_err(scores, run.content(layer, pairing=pairing, direction=direction), allowed)
        for pairing in ("half", "interleaved")
        for direction in (1, -1)
    }
    evidence[f"layer{layer}_rope_errors"] = {
        f"{pairing} R({'+' if d > 0 else '-'}p)": e for (pairing, d), e in errors.items()
    }
    (pairing, direction), err = min(errors.items(), key=lambda item: item[1])
    bound = run.tol.of(scores[allowed.expand_as(scores)])
    if err > bound:
        return Check(
            f"layer {layer} RoPE rotation direction",
            False,
            f"no rotation of either pairing or sense reproduces the scores (best error {err:.3g}); see step 5",
            err,
            bound,
        )
    plus = min(errors[(pr, 1)] for pr in ("half", "interleaved"))
    minus = min(errors[(pr, -1)] for pr in ("half", "interleaved"))
    sense = "R(+p theta), so q.k depends on n - m" if direction > 0 else "R(-p theta): the sign is flipped"
    return Check(
        f"layer {layer} RoPE rotation direction",
        direction > 0,
        f"scores are reproduced by {sense} (error {plus:.3g} for R(+p theta), {minus:.3g} for R(-p theta))",
        err,
        bound,
    )


def observed_content(run: Run, layer: int) -> Tensor:
    """The q.k part of the scores as the model recorded it (bias-free layers: the scores)."""
    content = run.hook(layer, "hook_content_scores")
    if content is not None:
        return content.double()
    return run.scores(layer).masked_fill(~run.allowed(layer), 0.0)


# ----------------------------------------------------------------------------- step 4
def step4_absolute_additions(run: Run) -> StepResult:
    """Step 4: absolute position vectors are the declared rows, added to the embeddings.

    ``hook_pos_embed`` must equal the input method's reference (a learned table's rows, or its
    formula) at the position ids used, and ``blocks.0.hook_resid_pre`` = ``hook_embed`` +
    ``hook_pos_embed`` at every real token.
    """
    s, p = run.subject, run.probe
    if s.input_method is None:
        return make_step(4, [], {}, "", f"no absolute position addition (methods {s.method_names})")
    if "hook_pos_embed" not in run.cache.keys():
        return make_step(
            4,
            [],
            {},
            "",
            f"{s.input_name} positions are added, but the model's hook_pos_embed never "
            "fires, so the added rows cannot be read",
        )
    ids = run.ids_used.clamp(min=0)
    recorded = run.cache["hook_pos_embed"].double()
    reference, what = s.input_reference(ids, recorded.shape[-1]), s.input_method.reference_text
    offset = getattr(s, "position_offset", 0)
    if offset:
        what += f" (table rows at position + {offset}: the first {offset} rows are reserved)"
    real = p.real[..., None]
    checks = [agree("hook_pos_embed equals the table", recorded, reference, run.tol, what, real)]
    resid = run.cache["blocks.0.hook_resid_pre"].double()
    embed = run.cache["hook_embed"].double()
    checks.append(
        agree(
            "positions are added to the embeddings",
            resid,
            embed + recorded,
            run.tol,
            "blocks.0.hook_resid_pre = hook_embed + hook_pos_embed",
            real,
        )
    )
    evidence = {"method": s.input_name, "position_ids": ids_list(ids, p.real)}
    if s.input_method.fixed_formula:  # a formula's first values are worth showing
        first = recorded[0, 0, :4].tolist()
        evidence["row_at_position_0_first_dims"] = first
    return make_step(4, checks, evidence, f"{s.input_name} position rows are looked up at the used ids and added")
