"""TransformerLens hook and parameter names, built in one place.

Every hooked model nopelens reads (its own :class:`~nopelens.models.Decoder`, a
``TransformerBridge`` around an HF model, a ``HookedModule``) names its hook points as
TransformerLens does: ``blocks.{l}.hook_resid_post``, ``blocks.{l}.attn.hook_pattern``, ...
Code that needs such a name asks :func:`act_name` instead of writing the f-string, so the naming
lives here and a typo is an error, not a hook that silently never fires.

This module imports only the standard library (it sits at the bottom of the import graph: every other module may
use it). Short names are TransformerLens' own (``transformer_lens.utils.get_act_name`` uses the
same words: ``resid_post``, ``pattern``, ``attn_scores``, ``rot_q``, ...), plus the hooks a
nopelens ``Decoder`` and the HF bridge add (``content_scores``, ``pos_bias``, ``q_normed``,
``cos``, ...).
"""

from __future__ import annotations

import operator

BLOCK_HOOKS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
"""Hooks directly under ``blocks.{l}`` (each ``[batch, pos, d_model]``)."""

ATTN_HOOKS = (
    "q",
    "k",
    "v",
    "q_normed",
    "k_normed",
    "rot_q",
    "rot_k",
    "content_scores",
    "pos_bias",
    "attn_scores",
    "pattern",
    "z",
    "result",
    "cos",
    "sin",
)
"""Hooks under ``blocks.{l}.attn`` (q/k/v/z/result ``[batch, pos, head_index, d_head]``, scores and
pattern ``[batch, head_index, query_pos, key_pos]``)."""

MLP_HOOKS = ("pre", "post")
"""Hooks under ``blocks.{l}.mlp`` (``[batch, pos, d_mlp]``)."""

ATTN_NORM_HOOKS = ("q_norm.hook_out", "k_norm.hook_out")
"""Output hooks of a ``TransformerBridge``'s q/k norm components under ``blocks.{l}.attn``, where a
bridge normalizes the full-width projection in a component of its own (OLMo-Hybrid:
``[batch, pos, n_heads * d_head]``)."""


def block(layer: int) -> str:
    """The name prefix of block ``layer``'s hooks and parameters.

    >>> block(3)
    'blocks.3'

    Raises:
        ValueError: if ``layer`` is not an int >= 0.
    """
    try:
        index = operator.index(layer)  # any integer type (numpy and torch ones too), never a float
    except TypeError:
        index = -1
    if isinstance(layer, bool) or index < 0:
        raise ValueError(f"a block index is an integer >= 0, got {layer!r}")
    return f"blocks.{index}"


def act_name(name: str, layer: int) -> str:
    """The full hook name of ``name`` in block ``layer``, as TransformerLens names it.

    Args:
        name: a short name (``resid_post``, ``pattern``, ``rot_q``, ``pre``, ...; see
            :data:`BLOCK_HOOKS`, :data:`ATTN_HOOKS` and :data:`MLP_HOOKS`), with or without
            its ``hook_`` prefix, or a bridge component's hook (:data:`ATTN_NORM_HOOKS`).
        layer: the block index, >= 0.

    Returns:
        ``blocks.{layer}.hook_{name}``, ``blocks.{layer}.attn.hook_{name}``,
        ``blocks.{layer}.mlp.hook_{name}`` or ``blocks.{layer}.attn.{name}``.

    Raises:
        ValueError: on an unknown name (the message lists the known ones) or a bad ``layer``.

    Example:
        >>> act_name("resid_post", 2), act_name("hook_pattern", 0), act_name("pre", 1)
        ('blocks.2.hook_resid_post', 'blocks.0.attn.hook_pattern', 'blocks.1.mlp.hook_pre')
        >>> act_name("q_norm.hook_out", 3)
        'blocks.3.attn.q_norm.hook_out'
    """
    short, prefix = name.removeprefix("hook_"), block(layer)
    places = {"hook_": BLOCK_HOOKS, "attn.hook_": ATTN_HOOKS, "mlp.hook_": MLP_HOOKS, "attn.": ATTN_NORM_HOOKS}
    for place, names in places.items():
        if short in names:
            return f"{prefix}.{place}{short}"
    raise ValueError(f"unknown hook {name!r}; known: {', '.join(sum(places.values(), ()))}")


def act_names(name: str, layers) -> list[str]:
    """:func:`act_name` of ``name`` for each of ``layers`` (an int n means ``range(n)``).

    >>> act_names("pattern", 2)
    ['blocks.0.attn.hook_pattern', 'blocks.1.attn.hook_pattern']
    """
    return [act_name(name, layer) for layer in (range(layers) if isinstance(layers, int) else layers)]
