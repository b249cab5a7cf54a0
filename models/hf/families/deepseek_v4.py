"""DeepSeek V4: heads laid out ``[nope | rope]`` with the rotated slice last (``apply_rotary_pos_emb``
of ``deepseek_v4/modeling_deepseek_v4.py`` rotates ``x[..., -rope_dim:]``), learned sinks and a DSA
indexer; its compressed-attention layers make it unreadable (``DeepseekV4Attention`` concatenates its
compressor's entries onto the keys)."""

from ..family import Family, index_topk

FAMILIES = (
    Family(
        ("deepseek_v4",),
        trailing_rope=True,
        sink="learned",
        indexer=index_topk,
        unreadable=(
            "DeepSeek V4's compressed-attention layers (layer_types compressed_sparse_attention and "
            "heavily_compressed_attention, every layer as shipped) append one compressed KV entry per "
            "compress_rate tokens to the key axis, so its attention weights are not one column per key token "
            "and no mask, sink or pattern read applies"
        ),
    ),
)
