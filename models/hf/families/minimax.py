"""MiniMax-M3 (text): its rotary embedding rotates ``head_dim * rope_parameters["partial_rotary_factor"]``
dims (1.0 when unset; ``MiniMaxM3VLRotaryEmbedding.compute_default_rope_parameters``), whatever the
config's ``rotary_dim`` says (MiniMax-M2's config turns ``rotary_dim`` into that factor; M3's does
not). Its ``minimax_m3_sparse`` layers are unreadable (``MiniMaxM3VLIndexer`` in
``minimax_m3_vl/modeling_minimax_m3_vl.py``: ``q_block = position_ids // block_size`` indexes the
key blocks)."""

from ..family import Family

FAMILIES = (
    Family(
        ("minimax_m3_vl_text",),
        reads_rotary_dim=False,
        unreadable_layer_types={
            "minimax_m3_sparse": "MiniMax-M3's minimax_m3_sparse layers keep, per query, only the key blocks its "
            "lightning indexer scores highest (a content-chosen key set) and place those blocks by "
            "position id in key-slot units, so re-spaced position ids (the per-layer detector's) "
            "crash it and left padding changes which keys it keeps"
        },
    ),
)
