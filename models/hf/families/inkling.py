"""Inkling 2: NoPE attention with a learned bias by token-index distance, a per-token sink, a log
query scale on its full layers and ``sliding_window_size`` windows on its ``hybrid_sliding`` ones
(``transformers/models/inkling2/modeling_inkling2.py``). Inkling 2 Loop runs its loop layers several
times per forward pass (``inkling2_loop/modeling_inkling2_loop.py``): unreadable."""

from __future__ import annotations

from typing import Any

from ..config import at_least_one
from ..description import QueryScale
from ..family import Family, layer_type


def _sliding(config: Any, layer: int) -> bool:
    return layer_type(config, layer) == "hybrid_sliding"


def _window(config: Any, layer: int) -> tuple[int | None, None]:
    """``Inkling2SlidingAttention``: ``sliding_window_size`` keys on ``hybrid_sliding`` layers."""
    return (at_least_one(config, "sliding_window_size") if _sliding(config, layer) else None), None


def _relative_bias(config: Any, layer: int) -> int:
    """``Inkling2RelativePositionBias``: a bias by distance i - j for 0 <= i - j < rel_extent, zero
    beyond (sliding layers use the window as extent), counted in token indices
    (``get_relative_distance``), not position ids."""
    return int(config.sliding_window_size if _sliding(config, layer) else config.rel_extent)


def _query_scale(config: Any, layer: int) -> QueryScale | None:
    """``Inkling2LogScale`` on ``Inkling2FullAttention`` layers."""
    if _sliding(config, layer):
        return None
    return QueryScale("inkling2", "position", float(config.log_scaling_n_floor), float(config.log_scaling_alpha))


NOTE = (
    "Inkling 2 adds a learned bias by token-index distance i - j < rel_extent (none beyond) and a "
    "short convolution over neighbouring tokens' keys and values; neither reads position ids, so "
    "the per-layer detector cannot see them: the audit's step 5 reads the bias from hook_pos_bias, "
    "and no step verifies the convolution"
)

FAMILIES = (
    # sinks = sink_proj(hidden_states): one logit per token
    Family(
        ("inkling2_text",),
        method="nope",
        sink="per_token",
        window=_window,
        relative_bias=_relative_bias,
        query_scale=_query_scale,
        notes=lambda config: (NOTE,),
        position_bias_module="relative_position_bias",
    ),
    Family(
        ("inkling2_loop_text",),
        unreadable=(
            "Inkling 2 Loop runs its loop layers (loop_layer_index_start to loop_layer_index_end - 1) "
            "loop_num_passes times in one forward pass, the later passes mixing in messages from the "
            "one before, so one layer module is several steps of the computation and its hooks cannot "
            "tell the passes apart"
        ),
    ),
)
