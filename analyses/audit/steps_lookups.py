"""Audit step 5: q/k rotations (RoPE) and relation lookups (Shaw, T5) against their references."""

from __future__ import annotations

from dataclasses import asdict

import torch

from nopelens.models.methods import QK_ROTATION
from nopelens.models.positions import apply_rope, rope_angles

from .detector import SHIFT
from .numerics import agree, max_err
from .probe import Run
from .report import Check, StepResult, make_step
from .steps_positions import observed_content


# ----------------------------------------------------------------------------- step 5
def step5_rotations_and_lookups(run: Run, shift: int) -> StepResult:
    """Step 5: q/k rotations and relation lookups match the reference at the declared parameters.

    Every layer first: the per-layer detector (:mod:`.detector`) measures with the layer's input
    held fixed whether it reads positions (nope, relative or absolute), and a layer whose
    measurement disagrees with its declared method fails, named. Then RoPE layers:
    ``hook_rot_q = R(p) hook_q`` and ``hook_rot_k = R(p) hook_k`` at the declared
    pairing, fraction and base (the other pairing's error is reported), unrotated dims pass
    through, HF's ``hook_cos`` equals cos(p theta_r), the scores equal R(p)q . R(p)k / sqrt(d_head),
    and shifting every position leaves the rotated dot products unchanged. Lookup layers (Shaw,
    T5): ``hook_pos_bias`` equals the model's table at the declared relative ids, and a value term
    (Shaw's a^V) is in ``hook_z``. A learned bias by token-index distance (Inkling 2's, extent
    ``rel_extent``): ``hook_pos_bias`` is exactly 0 at every distance i - j >= the extent and at
    future keys, and nonzero at every distance below it (the extent is the declared one, both ways).
    """
    s = run.subject
    rope_layers = s.layers_acting(QK_ROTATION)
    lookup_layers = [l for l, m in enumerate(s.layer_methods) if m.bias_kind == "lookup"]
    records = run.layer_records(rotations_and_lookups_layer)
    checks, evidence = _detector_checks(run)
    bias_layers = [l for l in s.attention_layers if s.relative_bias(l) is not None]
    for layer in bias_layers:
        _merge(records[layer]["relative"], checks, evidence)
    if not rope_layers and not lookup_layers and not checks:
        reason = f"no Q/K rotation or relation lookup (methods {s.method_names})"
        if evidence.get("measured"):
            reason += "; " + evidence["measured_note"]
        return make_step(5, [], evidence, "", reason)
    if rope_layers:
        specs = {layer: s.rope_spec(layer) for layer in rope_layers}
        same = len({(sp.rotary_dim, sp.base, sp.pairing) for sp in specs.values()}) == 1
        evidence["rope"] = asdict(specs[rope_layers[0]]) if same else {l: asdict(sp) for l, sp in specs.items()}
        for layer in rope_layers:
            _merge(records[layer]["rope"], checks, evidence)
        checks += _rope_offset_checks(run, rope_layers, shift, evidence)
    for layer in lookup_layers:
        _merge(records[layer]["lookup"], checks, evidence)
    referenced = [l for l in rope_layers if s.qk_unreadable(l) is None] + lookup_layers
    summary = (
        "every layer reads positions as declared (measured); rotations / lookups match the reference "
        "at the declared pairing, fraction and offsets"
        if referenced
        else "every layer reads positions as declared (measured with its input held fixed)"
    )
    if bias_layers:
        summary += "; relative biases act exactly within their declared extent"
    return make_step(5, checks, evidence, summary)


def _merge(part: tuple[list[Check], dict], checks: list[Check], evidence: dict) -> None:
    checks += part[0]
    evidence.update(part[1])


def rotations_and_lookups_layer(run: Run, layer: int) -> dict[str, tuple[list[Check], dict]]:
    """Step 5's parts of one layer (checks and evidence): its relative bias by token distance, its
    rotation, and its table lookup, each where the layer has one."""
    s, parts = run.subject, {}
    if layer in s.attention_layers and s.relative_bias(layer) is not None:
        evidence: dict = {}
        parts["relative"] = (_relative_bias_checks(run, layer, evidence), evidence)
    if s.layer_methods[layer].acts(QK_ROTATION):
        evidence = {}
        parts["rope"] = (_rotation_checks(run, layer, evidence), evidence)
    if s.layer_methods[layer].bias_kind == "lookup":
        evidence = {}
        parts["lookup"] = (_lookup_checks(run, layer, evidence), evidence)
    return parts


