"""Audit steps 3, 6 and 7: masks against biases, the parts of the scores, and the softmax."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nopelens.models.hf import softmax_with_sink
from nopelens.models.hooks import act_name
from nopelens.models.methods import SCORE_BIAS
from nopelens.models.positions import alibi_bias

from .numerics import agree, dot_scores, max_err
from .probe import Run
from .report import Check, StepResult, by_reason, make_step
from .streaming import HeldBytes, hold_by_layer


# ----------------------------------------------------------------------------- step 3
def masks_layer(run: Run, layer: int) -> dict | None:
    """Step 3's part of one layer: its extreme allowed and blocked weights, scores and bias."""
    s = run.subject
    if layer not in s.attention_layers:
        return None
    allowed, blocked = run.allowed(layer), run.blocked(layer)
    pattern = run.hook(layer, "hook_pattern").double()
    record = {
        "min_allowed": float(pattern[allowed.expand_as(pattern)].min()),
        "max_blocked": float(pattern[blocked.expand_as(pattern)].abs().max()),
        "blocked_scores_ok": True,
        "allowed_finite": True,
        "worst_bias": None,
    }
    if s.scores_trusted:
        scores = run.hook(layer, "hook_attn_scores").double()
        record["blocked_scores_ok"] = bool((scores[blocked.expand_as(scores)] <= run.tol.masked_score).all())
        record["allowed_finite"] = bool(scores[allowed.expand_as(scores)].isfinite().all())
    bias = run.position_contribution(layer)
    if bias is not None:
        record["worst_bias"] = float(bias[allowed.expand_as(bias)].abs().max())
    return record


def step3_masks_vs_biases(run: Run) -> StepResult:
    """Step 3: the mask blocks keys exactly; finite score biases never do.

    Blocked entries (future or padded keys of real queries) must have weight exactly 0 and scores
    at -inf (or <= -1e30); allowed entries keep weight > 0 and finite scores. Where a layer adds a
    score bias, a rerun with every bias dropped must change the scores but not the blocked set.
    """
    s = run.subject
    checks, evidence = [], {}
    records = [r for r in run.layer_records(masks_layer).values() if r is not None]
    min_allowed, max_blocked = [r["min_allowed"] for r in records], [r["max_blocked"] for r in records]
    worst_bias = [r["worst_bias"] for r in records if r["worst_bias"] is not None]
    blocked_scores_ok = all(r["blocked_scores_ok"] for r in records)
    allowed_finite = all(r["allowed_finite"] for r in records)
    windows = {
        layer: s.key_window(layer).describe() for layer in s.attention_layers if not s.key_window(layer).causal_only
    }
    if windows:
        evidence["windows"] = windows
    evidence.update(min_allowed_weight=min_allowed, max_blocked_weight=max_blocked, largest_bias=worst_bias)
    checks.append(
        Check(
            "blocked entries have exactly zero weight",
            max(max_blocked) == 0.0,
            f"max weight on a blocked (future or padded) key: {max(max_blocked):.3g}",
            max(max_blocked),
            0.0,
        )
    )
    checks.append(
        Check(
            "allowed entries keep weight > 0",
            min(min_allowed) > 0.0,
            f"min weight on an allowed key {min(min_allowed):.3g}"
            + (f", under biases up to {max(worst_bias):.3g}" if worst_bias else ""),
            min(min_allowed),
        )
    )
    if s.scores_trusted:
        checks.append(
            Check(
                "mask is -inf (or the dtype minimum), biases finite",
                blocked_scores_ok and allowed_finite,
                f"blocked scores <= {run.tol.masked_score:.3g} and every allowed score finite"
                if blocked_scores_ok and allowed_finite
                else "a blocked score is finite-valued or an allowed score is not finite",
            )
        )
    else:
        evidence["masked_scores"] = (
            "not checked: the model records no pre-softmax scores (its hook_attn_scores "
            "carry the pattern); blocked weights are checked on hook_pattern"
        )
    bias_layers = s.layers_acting(SCORE_BIAS)
    if bias_layers:
        drop = _drop_bias(run, bias_layers)
        if drop is not None:
            checks += drop[0]
            evidence.update(drop[1])
        else:
            evidence["drop_bias"] = "not applicable: this model exposes no way to drop its score bias"
    else:
        evidence["drop_bias"] = "not applicable: no finite score bias in any layer"
    return make_step(3, checks, evidence, "masks give exactly-zero weight; finite biases never block a key")


