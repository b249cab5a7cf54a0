"""What nopelens knows about HF causal LMs: the one place that knows model families.

:func:`describe` turns a bridged HF model (a TransformerLens ``TransformerBridge`` from
:func:`nopelens.models.adapters.bridge_hf_model`) into an :class:`HFDescription`: per layer, the
position method (``nope``, ``rope``, ``alibi``) with its parameters, the score scale, q/k
normalization, and which bridged hooks can be trusted. The audit, ``probe``, ``sinks`` and the
sweep read this description; none of them branches on a model type.

Two sources, kept apart:

- the config (and the family's documented formula, cited per family below) gives the position
  method, rotary fraction, base, pairing, score scale, soft-capping and q/k norms;
- one small forward pass (a *census*) gives what the bridge actually does: which hook points fire
  (TransformerLens 4.3 lists ``hook_rot_q``/``hook_rot_k`` on GPT-NeoX, Phi-3, GPT-J and Falcon
  but never fires them), whether ``hook_attn_scores`` are the scores behind ``hook_pattern`` (the
  plain ``AttentionBridge`` of GPT-J, GPT-Neo, OPT, XGLM and Llama 4 fires it with the softmaxed
  pattern), and whether future keys get zero weight under an ``attention_mask`` (OpenAI-GPT's
  bridged attention drops its causal mask when given one).

Pairing (seed 002: "pair layout ... must agree"): ``half`` rotates (x_r, x_{r + d/2}) as
GPT-NeoX/Llama do; ``interleaved`` rotates (x_{2r}, x_{2r+1}) as GPT-J, CodeGen, Cohere, GLM and
Llama 4 (complex multiplication) do.
"""

from __future__ import annotations

import inspect
import math
import re
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn
from transformers.models.falcon.modeling_falcon import FalconAttention

from .hooks import act_name
from .masks import KeyWindow
from .methods import METHODS, QK_ROTATION, SCORE_BIAS, get_method
from .positions import alibi_slopes

PAIRINGS = ("half", "interleaved")
INTERLEAVED_FAMILIES = ("gptj", "codegen", "cohere", "cohere2", "glm", "llama4_text", "llama4")
LEARNED_FAMILIES = ("gpt2", "gpt_neo", "opt", "gpt_bigcode", "openai-gpt")
ALIBI_FAMILIES = ("bloom", "mpt")
POSITION_OFFSET = {"opt": 2, "xglm": 2}
"""Families whose position table is read at ``position_id + offset`` (OPT and XGLM keep two rows
for padding ids; ``OPTLearnedPositionalEmbedding``, ``XGLMSinusoidalPositionalEmbedding``)."""


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
            return (f"queries times 1 + {self.attn_scale:g} log1p(floor((i + 1) / {self.floor_scale:g})), i the token's "
                    "index (Llama 4 temperature tuning)")
        if self.kind == "inkling2":
            return (f"queries and relative-bias states times 1 + {self.attn_scale:g} log(max((p + 1) / "
                    f"{self.floor_scale:g}, 1)), p the position id (Inkling 2's log scaling)")
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
            linear-attention or state-space mixer: Mamba, Gated DeltaNet, KDA; it takes no position
            ids, so its method is ``nope``) or ``none`` (an MLP-only block).
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
            return (f"a DSA indexer keeps only the top {self.index_topk} of the keys a query sees (index_topk), "
                    f"{unmodelled}")
        if length < self.index_topk + self.index_block:
            return None
        budget, block = BLOCK_INDEXER_FIELDS[self.index_kind]
        return (f"a {self.index_kind} indexer keeps only the top {self.index_topk // self.index_block} blocks of "
                f"{self.index_block} keys a query sees and its incomplete last block ({budget} {self.index_topk}, "
                f"{block} {self.index_block}), {unmodelled}")

    def label(self, d_head: int | None = None) -> str:
        """The layer in a few words, e.g. ``rope (rotary_fraction 0.5, sliding window 4, learned sink)``,
        ``nope``, ``linear attention`` (a mixer without softmax attention) or ``MLP only``.

        Example:
            >>> LayerPosition("rope", 1.0, rotary_dim=4, sliding_window=4, sink="learned").label(d_head=8)
            'rope (rotary_fraction 0.5, sliding window 4, learned sink)'
            >>> LayerPosition("nope", 1.0, mixer="linear_attention").label()
            'linear attention'
        """
        if self.mixer != "attention":
            return {"linear_attention": "linear attention", "none": "MLP only"}.get(self.mixer, self.mixer)
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
            (:data:`BRIDGE_CACHE_BROKEN`), or None.
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
            return ("a window or chunk of 1: transformers' sliding-window cache slices its last window - 1 = 0 keys "
                    "as keys[-0:], i.e. keeps every key, so decoded tokens see keys the full forward blocks")
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
            return ("hook_rot_q/k never fire, and hook_q/k hold q and k before RoPE, where a q·k read misses the "
                    "position RoPE adds; the score read covers it")
        return None

    def scores_unreadable(self, site: str) -> str | None:
        """Why the pre-softmax scores hooked at ``site`` (a block's ``hook_attn_scores``) cannot be
        read, or None when they can."""
        if self.adapter == "forward hooks":
            return "hooked with forward hooks, not through TransformerBridge: no hook exposes them"
        if not self.scores_hook:
            return ("the bridge's hook_attn_scores is not the scores behind hook_pattern: their softmax is not it, "
                    "or it is the pattern itself")
        if not self.fires(site):
            return "their hook_attn_scores never fires"
        return None

    def summary(self) -> str:
        """One line: family, input positions and the per-layer methods."""
        methods = ", ".join(self.layer_methods)
        return f"{self.architecture} ({self.family}): input positions {self.input_position or 'none'}; layers: {methods}"


