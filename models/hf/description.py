"""What an HF causal LM's description says: per layer (:class:`LayerPosition`), per query
(:class:`QueryScale`) and for the whole model (:class:`HFDescription`), and the two refusals.

Pairing (seed 002: "pair layout ... must agree"): ``half`` rotates (x_r, x_{r + d/2}) as
GPT-NeoX/Llama do; ``interleaved`` rotates (x_{2r}, x_{2r+1}) as GPT-J, CodeGen, Cohere, GLM and
Llama 4 (complex multiplication) do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..hooks import act_name
from ..masks import KeyWindow
from ..methods import METHODS, QK_ROTATION, SCORE_BIAS, get_method

PAIRINGS = ("half", "interleaved")
SINK_KINDS = ("learned", "output_scale", "per_token")
"""How a layer adds an attention sink besides token 0 (:attr:`LayerPosition.sink`)."""

BLOCK_INDEXER_FIELDS = {
    "QSA": ("indexer_budget", "indexer_compress_ratio"),
    "DSA k-pool": ("index_topk", "index_kpool"),
}
"""Block indexer -> the config fields of its budget (keys) and block size."""

MIXER_LABELS = {"linear_attention": "linear attention", "ssm": "ssm (no attention)", "none": "MLP only (no attention)"}
"""A block without softmax attention, by its ``mixer``, in the words of the per-layer labels."""


class UnsupportedModelError(ValueError):
    """An HF model nopelens cannot measure right: refused with a one-line reason."""


class ConfigError(ValueError):
    """An HF config that contradicts itself (:func:`check_config`): the message names the field."""


@dataclass(frozen=True)
class QueryScale:
    """A position-dependent factor tau(p) on a layer's queries (a temperature on its scores).

    Attributes:
        kind: ``llama4`` (``Llama4TextAttention``: tau = 1 + attn_scale * log1p(floor((p + 1) /
            floor_scale)) on NoPE layers, ``transformers/models/llama4/modeling_llama4.py``) or
            ``beam`` (``compute_attention_scaling``: tau = exp(0.1 * log1p((p + 1) / 2048)), i.e.
            (1 + (p + 1) / 2048) ** 0.1, ``transformers/models/beam/modeling_beam.py``) or ``inkling2``
            (``Inkling2LogScale`` on full-attention layers: tau = 1 + attn_scale * log(max((p + 1) /
            floor_scale, 1)), exactly 1 below position floor_scale - 1, on the queries and on the
            relative-bias states alike, ``transformers/models/inkling2/modeling_inkling2.py``).
        by: what p counts: ``index`` (Llama 4 counts the token's index, ``arange(seq_len) +
            past_seen_tokens``, not its position id, so left padding shifts it) or ``position``
            (Beam and Inkling 2 read ``position_ids``).
        floor_scale, attn_scale: Llama 4's (and Inkling 2's ``log_scaling_n_floor`` and
            ``log_scaling_alpha``) parameters.

    Example:
        >>> [round(t, 6) for t in QueryScale("llama4", "index", 4, 0.1).factor(torch.arange(8)).tolist()[2:5]]
        [1.0, 1.069315, 1.069315]
        >>> round(float(QueryScale("beam", "position").factor(torch.tensor([2047]))), 6)
        1.071773
        >>> [round(t, 6) for t in QueryScale("inkling2", "position", 8, 0.1).factor(torch.tensor([0, 6, 15])).tolist()]
        [1.0, 1.0, 1.069315]
    """

    kind: str
    by: str
    floor_scale: float | None = None
    attn_scale: float | None = None

    def factor(self, p: Tensor) -> Tensor:
        """tau(p) in float64 for positions (or indices) ``p``."""
        p = p.double()
        if self.kind == "llama4":
            return 1.0 + self.attn_scale * torch.log1p(torch.floor((p + 1.0) / self.floor_scale))
        if self.kind == "beam":
            return torch.exp(0.1 * torch.log1p((p + 1.0) / 2048.0))
        if self.kind == "inkling2":
            return 1.0 + self.attn_scale * torch.log(((p + 1.0) / self.floor_scale).clamp(min=1.0))
        raise ValueError(f"unknown query scale {self.kind!r}")

    def describe(self) -> str:
        if self.kind == "llama4":
            return (
                f"queries times 1 + {self.attn_scale:g} log1p(floor((i + 1) / {self.floor_scale:g})), i the token's "
                "index (Llama 4 temperature tuning)"
            )
        if self.kind == "inkling2":
            return (
                f"queries and relative-bias states times 1 + {self.attn_scale:g} log(max((p + 1) / "
                f"{self.floor_scale:g}, 1)), p the position id (Inkling 2's log scaling)"
            )
        return "queries times (1 + (p + 1) / 2048)^0.1, p the position id (Beam's scalable softmax)"


@dataclass(frozen=True)
class LayerPosition:
    """How one layer uses positions (its attention, or another mixer).

    Attributes:
        method: ``nope`` (only the causal mask), ``rope`` (rotated q/k), ``alibi`` (score bias) or
            ``unknown`` (the config does not say; nothing about positions is verified).
        rotary_dim: rotated dims per head (RoPE), ``rotary_fraction * d_head``.
        rotary_base: RoPE base b (theta_r = b^(-2r / rotary_dim)).
        pairing: ``half`` or ``interleaved`` (RoPE).
        alibi_slopes: per-head slopes m_h (ALiBi), in score units per token before ``bias_scale``.
        bias_scale: factor on the ALiBi bias (Falcon multiplies q.k + bias by 1/sqrt(d_head)).
        score_scale: factor on q.k in the scores (1/sqrt(d_head) unless the family says otherwise).
        softcap: scores become softcap * tanh(scores / softcap) (Gemma 2 ``attn_logit_softcapping``).
        sliding_window: key j is visible to query i only when i - j < sliding_window (None: no
            window); see :mod:`nopelens.models.masks`.
        chunk_size: key j is visible to query i only when i // chunk_size == j // chunk_size
            (Llama 4's ``attention_chunk_size`` on its ``chunked_attention`` layers), or None.
        rope_type: HF's ``rope_type``; only ``default`` (unscaled) has a nopelens reference.
        mixer: ``attention`` (softmax attention with a pattern), ``linear_attention`` (a
            linear-attention mixer: Gated DeltaNet, KDA), ``ssm`` (a state-space mixer: Mamba)
            or ``none`` (an MLP-only block). Only ``attention`` has a pattern; the others take no
            position ids, so their method is ``nope``.
        rotary_start: first rotated dim of each q/k head (0; MLA heads are ``[nope | rope]``, so
            the rotated slice starts at ``qk_nope_head_dim``).
        query_scale: a position-dependent factor on the queries (:class:`QueryScale`), or None.
        sink: how the layer adds an attention sink besides token 0: None, ``learned`` (one logit
            per head in the softmax denominator, so rows sum to 1 - p_sink: GPT-OSS), ``output_scale``
            (the same logit applied as a sigmoid(lse - s_h) scale on the output, so the returned
            pattern still sums to 1: Granite SWA) or ``per_token`` (a logit per query token,
            projected from its hidden state: Inkling 2).
        relative_bias: keys closer than this get a learned bias by distance, none beyond
            (Inkling 2's ``rel_extent``), or None.
        qk_reference: why the hooked q and k cannot be held against nopelens' reference rotation
            (e.g. MLA's shared key slice), or None; the detector still measures the layer.
        index_topk: a DeepSeek Sparse Attention (DSA) indexer keeps, per query, only the
            ``index_topk`` visible keys it scores highest (the others get exactly zero weight): a
            content-dependent sparse mask on top of the causal one, or None (no indexer). It bites
            once a query sees more than ``index_topk`` keys (:meth:`sparse_reason`).
        index_block: with a block indexer (Qwen4-Exp's QSA), the keys per block: each query keeps
            the ``index_topk // index_block`` complete blocks of ``index_block`` visible keys it
            scores highest (``index_topk`` is ``indexer_budget``) and its incomplete last block, so
            it keeps every key while it sees fewer than ``index_topk + index_block``; None: a DSA
            indexer, key by key.
        index_kind: which block indexer (a key of :data:`BLOCK_INDEXER_FIELDS`): ``QSA`` (Qwen4-Exp)
            or ``DSA k-pool`` (GLM-5.3's pooled DSA, ``index_topk`` in pools of ``index_kpool``).
    """

    method: str
    score_scale: float
    rotary_dim: int | None = None
    rotary_base: float | None = None
    pairing: str | None = None
    alibi_slopes: tuple[float, ...] | None = None
    bias_scale: float = 1.0
    softcap: float | None = None
    sliding_window: int | None = None
    chunk_size: int | None = None
    rope_type: str = "default"
    mixer: str = "attention"
    rotary_start: int = 0
    query_scale: "QueryScale | None" = None
    sink: str | None = None
    relative_bias: int | None = None
    qk_reference: str | None = None
    index_topk: int | None = None
    index_block: int | None = None
    index_kind: str = "QSA"

    @property
    def key_window(self) -> "KeyWindow":
        """The layer's window and chunk as the mask rule of :mod:`nopelens.models.masks`."""
        return KeyWindow(self.sliding_window, self.chunk_size)

    def sparse_reason(self, length: int) -> str | None:
        """Why the layer's attention over ``length`` real tokens is not the window rule alone, or None.

        With a DSA indexer (``index_topk``), a query that sees more than ``index_topk`` keys attends
        only to the ones its indexer picks; with a QSA block indexer (``index_block`` too), a query
        that sees ``index_topk + index_block`` keys or more. Which ones depends on the content, so
        no static mask (and no read that assumes one: masks, sink mass, variance, scores) describes it.

        Example:
            >>> LayerPosition("rope", 1.0, index_topk=8).sparse_reason(8) is None
            True
            >>> LayerPosition("rope", 1.0, index_topk=8).sparse_reason(9)[:38]
            'a DSA indexer keeps only the top 8 of '
            >>> qsa = LayerPosition("rope", 1.0, index_topk=8, index_block=4)
            >>> qsa.sparse_reason(11) is None, qsa.sparse_reason(12)[:50]
            (True, 'a QSA indexer keeps only the top 2 blocks of 4 key')
        """
        if self.index_topk is None:
            return None
        unmodelled = f"a content-dependent sparse mask nopelens does not model, and {length}-token sequences exceed it"
        if self.index_block is None:
            if length <= self.index_topk:
                return None
            return (
                f"a DSA indexer keeps only the top {self.index_topk} of the keys a query sees (index_topk), "
                f"{unmodelled}"
            )
        if length < self.index_topk + self.index_block:
            return None
        budget, block = BLOCK_INDEXER_FIELDS[self.index_kind]
        return (
            f"a {self.index_kind} indexer keeps only the top {self.index_topk // self.index_block} blocks of "
            f"{self.index_block} keys a query sees and its incomplete last block ({budget} {self.index_topk}, "
            f"{block} {self.index_block}), {unmodelled}"
        )

    def label(self, d_head: int | None = None) -> str:
        """The layer in a few words, e.g. ``rope (rotary_fraction 0.5, sliding window 4, learned sink)``,
        ``nope``, or for a block without attention ``linear attention``, ``ssm (no attention)`` or
        ``MLP only (no attention)``.

        Example:
            >>> LayerPosition("rope", 1.0, rotary_dim=4, sliding_window=4, sink="learned").label(d_head=8)
            'rope (rotary_fraction 0.5, sliding window 4, learned sink)'
            >>> LayerPosition("nope", 1.0, mixer="linear_attention").label()
            'linear attention'
            >>> LayerPosition("nope", 1.0, mixer="ssm").label()
            'ssm (no attention)'
        """
        if self.mixer != "attention":
            return MIXER_LABELS.get(self.mixer, self.mixer)
        parts = []
        if self.rotates and d_head and self.rotary_dim is not None and self.rotary_dim < d_head:
            parts.append(f"rotary_fraction {self.rotary_dim / d_head:g}")
        if self.rotates and self.rope_type != "default":
            parts.append(f"rope_type {self.rope_type}")
        if not self.key_window.causal_only:
            parts.append(self.key_window.describe())
        if self.query_scale is not None:
            parts.append("query scale")
        if self.relative_bias is not None:
            parts.append(f"relative bias below {self.relative_bias} tokens")
        if self.sink is not None:
            parts.append(f"{self.sink.replace('_', '-')} sink")
        if self.index_topk is not None:
            parts.append(f"{self.index_kind if self.index_block else 'DSA'} indexer")
        return self.method + (f" ({', '.join(parts)})" if parts else "")

    @property
    def unit(self):
        """The registry's method unit of this layer (:mod:`nopelens.models.methods`), None if unknown."""
        return get_method(self.method) if self.method in METHODS else None

    @property
    def rotates(self) -> bool:
        """The layer rotates q and k (its unit acts as a q/k rotation)."""
        return self.unit is not None and self.unit.acts(QK_ROTATION)

    @property
    def biases_scores(self) -> bool:
        """The layer adds a finite bias to its scores (its unit acts as a score bias)."""
        return self.unit is not None and self.unit.acts(SCORE_BIAS)


@dataclass(frozen=True)
class HFDescription:
    """A bridged HF causal LM as nopelens reads it (see the module docstring).

    Attributes:
        architecture: HF class name, e.g. ``SmolLM3ForCausalLM``.
        family: ``config.model_type``.
        n_layers, n_heads, n_kv_heads, d_head, d_vocab: sizes.
        input_position: ``learned``, ``sinusoidal`` or None (positions enter no input table).
        position_offset: the table row of position p is ``p + position_offset``.
        max_positions: rows of a learned table (positions past it cannot be computed), or None.
        layers: one :class:`LayerPosition` per block.
        qk_norm: None, or how q and k are normalized before the scores (``per-head``,
            ``full-width`` or ``l2 after rope``).
        q_hook, k_hook: the attention hook names (under ``blocks.{l}.attn.``) holding the q and k
            that enter the scores, before rotation.
        qk_layout: how those hooks lay q and k out: ``batch pos head d_head`` (TransformerLens'
            layout), ``batch head pos d_head`` (the bridged per-head q/k norms) or
            ``batch pos (head d_head)`` (OLMo-2's full-width norm).
        position_ids_hook: a hook whose input is the position ids (a learned table that is a
            plain ``nn.Embedding``), or None (OPT's table takes the attention mask).
        position_input: how positions enter the model: ``position_ids`` (the forward takes them),
            ``alibi_tensor`` (an ``alibi`` tensor slope_h * p_j, with p_j counted from the attention mask, is
            handed to every attention: Bloom, Falcon with ALiBi before transformers 5.25), ``alibi_mask``
            (slope_h * p_j * bias_scale is folded into the 4-D attention mask every attention adds to
            its scores: Falcon with ALiBi from transformers 5.25) or None (MPT builds its ALiBi bias
            from key indices; no position ids can be given).
        fired: every hook name that fired in the census forward pass.
        scores_hook: ``hook_attn_scores`` holds the pre-softmax scores behind ``hook_pattern``.
        causal_under_mask: future keys got zero weight with an ``attention_mask`` passed.
        notes: what the description could not verify, or knows to be approximate.
        adapter: how the model is hooked: ``TransformerBridge``, or ``forward hooks``
            (:class:`nopelens.models.adapters.HookedHFModel`, where the bridge refuses it; no
            q, k or pre-softmax scores are hooked then).
        cache_unreadable: why decoding through the hooked model's KV cache is not the model's own
            (the family's ``bridge_cache_broken``, :class:`nopelens.models.hf.family.Family`), or None.
    """

    architecture: str
    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_vocab: int
    input_position: str | None
    position_offset: int
    max_positions: int | None
    layers: tuple[LayerPosition, ...]
    qk_norm: str | None
    q_hook: str
    k_hook: str
    qk_layout: str = "batch pos head d_head"
    position_ids_hook: str | None = None
    position_input: str | None = "position_ids"
    fired: frozenset[str] = field(default_factory=frozenset)
    scores_hook: bool = True
    causal_under_mask: bool = True
    notes: tuple[str, ...] = ()
    adapter: str = "TransformerBridge"
    cache_unreadable: str | None = None

    @property
    def layer_methods(self) -> tuple[str, ...]:
        """Per-layer attention method names, e.g. SmolLM3 ``('rope', 'rope', 'rope', 'nope')``."""
        return tuple(layer.method for layer in self.layers)

    def key_windows(self) -> dict[int, "KeyWindow"]:
        """Layer -> its sliding window or chunk, for every layer that has one (the sink and
        variance reads take this as ``windows``)."""
        return {l: layer.key_window for l, layer in enumerate(self.layers) if not layer.key_window.causal_only}

    @property
    def cache_caveat(self) -> str | None:
        """What is known to make transformers' own cached decoding differ from its full forward
        here, or None: with ``sliding_window`` 1 (or ``attention_chunk_size`` 1, cached in the same
        layer), ``DynamicSlidingWindowLayer`` keeps the last ``sliding_window - 1`` keys as
        ``keys[:, :, -0:]``, i.e. every key (transformers 5.24, ``cache_utils.py``), so a decoded
        token sees keys the full forward blocks."""
        if any(layer.key_window.only_self for layer in self.layers):
            return (
                "a window or chunk of 1: transformers' sliding-window cache slices its last window - 1 = 0 keys "
                "as keys[-0:], i.e. keeps every key, so decoded tokens see keys the full forward blocks"
            )
        return None

    def fires(self, site: str) -> bool:
        """True if the hook ``site`` fired in the census (hook points that never fire are untrusted)."""
        return site in self.fired

    def rotated_qk_sites(self, layer: int) -> tuple[str, str] | None:
        """``hook_rot_q``/``hook_rot_k`` of a RoPE layer when the bridge fires them, else None."""
        names = (act_name("rot_q", layer), act_name("rot_k", layer))
        if self.layers[layer].rotates and all(self.fires(n) for n in names):
            return names
        return None

    def unrotated_qk(self, layer: int) -> str | None:
        """Why a content q.k read of ``layer`` cannot see the position RoPE adds, or None: the layer
        rotates q and k, but no hook that fires holds them rotated (TransformerLens 4.3 lists
        ``hook_rot_q/k`` on GPT-NeoX, Phi-3, GPT-J and Falcon and never fires them), and
        ``hook_q``/``hook_k`` hold them before the rotation."""
        if self.layers[layer].rotates and self.rotated_qk_sites(layer) is None:
            return (
                "hook_rot_q/k never fire, and hook_q/k hold q and k before RoPE, where a q·k read misses the "
                "position RoPE adds; the score read covers it"
            )
        return None

    def scores_unreadable(self, site: str) -> str | None:
        """Why the pre-softmax scores hooked at ``site`` (a block's ``hook_attn_scores``) cannot be
        read, or None when they can."""
        if self.adapter == "forward hooks":
            return "hooked with forward hooks, not through TransformerBridge: no hook exposes them"
        if not self.scores_hook:
            return (
                "the bridge's hook_attn_scores is not the scores behind hook_pattern: their softmax is not it, "
                "or it is the pattern itself"
            )
        if not self.fires(site):
            return "their hook_attn_scores never fires"
        return None

    def attention_absent(self) -> str | None:
        """Why no attention read applies to the model at all (no block is softmax attention), or None.

        Example:
            >>> ssm = LayerPosition("nope", 1.0, mixer="ssm")
            >>> HFDescription("Toy", "toy", 2, 1, 1, 8, 16, None, 0, None, (ssm, ssm), None, "hook_q", "hook_k"
            ...               ).attention_absent()
            'Toy has no attention block (blocks 0-1: ssm (no attention)): no attention pattern to read'
        """
        if any(layer.mixer == "attention" for layer in self.layers):
            return None
        kinds = sorted({layer.label() for layer in self.layers})
        what = kinds[0] if len(kinds) == 1 else ", ".join(kinds)
        return (
            f"{self.architecture} has no attention block (blocks 0-{self.n_layers - 1}: {what}): no attention "
            "pattern to read"
        )

    def summary(self) -> str:
        """One line: family, input positions and the per-layer methods."""
        methods = ", ".join(self.layer_methods)
        return (
            f"{self.architecture} ({self.family}): input positions {self.input_position or 'none'}; layers: {methods}"
        )