def _rotation_checks(run: Run, layer: int, evidence: dict) -> list[Check]:
    """A RoPE layer's rotated q and k, HF's cos, and its scores against the declared reference."""
    s, p = run.subject, run.probe
    if s.qk_unreadable(layer) is not None:
        evidence[f"layer{layer}_rotation"] = f"not checked against the reference: {s.qk_unreadable(layer)}"
        return []
    ids = run.ids_used.clamp(min=0)
    real_q = p.real[:, :, None, None]
    checks = []
    spec = s.rope_spec(layer)
    other = "interleaved" if spec.pairing == "half" else "half"
    q, k = run.qk(layer)
    rot_q = run.hook(layer, "hook_rot_q")
    if rot_q is not None:
        declared = apply_rope(q, ids, spec.rotary_dim, spec.base, spec.pairing)
        swapped = apply_rope(q, ids, spec.rotary_dim, spec.base, other)
        e_other = max_err(rot_q, swapped, real_q)
        check = agree(
            f"layer {layer} hook_rot_q = R(p) hook_q",
            rot_q,
            declared,
            run.tol,
            f"pairing {spec.pairing} (the {other} pairing gives error {e_other:.3g})",
            real_q,
        )
        if not check.passed and e_other <= check.tolerance:
            check.detail += f"; the rotation matches the {other} pairing instead of the declared {spec.pairing}"
        checks.append(check)
        rot_k = run.hook(layer, "hook_rot_k")
        checks.append(
            agree(
                f"layer {layer} hook_rot_k = R(p) hook_k",
                rot_k,
                apply_rope(k, ids, spec.rotary_dim, spec.base, spec.pairing),
                run.tol,
                f"rotary_dim {spec.rotary_dim}, base {spec.base:g}",
                real_q,
            )
        )
        if spec.rotary_dim < q.shape[-1]:
            checks.append(
                agree(
                    f"layer {layer} dims past rotary_dim pass through",
                    rot_q[..., spec.rotary_dim :],
                    q[..., spec.rotary_dim :],
                    run.tol,
                    f"{q.shape[-1] - spec.rotary_dim} of {q.shape[-1]} dims unrotated "
                    f"(rotary_fraction {spec.rotary_dim / q.shape[-1]:g})",
                    real_q,
                )
            )
    cos = run.hook(layer, "hook_cos")
    if cos is not None:
        half = spec.rotary_dim // 2
        angles = rope_angles(ids, spec.rotary_dim, spec.base, dtype=torch.float64)
        layouts = {
            "half": torch.cat([angles.cos(), angles.cos()], -1),  # [theta_0.., theta_0..]
            "interleaved": angles.cos().repeat_interleave(2, -1),
        }  # [theta_0, theta_0, ..]
        observed = cos.expand(ids.shape[0], -1, -1)[..., : 2 * half]
        errors = {name: max_err(observed, ref, p.real[..., None]) for name, ref in layouts.items()}
        layout = min(errors, key=errors.get)  # how HF lays out cos is bookkeeping, not the pairing
        checks.append(
            agree(
                f"layer {layer} hook_cos = cos(p theta_r)",
                observed,
                layouts[layout],
                run.tol,
                f"{half} frequencies base {spec.base:g} (HF's {layout} cos layout)",
                p.real[..., None],
            )
        )
    checks.append(_rope_scores_check(run, layer, other, evidence))
    return checks


def _detector_checks(run: Run) -> tuple[list[Check], dict]:
    """Declared against measured, per layer: a definite reading that disagrees fails, named."""
    readings = run.readings
    evidence = {
        "measured": [r.reading for r in readings],
        "declared": [r.declared for r in readings],
        "detector": [r.describe() for r in readings],
    }
    undecided = [r.layer for r in readings if r.agrees is None]
    notes = {
        "flat": "too flat to tell (scores within round-off)",
        "undetermined": "changed within round-off only",
        "not_measured": "not measured (the model takes no position ids)",
    }
    evidence["measured_note"] = "; ".join(
        f"layers {[r.layer for r in readings if r.reading == k]} {v}"
        for k, v in notes.items()
        if any(r.reading == k for r in readings)
    )
    checks = []
    for r in readings:
        if r.agrees is None:
            continue
        name = f"layer {r.layer} reads positions as declared ({r.declared})"
        checks.append(Check(name, bool(r.agrees), r.describe(), r.respaced_change, r.tolerance))
    if undecided:
        evidence["undecided_layers"] = undecided
    return checks, evidence


def _rope_scores_check(run: Run, layer: int, other: str, evidence: dict) -> Check:
    observed = observed_content(run, layer)
    allowed = run.allowed(layer)
    declared = run.content(layer)
    e_other = max_err(observed, run.content(layer, pairing=other), allowed)
    evidence[f"layer{layer}_scores_error_other_pairing"] = e_other
    same = " (with one rotated pair the two pairings coincide)" if run.subject.rope_spec(layer).rotary_dim == 2 else ""
    return agree(
        f"layer {layer} scores = R(p)q . R(p)k / sqrt(d_head)",
        observed,
        declared,
        run.tol,
        f"scores vs the reference with the declared pairing, fraction and base ({other} "
        f"pairing: error {e_other:.3g}{same})",
        allowed,
    )


