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

import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor

from .hooks import act_name

PAIRINGS = ("half", "interleaved")
INTERLEAVED_FAMILIES = ("gptj", "codegen", "cohere", "cohere2", "glm", "llama4_text", "llama4")
LEARNED_FAMILIES = ("gpt2", "gpt_neo", "opt", "gpt_bigcode", "openai-gpt")
ALIBI_FAMILIES = ("bloom", "mpt")
POSITION_OFFSET = {"opt": 2, "xglm": 2}
"""Families whose position table is read at ``position_id + offset`` (OPT and XGLM keep two rows
for padding ids; ``OPTLearnedPositionalEmbedding``, ``XGLMSinusoidalPositionalEmbedding``)."""


class UnsupportedModelError(ValueError):
    """An HF model nopelens cannot measure right: refused with a one-line reason."""


@dataclass(frozen=True)
class LayerPosition:
    """How one attention layer uses positions.

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
        sliding_window: keys further back than this are masked (None: full causal attention).
        rope_type: HF's ``rope_type``; only ``default`` (unscaled) has a nopelens reference.
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
    rope_type: str = "default"

    @property
    def unit(self):
        """The registry's method unit of this layer (:mod:`nopelens.models.methods`), None if unknown."""
        from .methods import METHODS, get_method

        return get_method(self.method) if self.method in METHODS else None

    @property
    def rotates(self) -> bool:
        """The layer rotates q and k (its unit acts as a q/k rotation)."""
        from .methods import QK_ROTATION

        return self.unit is not None and self.unit.acts(QK_ROTATION)

    @property
    def biases_scores(self) -> bool:
        """The layer adds a finite bias to its scores (its unit acts as a score bias)."""
        from .methods import SCORE_BIAS

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
            handed to every attention: Bloom, Falcon with ALiBi) or None (MPT builds its ALiBi bias
            from key indices; no position ids can be given).
        fired: every hook name that fired in the census forward pass.
        scores_hook: ``hook_attn_scores`` holds the pre-softmax scores behind ``hook_pattern``.
        causal_under_mask: future keys got zero weight with an ``attention_mask`` passed.
        notes: what the description could not verify, or knows to be approximate.
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

    @property
    def layer_methods(self) -> tuple[str, ...]:
        """Per-layer attention method names, e.g. SmolLM3 ``('rope', 'rope', 'rope', 'nope')``."""
        return tuple(layer.method for layer in self.layers)

    def fires(self, site: str) -> bool:
        """True if the hook ``site`` fired in the census (hook points that never fire are untrusted)."""
        return site in self.fired

    def rotated_qk_sites(self, layer: int) -> tuple[str, str] | None:
        """``hook_rot_q``/``hook_rot_k`` of a RoPE layer when the bridge fires them, else None."""
        names = (act_name("rot_q", layer), act_name("rot_k", layer))
        if self.layers[layer].rotates and all(self.fires(n) for n in names):
            return names
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
    family = str(getattr(config, "model_type", ""))
    architecture = architecture or (list(getattr(config, "architectures", None) or [family])[0])
    n_heads = int(_first(config, "num_attention_heads", "n_head", "num_heads", "attention_heads", "n_heads"))
    d_model = int(_first(config, "hidden_size", "n_embd", "d_model"))
    d_head = int(getattr(config, "head_dim", None) or d_model // n_heads)
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
        position_input = None if family == "mpt" else "alibi_tensor"
    return HFDescription(
        architecture=architecture, family=family, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(n_kv or n_heads), d_head=d_head, d_vocab=int(config.vocab_size),
        input_position=input_position, position_offset=POSITION_OFFSET.get(family, 0),
        max_positions=max_positions, layers=layers, qk_norm=qk_norm, q_hook=q_hook, k_hook=k_hook,
        position_input=position_input, qk_layout=qk_layout, notes=_notes(config, family),
    )


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
    window = _sliding_window(config, layer)
    softcap = getattr(config, "attn_logit_softcapping", None)
    common = dict(score_scale=scale, sliding_window=window, softcap=float(softcap) if softcap else None)
    plain = LayerPosition(_layer_method(config, family, layer), **common)
    if plain.biases_scores:
        slopes, bias_scale = _alibi(config, family, d_head)
        return replace(plain, alibi_slopes=slopes, bias_scale=bias_scale)
    if not plain.rotates:  # NoPE, or a method nopelens does not know (nothing about it is verified)
        return plain
    base, fraction, rope_type = _rope_parameters(config, family, layer)
    rotary_dim = int(getattr(config, "rotary_dim", None) or round(d_head * fraction))
    rotary_dim -= rotary_dim % 2
    pairing = "interleaved" if family in INTERLEAVED_FAMILIES else "half"
    return replace(plain, rotary_dim=rotary_dim, rotary_base=base, pairing=pairing, rope_type=rope_type)


def _layer_method(config: Any, family: str, layer: int) -> str:
    """``nope``/``rope``/``alibi`` of one layer (per-layer NoPE: SmolLM3, Llama 4, Cohere2)."""
    if family in LEARNED_FAMILIES or family == "xglm":
        return "nope"
    if family in ALIBI_FAMILIES or (family == "falcon" and getattr(config, "alibi", False)):
        return "alibi"
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None:  # SmolLM3 and Llama 4: 1 = this layer uses RoPE, 0 = NoPE
        return "rope" if no_rope[layer] else "nope"
    if family == "cohere2":  # Cohere2Attention rotates only when the layer has a sliding window
        return "rope" if config.layer_types[layer] == "sliding_attention" else "nope"
    if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None) or family in ("gptj", "codegen"):
        return "rope"
    return "unknown"