def _drop_bias(run: Run, layers: list[int]) -> tuple[list[Check], dict] | None:
    """Run the probe twice in one batch, every score bias dropped in the second copy: the scores
    change, the blocked set does not. Each bias layer's scores and pattern are compared as soon as
    they fire (:func:`~.streaming.hold_by_layer`), one layer at a time."""
    s, p = run.subject, run.probe
    rows = p.tokens.shape[0]
    wanted = {act_name(n, l): l for l in layers for n in ("attn_scores", "pattern")}
    real_rows = p.real[:, None, :, None]
    same_blocked, changed = [], {}

    def compare(layer, tensors):
        allowed = run.allowed(layer)
        pattern, scores = tensors[act_name("pattern", layer)], tensors[act_name("attn_scores", layer)]
        before, after = pattern[:rows], pattern[rows:]
        same_blocked.append(bool(((before == 0) == (after == 0))[real_rows.expand_as(before)].all()))
        changed[layer] = max_err(scores[:rows], scores[rows:], allowed)

    held = HeldBytes(p.tokens.shape[1])
    hooks, finish = hold_by_layer(
        [n for n in s.model.hook_dict if n in wanted], wanted.get, compare, {}, held, clone=True
    )
    if not s.forward_without_bias(p.tokens.repeat(2, 1), p.mask.repeat(2, 1), hooks, rows=slice(rows, None)):
        return None
    finish()
    run.peak_attention_bytes = max(run.peak_attention_bytes, held.peak)
    changed = [changed[layer] for layer in layers]
    bound = run.tol.of(run.logits)
    checks = [
        Check(
            "dropping the bias keeps the blocked set",
            all(same_blocked),
            "entries with zero weight are the same with and without the position bias",
        ),
        Check(
            "dropping the bias changes the scores",
            min(changed) > bound,
            f"max score change per bias layer {[round(c, 6) for c in changed]}",
            min(changed),
            bound,
        ),
    ]
    return checks, {"drop_bias_score_change": changed}


# ----------------------------------------------------------------------------- step 6
def score_parts_layer(run: Run, layer: int) -> tuple[list[Check], bool, str | None] | None:
    """Step 6's part of one layer: its checks, whether its content was derived, why its q and k
    cannot be read (or None)."""
    s = run.subject
    if layer not in s.attention_layers:
        return None
    if s.qk_unreadable(layer) is not None:
        return [], False, s.qk_unreadable(layer)
    method, checks = s.layer_methods[layer], []
    allowed = run.allowed(layer)
    scores = run.scores(layer)
    content_hook = run.hook(layer, "hook_content_scores")
    q_rot = run.hook(layer, "hook_rot_q")
    if content_hook is not None:
        q = q_rot if q_rot is not None else run.hook(layer, "hook_q")
        k = run.hook(layer, "hook_rot_k") if q_rot is not None else run.hook(layer, "hook_k")
        checks.append(
            agree(
                f"layer {layer} content = q.k / sqrt(d_head)",
                content_hook,
                dot_scores(q, k, s.score_scale(layer)),
                run.tol,
                "hook_content_scores recomputed from the hooked q and k",
                allowed,
            )
        )
        content = content_hook.double()
    else:
        content = run.content(layer)
    bias = run.position_contribution(layer)
    if bias is None or content_hook is not None:  # a derived bias adds up by construction
        total = content + (bias if bias is not None else 0.0)
        checks.append(
            agree(
                f"layer {layer} content + position = scores",
                scores,
                total,
                run.tol,
                f"{method.name}: "
                + ("content + position bias" if bias is not None else "content only (no score bias)"),
                allowed,
            )
        )
    if method.bias_kind == "linear":
        ids = run.ids_used.clamp(min=0)
        reference = alibi_bias(s.alibi_slopes(layer).to(ids.device), ids, ids).double()
        observed = bias
        if content_hook is None:  # HF adds slope * p_j; compare up to the per-row constant
            observed = bias - bias.diagonal(dim1=-2, dim2=-1)[..., :, None]
        checks.append(
            agree(
                f"layer {layer} {method.label} position contribution",
                observed,
                reference,
                run.tol,
                method.reference_text + (" (row-centred)" if content_hook is None else ""),
                allowed,
            )
        )
    return checks, content_hook is None, None


