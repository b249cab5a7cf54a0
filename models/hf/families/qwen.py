"""Qwen3 and Qwen3-Next (per-head q/k norm before RoPE, ``qwen3_next/modeling_qwen3_next.py``) and
Qwen4-Exp (a QSA block indexer, hyper-connection residual streams)."""

from __future__ import annotations

from typing import Any

from ..family import PER_HEAD_QK_NORM, Family, layer_type


def _qsa(config: Any, layer: int) -> dict[str, Any]:
    """Qwen4-Exp's QSA (``Qwen4ExpTextQSAIndexer`` in ``qwen4_exp/modeling_qwen4_exp.py``, on its
    ``indexed_attention`` layers once ``indexer_budget`` is set): each query's visible keys are cut
    into complete blocks of ``indexer_compress_ratio``, of which it keeps the ``indexer_budget //
    indexer_compress_ratio`` its index scores highest, plus the incomplete last block."""
    if not getattr(config, "indexer_budget", None) or layer_type(config, layer) != "indexed_attention":
        return {}
    return dict(index_topk=int(config.indexer_budget), index_block=int(config.indexer_compress_ratio))


def _qwen4_notes(config: Any) -> tuple[str, ...]:
    return (
        f"Qwen4-Exp keeps {config.hc_count} hyper-connection residual streams: hook_resid_pre/post hold "
        f"them side by side ({config.hc_count} x d_model wide), and the final mixer sums them"
        + (
            "; its PLE layers add hashed n-gram embeddings of neighbouring token ids, which read no "
            "position ids (nothing verifies them)"
            if config.ple_layer_ids
            else ""
        ),
    )


FAMILIES = (
    Family(("qwen3",), qk_norm=PER_HEAD_QK_NORM),
    Family(
        ("qwen3_next",),
        qk_norm=PER_HEAD_QK_NORM,
        bridge_cache_broken=(
            "TransformerLens 4.3's Qwen3-Next bridge loses the linear-attention state between cached "
            "steps (its decoding diverges from the full forward while the HF model's own does not), so "
            "cached decoding through the bridge is not the model's"
        ),
    ),
    Family(("qwen4_exp_text",), indexer=_qsa, notes=_qwen4_notes),
)
