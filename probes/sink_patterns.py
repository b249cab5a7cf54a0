"""What an attention sink is, and its reads on one pattern array per sequence (numpy).

Patterns come from :func:`~nopelens.probes.collect` at ``blocks.{l}.attn.hook_pattern`` sites:
one ``[head_index, n_real, n_real]`` array per sequence with padded rows and columns removed, so
key 0 is the first non-pad token (the sink candidate, usually BOS) and row ``i`` is the query at
position ``i``. Padded positions are therefore never rows of a sink statistic. A padded batch
``[batch, head_index, query_pos, key_pos]`` with its mask goes through :func:`strip_padding` first.

- Sink mass (:func:`sink_mass`): the mean attention on the first non-pad key over the query rows
  that can see it, excluding the sink's own row (whose mass is 1 under a causal mask whatever the
  model does). Uniform causal attention over T = 4 gives per-query masses [1, 1/2, 1/3, 1/4]:
  mean 0.361111 without row 0, 0.520833 with it.
- Sink score and rate in the sense of Gu et al. 2025 ("When attention sink emerges in language
  models: an empirical view", §3): over the first T = 64 tokens, the mean attention token 0
  receives from the queries that see it (all of them, row 0 included); a head is a sink when
  the score is > eps = 0.3 (strict); the rate is the fraction of (layer, head) pairs that are
  sinks. Uniform attention gives H_64 / 64 = 0.0741 (:func:`uniform_sink_score`), rate 0.
- Sliding windows and chunks (:class:`~nopelens.models.masks.KeyWindow`, passed per block as
  ``windows``): a query outside the first token's window or chunk cannot see it, so its zero mass
  says nothing about the head; both the sink mass and Gu's score average only the queries that can
  see token 0 (a sliding window of w: queries 0..w-1). Averaging all queries instead would shrink
  a sliding layer's mass by about T / w and no sliding layer could ever be a sink.

:func:`~nopelens.probes.sinks.sink_table`, :func:`sink_mass` and :func:`sink_scores` sum one read,
:func:`first_key_sums`, in float64. Every name here is re-exported by :mod:`nopelens.probes.sinks`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from jaxtyping import Float, Int
from scipy import stats

from nopelens.models.masks import CAUSAL, KeyWindow

from .collect import Activations, row_sum_tolerance
from .metrics import random_state

GU_EPSILON = 0.3

GU_WINDOW = 64


def uniform_sink_score(n_tokens: int = GU_WINDOW) -> float:
    """Gu et al.'s sink score of uniform causal attention over T tokens: H_T / T.

    Query i gives 1 / (i + 1) to token 0, so the mean over the T queries is (1/T) sum_{i=1}^T 1/i.

    Example:
        >>> round(uniform_sink_score(64), 4)
        0.0741
        >>> uniform_sink_score(4)
        0.5208333333333333
    """
    if not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an integer >= 1, got {n_tokens!r}")
    return float(np.sum(1.0 / np.arange(1, n_tokens + 1)) / n_tokens)


def check_gu_window(n_tokens: int, lengths: Sequence[int] = ()) -> None:
    """Raise ValueError unless Gu's window T is an integer >= 1 and every sequence length is >= T."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens (Gu's window T) must be an integer >= 1, got {n_tokens!r}")
    short = np.flatnonzero(np.asarray(lengths) < n_tokens)
    if len(short):
        raise ValueError(f"sequences {short[:10].tolist()} have fewer than T={n_tokens} real tokens")


def gu_chance(n_tokens: int = GU_WINDOW, keys: KeyWindow = CAUSAL) -> float:
    """The Gu score of uniform attention over the queries it averages: the chance level of a sink flag.

    Gu et al.'s score averages, over the first T queries that can see token 0, the attention they
    give it; a head with no preference (uniform over its visible keys) gives query i 1 / (its
    visible keys). Under the causal rule that is H_T / T (:func:`uniform_sink_score`, 0.074 at
    T = 64); under a sliding window or chunk of w < T only queries 0..w-1 see token 0, where
    uniform attention alone gives H_w / w (0.52 at w = 4), so the threshold there can flag a head
    that prefers nothing.

    Raises:
        ValueError: if ``n_tokens`` is not an integer >= 1.

    Example:
        >>> round(gu_chance(64), 4), round(gu_chance(64, KeyWindow(window=4)), 4)
        (0.0741, 0.5208)
    """
    check_gu_window(n_tokens)
    sees, visible = keys.sees_first(n_tokens), keys.n_visible(n_tokens)
    return float((1.0 / visible[sees].double()).mean())