# ----------------------------------------------------------------------------- from the config
def describe_config(config: Any, architecture: str | None = None) -> HFDescription:
    """The static part of the description: what the config and the family's formulas say.

    Args:
        config: an HF ``PretrainedConfig`` of a causal LM.
        architecture: the HF class name (default: the first of ``config.architectures``).

    Returns:
        An :class:`HFDescription` without census results (``fired`` empty).

    Raises:
        UnsupportedModelError: on a config without the sizes every causal LM declares.
    """
    config = text_config(config)
    check_config(config)
    # the config class's own model_type: a config.json whose "model_type" was edited still builds the class
    # its "architectures" names, and the family rules must be that class's
    family = str(getattr(type(config), "model_type", "") or getattr(config, "model_type", ""))
    architecture = architecture or (list(getattr(config, "architectures", None) or [family])[0])
    n_heads = int(_first(config, "num_attention_heads", "n_head", "num_heads", "attention_heads", "n_heads"))
    d_model = int(_first(config, "hidden_size", "n_embd", "d_model"))
    d_head = int(getattr(config, "head_dim", None) or d_model // n_heads)
    if family in MLA_FAMILIES:
        d_head = sum(mla_head_dims(config))
    n_kv = _first(config, "num_key_value_heads", "num_kv_heads", default=None)
    if family in ("falcon",) and not getattr(config, "new_decoder_architecture", False):
        n_kv = 1 if getattr(config, "multi_query", False) else n_heads
    if family == "gpt_bigcode" and getattr(config, "multi_query", False):
        n_kv = 1
    n_layers = int(_first(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    input_position, max_positions = _input_position(config, family)
    layers = tuple(_layer(config, family, layer, d_head) for layer in range(n_layers))
    qk_norm, q_hook, k_hook = _qk_norm(config, family)
    qk_layout = {"per-head": "batch head pos d_head", "full-width": "batch pos (head d_head)"}.get(
        qk_norm or "", "batch pos head d_head")
    position_input = "position_ids"
    if layers and layers[0].biases_scores:
        position_input = None if family == "mpt" else _alibi_carrier(family)
    return HFDescription(
        architecture=architecture, family=family, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(n_kv or n_heads), d_head=d_head, d_vocab=int(config.vocab_size),
        input_position=input_position, position_offset=POSITION_OFFSET.get(family, 0),
        max_positions=max_positions, layers=layers, qk_norm=qk_norm, q_hook=q_hook, k_hook=k_hook,
        position_input=position_input, qk_layout=qk_layout, notes=_notes(config, family),
    )


PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "no_rope_layers", "layer_rope_theta")
"""Config fields with one entry per layer, which the family rules below index by layer."""

LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
SIZE_FIELDS = ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_heads", "n_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")
"""Config fields that fix weight shapes, under each family's name: each must be at least 1 where a
config gives it (:func:`check_config`; transformers divides by some), and those a config gives are
named in the hint when its saved weights do not fit it (:func:`nopelens.models.hf_loading.load_hf_dir`)."""


def check_config(config: Any) -> None:
    """Refuse a config that contradicts itself, before a model is built from it or described.

    transformers builds such a model with an ``IndexError`` deep in a layer's ``__init__``, or
    builds one whose mask lets a query see no key at all; this names the field instead.

    Args:
        config: an HF ``PretrainedConfig`` of a causal LM (or its text sub-config).

    Raises:
        ConfigError: (a ``ValueError``) if the layer count or a size (:data:`SIZE_FIELDS`) is
            below 1, a per-layer list
            (:data:`PER_LAYER_FIELDS`) does not have one entry per layer, or a layer's sliding
            window or attention chunk is shorter than one token (a
            window of 0 blocks every key: every query row would be fully masked), a
            ``rope_parameters`` dict keyed by layer type has no entry for some layer's type, or a
            multi-head latent attention config's head sizes cannot be read (:func:`mla_head_dims`).

    Example:
        >>> from transformers import MistralConfig
        >>> try:
        ...     check_config(MistralConfig(num_hidden_layers=2, sliding_window=0))
        ... except ValueError as error:
        ...     print(error)
        sliding_window is 0: a window must be at least 1 token (every query row would be fully masked)
        >>> check_config(MistralConfig(num_hidden_layers=2, sliding_window=1))  # one token: itself
    """
    config = text_config(config)
    count = next((name for name in LAYER_COUNT_FIELDS if getattr(config, name, None) is not None), None)
    if count is None:
        return  # describe_config names the missing size
    n_layers = int(getattr(config, count))
    if n_layers < 1:
        raise ConfigError(f"{count} is {n_layers}: a model needs at least one layer")
    mla = str(getattr(type(config), "model_type", "")) in MLA_FAMILIES
    if mla:
        mla_head_dims(config)
    for name in SIZE_FIELDS:
        value = getattr(config, name, None)
        if mla and name == "head_dim":  # MLA configs' convention: head_dim is the rope slice, 0 when NoPE
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{name} is {value}: a model's sizes must be at least 1")
    width, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if getattr(config, "head_dim", None) is None and isinstance(width, int) and isinstance(heads, int) and heads > width:
        raise ConfigError(f"num_attention_heads {heads} is more than hidden_size {width}: each head would have "
                          f"{width // heads} dimensions")
    for name in PER_LAYER_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) != n_layers:
            raise ConfigError(f"{name} has {len(value)} entries for {n_layers} layers ({count})")
    for layer in range(n_layers):
        _key_window(config, layer)
        _rope_by_layer_type(config, layer)


def mla_head_dims(config: Any) -> tuple[int, int]:
    """(``qk_nope_head_dim``, ``qk_rope_head_dim``) of a multi-head latent attention config, as its
    attention reads them (``self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim``,
    ``deepseek_v3/modeling_deepseek_v3.py``, ``glm5_next/modeling_glm5_next.py``). A rope slice of 0 is
    a NoPE attention (GLM-5.3's indexed layers: ``Glm5NextTextConfig`` defaults it to 0 and
    refuses any other value).

    Raises:
        ConfigError: if either is missing, not an integer or negative, or both are 0.

    Example:
        >>> from transformers import DeepseekV3Config
        >>> mla_head_dims(DeepseekV3Config(num_hidden_layers=1))
        (128, 64)
    """
    dims = []
    for name in ("qk_nope_head_dim", "qk_rope_head_dim"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} is {value!r}: multi-head latent attention needs a whole number of dims "
                              "(0 or more) for each head's nope and rope slices")
        dims.append(value)
    if sum(dims) < 1:
        raise ConfigError("qk_nope_head_dim and qk_rope_head_dim are both 0: each head needs at least one q/k dim")
    return dims[0], dims[1]


