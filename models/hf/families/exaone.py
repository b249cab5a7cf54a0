"""EXAONE 4, EXAONE-MoE and Kolibri 1: with a sliding window, RoPE in the sliding layers and NoPE in
the full ones (``exaone4/modeling_exaone4.py``); EXAONE 4 normalizes q and k per head."""

from ..family import PER_HEAD_QK_NORM, Family, rope_unless_global

FAMILIES = (
    Family(("exaone4",), method=rope_unless_global, qk_norm=PER_HEAD_QK_NORM),
    Family(("exaone_moe", "kolibri1"), method=rope_unless_global),
)
