"""Attention sinks and attention-output variance shrinkage, per layer and head.

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
- Variance shrinkage (Chi et al. 2023, "Latent positional information is in the self-attention
  variance of transformer language models without positional embeddings"; seed
  ``004_150f630256efbd1c.txt``, "Softmax variance shrinkage"): with near-uniform causal attention,
  z_i = sum_{j<=i} v_j / (i + 1) averages i + 1 independent value vectors, so the variance of each
  coordinate of z_i across sequences is Var(v) / (i + 1); :func:`attention_variance` measures it
  per position and :func:`variance_slopes` fits the log-log slope (-1 for the 1/(i+1) law).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy import stats

from .collect import Activations, collect, site_block

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


def sink_mass_by_query(patterns: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Attention each query row puts on key 0 (the first non-pad token): ``[head, n_real]`` per sequence.

    Example:
        >>> uniform = np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None]
        >>> np.round(sink_mass_by_query([uniform[None]])[0][0], 6).tolist()
        [1.0, 0.5, 0.333333, 0.25]
    """
    return [_check_pattern(p, k)[:, :, 0] for k, p in enumerate(patterns)]


def sink_mass(patterns: Sequence[np.ndarray], include_sink_row: bool = False) -> np.ndarray:
    """Mean attention on the first non-pad key over the query rows that see it, per head.

    The mean pools all (sequence, query) rows; the sink's own row (always 1 under a causal mask)
    is excluded unless ``include_sink_row``.

    Args:
        patterns: per sequence ``[head_index, n_real, n_real]`` (padding removed).
        include_sink_row: count row 0 too.

    Returns:
        ``[head_index]`` mean masses in [0, 1].

    Raises:
        ValueError: if no row is left (every sequence has one token and the sink row is
            excluded), or patterns are malformed.

    Example:
        >>> uniform = (np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None])[None]
        >>> round(float(sink_mass([uniform])[0]), 6), round(float(sink_mass([uniform], True)[0]), 6)
        (0.361111, 0.520833)
    """
    start = 0 if include_sink_row else 1
    rows = [m[:, start:] for m in sink_mass_by_query(patterns)]
    rows = np.concatenate(rows, axis=1) if rows else np.empty((0, 0))
    if rows.shape[1] == 0:
        raise ValueError("no query row can see a sink other than itself (all sequences have one token)")
    return rows.mean(1)


