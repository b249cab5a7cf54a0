"""Causal, window, chunk and padding masks, and the masked softmax that refuses a query row with no
visible key. The one place that says which key a query may read.

Seed ``000_268c7b6ce21be6d1.txt``: key j is visible to query i exactly when j <= i; blocking adds
-inf before the softmax, so a blocked key gets exactly zero weight and leaves the denominator.

Sliding windows and chunked attention are further restrictions of the causal rule
(:class:`KeyWindow`), counted in positions (tokens from the first real one), as transformers 5.24
builds them (``transformers/masking_utils.py``): a sliding window of w keeps key j for query i when
i - j < w (``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``, so w keys including
the query's own); a chunk of c keeps it when i // c == j // c, with indices counted after the left
padding (``chunked_overlay``). Under left padding, index differences equal position differences,
so both rules are the same in indices and in positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


@dataclass(frozen=True)
class KeyWindow:
    """The keys a query may read besides the causal rule: a sliding window, a chunk, or neither.

    Attributes:
        window: key j is visible to query i only when i - j < window (w keys, the query's own
            included; HF ``sliding_window``), or None.
        chunk: key j is visible to query i only when i // chunk == j // chunk (HF
            ``attention_chunk_size``, Llama 4), or None.

    Raises:
        ValueError: if ``window`` or ``chunk`` is not an integer >= 1.

    Example:
        >>> KeyWindow(window=2).visible(4).int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
        >>> KeyWindow(chunk=2).sees_first(4).tolist(), KeyWindow(window=3).n_visible(5).tolist()
        ([True, True, False, False], [1, 2, 3, 3, 3])
    """

    window: int | None = None
    chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")

    @property
    def causal_only(self) -> bool:
        """Neither a window nor a chunk: the plain causal rule."""
        return self.window is None and self.chunk is None

    @property
    def only_self(self) -> bool:
        """Every query sees only its own key (a window or chunk of 1): its softmax is 1 whatever the score."""
        return self.window == 1 or self.chunk == 1

    def allows(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """True where key position ``key_pos`` is visible to query position ``query_pos`` (broadcast),
        causal rule included."""
        allowed = key_pos <= query_pos
        if self.window is not None:
            allowed = allowed & (query_pos - key_pos < self.window)
        if self.chunk is not None:
            allowed = allowed & (
                torch.div(query_pos, self.chunk, rounding_mode="floor")
                == torch.div(key_pos, self.chunk, rounding_mode="floor")
            )
        return allowed

    def visible(self, n: int, device: torch.device | str | None = None) -> Bool[Tensor, "query_pos key_pos"]:
        """``[n, n]``: key j visible to query i, for n tokens at positions 0..n-1."""
        pos = torch.arange(n, device=device)
        return self.allows(pos[:, None], pos[None, :])

    def sees_first(self, n: int) -> Bool[Tensor, " query_pos"]:
        """``[n]``: which of n queries can see the first token (the sink candidate); O(n) memory."""
        pos = torch.arange(n)
        return self.allows(pos, torch.zeros_like(pos))

    def n_visible(self, n: int) -> Int[Tensor, " query_pos"]:
        """``[n]``: the number of keys each of n queries sees (i + 1 without a window or chunk); O(n)
        memory: query i sees exactly the keys from ``first`` to i, ``first`` the latest of 0, the
        window's start i - w + 1 and the chunk's start (i // c) c."""
        pos = torch.arange(n)
        first = torch.zeros_like(pos)
        if self.window is not None:
            first = torch.maximum(first, pos - self.window + 1)
        if self.chunk is not None:
            first = torch.maximum(first, torch.div(pos, self.chunk, rounding_mode="floor") * self.chunk)
        return pos - first + 1

    def bites(self, n: int) -> bool:
        """Whether the window or chunk blocks some causal pair among n tokens."""
        return (self.window is not None and n > self.window) or (self.chunk is not None and n > self.chunk)

    def describe(self) -> str:
        """E.g. ``causal``, ``sliding window 4``, ``chunks of 8``."""
        parts = ([f"sliding window {self.window}"] if self.window is not None else []) + (
            [f"chunks of {self.chunk}"] if self.chunk is not None else []
        )
        return ", ".join(parts) or "causal"


CAUSAL = KeyWindow()


def causal_mask(
    query_len: int, key_len: int, device: torch.device | str | None = None, keys: KeyWindow = CAUSAL
) -> Bool[Tensor, "query_pos key_pos"]:
    """Boolean causal visibility, True where key j is visible to query i.

    The queries are the last ``query_len`` of ``key_len`` positions (a KV cache holds the first
    ``key_len - query_len``), so query row q sits at index ``q + key_len - query_len``.

    Args:
        query_len: number of query rows, >= 1.
        key_len: number of key columns, >= query_len.
        device: where to build the mask.
        keys: a sliding window or chunk on top of the causal rule (positions = indices here).

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
    return keys.allows(i, j)


def visibility(
    key_mask: Int[Tensor, "batch key_pos"] | None,
    query_len: int,
    key_len: int,
    device: torch.device | str | None = None,
    keys: KeyWindow = CAUSAL,
) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
    """Causal mask combined with a key padding mask; True where query i may read key j.

    A padded *query* row keeps its causal prefix (including padded keys), so it stays finite; real
    query rows never see a padded key. Padded rows are never probe samples or sink rows. A window
    or chunk (``keys``) is counted in positions from the first real token of each row, as
    transformers counts it (module docstring).

    Args:
        key_mask: 1 for real tokens, 0 for padding, over all key positions (cache included), or
            None for no padding.
        query_len: number of query rows (the last ``query_len`` keys are the queries themselves).
        key_len: number of keys.
        device: where to build the mask.
        keys: a sliding window or chunk on top of the causal rule.

    Example:
        >>> visibility(torch.tensor([[0, 1, 1, 1]]), 4, 4, keys=KeyWindow(chunk=2))[0, 0].int().tolist()
        [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]

    Returns:
        Bool ``[batch, 1, query_pos, key_pos]`` (batch 1 when ``key_mask`` is None).

    Raises:
        ValueError: if a row of ``key_mask`` has no real token (fully masked input).
    """
    if key_mask is None:
        return causal_mask(query_len, key_len, device, keys)[None, None]
    allowed = causal_mask(query_len, key_len, device)[None, None]
    key_mask = key_mask.bool()
    empty = ~key_mask.any(-1)
    if empty.any():
        row = int(empty.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} masks every position: a fully masked sequence has no visible key for any query"
        )
    query_is_real = key_mask[:, key_len - query_len :]
    readable = key_mask[:, None, :] | ~query_is_real[:, :, None]
    allowed = allowed & readable[:, None]
    if not keys.causal_only:
        key_pos = (key_mask.long().cumsum(-1) - 1).clamp(min=0).to(allowed.device)
        query_pos = key_pos[:, key_len - query_len :]
        allowed = allowed & keys.allows(query_pos[:, None, :, None], key_pos[:, None, None, :])
    return allowed


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
