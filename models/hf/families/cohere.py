"""Cohere's decoders: Cohere (interleaved RoPE, per-head q/k norm with ``use_qk_norm``), Cohere 2
(RoPE only in sliding layers) and Cohere 2 MoE (half pairs; dense prefix layers may rotate too)."""

from __future__ import annotations

from typing import Any

from ..family import PER_HEAD_QK_NORM, Family, layer_type, rope_if, rope_if_sliding


def _cohere2_moe_method(config: Any, layer: int) -> str:
    """``cohere2_moe/modeling_cohere2_moe.py``: sliding layers rotate, and dense prefix layers are
    forced to when ``prefix_dense_sliding_window_pattern`` is 1."""
    forced = config.mlp_layer_types[layer] == "dense" and config.prefix_dense_sliding_window_pattern == 1
    return rope_if(layer_type(config, layer) == "sliding_attention" or forced)


FAMILIES = (
    Family(
        ("cohere",),
        pairing="interleaved",
        qk_norm=lambda config: PER_HEAD_QK_NORM if getattr(config, "use_qk_norm", False) else None,
    ),
    Family(("cohere2",), pairing="interleaved", method=rope_if_sliding),
    Family(("cohere2_moe",), method=_cohere2_moe_method),
)