def sink_mass_by_position(patterns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Mean attention on key 0 as a function of query position, per head.

    Returns:
        (``[head_index, max_len]`` mean mass at each query position over the sequences that
        have it, ``[max_len]`` number of those sequences).
    """
    masses = sink_mass_by_query(patterns)
    if not masses:
        raise ValueError("no patterns given")
    n_heads, longest = masses[0].shape[0], max(m.shape[1] for m in masses)
    total, count = np.zeros((n_heads, longest)), np.zeros(longest, dtype=np.int64)
    for mass in masses:
        total[:, : mass.shape[1]] += mass
        count[: mass.shape[1]] += 1
    return total / count, count


def sink_scores(patterns: Sequence[np.ndarray], n_tokens: int = GU_WINDOW) -> np.ndarray:
    """Gu et al. 2025 sink score per head: mean attention on token 0 over queries 0..T-1.

    Every sequence contributes its first T tokens (its first T rows and columns); row 0 counts.

    Args:
        patterns: per sequence ``[head_index, n_real, n_real]``.
        n_tokens: T, 64 in Gu et al.

    Returns:
        ``[head_index]`` scores in [0, 1].

    Raises:
        ValueError: if T is not an integer >= 1, or a sequence has fewer than T real tokens.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens (Gu's window T) must be an integer >= 1, got {n_tokens!r}")
    short = [k for k, p in enumerate(patterns) if p.shape[-1] < n_tokens]
    if short:
        raise ValueError(f"sequences {short[:10]} have fewer than T={n_tokens} real tokens")
    masses = [m[:, :n_tokens] for m in sink_mass_by_query(patterns)]
    if not masses:
        raise ValueError("no patterns given")
    return np.concatenate(masses, axis=1).mean(1)


def sink_table(acts: Activations, eps: float = GU_EPSILON, n_tokens: int | None = GU_WINDOW) -> pd.DataFrame:
    """Sink mass, Gu sink score and sink flag for every collected ``hook_pattern`` site and head.

    Args:
        acts: activations with ``blocks.{l}.attn.hook_pattern`` sites.
        eps: Gu's threshold; a head is a sink when its score is > eps.
        n_tokens: Gu's window T; None skips the score (e.g. for sequences shorter than 64).

    Returns:
        DataFrame with columns ``site, block, head, sink_mass, sink_score, is_sink``
        (``sink_score``/``is_sink`` absent when ``n_tokens`` is None).

    Raises:
        ValueError: if no pattern site was collected, or as :func:`sink_scores`.
    """
    sites = [site for site in acts.patterns if site.endswith("hook_pattern")]
    if not sites:
        raise ValueError(f"no hook_pattern site was collected (collected: {sorted(acts.acts) + sorted(acts.patterns)})")
    rows = []
    for site in sites:
        masses = sink_mass(acts.patterns[site])
        scores = sink_scores(acts.patterns[site], n_tokens) if n_tokens is not None else None
        for head, mass in enumerate(masses):
            row = dict(site=site, block=site_block(site), head=head, sink_mass=float(mass))
            if scores is not None:
                row.update(sink_score=float(scores[head]), is_sink=bool(scores[head] > eps))
            rows.append(row)
    return pd.DataFrame(rows)


def sink_rate(table: pd.DataFrame) -> float:
    """Fraction of (layer, head) pairs flagged ``is_sink`` in a :func:`sink_table` (Gu et al. 2025)."""
    if "is_sink" not in table or table.empty:
        raise ValueError("the table has no is_sink column (build it with n_tokens set)")
    return float(table["is_sink"].mean())


def sink_mass_by_position_table(acts: Activations) -> pd.DataFrame:
    """Tidy sink mass vs query position: ``site, block, head, query_position, sink_mass, n_sequences``."""
    frames = []
    for site in (s for s in acts.patterns if s.endswith("hook_pattern")):
        mass, count = sink_mass_by_position(acts.patterns[site])
        heads, positions = np.meshgrid(np.arange(mass.shape[0]), np.arange(mass.shape[1]), indexing="ij")
        frames.append(pd.DataFrame(dict(site=site, block=site_block(site), head=heads.ravel(),
                                        query_position=positions.ravel(), sink_mass=mass.ravel(),
                                        n_sequences=np.broadcast_to(count, mass.shape).ravel())))
    if not frames:
        raise ValueError("no hook_pattern site was collected")
    return pd.concat(frames, ignore_index=True)


def prepend_bos(
    tokens: Int[torch.Tensor, "batch pos"], bos_token_id: int, attention_mask: Int[torch.Tensor, "batch pos"] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Insert BOS before the first real token of each row (after any left padding); one column longer.

    Example:
        >>> t, m = prepend_bos(torch.tensor([[0, 5, 6], [7, 8, 9]]), 1, torch.tensor([[0, 1, 1], [1, 1, 1]]))
        >>> t.tolist(), m.tolist()
        ([[0, 1, 5, 6], [1, 7, 8, 9]], [[0, 1, 1, 1], [1, 1, 1, 1]])
    """
    tokens = torch.as_tensor(tokens)
    mask = torch.ones_like(tokens) if attention_mask is None else torch.as_tensor(attention_mask).long()
    first = sink_index(mask.cpu().numpy())
    new_tokens = torch.zeros(tokens.shape[0], tokens.shape[1] + 1, dtype=tokens.dtype)
    new_mask = torch.zeros_like(new_tokens)
    for row, k in enumerate(first.tolist()):
        real = mask[row].bool()
        n_real = int(real.sum())
        new_tokens[row, k] = bos_token_id
        new_tokens[row, k + 1 : k + 1 + n_real] = tokens[row][real]
        new_mask[row, k : k + 1 + n_real] = 1
        new_tokens[row, :k] = tokens[row, :k]
    return new_tokens, new_mask


def compare_bos(
    model: torch.nn.Module,
    tokens: Int[torch.Tensor, "batch pos"],
    bos_token_id: int,
    n_layers: int,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    eps: float = GU_EPSILON,
    n_tokens: int | None = GU_WINDOW,
    batch_size: int = 32,
) -> pd.DataFrame:
    """Sink statistics of every layer and head with and without a BOS token in front.

    ``tokens`` are taken as BOS-free; the ``with_bos`` run inserts ``bos_token_id`` before the
    first real token of each row. In both runs, key 0 is the first real token, so the comparison
    asks whether a dedicated BOS draws more sink mass than an ordinary first token.

    Returns:
        :func:`sink_table` rows of both runs with a ``condition`` column (``without_bos``,
        ``with_bos``).
    """
    sites = [f"blocks.{layer}.attn.hook_pattern" for layer in range(n_layers)]
    with_tokens, with_mask = prepend_bos(tokens, bos_token_id, attention_mask)
    if attention_mask is None:  # all real: a module that takes no mask is not handed one
        with_mask = None
    frames = []
    for condition, toks, mask in (("without_bos", tokens, attention_mask), ("with_bos", with_tokens, with_mask)):
        acts = collect(model, toks, sites, attention_mask=mask, batch_size=batch_size)
        frames.append(sink_table(acts, eps, n_tokens).assign(condition=condition))
    return pd.concat(frames, ignore_index=True)


def attention_variance(acts: Activations, sites: Sequence[str] | None = None) -> pd.DataFrame:
    """Per-position variance of attention outputs across sequences, averaged over coordinates.

    For each site and position i: Var_s(z_{s,i,c}) over the sequences s that have position i
    (unbiased, ddof = 1), then the mean over coordinates c. This is the definition under which
    near-uniform causal attention over independent tokens gives Var(v) / (i + 1) (see the module
    docstring). Use ``blocks.{l}.hook_attn_out`` (or ``attn.hook_z``) sites.

    Returns:
        DataFrame ``site, block, position, variance, n_sequences`` (positions with >= 2 sequences).

    Raises:
        KeyError: for a site that was not collected.
        ValueError: if there is no site, or no position has two sequences.
    """
    sites = [s for s in acts.acts] if sites is None else list(sites)
    if not sites:
        raise ValueError("no non-pattern site was collected; collect blocks.{l}.hook_attn_out or attn.hook_z sites")
    frames = []
    for site in sites:
        X = acts.features(site).astype(np.float64)
        positions = np.unique(acts.position)
        rows = []
        for position in positions:
            Z = X[acts.position == position]
            if len(Z) >= 2:
                rows.append((int(position), float(Z.var(axis=0, ddof=1).mean()), len(Z)))
        if not rows:
            raise ValueError(f"site {site!r}: no position is shared by two sequences")
        frame = pd.DataFrame(rows, columns=["position", "variance", "n_sequences"])
        frames.append(frame.assign(site=site, block=site_block(site)))
    table = pd.concat(frames, ignore_index=True)
    return table[["site", "block", "position", "variance", "n_sequences"]]


def variance_slopes(table: pd.DataFrame) -> pd.DataFrame:
    """Least-squares slope of log variance against log(position + 1), per site.

    A slope of -1 is the 1/(i+1) shrinkage law (Chi et al. 2023; seed 004).

    Returns:
        DataFrame ``site, block, slope, intercept, r_value, n_positions``.

    Raises:
        ValueError: if a site has fewer than 3 positions or a variance <= 0.
    """
    rows = []
    for site, group in table.groupby("site", sort=False):
        if len(group) < 3:
            raise ValueError(f"site {site!r}: a slope needs >= 3 positions, got {len(group)}")
        if (group["variance"] <= 0).any():
            raise ValueError(f"site {site!r}: variance <= 0 at some position; the log-log fit is undefined")
        fit = stats.linregress(np.log(group["position"] + 1.0), np.log(group["variance"]))
        rows.append(dict(site=site, block=site_block(site), slope=fit.slope, intercept=fit.intercept,
                         r_value=fit.rvalue, n_positions=len(group)))
    return pd.DataFrame(rows)


def variance_shrinkage(
    model: torch.nn.Module,
    tokens: Int[torch.Tensor, "batch pos"],
    layers: Sequence[int],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    batch_size: int = 256,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Collect ``blocks.{l}.hook_attn_out`` and return (:func:`attention_variance`, :func:`variance_slopes`).

    When every sequence starts with the same token (a BOS), position 0 sees only that token, so
    its output is identical across sequences (variance 0, no log): position 0 is left out of both
    tables, and the variance table says so in its ``note`` column.
    """
    sites = [f"blocks.{layer}.hook_attn_out" for layer in layers]
    acts = collect(model, tokens, sites, attention_mask=attention_mask, batch_size=batch_size)
    table = attention_variance(acts).assign(note="")
    first = acts.token[acts.position == 0]
    if len(first) and bool((first == first[0]).all()):
        table = table[table["position"] > 0].reset_index(drop=True)
        table = table.assign(note=f"position 0 left out: every sequence starts with token {int(first[0])} (BOS), "
                             "so its output never varies")
    return table, variance_slopes(table)


def _check_pattern(pattern: np.ndarray, index: int) -> np.ndarray:
    pattern = np.asarray(pattern)
    if pattern.ndim != 3 or pattern.shape[1] != pattern.shape[2] or pattern.shape[1] == 0:
        raise ValueError(f"pattern {index} must be [head_index, n, n] with n >= 1, got {pattern.shape}")
    if not np.all(np.isfinite(pattern)):
        raise ValueError(f"pattern {index} contains NaN or Inf")
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
    per_sequence = np.concatenate([np.stack([sink_scores([p], n_tokens) for p in acts.patterns[site]])
                                   for site in sites], axis=1)  # [sequence, all heads]
    rate = float((per_sequence.mean(0) > eps).mean())
    if n_boot < 1 or len(per_sequence) < 2:
        return rate, float("nan"), float("nan")
    if np.ptp(per_sequence, axis=0).max() == 0:
        return rate, rate, rate
    rows = np.arange(len(per_sequence))  # resampled sequence indices
    result = stats.bootstrap((rows,), lambda idx: float((per_sequence[idx].mean(0) > eps).mean()),
                             vectorized=False, n_resamples=n_boot, method="percentile", random_state=seed)
    return rate, float(result.confidence_interval.low), float(result.confidence_interval.high)
