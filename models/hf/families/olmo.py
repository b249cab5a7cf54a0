"""OLMo-2 (q/k norm over the whole projection, hooked as ``hook_q_normed``) and OLMo Hybrid (RoPE in
full-attention layers only when ``rope_theta`` is set; ``OlmoHybridAttention`` normalizes the whole
projection and its bridge hooks the norm)."""

from __future__ import annotations

from typing import Any

from ..family import Family, layer_type, rope_if


def _olmo_hybrid_method(config: Any, layer: int) -> str:
    """``OlmoHybridModel`` builds no ``rotary_emb`` when ``rope_theta`` is None."""
    params = getattr(config, "rope_parameters", None) or {}
    return rope_if(layer_type(config, layer) == "full_attention" and params.get("rope_theta") is not None)


FAMILIES = (
    Family(("olmo2",), qk_norm=("full-width", "hook_q_normed", "hook_k_normed")),
    Family(("olmo_hybrid",), method=_olmo_hybrid_method, qk_norm=("full-width", "q_norm.hook_out", "k_norm.hook_out")),
)
