"""Families with one learned sink logit per head in the softmax denominator (``sinks`` in
``gpt_oss/modeling_gpt_oss.py``): GPT-OSS, Flint (RoPE only in sliding layers, per-head q/k norm,
``flint/modeling_flint.py``), HY-V4 (with a DSA indexer) and MiMo-V2-Flash (sliding layers only)."""

from __future__ import annotations

from typing import Any

from ..family import PER_HEAD_QK_NORM, Family, index_topk, layer_type, rope_if_sliding


def _mimo_sink(config: Any, layer: int) -> str | None:
    """``MiMoV2FlashAttention``: ``self.sinks`` only when ``is_swa``."""
    return "learned" if layer_type(config, layer) == "sliding_attention" else None


FAMILIES = (
    Family(("gpt_oss",), sink="learned"),
    Family(("flint",), sink="learned", method=rope_if_sliding, qk_norm=PER_HEAD_QK_NORM),
    Family(("hy_v4",), sink="learned", indexer=index_topk),
    Family(("mimo_v2_flash",), sink=_mimo_sink),
)
