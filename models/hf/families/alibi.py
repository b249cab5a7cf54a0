"""ALiBi families: BLOOM, MPT (its own slopes, scale and q/k norm) and Falcon (ALiBi when
``config.alibi``, else RoPE; its own key-value heads)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor
from transformers.models.falcon.modeling_falcon import FalconAttention

from ...positions import alibi_slopes
from ..family import Family


def mpt_alibi_slopes(n_heads: int, alibi_bias_max: float = 8.0) -> Tensor:
    """MPT's ALiBi slopes: 2^(-alibi_bias_max (h + 1) / n) over the next power of two n >= n_heads.

    For a power of two and ``alibi_bias_max = 8`` these are Press et al.'s slopes; otherwise MPT
    takes the odd then the even entries of the longer list (MPT's released ``attention.py``).

    Raises:
        ValueError: if ``n_heads`` is below 1.

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


def _mpt_alibi(config: Any, n_heads: int, d_head: int) -> tuple[tuple[float, ...], float]:
    """``build_mpt_alibi_tensor``, after MPT's released attention.py."""
    return tuple(mpt_alibi_slopes(n_heads, float(config.attn_config.alibi_bias_max)).tolist()), 1.0


def _falcon_alibi(config: Any, n_heads: int, d_head: int) -> tuple[tuple[float, ...], float]:
    """Falcon (Penedo et al. 2023, Falcon-RW's released code): (q.k + alibi) / sqrt(d_head).

    transformers 5.24's FalconModel folded alibi / sqrt(d_head) into the causal mask and also handed
    alibi to every attention, so the bias counted twice (the audit reports it); 5.25 folds it into
    the mask only."""
    return tuple(alibi_slopes(n_heads).tolist()), d_head**-0.5


def _falcon_alibi_input() -> str:
    """``alibi_tensor`` where the installed attention takes an ``alibi`` argument, else ``alibi_mask``.

    Measured from the installed code, not its version: transformers 5.25's ``FalconAttention.forward``
    has no ``alibi`` parameter (``FalconModel`` folds alibi / sqrt(d_head) into the attention mask).
    """
    return "alibi_tensor" if "alibi" in inspect.signature(FalconAttention.forward).parameters else "alibi_mask"


def _falcon_kv(config: Any, n_heads: int) -> int | None:
    if getattr(config, "new_decoder_architecture", False):
        return None
    return 1 if getattr(config, "multi_query", False) else n_heads


def _mpt_scale(config: Any, layer: int, d_head: int) -> float | None:
    return config.attn_config.softmax_scale


def _mpt_qk_norm(config: Any) -> tuple[str, str, str] | None:
    return ("per-head (not hooked)", "hook_q", "hook_k") if config.attn_config.qk_ln else None


FAMILIES = (
    Family(("bloom",), method="alibi"),
    # MPT computes its bias inside the attention: no position input
    Family(("mpt",), method="alibi", alibi=_mpt_alibi, alibi_input=None, score_scale=_mpt_scale, qk_norm=_mpt_qk_norm),
    Family(
        ("falcon",),
        method=lambda config, layer: "alibi" if getattr(config, "alibi", False) else None,
        alibi=_falcon_alibi,
        alibi_input=_falcon_alibi_input,
        n_kv_heads=_falcon_kv,
    ),
)