def sink_read_reason(keys: KeyWindow, n_tokens: int) -> str | None:
    """Why no sink mass can be read under ``keys`` over ``n_tokens`` positions, or None when it can.

    The sink mass averages the queries other than token 0 that see token 0; under a sliding window
    or chunk of 1 every query sees only itself, so there is none (and Gu's score is 1 by
    construction).

    Example:
        >>> sink_read_reason(KeyWindow(window=2), 8) is None
        True
        >>> sink_read_reason(KeyWindow(window=1), 8)
        'sliding window 1: no query but token 0 itself sees token 0, so no sink can be read'
    """
    if bool(keys.sees_first(n_tokens)[1:].any()):
        return None
    return f"{keys.describe()}: no query but token 0 itself sees token 0, so no sink can be read"


def sink_index(attention_mask: Int[torch.Tensor, "batch pos"] | np.ndarray) -> np.ndarray:
    """Index of the first non-pad token of each row (the sink candidate).

    Raises:
        ValueError: if the mask is not 2-D 0/1 or a row has no real token.

    Example:
        >>> sink_index(np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])).tolist()
        [2, 0]
    """
    mask = np.asarray(attention_mask)
    if mask.ndim != 2 or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"attention_mask must be a 2-D array of 0/1, got shape {mask.shape}")
    empty = np.flatnonzero(mask.sum(1) == 0)
    if len(empty):
        raise ValueError(f"rows {empty.tolist()} of attention_mask have no real token")
    return mask.argmax(1)


def strip_padding(
    pattern: Float[torch.Tensor, "batch head_index query_pos key_pos"] | np.ndarray,
    attention_mask: Int[torch.Tensor, "batch pos"] | np.ndarray | None = None,
) -> list[np.ndarray]:
    """A padded pattern batch -> one ``[head_index, n_real, n_real]`` array per sequence.

    Raises:
        ValueError: on a shape that is not ``[batch, head, pos, pos]`` matching the mask, or
            non-finite entries.
    """
    pattern = pattern.detach().cpu().numpy() if isinstance(pattern, torch.Tensor) else np.asarray(pattern)
    if pattern.ndim != 4 or pattern.shape[2] != pattern.shape[3]:
        raise ValueError(f"pattern must be [batch, head_index, query_pos, key_pos], got {pattern.shape}")
    if attention_mask is None:
        attention_mask = np.ones((pattern.shape[0], pattern.shape[2]), dtype=np.int64)
    mask = np.asarray(attention_mask)
    sink_index(mask)
    if mask.shape != (pattern.shape[0], pattern.shape[2]):
        raise ValueError(f"attention_mask shape {mask.shape} does not match pattern {pattern.shape}")
    if not np.all(np.isfinite(pattern)):
        raise ValueError("pattern contains NaN or Inf")
    return [p[:, m.astype(bool)][:, :, m.astype(bool)] for p, m in zip(pattern, mask)]