def step6_score_parts(run: Run) -> StepResult:
    """Step 6: content scores and position contributions, recorded separately, add up to the scores.

    ``hook_content_scores`` is recomputed from the hooked (rotated) q and k; content + position
    bias must equal ``hook_attn_scores`` at allowed entries; a linear bias must equal the declared
    -m_h (i - j). Where a model hooks no separate parts (HF), content is recomputed from
    ``hook_q``/``hook_k`` and the position part is the difference.
    """
    checks, evidence, derived, unreadable = [], {}, [], {}
    for layer, record in run.layer_records(score_parts_layer).items():
        if record is None:
            continue
        layer_checks, was_derived, why = record
        checks += layer_checks
        if why is not None:
            unreadable[layer] = why
        elif was_derived:
            derived.append(layer)
    if derived:
        evidence["derived_content_layers"] = derived
        evidence["note"] = (
            "the bridge hooks no separate content or bias scores; content is recomputed from "
            "hook_q/hook_k (rotated by the reference for RoPE) and the position part is "
            "hook_attn_scores - content"
        )
    reason = None
    if unreadable:
        evidence["q_k_not_read"] = {str(layer): why for layer, why in unreadable.items()}
        reason = by_reason(unreadable)
    return make_step(
        6, checks, evidence, "content and position parts are recorded separately and add up to the scores", reason
    )


def _output_scale(run: Run, layer: int, pattern: Tensor) -> Tensor | None:
    """The factor c of each real (query, head) in hook_z = c * (pattern @ hook_v): an output-scale
    sink's 1 - p_sink (see :class:`nopelens.probes.sinks.SinkStats`); None unhooked."""
    v, z = run.hook(layer, "hook_v"), run.hook(layer, "hook_z")
    if v is None or z is None:
        return None
    v = v.double().repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)
    weighted = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
    norm = (weighted * weighted).sum(-1)
    scale = (z.double() * weighted).sum(-1) / norm.clamp(min=1e-300)
    return scale[run.probe.real]


# ----------------------------------------------------------------------------- step 7
def softmax_layer(run: Run, layer: int) -> dict | None:
    """Step 7's part of one layer: its softmax errors, row sums, sink mass and blocked weights."""
    s, p = run.subject, run.probe
    if layer not in s.attention_layers:
        return None
    real_rows = p.real[:, None, :, None]
    blocked = run.blocked(layer)
    pattern = run.hook(layer, "hook_pattern").double()
    kind, logits = s.sink(layer)
    extra = kind in ("learned", "per_token")
    record = {"key": None, "query": None, "sink_mass": None, "over_one": None, "sum": None}
    if s.scores_trusted:
        scores = run.hook(layer, "hook_attn_scores").double()
        record["key"] = max_err(pattern, softmax_with_sink(scores, logits if extra else None), real_rows)
        record["query"] = max_err(pattern, scores.softmax(-2), real_rows)
    sums = pattern.sum(-1)[p.real[:, None].expand(-1, pattern.shape[1], -1)]
    if kind == "output_scale":
        scale = _output_scale(run, layer, pattern)
        if scale is not None:
            record["sink_mass"], record["over_one"] = float((1 - scale).mean()), float((scale - 1).max())
    if extra:
        record["sink_mass"], record["over_one"] = float((1 - sums).mean()), float((sums - 1).max())
    else:
        record["sum"] = float((sums - 1).abs().max())
    record["block"] = float(pattern[blocked.expand_as(pattern)].abs().max())
    return record


