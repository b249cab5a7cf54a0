"""Multi-head latent attention (``deepseek_v3/modeling_deepseek_v3.py``): q and k heads are
``[qk_nope_head_dim | qk_rope_head_dim]``; only the last slice rotates, and k's rotated slice is one
head broadcast to all. DeepSeek V2/V3/V3.2 and the families built on them.

``mla_interleaved``: the attention rotates interleaved pairs whatever the config says (no
``rope_interleave`` field): ``apply_rotary_pos_emb_interleave`` in the attention of
``deepseek_v32``, ``longcat_flash``, ``mistral_large4``, ``axk2``, ``glm_moe_dsa``,
``bailing_hybrid`` and ``dots3_note``'s modeling files (their DSA indexers rotate half-split pairs,
but only to choose keys), and DeepSeek V2's complex multiplication (``apply_rotary_emb``).

DSA indexers (``index_topk``): GLM-MoE-DSA's ``shared`` layers reuse the previous layer's selection
(still sparse); Dots3-Note indexes only its ``indexed_attention`` layers; GLM-5.3's pooled indexer
scores pools of ``index_kpool`` keys.
"""

from __future__ import annotations

from typing import Any

from ..description import UnsupportedModelError
from ..family import Family, index_topk, layer_type, no_rope_layers


def _indexed_layers_only(config: Any, layer: int) -> dict[str, Any]:
    return index_topk(config, layer) if layer_type(config, layer) == "indexed_attention" else {}


def _pooled_dsa(config: Any, layer: int) -> dict[str, Any]:
    """A DSA indexer that scores pools of ``index_kpool`` keys (``Glm5NextTextIndexer`` in
    ``glm5_next/modeling_glm5_next.py``): a pool is a candidate once its last key is visible, each
    query keeps the ``index_topk // index_kpool`` best and, with ``index_kpool_always_select_tail``,
    its incomplete last pool: QSA's rule, in its own field names.

    Raises:
        UnsupportedModelError: when ``index_kpool_always_select_tail`` is false (its keys are cut at every length).
    """
    if layer_type(config, layer) != "indexed_attention":
        return {}
    if not getattr(config, "index_kpool_always_select_tail", True):
        raise UnsupportedModelError(
            "index_kpool_always_select_tail is false: each query's DSA indexer drops the "
            "keys of its incomplete last pool at every length, a content-dependent sparse "
            "mask nopelens does not model"
        )
    return dict(index_topk=int(config.index_topk), index_block=int(config.index_kpool), index_kind="DSA k-pool")


FAMILIES = (
    Family(("deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu", "sarvam_mla", "mistral4", "axk1"), mla=True),
    Family(("deepseek_v2", "bailing_hybrid"), mla=True, mla_interleaved=True),
    Family(("deepseek_v32", "axk2", "glm_moe_dsa"), mla=True, mla_interleaved=True, indexer=index_topk),
    # LongcatFlashDecoderLayer runs self_attn[i] on input_layernorm[i] of the stream for i in (0, 1),
    # cache layer 2 * layer + i; num_hidden_layers is twice the decoder layers
    Family(("longcat_flash",), mla=True, mla_interleaved=True, sublayers=("self_attn", "input_layernorm")),
    Family(("mistral_large4_text",), mla=True, mla_interleaved=True, indexer=index_topk, method=no_rope_layers),
    Family(("dots3_note_text",), mla=True, mla_interleaved=True, indexer=_indexed_layers_only),
    Family(("glm5_next_text",), mla=True, indexer=_pooled_dsa),
)
