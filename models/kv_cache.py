"""The key/value cache of incremental decoding (:meth:`nopelens.models.Decoder.forward` with
``past_kv``; :func:`nopelens.models.generation.generate` with ``use_past_kv_cache``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from .config import DecoderConfig


@dataclass
class KVCache:
    """Keys (before rotation), values, positions and padding of the tokens decoded so far.

    Keys are cached *unrotated*, so each step rotates every key at its true position id. The
    ``Decoder`` appends to the cache only after a forward pass succeeds, so a failed step leaves
    it as it was.

    Attributes:
        keys: per layer ``[batch, pos, head_index, d_head]`` or None before the first step.
        values: per layer ``[batch, pos, head_index, d_head]`` or None.
        position_ids: int64 ``[batch, pos]`` position ids of the cached tokens.
        attention_mask: int64 ``[batch, pos]``, 1 for real tokens.
    """

    keys: list[Tensor | None]
    values: list[Tensor | None]
    position_ids: Tensor
    attention_mask: Tensor

    @classmethod
    def empty(cls, cfg: DecoderConfig, batch: int, device: torch.device | str | None = None) -> "KVCache":
        """A cache with no tokens for a model of config ``cfg``."""
        none = [None] * cfg.n_layers
        blank = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return cls(list(none), list(none), blank, blank.clone())

    @property
    def length(self) -> int:
        """Number of cached positions (padding included)."""
        return self.position_ids.shape[1]

    @property
    def next_position(self) -> Int[Tensor, " batch"]:
        """Position id of the next real token of each row: the number of real tokens so far."""
        return self.attention_mask.sum(-1)
