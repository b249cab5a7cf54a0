"""Families that add a position table at the input and no position inside attention (every layer
``nope``): GPT-2, GPT-Neo, OPT, GPT-BigCode, OpenAI-GPT (learned tables) and XGLM (sinusoidal)."""

from __future__ import annotations

from typing import Any

from ..config import at_least_one
from ..family import Family


def _gpt2_scale(config: Any, layer: int, d_head: int) -> float | None:
    """``scale_attn_weights`` false: q.k unscaled (``GPT2Attention``), still over layer + 1 with
    ``scale_attn_by_inverse_layer_idx``; None: the default 1/sqrt(d_head)."""
    if getattr(config, "scale_attn_weights", True):
        return None
    return 1.0 / (layer + 1) if getattr(config, "scale_attn_by_inverse_layer_idx", False) else 1.0


def _gpt_neo_window(config: Any, layer: int) -> tuple[int | None, None]:
    """GPT-Neo's ``local`` layers (``config.attention_layers``) see the ``window_size`` keys up to the
    query (``GPTNeoSelfAttention``: the causal mask less ``tril(mask, -window_size)``)."""
    local = config.attention_layers[layer] == "local"
    return (at_least_one(config, "window_size") if local else None), None


def _bigcode_kv(config: Any, n_heads: int) -> int | None:
    return 1 if getattr(config, "multi_query", False) else None


LEARNED = dict(method="nope", input_position="learned")

FAMILIES = (
    Family(("gpt2",), **LEARNED, position_table="transformer.wpe", score_scale=_gpt2_scale),
    Family(
        ("gpt_bigcode",), **LEARNED, position_table="transformer.wpe", score_scale=_gpt2_scale, n_kv_heads=_bigcode_kv
    ),
    # GPTNeoSelfAttention does not scale q.k
    Family(
        ("gpt_neo",),
        **LEARNED,
        position_table="transformer.wpe",
        score_scale=lambda c, l, d: 1.0,
        window=_gpt_neo_window,
    ),
    # OPTLearnedPositionalEmbedding keeps two rows for padding ids: read at position_id + 2
    Family(("opt",), **LEARNED, position_table="model.decoder.embed_positions", position_offset=2),
    Family(("openai-gpt",), **LEARNED, position_table="transformer.positions_embed"),
    # XGLMSinusoidalPositionalEmbedding: the same offset of 2
    Family(("xglm",), method="nope", input_position="sinusoidal", position_offset=2),
)
