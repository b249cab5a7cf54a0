"""The ten-step position audit of seed ``002_c993a97fc3f160f5.txt``, run on a model.

Seed 002 ends with an audit order for a position bug that keeps every tensor shape. :func:`audit`
runs it on a nopelens :class:`~nopelens.models.Decoder` (any position method, per-layer hybrids
included) or on an HF causal LM through TransformerLens' ``TransformerBridge``
(:func:`nopelens.models.adapters.bridge_hf_model`), and says step by step what it verified, with
the evidence: each step is ``pass``, ``fail`` or ``not_applicable`` (with the reason).

1. token ids, padding, special tokens and the position ids the model used, incl. a left-padded row
2. index origin (first real token at 0) and the signed-offset convention of each method
3. masks are separate from finite score biases (blocked -> exactly 0, allowed -> > 0)
4. absolute additions: ``hook_pos_embed`` equals the table rows at the position ids
5. Q/K rotations (``hook_rot_q = R(p) hook_q``, rotated fraction, pairing, offset-only dot
   products) and Shaw relation lookups
6. content scores and position contributions, recorded separately, add up to the scores
7. softmax over the key axis, unmasked rows sum to 1, blocked entries exactly 0
8. interventions (zeroed, shifted, swapped positions) against each method's expected effect
9. cached (incremental) vs uncached decoding: position assignments and logits
10. training vs evaluation lengths, with the seed's warning that a computable index is not
    demonstrated generalization

Conventions are those of ``DESIGN.md``: query i, key j, positions from 0, relative distance
i - j >= 0, ALiBi bias -m_h (i - j), Shaw offset clip(j - i), RoPE dot products depending on the
offset (seed 002: (R(m theta) q)^T (R(n theta) k) = q^T R((n - m) theta) k).
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
import textwrap
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from nopelens.models import Decoder, KVCache
from nopelens.models.io import write_text_atomic
from nopelens.models.masks import visibility
from nopelens.models.positions import (
    alibi_bias,
    alibi_slopes,
    apply_rope,
    position_ids_from_mask,
    rope_angles,
    shaw_relative_ids,
    sinusoidal_table,
)

STATUSES = ("pass", "fail", "not_applicable")
STEP_TITLES = {
    1: "Token ids, padding, special tokens and position ids",
    2: "Index origin and signed-offset convention",
    3: "Masks separate from finite score biases",
    4: "Absolute position additions",
    5: "Q/K rotations and relation lookups",
    6: "Content scores and position contributions",
    7: "Combined scores and softmax",
    8: "Position interventions",
    9: "Cached vs uncached decoding",
    10: "Training and evaluation lengths",
}
TRAIN_LENGTH_KEYS = ("train_lengths", "train_length", "max_train_length", "train_seq_len", "seq_len")
GENERALIZATION_NOTE = (
    "a position index that the method can compute is not demonstrated length generalization "
    "(seed 002_c993a97fc3f160f5.txt)"
)


# ============================================================================= report
@dataclass
class Check:
    """One verified claim: its name, whether it held, the measured value and the tolerance."""

    name: str
    passed: bool
    detail: str
    value: float | None = None
    tolerance: float | None = None


@dataclass
class StepResult:
    """One audit step: status (pass / fail / not_applicable), its checks and its evidence."""

    number: int
    title: str
    status: str
    summary: str
    checks: list[Check] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    reason: str | None = None

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


@dataclass
class AuditReport:
    """The audit of one model: what it is, the probe batch, and the ten steps."""

    model: dict[str, Any]
    probe: dict[str, Any]
    steps: list[StepResult]

    def step(self, number: int) -> StepResult:
        """The result of step ``number`` (1..10).

        Raises:
            KeyError: if there is no such step.
        """
        for step in self.steps:
            if step.number == number:
                return step
        raise KeyError(f"no audit step {number}; steps are 1..10")

    @property
    def failed_steps(self) -> list[int]:
        return [s.number for s in self.steps if s.status == "fail"]

    @property
    def passed(self) -> bool:
        """True when no step failed (not-applicable steps do not count against a model)."""
        return not self.failed_steps

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole report."""
        return _finite({
            "model": self.model,
            "probe": self.probe,
            "passed": self.passed,
            "failed_steps": self.failed_steps,
            "steps": [asdict(s) for s in self.steps],
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False, allow_nan=False)

    def summary(self) -> str:
        """A one-screen terminal summary: one line per step, then warnings and the verdict."""
        mark = {"pass": "PASS", "fail": "FAIL", "not_applicable": "n/a "}
        lines = [f"nopelens audit: {self.model['name']} ({self.model['description']})"]
        for s in self.steps:
            flag = " !" if s.warnings else ""
            lines.append(f" [{mark[s.status]}]{flag} {s.number:>2}. {s.title}: {_clip(s.summary, 90)}")
            for c in s.failed_checks[:3]:
                lines.append(f"          x {c.name}: {_clip(c.detail, 86)}")
        warnings = [(s.number, w) for s in self.steps for w in s.warnings]
        for number, warning in warnings:
            lines += textwrap.wrap(f"warning (step {number}): {warning}", 110, initial_indent=" ",
                                   subsequent_indent="   ")
        verdict = "no step failed" if self.passed else f"FAILED steps: {self.failed_steps}"
        counts = {k: sum(s.status == k for s in self.steps) for k in STATUSES}
        lines.append(
            f" {verdict} ({counts['pass']} pass, {counts['fail']} fail, "
            f"{counts['not_applicable']} not applicable)"
        )
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The report as Markdown: model, probe batch, and per step its checks and evidence."""
        out = [f"# Position audit: {self.model['name']}", ""]
        out.append(f"Seed `002_c993a97fc3f160f5.txt`'s ten-step audit order. {self.model['description']}.")
        out.append("")
        out.append(f"**Verdict:** {'no step failed' if self.passed else f'steps {self.failed_steps} failed'}.")
        out += ["", "| step | title | status | summary |", "|---|---|---|---|"]
        for s in self.steps:
            out.append(f"| {s.number} | {s.title} | {s.status} | {_md(s.summary)} |")
        out += ["", "## Model", "", "```json", json.dumps(self.model, indent=1), "```", ""]
        out += ["## Probe batch", "", "```json", json.dumps(self.probe), "```", ""]
        for s in self.steps:
            out += [f"## Step {s.number}. {s.title}: {s.status}", "", s.summary, ""]
            if s.reason:
                out += [f"Not applicable: {s.reason}", ""]
            for w in s.warnings:
                out += [f"> **Warning:** {w}", ""]
            if s.checks:
                out += ["| check | result | value | tolerance | detail |", "|---|---|---|---|---|"]
                for c in s.checks:
                    value = "" if c.value is None else f"{c.value:.3g}"
                    tol = "" if c.tolerance is None else f"{c.tolerance:.3g}"
                    out.append(
                        f"| {_md(c.name)} | {'pass' if c.passed else '**fail**'} | {value} | {tol} | {_md(c.detail)} |"
                    )
                out.append("")
            if s.evidence:
                out += ["Evidence:", "", "```json", json.dumps(s.evidence), "```", ""]
        return "\n".join(out)

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write ``report.md`` and ``audit.json`` into ``out_dir``, each atomically.

        Returns:
            The two paths written.

        Raises:
            OSError: if the directory cannot be created or written.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        md, js = out_dir / "report.md", out_dir / "audit.json"
        write_text_atomic(md, self.to_markdown() + "\n")
        write_text_atomic(js, self.to_json() + "\n")
        return md, js


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write such measurements as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _make_step(
    number: int,
    checks: list[Check],
    evidence: dict[str, Any],
    summary_pass: str,
    reason: str | None = None,
    warnings: list[str] | None = None,
) -> StepResult:
    """A step is not_applicable when it has a reason and no checks, fail if any check failed."""
    if not checks:
        if reason is None:
            raise ValueError(f"step {number} has neither checks nor a not-applicable reason")
        return StepResult(number, STEP_TITLES[number], "not_applicable", reason, [], evidence,
                          warnings or [], reason)
    failed = [c for c in checks if not c.passed]
    if failed:
        summary = f"{len(failed)} of {len(checks)} checks failed: " + "; ".join(c.name for c in failed)
        return StepResult(number, STEP_TITLES[number], "fail", summary, checks, evidence, warnings or [])
    return StepResult(number, STEP_TITLES[number], "pass", summary_pass, checks, evidence, warnings or [])


# ============================================================================= numerics
@dataclass(frozen=True)
class Tolerance:
    """Agreement means max |a - b| <= atol + rtol * max |b| (float32 models by default).

    Example:
        >>> round(Tolerance(atol=1e-5, rtol=1e-4).of(torch.tensor([-3.0, 2.0])), 8)
        0.00031
    """

    atol: float = 1e-5
    rtol: float = 1e-4

    def of(self, reference: Tensor) -> float:
        scale = float(reference.abs().max()) if reference.numel() else 0.0
        return self.atol + self.rtol * scale


def _max_err(a: Tensor, b: Tensor, where: Tensor | None = None) -> float:
    diff = (a.double() - b.double()).abs()
    if where is not None:
        diff = diff[where.expand_as(diff)]
    return float(diff.max()) if diff.numel() else 0.0


def _agree(name: str, observed: Tensor, reference: Tensor, tol: Tolerance, detail: str,
           where: Tensor | None = None) -> Check:
    ref = reference if where is None else reference[where.expand_as(reference)]
    err, bound = _max_err(observed, reference, where), tol.of(ref)
    return Check(name, err <= bound, f"{detail}; max |error| {err:.3g}", err, bound)


def _rotate(x: Tensor, ids: Tensor, rotary_dim: int, base: float, pairing: str, direction: int = 1) -> Tensor:
    """``apply_rope`` (direction +1) or the opposite rotation R(-p theta) (direction -1).

    Seed 002: with R(-p theta) the rotated dot product depends on m - n instead of n - m, a sign
    bug that keeps every shape. R(-p theta) undoes R(p theta):

    Example:
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).view(1, 1, 1, 4)
        >>> ids = torch.tensor([[5]])
        >>> back = _rotate(_rotate(x, ids, 4, 10000.0, "half"), ids, 4, 10000.0, "half", direction=-1)
        >>> [round(v, 6) for v in back.flatten().tolist()]
        [1.0, 2.0, 3.0, 4.0]
    """
    if direction == 1:
        return apply_rope(x, ids, rotary_dim, base, pairing)
    # R(-t)(a, b) = C R(t) C (a, b) with C (a, b) = (a, -b): negate each pair's second element
    second = slice(rotary_dim // 2, rotary_dim) if pairing == "half" else slice(1, rotary_dim, 2)
    sign = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    sign[second] = -1
    return apply_rope(x * sign, ids, rotary_dim, base, pairing) * sign


def _dot_scores(q: Tensor, k: Tensor, scale: float) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    if k.shape[2] != q.shape[2]:  # grouped-query attention: repeat key heads
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bqhe,bkhe->bhqk", q.double(), k.double()) * scale


# ============================================================================= subjects
@dataclass
class _RopeSpec:
    """RoPE as the model declares it: rotated dims per head, base b and pair layout."""

    rotary_dim: int
    base: float
    pairing: str


class _Subject(abc.ABC):
    """What the audit needs of a model, whatever its implementation."""

    kind: str
    name: str
    layer_methods: tuple[str, ...]
    input_method: str | None
    n_heads: int
    d_head: int
    d_vocab: int
    max_positions: int | None
    rope: _RopeSpec | None = None
    shaw_clip: int | None = None
    special_tokens: dict[str, Any]
    model: Any

    @property
    def n_layers(self) -> int:
        return len(self.layer_methods)

    @property
    def uses_positions(self) -> bool:
        return self.input_method is not None or any(m != "nope" for m in self.layer_methods)

    def describe(self) -> dict[str, Any]:
        methods = sorted(set(self.layer_methods))
        desc = (f"{self.kind}; input positions: {self.input_method or 'none'}; attention methods per "
                f"layer: {list(self.layer_methods)}")
        out = {"name": self.name, "kind": self.kind, "description": desc,
               "input_position": self.input_method, "layer_positions": list(self.layer_methods),
               "attention_methods": methods, "n_layers": self.n_layers, "n_heads": self.n_heads,
               "d_head": self.d_head, "d_vocab": self.d_vocab, "max_positions": self.max_positions}
        if self.rope is not None:
            out["rope"] = asdict(self.rope)
        if self.shaw_clip is not None:
            out["shaw_clip"] = self.shaw_clip
        return out

    @abc.abstractmethod
    def forward(self, tokens: Tensor, mask: Tensor, position_ids: Tensor | None = None,
                fwd_hooks: Any = ()) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits, with explicit position ids (an intervention) and TransformerLens hooks."""

    @abc.abstractmethod
    def run_with_cache(self, tokens: Tensor, mask: Tensor, position_ids: Tensor | None = None
                       ) -> tuple[Tensor, Any, Tensor | None]:
        """Logits, the audited activations and the position ids the model used (None if unseen)."""

    @abc.abstractmethod
    def capture_position_ids(self) -> contextlib.AbstractContextManager[list]:
        """A context collecting, per forward pass, the position ids of the new tokens."""

    @abc.abstractmethod
    def decode_incrementally(self, tokens: Tensor, mask: Tensor, split: int) -> tuple[Tensor, dict[str, Any]]:
        """Logits of a prefix of ``split`` tokens then one token at a time through the KV cache,
        and the position ids assigned on the way (``step_ids``; ``cache_ids`` where the cache
        records them)."""

    @abc.abstractmethod
    def drop_bias_hooks(self) -> list:
        """Hooks that zero every finite score bias (empty where biases are dropped otherwise)."""

    def score_scale(self, layer: int) -> float:
        """The factor multiplying q.k in a layer's scores: 1 / sqrt(d_head)."""
        return self.d_head ** -0.5

    def rope_spec(self, layer: int) -> _RopeSpec | None:
        """The RoPE parameters of a layer, None where the layer does not rotate."""
        return self.rope if self.layer_methods[layer] == "rope" else None

    def content_scores(self, q: Tensor, k: Tensor, layer: int) -> Tensor:
        """A layer's content scores from the q and k entering them: q.k * score_scale."""
        return _dot_scores(q, k, self.score_scale(layer))

    def qk_names(self, layer: int) -> tuple[str, str]:
        """The attention hooks holding the q and k that enter the scores (before rotation)."""
        return "hook_q", "hook_k"

    def prepare_qk(self, q: Tensor, k: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """What the model does to the hooked q and k before the scores, besides rotating them."""
        return q, k

    @property
    def scores_trusted(self) -> bool:
        """``hook_attn_scores`` are the pre-softmax scores behind ``hook_pattern``."""
        return True

    @property
    def takes_positions(self) -> bool:
        """Position ids can be handed to the model (interventions, step 8)."""
        return True

    def unverifiable(self) -> str | None:
        """Why the position steps cannot be verified at all, or None."""
        return None

    def alibi_slopes(self, layer: int) -> Tensor:
        """Slopes m_h of an ALiBi layer, in score units per token (float64)."""
        return alibi_slopes(self.n_heads).double()


class _DecoderSubject(_Subject):
    kind = "nopelens Decoder"

    def __init__(self, model: Decoder, name: str):
        cfg = model.cfg
        self.model, self.name = model, name
        self.layer_methods = cfg.layer_positions
        self.input_method = cfg.input_position
        self.n_heads, self.d_head, self.d_vocab = cfg.n_heads, cfg.d_head, cfg.d_vocab
        self.max_positions = cfg.n_ctx if cfg.input_position == "learned" else None
        if "rope" in self.layer_methods:
            self.rope = _RopeSpec(cfg.rotary_dim, cfg.rotary_base, cfg.pairing)
        if "shaw" in self.layer_methods:
            self.shaw_clip = cfg.shaw_clip
        self.special_tokens = {"note": "a nopelens Decoder has no tokenizer; no special token ids are declared"}

    def forward(self, tokens, mask, position_ids=None, fwd_hooks=()):
        return self.model.run_with_hooks(tokens, attention_mask=mask, position_ids=position_ids,
                                         fwd_hooks=list(fwd_hooks))

    def run_with_cache(self, tokens, mask, position_ids=None):
        with self.capture_position_ids() as seen:
            logits, cache = self.model.run_with_cache(tokens, attention_mask=mask, position_ids=position_ids,
                                                      names_filter=_audited_hook)
        return logits, cache, seen[0]

    @contextlib.contextmanager
    def capture_position_ids(self) -> Iterator[list]:
        """Record the query position ids block 0 receives (what every layer uses)."""
        seen: list[Tensor] = []

        def hook(module, args):
            resid, key_positions = args[0], args[1]
            seen.append(key_positions[:, -resid.shape[1]:].detach().clone())

        handle = self.model.blocks[0].register_forward_pre_hook(hook)
        try:
            yield seen
        finally:
            handle.remove()

    def decode_incrementally(self, tokens, mask, split):
        cache = KVCache.empty(self.model.cfg, tokens.shape[0], tokens.device)
        pieces = []
        with self.capture_position_ids() as seen:
            pieces.append(self.model(tokens[:, :split], attention_mask=mask[:, :split], past_kv=cache))
            for t in range(split, tokens.shape[1]):
                pieces.append(self.model(tokens[:, t:t + 1], attention_mask=mask[:, t:t + 1], past_kv=cache))
        return torch.cat(pieces, 1), {"step_ids": torch.cat(seen, 1), "cache_ids": cache.position_ids}

    def drop_bias_hooks(self):
        return [(f"blocks.{l}.attn.hook_pos_bias", lambda x, hook: torch.zeros_like(x))
                for l, m in enumerate(self.layer_methods) if m in ("alibi", "shaw")]


class _BridgeSubject(_Subject):
    """An HF causal LM through TransformerBridge, read through :func:`nopelens.models.hf.describe`.

    Everything family-specific (per-layer method, RoPE parameters, score scale and soft-capping,
    q/k norms, which hooks carry what they say, how positions enter) comes from the description;
    this class only runs the model.
    """

    kind = "HF causal LM via TransformerBridge"

    def __init__(self, bridge: Any, name: str):
        from nopelens.models.hf import check_readable, describe

        self.model, self.name = bridge, name
        self.hf = describe(bridge)
        check_readable(self.hf)
        self.config = bridge.original_model.config
        self.layer_methods = self.hf.layer_methods
        self.input_method = self.hf.input_position
        self.n_heads, self.d_head, self.d_vocab = self.hf.n_heads, self.hf.d_head, self.hf.d_vocab
        self.max_positions = self.hf.max_positions
        self.position_offset = self.hf.position_offset
        rope = [l for l in self.hf.layers if l.method == "rope"]
        if rope:
            self.rope = self.rope_spec(self.layer_methods.index("rope"))
        self.special_tokens = {k: getattr(self.config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        self.position_limit = 4096  # audit() sets it from the probe length

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["hf"] = {"architecture": self.hf.architecture, "family": self.hf.family, "qk_norm": self.hf.qk_norm,
                     "scores_hook": self.hf.scores_hook, "position_input": self.hf.position_input,
                     "layers": [asdict(layer) for layer in self.hf.layers], "notes": list(self.hf.notes)}
        return out

    # --- what the description says -----------------------------------------------------------
    def rope_spec(self, layer: int) -> _RopeSpec | None:
        spec = self.hf.layers[layer]
        if spec.method != "rope":
            return None
        return _RopeSpec(spec.rotary_dim, spec.rotary_base, spec.pairing)

    def score_scale(self, layer: int) -> float:
        return self.hf.layers[layer].score_scale

    def content_scores(self, q: Tensor, k: Tensor, layer: int) -> Tensor:
        scores = _dot_scores(q, k, self.score_scale(layer))
        cap = self.hf.layers[layer].softcap
        return scores if cap is None else cap * torch.tanh(scores / cap)

    def qk_names(self, layer: int) -> tuple[str, str]:
        return self.hf.q_hook, self.hf.k_hook

    def prepare_qk(self, q: Tensor, k: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        q, k = self._tl_layout(q), self._tl_layout(k)
        if self.hf.qk_norm == "l2 after rope" and self.hf.layers[layer].method == "rope":
            from nopelens.models.hf import l2_normalize  # commutes with the rotation

            eps = float(getattr(self.config, "rms_norm_eps", 1e-6))
            return l2_normalize(q.double(), eps), l2_normalize(k.double(), eps)
        return q, k

    def _tl_layout(self, x: Tensor) -> Tensor:
        """The description's q/k layout -> ``[batch, pos, head_index, d_head]``."""
        if self.hf.qk_layout == "batch head pos d_head":
            return x.transpose(1, 2)
        if self.hf.qk_layout == "batch pos (head d_head)":
            return x.reshape(*x.shape[:2], -1, self.d_head)
        return x

    @property
    def scores_trusted(self) -> bool:
        return self.hf.scores_hook

    def unverifiable(self) -> str | None:
        unknown = [l for l, m in enumerate(self.layer_methods) if m == "unknown"]
        if unknown:
            return (f"the position method of {self.hf.family!r} layers {unknown} is not known to nopelens.models.hf; "
                    "nothing about positions is verified")
        scaled = sorted({l.rope_type for l in self.hf.layers if l.method == "rope" and l.rope_type != "default"})
        if scaled:
            return f"rope_type {scaled} scales RoPE frequencies; the reference covers the default (unscaled) RoPE only"
        return None

    @property
    def _alibi_input(self) -> bool:
        return self.hf.position_input == "alibi"

    @property
    def takes_positions(self) -> bool:
        return self.hf.position_input is not None

    def alibi_slopes(self, layer: int) -> Tensor:
        spec = self.hf.layers[layer]
        return torch.tensor(spec.alibi_slopes, dtype=torch.float64) * spec.bias_scale

    # --- running ---------------------------------------------------------------------------
    def _kwargs(self, mask, position_ids):
        kwargs = {"attention_mask": mask}
        if position_ids is not None and self.hf.position_input == "position_ids":
            kwargs["position_ids"] = position_ids
        return kwargs

    @contextlib.contextmanager
    def _alibi_positions(self, position_ids: Tensor | None) -> Iterator[None]:
        """Positions enter an ALiBi model as the tensor slope_h * p_j: an intervention replaces it."""
        if position_ids is None or not self._alibi_input:
            yield
            return
        slopes = torch.tensor(self.hf.layers[0].alibi_slopes, device=position_ids.device)

        def pre(module, args, kwargs):
            alibi = kwargs.get("alibi")
            if alibi is None:
                return None
            batch = (args[0] if args else kwargs["hidden_states"]).shape[0]
            ids = position_ids[:, -alibi.shape[-1]:].to(alibi.dtype)
            new = (slopes[None, :, None].to(alibi.dtype) * ids[:, None, :]).reshape(alibi.shape)
            assert new.shape[0] in (batch, batch * self.n_heads)
            return args, {**kwargs, "alibi": new}

        handles = [b.attn.register_forward_pre_hook(pre, with_kwargs=True) for b in self.model.blocks]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def forward(self, tokens, mask, position_ids=None, fwd_hooks=()):
        with self._alibi_positions(position_ids), self.model.hooks(fwd_hooks=list(fwd_hooks)):
            return self.model(tokens, **self._kwargs(mask, position_ids))

    def run_with_cache(self, tokens, mask, position_ids=None):
        with self._alibi_positions(position_ids), self.capture_position_ids() as seen:
            logits, cache = self.model.run_with_cache(tokens, names_filter=_audited_hook,
                                                      **self._kwargs(mask, position_ids))
        return logits, cache, (seen[0] if seen else None)

    @contextlib.contextmanager
    def capture_position_ids(self) -> Iterator[list]:
        """Record the position ids the HF model used, read back from its own position evidence.

        Learned tables: the ids entering the table (``pos_embed.hook_in``, less the family's row
        offset). RoPE: decoded from the cos/sin the rotary embedding computed (``hook_cos|hook_sin``
        of the first RoPE layer). ALiBi handed as a tensor: read from slope_h * p_j. Otherwise not
        observable.
        """
        seen: list[Tensor] = []
        bridge = self.model
        if self._alibi_input:
            slope = float(self.hf.layers[0].alibi_slopes[0])

            def pre(module, args, kwargs):
                alibi = kwargs.get("alibi")
                if alibi is not None:
                    hidden = args[0] if args else kwargs["hidden_states"]
                    keys = alibi.reshape(hidden.shape[0], self.n_heads, -1)[:, 0] / slope
                    seen.append(_as_ids(keys[:, -hidden.shape[1]:]))

            handle = bridge.blocks[0].attn.register_forward_pre_hook(pre, with_kwargs=True)
            try:
                yield seen
            finally:
                handle.remove()
            return
        if self.hf.position_ids_hook is not None:
            offset = self.hf.position_offset

            def hook(x, hook):
                seen.append(x.detach().clone() - offset)
            with bridge.hooks(fwd_hooks=[(self.hf.position_ids_hook, hook)]):
                yield seen
            return
        rope_layers = [l for l, m in enumerate(self.layer_methods) if m == "rope"]
        names = [f"blocks.{rope_layers[0]}.attn.{n}" for n in ("hook_cos", "hook_sin")] if rope_layers else []
        if not names or not all(self.hf.fires(n) for n in names):
            yield seen
            return
        store: dict[str, Tensor] = {}

        def keep(x, hook):
            store[hook.name.rsplit(".", 1)[-1]] = x.detach().clone()
            if len(store) == 2:
                seen.append(self._decode_rope_ids(rope_layers[0], store.pop("hook_cos"), store.pop("hook_sin")))

        with bridge.hooks(fwd_hooks=[(n, keep) for n in names]):
            yield seen

    def _decode_rope_ids(self, layer: int, cos: Tensor, sin: Tensor) -> Tensor:
        """Integer positions p whose reference angles p * theta_r best match HF's cos/sin.

        HF lays the rotary_dim / 2 angles out as [theta_0.., theta_0..] (``half``) or
        [theta_0, theta_0, theta_1, ..] (Cohere's ``repeat_interleave``); both layouts are tried.
        """
        spec = self.rope_spec(layer)
        half, device = spec.rotary_dim // 2, cos.device
        angles = rope_angles(torch.arange(self.position_limit), spec.rotary_dim, spec.base, dtype=torch.float64)
        ref_cos, ref_sin = angles.cos(), angles.sin()
        best_ids, best_worst = None, math.inf
        for pick in (slice(0, half), slice(0, 2 * half, 2)):
            c_all, s_all = cos[..., pick].double().cpu(), sin[..., pick].double().cpu()
            found, worst = [], 0.0
            for start in range(0, c_all.shape[-2], 32):  # chunks bound the [pos, candidate, half] tensor
                c, s = c_all[..., start:start + 32, None, :], s_all[..., start:start + 32, None, :]
                err = (c - ref_cos).abs().sum(-1) + (s - ref_sin).abs().sum(-1)
                found.append(err.argmin(-1))
                worst = max(worst, float(err.min(-1).values.max()))
            if worst < best_worst:
                best_ids, best_worst = torch.cat(found, -1), worst
        if best_worst > 1e-3 * half:  # not angles p * theta_r for any p < position_limit
            best_ids = torch.full_like(best_ids, -1)
        return best_ids.to(device)

    def decode_incrementally(self, tokens, mask, split):
        pieces = []
        with self.capture_position_ids() as seen, warnings.catch_warnings():
            # The bridge hands HF its cache as past_key_values, which transformers 5 deprecates.
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            logits, past = self.model(tokens[:, :split], attention_mask=mask[:, :split],
                                      return_type="logits_and_cache", use_cache=True)
            pieces.append(logits)
            for t in range(split, tokens.shape[1]):
                logits, past = self.model(tokens[:, t:t + 1], attention_mask=mask[:, :t + 1],
                                          past_key_values=past, return_type="logits_and_cache", use_cache=True)
                pieces.append(logits)
        ids = torch.cat([s.expand(tokens.shape[0], -1) for s in seen], 1) if len(seen) == len(pieces) else None
        return torch.cat(pieces, 1), {"step_ids": ids, "cache_ids": None}

    def drop_bias_hooks(self):
        return []


def _audited_hook(name: str) -> bool:
    """The hooks the audit reads: attention internals and the layer-0 input."""
    if name in ("hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre"):
        return True
    return ".attn.hook_" in name and name.rsplit(".", 1)[-1] in _ATTENTION_HOOKS


_ATTENTION_HOOKS = ("hook_q", "hook_k", "hook_q_normed", "hook_k_normed", "hook_v", "hook_rot_q", "hook_rot_k",
                    "hook_content_scores",
                    "hook_pos_bias", "hook_attn_scores", "hook_pattern", "hook_z", "hook_cos", "hook_sin")


def _as_ids(values: Tensor) -> Tensor:
    """Round float positions to int64; -1 marks values that are not integers.

    Example:
        >>> _as_ids(torch.tensor([0.0, 2.9999999, 1.5])).tolist()
        [0, 3, -1]
    """
    rounded = values.round()
    ids = rounded.long()
    return ids.masked_fill((values - rounded).abs() > 1e-3, -1)


def _subject(model: Any, name: str | None) -> tuple[_Subject, dict[str, Any]]:
    """Wrap a Decoder, a TrainedModel, a TransformerBridge or an HF model for the audit."""
    metadata: dict[str, Any] = {}
    if hasattr(model, "model") and hasattr(model, "metadata") and isinstance(model.model, Decoder):
        metadata = dict(model.metadata or {})
        model = model.model
    if isinstance(model, Decoder):
        return _DecoderSubject(model, name or f"Decoder({model.cfg.position_name})"), metadata
    if hasattr(model, "original_model") and hasattr(model, "blocks"):
        return _BridgeSubject(model, name or type(model.original_model).__name__), metadata
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency of transformer-lens
        PreTrainedModel = ()
    if isinstance(model, PreTrainedModel):
        from nopelens.models.adapters import bridge_hf_model

        return _BridgeSubject(bridge_hf_model(model), name or type(model).__name__), metadata
    raise TypeError(
        f"audit needs a nopelens Decoder, a TrainedModel, a TransformerBridge or an HF causal LM; "
        f"got {type(model).__name__}"
    )


# ============================================================================= probe batch
@dataclass
class _Probe:
    tokens: Int[Tensor, "batch pos"]
    mask: Int[Tensor, "batch pos"]
    ids: Int[Tensor, "batch pos"]  # expected: position_ids_from_mask(mask)
    n_pad: int

    @property
    def real(self) -> Bool[Tensor, "batch pos"]:
        return self.mask.bool()

    def allowed(self) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """Visible (query, key) pairs whose query is a real token."""
        length = self.tokens.shape[1]
        return visibility(self.mask, length, length) & self.real[:, None, :, None]

    def blocked(self) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """Hidden (query, key) pairs (future or padded keys) whose query is a real token."""
        length = self.tokens.shape[1]
        return ~visibility(self.mask, length, length) & self.real[:, None, :, None]


def _make_probe(subject: _Subject, eval_length: int, seed: int, tokens: Tensor | None) -> _Probe:
    if tokens is None:
        generator = torch.Generator().manual_seed(seed)
        row = torch.randint(0, subject.d_vocab, (eval_length,), generator=generator)
        bos = subject.special_tokens.get("bos_token_id")
        if isinstance(bos, int) and 0 <= bos < subject.d_vocab:
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
    device = _device_of(subject)
    token_batch, mask = token_batch.to(device), mask.to(device)
    return _Probe(token_batch, mask, position_ids_from_mask(mask), n_pad)


def _device_of(subject: _Subject) -> torch.device:
    return next(subject.model.parameters()).device


# ============================================================================= the audit
def audit(
    model: Any,
    eval_length: int = 16,
    *,
    tokens: Int[Tensor, "... pos"] | None = None,
    metadata: dict[str, Any] | None = None,
    train_lengths: tuple[int, int] | list[int] | None = None,
    shift: int = 3,
    seed: int = 0,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    name: str | None = None,
) -> AuditReport:
    """Run seed 002's ten-step position audit on a model.

    The probe batch is two rows: ``eval_length`` tokens (random with ``seed`` unless ``tokens`` is
    given; an HF model's BOS id first), and the same tokens left-padded by ``eval_length // 4``
    pads. Every step reports pass / fail / not_applicable and its evidence; see the module
    docstring for what each step checks. The model is run in eval mode under ``torch.no_grad``
    and its training flag is restored afterwards.

    Args:
        model: a nopelens ``Decoder``, a ``TrainedModel`` (its metadata gives training lengths),
            a TransformerLens ``TransformerBridge`` from
            :func:`~nopelens.models.adapters.bridge_hf_model`, or an HF causal LM (bridged here,
            which modifies it in place).
        eval_length: probe length in tokens, >= 4; at most the learned table's rows.
        tokens: optional int64 token ids ``[pos]`` (or ``[batch, pos]``: the first row is used).
        metadata: checkpoint metadata (``train_lengths`` = [min, max] and similar keys), merged
            over a ``TrainedModel``'s.
        train_lengths: training lengths, overriding the metadata.
        shift: the constant added to every position in step 8's shift intervention, >= 1.
        seed: seed of the random probe tokens.
        atol, rtol: agreement means max |a - b| <= atol + rtol * max |reference|.
        name: label of the model in the report.

    Returns:
        An :class:`AuditReport`.

    Raises:
        TypeError: if ``model`` is of an unsupported type.
        ValueError: on a probe shorter than 4 tokens, longer than a learned table, a non-positive
            shift, train_lengths that are not [min, max] with 1 <= min <= max, or an HF config
            whose position method cannot be read.
    """
    subject, meta = _subject(model, name)
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
    if subject.max_positions is not None and eval_length > subject.max_positions:
        raise ValueError(
            f"eval_length={eval_length} is past the learned position table ({subject.max_positions} "
            "rows): those positions cannot be computed at all"
        )
    tol = Tolerance(atol, rtol)
    subject.position_limit = 2 * eval_length + shift + 64
    module = subject.model
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            probe = _make_probe(subject, eval_length, seed, tokens)
            logits, cache, seen_ids = subject.run_with_cache(probe.tokens, probe.mask)
            run = _Run(subject, probe, logits, cache, seen_ids, tol)
            steps = [
                _step1(run), _step2(run), _step3(run), _step4(run), _step5(run, shift),
                _step6(run), _step7(run), _step8(run, shift), _step9(run), _step10(run, meta),
            ]
            reason = subject.unverifiable()
            if reason is not None:  # position steps: not_applicable, never a false fail
                steps = [_make_step(st.number, [], {}, "", reason) if st.number in (2, 4, 5, 6, 8) else st
                         for st in steps]
    finally:
        module.train(was_training)
    probe_record = {
        "tokens": probe.tokens.tolist(),
        "attention_mask": probe.mask.tolist(),
        "position_ids_from_mask": probe.ids.tolist(),
        "left_padding": probe.n_pad,
        "eval_length": eval_length,
        "seed": seed if tokens is None else None,
        "special_tokens": subject.special_tokens,
    }
    return AuditReport(subject.describe(), probe_record, steps)


@dataclass
class _Run:
    subject: _Subject
    probe: _Probe
    logits: Tensor
    cache: Any
    seen_ids: Tensor | None
    tol: Tolerance

    def hook(self, layer: int, name: str) -> Tensor | None:
        key = f"blocks.{layer}.attn.{name}"
        return self.cache[key] if key in self.cache.keys() else None

    def qk(self, layer: int) -> tuple[Tensor, Tensor]:
        """The q and k entering a layer's scores, before rotation (after any q/k norm)."""
        q_name, k_name = self.subject.qk_names(layer)
        return self.subject.prepare_qk(self.hook(layer, q_name), self.hook(layer, k_name), layer)

    def content(self, layer: int, ids: Tensor | None = None, pairing: str | None = None,
                direction: int = 1, base: float | None = None) -> Tensor:
        """q.k * scale of a layer, with q and k rotated by the reference when the layer is RoPE
        (row-centred where the model records no pre-softmax scores, see :meth:`scores`)."""
        q, k = self.qk(layer)
        spec = self.subject.rope_spec(layer)
        if spec is not None:
            ids = self.probe.ids if ids is None else ids
            b = spec.base if base is None else base
            q = _rotate(q.double(), ids, spec.rotary_dim, b, pairing or spec.pairing, direction)
            k = _rotate(k.double(), ids, spec.rotary_dim, b, pairing or spec.pairing, direction)
        return self._comparable(self.subject.content_scores(q, k, layer))

    def scores(self, layer: int) -> Tensor:
        """The pre-softmax scores: ``hook_attn_scores``, or, where the bridge's scores hook carries
        something else, log(hook_pattern) at allowed keys, which is the scores less a per-row
        constant (so both sides of every comparison are then row-centred)."""
        if self.subject.scores_trusted:
            return self.hook(layer, "hook_attn_scores").double()
        allowed = self.probe.allowed()
        logp = self.hook(layer, "hook_pattern").double().clamp(min=1e-300).log()
        return self._comparable(logp.masked_fill(~allowed, 0.0))

    def _comparable(self, scores: Tensor) -> Tensor:
        if self.subject.scores_trusted:
            return scores
        return scores - scores.diagonal(dim1=-2, dim2=-1)[..., :, None]

    def position_contribution(self, layer: int) -> Tensor | None:
        """The score a method adds: ``hook_pos_bias`` where hooked, else scores - content (HF)."""
        method = self.subject.layer_methods[layer]
        if method not in ("alibi", "shaw"):
            return None
        recorded = self.hook(layer, "hook_pos_bias")
        if recorded is not None:
            return recorded.double()
        allowed = self.probe.allowed()
        return (self.scores(layer) - self.content(layer)).masked_fill(~allowed, 0.0)

    @property
    def ids_used(self) -> Tensor:
        return self.seen_ids.expand_as(self.probe.ids) if self.seen_ids is not None else self.probe.ids


def _ids_list(ids: Tensor, real: Tensor) -> list[list[int]]:
    return [[int(p) for p, r in zip(row, rrow) if r] for row, rrow in zip(ids.tolist(), real.tolist())]


# ----------------------------------------------------------------------------- step 1
def _step1(run: _Run) -> StepResult:
    s, p = run.subject, run.probe
    checks, evidence = [], {
        "tokens": p.tokens.tolist(), "attention_mask": p.mask.tolist(),
        "special_tokens": s.special_tokens, "expected_position_ids": _ids_list(p.ids, p.real),
    }
    if run.seen_ids is not None:
        seen = run.ids_used
        evidence["recorded_position_ids"] = _ids_list(seen, p.real)
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
    padded = run.logits[1, p.n_pad:]
    checks.append(_agree(
        "left-padding invariance", padded, reference, run.tol,
        f"logits of the left-padded row's {n_real} real tokens vs the same tokens unpadded"))
    evidence["left_padding"] = p.n_pad
    return _make_step(1, checks, evidence, "probe batch recorded; left-padded row uses mask-derived ids "
                      "and gives the unpadded logits")


# ----------------------------------------------------------------------------- step 2
def _step2(run: _Run) -> StepResult:
    s, p = run.subject, run.probe
    checks: list[Check] = []
    evidence: dict[str, Any] = {
        "convention": "query i, key j, positions from 0; relative distance i - j >= 0 for visible keys; "
        "ALiBi bias -m_h (i - j); Shaw offset clip(j - i, -k, k); RoPE dot product depends on n - m "
        "(seed 002, column-vector convention)",
    }
    if run.seen_ids is not None and s.uses_positions:
        first = p.mask.argmax(-1)
        origin = run.ids_used.gather(1, first[:, None])[:, 0]
        evidence["first_real_token_position"] = origin.tolist()
        checks.append(Check("index origin", bool((origin == 0).all()),
                            f"first real token of each row at positions {origin.tolist()} (expected 0)"))
    for layer, method in enumerate(s.layer_methods):
        if method == "alibi":
            checks.append(_alibi_sign_check(run, layer, evidence))
        elif method == "shaw" and s.kind == _DecoderSubject.kind:
            checks.append(_shaw_sign_check(run, layer, evidence))
        elif method == "rope":
            checks.append(_rope_direction_check(run, layer, evidence))
    reason = None if checks else "no position method with an origin or signed offset (NoPE: only the causal mask)"
    relative = len(checks) > 1 or (checks and checks[0].name != "index origin")
    summary = ("first real token at 0; every relative method has its declared sign" if relative
               else "first real token of every row at position 0")
    return _make_step(2, checks, evidence, summary, reason)


def _alibi_sign_check(run: _Run, layer: int, evidence: dict) -> Check:
    """Fit bias_ij - bias_ii = -m_h (i - j) per head; expect m_h > 0, equal to the official slopes."""
    p = run.probe
    bias = run.position_contribution(layer)
    allowed = p.allowed()[:, 0]
    distance = (p.ids[:, :, None] - p.ids[:, None, :]).double()  # i - j
    centered = bias - bias.diagonal(dim1=-2, dim2=-1)[..., :, None]
    fitted = []
    for h in range(run.subject.n_heads):
        c = centered[:, h][allowed]
        dd = distance[allowed]
        fitted.append(float(-(c * dd).sum() / (dd * dd).sum()))
    expected = run.subject.alibi_slopes(layer).tolist()
    evidence[f"layer{layer}_alibi_fitted_slopes"] = fitted
    evidence[f"layer{layer}_alibi_expected_slopes"] = expected
    err = max(abs(a - b) for a, b in zip(fitted, expected))
    bound = run.tol.of(torch.tensor(expected))
    ok = all(f > 0 for f in fitted) and err <= bound
    sign = "penalizes distant keys" if all(f > 0 for f in fitted) else "REWARDS distant keys (sign flipped)"
    return Check(f"layer {layer} ALiBi sign", ok,
                 f"bias vs distance i - j: fitted slopes {[round(f, 5) for f in fitted]} (expected "
                 f"+m_h = {[round(e, 5) for e in expected]}); the bias {sign}", err, bound)


def _shaw_sign_check(run: _Run, layer: int, evidence: dict) -> Check:
    p, s = run.probe, run.subject
    q = run.hook(layer, "hook_q").double()
    table = s.model.blocks[layer].attn.W_rel_K.double()
    allowed = p.allowed()
    rows = shaw_relative_ids(p.ids, p.ids, s.shaw_clip)  # clip(j - i) + k
    declared = torch.einsum("bqhe,bqke->bhqk", q, table[rows]) * s.d_head ** -0.5
    mirrored = torch.einsum("bqhe,bqke->bhqk", q, table[rows.transpose(1, 2)]) * s.d_head ** -0.5  # clip(i - j)
    observed = run.position_contribution(layer)
    e_dec, e_mir = _max_err(observed, declared, allowed), _max_err(observed, mirrored, allowed)
    evidence[f"layer{layer}_shaw_error_j_minus_i"] = e_dec
    evidence[f"layer{layer}_shaw_error_i_minus_j"] = e_mir
    bound = run.tol.of(declared)
    return Check(f"layer {layer} Shaw offset sign", e_dec <= bound,
                 f"hook_pos_bias vs a^K at the declared offset clip(j - i): error {e_dec:.3g}; at the "
                 f"mirrored offset clip(i - j): error {e_mir:.3g}", e_dec, bound)


def _rope_direction_check(run: _Run, layer: int, evidence: dict) -> Check:
    """Which rotation sense reproduces the scores: R(+p theta) (declared) or R(-p theta).

    Both pairings are tried, so a pairing fault (step 5) does not read as a sign fault here.
    """
    scores = _observed_content(run, layer)
    allowed = run.probe.allowed()
    errors = {(pairing, direction): _max_err(scores, run.content(layer, pairing=pairing, direction=direction), allowed)
              for pairing in ("half", "interleaved") for direction in (1, -1)}
    evidence[f"layer{layer}_rope_errors"] = {f"{pairing} R({'+' if d > 0 else '-'}p)": e
                                              for (pairing, d), e in errors.items()}
    (pairing, direction), err = min(errors.items(), key=lambda item: item[1])
    bound = run.tol.of(scores[allowed.expand_as(scores)])
    if err > bound:
        return Check(f"layer {layer} RoPE rotation direction", False,
                     f"no rotation of either pairing or sense reproduces the scores (best error {err:.3g}); "
                     "see step 5", err, bound)
    plus = min(errors[(pr, 1)] for pr in ("half", "interleaved"))
    minus = min(errors[(pr, -1)] for pr in ("half", "interleaved"))
    sense = "R(+p theta), so q.k depends on n - m" if direction > 0 else "R(-p theta): the sign is flipped"
    return Check(f"layer {layer} RoPE rotation direction", direction > 0,
                 f"scores are reproduced by {sense} (error {plus:.3g} for R(+p theta), {minus:.3g} for "
                 "R(-p theta))", err, bound)


def _observed_content(run: _Run, layer: int) -> Tensor:
    """The q.k part of the scores as the model recorded it (bias-free layers: the scores)."""
    content = run.hook(layer, "hook_content_scores")
    if content is not None:
        return content.double()
    return run.scores(layer).masked_fill(~run.probe.allowed(), 0.0)


# ----------------------------------------------------------------------------- step 3
def _step3(run: _Run) -> StepResult:
    s, p = run.subject, run.probe
    allowed, blocked = p.allowed(), p.blocked()
    checks, evidence = [], {}
    min_allowed, max_blocked, worst_bias = [], [], []
    blocked_scores_ok, allowed_finite = True, True
    for layer in range(s.n_layers):
        pattern = run.hook(layer, "hook_pattern").double()
        min_allowed.append(float(pattern[allowed.expand_as(pattern)].min()))
        max_blocked.append(float(pattern[blocked.expand_as(pattern)].abs().max()))
        if s.scores_trusted:
            scores = run.hook(layer, "hook_attn_scores").double()
            blocked_values = scores[blocked.expand_as(scores)]
            blocked_scores_ok &= bool((blocked_values <= -1e30).all())
            allowed_finite &= bool(scores[allowed.expand_as(scores)].isfinite().all())
        bias = run.position_contribution(layer)
        if bias is not None:
            worst_bias.append(float(bias[allowed.expand_as(bias)].abs().max()))
    evidence.update(min_allowed_weight=min_allowed, max_blocked_weight=max_blocked, largest_bias=worst_bias)
    checks.append(Check("blocked entries have exactly zero weight", max(max_blocked) == 0.0,
                        f"max weight on a blocked (future or padded) key: {max(max_blocked):.3g}",
                        max(max_blocked), 0.0))
    checks.append(Check("allowed entries keep weight > 0", min(min_allowed) > 0.0,
                        f"min weight on an allowed key {min(min_allowed):.3g}"
                        + (f", under biases up to {max(worst_bias):.3g}" if worst_bias else ""), min(min_allowed)))
    if s.scores_trusted:
        checks.append(Check("mask is -inf (or the dtype minimum), biases finite", blocked_scores_ok and allowed_finite,
                            "blocked scores <= -1e30 and every allowed score finite" if blocked_scores_ok
                            and allowed_finite else "a blocked score is finite-valued or an allowed score is not finite"))
    else:
        evidence["masked_scores"] = ("not checked: the model records no pre-softmax scores (its hook_attn_scores "
                                     "carry the pattern); blocked weights are checked on hook_pattern")
    bias_layers = [l for l, m in enumerate(s.layer_methods) if m in ("alibi", "shaw")]
    if bias_layers:
        drop = _drop_bias(run, bias_layers)
        if drop is not None:
            checks += drop[0]
            evidence.update(drop[1])
        else:
            evidence["drop_bias"] = "not applicable: this model exposes no way to drop its score bias"
    else:
        evidence["drop_bias"] = "not applicable: no finite score bias in any layer"
    return _make_step(3, checks, evidence, "masks give exactly-zero weight; finite biases never block a key")


def _drop_bias(run: _Run, layers: list[int]) -> tuple[list[Check], dict] | None:
    """Re-run with every score bias zeroed: scores change, the blocked set does not."""
    s, p = run.subject, run.probe
    names = [f"blocks.{l}.attn.{n}" for l in layers for n in ("hook_attn_scores", "hook_pattern")]
    kept: dict[str, Tensor] = {}

    def keep(x, hook):
        kept[hook.name] = x.detach().clone()

    keep_hooks = [(n, keep) for n in names]
    if isinstance(s, _BridgeSubject):
        if not s._alibi_input:
            return None
        s.forward(p.tokens, p.mask, torch.zeros_like(p.ids), keep_hooks)
    else:
        s.forward(p.tokens, p.mask, None, s.drop_bias_hooks() + keep_hooks)
    allowed = p.allowed()
    real_rows = p.real[:, None, :, None]
    same_blocked, changed = True, []
    for layer in layers:
        before = run.hook(layer, "hook_pattern")
        after = kept[f"blocks.{layer}.attn.hook_pattern"]
        same_blocked &= bool(((before == 0) == (after == 0))[real_rows.expand_as(before)].all())
        score_before = run.hook(layer, "hook_attn_scores")
        score_after = kept[f"blocks.{layer}.attn.hook_attn_scores"]
        changed.append(_max_err(score_before, score_after, allowed))
    bound = run.tol.of(run.logits)
    checks = [
        Check("dropping the bias keeps the blocked set", same_blocked,
              "entries with zero weight are the same with and without the position bias"),
        Check("dropping the bias changes the scores", min(changed) > bound,
              f"max score change per bias layer {[round(c, 6) for c in changed]}", min(changed), bound),
    ]
    return checks, {"drop_bias_score_change": changed}


# ----------------------------------------------------------------------------- step 4
def _step4(run: _Run) -> StepResult:
    s, p = run.subject, run.probe
    if s.input_method is None:
        return _make_step(4, [], {}, "", f"no absolute position addition (methods {sorted(set(s.layer_methods))})")
    if "hook_pos_embed" not in run.cache.keys():
        return _make_step(4, [], {}, "", f"{s.input_method} positions are added, but the model's hook_pos_embed never "
                          "fires, so the added rows cannot be read")
    ids = run.ids_used.clamp(min=0)
    recorded = run.cache["hook_pos_embed"].double()
    offset = getattr(s, "position_offset", 0)
    if s.input_method == "learned":
        table = _learned_table(s).double()
        reference = table[ids + offset]
        what = "W_pos rows at the position ids" + (f" + {offset} (the table's first {offset} rows are reserved)"
                                                  if offset else "")
    else:
        reference, what = sinusoidal_table(ids, recorded.shape[-1], dtype=torch.float64), "sinusoidal_table(ids)"
    real = p.real[..., None]
    checks = [_agree("hook_pos_embed equals the table", recorded, reference, run.tol, what, real)]
    resid = run.cache["blocks.0.hook_resid_pre"].double()
    embed = run.cache["hook_embed"].double()
    checks.append(_agree("positions are added to the embeddings", resid, embed + recorded, run.tol,
                         "blocks.0.hook_resid_pre = hook_embed + hook_pos_embed", real))
    evidence = {"method": s.input_method, "position_ids": _ids_list(ids, p.real)}
    if s.input_method == "sinusoidal":
        first = recorded[0, 0, :4].tolist()
        evidence["row_at_position_0_first_dims"] = first
    return _make_step(4, checks, evidence, f"{s.input_method} position rows are looked up at the used ids and added")


def _learned_table(s: _Subject) -> Tensor:
    if isinstance(s, _DecoderSubject):
        return s.model.pos_embed.W_pos
    from nopelens.models.hf import position_table

    return position_table(s.model.original_model)


# ----------------------------------------------------------------------------- step 5
def _step5(run: _Run, shift: int) -> StepResult:
    s, p = run.subject, run.probe
    rope_layers = [l for l, m in enumerate(s.layer_methods) if m == "rope"]
    shaw_layers = [l for l, m in enumerate(s.layer_methods) if m == "shaw"]
    if not rope_layers and not shaw_layers:
        return _make_step(5, [], {}, "", f"no Q/K rotation or relation lookup (methods {sorted(set(s.layer_methods))})")
    checks, evidence = [], {}
    ids = run.ids_used.clamp(min=0)
    real_q = p.real[:, :, None, None]
    if rope_layers:
        evidence["rope"] = {layer: asdict(s.rope_spec(layer)) for layer in rope_layers}
        for layer in rope_layers:
            spec = s.rope_spec(layer)
            other = "interleaved" if spec.pairing == "half" else "half"
            q, k = run.qk(layer)
            rot_q = run.hook(layer, "hook_rot_q")
            if rot_q is not None:
                declared = apply_rope(q, ids, spec.rotary_dim, spec.base, spec.pairing)
                swapped = apply_rope(q, ids, spec.rotary_dim, spec.base, other)
                e_other = _max_err(rot_q, swapped, real_q)
                check = _agree(f"layer {layer} hook_rot_q = R(p) hook_q", rot_q, declared, run.tol,
                               f"pairing {spec.pairing} (the {other} pairing gives error {e_other:.3g})", real_q)
                if not check.passed and e_other <= check.tolerance:
                    check.detail += f"; the rotation matches the {other} pairing instead of the declared {spec.pairing}"
                checks.append(check)
                rot_k = run.hook(layer, "hook_rot_k")
                checks.append(_agree(f"layer {layer} hook_rot_k = R(p) hook_k", rot_k,
                                     apply_rope(k, ids, spec.rotary_dim, spec.base, spec.pairing), run.tol,
                                     f"rotary_dim {spec.rotary_dim}, base {spec.base:g}", real_q))
                if spec.rotary_dim < q.shape[-1]:
                    checks.append(_agree(f"layer {layer} dims past rotary_dim pass through",
                                         rot_q[..., spec.rotary_dim:], q[..., spec.rotary_dim:], run.tol,
                                         f"{q.shape[-1] - spec.rotary_dim} of {q.shape[-1]} dims unrotated "
                                         f"(rotary_fraction {spec.rotary_dim / q.shape[-1]:g})", real_q))
            cos = run.hook(layer, "hook_cos")
            if cos is not None:
                half = spec.rotary_dim // 2
                angles = rope_angles(ids, spec.rotary_dim, spec.base, dtype=torch.float64)
                layouts = {"half": torch.cat([angles.cos(), angles.cos()], -1),  # [theta_0.., theta_0..]
                           "interleaved": angles.cos().repeat_interleave(2, -1)}  # [theta_0, theta_0, ..]
                observed = cos.expand(ids.shape[0], -1, -1)[..., : 2 * half]
                errors = {name: _max_err(observed, ref, p.real[..., None]) for name, ref in layouts.items()}
                layout = min(errors, key=errors.get)  # the cos layout is HF's bookkeeping, not the pairing
                checks.append(_agree(f"layer {layer} hook_cos = cos(p theta_r)", observed, layouts[layout], run.tol,
                                     f"{half} frequencies base {spec.base:g} (HF's {layout} cos layout)",
                                     p.real[..., None]))
            checks.append(_rope_scores_check(run, layer, other, evidence))
        checks += _rope_offset_checks(run, rope_layers, shift, evidence)
    for layer in shaw_layers:
        checks += _shaw_lookup_checks(run, layer, evidence)
    return _make_step(5, checks, evidence, "rotations / lookups match the reference at the declared pairing, "
                      "fraction and offsets")


def _rope_scores_check(run: _Run, layer: int, other: str, evidence: dict) -> Check:
    observed = _observed_content(run, layer)
    allowed = run.probe.allowed()
    declared = run.content(layer)
    e_other = _max_err(observed, run.content(layer, pairing=other), allowed)
    evidence[f"layer{layer}_scores_error_other_pairing"] = e_other
    same = " (with one rotated pair the two pairings coincide)" if run.subject.rope_spec(layer).rotary_dim == 2 else ""
    return _agree(f"layer {layer} scores = R(p)q . R(p)k / sqrt(d_head)", observed, declared, run.tol,
                  f"scores vs the reference with the declared pairing, fraction and base ({other} "
                  f"pairing: error {e_other:.3g}{same})", allowed)


def _rope_offset_checks(run: _Run, layers: list[int], shift: int, evidence: dict) -> list[Check]:
    """Shift every position by a constant: the rotated dot products of RoPE layers do not change."""
    s, p = run.subject, run.probe
    if s.input_method is not None or not s.takes_positions:
        return []
    kept: dict[str, Tensor] = {}

    def keep(x, hook):
        kept[hook.name] = x.detach().clone()

    site = "hook_content_scores" if isinstance(s, _DecoderSubject) else (
        "hook_attn_scores" if s.scores_trusted else "hook_pattern")
    names = [f"blocks.{l}.attn.{site}" for l in layers]
    s.forward(p.tokens, p.mask, p.ids + shift, [(n, keep) for n in names])
    allowed = p.allowed()
    checks = []
    for layer, name in zip(layers, names):
        before = _observed_content(run, layer) if site != "hook_pattern" else run.hook(layer, site).double()
        after = kept[name].double().masked_fill(~allowed, 0.0)
        checks.append(_agree(f"layer {layer} rotated q.k depends only on the offset", after, before, run.tol,
                             f"scores with every position + {shift} vs the originals", allowed))
    return checks


def _shaw_lookup_checks(run: _Run, layer: int, evidence: dict) -> list[Check]:
    s, p = run.subject, run.probe
    if not isinstance(s, _DecoderSubject):
        return []
    attn = s.model.blocks[layer].attn
    ids = run.ids_used.clamp(min=0)
    rel_ids = shaw_relative_ids(ids, ids, s.shaw_clip)
    q = run.hook(layer, "hook_q").double()
    reference = torch.einsum("bqhe,bqke->bhqk", q, attn.W_rel_K.double()[rel_ids]) * s.d_head ** -0.5
    allowed = p.allowed()
    checks = [_agree(f"layer {layer} Shaw a^K lookup", run.hook(layer, "hook_pos_bias"), reference, run.tol,
                     f"q_i . a^K[clip(j - i, -{s.shaw_clip}, {s.shaw_clip})] / sqrt(d_head)", allowed)]
    evidence[f"layer{layer}_shaw_offsets_used"] = sorted(set((rel_ids[allowed[:, 0]] - s.shaw_clip).tolist()))
    if s.model.cfg.shaw_values:
        pattern = run.hook(layer, "hook_pattern").double()
        v = run.hook(layer, "hook_v").double()
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
        z = z + torch.einsum("bhqk,bqke->bqhe", pattern, attn.W_rel_V.double()[rel_ids])
        checks.append(_agree(f"layer {layer} Shaw a^V lookup", run.hook(layer, "hook_z"), z, run.tol,
                             "hook_z = A v + A a^V[clip(j - i)]", p.real[:, :, None, None]))
    return checks


# ----------------------------------------------------------------------------- step 6
def _step6(run: _Run) -> StepResult:
    s, p = run.subject, run.probe
    allowed = p.allowed()
    checks, evidence, derived = [], {}, []
    for layer, method in enumerate(s.layer_methods):
        scores = run.scores(layer)
        content_hook = run.hook(layer, "hook_content_scores")
        q_rot = run.hook(layer, "hook_rot_q")
        if content_hook is not None:
            q = q_rot if q_rot is not None else run.hook(layer, "hook_q")
            k = run.hook(layer, "hook_rot_k") if q_rot is not None else run.hook(layer, "hook_k")
            checks.append(_agree(f"layer {layer} content = q.k / sqrt(d_head)", content_hook,
                                 _dot_scores(q, k, s.score_scale(layer)), run.tol,
                                 "hook_content_scores recomputed from the hooked q and k", allowed))
            content = content_hook.double()
        else:
            content = run.content(layer)
            derived.append(layer)
        bias = run.position_contribution(layer)
        if bias is None or content_hook is not None:  # a derived bias adds up by construction
            total = content + (bias if bias is not None else 0.0)
            checks.append(_agree(f"layer {layer} content + position = scores", scores, total, run.tol,
                                 f"{method}: " + ("content + position bias" if bias is not None
                                                  else "content only (no score bias)"),
                                 allowed))
        if method == "alibi":
            ids = run.ids_used.clamp(min=0)
            reference = alibi_bias(s.alibi_slopes(layer).to(ids.device), ids, ids).double()
            observed = bias
            if content_hook is None:  # HF adds slope * p_j; compare up to the per-row constant
                observed = bias - bias.diagonal(dim1=-2, dim2=-1)[..., :, None]
            checks.append(_agree(f"layer {layer} ALiBi position contribution", observed, reference, run.tol,
                                 "-m_h (i - j) with the official slopes"
                                 + (" (row-centred)" if content_hook is None else ""),
                                 allowed))
    if derived:
        evidence["derived_content_layers"] = derived
        evidence["note"] = ("the bridge hooks no separate content or bias scores; content is recomputed from "
                            "hook_q/hook_k (rotated by the reference for RoPE) and the position part is "
                            "hook_attn_scores - content")
    return _make_step(6, checks, evidence,
                      "content and position parts are recorded separately and add up to the scores")


# ----------------------------------------------------------------------------- step 7
def _step7(run: _Run) -> StepResult:
    s, p = run.subject, run.probe
    real_rows = p.real[:, None, :, None]
    blocked = p.blocked()
    checks = []
    worst_key, worst_query, worst_sum, worst_block = 0.0, math.inf, 0.0, 0.0
    for layer in range(s.n_layers):
        pattern = run.hook(layer, "hook_pattern").double()
        if s.scores_trusted:
            scores = run.hook(layer, "hook_attn_scores").double()
            worst_key = max(worst_key, _max_err(pattern, scores.softmax(-1), real_rows))
            worst_query = min(worst_query, _max_err(pattern, scores.softmax(-2), real_rows))
        worst_sum = max(worst_sum, _max_err(pattern.sum(-1), torch.ones_like(pattern.sum(-1)), p.real[:, None]))
        worst_block = max(worst_block, float(pattern[blocked.expand_as(pattern)].abs().max()))
    bound = run.tol.atol
    evidence: dict[str, Any] = {"padded_query_rows_excluded": p.n_pad}
    if s.scores_trusted:
        checks.append(Check("softmax over the key axis", worst_key <= bound,
                            f"hook_pattern = softmax(hook_attn_scores, key axis): error {worst_key:.3g}; over the "
                            f"query axis it would be {worst_query:.3g}", worst_key, bound))
    else:
        evidence["softmax_axis"] = ("not checked: the model records no pre-softmax scores (its hook_attn_scores carry "
                                    "the pattern)")
    checks.append(Check("unmasked rows sum to 1", worst_sum <= bound,
                        f"max |row sum - 1| over real query rows {worst_sum:.3g}", worst_sum, bound))
    checks.append(Check("blocked entries exactly 0", worst_block == 0.0,
                        f"max weight at blocked entries {worst_block:.3g}", worst_block, 0.0))
    return _make_step(7, checks, evidence,
                      "patterns are key-axis softmaxes; rows sum to 1; blocked entries are exactly 0")


# ----------------------------------------------------------------------------- step 8
def _step8(run: _Run, shift: int) -> StepResult:
    s, p = run.subject, run.probe
    if not s.takes_positions:
        return _make_step(8, [], {}, "", "the model takes no position ids (its position bias is built from key "
                          "indices), so positions cannot be intervened on")
    base = run.logits.double()
    bound = run.tol.of(base)
    checks, evidence = [], {"expectations": {}}

    def effect(position_ids: Tensor) -> Tensor:
        return (s.forward(p.tokens, p.mask, position_ids).double() - base).abs().amax(-1)

    def expect(label: str, diff: Tensor, where: Tensor, should_change: bool, why: str) -> None:
        value = float(diff[where].max()) if where.any() else 0.0
        changed = value > bound
        evidence["expectations"][label] = why
        evidence[f"{label}_max_logit_change"] = value
        checks.append(Check(label, changed == should_change,
                            f"expected {'a change' if should_change else 'no change'} ({why}); "
                            f"max logit change {value:.3g}", value, bound))

    uses = s.uses_positions
    zero = torch.zeros_like(p.ids)
    expect("zeroed positions", effect(zero), p.real, uses,
           "every method reads positions" if uses else "NoPE reads no positions")
    absolute = s.input_method is not None
    top = int(p.ids.max()) + shift
    if s.max_positions is not None and top >= s.max_positions:
        evidence["shifted positions"] = f"not run: position {top} is past the {s.max_positions}-row table"
    else:
        expect(f"positions shifted by {shift}", effect(p.ids + shift), p.real, absolute,
               f"{s.input_method} positions are absolute" if absolute
               else "NoPE, RoPE, ALiBi and Shaw depend only on offsets")
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
    expect("swap: tokens before the first swapped one", diff, before, False,
           "causal: earlier queries neither see nor carry the swapped positions")
    expect("swap: tokens from the first swapped one on", diff, after, uses,
           "their positions or offsets changed" if uses else "NoPE reads no positions")
    return _make_step(8, checks, evidence, "every intervention has its method's expected effect")


# ----------------------------------------------------------------------------- step 9
def _step9(run: _Run) -> StepResult:
    s, p = run.subject, run.probe
    split = max(p.n_pad + 1, p.tokens.shape[1] // 2)
    logits, record = s.decode_incrementally(p.tokens, p.mask, split)
    checks, evidence = [], {"prefix_length": split, "decoded_one_token_at_a_time": p.tokens.shape[1] - split}
    step_ids = record["step_ids"]
    if step_ids is not None:
        full = run.ids_used
        bad = (step_ids != full) & p.real
        evidence["incremental_position_ids"] = _ids_list(step_ids, p.real)
        detail = "position ids assigned while decoding equal the full forward's"
        if bad.any():
            b, i = bad.nonzero()[0].tolist()
            detail = f"row {b} token {i}: decoding assigned {int(step_ids[b, i])}, the full forward {int(full[b, i])}"
        checks.append(Check("cached position assignments", not bad.any(), detail))
    if record.get("cache_ids") is not None:
        cache_ids = record["cache_ids"]
        bad = (cache_ids != p.ids) & p.real
        checks.append(Check("KV cache position ids", not bad.any(),
                            "cache.position_ids equal position_ids_from_mask" if not bad.any()
                            else f"cache holds {_ids_list(cache_ids, p.real)}, the mask gives "
                            f"{_ids_list(p.ids, p.real)}"))
    checks.append(_agree("cached logits = full forward", logits, run.logits, run.tol,
                         f"prefix of {split} tokens, then one token at a time", p.real[..., None]))
    return _make_step(9, checks, evidence,
                      "incremental decoding assigns the same positions and logits as the full forward")


# ----------------------------------------------------------------------------- step 10
def _step10(run: _Run, meta: dict[str, Any]) -> StepResult:
    s, p = run.subject, run.probe
    eval_lengths = sorted(set(p.mask.sum(-1).tolist()))
    evidence: dict[str, Any] = {"eval_lengths": eval_lengths, "max_eval_position": int(p.ids.max())}
    found = next(((k, meta[k]) for k in TRAIN_LENGTH_KEYS if meta.get(k) is not None), None)
    if found is None:
        evidence["train_lengths"] = "unknown"
        return _make_step(10, [], evidence, "", "training lengths unknown (no train_lengths in the metadata); "
                          f"evaluated at lengths {eval_lengths}; {GENERALIZATION_NOTE}",
                          warnings=[f"training lengths unknown: {GENERALIZATION_NOTE}"])
    key, value = found
    lengths = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"metadata {key}={value!r} is not a list of positive lengths")
    evidence.update(train_lengths=lengths, metadata_key=key)
    beyond = [n for n in eval_lengths if n > max(lengths)]
    warnings = []
    if beyond:
        warnings.append(f"evaluation lengths {beyond} go past the longest training length {max(lengths)}: "
                        f"{GENERALIZATION_NOTE}")
    check = Check("lengths reported before any generalization claim", True,
                  f"trained on lengths {lengths}, evaluated at {eval_lengths}"
                  + (f"; {len(beyond)} beyond training" if beyond else "; within training"))
    return _make_step(10, [check], evidence, f"trained on {lengths}, evaluated at {eval_lengths}"
                      + (" (BEYOND training)" if beyond else ""), warnings=warnings)
