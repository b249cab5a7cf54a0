"""Llama 4 (text and multimodal): interleaved RoPE (complex multiplication) on the layers
``no_rope_layers`` marks, NoPE elsewhere with a query temperature, chunked attention, and an L2
q/k norm after the rotation (``transformers/models/llama4/modeling_llama4.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..description import QueryScale
from ..family import Family, no_rope_layers


def l2_normalize(x: Tensor, eps: float) -> Tensor:
    """Llama 4's ``Llama4TextL2Norm`` without weight: x / sqrt(mean(x^2) + eps) over the last axis.

    A rotation keeps the norm of each rotated pair, so this commutes with RoPE.
    """
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _query_scale(config: Any, layer: int) -> QueryScale | None:
    """``Llama4TextAttention``'s temperature tuning on NoPE layers (:class:`QueryScale` ``llama4``)."""
    if not getattr(config, "attn_temperature_tuning", False):
        return None
    return QueryScale("llama4", "index", float(config.floor_scale), float(config.attn_scale))


def _notes(config: Any) -> tuple[str, ...]:
    if not getattr(config, "attn_temperature_tuning", False):
        return ()
    floor = int(config.floor_scale)
    return (
        f"Llama 4 scales NoPE-layer queries by 1 + attn_scale * log(1 + floor((p + 1) / {floor})): "
        f"exactly 1 below position {floor - 1}",
    )


FAMILIES = (
    Family(
        ("llama4_text", "llama4"),
        method=no_rope_layers,
        pairing="interleaved",
        query_scale=_query_scale,
        qk_norm=lambda config: ("l2 after rope", "hook_q", "hook_k") if getattr(config, "use_qk_norm", False) else None,
        notes=_notes,
    ),
)