def first_key_sums(
    pattern: Float[torch.Tensor, "batch head query key"],
    mask: Int[torch.Tensor, "batch pos"],
    keys: KeyWindow = CAUSAL,
    start: int = 1,
    stop: int | None = None,
    underflow_ok: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one definition of a sink read: attention on the first real key summed over the rows that see it.

    Rows: the real queries at positions ``start``..``stop`` - 1 (real tokens counted from 0) that see
    the first real key under ``keys`` (sink mass: ``start`` 1; Gu et al.'s score: 0, ``stop`` T). Summed by
    :class:`~nopelens.probes.sinks.SinkStats` per batch and by the pattern-list reads per sequence.

    Args:
        pattern: ``hook_pattern`` of a padded batch; mask: ``[batch, pos]``, 1 for real tokens (left
            padding is skipped as :func:`sink_index` does); keys: the layer's window or chunk.
        underflow_ok: ``keys`` is the mask the model declares, so an exact zero on a visible first key
            is a weight below the dtype's smallest number (a softmax underflows past a score gap of about
            100 in float32: a sharp head, or ALiBi far from the key) and is summed as 0; False (the
            mask is unknown): such a row is refused.

    Returns:
        ``[head, query]`` float64 sums over the batch per query column (the position when nothing is
        left-padded) and ``[query]`` the number of rows summed.

    Raises:
        ValueError: as :func:`sink_index` (a row with no real token), or, unless ``underflow_ok``, when a
            row that ``keys`` says sees the first key gives it exactly zero weight: with the mask unknown
            that may be a key blocked by a mask ``keys`` does not describe, so it is not averaged in.

    Example:
        >>> uniform = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5)[:, None]
        >>> sums, rows = first_key_sums(uniform[None, None], torch.ones(1, 4))
        >>> round(float(sums.sum() / rows.sum()), 6), rows.tolist()
        (0.361111, [0, 1, 1, 1])
    """
    device = pattern.device
    real = mask.bool().to(device)
    position = (real.long().cumsum(-1) - 1).clamp(min=0)
    stop = mask.shape[1] if stop is None else stop
    rows = keys.sees_first(mask.shape[1]).to(device)[position] & real & (position >= start) & (position < stop)
    first = torch.as_tensor(sink_index(mask.cpu().numpy()), device=device)
    first_key = pattern[torch.arange(len(mask), device=device), :, :, first]  # [batch, head, query]
    blind = (first_key == 0) & rows[:, None]
    if not underflow_ok and bool(blind.any()):
        row, _, query = blind.nonzero()[0].tolist()
        raise ValueError(
            f"query position {int(position[row, query])} gives the first key exactly zero weight, though "
            f"{keys.describe()} lets it see it: the pattern was computed under a mask the read does not know "
            "(a sliding window or chunk?); collect it from a model that records its mask, or pass windows="
        )
    return (first_key.to(torch.float64) * rows[:, None]).sum(0), rows.sum(0)


def sink_mass_by_query(patterns: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Attention each query row puts on key 0 (the first non-pad token): ``[head, n_real]`` per sequence.

    Example:
        >>> uniform = np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None]
        >>> np.round(sink_mass_by_query([uniform[None]])[0][0], 6).tolist()
        [1.0, 0.5, 0.333333, 0.25]
    """
    return [_check_pattern(p, k)[:, :, 0] for k, p in enumerate(patterns)]


