"""Gemma 3 (text and multimodal): per-head q/k norm before RoPE, one set of RoPE parameters per
layer type. (Gemma 2's ``query_pre_attn_scalar`` and soft-capping need no declaration: the core reads
those fields wherever a config has them.)"""

from ..family import PER_HEAD_QK_NORM, Family

FAMILIES = (Family(("gemma3_text", "gemma3"), qk_norm=PER_HEAD_QK_NORM),)
