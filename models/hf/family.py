"""What an HF model family declares, and the registry that finds the declarations.

A :class:`Family` says what a family *is* for each ``model_type`` it covers: its position method
per layer, window, sink, query scale, indexer, sizes, score scale, q/k norm, and where
TransformerLens cannot read it. Every field defaults to "nothing special" (RoPE with half pairs
where the config gives RoPE parameters, 1/sqrt(d_head), no norm, bridged). The core
(:mod:`nopelens.models.hf.config`, :mod:`nopelens.models.hf.layout`) reads only these traits.

Adding a family is one new module in :mod:`nopelens.models.hf.families` that defines
``FAMILIES = (Family(...), ...)``: the registry discovers every module of that package. A family
kept outside the package is added with :func:`register`.

A *rule* field is a constant or a function of ``(config, layer)`` (``score_scale``: of
``(config, layer, d_head)``), for what depends on the config.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..methods import method_names
from .description import PAIRINGS, SINK_KINDS, ConfigError, UnsupportedModelError

FAMILIES_PACKAGE = "nopelens.models.hf.families"


@dataclass(frozen=True, eq=False)
class Family:
    """One family's declarations (one or more ``model_type`` values that share them).

    Attributes:
        model_types: the config ``model_type`` values this declares (``type(config).model_type``).
        method: the position method of every attention layer (``nope``, ``rope``, ``alibi``), or a
            rule ``(config, layer) -> method or None``; None: ``rope`` where ``rope_parameters``
            give the layer's type an entry (or the config any RoPE parameter), else ``unknown``.
        pairing: ``half`` or ``interleaved`` RoPE pairs.
        input_position: ``learned`` (a position table read at input, sized by ``n_positions`` or
            ``max_position_embeddings``), ``sinusoidal`` or None.
        position_offset: the table is read at ``position_id + offset``.
        position_table: module path of the learned table (``transformer.wpe``), or None.
        mla: multi-head latent attention, heads ``[qk_nope_head_dim | qk_rope_head_dim]`` with one
            shared rotated key slice (``deepseek_v3/modeling_deepseek_v3.py``).
        mla_interleaved: an MLA family that rotates interleaved pairs whatever ``rope_interleave`` says.
        trailing_rope: the rotated slice is the last ``rotary_dim`` dims of each head, interleaved.
        reads_rotary_dim: the model reads the config's ``rotary_dim`` (False: a field it ignores).
        layer_theta: ``layer_rope_theta[l]`` is layer l's RoPE base, 0 a NoPE layer.
        window: rule -> (sliding window, chunk) of a layer, or None for transformers' layer-type rule.
        sink: ``learned``, ``output_scale``, ``per_token`` or None, or a rule giving one.
        query_scale: rule -> :class:`~nopelens.models.hf.description.QueryScale` or None.
        relative_bias: rule -> the extent of a learned bias by distance, or None.
        indexer: rule -> the ``index_topk``/``index_block``/``index_kind`` fields of a layer's
            sparse indexer (:class:`~nopelens.models.hf.description.LayerPosition`), empty: none.
        score_scale: rule ``(config, layer, d_head)`` -> the factor on q.k, or None for the default.
        n_kv_heads: rule ``(config, n_heads)`` -> key-value heads, or None to read the config.
        qk_norm: (where, q hook, k hook), or a rule ``(config) ->`` that or None.
        alibi: rule ``(config, n_heads, d_head)`` -> (slopes, bias scale); None: Press et al.'s slopes.
        alibi_input: the name the ALiBi bias enters the attention under (or a function of nothing
            giving it; None: computed inside it).
        notes: rule ``(config) ->`` what the description cannot verify, as sentences.
        bridge_refused: why TransformerLens' adapter misreads it (hooked directly instead), or None.
        bridge_cache_broken: why cached decoding through its bridge is not the model's, or None.
        unreadable: why nopelens cannot read it at all, or None.
        unreadable_layer_types: ``layer_types`` entry -> why a model with such a layer is unreadable.
        position_bias_module: child of each attention whose output is its score bias by distance.
        sublayers: (attention list, norm list) of a decoder layer holding several attention sublayers.
        linear_mixer: what its ``linear_attention`` layers are (transformers' name for every
            non-softmax mixer): ``linear_attention`` (Gated DeltaNet, KDA) or ``ssm`` (Mamba blocks).
        size_fields: config fields besides :data:`~nopelens.models.hf.config.SIZE_FIELDS` that
            fix weight shapes or place layers (each must be a whole number of at least 1 in config.json).
        check: a function of the config that raises
            :class:`~nopelens.models.hf.description.ConfigError` naming a field the family's code
            would fail on, or None.
    """

    model_types: tuple[str, ...]
    method: str | Callable[[Any, int], str | None] | None = None
    pairing: str = "half"
    input_position: str | None = None
    position_offset: int = 0
    position_table: str | None = None
    mla: bool = False
    mla_interleaved: bool = False
    trailing_rope: bool = False
    reads_rotary_dim: bool = True
    layer_theta: bool = False
    window: Callable[[Any, int], tuple[int | None, int | None]] | None = None
    sink: str | Callable[[Any, int], str | None] | None = None
    query_scale: Callable[[Any, int], Any] | None = None
    relative_bias: Callable[[Any, int], int | None] | None = None
    indexer: Callable[[Any, int], dict[str, Any]] | None = None
    score_scale: Callable[[Any, int, int], float | None] | None = None
    n_kv_heads: Callable[[Any, int], int | None] | None = None
    qk_norm: tuple[str, str, str] | Callable[[Any], tuple[str, str, str] | None] | None = None
    alibi: Callable[[Any, int, int], tuple[tuple[float, ...], float]] | None = None
    alibi_input: str | Callable[[], str | None] | None = "alibi_tensor"
    notes: Callable[[Any], tuple[str, ...]] | None = None
    bridge_refused: str | None = None
    bridge_cache_broken: str | None = None
    unreadable: str | None = None
    unreadable_layer_types: Mapping[str, str] = field(default_factory=dict)
    position_bias_module: str | None = None
    sublayers: tuple[str, str] | None = None
    linear_mixer: str = "linear_attention"
    size_fields: tuple[str, ...] = ()
    check: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        """Refuse declarations the core cannot read, when the family is made rather than when it is used.

        Raises:
            TypeError: if ``model_types`` is not a tuple (or list) of non-empty strings.
            ValueError: if a constant ``method``, ``pairing`` or ``sink`` is none the core knows.
        """
        types = self.model_types
        if (
            isinstance(types, str)
            or not isinstance(types, (tuple, list))
            or not all(isinstance(name, str) and name for name in types)
        ):
            raise TypeError(f"Family(model_types={types!r}): give a tuple of model_type strings, e.g. ('llama',)")
        object.__setattr__(self, "model_types", tuple(types))
        for name, known in (("method", (*method_names(), "unknown")), ("pairing", PAIRINGS), ("sink", SINK_KINDS)):
            value = getattr(self, name)
            if value is not None and not callable(value) and value not in known:
                raise ValueError(f"Family {types!r}: {name}={value!r} is none of {', '.join(known)} (or a rule)")

    def rule(self, name: str, *args: Any) -> Any:
        """Rule field ``name``'s value: its function's result for ``args`` (``config, layer, ...``), or the
        constant itself.

        Raises:
            RuleError: if the function fails with anything but a ConfigError (which names a config field).
        """
        rule = getattr(self, name)
        if not callable(rule):
            return rule
        try:
            return rule(*args)
        except (ConfigError, UnsupportedModelError):
            raise
        except Exception as error:
            where = f" at layer {args[1]}" if name in LAYER_RULES else ""
            raise self.fault(f"its {name} rule failed{where} ({type(error).__name__}: {error})") from error

    def fault(self, what: str) -> RuleError:
        """The error for a fault of these declarations: ``family '<model types>': <what>``."""
        return RuleError(f"family {'/'.join(self.model_types)!r}: {what}")


LAYER_RULES = ("method", "window", "sink", "query_scale", "relative_bias", "indexer", "score_scale")
"""Rule fields whose second argument is the layer."""


class RuleError(ConfigError):
    """A family's rule failed on a config: a fault of the family's declarations, named with the rule."""


DEFAULT = Family(model_types=())
"""The declarations of a family nobody registered: nothing special."""

_REGISTRY: dict[str, Family] = {}
_SOURCES: dict[str, str] = {}
_discovered: set[str] = set()


def register(family: Family, source: str = "register()") -> Family:
    """Add ``family`` to the registry under each of its ``model_types`` and return it.

    Raises:
        TypeError: if ``family`` is not a :class:`Family`.
        ValueError: if it declares no model type, or another family (from another module) already
            declares one of its model types.
    """
    _need(family, Family, "register", "a Family")
    if not family.model_types:
        raise ValueError("register: the Family declares no model_type; give Family(('my_type',), ...)")
    discover()
    taken = [t for t in family.model_types if t in _REGISTRY and _REGISTRY[t] is not family]
    if taken:
        raise ValueError(f"model_type {taken[0]!r} is already declared by {_SOURCES[taken[0]]}")
    for model_type in family.model_types:
        _REGISTRY[model_type], _SOURCES[model_type] = family, source
    return family


def unregister(family: Family) -> None:
    """Remove ``family``'s model types from the registry (undoes :func:`register`).

    Raises:
        TypeError: if ``family`` is not a :class:`Family` (e.g. a model_type string: pass ``family_of(it)``).
    """
    _need(family, Family, "unregister", "a Family (family_of(model_type) gives one)")
    for model_type in family.model_types:
        if _REGISTRY.get(model_type) is family:
            del _REGISTRY[model_type], _SOURCES[model_type]


def discover() -> None:
    """Register the ``FAMILIES`` of every module of :data:`FAMILIES_PACKAGE` not read yet (its
    ``__path__`` may be extended to add a folder of family modules)."""
    package = importlib.import_module(FAMILIES_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__, FAMILIES_PACKAGE + "."):
        if info.name in _discovered:
            continue
        _discovered.add(info.name)
        for family in importlib.import_module(info.name).FAMILIES:
            register(family, info.name)


def family_of(model_type: str) -> Family:
    """The declarations for ``model_type`` (:data:`DEFAULT` when no family declares it).

    Raises:
        TypeError: if ``model_type`` is not a string.
    """
    _need(model_type, str, "family_of", "a model_type string")
    discover()
    return _REGISTRY.get(model_type, DEFAULT)


def declared() -> dict[str, str]:
    """model_type -> the module (or ``register()``) that declares it, for every registered family."""
    discover()
    return dict(_SOURCES)


def _need(value: Any, kind: type, function: str, what: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{function} needs {what}, got {value!r} (a {type(value).__name__})")


# ----------------------------------------------------------------------------- rules families share
def layer_type(config: Any, layer: int) -> str | None:
    """``config.layer_types[layer]``, or None where the config has no such list."""
    kinds = getattr(config, "layer_types", None)
    return kinds[layer] if kinds is not None and layer < len(kinds) else None


def rope_if(rotates: Any) -> str:
    """``rope`` when ``rotates`` is true, else ``nope``."""
    return "rope" if rotates else "nope"


def rope_if_sliding(config: Any, layer: int) -> str:
    """RoPE only in sliding-window layers, NoPE in full ones (``if self.sliding_window is not None:``
    in ``cohere2/modeling_cohere2.py``)."""
    return rope_if(layer_type(config, layer) == "sliding_attention")


def rope_unless_global(config: Any, layer: int) -> str:
    """``if self.sliding_window is None or self.is_sliding:`` rotate (``exaone4/modeling_exaone4.py``):
    with a window, the full-attention layers are NoPE; without one, every layer rotates."""
    return rope_if(getattr(config, "sliding_window", None) is None or layer_type(config, layer) == "sliding_attention")


def no_rope_layers(config: Any, layer: int) -> str | None:
    """``no_rope_layers[l]``: 1 = layer l rotates, 0 = NoPE (``self.use_rope =
    config.no_rope_layers[layer_idx]`` in ``smollm3/modeling_smollm3.py`` and
    ``llama4/modeling_llama4.py``); None where the config has no such list."""
    flags = getattr(config, "no_rope_layers", None)
    return None if flags is None else rope_if(flags[layer])


def index_topk(config: Any, layer: int) -> dict[str, Any]:
    """A DeepSeek Sparse Attention indexer on every layer once ``index_topk`` is set: each query
    attends only to the ``index_topk`` keys its indexer scores highest (``DeepseekV32Indexer``:
    ``index_scores.topk(...)`` scattered into the attention mask, ``deepseek_v32/modeling_deepseek_v32.py``)."""
    topk = getattr(config, "index_topk", None)
    return dict(index_topk=int(topk)) if topk else {}


PER_HEAD_QK_NORM = ("per-head", "hook_q_normed", "hook_k_normed")
"""q and k normalized per head before the rotation (``self.q_norm`` on ``head_dim``, e.g.
``qwen3_next/modeling_qwen3_next.py``), hooked after the norm as ``hook_q_normed``/``hook_k_normed``."""