def _pooled(
    patterns: Sequence[np.ndarray], keys: KeyWindow, start: int = 0, stop: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`first_key_sums` of each sequence, pooled per position: ``[head, longest]`` sums, ``[longest]`` rows."""
    patterns = [torch.as_tensor(np.ascontiguousarray(_check_pattern(p, k)))[None] for k, p in enumerate(patterns)]
    longest = max((p.shape[-1] for p in patterns), default=0)
    total, count = np.zeros((1, longest)), np.zeros(longest, dtype=np.int64)
    for pattern in patterns:
        sums, rows = first_key_sums(pattern, torch.ones(1, pattern.shape[-1]), keys, start, stop)
        pad = (0, longest - len(rows))
        total, count = total + np.pad(sums.numpy(), ((0, 0), pad)), count + np.pad(rows.numpy(), pad)
    return total, count


def sink_mass(patterns: Sequence[np.ndarray], include_sink_row: bool = False, keys: KeyWindow = CAUSAL) -> np.ndarray:
    """Mean attention on the first non-pad key over the query rows that see it, per head.

    The mean pools all (sequence, query) rows that can see key 0 (all of them under the causal
    rule; under a sliding window of w only queries 0..w-1); the sink's own row (always 1 under a
    causal mask) is excluded unless ``include_sink_row``. Sums of :func:`first_key_sums`.

    Args:
        patterns: per sequence ``[head_index, n_real, n_real]`` (padding removed).
        include_sink_row: count row 0 too.
        keys: the layer's sliding window or chunk.

    Returns:
        ``[head_index]`` float64 mean masses in [0, 1].

    Raises:
        ValueError: if no row is left (every sequence has one token and the sink row is
            excluded), or patterns are malformed.

    Example:
        >>> uniform = (np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None])[None]
        >>> round(float(sink_mass([uniform])[0]), 6), round(float(sink_mass([uniform], True)[0]), 6)
        (0.361111, 0.520833)
        >>> windowed = KeyWindow(window=2).visible(4).double().numpy()
        >>> windowed = (windowed / windowed.sum(1, keepdims=True))[None]  # uniform over each window
        >>> float(sink_mass([windowed], keys=KeyWindow(window=2))[0])  # query 1 only: 1/2
        0.5
    """
    total, count = _pooled(patterns, keys, start=0 if include_sink_row else 1)
    if count.sum() == 0:
        raise ValueError(no_sink_row_reason(keys, len(count)))
    return total.sum(1) / count.sum()


def no_sink_row_reason(keys: KeyWindow, n_tokens: int) -> str:
    window_blind = sink_read_reason(keys, n_tokens) if n_tokens > 1 else None
    return window_blind or "no query row can see a sink other than itself (all sequences have one token)"


def sink_mass_by_position(patterns: Sequence[np.ndarray], keys: KeyWindow = CAUSAL) -> tuple[np.ndarray, np.ndarray]:
    """Mean attention on key 0 as a function of query position, per head.

    Returns:
        (``[head_index, max_len]`` mean mass at each query position over the sequences that
        have it, ``[max_len]`` number of those sequences). Positions that cannot see key 0
        (outside its window or chunk) have no sequence: count 0, mass NaN.
    """
    if not patterns:
        raise ValueError("no patterns given")
    total, count = _pooled(patterns, keys)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan), count


def sink_scores(patterns: Sequence[np.ndarray], n_tokens: int = GU_WINDOW, keys: KeyWindow = CAUSAL) -> np.ndarray:
    """Gu et al. 2025 sink score per head: mean attention on token 0 over queries 0..T-1 that see it.

    Every sequence contributes its first T tokens (its first T rows and columns); row 0 counts.
    Under a sliding window or chunk, only the queries that can see token 0 count (module docstring).

    Args:
        patterns: per sequence ``[head_index, n_real, n_real]``.
        n_tokens: T, 64 in Gu et al.
        keys: the layer's sliding window or chunk.

    Returns:
        ``[head_index]`` float64 scores in [0, 1].

    Raises:
        ValueError: if T is not an integer >= 1, or a sequence has fewer than T real tokens.
    """
    check_gu_window(n_tokens, [p.shape[-1] for p in patterns])
    if not patterns:
        raise ValueError("no patterns given")
    total, count = _pooled([np.asarray(p)[:, :n_tokens, :n_tokens] for p in patterns], keys, stop=n_tokens)
    return total.sum(1) / count.sum()


def _check_pattern(pattern: np.ndarray, index: int) -> np.ndarray:
    pattern = np.asarray(pattern)
    if pattern.ndim != 3 or pattern.shape[1] != pattern.shape[2] or pattern.shape[1] == 0:
        raise ValueError(f"pattern {index} must be [head_index, n, n] with n >= 1, got {pattern.shape}")
    if not np.all(np.isfinite(pattern)):
        raise ValueError(f"pattern {index} contains NaN or Inf")
    # collect() checked each row against its dtype's round-off; a list made by hand is held to
    # bfloat16's (row sums below 1 pass: a learned sink's rows sum to 1 - p_sink)
    sums = pattern.sum(-1, dtype=np.float64)
    if pattern.min() < 0 or sums.max() > 1 + row_sum_tolerance(torch.bfloat16):
        what = "has negative weights" if pattern.min() < 0 else f"has rows that sum to up to {sums.max():.4g}, not 1"
        raise ValueError(f"pattern {index} {what}: its attention is not a softmax distribution over the keys")
    return pattern


def sink_rate_ci(
    acts: Activations, eps: float = GU_EPSILON, n_tokens: int = GU_WINDOW, n_boot: int = 200, seed: int = 0
) -> tuple[float, float, float]:
    """Gu et al.'s sink rate over every collected ``hook_pattern`` head, with a 95 % CI over sequences.

    The rate is :func:`sink_rate` of :func:`sink_table`: the share of (layer, head) pairs whose
    sink score (mean attention on token 0 over queries 0..T-1) is > eps. The CI is SciPy's
    percentile bootstrap, resampling whole sequences and recomputing every head's score.

    Returns:
        ``(rate, ci_low, ci_high)``; the CI is NaN with fewer than 2 sequences or ``n_boot`` < 1.

    Raises:
        ValueError: as :func:`sink_scores` (no pattern site, sequences shorter than T).
    """
    sites = [site for site in acts.patterns if site.endswith("hook_pattern")]
    if not sites:
        raise ValueError("no hook_pattern site was collected")
    per_sequence = np.concatenate(
        [np.stack([sink_scores([p], n_tokens) for p in acts.patterns[site]]) for site in sites], axis=1
    )  # [sequence, all heads]
    rate = float((per_sequence.mean(0) > eps).mean())
    if n_boot < 1 or len(per_sequence) < 2:
        return rate, float("nan"), float("nan")
    if np.ptp(per_sequence, axis=0).max() == 0:
        return rate, rate, rate
    rows = np.arange(len(per_sequence))  # resampled sequence indices
    result = stats.bootstrap(
        (rows,),
        lambda idx: float((per_sequence[idx].mean(0) > eps).mean()),
        vectorized=False,
        n_resamples=n_boot,
        method="percentile",
        random_state=random_state(seed),
    )
    return rate, float(result.confidence_interval.low), float(result.confidence_interval.high)
