"""Audit steps 8, 9 and 10: interventions on positions, cached decoding, and lengths."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .numerics import agree
from .probe import Run, ids_list
from .report import Check, StepResult, make_step
from .subjects import DecodingUnavailable

TRAIN_LENGTH_KEYS = ("train_lengths", "train_length", "max_train_length", "train_seq_len", "seq_len")
GENERALIZATION_NOTE = (
    "a position index that the method can compute is not demonstrated length generalization "
    "(seed 002_c993a97fc3f160f5.txt)"
)
RELATIVE_LABELS = ("NoPE", "RoPE", "ALiBi", "Shaw")
"""The relative methods step 8's shift expectation names; a model's other relative methods are added."""


def _relative_note(methods) -> str:
    """Why a shift must not matter: the relative methods, e.g. "NoPE, RoPE, ALiBi and Shaw ..."."""
    labels = list(RELATIVE_LABELS) + [m.label for m in dict.fromkeys(methods) if m.label not in RELATIVE_LABELS]
    return f"{', '.join(labels[:-1])} and {labels[-1]} depend only on offsets"


# ----------------------------------------------------------------------------- step 8
def step8_interventions(run: Run, shift: int) -> StepResult:
    """Step 8: position interventions have each method's declared effect on the logits.

    Zeroing every position changes the output of any model that reads positions (not NoPE);
    adding ``shift`` to every position changes it only where a method is absolute; swapping two
    positions leaves every earlier token unchanged (causality) and changes the later ones unless
    the model reads no positions or every layer that reads them has a window or chunk of 1 (each
    query sees only its own key: no offset but 0, and a softmax over one key). A model that ignores
    an intervention computes exactly what it
    computed before, so "a change" means any nonzero change (a half-precision model's position
    effects may be a few ulps of its logits); "no change" allows the agreement tolerance. In
    bfloat16 and float16 the shift of a model with only relative methods is not held to a bound
    end to end (the rounding of every rotation changes and grows through the blocks, and can flip
    MoE routing); its change is recorded, and step 5 checks the shift per layer with the input fixed.
    """
    s, p = run.subject, run.probe
    if not s.takes_positions:
        return make_step(
            8,
            [],
            {},
            "",
            "the model takes no position ids (its position bias is built from key "
            "indices), so positions cannot be intervened on",
        )
    base = run.logits.double()
    bound = run.logit_tol.of(base)
    checks, evidence = [], {"expectations": {}}

    def effect(position_ids: Tensor) -> Tensor:
        return (s.forward(p.tokens, p.mask, position_ids).double() - base).abs().amax(-1)

    def expect(label: str, diff: Tensor, where: Tensor, should_change: bool, why: str) -> None:
        # An intervention the model ignores leaves its logits bitwise equal, so "a change" is any
        # change at all; "no change" allows the round-off of an equivalent computation (bound).
        value = float(diff[where].max()) if where.any() else 0.0
        threshold = 0.0 if should_change else bound
        evidence["expectations"][label] = why
        evidence[f"{label}_max_logit_change"] = value
        checks.append(
            Check(
                label,
                (value > threshold) == should_change,
                f"expected {'a change' if should_change else f'no change beyond {bound:.3g}'} ({why}); "
                f"max logit change {value:.3g}",
                value,
                threshold,
            )
        )

    uses = s.positions_reach_output
    no_effect = (
        "NoPE reads no positions"
        if not s.uses_positions
        else "a window or chunk of 1: each query sees only its own key, so its softmax is 1 whatever the positions"
    )
    zero = torch.zeros_like(p.ids)
    expect("zeroed positions", effect(zero), p.real, uses, "every method reads positions" if uses else no_effect)
    absolute_names = [m.name for m in (s.input_method, *s.layer_methods) if m is not None and m.absolute]
    absolute = bool(absolute_names)
    top = int(p.ids.max()) + shift
    if s.max_positions is not None and top >= s.max_positions:
        evidence["shifted positions"] = f"not run: position {top} is past the {s.max_positions}-row table"
    elif not absolute and run.tol.half_precision:
        # Exact in real arithmetic, not in half precision: RoPE at other positions rounds otherwise, the
        # error grows through the blocks and can flip a mixture of experts' routing (GPT-OSS, Beam:
        # logit changes of O(1) in a correct model). Step 5's detector checks the shift per layer, input fixed.
        change = float(effect(p.ids + shift)[p.real].max())
        evidence[f"positions shifted by {shift}"] = (
            f"not checked in {run.tol.dtype}: max logit change {change:.3g}; a shift changes the rounding of every "
            "rotation, which grows through the blocks (and can flip MoE routing), so only step 5's per-layer "
            "shift test, with each layer's input held fixed, can hold offsets-only to round-off"
        )
    else:
        expect(
            f"positions shifted by {shift}",
            effect(p.ids + shift),
            p.real,
            absolute,
            f"{', '.join(dict.fromkeys(absolute_names))} positions are absolute"
            if absolute
            else _relative_note(s.layer_methods),
        )
    swapped, a, b = p.ids.clone(), [], []
    for row in range(p.ids.shape[0]):
        first, last = int(p.mask[row].argmax()), p.ids.shape[1] - 1
        i = first + (last - first) // 2
        swapped[row, i], swapped[row, last] = p.ids[row, last], p.ids[row, i]
        a.append(i)
        b.append(last)
    evidence["swapped_token_indices"] = list(zip(a, b))
    diff = effect(swapped)
    index = torch.arange(p.ids.shape[1], device=p.ids.device)[None]
    before = p.real & (index < torch.tensor(a, device=index.device)[:, None])
    after = p.real & ~before
    expect(
        "swap: tokens before the first swapped one",
        diff,
        before,
        False,
        "causal: earlier queries neither see nor carry the swapped positions",
    )
    expect(
        "swap: tokens from the first swapped one on",
        diff,
        after,
        uses,
        "their positions or offsets changed" if uses else no_effect,
    )
    return make_step(8, checks, evidence, "every intervention has its method's expected effect")


# ----------------------------------------------------------------------------- step 9
def step9_cached_decoding(run: Run) -> StepResult:
    """Step 9: decoding through the KV cache assigns the full forward's positions and logits.

    A prefix, then one token at a time: the position ids assigned on the way and held by the cache
    must equal the mask-derived ids, and the logits must equal the full forward's.
    """
    s, p = run.subject, run.probe
    if s.decoding_unreadable() is not None:
        return make_step(9, [], {}, "", s.decoding_unreadable())
    split = max(p.n_pad + 1, p.tokens.shape[1] // 2)

    try:
        logits, record = s.decode_incrementally(p.tokens, p.mask, split)
    except DecodingUnavailable as reason:
        return make_step(9, [], {}, "", str(reason))
    checks, evidence = [], {"prefix_length": split, "decoded_one_token_at_a_time": p.tokens.shape[1] - split}
    step_ids = record["step_ids"]
    if step_ids is not None:
        full = run.ids_used
        bad = (step_ids != full) & p.real
        evidence["incremental_position_ids"] = ids_list(step_ids, p.real)
        detail = "position ids assigned while decoding equal the full forward's"
        if bad.any():
            b, i = bad.nonzero()[0].tolist()
            detail = f"row {b} token {i}: decoding assigned {int(step_ids[b, i])}, the full forward {int(full[b, i])}"
        checks.append(Check("cached position assignments", not bad.any(), detail))
    if record.get("cache_ids") is not None:
        cache_ids = record["cache_ids"]
        bad = (cache_ids != p.ids) & p.real
        checks.append(
            Check(
                "KV cache position ids",
                not bad.any(),
                "cache.position_ids equal position_ids_from_mask"
                if not bad.any()
                else f"cache holds {ids_list(cache_ids, p.real)}, the mask gives {ids_list(p.ids, p.real)}",
            )
        )
    check = agree(
        "cached logits = full forward",
        logits,
        run.logits,
        run.logit_tol,
        f"prefix of {split} tokens, then one token at a time",
        p.real[..., None],
    )
    if not check.passed and s.decoding_caveat() is not None:
        check.detail += f" (known cause: {s.decoding_caveat()})"
    checks.append(check)
    return make_step(
        9, checks, evidence, "incremental decoding assigns the same positions and logits as the full forward"
    )


# ----------------------------------------------------------------------------- step 10
def step10_lengths(run: Run, meta: dict[str, Any]) -> StepResult:
    """Step 10: training and evaluation lengths are reported before any generalization claim.

    Reads the training lengths from the metadata; warns when the probe goes past them, with seed
    002's note that a computable index is not demonstrated length generalization.
    """
    p = run.probe
    eval_lengths = sorted(set(p.mask.sum(-1).tolist()))
    evidence: dict[str, Any] = {"eval_lengths": eval_lengths, "max_eval_position": int(p.ids.max())}
    found = next(((k, meta[k]) for k in TRAIN_LENGTH_KEYS if meta.get(k) is not None), None)
    if found is None:
        evidence["train_lengths"] = "unknown"
        return make_step(
            10,
            [],
            evidence,
            "",
            "training lengths unknown (no train_lengths in the metadata); "
            f"evaluated at lengths {eval_lengths}; {GENERALIZATION_NOTE}",
            warnings=[f"training lengths unknown: {GENERALIZATION_NOTE}"],
        )
    key, value = found
    lengths = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"metadata {key}={value!r} is not a list of positive lengths")
    evidence.update(train_lengths=lengths, metadata_key=key)
    beyond = [n for n in eval_lengths if n > max(lengths)]
    warnings = []
    if beyond:
        warnings.append(
            f"evaluation lengths {beyond} go past the longest training length {max(lengths)}: {GENERALIZATION_NOTE}"
        )
    check = Check(
        "lengths reported before any generalization claim",
        True,
        f"trained on lengths {lengths}, evaluated at {eval_lengths}"
        + (f"; {len(beyond)} beyond training" if beyond else "; within training"),
    )
    return make_step(
        10,
        [check],
        evidence,
        f"trained on {lengths}, evaluated at {eval_lengths}" + (" (BEYOND training)" if beyond else ""),
        warnings=warnings,
    )