def text_config(config: Any) -> Any:
    """The decoder's config: ``config`` itself for a causal LM, the text sub-config of a multimodal
    ``...ForConditionalGeneration`` (Mistral Large 4, Muse Glimmer, Muse Spark: ``get_text_config``),
    whose language model is the decoder nopelens reads (text input only)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def trained_length(config: Any) -> int | None:
    """The sequence length an HF config says its model was made for (``max_position_embeddings``, or
    GPT-2's ``n_positions``), or None where it says none. A RoPE or NoPE layer computes any position;
    past this length the model was not trained.

    >>> from transformers import LlamaConfig
    >>> trained_length(LlamaConfig(max_position_embeddings=16, num_hidden_layers=1))
    16
    """
    value = _first(text_config(config), "max_position_embeddings", "n_positions", default=None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _first(config: Any, *names: str, default: Any = ...) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is ...:
        raise UnsupportedModelError(f"config of {type(config).__name__} has none of {names}")
    return default


def _input_position(config: Any, family: str) -> tuple[str | None, int | None]:
    if family in LEARNED_FAMILIES:
        return "learned", int(_first(config, "n_positions", "max_position_embeddings"))
    if family == "xglm":
        return "sinusoidal", None
    return None, None


def _layer(config: Any, family: str, layer: int, d_head: int) -> LayerPosition:
    scale = _score_scale(config, family, layer, d_head)
    window, chunk = _key_window(config, layer)
    softcap = getattr(config, "attn_logit_softcapping", None)
    common = dict(score_scale=scale, sliding_window=window, chunk_size=chunk, mixer=_mixer(config, layer),
                  softcap=float(softcap) if softcap else None, sink=_sink(config, family, layer),
                  relative_bias=_relative_bias(config, family, layer), **_indexer(config, family, layer))
    plain = LayerPosition(_layer_method(config, family, layer), **common)
    if plain.biases_scores:
        slopes, bias_scale = _alibi(config, family, d_head)
        return replace(plain, alibi_slopes=slopes, bias_scale=bias_scale)
    if not plain.rotates:  # NoPE, or a method nopelens does not know (nothing about it is verified)
        return replace(plain, query_scale=_query_scale(config, family, layer),
                       qk_reference=MLA_REFERENCE if family in MLA_FAMILIES else None)
    base, fraction, rope_type = _rope_parameters(config, family, layer)
    pairing = "interleaved" if family in INTERLEAVED_FAMILIES else "half"
    if family in MLA_FAMILIES:  # heads are [nope | rope]; the rope slice of k is one head shared by all
        start, rotary_dim = mla_head_dims(config)
        interleaved = family in MLA_ALWAYS_INTERLEAVED or getattr(config, "rope_interleave", False)
        pairing = "interleaved" if interleaved else pairing
        return replace(plain, rotary_dim=rotary_dim, rotary_base=base, pairing=pairing, rope_type=rope_type,
                       rotary_start=start, qk_reference=MLA_REFERENCE)
    declared = None if family in ROTARY_DIM_UNREAD else getattr(config, "rotary_dim", None)
    rotary_dim = int(declared or round(d_head * fraction))
    rotary_dim -= rotary_dim % 2
    if family in TRAILING_ROPE_FAMILIES:
        return replace(plain, rotary_dim=rotary_dim, rotary_base=base, pairing="interleaved", rope_type=rope_type,
                       rotary_start=d_head - rotary_dim, qk_reference=(
                           "the rotated slice is the trailing rotary_dim dims of each head (DeepSeek V4's "
                           "[nope | rope] layout); nopelens' reference rotation covers the leading dims"))
    return replace(plain, rotary_dim=rotary_dim, rotary_base=base, pairing=pairing, rope_type=rope_type)


NON_ATTENTION_TYPES = {"linear_attention": "linear_attention", "mamba": "linear_attention", "moe": "none",
                       "mlp": "none"}
"""``config.layer_types`` entries (transformers normalizes hybrids' block types to these) that are
no softmax attention: linear attention and state-space mixers (Mamba, Gated DeltaNet, KDA), and
MLP-only blocks (Nemotron-H)."""

NO_ROPE_LAYER_FAMILIES = ("smollm3", "llama4_text", "llama4", "mistral_large4_text")
"""``no_rope_layers[l]``: 1 = layer l rotates, 0 = NoPE (``self.use_rope = config.no_rope_layers[layer_idx]``
in ``transformers/models/smollm3/modeling_smollm3.py`` and ``llama4/modeling_llama4.py``; the
SmolLM3 config docstring says the same, and the detector measures it)."""
ROPE_IF_SLIDING = ("cohere2", "flint", "lara_mini")
"""RoPE only in sliding-window layers, NoPE in full ones (``if self.sliding_window is not None:``
in ``cohere2/modeling_cohere2.py`` and ``flint/modeling_flint.py``; ``lara_mini/modeling_lara_mini.py``
passes ``position_embeddings=None`` to its global layers)."""
ROPE_UNLESS_GLOBAL = ("exaone4", "exaone_moe", "kolibri1")
"""``if self.sliding_window is None or self.is_sliding:`` rotate (``exaone4/modeling_exaone4.py``):
with a window, the full-attention layers are NoPE; without one, every layer rotates."""
LAYER_THETA_FAMILIES = ("granite_swa", "granitemoe_swa", "muse_glimmer_text", "muse_spark_text")
"""``layer_rope_theta[l]`` is layer l's RoPE base; 0 = NoPE (``granite_swa/configuration_granite_swa.py``;
the model passes ``position_embeddings=None`` to such a layer)."""
NOPE_ATTENTION_FAMILIES = ("jamba", "kimi_linear", "nemotron_h", "zamba", "inkling2_text")
"""Attention with no rotary embedding at all (``kimi_linear/modeling_kimi_linear.py`` keeps MLA's
``k_rot`` slice but never rotates it; Jamba, Nemotron-H and Zamba attention apply none; Inkling 2
has a relative bias instead)."""
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "minicpm3", "youtu",
                "longcat_flash", "sarvam_mla", "mistral_large4_text", "mistral4", "axk1", "axk2", "glm_moe_dsa",
                "bailing_hybrid", "dots3_note_text", "glm5_next_text")
"""Multi-head latent attention (``deepseek_v3/modeling_deepseek_v3.py``): q and k heads are
``[qk_nope_head_dim | qk_rope_head_dim]``; only the last slice rotates, and k's rotated slice is one
head broadcast to all."""


MLA_ALWAYS_INTERLEAVED = ("deepseek_v2", "deepseek_v32", "longcat_flash", "mistral_large4_text", "axk2",
                          "glm_moe_dsa", "bailing_hybrid", "dots3_note_text")
"""MLA families that rotate interleaved pairs whatever the config says (no ``rope_interleave``
field): ``apply_rotary_pos_emb_interleave`` in the attention of ``deepseek_v32``, ``longcat_flash``,
``mistral_large4``, ``axk2``, ``glm_moe_dsa``, ``bailing_hybrid`` and ``dots3_note``'s modeling
files (their DSA indexers rotate half-split pairs, but only to choose keys), and DeepSeek V2's
complex multiplication (``apply_rotary_emb``)."""

DSA_FAMILIES = ("deepseek_v32", "hy_v4", "mistral_large4_text", "deepseek_v4", "axk2", "glm_moe_dsa", "dots3_note_text")
"""Families with a DeepSeek Sparse Attention indexer: each query attends only to the
``index_topk`` keys its indexer scores highest (``DeepseekV32Indexer``: ``index_scores.topk(...)``
scattered into the attention mask, ``deepseek_v32/modeling_deepseek_v32.py``). GLM-MoE-DSA's
``shared`` layers reuse the previous layer's selection (still sparse); Dots3-Note indexes only its
``indexed_attention`` layers."""


QSA_FAMILIES = ("qwen4_exp_text",)
"""Families with a block indexer (Qwen4-Exp's QSA, ``Qwen4ExpTextQSAIndexer`` in
``qwen4_exp/modeling_qwen4_exp.py``, on its ``indexed_attention`` layers once ``indexer_budget`` is
set): each query's visible keys are cut into complete blocks of ``indexer_compress_ratio``, of which
it keeps the ``indexer_budget // indexer_compress_ratio`` its index scores highest, plus the
incomplete last block."""


BLOCK_INDEXER_FIELDS = {"QSA": ("indexer_budget", "indexer_compress_ratio"), "DSA k-pool": ("index_topk", "index_kpool")}
"""Block indexer -> the config fields of its budget (keys) and block size."""

POOLED_DSA_FAMILIES = ("glm5_next_text",)
"""A DSA indexer that scores pools of ``index_kpool`` keys (``Glm5NextTextIndexer`` in
``glm5_next/modeling_glm5_next.py``): a pool is a candidate once its last key is visible, each query
keeps the ``index_topk // index_kpool`` best and, with ``index_kpool_always_select_tail``, its
incomplete last pool: QSA's rule, in its own field names."""


def _indexer(config: Any, family: str, layer: int) -> dict[str, Any]:
    """The layer's ``index_topk`` (and ``index_block``) of :class:`LayerPosition`: none without an indexer.

    Raises:
        UnsupportedModelError: for a pooled DSA indexer that drops each query's incomplete last pool
            (``index_kpool_always_select_tail`` false): its keys are cut at every length.
    """
    if family in QSA_FAMILIES and getattr(config, "indexer_budget", None) and \
            _layer_type(config, layer) == "indexed_attention":
        return dict(index_topk=int(config.indexer_budget), index_block=int(config.indexer_compress_ratio))
    if family in POOLED_DSA_FAMILIES and _layer_type(config, layer) == "indexed_attention":
        if not getattr(config, "index_kpool_always_select_tail", True):
            raise UnsupportedModelError("index_kpool_always_select_tail is false: each query's DSA indexer drops the "
                                        "keys of its incomplete last pool at every length, a content-dependent sparse "
                                        "mask nopelens does not model")
        return dict(index_topk=int(config.index_topk), index_block=int(config.index_kpool), index_kind="DSA k-pool")
    if family not in DSA_FAMILIES or not getattr(config, "index_topk", None):
        return {}
    if family == "dots3_note_text" and _layer_type(config, layer) != "indexed_attention":
        return {}
    return dict(index_topk=int(config.index_topk))


ROTARY_DIM_UNREAD = ("minimax_m3_vl_text",)
"""Families whose config has a ``rotary_dim`` field the model never reads: MiniMax-M3's rotary
embedding rotates ``head_dim * rope_parameters["partial_rotary_factor"]`` dims (1.0 when unset;
``MiniMaxM3VLRotaryEmbedding.compute_default_rope_parameters``), whatever ``rotary_dim`` says
(MiniMax-M2's config turns ``rotary_dim`` into that factor; M3's does not)."""

TRAILING_ROPE_FAMILIES = ("deepseek_v4",)
"""Heads laid out ``[nope | rope]`` with the rotated slice last (``apply_rotary_pos_emb`` of
``deepseek_v4/modeling_deepseek_v4.py`` rotates ``x[..., -rope_dim:]``)."""

MLA_REFERENCE = ("multi-head latent attention: the rotated slice is the last qk_rope_head_dim dims of each head and "
                 "one rotated key slice is shared by every head; nopelens' reference rotation covers leading dims of "
                 "per-head q and k")


GRANITE_ROTARY_TYPES = frozenset({"rope"})
"""GraniteMoeHybrid's ``position_embedding_type`` values that build a rotary embedding (None: NoPE)."""


def _layer_type(config: Any, layer: int) -> str | None:
    kinds = getattr(config, "layer_types", None)
    return kinds[layer] if kinds is not None and layer < len(kinds) else None


def _mixer(config: Any, layer: int) -> str:
    return NON_ATTENTION_TYPES.get(_layer_type(config, layer) or "", "attention")


def _rotates(config: Any, family: str, layer: int) -> bool | None:
    """Whether an attention layer rotates q and k by its family's rule; None: no per-layer rule."""
    kind = _layer_type(config, layer)
    if family in MLA_FAMILIES and mla_head_dims(config)[1] == 0:  # no rope slice: the attention is NoPE
        return False
    if family in NO_ROPE_LAYER_FAMILIES and getattr(config, "no_rope_layers", None) is not None:
        return bool(config.no_rope_layers[layer])
    if family in ROPE_IF_SLIDING:
        return kind == "sliding_attention"
    if family == "cohere2_moe":  # cohere2_moe/modeling_cohere2_moe.py: dense prefix layers may be forced to rotate
        forced = (config.mlp_layer_types[layer] == "dense" and config.prefix_dense_sliding_window_pattern == 1)
        return kind == "sliding_attention" or forced
    if family in ROPE_UNLESS_GLOBAL:
        return getattr(config, "sliding_window", None) is None or kind == "sliding_attention"
    if family in LAYER_THETA_FAMILIES:
        return bool(config.layer_rope_theta[layer])
    if family == "olmo_hybrid":  # OlmoHybridModel builds no rotary_emb when rope_theta is None
        params = getattr(config, "rope_parameters", None) or {}
        return kind == "full_attention" and params.get("rope_theta") is not None
    if family == "granitemoehybrid":  # GraniteMoeHybridModel: rotary_emb only for position_embedding_type "rope"
        return getattr(config, "position_embedding_type", None) in GRANITE_ROTARY_TYPES
    if family == "zamba2":  # Zamba2Model: rotary_emb only with use_mem_rope
        return bool(getattr(config, "use_mem_rope", False))
    if family in NOPE_ATTENTION_FAMILIES:
        return False
    per_type = _rope_by_layer_type(config, layer)
    return None if per_type is None else per_type.get(kind) is not None


def _rope_by_layer_type(config: Any, layer: int) -> dict | None:
    """``rope_parameters`` when it holds one entry per layer type (Gemma 3, Beam, Cohere Compass), else None.

    An entry of None makes that layer type NoPE: the model builds no rotary embedding for it and
    passes ``position_embeddings=None`` to its attention (``CohereCompassTextModel.forward`` in
    ``cohere_compass/modeling_cohere_compass.py``, ``BeamModel.forward`` in ``beam/modeling_beam.py``).

    Raises:
        ConfigError: if the dict is keyed by layer type but has no entry for this attention layer's type.
    """
    params, kinds = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None)
    if not isinstance(params, dict) or not kinds or not set(params) & set(kinds):
        return None
    if kinds[layer] not in params:
        if _mixer(config, layer) != "attention":  # a Mamba or linear-attention layer takes no rotary embedding
            return params
        raise ConfigError(f"rope_parameters has entries per layer type ({', '.join(sorted(set(params) & set(kinds)))}) "
                          f"but none for {kinds[layer]!r} (layer {layer}); give it one, or None for a NoPE layer type")
    return params


