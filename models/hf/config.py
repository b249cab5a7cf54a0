"""The static description of an HF causal LM: what its config and its family's declarations say.

:func:`describe_config` reads the config's sizes and per-layer fields and the
:class:`~nopelens.models.hf.family.Family` registered for its ``model_type``; it branches on declared
traits only (each family's formulas, with their sources, are in its module under
:mod:`nopelens.models.hf.families`). :func:`check_config` refuses a config that contradicts itself.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import replace
from typing import Any, Mapping

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..methods import METHODS, QK_ROTATION, get_method
from ..positions import alibi_slopes
from .description import ConfigError, HFDescription, LayerPosition, UnsupportedModelError
from .family import Family, family_of, layer_type


def config_family(config: Any) -> Family:
    """The family declarations of a (text) config: those of its config class's own ``model_type`` (a
    config.json whose "model_type" was edited still builds the class its "architectures" names, and
    the family rules must be that class's)."""
    return family_of(_model_type(text_config(config)))


def _model_type(config: Any) -> str:
    return str(getattr(type(config), "model_type", "") or getattr(config, "model_type", ""))


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
    model_type, family = _model_type(config), config_family(config)
    architecture = architecture or (list(getattr(config, "architectures", None) or [model_type])[0])
    n_heads = int(_first(config, "num_attention_heads", "n_head", "num_heads", "attention_heads", "n_heads"))
    d_model = int(_first(config, "hidden_size", "n_embd", "d_model"))
    d_head = int(getattr(config, "head_dim", None) or d_model // n_heads)
    if family.mla:
        d_head = sum(mla_head_dims(config))
    n_kv = family.rule("n_kv_heads", config, n_heads)
    n_kv = n_kv or _first(config, "num_key_value_heads", "num_kv_heads", default=None)
    n_layers = int(_first(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    max_positions = None
    if family.position_table:  # a learned table has rows for max_positions positions only
        max_positions = int(_first(config, "n_positions", "max_position_embeddings"))
    layers = tuple(_layer(config, family, layer, d_head) for layer in range(n_layers))
    qk_norm, q_hook, k_hook = _qk_norm(config, family)
    qk_layout = {"per-head": "batch head pos d_head", "full-width": "batch pos (head d_head)"}.get(
        qk_norm or "", "batch pos head d_head"
    )
    position_input = "position_ids"
    if layers and layers[0].biases_scores:
        position_input = family.rule("alibi_input")
    return HFDescription(
        architecture=architecture,
        family=model_type,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv or n_heads),
        d_head=d_head,
        d_vocab=int(config.vocab_size),
        input_position=family.input_position,
        position_offset=family.position_offset,
        max_positions=max_positions,
        layers=layers,
        qk_norm=qk_norm,
        q_hook=q_hook,
        k_hook=k_hook,
        position_input=position_input,
        qk_layout=qk_layout,
        notes=family.rule("notes", config) or (),
    )


PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "no_rope_layers", "layer_rope_theta")
"""Config fields with one entry per layer, which the family rules below index by layer."""

LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
SIZE_FIELDS = (
    "hidden_size",
    "n_embd",
    "d_model",
    "num_attention_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)
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
            ``rope_parameters`` dict keyed by layer type has no entry for some layer's type, a
            multi-head latent attention config's head sizes cannot be read (:func:`mla_head_dims`),
            the layer count is above :data:`MAX_LAYERS`, RoPE parameters are of the wrong kind
            (an entry neither a dict nor None, an unknown ``rope_type``, a ``partial_rotary_factor``
            outside (0, 1], a rotating layer's base not a positive number), or the family's own
            ``check`` names a field its code would fail on (:class:`~nopelens.models.hf.family.RuleError`
            where a family rule itself fails).

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
    if n_layers > MAX_LAYERS:
        raise _too_many_layers(count, n_layers)
    family = config_family(config)
    family.rule("check", config)
    mla = family.mla
    if mla:
        mla_head_dims(config)
    for name in SIZE_FIELDS:
        value = getattr(config, name, None)
        if mla and name == "head_dim":  # MLA configs' convention: head_dim is the rope slice, 0 when NoPE
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{name} is {value}: a model's sizes must be at least 1")
    width, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if (
        getattr(config, "head_dim", None) is None
        and isinstance(width, int)
        and isinstance(heads, int)
        and heads > width
    ):
        raise ConfigError(
            f"num_attention_heads {heads} is more than hidden_size {width}: each head would have "
            f"{width // heads} dimensions"
        )
    _check_rope_parameters(config)
    for name in PER_LAYER_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) != n_layers:
            raise ConfigError(f"{name} has {len(value)} entries for {n_layers} layers ({count})")
    for layer in range(n_layers):
        _key_window(config, family, layer)
        _rope_by_layer_type(config, layer)
        method = _layer_method(config, family, layer)
        if method in METHODS and get_method(method).acts(QK_ROTATION):  # the method unit says, not its name
            _rope_parameters(config, family, layer)


MAX_LAYERS = 10_000
"""The most layers :func:`check_config` accepts: describing a layer costs a few microseconds, and a
config.json with a layer count like 10**9 would hang the description before its weights are checked."""


def _check_rope_parameters(config: Any) -> None:
    """Refuse RoPE parameters the model would fail on with a raw Python error: each entry of a
    ``rope_parameters`` keyed by layer type a dict or None (:func:`_rope_entries`), ``rope_type`` one
    transformers knows, and ``partial_rotary_factor`` in (0, 1] (``int(head_dim *
    partial_rotary_factor)`` rotated dims, ``transformers/modeling_rope_utils.py``)."""
    entries = _rope_entries(getattr(config, "rope_parameters", None), getattr(config, "layer_types", None))
    for name, entry in entries.items():
        known = rope_types(config)
        if entry.get("rope_type", "default") not in known:
            raise ConfigError(
                f"{name}.rope_type is {entry['rope_type']!r}, which transformers does not know: "
                f"use one of {', '.join(known)}"
            )
        _check_fraction(f"{name}.partial_rotary_factor", entry.get("partial_rotary_factor"))
    _check_fraction("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))


def _too_many_layers(name: str, value: int) -> ConfigError:
    return ConfigError(
        f"{name} is {value}: nopelens describes at most {MAX_LAYERS} layers (released models have a "
        "few hundred at most)"
    )


def _rope_entries(params: Any, layer_types: Any, prefix: str = "") -> dict[str, Mapping]:
    """Name -> each set of RoPE parameters in ``rope_parameters`` (one per layer type where it is keyed so;
    None entries, NoPE layer types, left out).

    Raises:
        ConfigError: if an entry is neither a dict nor None.
    """
    if not isinstance(params, Mapping):
        return {}
    per_type = set(params) & set(layer_types if isinstance(layer_types, (list, tuple)) else ())
    entries = (
        {f"{prefix}rope_parameters.{kind}": params[kind] for kind in sorted(per_type)}
        if per_type
        else {f"{prefix}rope_parameters": params}
    )
    for name, entry in entries.items():
        if entry is not None and not isinstance(entry, Mapping):
            raise ConfigError(f"{name} is {entry!r}: give a dict of RoPE parameters, or None for a NoPE layer type")
    return {name: entry for name, entry in entries.items() if entry is not None}


def rope_types(config: Any) -> tuple[str, ...]:
    """The ``rope_type`` values transformers computes for ``config``'s class: ``default``, those of
    ``ROPE_INIT_FUNCTIONS`` and those its config class validates (``_validate_<type>_rope_parameters``)."""
    own = (
        name[len("_validate_") : -len("_rope_parameters")]
        for name in dir(type(config))
        if name.startswith("_validate_") and name.endswith("_rope_parameters")
    )
    return tuple(sorted({"default", *ROPE_INIT_FUNCTIONS, *own}))


def _whole_or_none(value: Any) -> bool:
    return value is None or isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _check_fraction(name: str, value: Any) -> None:
    if value is not None and not (_positive(value) and value <= 1):
        raise ConfigError(f"{name} is {value!r}: the rotated fraction of each head must be above 0 and at most 1")


def check_sizes(fields: Mapping[str, Any], prefix: str = "") -> None:
    """Refuse a config.json whose size fields are not whole numbers, before transformers reads them
    (it fails on ``"head_dim": "64"`` with a comparison error that names no field).

    Args:
        fields: config.json as a dict; its ``text_config`` is checked too (named ``text_config.<field>``).
        prefix: how the fields are named in the message.

    Raises:
        ConfigError: naming the first of :data:`LAYER_COUNT_FIELDS`, :data:`SIZE_FIELDS` or the
            family's ``size_fields`` whose value is given and is not an integer (or, of the family's,
            is below 1; or, a layer count, above :data:`MAX_LAYERS`), or an entry of
            ``rope_parameters`` keyed by layer type that is neither a
            dict nor None (transformers fails on it with an AttributeError).

    Example:
        >>> try:
        ...     check_sizes({"model_type": "llama", "head_dim": "64"})
        ... except ValueError as error:
        ...     print(error)
        head_dim is '64' (a str): config.json's sizes must be whole numbers, e.g. 64 without quotes
    """
    family = family_of(str(fields.get("model_type", "")))
    for name in (*LAYER_COUNT_FIELDS, *SIZE_FIELDS, *family.size_fields):
        value = fields.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(
                f"{prefix}{name} is {value!r} (a {type(value).__name__}): config.json's sizes must be "
                "whole numbers, e.g. 64 without quotes"
            )
        if name in family.size_fields and value is not None and value < 1:
            raise ConfigError(f"{prefix}{name} is {value}: it must be at least 1")
        if name in LAYER_COUNT_FIELDS and value is not None and value > MAX_LAYERS:
            raise _too_many_layers(prefix + name, value)  # before transformers lists per-layer fields
    _rope_entries(fields.get("rope_parameters"), fields.get("layer_types"), prefix)
    if isinstance(fields.get("text_config"), Mapping):
        check_sizes(fields["text_config"], "text_config.")


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
            raise ConfigError(
                f"{name} is {value!r}: multi-head latent attention needs a whole number of dims "
                "(0 or more) for each head's nope and rope slices"
            )
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


NON_ATTENTION_TYPES = {"linear_attention": "linear_attention", "mamba": "ssm", "moe": "none", "mlp": "none"}
"""``config.layer_types`` entries (transformers normalizes hybrids' block types to these) that are
no softmax attention: linear attention (Gated DeltaNet, KDA; a family's Mamba blocks, which
transformers also calls ``linear_attention``, are its ``linear_mixer``, ``ssm``), state-space
mixers, and MLP-only blocks (Nemotron-H)."""

MLA_REFERENCE = (
    "multi-head latent attention: the rotated slice is the last qk_rope_head_dim dims of each head and "
    "one rotated key slice is shared by every head; nopelens' reference rotation covers leading dims of "
    "per-head q and k"
)
TRAILING_REFERENCE = (
    "the rotated slice is the trailing rotary_dim dims of each head (DeepSeek V4's [nope | rope] "
    "layout); nopelens' reference rotation covers the leading dims"
)


def _layer(config: Any, family: Family, layer: int, d_head: int) -> LayerPosition:
    scale = _score_scale(config, family, layer, d_head)
    window, chunk = _key_window(config, family, layer)
    softcap = getattr(config, "attn_logit_softcapping", None)
    common = dict(
        score_scale=scale,
        sliding_window=window,
        chunk_size=chunk,
        mixer=_mixer(config, family, layer),
        softcap=float(softcap) if softcap else None,
        sink=family.rule("sink", config, layer),
        relative_bias=family.rule("relative_bias", config, layer),
        **(family.rule("indexer", config, layer) or {}),
    )
    plain = LayerPosition(_layer_method(config, family, layer), **common)
    if plain.biases_scores:
        n_heads = int(_first(config, "num_attention_heads", "n_head", "n_heads"))
        slopes, bias_scale = (
            family.rule("alibi", config, n_heads, d_head) if family.alibi else _alibi(config, n_heads, d_head)
        )
        return replace(plain, alibi_slopes=slopes, bias_scale=bias_scale)
    if not plain.rotates:  # NoPE, or a method nopelens does not know (nothing about it is verified)
        return replace(
            plain,
            query_scale=family.rule("query_scale", config, layer),
            qk_reference=MLA_REFERENCE if family.mla else None,
        )
    base, fraction, rope_type = _rope_parameters(config, family, layer)
    rope = dict(rotary_base=base, rope_type=rope_type, pairing=family.pairing)
    if family.mla:  # heads are [nope | rope]; the rope slice of k is one head shared by all
        start, rotary_dim = mla_head_dims(config)
        if family.mla_interleaved or getattr(config, "rope_interleave", False):
            rope["pairing"] = "interleaved"
        return replace(plain, rotary_dim=rotary_dim, rotary_start=start, qk_reference=MLA_REFERENCE, **rope)
    declared = getattr(config, "rotary_dim", None) if family.reads_rotary_dim else None
    if declared is None and fraction != 1.0 and rope_type == "default":
        declared = _default_rotary_dim(config, layer)
    rotary_dim = int(declared or round(d_head * fraction))
    rotary_dim -= rotary_dim % 2
    if family.trailing_rope:
        return replace(
            plain,
            rotary_dim=rotary_dim,
            rotary_start=d_head - rotary_dim,
            qk_reference=TRAILING_REFERENCE,
            **{**rope, "pairing": "interleaved"},
        )
    return replace(plain, rotary_dim=rotary_dim, **rope)


def _default_rotary_dim(config: Any, layer: int) -> int | None:
    """Dims the model's own default RoPE rotates: twice the inverse frequencies that its
    ``*RotaryEmbedding.compute_default_rope_parameters`` returns for this config. Llama's ignores
    ``partial_rotary_factor`` and rotates the whole head; GPT-NeoX's reads it
    (``transformers/models/*/modeling_*.py``). None where the modeling module has not exactly one such
    function, or it cannot run on this config: then the config's fraction is taken as given."""
    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = {
        value.compute_default_rope_parameters
        for name, value in vars(module).items()
        if name.endswith("RotaryEmbedding") and hasattr(value, "compute_default_rope_parameters")
    }
    if len(found) != 1:
        return None
    compute = found.pop()
    kwargs = {}
    if "layer_type" in inspect.signature(compute).parameters and getattr(config, "layer_types", None):
        kwargs["layer_type"] = config.layer_types[layer]
    try:
        inv_freq, _ = compute(config, **kwargs)
    except Exception:  # the model's own code refuses this config: the loader reports that, not the description
        return None
    return 2 * int(inv_freq.numel())


def _mixer(config: Any, family: Family, layer: int) -> str:
    mixer = NON_ATTENTION_TYPES.get(layer_type(config, layer) or "", "attention")
    return family.linear_mixer if mixer == "linear_attention" else mixer


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
        if kinds[layer] in NON_ATTENTION_TYPES:  # a Mamba or linear-attention layer takes no rotary embedding
            return params
        raise ConfigError(
            f"rope_parameters has entries per layer type ({', '.join(sorted(set(params) & set(kinds)))}) "
            f"but none for {kinds[layer]!r} (layer {layer}); give it one, or None for a NoPE layer type"
        )
    return params


def _layer_method(config: Any, family: Family, layer: int) -> str:
    """``nope``/``rope``/``alibi`` of one layer: the family's declared method, else its RoPE parameters."""
    if _mixer(config, family, layer) != "attention":
        return "nope"
    if family.mla and mla_head_dims(config)[1] == 0:  # no rope slice: the attention is NoPE
        return "nope"
    if family.layer_theta:  # 0: the model passes position_embeddings=None to the layer
        return "rope" if config.layer_rope_theta[layer] else "nope"
    declared = family.rule("method", config, layer)
    if declared is not None:
        return declared
    per_type = _rope_by_layer_type(config, layer)
    if per_type is not None:
        return "rope" if per_type.get(layer_type(config, layer)) is not None else "nope"
    return "rope" if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None) else "unknown"


def _rope_parameters(config: Any, family: Family, layer: int) -> tuple[float, float, str]:
    """(base, rotated fraction, rope_type) of a rotating layer.

    Raises:
        ConfigError: naming the field that gives the base if it is not a positive number (OLMo Hybrid's
            ``rope_theta: None`` means no rotation: its method rule makes those layers NoPE first).
    """
    per_type = _rope_by_layer_type(config, layer)  # Gemma 3: one set per layer type
    params = dict(per_type[config.layer_types[layer]] if per_type else getattr(config, "rope_parameters", None) or {})
    rope_type = str(params.get("rope_type", "default"))
    name = f"rope_parameters.{config.layer_types[layer]}.rope_theta" if per_type else "rope_parameters.rope_theta"
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", 10000.0))
    if family.layer_theta:  # Granite SWA: each layer's own base, over the global one
        name, base = f"layer_rope_theta[{layer}]", config.layer_rope_theta[layer]
    if not _positive(base):
        raise ConfigError(f"{name} is {base!r}: the RoPE base of a rotating layer must be a positive number")
    fraction = params.get(
        "partial_rotary_factor",
        getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None) or 1.0,
    )
    return float(base), float(fraction), rope_type


def _score_scale(config: Any, family: Family, layer: int, d_head: int) -> float:
    """The factor on q.k in the scores: the family's own formula, else MLA's, Gemma's or 1/sqrt(d_head)."""
    declared = family.rule("score_scale", config, layer, d_head)
    if declared is not None:
        return float(declared)
    if family.mla:  # DeepseekV3Attention: qk_head_dim ** -0.5 (times yarn's mscale^2 if scaled)
        return float(sum(mla_head_dims(config))) ** -0.5
    if getattr(config, "query_pre_attn_scalar", None):  # Gemma 2/3: query_pre_attn_scalar ** -0.5
        return float(config.query_pre_attn_scalar) ** -0.5
    scale = d_head**-0.5
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= layer + 1
    return scale


def _key_window(config: Any, family: Family, layer: int) -> tuple[int | None, int | None]:
    """(sliding window, chunk) of a layer: the family's rule, else as transformers picks its mask.

    A model's forward builds one mask per layer type (``causal_mask_mapping`` in e.g.
    ``transformers/models/cohere2/modeling_cohere2.py``): ``sliding_attention`` layers get
    ``create_sliding_window_causal_mask`` with ``config.sliding_window``, ``chunked_attention``
    layers ``create_chunked_causal_mask`` with ``config.attention_chunk_size``
    (``transformers/masking_utils.py``), every other layer the causal mask. A config without
    ``layer_types`` windows every layer when it sets ``sliding_window`` (Mistral before layer types).
    """
    if family.window is not None:
        pair = family.rule("window", config, layer)
        if not isinstance(pair, tuple) or len(pair) != 2 or not all(_whole_or_none(value) for value in pair):
            raise family.fault(
                f"its window rule gave {pair!r} at layer {layer}, not (sliding window, chunk) as whole numbers or None"
            )
        return pair
    window = getattr(config, "sliding_window", None)
    kind = layer_type(config, layer)
    if kind == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        return None, (at_least_one(config, "attention_chunk_size") if chunk is not None else None)
    if window is None or (kind is not None and kind != "sliding_attention"):
        return None, None
    return at_least_one(config, "sliding_window"), None


def at_least_one(config: Any, name: str) -> int:
    """A window or chunk length in tokens from ``config.<name>``.

    Raises:
        ConfigError: if it is below 1 (every query row would be fully masked).
    """
    value = int(getattr(config, name))
    if value < 1:
        what = "a chunk" if "chunk" in name else "a window"
        raise ConfigError(f"{name} is {value}: {what} must be at least 1 token (every query row would be fully masked)")
    return value


def _alibi(config: Any, n_heads: int, d_head: int) -> tuple[tuple[float, ...], float]:
    """Press et al.'s slopes (:func:`nopelens.models.positions.alibi_slopes`), the bias added unscaled."""
    return tuple(alibi_slopes(n_heads).tolist()), 1.0


def _qk_norm(config: Any, family: Family) -> tuple[str | None, str, str]:
    """Where q/k are normalized, and the hooks that hold the q/k entering the scores.

    The bridge's ``hook_q``/``hook_k`` are the projection outputs, *before* any q/k norm; a norm
    the bridge hooks (Qwen3, OLMo-2, Gemma 3) is read from ``hook_q_normed``/``hook_k_normed``.
    """
    declared = family.rule("qk_norm", config)
    if declared is not None:
        return declared
    if getattr(config, "qk_layernorm", False):
        return "per-head (not hooked)", "hook_q", "hook_k"
    return None, "hook_q", "hook_k"
