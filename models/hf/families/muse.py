"""Muse Glimmer and Muse Spark: each layer's RoPE base from ``layer_rope_theta`` (0: NoPE)."""

from ..family import Family

FAMILIES = (
    Family(
        ("muse_glimmer_text",),
        layer_theta=True,
        bridge_refused=(
            "TransformerLens 4.3's bridge of Muse Glimmer hooks q and k before its scaleless q/k norm "
            "and the qk_scale_factor on q, so its hook_q and hook_k are not what enters the scores"
        ),
    ),
    Family(("muse_spark_text",), layer_theta=True),
)