def _layer_method(config: Any, family: str, layer: int) -> str:
    """``nope``/``rope``/``alibi`` of one layer (per family: see the rule tables above)."""
    if family in LEARNED_FAMILIES or family == "xglm" or _mixer(config, layer) != "attention":
        return "nope"
    if family in ALIBI_FAMILIES or (family == "falcon" and getattr(config, "alibi", False)):
        return "alibi"
    rotates = _rotates(config, family, layer)
    if rotates is not None:
        return "rope" if rotates else "nope"
    if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None) or family in ("gptj", "codegen"):
        return "rope"
    return "unknown"


LEARNED_SINK_FAMILIES = ("gpt_oss", "flint", "hy_v4", "deepseek_v4")
"""One learned logit per head in every layer's softmax denominator (``sinks`` in
``gpt_oss/modeling_gpt_oss.py``); MiMo-V2-Flash has it in sliding layers only."""


SINKS_IN_THE_SOFTMAX = frozenset({"learned"})
"""Sink kinds whose logit is known and sits in the softmax denominator (the pattern sums to 1 - p_sink)."""


def _sink(config: Any, family: str, layer: int) -> str | None:
    if family in LEARNED_SINK_FAMILIES:
        return "learned"
    if family == "mimo_v2_flash":  # MiMoV2FlashAttention: self.sinks only when is_swa
        return "learned" if _layer_type(config, layer) == "sliding_attention" else None
    if family in ("granite_swa", "granitemoe_swa"):  # eager_attention_forward: sigmoid(lse - sinks) on the output
        return "output_scale"
    if family == "inkling2_text":  # Inkling2*Attention: sinks = sink_proj(hidden_states), one logit per token
        return "per_token"
    return None


def _relative_bias(config: Any, family: str, layer: int) -> int | None:
    """Inkling 2: a bias by distance i - j for 0 <= i - j < rel_extent, zero beyond
    (``Inkling2RelativePositionBias``; sliding layers use the window as extent). The distance is
    counted in token indices (``get_relative_distance``), not position ids."""
    if family != "inkling2_text":
        return None
    sliding = _layer_type(config, layer) == "hybrid_sliding"
    return int(config.sliding_window_size if sliding else config.rel_extent)


def _query_scale(config: Any, family: str, layer: int) -> QueryScale | None:
    if family in ("llama4_text", "llama4") and getattr(config, "attn_temperature_tuning", False):
        return QueryScale("llama4", "index", float(config.floor_scale), float(config.attn_scale))
    if family == "beam":
        return QueryScale("beam", "position")
    if family == "inkling2_text" and _layer_type(config, layer) != "hybrid_sliding":  # Inkling2FullAttention
        return QueryScale("inkling2", "position", float(config.log_scaling_n_floor), float(config.log_scaling_alpha))
    return None


def _rope_parameters(config: Any, family: str, layer: int) -> tuple[float, float, str]:
    per_type = _rope_by_layer_type(config, layer)  # Gemma 3: one set per layer type
    params = dict(per_type[config.layer_types[layer]] if per_type else getattr(config, "rope_parameters", None) or {})
    rope_type = str(params.get("rope_type", "default"))
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", 10000.0))
    if family in LAYER_THETA_FAMILIES:  # Granite SWA: each layer's own base, over the global one
        base = config.layer_rope_theta[layer]
    fraction = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
                          or getattr(config, "rotary_pct", None) or 1.0)
    return float(base), float(fraction), rope_type