def step7_softmax(run: Run) -> StepResult:
    """Step 7: patterns are softmaxes of the combined scores over the key axis.

    ``hook_pattern`` = softmax(``hook_attn_scores``, key axis) (the query-axis softmax is reported
    for contrast), every real query row sums to 1, and blocked entries are exactly 0. A layer with a
    learned sink (one more logit per head in the denominator, :func:`~nopelens.models.hf.softmax_with_sink`)
    has rows summing to 1 - p_sink instead: the sink must take mass (p_sink > 0 beyond round-off)
    and no row may exceed 1; where the scores are recorded, the pattern must equal the softmax with
    the model's own sink logits. An output-scale sink (Granite SWA) leaves the pattern a plain softmax.
    """
    s, p = run.subject, run.probe
    checks = []
    records = {layer: r for layer, r in run.layer_records(softmax_layer).items() if r is not None}
    worst_key = max([0.0] + [r["key"] for r in records.values() if r["key"] is not None])
    worst_query = min([math.inf] + [r["query"] for r in records.values() if r["query"] is not None])
    sink_mass = {layer: r["sink_mass"] for layer, r in records.items() if r["sink_mass"] is not None}
    over_one = max([0.0] + [r["over_one"] for r in records.values() if r["over_one"] is not None])
    plain = any(r["sum"] is not None for r in records.values())
    worst_sum = max([0.0] + [r["sum"] for r in records.values() if r["sum"] is not None])
    worst_block = max([0.0] + [r["block"] for r in records.values()])
    bound = run.tol.atol
    evidence: dict = {"padded_query_rows_excluded": p.n_pad}
    if s.scores_trusted:
        checks.append(
            Check(
                "softmax over the key axis",
                worst_key <= bound,
                f"hook_pattern = softmax(hook_attn_scores, key axis){' with the learned sinks' if sink_mass else ''}"
                f": error {worst_key:.3g}; over the query axis it would be {worst_query:.3g}",
                worst_key,
                bound,
            )
        )
    else:
        evidence["softmax_axis"] = (
            "not checked: the model records no pre-softmax scores (its hook_attn_scores "
            "carry the pattern, or it is hooked without the bridge)"
        )
    if plain:
        checks.append(
            Check(
                "unmasked rows sum to 1",
                worst_sum <= bound,
                f"max |row sum - 1| over real query rows {worst_sum:.3g}",
                worst_sum,
                bound,
            )
        )
    if sink_mass:
        evidence["mean_sink_mass_per_layer"] = {str(l): m for l, m in sink_mass.items()}
        least = min(sink_mass.values())
        checks.append(
            Check(
                "declared sinks take mass",
                least > bound and over_one <= bound,
                f"mean p_sink per sink layer {[round(m, 4) for m in sink_mass.values()]} (1 - row sum, "
                f"or 1 - the output scale; must be > {bound:.3g}: a declared sink takes mass); largest "
                f"row sum (or scale) - 1 {over_one:.3g}",
                least,
                bound,
            )
        )
    checks.append(
        Check(
            "blocked entries exactly 0",
            worst_block == 0.0,
            f"max weight at blocked entries {worst_block:.3g}",
            worst_block,
            0.0,
        )
    )
    summary = "patterns are key-axis softmaxes; rows sum to 1; blocked entries are exactly 0"
    if sink_mass:
        summary = (
            "patterns are key-axis softmaxes (learned sinks in the denominator); rows sum to 1, or to "
            "1 - p_sink on sink layers; blocked entries are exactly 0"
        )
    return make_step(7, checks, evidence, summary)
