"""T5 relative position bias (Raffel et al. 2020): a learned scalar per head and distance bucket."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..positions import t5_relative_bucket
from .base import SCORE_BIAS, LookupBias


class T5(LookupBias):
    """Adds b_h[bucket(j - i)] to the score of query i and key j (Raffel et al. 2020, sec. 2.1).

    Unidirectional buckets (a decoder; HF's ``bidirectional=not is_decoder``): distance
    d = i - j gets its own bucket below ``t5_num_buckets // 2``, log-spaced buckets up to
    ``t5_max_distance``, and the last bucket beyond (:func:`t5_relative_bucket`).

    Parameter: ``attn.W_rel_bias [t5_num_buckets, n_heads]`` (HF's ``relative_attention_bias``
    weight). T5 computes it in the first layer and shares it: with ``t5_shared`` the first ``t5``
    layer owns the one table and every other ``t5`` layer reads it (``blocks.{l}.attn`` then has
    no ``W_rel_bias`` of its own); without it (default) each ``t5`` layer has its own table. The
    content score keeps this decoder's
    1 / sqrt(d_head) (T5 folds that scale into its initialization). Hook: ``attn.hook_pos_bias``.

    Audit expectations: relative (a constant shift changes nothing); ``hook_pos_bias`` equals the
    table at bucket(j - i) and not at the mirrored bucket(i - j); finite, never a mask.
    """

    name = "t5"
    label = "T5"
    acts_on = frozenset({SCORE_BIAS})
    convention = (
        "bias b_h[bucket(j - i)], unidirectional: distance i - j, exact below num_buckets / 2, "
        "log-spaced up to max_distance, one bucket beyond"
    )
    config_fields = ("t5_num_buckets", "t5_max_distance", "t5_shared")
    bidirectional = False
    table_name, declared_offset, mirrored_offset = "b_h", "bucket(j - i)", "bucket(i - j)"
    ids_evidence_name = "buckets_used"

    @classmethod
    def validate_config(cls, cfg, used: bool) -> None:
        if not isinstance(cfg.t5_shared, bool):
            raise ValueError(f"t5_shared must be True or False, got {cfg.t5_shared!r}")
        for name in ("t5_num_buckets", "t5_max_distance"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if cfg.t5_num_buckets < 2 or cfg.t5_max_distance <= cfg.t5_num_buckets // 2:
            raise ValueError(
                f"t5_num_buckets={cfg.t5_num_buckets}, t5_max_distance={cfg.t5_max_distance}: need "
                "t5_num_buckets >= 2 (half of them exact) and t5_max_distance > t5_num_buckets // 2"
            )

    def describe(self, cfg) -> dict:
        return {
            "t5": {
                "num_buckets": cfg.t5_num_buckets,
                "max_distance": cfg.t5_max_distance,
                "bidirectional": self.bidirectional,
                "shared": cfg.t5_shared,
            }
        }

    def add_parameters(self, attn: nn.Module, cfg) -> None:
        attn.W_rel_bias = nn.Parameter(torch.empty(cfg.t5_num_buckets, cfg.n_heads))

    def share_parameters(self, decoder: nn.Module, cfg) -> None:
        """With ``t5_shared``: every ``t5`` layer after the first reads the first one's table."""
        if not cfg.t5_shared:
            return
        owner, *others = [block.attn for block in decoder.blocks if block.attn.position_method == self]
        for attn in others:
            del attn.W_rel_bias
            attn.__dict__["_t5_table_owner"] = owner  # a plain reference: the owner's state dict keeps the one table

    @staticmethod
    def table(attn: nn.Module) -> Tensor:
        """The ``[t5_num_buckets, n_heads]`` table a layer reads: its own, or the shared owner's."""
        return attn.__dict__.get("_t5_table_owner", attn).W_rel_bias

    def relative_ids(self, cfg, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """Bucket of each (i, j): bucket(j - i), int64 ``[batch, query_pos, key_pos]``."""
        offset = key_positions[:, None, :] - query_positions[:, :, None]  # j - i
        return t5_relative_bucket(offset, self.bidirectional, cfg.t5_num_buckets, cfg.t5_max_distance)

    def reference_bias(self, attn: nn.Module, q: Tensor, ids: Tensor) -> Tensor:
        """b_h at table rows ``ids [batch, query_pos, key_pos]``: ``[batch, head_index, query_pos, key_pos]``."""
        return self.table(attn).to(q.dtype)[ids].permute(0, 3, 1, 2)

    def score_bias(self, attn: nn.Module, q: Tensor, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        return self.reference_bias(attn, q, self.relative_ids(attn.cfg, query_positions, key_positions))

    def lookup_formula(self, cfg) -> str:
        return (
            f"b_h[bucket(j - i)], {cfg.t5_num_buckets} buckets (exact below {cfg.t5_num_buckets // 2}), "
            f"max_distance {cfg.t5_max_distance}, unidirectional"
            f"{', one table shared by every layer' if cfg.t5_shared else ''}"
        )