def _score_scale(config: Any, family: str, layer: int, d_head: int) -> float:
    """The factor on q.k in the scores, by the family's own formula."""
    if family == "gpt_neo":  # GPTNeoSelfAttention does not scale q.k
        return 1.0
    if family in ("granite", "granite_swa", "granitemoe_swa", "granitemoe", "granitemoehybrid"):
        return float(config.attention_multiplier)  # GraniteAttention: self.scaling = config.attention_multiplier
    if family in MLA_FAMILIES:  # DeepseekV3Attention: qk_head_dim ** -0.5 (times yarn's mscale^2 if scaled)
        return float(sum(mla_head_dims(config))) ** -0.5
    if getattr(config, "query_pre_attn_scalar", None):  # Gemma 2/3: query_pre_attn_scalar ** -0.5
        return float(config.query_pre_attn_scalar) ** -0.5
    if family == "mpt" and config.attn_config.softmax_scale is not None:
        return float(config.attn_config.softmax_scale)
    scale = d_head ** -0.5
    if family in ("gpt2", "gpt_bigcode") and not getattr(config, "scale_attn_weights", True):
        scale = 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= layer + 1
    return scale


def _key_window(config: Any, layer: int) -> tuple[int | None, int | None]:
    """(sliding window, chunk) of a layer, as transformers picks its mask.

    A model's forward builds one mask per layer type (``causal_mask_mapping`` in e.g.
    ``transformers/models/cohere2/modeling_cohere2.py``): ``sliding_attention`` layers get
    ``create_sliding_window_causal_mask`` with ``config.sliding_window``, ``chunked_attention``
    layers ``create_chunked_causal_mask`` with ``config.attention_chunk_size``
    (``transformers/masking_utils.py``), every other layer the causal mask. A config without
    ``layer_types`` windows every layer when it sets ``sliding_window`` (Mistral before layer types).
    GPT-Neo's ``local`` layers (``config.attention_layers``) see the ``window_size`` keys up to the
    query (``GPTNeoSelfAttention``: the causal mask less ``tril(mask, -window_size)``), the same rule.
    """
    if getattr(config, "model_type", "") == "gpt_neo":  # GPTNeoSelfAttention: "local" layers see window_size keys
        local = config.attention_layers[layer] == "local"
        return (_at_least_one(config, "window_size") if local else None), None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    kind = layer_types[layer] if layer_types is not None else None
    if getattr(config, "model_type", "") == "inkling2_text":  # Inkling2SlidingAttention: sliding_window_size
        return (_at_least_one(config, "sliding_window_size") if kind == "hybrid_sliding" else None), None
    if kind == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        return None, (_at_least_one(config, "attention_chunk_size") if chunk is not None else None)
    if window is None or (kind is not None and kind != "sliding_attention"):
        return None, None
    return _at_least_one(config, "sliding_window"), None


def _at_least_one(config: Any, name: str) -> int:
    """A window or chunk length in tokens; one below 1 leaves every query without a visible key."""
    value = int(getattr(config, name))
    if value < 1:
        what = "a chunk" if "chunk" in name else "a window"
        raise ConfigError(f"{name} is {value}: {what} must be at least 1 token (every query row would be fully masked)")
    return value


def _alibi(config: Any, family: str, d_head: int) -> tuple[tuple[float, ...], float]:
    n_heads = int(_first(config, "num_attention_heads", "n_head", "n_heads"))
    if family == "mpt":  # build_mpt_alibi_tensor, after MPT's released attention.py
        slopes = mpt_alibi_slopes(n_heads, float(config.attn_config.alibi_bias_max))
        return tuple(slopes.tolist()), 1.0
    # Falcon (Penedo et al. 2023, Falcon-RW's released code): (q.k + alibi) / sqrt(d_head). transformers
    # 5.24's FalconModel folded alibi / sqrt(d_head) into the causal mask and also handed alibi to every
    # attention, so the bias counted twice (the audit reports it); 5.25 folds it into the mask only.

    bias_scale = d_head ** -0.5 if family == "falcon" else 1.0  # Falcon: (q.k + alibi) * inv_norm_factor
    return tuple(alibi_slopes(n_heads).tolist()), bias_scale


def _alibi_carrier(family: str) -> str:
    """``alibi_tensor`` where the installed attention takes an ``alibi`` argument, else ``alibi_mask``.

    Measured from the installed code, not its version: transformers 5.25's ``FalconAttention.forward``
    has no ``alibi`` parameter (``FalconModel`` folds alibi / sqrt(d_head) into the attention mask).
    """
    if family != "falcon":
        return "alibi_tensor"
    return "alibi_tensor" if "alibi" in inspect.signature(FalconAttention.forward).parameters else "alibi_mask"


