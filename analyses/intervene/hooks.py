"""The hooks of the interventions: a sink ablation's (per batch), an index direction's, a patch's.

Each is a TransformerLens hook ``fn(activation, hook)`` added for the passes of one measurement by
:func:`intervention`; hooks that index rows are made per batch (:func:`sink_batch_hooks`) and
refuse a batch of another size.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from jaxtyping import Float
from torch import Tensor

from nopelens.models.hooks import act_name
from nopelens.probes import HookList, hooks_added

SINK_MODES = ("remove_key", "mean_value")
"""How a sink ablation takes the first token out of a block's attention (see :mod:`nopelens.analyses.intervene`)."""


class NotApplicable(ValueError):
    """An intervention that cannot be measured right on this model; the message says why."""


@contextmanager
def intervention(model, hooks: HookList) -> Iterator[None]:
    """Add ``hooks`` (``[(hook name, fn(activation, hook))]``) for the passes inside the block.

    The hooks are removed when the block exits, also when a forward pass inside it raises
    (TransformerLens' ``model.hooks`` context manager; hooks the caller added before are kept).

    Raises:
        KeyError: if a hook name does not exist on the model, naming it.
    """
    with hooks_added(model, hooks):
        yield


def first_real_index(attention_mask: Tensor) -> Tensor:
    """Index of the first real token of each row ``[batch]`` (0 unless the row is left-padded)."""
    return attention_mask.long().argmax(-1)


def _check_rows(first: Tensor, n_rows: int, site: str) -> None:
    if first.shape[0] != n_rows:
        raise ValueError(
            f"a sink hook at {site} was made for {first.shape[0]} rows but sees a batch of {n_rows}: "
            "make the hooks per batch (sink_batch_hooks), so each batch gets its own rows' first indices"
        )


def remove_first_key_hook(first: Tensor) -> Callable:
    """A ``hook_attn_scores`` hook that blocks key ``first[b]`` for every query after it.

    Args:
        first: int64 ``[batch]``, the first real index of each row of the batch the hook will see.

    Returns:
        ``fn(scores [batch, head_index, query_pos, key_pos], hook)`` returning the scores with -inf
        at (query > first, key = first); the softmax then renormalizes over the other keys.
        Raises ValueError when handed a batch of another size than ``first`` (a hook made for
        other rows would block the wrong key of a left-padded row).
    """

    def hook(scores: Tensor, hook) -> Tensor:
        _check_rows(first, scores.shape[0], "hook_attn_scores")
        n_query, n_key = scores.shape[-2:]
        offset = n_key - n_query  # keys before the queries (a cache); 0 in a full pass
        key = torch.arange(n_key, device=scores.device)
        query = torch.arange(n_query, device=scores.device) + offset
        f = first.to(scores.device)[:, None, None]
        blocked = (key[None, None, :] == f) & (query[None, :, None] > f)
        return scores.masked_fill(blocked[:, None], float("-inf"))

    return hook


def replace_first_value_hook(first: Tensor, mean_value: Tensor) -> Callable:
    """A ``hook_v`` hook that sets the first real token's value to ``mean_value``.

    Args:
        first: int64 ``[batch]``, first real index per row of the batch the hook will see (a
            batch of another size raises ValueError).
        mean_value: ``[head_index, d_head]`` (the mean value of the other real tokens).
    """

    def hook(v: Tensor, hook) -> Tensor:
        _check_rows(first, v.shape[0], "hook_v")
        v = v.clone()
        rows = torch.arange(v.shape[0], device=v.device)
        v[rows, first.to(v.device)] = mean_value.to(v.device, v.dtype)
        return v

    return hook


def shift_hook(direction: Tensor, amount: float) -> Callable:
    """A residual hook adding ``amount * direction`` to every token's state."""

    def hook(resid: Tensor, hook) -> Tensor:
        return resid + amount * direction.to(resid.device, resid.dtype)

    return hook


def project_out_hook(direction: Tensor, center: Tensor) -> Callable:
    """A residual hook removing each state's component along ``direction`` about ``center``."""
    unit = direction / direction.norm()

    def hook(resid: Tensor, hook) -> Tensor:
        u, c = unit.to(resid.device, resid.dtype), center.to(resid.device, resid.dtype)
        return resid - ((resid - c) @ u)[..., None] * u

    return hook


def sink_hooks(block: int, mode: str, first: Tensor, mean_value: Tensor | None = None) -> HookList:
    """The hooks of one sink ablation of ``block`` (``remove_key`` or ``mean_value``) for one batch
    whose rows have first real indices ``first`` (int64 ``[batch]``); for a batched pass use
    :func:`sink_batch_hooks`.

    Raises:
        ValueError: on an unknown mode, or ``mean_value`` without its mean value.
    """
    if mode == "remove_key":
        return [(act_name("attn_scores", block), remove_first_key_hook(first))]
    if mode == "mean_value":
        if mean_value is None:
            raise ValueError("mode 'mean_value' needs the mean value of the block")
        return [(act_name("v", block), replace_first_value_hook(first, mean_value))]
    raise ValueError(f"sink ablation mode must be one of {SINK_MODES}, got {mode!r}")


@dataclass(frozen=True)
class SinkBatchHooks:
    """One sink ablation of ``block`` as hooks made per batch (a
    :data:`~nopelens.probes.collect.BatchHooks`; build with :func:`sink_batch_hooks`). A dataclass,
    so it pickles and can be sent to shards (:func:`nopelens.probes.stream.run` with ``executor``)."""

    block: int
    mode: str
    mean_value: Tensor | None = None

    def __call__(self, rows: slice, attention_mask: Tensor) -> HookList:
        return sink_hooks(self.block, self.mode, first_real_index(attention_mask), self.mean_value)


def sink_batch_hooks(block: int, mode: str, mean_value: Tensor | None = None) -> SinkBatchHooks:
    """One sink ablation of ``block`` as hooks made per batch: each batch gets :func:`sink_hooks`
    with its own rows' first real indices (:func:`first_real_index` of its mask), so a left-padded
    row has its own first key removed however the sequences are batched.

    Raises:
        ValueError: as :func:`sink_hooks`, at once.
    """
    sink_hooks(block, mode, torch.zeros(1, dtype=torch.long), mean_value)  # check mode and mean value now
    return SinkBatchHooks(block, mode, mean_value)


def patch_position_hook(position: int, replacement: Float[Tensor, "batch d_model"]) -> Callable:
    """A residual hook that puts ``replacement[b]`` at ``position`` of row b of the batch it sees
    (a batch of another size than ``replacement`` raises ValueError: make it per batch)."""

    def hook(resid: Tensor, hook) -> Tensor:
        if resid.shape[0] != replacement.shape[0]:
            raise ValueError(f"a patch made for {replacement.shape[0]} rows sees a batch of {resid.shape[0]}")
        resid = resid.clone()
        resid[:, position] = replacement.to(resid.device, resid.dtype)
        return resid

    return hook
