"""Causal and padding masks, and the masked softmax that refuses a query row with no visible key.

Seed ``000_268c7b6ce21be6d1.txt``: key j is visible to query i exactly when j <= i; blocking adds
-inf before the softmax, so a blocked key gets exactly zero weight and leaves the denominator.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


def causal_mask(
    query_len: int, key_len: int, device: torch.device | str | None = None
) -> Bool[Tensor, "query_pos key_pos"]:
    """Boolean causal visibility, True where key j is visible to query i.

    The queries are the last ``query_len`` of ``key_len`` positions (a KV cache holds the first
    ``key_len - query_len``), so query row q sits at index ``q + key_len - query_len``.

    Args:
        query_len: number of query rows, >= 1.
        key_len: number of key columns, >= query_len.
        device: where to build the mask.

    Returns:
        Bool ``[query_pos, key_pos]``.

    Raises:
        ValueError: if ``key_len < query_len`` or ``query_len < 1``.

    Example:
        >>> causal_mask(3, 3).int().tolist()  # seed 000, FIG-004
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    if query_len < 1 or key_len < query_len:
        raise ValueError(f"need 1 <= query_len <= key_len, got {query_len} and {key_len}")
    offset = key_len - query_len
    i = torch.arange(query_len, device=device)[:, None] + offset
    j = torch.arange(key_len, device=device)[None, :]
    return j <= i


def visibility(
    key_mask: Int[Tensor, "batch key_pos"] | None,
    query_len: int,
    key_len: int,
    device: torch.device | str | None = None,
) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
    """Causal mask combined with a key padding mask; True where query i may read key j.

    A padded *query* row keeps its causal prefix (including padded keys), so it stays finite; real
    query rows never see a padded key. Padded rows are never probe samples or sink rows.

    Args:
        key_mask: 1 for real tokens, 0 for padding, over all key positions (cache included), or
            None for no padding.
        query_len: number of query rows (the last ``query_len`` keys are the queries themselves).
        key_len: number of keys.
        device: where to build the mask.

    Returns:
        Bool ``[batch, 1, query_pos, key_pos]`` (batch 1 when ``key_mask`` is None).

    Raises:
        ValueError: if a row of ``key_mask`` has no real token (fully masked input).
    """
    allowed = causal_mask(query_len, key_len, device)[None, None]
    if key_mask is None:
        return allowed
    key_mask = key_mask.bool()
    empty = ~key_mask.any(-1)
    if empty.any():
        row = int(empty.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} masks every position: a fully masked sequence has no "
            "visible key for any query"
        )
    query_is_real = key_mask[:, key_len - query_len :]
    readable = key_mask[:, None, :] | ~query_is_real[:, :, None]
    return allowed & readable[:, None]


def masked_softmax(
    scores: Float[Tensor, "batch head_index query_pos key_pos"],
    allowed: Bool[Tensor, "batch head_index query_pos key_pos"],
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """Softmax over keys after adding -inf to blocked entries (seed 000's A = softmax(S + M)).

    Blocked entries come out exactly 0 and leave the denominator; allowed entries renormalize over
    the allowed keys only. ``allowed`` broadcasts against ``scores``.

    Args:
        scores: pre-softmax scores.
        allowed: True where the key is visible.

    Returns:
        Attention weights, each row summing to 1 over its allowed keys.

    Raises:
        ValueError: naming the batch row and query position of the first row with no allowed key;
            such a row has no distribution to normalize, and is never turned into NaN, uniform or
            zero attention.

    Example:
        >>> s = torch.zeros(1, 1, 2, 2)
        >>> masked_softmax(s, causal_mask(2, 2)[None, None]).tolist()
        [[[[1.0, 0.0], [0.5, 0.5]]]]
    """
    check_rows_have_a_key(allowed)
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def check_rows_have_a_key(allowed: Bool[Tensor, "... query_pos key_pos"]) -> None:
    """Raise ``ValueError`` naming the first (batch row, query position) with no visible key."""
    empty = ~allowed.any(dim=-1)
    if empty.any():
        where = empty.nonzero()[0].tolist()
        batch, query = where[0], where[-1]
        raise ValueError(
            f"query position {query} of batch row {batch} has no visible key: every key is "
            "masked, so there is no distribution to normalize"
        )