def mpt_alibi_slopes(n_heads: int, alibi_bias_max: float = 8.0) -> Tensor:
    """MPT's ALiBi slopes: 2^(-alibi_bias_max (h + 1) / n) over the next power of two n >= n_heads.

    For a power of two and ``alibi_bias_max = 8`` these are Press et al.'s slopes; otherwise MPT
    takes the odd then the even entries of the longer list (MPT's released ``attention.py``).

    Example:
        >>> mpt_alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
        >>> [round(s, 4) for s in mpt_alibi_slopes(3).tolist()]
        [0.0625, 0.0039, 0.25]
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    power = 2 ** math.ceil(math.log2(n_heads))
    slopes = 1.0 / 2.0 ** (torch.arange(1, power + 1, dtype=torch.float64) * (alibi_bias_max / power))
    if power != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


PER_HEAD_QK_NORM = ("qwen3", "gemma3_text", "gemma3", "qwen3_next", "exaone4", "flint", "beam")
"""Families whose attention normalizes q and k per head before the rotation (``self.q_norm`` on
``head_dim``, e.g. ``qwen3_next/modeling_qwen3_next.py``)."""


def _qk_norm(config: Any, family: str) -> tuple[str | None, str, str]:
    """Where q/k are normalized, and the hooks that hold the q/k entering the scores.

    The bridge's ``hook_q``/``hook_k`` are the projection outputs, *before* any q/k norm; a norm
    the bridge hooks (Qwen3, OLMo-2, Gemma 3) is read from ``hook_q_normed``/``hook_k_normed``.
    """
    if family in PER_HEAD_QK_NORM or (family == "cohere" and getattr(config, "use_qk_norm", False)):
        return "per-head", "hook_q_normed", "hook_k_normed"
    if family == "olmo2":
        return "full-width", "hook_q_normed", "hook_k_normed"
    if family == "olmo_hybrid":  # OlmoHybridAttention normalizes the whole projection; its bridge hooks the norm
        return "full-width", "q_norm.hook_out", "k_norm.hook_out"
    if family in ("llama4_text", "llama4") and getattr(config, "use_qk_norm", False):
        return "l2 after rope", "hook_q", "hook_k"
    if getattr(config, "qk_layernorm", False) or (family == "mpt" and config.attn_config.qk_ln):
        return "per-head (not hooked)", "hook_q", "hook_k"
    return None, "hook_q", "hook_k"


def _notes(config: Any, family: str) -> tuple[str, ...]:
    notes = []
    if family == "inkling2_text":
        notes.append("Inkling 2 adds a learned bias by token-index distance i - j < rel_extent (none beyond) and a "
                     "short convolution over neighbouring tokens' keys and values; neither reads position ids, so "
                     "the per-layer detector cannot see them: the audit's step 5 reads the bias from hook_pos_bias, "
                     "and no step verifies the convolution")
    if family == "qwen4_exp_text":
        notes.append(f"Qwen4-Exp keeps {config.hc_count} hyper-connection residual streams: hook_resid_pre/post hold "
                     f"them side by side ({config.hc_count} x d_model wide), and the final mixer sums them"
                     + ("; its PLE layers add hashed n-gram embeddings of neighbouring token ids, which read no "
                        "position ids (nothing verifies them)" if config.ple_layer_ids else ""))
    if family in ("llama4_text", "llama4") and getattr(config, "attn_temperature_tuning", False):
        floor = int(config.floor_scale)
        notes.append(f"Llama 4 scales NoPE-layer queries by 1 + attn_scale * log(1 + floor((p + 1) / {floor})): "
                     f"exactly 1 below position {floor - 1}")
    return tuple(notes)


# ----------------------------------------------------------------------------- hooks without the bridge
BRIDGE_REFUSED = {
    "granitemoehybrid": "TransformerLens 4.3's GraniteMoeHybrid bridge cannot run its forward pass "
                        "(its rotary_emb component is never set)",
    "muse_glimmer_text": "TransformerLens 4.3's bridge of Muse Glimmer hooks q and k before its scaleless q/k norm "
                         "and the qk_scale_factor on q, so its hook_q and hook_k are not what enters the scores",
    "nemotron_h": "TransformerLens 4.3's Nemotron-H bridge wraps every block's mixer (Mamba, attention or MLP) as one "
                  "opaque SSM2MixerBridge, so no hook_pattern fires: its attention blocks are hooked directly",
    "zamba2": "TransformerLens 4.3's Zamba2 bridge wraps each hybrid layer as one opaque SSMBlockBridge, so its "
              "shared attention fires no hook_pattern: the attention blocks are hooked directly",
}
"""Families TransformerLens has an adapter for but cannot run or read right: they go to forward hooks."""

UNREADABLE_FAMILIES = {
    "deepseek_v4": "DeepSeek V4's compressed-attention layers (layer_types compressed_sparse_attention and "
                   "heavily_compressed_attention, every layer as shipped) append one compressed KV entry per "
                   "compress_rate tokens to the key axis, so its attention weights are not one column per key token "
                   "and no mask, sink or pattern read applies",
    "inkling2_loop_text": "Inkling 2 Loop runs its loop layers (loop_layer_index_start to loop_layer_index_end - 1) "
                          "loop_num_passes times in one forward pass, the later passes mixing in messages from the "
                          "one before, so one layer module is several steps of the computation and its hooks cannot "
                          "tell the passes apart",
}
"""Families whose attention has no per-token pattern to hook (``DeepseekV4Attention`` concatenates
its compressor's entries onto the keys, ``deepseek_v4/modeling_deepseek_v4.py``), or whose layers
are no single step of the computation (``Inkling2LoopTextModel.forward`` calls the loop layers once
per pass, ``inkling2_loop/modeling_inkling2_loop.py``): refused in one line, never measured wrong."""

UNREADABLE_LAYER_TYPES = {
    "minimax_m3_sparse": "MiniMax-M3's minimax_m3_sparse layers keep, per query, only the key blocks its lightning "
                         "indexer scores highest (a content-chosen key set) and place those blocks by position id in "
                         "key-slot units, so re-spaced position ids (the per-layer detector's) crash it and left "
                         "padding changes which keys it keeps",
}
"""``config.layer_types`` entries nopelens cannot read right (``MiniMaxM3VLIndexer`` in
``minimax_m3_vl/modeling_minimax_m3_vl.py``: ``q_block = position_ids // block_size`` indexes the
key blocks): a model with such a layer is refused in one line."""

BRIDGE_CACHE_BROKEN = {
    "qwen3_next": "TransformerLens 4.3's Qwen3-Next bridge loses the linear-attention state between cached "
                  "steps (its decoding diverges from the full forward while the HF model's own does not), so "
                  "cached decoding through the bridge is not the model's",
}
"""Bridged families whose forward is right but whose KV-cache decoding through the bridge is not."""

MIXER_NAMES = ("self_attn", "attention", "attn", "self_attention", "linear_attn", "mamba", "mixer")
"""Child names of a decoder layer's attention or other sequence mixer, in the order looked for."""
ATTENTION_NAMES = MIXER_NAMES[:4]
"""Names of a softmax attention, looked for deeper in a layer that has no mixer child (Zamba's
hybrid layers keep theirs under ``shared_transformer.self_attn`` next to a ``mamba_decoder``)."""

POSITION_BIAS_MODULES = {"inkling2_text": "relative_position_bias"}
"""Family -> the child of each attention whose output is the score bias it adds by distance
(``Inkling2RelativePositionBias`` returns ``[batch, head_index, query_pos, key_pos]``), hooked as
``attn.hook_pos_bias``."""

SUBLAYER_FAMILIES = {"longcat_flash": ("self_attn", "input_layernorm")}
"""Families whose decoder layer holds several attention sublayers, each one nopelens layer:
``LongcatFlashDecoderLayer`` runs ``self_attn[i]`` on ``input_layernorm[i]`` of the stream for i in
(0, 1), cache layer ``2 * layer + i``, and ``num_hidden_layers`` is twice the decoder layers
(``longcat_flash/modeling_longcat_flash.py``). Sublayer i's input is the input of
``input_layernorm[i]`` (so a patch there reaches its attention, not the residual it adds to); its
output is the next sublayer's input, or the decoder layer's output (which adds the shortcut MoE
computed in sublayer 0)."""


@dataclass(frozen=True)
class HookLayout:
    """Where :class:`nopelens.models.adapters.HookedHFModel` hooks an HF causal LM (module paths).

    Attributes:
        embed: the token embedding.
        layers: each decoder layer.
        mixers: each layer's attention or other mixer (None for an MLP-only block).
        attention: whether that mixer is softmax attention returning its weights.
        final_norm: the norm before the unembedding, or None.
        values, outputs: each attention's value projection (``v_proj``, whose output is
            ``hook_v``) and output projection (``o_proj``, whose input is ``hook_z``), or None.
        d_head: the head size ``hook_v``/``hook_z`` are split by.
        outputs_at: per layer, where ``hook_resid_post`` sits: ``(path, "output")`` (a module's
            output) or ``(path, "input")`` (the next sublayer's input); empty: each layer's output.
        biases: per layer, the module whose output is the attention's position bias
            (``hook_pos_bias``, :data:`POSITION_BIAS_MODULES`), or None.
    """

    embed: str
    layers: tuple[str, ...]
    mixers: tuple[str | None, ...]
    attention: tuple[bool, ...]
    final_norm: str | None
    values: tuple[str | None, ...] = ()
    outputs: tuple[str | None, ...] = ()
    d_head: int = 0
    outputs_at: tuple[tuple[str, str], ...] = ()
    biases: tuple[str | None, ...] = ()


def hook_layout(hf_model: Any) -> HookLayout:
    """Find the embedding, decoder layers, mixers and final norm of an HF causal LM.

    The decoder layers are the ``nn.ModuleList`` with one entry per ``num_hidden_layers`` (the
    one under ``model.layers`` where there is one; a family of :data:`SUBLAYER_FAMILIES` has one
    entry per group of sublayers); a layer's mixer is its first child named as in
    :data:`MIXER_NAMES`, else (an attention layer) its shallowest module named as in
    :data:`ATTENTION_NAMES`; it is attention when the config says so (:func:`describe_config`).

    Raises:
        UnsupportedModelError: if no such layer list (or embedding) is found.
    """
    static = describe_config(hf_model.config, type(hf_model).__name__)
    modules = dict(hf_model.named_modules())
    sublayers = SUBLAYER_FAMILIES.get(static.family)
    outputs_at: tuple[tuple[str, str], ...] = ()
    if sublayers:
        attn, norm_name = sublayers
        root = _decoder_list(modules, static, lambda m: True)
        per_layer = len(modules[f"{root}.0.{attn}"])
        if per_layer * len(modules[root]) != static.n_layers:
            raise UnsupportedModelError(f"{static.architecture}: {len(modules[root])} decoder layers of {per_layer} "
                                        f"attention sublayers are not its {static.n_layers} layers")
        block = [f"{root}.{l // per_layer}" for l in range(static.n_layers)]
        layers = tuple(path if l % per_layer == 0 else f"{path}.{norm_name}.{l % per_layer}" for l, path in enumerate(block))
        mixers = [f"{path}.{attn}.{l % per_layer}" for l, path in enumerate(block)]
        outputs_at = tuple((layers[l + 1], "input") if (l + 1) % per_layer else (path, "output")
                           for l, path in enumerate(block))
    embedding = hf_model.get_input_embeddings()
    embed = next((name for name, m in modules.items() if m is embedding), None)
    if embed is None:
        raise UnsupportedModelError(f"cannot find the token embedding of {static.architecture}")
    if not sublayers:
        # a multimodal wrapper: the decoder layers beside the token embedding, not a vision tower's
        beside = embed.rsplit(".", 1)[0] + "." if text_config(hf_model.config) is not hf_model.config else ""
        root = _decoder_list(modules, static, lambda m: len(m) == static.n_layers, beside)
        layers = tuple(f"{root}.{l}" for l in range(static.n_layers))
        mixers = [_mixer_path(modules, path, spec.mixer == "attention") for path, spec in zip(layers, static.layers)]
    prefix = root.rsplit(".", 1)[0] if "." in root else ""
    norm = next((f"{prefix}.{n}".lstrip(".") for n in ("norm", "final_layernorm", "ln_f", "final_norm")
                 if f"{prefix}.{n}".lstrip(".") in modules), None)
    attention = tuple(layer.mixer == "attention" and mixer is not None for layer, mixer in zip(static.layers, mixers))

    def child(mixer: str | None, name: str, is_attention: bool) -> str | None:
        path = f"{mixer}.{name}"
        return path if is_attention and path in modules and isinstance(modules[path], nn.Linear) else None

    values = tuple(child(m, "v_proj", a) for m, a in zip(mixers, attention))
    outputs = tuple(child(m, "o_proj", a) for m, a in zip(mixers, attention))
    bias = POSITION_BIAS_MODULES.get(static.family)
    biases = tuple(f"{m}.{bias}" if bias and a and f"{m}.{bias}" in modules else None for m, a in zip(mixers, attention))
    # MiMo-V2-Flash: v heads differ from q/k heads
    v_head = int(getattr(text_config(hf_model.config), "v_head_dim", None) or static.d_head)
    return HookLayout(embed, layers, tuple(mixers), attention, norm, values, outputs, v_head, outputs_at, biases)


def _decoder_list(modules: dict, static: HFDescription, fits: Callable[[Any], bool], under: str = "") -> str:
    """The path of the ``nn.ModuleList`` of decoder layers: of the lists under ``under`` that
    ``fits``, the one named ``...layers`` nearest the root."""
    lists = [name for name, m in modules.items() if isinstance(m, nn.ModuleList) and fits(m) and name.startswith(under)]
    if not lists:
        raise UnsupportedModelError(f"cannot find the {static.n_layers} decoder layers of {static.architecture}")
    return min(lists, key=lambda name: (not name.endswith("layers"), name.count("."), name))


def _mixer_path(modules: dict, layer: str, attention: bool) -> str | None:
    """A decoder layer's mixer: its first child named as in :data:`MIXER_NAMES`, else, for an
    attention layer, its shallowest descendant named as in :data:`ATTENTION_NAMES`."""
    children = dict(modules[layer].named_children())
    found = next((f"{layer}.{n}" for n in MIXER_NAMES if n in children), None)
    if found is not None or not attention:
        return found
    deeper = [name for name in modules if name.startswith(f"{layer}.") and name.rsplit(".", 1)[-1] in ATTENTION_NAMES]
    return min(deeper, key=lambda name: name.count("."), default=None)


def unreadable(hf_model: Any) -> str | None:
    """Why nopelens cannot read an HF model at all (:data:`UNREADABLE_FAMILIES`,
    :data:`UNREADABLE_LAYER_TYPES`), or None."""
    config = text_config(getattr(hf_model, "config", None))
    why = UNREADABLE_FAMILIES.get(str(getattr(config, "model_type", "")))
    kinds = getattr(config, "layer_types", None) or ()
    return why or next((UNREADABLE_LAYER_TYPES[k] for k in kinds if k in UNREADABLE_LAYER_TYPES), None)


def bridge_refused(hf_model: Any) -> str | None:
    """Why a family goes to forward hooks although TransformerLens has an adapter for it, or None."""
    return BRIDGE_REFUSED.get(str(getattr(text_config(getattr(hf_model, "config", None)), "model_type", "")))


POSITION_TABLES = ("transformer.wpe", "model.decoder.embed_positions", "transformer.positions_embed")
"""Where the families with a learned table keep it (GPT-2, GPT-Neo, GPT-BigCode; OPT; OpenAI-GPT)."""


def position_table(hf_model: Any) -> Tensor:
    """The learned position table ``[n_rows, d_model]`` of an HF model (rows include any offset).

    Raises:
        UnsupportedModelError: if the model keeps no table nopelens knows where to find.
    """
    modules = dict(hf_model.named_modules())
    for name in POSITION_TABLES:
        for candidate in (name, f"{name}.original_component"):
            module = modules.get(candidate)
            if module is not None and isinstance(getattr(module, "weight", None), Tensor):
                return module.weight
    raise UnsupportedModelError(f"cannot find the learned position table of {type(hf_model).__name__} "
                                f"(looked for {', '.join(POSITION_TABLES)})")


def l2_normalize(x: Tensor, eps: float) -> Tensor:
    """Llama 4's ``Llama4TextL2Norm`` without weight: x / sqrt(mean(x^2) + eps) over the last axis.

    A rotation keeps the norm of each rotated pair, so this commutes with RoPE.
    """
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- the census
_DESCRIPTIONS: "weakref.WeakKeyDictionary[Any, HFDescription]" = weakref.WeakKeyDictionary()
CENSUS_LENGTH = 6


def describe(bridge: Any) -> HFDescription:
    """The full description of a hooked HF causal LM: config plus one census forward pass.

    ``bridge`` is a ``TransformerBridge`` or a :class:`nopelens.models.adapters.HookedHFModel`
    (then ``adapter`` is ``forward hooks`` and ``scores_hook`` False: no pre-softmax scores).

    The result is remembered per bridge.

    Raises:
        UnsupportedModelError: as :func:`describe_config`, or when the bridge cannot run a forward
            pass (the error says which architecture and what failed).
    """
    if bridge in _DESCRIPTIONS:
        return _DESCRIPTIONS[bridge]
    hf = bridge.original_model
    static = describe_config(hf.config, type(hf).__name__)
    hooked = not hasattr(bridge, "blocks")  # a HookedHFModel: PyTorch hooks, no bridge
    extra = {} if hooked else {"cache_unreadable": BRIDGE_CACHE_BROKEN.get(static.family)}
    if hooked:
        reason = getattr(bridge, "reason", None)
        extra = dict(adapter="forward hooks", scores_hook=False,
                     notes=static.notes + ((f"hooked with PyTorch forward hooks: {reason}",) if reason else ()))
    description = replace(static, **census(bridge, static), position_ids_hook=_position_ids_hook(bridge))
    description = replace(description, **extra)
    _DESCRIPTIONS[bridge] = description
    return description


def census(bridge: Any, static: HFDescription) -> dict[str, Any]:
    """Run one short forward pass with an ``attention_mask`` and record what the hooks carry.

    Returns:
        ``fired`` (hook names that fired), ``scores_hook`` (softmax of ``hook_attn_scores`` over
        visible keys equals ``hook_pattern`` in every layer, and they are not the pattern itself)
        and ``causal_under_mask`` (every future key got zero weight).
    """
    length = CENSUS_LENGTH
    tokens = (torch.arange(2 * length).view(2, length) * 7 + 3) % static.d_vocab
    device = next(bridge.parameters()).device
    tokens = tokens.to(device)
    captured: dict[str, Tensor] = {}
    handles = []
    for name, point in bridge.hook_dict.items():
        def keep(x, hook, name=name):
            if isinstance(x, Tensor) and (name.endswith(("hook_pattern", "hook_attn_scores")) or name not in captured):
                captured[name] = x.detach()
        handles.append((point, point.add_hook(keep)))
    was_training = bridge.training
    bridge.eval()
    try:
        with torch.no_grad():
            bridge(tokens, attention_mask=torch.ones_like(tokens))
    except Exception as error:  # a bridge that builds but cannot run is refused, whatever it raised
        who = (f"TransformerLens bridges {static.architecture}" if hasattr(bridge, "blocks")
               else f"nopelens hooks {static.architecture}")
        raise UnsupportedModelError(f"{who} but its forward pass fails ({type(error).__name__}: {_one_line(error)})"
                                    ) from None
    finally:
        bridge.train(was_training)
        for point, handle in handles:
            handle.hook.remove()
            if handle in point.fwd_hooks:
                point.fwd_hooks.remove(handle)
    future = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)
    scores_ok, causal = True, True
    try:
        sinks = learned_sinks(bridge.original_model, static)
    except UnsupportedModelError:
        sinks = None
    for layer in range(static.n_layers):
        pattern = captured.get(act_name("pattern", layer))
        scores = captured.get(act_name("attn_scores", layer))
        if pattern is None:
            continue
        if pattern.shape[-1] != length:
            raise UnsupportedModelError(f"the attention weights of {static.architecture} layer {layer} have "
                                        f"{pattern.shape[-1]} key columns for {length} tokens (not one per key token)")
        if not bool(torch.isfinite(pattern).all()):
            raise UnsupportedModelError(
                f"{static.architecture} layer {layer} gives non-finite attention weights (NaN or inf) on a short "
                "input: check its weights for NaN or inf and its RoPE base (rope_theta, layer_rope_theta) for a "
                "positive value")
        causal &= float(pattern[..., future].abs().max()) == 0.0
        if scores is None or torch.equal(scores, pattern) or sinks is None:
            scores_ok = False
            continue
        sink = sinks.get(layer) if static.layers[layer].sink in SINKS_IN_THE_SOFTMAX else None
        recomputed = softmax_with_sink(scores.double().masked_fill(future, float("-inf")), sink)
        scores_ok &= float((recomputed - pattern.double()).abs().max()) < _census_tolerance(pattern.dtype)
    return {"fired": frozenset(captured), "scores_hook": scores_ok, "causal_under_mask": causal}