def _rope_offset_checks(run: Run, layers: list[int], shift: int, evidence: dict) -> list[Check]:
    """Shift every position by a constant: the rotated dot products of RoPE layers do not change.

    Measured by the detector's shift run, with each layer's input held at its unshifted value (so
    round-off from earlier layers does not pile up, which in half precision it would): the layer's
    scores (or log-pattern) relative to the query's own key, before and after.
    """
    s = run.subject
    if s.input_method is not None or not s.takes_positions:
        return []

    checks = []
    for reading in run.readings:
        if reading.layer not in layers or reading.shifted_change is None:
            continue
        checks.append(
            Check(
                f"layer {reading.layer} rotated q.k depends only on the offset",
                reading.shifted_change <= reading.tolerance,
                f"{reading.quantity} with every position + {SHIFT} (the layer's input held fixed) vs the "
                f"originals: change {reading.shifted_change:.3g}",
                reading.shifted_change,
                reading.tolerance,
            )
        )
    return checks


def _lookup_checks(run: Run, layer: int, evidence: dict) -> list[Check]:
    """``hook_pos_bias`` (and a value term) against the layer's own table at the relative ids of
    the declaration (the model config), as RoPE's references use the declared base and fraction."""
    s, p = run.subject, run.probe
    if not s.reads_tables:
        return []
    method, attn, declared = s.layer_methods[layer], s.attention(layer), s.declaration
    ids = run.ids_used.clamp(min=0)
    rel_ids = method.relative_ids(declared, ids, ids)
    q = run.hook(layer, "hook_q").double()
    name = f"layer {layer} {method.label} {method.table_name} lookup"
    try:
        reference = method.reference_bias(attn, q, rel_ids)
    except IndexError as error:  # the layer's table is smaller than the declaration needs
        return [
            Check(
                name,
                False,
                f"the layer's {method.table_name} cannot be read at the ids of the declaration "
                f"({method.lookup_formula(declared)}): {error}",
            )
        ]
    allowed = run.allowed(layer)
    checks = [
        agree(name, run.hook(layer, "hook_pos_bias"), reference, run.tol, method.lookup_formula(declared), allowed)
    ]
    evidence[f"layer{layer}_{method.name}_{method.ids_evidence_name}"] = method.ids_evidence(
        declared, rel_ids[allowed[:, 0]]
    )
    pattern = run.hook(layer, "hook_pattern").double()
    value_term = method.reference_value_term(attn, pattern, rel_ids)
    if value_term is not None:
        v = run.hook(layer, "hook_v").double()
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
        z = z + value_term
        checks.append(
            agree(
                f"layer {layer} {method.label} {method.value_table_name} lookup",
                run.hook(layer, "hook_z"),
                z,
                run.tol,
                method.value_formula,
                p.real[:, :, None, None],
            )
        )
    return checks


def _relative_bias_checks(run: Run, layer: int, evidence: dict) -> list[Check]:
    """A bias by token-index distance i - j, zero outside 0 <= i - j < extent (Inkling 2's
    ``Inkling2RelativePositionBias``; ``get_relative_distance`` counts token indices, not position
    ids, so the detector, which re-spaces position ids, cannot see it: this reads the bias itself)."""
    extent = run.subject.relative_bias(layer)
    bias = run.hook(layer, "hook_pos_bias")
    if bias is None:
        evidence[f"layer{layer}_relative_bias"] = (
            f"a learned bias by token-index distance i - j < {extent} is "
            "declared, but no hook_pos_bias records it: not verified"
        )
        return []
    bias = bias.double()
    index = torch.arange(bias.shape[-1], device=bias.device)
    distance = index[:, None] - index[None, :]
    real = run.probe.real
    pairs = (real[:, None, :, None] & real[:, None, None, :]).expand_as(bias)
    beyond = pairs & ((distance >= extent) | (distance < 0))
    outside = float(bias[beyond].abs().max()) if beyond.any() else 0.0
    within = range(min(extent, int(real.sum(-1).max())))
    silent = [d for d in within if float(bias[pairs & (distance == d)].abs().max()) == 0.0]
    evidence[f"layer{layer}_relative_bias"] = (
        f"bias by token-index distance, extent {extent}: read from "
        "hook_pos_bias (position ids do not enter it, so the detector cannot)"
    )
    return [
        Check(
            f"layer {layer} relative bias is zero beyond rel_extent {extent}",
            outside == 0.0,
            f"max |hook_pos_bias| at token distances i - j >= {extent} or < 0 ({int(beyond.sum())} entries): "
            f"{outside:.3g}",
            outside,
            0.0,
        ),
        Check(
            f"layer {layer} relative bias acts below rel_extent {extent}",
            not silent,
            f"hook_pos_bias is nonzero somewhere at every distance 0..{len(within) - 1}"
            + (f"; exactly 0 at distances {silent}" if silent else ""),
            float(len(silent)),
            0.0,
        ),
    ]
