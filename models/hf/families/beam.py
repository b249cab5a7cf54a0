"""Beam: per-head q/k norm, one set of RoPE parameters per layer type (None: a NoPE type), and
scalable softmax on its NoPE layers' queries (``compute_attention_scaling`` in
``transformers/models/beam/modeling_beam.py``)."""

from ..description import QueryScale
from ..family import PER_HEAD_QK_NORM, Family

FAMILIES = (Family(("beam",), qk_norm=PER_HEAD_QK_NORM, query_scale=QueryScale("beam", "position")),)
