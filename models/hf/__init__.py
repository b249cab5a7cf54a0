"""What nopelens knows about HF causal LMs: the one place that knows model families.

:func:`describe` turns a bridged HF model (a TransformerLens ``TransformerBridge`` from
:func:`nopelens.models.adapters.bridge_hf_model`) into an :class:`HFDescription`: per layer, the
position method (``nope``, ``rope``, ``alibi``) with its parameters, the score scale, q/k
normalization, and which bridged hooks can be trusted. The audit, ``probe``, ``sinks`` and the
sweep read this description; none of them branches on a model type.

Two sources, kept apart:

- the config and the family's declarations (:class:`~nopelens.models.hf.family.Family`, one module
  per family or group in :mod:`nopelens.models.hf.families`, citing the family's code) give the
  position method, rotary fraction, base, pairing, score scale, soft-capping and q/k norms
  (:mod:`~nopelens.models.hf.config`);
- one small forward pass (a *census*, :mod:`~nopelens.models.hf.census`) gives what the bridge
  actually does: which hook points fire (TransformerLens 4.3 lists ``hook_rot_q``/``hook_rot_k``
  on GPT-NeoX, Phi-3, GPT-J and Falcon but never fires them), whether ``hook_attn_scores`` are the
  scores behind ``hook_pattern``, and whether future keys get zero weight under an ``attention_mask``.

Adding a family is one new module under ``families/`` (or :func:`register` for one kept elsewhere).
"""

from ..compat import moved_names
from .census import _DESCRIPTIONS as _DESCRIPTIONS
from .census import (
    SINKS_IN_THE_SOFTMAX,
    census,
    check_readable,
    describe,
    learned_sinks,
    refusing,
    sink_parameters,
    softmax_with_sink,
)
from .census import _one_line as _one_line
from .config import (
    LAYER_COUNT_FIELDS,
    PER_LAYER_FIELDS,
    SIZE_FIELDS,
    check_config,
    check_sizes,
    describe_config,
    mla_head_dims,
    text_config,
    trained_length,
)
from .description import (
    BLOCK_INDEXER_FIELDS,
    PAIRINGS,
    ConfigError,
    HFDescription,
    LayerPosition,
    QueryScale,
    UnsupportedModelError,
)
from .families.alibi import mpt_alibi_slopes
from .families.llama4 import l2_normalize
from .family import Family, RuleError, family_of, register, unregister
from .layout import HookLayout, bridge_refused, hook_layout, position_table, unreadable

__all__ = [
    "BLOCK_INDEXER_FIELDS",
    "LAYER_COUNT_FIELDS",
    "PAIRINGS",
    "PER_LAYER_FIELDS",
    "SINKS_IN_THE_SOFTMAX",
    "SIZE_FIELDS",
    "ConfigError",
    "Family",
    "HFDescription",
    "HookLayout",
    "LayerPosition",
    "QueryScale",
    "RuleError",
    "UnsupportedModelError",
    "bridge_refused",
    "census",
    "check_config",
    "check_sizes",
    "check_readable",
    "describe",
    "describe_config",
    "family_of",
    "hook_layout",
    "l2_normalize",
    "learned_sinks",
    "mla_head_dims",
    "mpt_alibi_slopes",
    "position_table",
    "refusing",
    "register",
    "sink_parameters",
    "softmax_with_sink",
    "text_config",
    "trained_length",
    "unreadable",
    "unregister",
]

FAMILY_TABLES = (
    "INTERLEAVED_FAMILIES",
    "LEARNED_FAMILIES",
    "ALIBI_FAMILIES",
    "POSITION_OFFSET",
    "NON_ATTENTION_TYPES",
    "NO_ROPE_LAYER_FAMILIES",
    "ROPE_IF_SLIDING",
    "ROPE_UNLESS_GLOBAL",
    "LAYER_THETA_FAMILIES",
    "NOPE_ATTENTION_FAMILIES",
    "MLA_FAMILIES",
    "MLA_ALWAYS_INTERLEAVED",
    "DSA_FAMILIES",
    "QSA_FAMILIES",
    "POOLED_DSA_FAMILIES",
    "ROTARY_DIM_UNREAD",
    "TRAILING_ROPE_FAMILIES",
    "MLA_REFERENCE",
    "GRANITE_ROTARY_TYPES",
    "LEARNED_SINK_FAMILIES",
    "PER_HEAD_QK_NORM",
    "BRIDGE_REFUSED",
    "UNREADABLE_FAMILIES",
    "UNREADABLE_LAYER_TYPES",
    "BRIDGE_CACHE_BROKEN",
    "MIXER_NAMES",
    "ATTENTION_NAMES",
    "POSITION_BIAS_MODULES",
    "SUBLAYER_FAMILIES",
    "POSITION_TABLES",
    "CENSUS_LENGTH",
)
"""The tables of the single-module ``hf.py`` (one tuple of family names per trait), gone since each family
declares its traits in one file of ``models/hf/families/``."""

__getattr__ = moved_names(
    __name__,
    gone=dict.fromkeys(
        FAMILY_TABLES, "each family declares its traits in models/hf/families/: ask family_of(model_type)"
    ),
)