def _rope_parameters(config: Any, family: str, layer: int) -> tuple[float, float, str]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer] in params:  # Gemma 3: one set per layer type
        params = dict(params[layer_types[layer]])
    rope_type = str(params.get("rope_type", "default"))
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", 10000.0))
    fraction = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
                          or getattr(config, "rotary_pct", None) or 1.0)
    return float(base), float(fraction), rope_type


def _score_scale(config: Any, family: str, layer: int, d_head: int) -> float:
    """The factor on q.k in the scores, by the family's own formula."""
    if family == "gpt_neo":  # GPTNeoSelfAttention does not scale q.k
        return 1.0
    if family == "granite":  # GraniteAttention: self.scaling = config.attention_multiplier
        return float(config.attention_multiplier)
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


def _sliding_window(config: Any, layer: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and layer_types[layer] != "sliding_attention"):
        return None
    return int(window)


def _alibi(config: Any, family: str, d_head: int) -> tuple[tuple[float, ...], float]:
    n_heads = int(_first(config, "num_attention_heads", "n_head", "n_heads"))
    if family == "mpt":  # build_mpt_alibi_tensor, after MPT's released attention.py
        slopes = mpt_alibi_slopes(n_heads, float(config.attn_config.alibi_bias_max))
        return tuple(slopes.tolist()), 1.0
    # Falcon (Penedo et al. 2023, Falcon-RW's released code): (q.k + alibi) / sqrt(d_head). In eager
    # attention, transformers 5.24's FalconModel also folds alibi / sqrt(d_head) into the causal mask,
    # so the bias counts twice there; the audit reports that against the documented formula.
    from .positions import alibi_slopes

    bias_scale = d_head ** -0.5 if family == "falcon" else 1.0  # Falcon: (q.k + alibi) * inv_norm_factor
    return tuple(alibi_slopes(n_heads).tolist()), bias_scale


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


def _qk_norm(config: Any, family: str) -> tuple[str | None, str, str]:
    """Where q/k are normalized, and the hooks that hold the q/k entering the scores.

    The bridge's ``hook_q``/``hook_k`` are the projection outputs, *before* any q/k norm; a norm
    the bridge hooks (Qwen3, OLMo-2, Gemma 3) is read from ``hook_q_normed``/``hook_k_normed``.
    """
    if family in ("qwen3", "gemma3_text", "gemma3") or (family == "cohere" and getattr(config, "use_qk_norm", False)):
        return "per-head", "hook_q_normed", "hook_k_normed"
    if family == "olmo2":
        return "full-width", "hook_q_normed", "hook_k_normed"
    if family in ("llama4_text", "llama4") and getattr(config, "use_qk_norm", False):
        return "l2 after rope", "hook_q", "hook_k"
    if getattr(config, "qk_layernorm", False) or (family == "mpt" and config.attn_config.qk_ln):
        return "per-head (not hooked)", "hook_q", "hook_k"
    return None, "hook_q", "hook_k"


def _notes(config: Any, family: str) -> tuple[str, ...]:
    notes = []
    if family in ("llama4_text", "llama4") and getattr(config, "attn_temperature_tuning", False):
        floor = int(config.floor_scale)
        notes.append(f"Llama 4 scales NoPE-layer queries by 1 + attn_scale * log(1 + floor((p + 1) / {floor})): "
                     f"exactly 1 below position {floor - 1}")
    return tuple(notes)


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
    """The full description of a bridged HF causal LM: config plus one census forward pass.

    The result is remembered per bridge.

    Raises:
        UnsupportedModelError: as :func:`describe_config`, or when the bridge cannot run a forward
            pass (the error says which architecture and what failed).
    """
    if bridge in _DESCRIPTIONS:
        return _DESCRIPTIONS[bridge]
    hf = bridge.original_model
    static = describe_config(hf.config, type(hf).__name__)
    description = replace(static, **census(bridge, static), position_ids_hook=_position_ids_hook(bridge))
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
        raise UnsupportedModelError(
            f"TransformerLens bridges {static.architecture} but its forward pass fails "
            f"({type(error).__name__}: {_one_line(error)})"
        ) from None
    finally:
        bridge.train(was_training)
        for point, handle in handles:
            handle.hook.remove()
            if handle in point.fwd_hooks:
                point.fwd_hooks.remove(handle)
    future = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)
    scores_ok, causal = True, True
    for layer in range(static.n_layers):
        pattern = captured.get(act_name("pattern", layer))
        scores = captured.get(act_name("attn_scores", layer))
        if pattern is None:
            continue
        causal &= float(pattern[..., future].abs().max()) == 0.0
        if scores is None or torch.equal(scores, pattern):
            scores_ok = False
            continue
        recomputed = scores.double().masked_fill(future, float("-inf")).softmax(-1)
        scores_ok &= float((recomputed - pattern.double()).abs().max()) < 1e-4
    return {"fired": frozenset(captured), "scores_hook": scores_ok, "causal_under_mask": causal}


def _position_ids_hook(bridge: Any) -> str | None:
    """``pos_embed.hook_in`` when the position table is a plain ``nn.Embedding`` fed position ids."""
    from torch import nn

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
            f"the bridged attention of {description.architecture} gives future keys nonzero weight when an "
            "attention_mask is passed (the causal mask is dropped); its patterns and activations would be wrong"
        )
    if not description.fires("blocks.0.attn.hook_pattern"):
        raise UnsupportedModelError(f"the bridge of {description.architecture} fires no hook_pattern")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def refusing(action: Callable[[], Any], architecture: str) -> Any:
    """Run ``action``; turn whatever the bridge raises into an :class:`UnsupportedModelError`."""
    try:
        return action()
    except UnsupportedModelError:
        raise
    except Exception as error:
        raise UnsupportedModelError(
            f"TransformerLens cannot bridge {architecture} ({type(error).__name__}: {_one_line(error)})"
        ) from None