_SINK_PARAMETER = re.compile(r"layers\.(\d+)\..*\bsinks$")


def sink_parameters(hf_model: Any) -> dict[int, tuple[str, Tensor]]:
    """Layer -> (parameter name, its logits ``[head_index]`` in float64) of every learned ``sinks``
    parameter of an HF model, read from the weights alone (no forward pass), whatever its
    description says: the ``nn.Parameter`` named ``sinks`` under ``layers.{l}`` (GPT-OSS, Flint,
    MiMo-V2-Flash, HY-V4, Granite SWA, DeepSeek V4: ``self.sinks = nn.Parameter(torch.empty(num_heads))``,
    e.g. ``deepseek_v4/modeling_deepseek_v4.py``). Each is one logit s_h per head that enters every
    query row's softmax as a key with a zero value (Granite SWA: as a sigmoid(lse - s_h) output scale).
    A bridge's name (``..._original_component.sinks``) is given as the model's own."""
    found = {}
    for name, param in hf_model.named_parameters():
        match = _SINK_PARAMETER.search(name)
        if match:
            found[int(match.group(1))] = (name.replace("._original_component", ""), param.detach().double().flatten())
    return dict(sorted(found.items()))


def learned_sinks(hf_model: Any, description: HFDescription) -> dict[int, Tensor]:
    """Layer -> its learned sink logits ``[head_index]`` (float64), for the layers the description
    says have a ``learned`` or ``output_scale`` sink (the ``sinks`` parameter of their attention,
    found by name; a bridge wraps it as ``..._original_component.sinks``).

    Raises:
        UnsupportedModelError: if a layer that declares such a sink has no ``sinks`` parameter.
    """
    found = {l: logits for l, (_, logits) in sink_parameters(hf_model).items()}
    declared = [l for l, layer in enumerate(description.layers) if layer.sink in ("learned", "output_scale")]
    missing = [l for l in declared if l not in found]
    if missing:
        raise UnsupportedModelError(f"{description.architecture} declares learned sinks in layers {missing} but "
                                    "has no sinks parameter there")
    return {l: found[l] for l in declared}


