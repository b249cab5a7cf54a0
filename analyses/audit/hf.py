"""HF models as audit subjects (bridged, or hooked with forward hooks), read through
:func:`nopelens.models.hf.describe`.

Everything family-specific (per-layer method, RoPE parameters, score scale and soft-capping, q/k
norms, which hooks carry what they say, how positions enter the model) comes from the description
in :mod:`nopelens.models.hf`, the one package that knows HF families; this module only runs the
bridged model and hands the audit what the description says.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import asdict
from typing import Any, Iterator

import torch
from torch import Tensor

from nopelens.models.hf import _one_line, check_readable, describe, l2_normalize, learned_sinks, position_table
from nopelens.models.hooks import act_name
from nopelens.models.methods import get_method
from nopelens.models.methods.nope import NoPE
from nopelens.models.positions import position_ids_from_mask, rope_angles
from nopelens.probes.sinks import learned_sink_line, learned_sink_logits

from .numerics import as_ids, dot_scores
from .report import by_reason
from .subjects import DecodingUnavailable, RopeSpec, Subject, audited_hook


class BridgeSubject(Subject):
    """An HF causal LM through TransformerBridge, read through :func:`nopelens.models.hf.describe`.

    Everything family-specific (per-layer method, RoPE parameters, score scale and soft-capping,
    q/k norms, which hooks carry what they say, how positions enter) comes from the description;
    this class only runs the model.
    """

    kind = "HF causal LM via TransformerBridge"

    def __init__(self, bridge: Any, name: str):
        self.model, self.name = bridge, name
        self.hf = describe(bridge)
        check_readable(self.hf)
        self.config = bridge.original_model.config
        # each layer's method is the registry's unit; its parameters come from the description
        self.layer_methods = tuple(spec.unit or NoPE() for spec in self.hf.layers)
        self.input_method = get_method(self.hf.input_position) if self.hf.input_position else None
        self.n_heads, self.d_head, self.d_vocab = self.hf.n_heads, self.hf.d_head, self.hf.d_vocab
        self.max_positions = self.hf.max_positions
        self.position_offset = self.hf.position_offset
        rope_layers = [l for l, spec in enumerate(self.hf.layers) if spec.rotates]
        self.details = {}
        if rope_layers:
            self.rope = self.rope_spec(rope_layers[0])
            self.details["rope"] = asdict(self.rope)
        self.details |= {
            "hf": {
                "architecture": self.hf.architecture,
                "family": self.hf.family,
                "layer_positions": list(self.hf.layer_methods),
                "qk_norm": self.hf.qk_norm,
                "scores_hook": self.hf.scores_hook,
                "position_input": self.hf.position_input,
                "layers": [asdict(layer) for layer in self.hf.layers],
                "notes": list(self.hf.notes),
            }
        }
        self.details |= learned_sink_details(bridge.original_model)
        self.special_tokens = {
            k: getattr(self.config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        }
        self.position_limit = 4096  # audit() sets it from the probe length

    @property
    def layer_labels(self) -> list[str]:
        return [layer.label(self.hf.d_head) for layer in self.hf.layers]

    @property
    def layer_names(self) -> list[str]:
        return list(self.hf.layer_methods)  # ``unknown`` stays visible in reports

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the input embedding: what the layers compute in (a few small parameters,
        such as GPT-OSS's sinks, may be kept in float32)."""
        return self.model.original_model.get_input_embeddings().weight.dtype

    def key_window(self, layer: int):
        return self.hf.layers[layer].key_window

    # --- what the description says -----------------------------------------------------------
    def rope_spec(self, layer: int) -> RopeSpec | None:
        spec = self.hf.layers[layer]
        if not spec.rotates:
            return None
        return RopeSpec(spec.rotary_dim, spec.rotary_base, spec.pairing)

    def score_scale(self, layer: int) -> float:
        return self.hf.layers[layer].score_scale

    def content_scores(self, q: Tensor, k: Tensor, layer: int) -> Tensor:
        scores = dot_scores(q, k, self.score_scale(layer))
        cap = self.hf.layers[layer].softcap
        return scores if cap is None else cap * torch.tanh(scores / cap)

    def qk_names(self, layer: int) -> tuple[str, str]:
        return self.hf.q_hook, self.hf.k_hook

    def qk_unreadable(self, layer: int) -> str | None:
        spec = self.hf.layers[layer]
        if spec.rotates and spec.rope_type != "default":
            return (
                f"rope_type {spec.rope_type!r} scales RoPE frequencies; the reference covers the default "
                "(unscaled) RoPE only"
            )
        return spec.qk_reference

    def query_scale(self, layer: int):
        return self.hf.layers[layer].query_scale

    def decoding_unreadable(self) -> str | None:
        return self.hf.cache_unreadable

    def decoding_caveat(self) -> str | None:
        return self.hf.cache_caveat

    def relative_bias(self, layer: int) -> int | None:
        return self.hf.layers[layer].relative_bias

    def sparse_reason(self, length: int) -> str | None:
        reasons = {l: self.hf.layers[l].sparse_reason(length) for l in self.attention_layers}
        return by_reason({l: why for l, why in reasons.items() if why is not None}) or None

    def sink(self, layer: int):
        kind = self.hf.layers[layer].sink
        if kind not in ("learned", "output_scale"):
            return kind, None
        if not hasattr(self, "_sinks"):
            self._sinks = learned_sinks(self.model.original_model, self.hf)
        return kind, self._sinks[layer]

    @property
    def attention_layers(self) -> list[int]:
        return [l for l, spec in enumerate(self.hf.layers) if spec.mixer == "attention"]

    def prepare_qk(self, q: Tensor, k: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        q, k = self._tl_layout(q), self._tl_layout(k)
        if self.hf.qk_norm == "l2 after rope" and self.hf.layers[layer].rotates:
            eps = float(getattr(self.config, "rms_norm_eps", 1e-6))
            return l2_normalize(q.double(), eps), l2_normalize(k.double(), eps)  # commutes with the rotation
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
        unknown = [l for l, spec in enumerate(self.hf.layers) if spec.unit is None]
        if unknown:
            return (
                f"the position method of {self.hf.family!r} layers {unknown} is not known to nopelens.models.hf; "
                "nothing about positions is verified"
            )
        if self.hf.qk_norm is not None and "not hooked" in self.hf.qk_norm:
            return (
                f"{self.hf.family} normalizes q and k ({self.hf.qk_norm}) where the bridge hooks neither, so "
                "the q and k entering the scores cannot be read"
            )
        return None

    @property
    def _alibi_input(self) -> bool:
        return self.hf.position_input in ("alibi_tensor", "alibi_mask")

    def _alibi_bias(self, kwargs: dict) -> tuple[str, Tensor | None]:
        """The attention's keyword argument carrying slope_h * p_j, and its value (None: not handed)."""
        key = "attention_mask" if self.hf.position_input == "alibi_mask" else "alibi"
        return key, kwargs.get(key)

    def _alibi_key_positions(self, bias: Tensor, batch: int) -> Tensor:
        """``[batch, key]`` positions p_j read from head 0's bias (blocked keys, i.e. padding, read 0)."""
        if self.hf.position_input == "alibi_mask":  # [batch, heads, query, key]; the last query sees every key
            row = bias[:, 0, -1].double()
            p = row.masked_fill(row < -1, 0.0) / float(self.alibi_slopes(0)[0])
            # m_h / sqrt(d_head) is rarely exact in the mask's dtype: accept its round-off while it is unambiguous
            slack = torch.finfo(bias.dtype).eps * p.abs()
            return torch.where(((p - p.round()).abs() <= slack) & (slack < 0.5), p.round(), p)
        return bias.reshape(batch, self.n_heads, -1)[:, 0].double() / float(self.hf.layers[0].alibi_slopes[0])

    @property
    def takes_positions(self) -> bool:
        return self.hf.position_input is not None

    def alibi_slopes(self, layer: int) -> Tensor:
        spec = self.hf.layers[layer]
        return torch.tensor(spec.alibi_slopes, dtype=torch.float64) * spec.bias_scale

    def attention(self, layer: int):
        raise TypeError("the audit reads no position table of an HF model's attention")

    def input_reference(self, position_ids: Tensor, width: int) -> Tensor:
        """The learned position table's rows at the ids (plus the family's row offset), float64."""
        return position_table(self.model.original_model).double()[position_ids + self.position_offset]

    def forward_without_bias(self, tokens, mask, fwd_hooks, rows=slice(None)):
        """The ALiBi bias (slope_h * p_j, as a tensor or folded into the mask) zeroed in batch rows ``rows``;
        other families cannot drop a bias."""
        if not self._alibi_input:
            return False

        def pre(module, args, kwargs):
            key, bias = self._alibi_bias(kwargs)
            if bias is None:
                return None
            zeroed = bias.clone()  # Bloom's [batch * heads, 1, key], Falcon <5.25 [batch, heads, 1, key]
            if self.hf.position_input == "alibi_mask":  # Falcon 5.25's mask: open entries hold the bias
                zeroed[rows] = torch.where(bias[rows] < -1, bias[rows], torch.zeros_like(bias[rows]))
            else:
                zeroed.view(tokens.shape[0], -1)[rows] = 0
            return args, {**kwargs, key: zeroed}

        handles = [b.attn.register_forward_pre_hook(pre, with_kwargs=True) for b in self.model.blocks]
        try:
            self.forward(tokens, mask, None, fwd_hooks)
        finally:
            for h in handles:
                h.remove()
        return True

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
        in_mask = self.hf.position_input == "alibi_mask"
        slopes = self.alibi_slopes(0) if in_mask else torch.tensor(self.hf.layers[0].alibi_slopes)
        slopes = slopes.to(position_ids.device)

        def pre(module, args, kwargs):
            key, bias = self._alibi_bias(kwargs)
            if bias is None:
                return None
            # Bloom hands [batch * heads, 1, key], Falcon <5.25 [batch, heads, 1, key]: both hold slope_h * p_j;
            # Falcon 5.25's mask [batch, heads, query, key] holds slope_h * p_j / sqrt(d_head), blocked below -1
            ids = position_ids[:, -bias.shape[-1] :].to(bias.dtype)
            new = slopes[None, :, None].to(bias.dtype) * ids[:, None, :]
            new = torch.where(bias < -1, bias, new[:, :, None]) if in_mask else new.reshape(bias.shape)
            return args, {**kwargs, key: new}

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
            logits, cache = self.model.run_with_cache(
                tokens, names_filter=audited_hook, **self._kwargs(mask, position_ids)
            )
        return logits, cache, (seen[0] if seen else None)

    @contextlib.contextmanager
    def capture_position_ids(self) -> Iterator[list]:
        """Record the position ids the HF model used, read back from its own position evidence.

        Learned tables: the ids entering the table (``pos_embed.hook_in``, less the family's row
        offset). RoPE: decoded from the cos/sin the rotary embedding computed (``hook_cos|hook_sin``
        of the first RoPE layer). ALiBi handed as a tensor or folded into the mask: read from
        slope_h * p_j. Otherwise not observable.
        """
        seen: list[Tensor] = []
        bridge = self.model
        if self._alibi_input:

            def pre(module, args, kwargs):
                _, bias = self._alibi_bias(kwargs)
                if bias is not None:
                    hidden = args[0] if args else kwargs["hidden_states"]
                    keys = self._alibi_key_positions(bias, hidden.shape[0])
                    seen.append(as_ids(keys[:, -hidden.shape[1] :]))

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
        rope_layers = [l for l, spec in enumerate(self.hf.layers) if spec.rotates]
        names = [act_name(n, rope_layers[0]) for n in ("cos", "sin")] if rope_layers else []
        if (
            not names
            or not all(self.hf.fires(n) for n in names)
            or self.unverifiable() is not None
            or self.hf.layers[rope_layers[0]].rope_type != "default"
        ):
            yield seen  # no angles nopelens can decode (e.g. scaled RoPE frequencies)
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
                c, s = c_all[..., start : start + 32, None, :], s_all[..., start : start + 32, None, :]
                err = (c - ref_cos).abs().sum(-1) + (s - ref_sin).abs().sum(-1)
                found.append(err.argmin(-1))
                worst = max(worst, float(err.min(-1).values.max()))
            if worst < best_worst:
                best_ids, best_worst = torch.cat(found, -1), worst
        resolution = max(1e-3, 4 * float(torch.finfo(cos.dtype).eps))  # cos/sin rounded to the model's dtype
        if best_worst > resolution * half:  # not angles p * theta_r for any p < position_limit
            best_ids = torch.full_like(best_ids, -1)
        return best_ids.to(device)

    def decode_incrementally(self, tokens, mask, split):
        pieces = []
        with self.capture_position_ids() as seen, warnings.catch_warnings():
            # The bridge hands HF its cache as past_key_values, which transformers 5 deprecates.
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            logits, past = self.model(
                tokens[:, :split], attention_mask=mask[:, :split], return_type="logits_and_cache", use_cache=True
            )
            pieces.append(logits)
            for t in range(split, tokens.shape[1]):
                logits, past = self.model(
                    tokens[:, t : t + 1],
                    attention_mask=mask[:, : t + 1],
                    past_key_values=past,
                    return_type="logits_and_cache",
                    use_cache=True,
                )
                pieces.append(logits)
        ids = torch.cat([s.expand(tokens.shape[0], -1) for s in seen], 1) if len(seen) == len(pieces) else None
        return torch.cat(pieces, 1), {"step_ids": ids, "cache_ids": None}


class HookedSubject(BridgeSubject):
    """An HF causal LM the bridge refuses, read through :class:`~nopelens.models.adapters.HookedHFModel`.

    Its hooks reach the residual stream and the attention weights, not q, k or the pre-softmax
    scores: the steps that need those (the rotation checks of steps 2 and 5, step 6) say so per
    layer, and every other step, the per-layer detector included, runs on the patterns and logits.
    HF's own cache serves step 9.
    """

    kind = "HF causal LM via forward hooks"

    def qk_unreadable(self, layer: int) -> str | None:
        return (
            "the model is hooked with PyTorch forward hooks (TransformerLens cannot bridge it), which reach "
            "its attention weights but not its q and k"
        )

    def forward(self, tokens, mask, position_ids=None, fwd_hooks=()):
        with self.model.hooks(fwd_hooks=list(fwd_hooks)):
            return self.model(tokens, attention_mask=mask, position_ids=position_ids)

    def run_with_cache(self, tokens, mask, position_ids=None):
        with self.capture_position_ids() as seen:
            logits, cache = self.model.run_with_cache(
                tokens, names_filter=audited_hook, attention_mask=mask, position_ids=position_ids
            )
        return logits, cache, (seen[0] if seen else None)

    @contextlib.contextmanager
    def capture_position_ids(self) -> Iterator[list]:
        """The position ids the model hands its first decoder layer (what its rotary embedding reads)."""
        seen: list[Tensor] = []
        layer = dict(self.model.original_model.named_modules())[self.model.layout.layers[0]]

        def pre(module, args, kwargs):
            ids = kwargs.get("position_ids")
            if isinstance(ids, Tensor):
                hidden = args[0] if args else kwargs["hidden_states"]
                seen.append(ids.detach().clone().expand(hidden.shape[0], -1))

        handle = layer.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            yield seen
        finally:
            handle.remove()

    def decode_incrementally(self, tokens, mask, split):
        """HF's own KV cache: a prefix of ``split`` tokens, then one token at a time."""
        hf, ids = self.model.original_model, position_ids_from_mask(mask)
        pieces = []
        with self.capture_position_ids() as seen, warnings.catch_warnings():
            # transformers 5.24 renames past_key_values to cache in some families and warns about it
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            try:
                out = hf(tokens[:, :split], attention_mask=mask[:, :split], position_ids=ids[:, :split], use_cache=True)
                pieces.append(out.logits)
                for t in range(split, tokens.shape[1]):
                    out = hf(
                        tokens[:, t : t + 1],
                        attention_mask=mask[:, : t + 1],
                        position_ids=ids[:, t : t + 1],
                        past_key_values=out.past_key_values,
                        use_cache=True,
                    )
                    pieces.append(out.logits)
            except Exception as error:  # the model's own cache, not nopelens: say so, never a traceback
                raise DecodingUnavailable(
                    f"{type(hf).__name__}'s own KV cache fails when decoding one token at a "
                    f"time ({type(error).__name__}: {_one_line(error)})"
                ) from None
        step_ids = torch.cat(seen, 1) if len(seen) == len(pieces) else None
        return torch.cat(pieces, 1), {"step_ids": step_ids, "cache_ids": None}


def learned_sink_details(hf_model: Any) -> dict[str, Any]:
    """``learned_sinks`` of an audit's model record: the model's learned sink logits, named, one
    line summarising them and each block's per-head list (from the weights:
    :func:`nopelens.probes.sinks.learned_sink_logits`); empty where it has none."""
    table = learned_sink_logits(hf_model)
    if table.empty:
        return {}
    per_block = {int(block): rows.sort_values("head")["sink_logit"].tolist() for block, rows in table.groupby("block")}
    return {
        "learned_sinks": {
            "summary": learned_sink_line(table),
            "parameters": sorted(set(table["parameter"])),
            "logits_per_block": per_block,
        }
    }
