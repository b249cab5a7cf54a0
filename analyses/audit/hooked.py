"""The audit of a module hooked with no declared position method (:func:`nopelens.models.anymodel.hook_any`,
:class:`~nopelens.models.adapters.HookedModule`).

Such a module declares nothing: no position method per layer, no tokenizer or padding convention,
no KV cache nopelens can drive. Each step runs where what it needs is recorded, and is
``not_applicable`` with its reason where not:

- step 1 compares a left-padded row with the unpadded one where the forward takes ``attention_mask``
  and ``position_ids``;
- step 3 (masks) and step 7 (softmax) run on the recorded ``hook_attn_scores`` and ``hook_pattern``
  of the intercepted attention calls, under the window each call was recorded under (a pattern that
  is no distribution is refused in one line, as by every other read);
- step 5's per-layer detector runs where positions can be set (the forward takes ``position_ids``:
  :func:`~.detector.detect`, each layer's input held fixed and the ids re-spaced and shifted); elsewhere
  each layer is measured from its recorded scores, q and k under a *constant input*
  (:func:`measure_constant_input`), and so is whether positions enter before block 0
  (:func:`input_positions`);
- step 10 reports the lengths; steps 2, 4, 6, 8 and 9 compare against a declaration or an
  interface the module does not have, and say so.

With no declared method, step 5 has nothing to hold its readings against: it is not applicable and
the readings are reported (``measured_layer_positions``), never judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from nopelens.models.adapters import HookedModule, _accepts, _names
from nopelens.models.anymodel import no_attention_reason
from nopelens.models.hooks import act_name
from nopelens.models.masks import CAUSAL, KeyWindow, visibility
from nopelens.probes.collect import check_distribution

from .detector import ABSOLUTE, FLAT, NOPE, NOT_MEASURED, RELATIVE, LayerReading, detect
from .numerics import Tolerance
from .report import AuditReport, Check, StepResult, make_step
from .steps_runtime import step10_lengths

NOT_DECLARED = (
    "the module declares no position method per layer (it is hooked with no declaration: hook_any or "
    "HookedModule), so there is nothing to hold this step's {what} against"
)
LEFT_PADDING = (
    "step 1 compares a left-padded row with its unpadded one, which needs a forward that takes both "
    "attention_mask and position_ids; {name}.forward takes {takes}"
)
NOT_APPLICABLE = {
    2: NOT_DECLARED.format(what="index origin and offset sign"),
    4: NOT_DECLARED.format(what="absolute position additions (no declared position table)"),
    6: "the scores are one tensor at the attention call (the softmax's input, or recomputed from the q, k, scale "
    "and mask of scaled_dot_product_attention): no separately recorded content and position parts to add up",
    8: NOT_DECLARED.format(
        what="interventions (zeroed, shifted, swapped positions: their expected effect is the declared method's)"
    ),
    9: "nopelens knows no KV-cache interface of a hooked module, so cached decoding cannot be driven",
}


@dataclass
class HookedLayout:
    """What the audit reads of a hooked module: blocks, the ones with a recorded softmax attention,
    whether the detector can set positions (the forward takes ``position_ids``, and block 0's input
    is a site, where the detector holds it)."""

    n_layers: int
    attention_layers: list[int]
    takes_positions: bool


def layout(model: HookedModule) -> HookedLayout:
    """Blocks from the ``blocks.{l}.hook_resid_post`` sites; attention layers from ``hook_pattern`` sites."""
    names = model.hook_dict
    n_layers = sum(1 for name in names if name.startswith("blocks.") and name.endswith(".hook_resid_post"))
    attention = [l for l in range(n_layers) if act_name("pattern", l) in names]
    held = act_name("resid_pre", 0) in names  # the detector holds block 0's input there
    return HookedLayout(n_layers, attention, held and _names(model.model, "position_ids"))


def audit_hooked(
    model: HookedModule,
    eval_length: int,
    tokens: Tensor | None,
    seed: int,
    tolerance: tuple[float | None, float | None],
    meta: dict[str, Any],
    name: str | None,
) -> AuditReport:
    """The audit of a hooked module (module docstring); called by :func:`~.core.audit`, whose
    arguments these are (``tolerance``: its ``(atol, rtol)``, None for the compute dtype's).

    Raises:
        ValueError: if the module records no softmax attention (sigmoid or linear attention, an SSM:
            nothing the audit checks), a recorded pattern is no distribution (a hand map pointing at
            sigmoid weights: :func:`~nopelens.probes.collect.check_distribution`), its logits are not
            finite, or the module has no ``nn.Embedding`` to draw probe tokens from.
    """
    shape = layout(model)
    if not shape.attention_layers:
        raise ValueError(
            f"{type(model.model).__name__} records no softmax attention (no hook_pattern site: "
            f"{no_attention_reason(model.model)}), so there is nothing to audit"
        )
    module = model.model
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    tol = Tolerance.for_dtype(dtype, *tolerance)
    device = next(module.parameters()).device
    probe = _probe_tokens(module, eval_length, seed, tokens).to(device)
    mask = torch.ones_like(probe)
    flags = [(m, m.training) for m in module.modules()]
    steps = {n: make_step(n, [], {}, "", why) for n, why in NOT_APPLICABLE.items()}
    module.eval()
    try:
        with torch.no_grad():
            steps[1] = _step1_left_padding(model, probe, tol)
            steps[3], steps[7] = _layer_checks(model, probe, shape.attention_layers, tol)
            readings, details, how = _readings(model, shape, probe, mask, tol)
            entering = input_positions(model, probe, tol)
    finally:
        for m, training in flags:
            m.training = training
    windows = dict(getattr(model, "key_windows", {}) or {})
    steps[5] = _step5_detector(readings, details, how)
    steps[10] = step10_lengths(SimpleNamespace(probe=SimpleNamespace(mask=mask, ids=mask.cumsum(-1) - 1)), meta)
    label = name or type(module).__name__
    described = {
        "name": label,
        "kind": f"{type(model).__name__} (no declared position method)",
        "description": f"{type(module).__name__} hooked with no declared position method; "
        f"{shape.n_layers} blocks, softmax attention in {len(shape.attention_layers)}",
        "n_layers": shape.n_layers,
        "attention_layers": shape.attention_layers,
        "sites": dict(model.site_paths),
        "key_windows": {l: w.describe() for l, w in sorted(windows.items())},
        "measured_input_positions": entering,
        "measured_layer_positions": [r.reading for r in readings],
        "detector": how,
    }
    probe_record = {
        "tokens": probe.tolist(),
        "attention_mask": mask.tolist(),
        "eval_length": probe.shape[1],
        "seed": seed if tokens is None else None,
        "compute_dtype": tol.dtype,
        "tolerance": {"atol": tol.atol, "rtol": tol.rtol},
    }
    return AuditReport(described, probe_record, [steps[n] for n in sorted(steps)])


def _probe_tokens(module: nn.Module, eval_length: int, seed: int, tokens: Tensor | None) -> Tensor:
    """One row ``[1, pos]``: the given tokens, or uniform ids below the first ``nn.Embedding``'s vocabulary."""
    if tokens is not None:
        return tokens.reshape(-1, tokens.shape[-1])[:1].long()
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(f"{type(module).__name__} has no nn.Embedding, so its vocabulary is unknown: pass tokens=")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, embeddings[0].num_embeddings, (1, eval_length), generator=generator)