def softmax_with_sink(scores: Tensor, sink: Tensor | None) -> Tensor:
    """softmax over the keys with one extra logit per head (the learned sink, zero value), sink column
    dropped: rows sum to 1 - p_sink (``eager_attention_forward`` in ``gpt_oss/modeling_gpt_oss.py``).
    ``sink`` None is the plain softmax. ``scores`` is ``[batch, head_index, query_pos, key_pos]``.

    Example:
        >>> p = softmax_with_sink(torch.zeros(1, 1, 1, 3, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
        >>> p.tolist(), round(1 - float(p.sum()), 6)  # three keys and the sink share equally
        ([[[[0.25, 0.25, 0.25]]]], 0.25)
    """
    if sink is None:
        return scores.softmax(-1)
    column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], -1).softmax(-1)[..., :-1]


def _census_tolerance(dtype: torch.dtype) -> float:
    """How far softmax(scores) may be from a pattern stored in ``dtype``: 1e-4, or 4 eps of a half dtype."""
    return max(1e-4, 4 * float(torch.finfo(dtype).eps))


def _position_ids_hook(bridge: Any) -> str | None:
    """``pos_embed.hook_in`` when the position table is a plain ``nn.Embedding`` fed position ids."""
    try:
        table = position_table(bridge.original_model)
    except UnsupportedModelError:
        return None
    plain = any(getattr(m, "weight", None) is table and type(m).forward is nn.Embedding.forward
                for m in bridge.original_model.modules())
    return "pos_embed.hook_in" if plain and "pos_embed.hook_in" in bridge.hook_dict else None


def check_readable(description: HFDescription) -> None:
    """Refuse a model whose bridged attention nopelens cannot read right.

    Raises:
        UnsupportedModelError: when future keys get weight under an ``attention_mask`` (the bridge
            dropped the causal mask), or when no ``hook_pattern`` fires.
    """
    if not description.causal_under_mask:
        raise UnsupportedModelError(
            f"the attention of {description.architecture} (through its {description.adapter}) gives future keys "
            "nonzero weight when an attention_mask is passed (the causal mask is dropped); its patterns and "
            "activations would be wrong"
        )
    attention = [l for l, layer in enumerate(description.layers) if layer.mixer == "attention"]
    if attention and not description.fires(act_name("pattern", attention[0])):
        why = next((n for n in description.notes if n.startswith("hooked with")), None)
        raise UnsupportedModelError(f"no hook_pattern fires in {description.architecture} through its "
                                    f"{description.adapter} (its attention weights cannot be read)"
                                    + (f"; {why}" if why else ""))


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def refusing(action: Callable[[], Any], architecture: str, verb: str = "bridge") -> Any:
    """Run ``action``; turn whatever the bridge (or the hooks) raise into an :class:`UnsupportedModelError`."""
    try:
        return action()
    except (UnsupportedModelError, ConfigError):  # already one line naming the model or the field
        raise
    except Exception as error:
        who = "TransformerLens cannot bridge" if verb == "bridge" else "nopelens cannot hook"
        raise UnsupportedModelError(f"{who} {architecture} ({type(error).__name__}: {_one_line(error)})") from None