def _step1_left_padding(model: HookedModule, tokens: Tensor, tol: Tolerance) -> StepResult:
    """Step 1 where the forward takes ``attention_mask`` and ``position_ids``: the probe left-padded
    by a quarter of its length (position ids counted from the mask, as :class:`HookedModule` does)
    gives the unpadded row's logits at its real tokens. Else not applicable, naming what it takes."""
    module = model.model
    if not (_names(module, "attention_mask") and _names(module, "position_ids")):
        return make_step(1, [], {}, "", LEFT_PADDING.format(name=type(module).__name__, takes=_accepts(module)))
    n_pad = max(1, tokens.shape[1] // 4)
    padded = torch.cat([tokens[:, :1].expand(-1, n_pad), tokens], 1)  # the pads' ids never reach a real token
    mask = torch.cat([torch.zeros_like(tokens[:, :n_pad]), torch.ones_like(tokens)], 1)
    ids = (mask.cumsum(-1) - 1).clamp(min=0)
    plain = model(tokens).double()
    shifted = model(padded, attention_mask=mask, position_ids=ids).double()[:, n_pad:]
    gap, bound = float((shifted - plain).abs().max()), tol.of(plain)
    check = Check(
        "left-padding invariance",
        gap <= bound,
        f"the row left-padded by {n_pad} gives logits at its real tokens within {gap:.3g} of the unpadded row's",
        gap,
        bound,
    )
    evidence = {"left_padding": n_pad, "position_ids_from_mask": ids.tolist(), "max_abs_diff": gap}
    return make_step(
        1,
        [check],
        evidence,
        f"a row left-padded by {n_pad} (position ids from the mask) gives the unpadded row's logits at its real tokens",
    )


def _layer_checks(
    model: HookedModule, tokens: Tensor, layers: list[int], tol: Tolerance
) -> tuple[StepResult, StepResult]:
    """Steps 3 and 7, each layer checked as its pattern is recorded (one layer's scores held at a time).

    A first plain pass records the window or chunk each attention call runs under at this length
    (``key_windows``, ``unknown_masks``, ``sink_blocks`` of a :class:`~nopelens.models.anymodel.HookedAny`).

    Raises:
        TypeError: if the forward pass gives no tensor of logits.
        ValueError: if the logits are not finite (nothing to compare: refused, not failed)."""
    logits = model(tokens)
    if not isinstance(logits, Tensor):
        raise TypeError(
            f"{type(model.model).__name__}'s forward returned a {type(logits).__name__} with no tensor of "
            "logits (.logits, ['logits'] or a tuple's first item): wrap it with output_fn=..."
        )
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(
            f"{type(model.model).__name__}'s logits are not finite on the probe (NaN or inf): check its "
            "weights for NaN or inf"
        )
    windows = dict(getattr(model, "key_windows", {}) or {})
    unknown = set(getattr(model, "unknown_masks", ()) or ())
    sinks = set(getattr(model, "sink_blocks", ()) or ())
    wanted = {act_name(point, l): (l, point) for l in layers for point in ("attn_scores", "pattern")}
    scores: dict[int, Tensor] = {}
    masks: dict[int, tuple[list[Check], Any]] = {}
    softmax: dict[int, tuple[list[Check], Any]] = {}

    def check(x, hook):
        layer, point = wanted[hook.name]
        if point == "attn_scores":
            scores[layer] = x.detach().double()
            return
        check_distribution(x, torch.ones_like(tokens), hook.name, sink=layer in sinks)  # else: refused, one line
        pattern = x.detach().double()
        masks[layer] = _mask_checks(layer, pattern, None if layer in unknown else windows.get(layer, CAUSAL))
        softmax[layer] = _softmax_checks(layer, pattern, scores.pop(layer, None), layer in sinks, tol)

    model.run_with_hooks(tokens, fwd_hooks=[(n, check) for n in wanted if n in model.hook_dict])
    return (
        _step(
            3,
            masks,
            "blocked keys get exactly 0 and allowed keys more, in every recorded layer",
            "no layer's mask is known (neither causal nor a window or chunk)",
        ),
        _step(7, softmax, "every recorded pattern is the softmax of its recorded scores", "no pattern recorded"),
    )


def _step(number: int, per_layer: dict[int, tuple[list[Check], Any]], summary: str, reason: str) -> StepResult:
    checks = [c for layer in sorted(per_layer) for c in per_layer[layer][0]]
    evidence = {f"layer {layer}": per_layer[layer][1] for layer in sorted(per_layer)}
    return make_step(number, checks, evidence, summary, reason)


def _mask_checks(layer: int, pattern: Tensor, window: KeyWindow | None) -> tuple[list[Check], Any]:
    """Step 3 in one layer: keys outside the causal / window rule get exactly 0, the others > 0
    (``window`` None: the call's mask is neither, so nothing is checked)."""
    if window is None:
        return [], "its mask is neither causal nor a window or chunk: not checked"
    seen = visibility(None, pattern.shape[-2], pattern.shape[-1], pattern.device, keys=window).expand_as(pattern)
    blocked = float(pattern[~seen].abs().max()) if bool((~seen).any()) else 0.0
    smallest = float(pattern[seen].min())
    return [
        Check(
            f"layer {layer}: blocked keys exactly 0",
            blocked == 0.0,
            f"max |p| at blocked keys {blocked:.3g}",
            blocked,
            0.0,
        ),
        Check(
            f"layer {layer}: allowed keys > 0", smallest > 0.0, f"min p at allowed keys {smallest:.3g}", smallest, 0.0
        ),
    ], {"mask": window.describe(), "max_blocked": blocked, "min_allowed": smallest}


def _softmax_checks(
    layer: int, pattern: Tensor, scores: Tensor | None, sink: bool, tol: Tolerance
) -> tuple[list[Check], Any]:
    """Step 7 in one layer: rows sum to 1 (to 1 - p_sink where a learned sink's logit was in the
    softmax), and the pattern is the softmax of the recorded scores, in float64."""
    sums = pattern.sum(-1)
    if sink:
        ok = bool(((sums > 0) & (sums < 1 + tol.atol)).all())
        checks = [
            Check(
                f"layer {layer}: rows sum to 1 - p_sink",
                ok,
                f"row sums in [{float(sums.min()):.3g}, {float(sums.max()):.3g}] (a learned sink takes the rest)",
            )
        ]
    else:
        worst = float((sums - 1).abs().max())
        checks = [
            Check(f"layer {layer}: rows sum to 1", worst <= tol.atol, f"max |row sum - 1| {worst:.3g}", worst, tol.atol)
        ]
    if scores is None:
        return checks, "no hook_attn_scores site: the pattern is checked against nothing else"
    want = torch.softmax(scores, dim=-1) * sums[..., None]  # with a sink: the key columns' share
    gap, bound = float((pattern - want).abs().max()), tol.of(want)
    checks.append(
        Check(
            f"layer {layer}: pattern = softmax(scores)",
            gap <= bound,
            f"max |pattern - softmax(scores)| {gap:.3g} (float64)",
            gap,
            bound,
        )
    )
    return checks, {"max_abs_diff_from_softmax_of_scores": gap}


def _step5_detector(readings: list[LayerReading], details: list[str], how: str):
    """Step 5: the readings, with how they were measured; not applicable (nothing declared to hold them against)."""
    evidence = {"detector": how, "readings": [r.to_dict() for r in readings], "per_layer": details}
    summary = ", ".join(f"{r.layer}:{r.reading}" for r in readings)
    return make_step(
        5,
        [],
        evidence,
        "",
        f"measured per layer ({how}): {summary}; not judged: " + NOT_DECLARED.format(what="readings"),
    )


def _readings(model: HookedModule, shape: HookedLayout, tokens: Tensor, mask: Tensor, tol: Tolerance):
    """The detector where positions can be set, else the constant-input measurement: the readings,
    one line per layer, and how they were measured."""
    if shape.takes_positions:
        readings = detect(_DetectorSubject(model, shape), tokens, mask, tol)
        return readings, [r.describe() for r in readings], "input held fixed, position_ids re-spaced and shifted"
    measured = measure_constant_input(model, shape, tokens, tol)
    return (
        [r for r, _ in measured],
        [line for _, line in measured],
        "constant input, read from the recorded scores, q, k and v",
    )


class _DetectorSubject:
    """What :func:`~.detector.detect` reads of a subject, for a hooked module that takes ``position_ids``.

    Block l's input is held at its feeding site (:func:`_feeding_site`: ``blocks.{l-1}.hook_resid_post``
    where no ``hook_resid_pre`` is mapped; hook_any's census checked it is block l's input)."""

    def __init__(self, model: HookedModule, shape: HookedLayout):
        self.model, self.shape = model, shape
        self.n_layers, self.attention_layers = shape.n_layers, shape.attention_layers
        self.layer_names = ["unknown"] * shape.n_layers
        self.takes_positions, self.scores_trusted, self.max_positions = True, True, None

    def key_window(self, layer: int):
        return dict(getattr(self.model, "key_windows", {}) or {}).get(layer, CAUSAL)

    def forward(self, tokens, mask, position_ids=None, fwd_hooks=()):
        hooks = [
            (_feeding_site(self.model, int(name.split(".")[1])) if name.endswith("hook_resid_pre") else name, hook)
            for name, hook in fwd_hooks
        ]
        return self.model.run_with_hooks(tokens, position_ids=position_ids, fwd_hooks=hooks)


def input_positions(model: HookedModule, tokens: Tensor, tol: Tolerance) -> str:
    """Whether positions enter the residual stream before block 0, measured: under a constant
    input (every token the probe's first) the stream entering block 0 is the same at every position
    unless something added by position (a learned or sinusoidal table) put positions into it."""
    site = act_name("resid_pre", 0)
    if site not in model.hook_dict:
        return f"not measured: no {site} site"
    seen = []
    model.run_with_hooks(
        tokens[:, :1].expand_as(tokens).contiguous(),
        fwd_hooks=[(site, lambda x, hook: seen.append(x.detach().double()))],
    )
    if _varies(seen[0], 1, tol):
        return "absolute: under a constant input the stream entering block 0 differs between positions"
    return "none: under a constant input the stream entering block 0 is the same at every position"


def _feeding_site(model: HookedModule, layer: int) -> str | None:
    """The residual site whose value block ``layer`` reads: its ``hook_resid_pre`` where mapped, else
    the previous block's ``hook_resid_post`` (None: neither is mapped)."""
    for site in [act_name("resid_pre", layer)] + ([act_name("resid_post", layer - 1)] if layer else []):
        if site in model.hook_dict:
            return site
    return None


def measure_constant_input(
    model: HookedModule, shape: HookedLayout, tokens: Tensor, tol: Tolerance
) -> list[tuple[LayerReading, str]]:
    """Each layer's position reading from its recorded scores, q and k under a constant input.

    Every token is the probe's first, and the residual stream feeding the layer is replaced by its
    first position's vector at every position. With its input the same at every position, the
    layer's scores (or the log of its pattern, where no scores are recorded) can vary along a row
    only by what the layer itself does with positions. Flat rows (``s_ij = s_ii`` within round-off,
    and q and k the same at every position where the call records them; else exactly flat) read
    ``nope``; flat rows with nothing to tell a rotation of q.k = 0 apart read ``flat``; scores that
    depend on i - j only (``s_ij - s_ii = s_{i-1,j-1} - s_{i-1,i-1}``: RoPE, ALiBi, a relative bias)
    read ``relative``; anything else ``absolute``. The input is verified constant from the recorded
    v (the same at every position) or, with no v recorded, from the stream arriving at the feeding
    site already constant (every value the same, so no layer before could make positions differ,
    whatever its pattern); a layer whose input cannot be verified is ``not_measured``, with the
    reason. Tolerance: ``tol.rtol`` of the values' magnitude (their round-off).

    Returns:
        Per block, its :class:`~.detector.LayerReading` and one line saying what was seen.
    """
    constant = tokens[:, :1].expand_as(tokens).contiguous()
    readings = []
    for layer in range(shape.n_layers):
        if layer not in shape.attention_layers:
            readings.append(
                (
                    LayerReading(layer, NOT_MEASURED, "unknown", "scores"),
                    f"layer {layer}: not measured: no softmax attention recorded",
                )
            )
            continue
        readings.append(_constant_reading(model, layer, _run_constant(model, layer, constant), tol))
    return readings


def _run_constant(model: HookedModule, layer: int, constant: Tensor) -> dict[str, Tensor]:
    """One pass on the constant tokens with the stream feeding ``layer`` set to its first position's
    vector everywhere: the stream as it arrived (``arrived``) and the layer's ``q``, ``k``, ``v``,
    ``scores``, ``pattern`` where recorded (float64, CPU)."""
    seen: dict[str, Tensor] = {}

    def hold(x, hook):
        seen["arrived"] = x.detach()
        return x[:, :1].expand_as(x).clone()

    def keep(x, hook):
        seen[hook.name.rsplit("_", 1)[-1]] = x.detach().double().cpu()

    names = [act_name(p, layer) for p in ("q", "k", "v", "attn_scores", "pattern")]
    site = _feeding_site(model, layer)
    hooks = ([(site, hold)] if site else []) + [(n, keep) for n in names if n in model.hook_dict]
    model.run_with_hooks(constant, fwd_hooks=hooks)
    return seen


def _varies(x: Tensor | None, axis: int, tol: Tolerance) -> bool | None:
    """Whether ``x`` differs along ``axis`` (positions) by more than ``tol``; None when ``x`` is None."""
    if x is None:
        return None
    first = x.narrow(axis, 0, 1)
    return float((x - first).abs().max()) > tol.of(x)


def _constant_reading(
    model: HookedModule, layer: int, seen: dict[str, Tensor], tol: Tolerance
) -> tuple[LayerReading, str]:
    v_varies = _varies(seen.get("v"), 1, tol)
    arrived_varies = _varies(seen.get("arrived"), 1, tol)
    if v_varies or (v_varies is None and arrived_varies is not False):
        why = (
            "its recorded v differs between positions"
            if v_varies
            else "no v is recorded and the stream reaching it already carries positions"
            if arrived_varies
            else "no v is recorded and no residual site feeds it"
        )
        return (
            LayerReading(layer, NOT_MEASURED, "unknown", "scores"),
            f"layer {layer}: not measured: its input could not be verified constant ({why})",
        )
    if "scores" in seen:
        scores, floor = seen["scores"][0], 1e-30  # [head, query, key]
    else:  # log p_ij - log p_ii = s_ij - s_ii; at least the round-off of two pattern entries (2 rtol)
        scores, floor = seen["pattern"][0].clamp(min=1e-300).log(), 2.0
    window = dict(getattr(model, "key_windows", {}) or {}).get(layer, CAUSAL)
    where = visibility(None, scores.shape[-2], scores.shape[-1], keys=window)[0].expand_as(scores)
    own = scores.diagonal(dim1=-2, dim2=-1)[..., None]
    relative = (scores - own).masked_fill(~where, 0.0)  # s_ij - s_ii: what the softmax sees
    scale = float(relative.abs().max())
    bound = tol.rtol * max(float(scores[where].abs().max()), floor)  # the round-off of values of that magnitude
    # s depends on i - j only iff s_ij - s_ii does: compared along the diagonals
    step = (relative[:, 1:, 1:] - relative[:, :-1, :-1]).masked_fill(~(where[:, 1:, 1:] & where[:, :-1, :-1]), 0.0)
    moved = [k for k in ("q", "k") if _varies(seen.get(k), 1, tol)]
    recorded = all(k in seen for k in ("q", "k"))
    if scale <= bound:
        reading = NOPE if (recorded and not moved) or scale == 0.0 else FLAT
        detail = "rows flat" + (", q and k the same at every position" if reading == NOPE and recorded else "")
    elif float(step.abs().max()) <= bound:
        reading = RELATIVE
        detail = "scores depend on i - j only; " + (
            f"{' and '.join(moved)} rotate with position"
            if moved
            else "q and k the same at every position: a bias by offset"
            if recorded
            else "q and k not recorded"
        )
    else:
        reading = ABSOLUTE
        detail = f"scores change along the diagonals by up to {float(step.abs().max()):.3g}"
    text = (
        f"layer {layer}: measured {reading} under constant input: {detail} (row spread {scale:.3g}, "
        f"tolerance {bound:.3g})"
    )
    return LayerReading(layer, reading, "unknown", "scores", spread=scale, tolerance=bound), text
