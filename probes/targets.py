"""Position targets, pair features and control tasks for probes.

Targets:

- absolute index: the position id of each sample (``Activations.position``), as classes or as a
  regression target;
- relative distance ``i - j`` for pairs of tokens ``j <= i`` of the same sequence, sampled by
  :func:`sample_distance_pairs` so that every distance has the same number of pairs (a probe
  cannot win by predicting the most common distance).

Pair features: ``[h_i; h_j]`` (``concat``) and ``h_i - h_j`` (``difference``) at residual sites;
at attention sites two reads per head:

- the *score read* :func:`score_features`: what the head actually scores, the pre-softmax score
  (``hook_attn_scores``: content q.k plus any position bias, ALiBi's or Shaw's), taken relative to
  the query's own key, e_h(i, j) - e_h(i, i);
- the *content-only q.k read* :func:`bilinear_features`: a bilinear read of the (rotated) query of
  token i and key of token j, which never sees a bias added to the score.

Controls: the control task of Hewitt & Liang 2019 ("Designing and interpreting probes with
control tasks", §2: each word type gets a fixed random label drawn from the task's label
distribution; selectivity = task accuracy - control accuracy) in :func:`control_labels`; the
token-identity ceiling :func:`token_identity_predictions`; shuffled labels :func:`shuffled_labels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from jaxtyping import Float, Int

from nopelens.models.compat import moved_names

from .roundoff import roundoff_tolerance


@dataclass
class DistancePairs:
    """Pairs (i, j) of samples of one sequence with position(i) - position(j) = distance >= 0.

    Attributes:
        query: int64 ``[n_pairs]``, index of sample i (the later token) into the activations.
        key: int64 ``[n_pairs]``, index of sample j (j <= i).
        distance: int64 ``[n_pairs]``, position(i) - position(j).
        sequence_id: int64 ``[n_pairs]``, the sequence both tokens come from (the CV group).
    """

    query: np.ndarray
    key: np.ndarray
    distance: np.ndarray
    sequence_id: np.ndarray

    def __len__(self) -> int:
        return len(self.distance)


def sample_distance_pairs(
    sequence_id: Int[np.ndarray, " n"],
    position: Int[np.ndarray, " n"],
    max_distance: int | None = None,
    pairs_per_distance: int | None = None,
    seed: int = 0,
    distances: Sequence[int] | None = None,
) -> DistancePairs:
    """Sample token pairs j <= i within sequences, the same number for every distance 0..max_distance.

    For distance d, the candidates are all (i, j) of one sequence with position(i) - position(j) = d;
    ``pairs_per_distance`` of them are drawn without replacement, uniformly. The longest distances
    have the fewest candidates (one per sequence long enough), so by default every distance gets
    as many pairs as the rarest one has.

    Args:
        sequence_id: sequence of each sample ``[n]`` (``Activations.sequence_id``).
        position: position id of each sample ``[n]``; within a sequence, positions must be
            0..n_s - 1 with no gaps or repeats (what :func:`~nopelens.probes.collect` returns).
        max_distance: largest distance to include; default: the longest sequence's length - 1.
        pairs_per_distance: pairs per distance; default (and at most): the fewest candidates any
            distance has.
        seed: seed of the draw.
        distances: the distances to sample instead of every one of 0..max_distance (ascending, each
            in 0..max_distance; e.g. :func:`spread_distances` at long context).

    Returns:
        :class:`DistancePairs`, sorted by distance.

    Raises:
        ValueError: if positions are not 0..n_s - 1 per sequence, ``max_distance`` has no candidate
            pair, or ``pairs_per_distance`` exceeds the candidates of some distance.

    Example:
        >>> pairs = sample_distance_pairs(np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 2, 0, 1, 2]))
        >>> np.bincount(pairs.distance).tolist()
        [2, 2, 2]
    """
    sequence_id, position = np.asarray(sequence_id), np.asarray(position)
    if sequence_id.shape != position.shape or sequence_id.ndim != 1 or len(position) == 0:
        raise ValueError(
            f"sequence_id and position must be equal-length 1-D arrays, got {sequence_id.shape}, {position.shape}"
        )
    order = np.lexsort((position, sequence_id))
    seqs, starts, lengths = np.unique(sequence_id[order], return_index=True, return_counts=True)
    expected = np.arange(len(order)) - np.repeat(starts, lengths)
    if not np.array_equal(position[order], expected):
        raise ValueError("positions within each sequence must be exactly 0..n_s - 1 (no gaps or repeats)")
    longest = int(lengths.max())
    if max_distance is None:
        max_distance = longest - 1
    if not isinstance(max_distance, (int, np.integer)) or not 0 <= max_distance < longest:
        raise ValueError(
            f"max_distance must lie in [0, {longest - 1}] (longest sequence has {longest} tokens), got {max_distance!r}"
        )
    distances = np.arange(max_distance + 1) if distances is None else np.asarray(distances, dtype=np.int64)
    if (
        distances.ndim != 1
        or len(distances) == 0
        or distances.min() < 0
        or distances.max() > max_distance
        or np.any(np.diff(distances) <= 0)
    ):
        raise ValueError(f"distances must be ascending and distinct in [0, {max_distance}], got {distances.tolist()}")
    available = np.array([np.clip(lengths - d, 0, None).sum() for d in distances])
    per_distance = int(available.min()) if pairs_per_distance is None else pairs_per_distance
    if not isinstance(per_distance, (int, np.integer)) or not 1 <= per_distance <= available.min():
        raise ValueError(
            f"pairs_per_distance must lie in [1, {int(available.min())}] (distance "
            f"{int(distances[available.argmin()])} has only {int(available.min())} candidate pairs), "
            f"got {pairs_per_distance!r}"
        )
    rng = np.random.default_rng(seed)
    query, key, distance = [], [], []
    for d, candidates in zip(distances, available):
        per_sequence = np.clip(lengths - d, 0, None)
        flat = rng.choice(int(candidates), size=per_distance, replace=False)
        which = np.searchsorted(np.cumsum(per_sequence), flat, side="right")
        offset = flat - (np.cumsum(per_sequence) - per_sequence)[which]
        i = starts[which] + d + offset  # sorted index of the later token
        query.append(order[i])
        key.append(order[i - d])
        distance.append(np.full(per_distance, d))
    query, key = np.concatenate(query), np.concatenate(key)
    return DistancePairs(query, key, np.concatenate(distance).astype(np.int64), sequence_id[query].astype(np.int64))


def spread_distances(max_distance: int, n: int) -> np.ndarray:
    """``n`` distances spread evenly over 0..max_distance, both ends included (every distance when
    there are no more than ``n``): the pairs of a long context cover its whole range without
    sampling all of its distances.

    Raises:
        ValueError: if ``max_distance`` < 0 or ``n`` < 2.

    Example:
        >>> spread_distances(2047, 5).tolist(), spread_distances(3, 64).tolist()
        ([0, 512, 1024, 1535, 2047], [0, 1, 2, 3])
    """
    if max_distance < 0 or n < 2:
        raise ValueError(f"need max_distance >= 0 and n >= 2, got {max_distance}, {n}")
    return np.unique(np.round(np.linspace(0, max_distance, min(n, max_distance + 1))).astype(np.int64))


def pair_features(
    features: Float[np.ndarray, "n d"], pairs: DistancePairs, kind: str = "concat"
) -> Float[np.ndarray, "n_pairs d_out"]:
    """Features of each pair from per-token features: ``concat`` [h_i; h_j] or ``difference`` h_i - h_j.

    Args:
        features: ``[n_samples, d]`` (e.g. ``Activations.features(site)``): numpy, or a torch
            tensor (the result is then a tensor on its device, the same numbers).
        pairs: from :func:`sample_distance_pairs`.
        kind: ``concat`` (``[n_pairs, 2 d]``) or ``difference`` (``[n_pairs, d]``).

    Raises:
        ValueError: on an unknown ``kind`` or a 1-D ``features``.

    Example:
        >>> h = np.array([[0.0, 1.0], [2.0, 5.0]])
        >>> p = DistancePairs(np.array([1]), np.array([0]), np.array([1]), np.array([0]))
        >>> pair_features(h, p, "difference").tolist(), pair_features(h, p, "concat").tolist()
        ([[2.0, 4.0]], [[2.0, 5.0, 0.0, 1.0]])
    """
    if features.ndim != 2:
        raise ValueError(f"features must be [n_samples, d], got shape {features.shape}")
    query, key = _pair_index(features, pairs.query), _pair_index(features, pairs.key)
    if kind == "concat":
        if isinstance(features, torch.Tensor):
            return torch.cat([features[query], features[key]], dim=1)
        return np.concatenate([features[query], features[key]], axis=1)
    if kind == "difference":
        return features[query] - features[key]
    raise ValueError(f"kind must be 'concat' or 'difference', got {kind!r}")


def bilinear_features(
    queries: Float[np.ndarray, "n head_index d_head"],
    keys: Float[np.ndarray, "n kv_head d_head"],
    pairs: DistancePairs,
    mode: str = "outer",
) -> Float[np.ndarray, "n_pairs d_out"]:
    """Per-head bilinear read of query i and key j: vec(q_i k_j^T) (``outer``) or q_i * k_j (``elementwise``).

    A linear probe on the flattened per-head outer products computes sum_h q_{i,h}^T W_h k_{j,h}
    + b, the most general bilinear form per head; the model's own score q_i . k_j / sqrt(d_head)
    is the case W_h = I / sqrt(d_head), so the probe reads at least what the attention scores
    carry. Under RoPE, (R_i q)^T (R_j k) has, per rotary pair, a cos term (q_a k_a + q_b k_b) and
    a sin term (q_a k_b - q_b k_a) of the phase (i - j) theta_r; the ``outer`` features contain
    both, while ``elementwise`` (a diagonal W_h, d_head features per head instead of d_head^2)
    keeps only the cos terms and cannot read the sign or the cross-dimension terms. Use
    ``elementwise`` only when d_head^2 * n_heads features are too many. Pass the rotated
    ``hook_rot_q``/``hook_rot_k`` for RoPE layers and ``hook_q``/``hook_k`` otherwise.

    Grouped-query attention: with ``n_kv`` key heads and ``n_heads`` query heads, query head h
    reads key head ``h // (n_heads // n_kv)`` (HF ``repeat_kv``).

    Args:
        queries: ``[n_samples, head_index, d_head]`` (numpy, or a torch tensor: the result is then a
            tensor on its device, the same numbers).
        keys: ``[n_samples, kv_head, d_head]``, kv_head dividing head_index (the type of ``queries``).
        pairs: from :func:`sample_distance_pairs`.
        mode: ``outer`` (``[n_pairs, head_index * d_head^2]``) or ``elementwise``
            (``[n_pairs, head_index * d_head]``).

    Raises:
        ValueError: on shapes that do not match or an unknown mode.

    Example:
        >>> q = np.array([[[1.0, 2.0]], [[3.0, 4.0]]]); k = np.array([[[5.0, 6.0]], [[7.0, 8.0]]])
        >>> p = DistancePairs(np.array([1]), np.array([0]), np.array([1]), np.array([0]))
        >>> bilinear_features(q, k, p).tolist(), bilinear_features(q, k, p, "elementwise").tolist()
        ([[15.0, 18.0, 20.0, 24.0]], [[15.0, 24.0]])
    """
    if queries.ndim != 3 or keys.ndim != 3 or queries.shape[2] != keys.shape[2] or len(queries) != len(keys):
        raise ValueError(
            f"queries [n, head, d_head] and keys [n, kv_head, d_head] do not match: {queries.shape}, {keys.shape}"
        )
    n_heads, n_kv = queries.shape[1], keys.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"key heads ({n_kv}) must divide query heads ({n_heads})")
    q = queries[_pair_index(queries, pairs.query)]
    k = keys[_pair_index(keys, pairs.key)]
    if isinstance(k, torch.Tensor):
        k = torch.repeat_interleave(k, n_heads // n_kv, dim=1)
    else:
        k = np.repeat(k, n_heads // n_kv, axis=1)
    if mode == "outer":
        return (q[..., :, None] * k[..., None, :]).reshape(len(pairs), -1)
    if mode == "elementwise":
        return (q * k).reshape(len(pairs), -1)
    raise ValueError(f"mode must be 'outer' or 'elementwise', got {mode!r}")


def _pair_index(features, index: np.ndarray):
    """``index`` as ``features`` is indexed: numpy as it is, a tensor on a tensor's device."""
    if isinstance(features, torch.Tensor):
        return torch.as_tensor(index, device=features.device)
    return index


BLOCKED_SCORE = -1e30
"""A collected score at or below this (or -inf) marks a blocked key: masks write -inf or the
dtype's lowest value (HF uses ``torch.finfo(dtype).min``), never a real score. In float16 the
lowest value is -65504, so there the bar is half of it (:func:`blocked_score`)."""


def blocked_score(dtype="float32") -> float:
    """The bar at or below which a score of ``dtype`` marks a blocked key.

    Example:
        >>> blocked_score("float32"), blocked_score("float16")
        (-1e+30, -32752.0)
    """
    name = str(dtype).removeprefix("torch.")
    torch_dtype = getattr(torch, name, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        return BLOCKED_SCORE
    return max(BLOCKED_SCORE, 0.5 * float(torch.finfo(torch_dtype).min))


def score_features(
    scores: Sequence[np.ndarray],
    sequence_id: Int[np.ndarray, " n"],
    position: Int[np.ndarray, " n"],
    pairs: DistancePairs,
    dtype="float32",
) -> Float[np.ndarray, "n_pairs head_index"]:
    """Per-head pre-softmax score of each pair, relative to the query's own key: e_h(i, j) - e_h(i, i).

    e_h(i, j) is the score the head gives key j before the softmax, content and position bias
    together: for ALiBi q_i.k_j / sqrt(d_head) - m_h (i - j) (Press et al. 2022; seed
    ``002_c993a97fc3f160f5.txt``), for Shaw (q_i.k_j + q_i.a^K_{clip(j - i, -k, k)}) / sqrt(d_head)
    (Shaw et al. 2018, eq. 5). The softmax of row i ignores any constant added to the whole row,
    so only differences within a row reach the pattern; subtracting the query's own key e_h(i, i)
    removes such constants. This makes the read the same for every way of writing one bias: the
    Decoder's ALiBi adds -m_h (i - j), HF Bloom adds m_h j, and both give -m_h (i - j) here. A
    linear probe on these features asks whether the head's own scores, as the softmax sees them,
    carry i - j.

    Float round-off is not signal (issue 10 §1): a difference within the round-off of its two
    scores, ``|e(i, j) - e(i, i)| <= roundoff_tolerance(dtype) * max(|e(i, j)|, |e(i, i)|)``, is 0.
    Without this, the scores of a NoPE model on constant input (equal in exact arithmetic) differ
    by float error that grows with the position, and a probe reads that error as distance.

    Args:
        scores: one ``[head_index, n_real, n_real]`` array per sequence (``Activations.patterns``
            of a ``hook_attn_scores`` site), index ``[h, i, j]`` = query position i, key position j.
        sequence_id: sequence of each sample ``[n]`` (the index into ``scores``).
        position: position id of each sample ``[n]``.
        pairs: from :func:`sample_distance_pairs`.
        dtype: the dtype the scores were computed in (sets the round-off, see
            :func:`~nopelens.probes.roundoff.roundoff_tolerance`).

    Returns:
        ``[n_pairs, head_index]`` float64; 0 for every pair of distance 0.

    Raises:
        ValueError: if a pair's key is blocked (score -inf or <= :func:`blocked_score` of ``dtype``,
            e.g. outside a sliding window: the sweep leaves such blocks out of the score read, see
            :func:`nopelens.analyses.sweep.reads.readable_score_sites`), a sequence is missing, or the
            score arrays are not square per head.

    Example:
        >>> alibi = -0.5 * np.subtract.outer(np.arange(3), np.arange(3)).astype(float)[None]  # -m (i - j)
        >>> bloom = 0.5 * np.tile(np.arange(3.0), (3, 1))[None]  # m j: the same softmax
        >>> p = DistancePairs(np.array([2, 2]), np.array([0, 1]), np.array([2, 1]), np.array([0, 0]))
        >>> ids, pos = np.zeros(3, dtype=int), np.arange(3)
        >>> score_features([alibi], ids, pos, p).ravel().tolist(), score_features([bloom], ids, pos, p).ravel().tolist()
        ([-1.0, -0.5], [-1.0, -0.5])
    """
    sequence_id, position = np.asarray(sequence_id), np.asarray(position)
    if not scores:
        raise ValueError("no score arrays given")
    n_heads = np.asarray(scores[0]).shape[0]
    pair, own = np.empty((len(pairs), n_heads)), np.empty((len(pairs), n_heads))
    seq = sequence_id[pairs.query]
    i, j = position[pairs.query], position[pairs.key]
    for s in np.unique(seq):
        if not 0 <= s < len(scores):
            raise ValueError(f"sequence {s} has no score array ({len(scores)} given)")
        e = np.asarray(scores[s], dtype=np.float64)
        if e.ndim != 3 or e.shape[1] != e.shape[2] or e.shape[0] != n_heads:
            raise ValueError(f"scores of sequence {s} must be [{n_heads}, n, n], got {e.shape}")
        rows = np.flatnonzero(seq == s)
        pair[rows], own[rows] = e[:, i[rows], j[rows]].T, e[:, i[rows], i[rows]].T
    return score_read(pair, own, i, j, seq, dtype)


def score_read(
    pair_score: np.ndarray,
    own_score: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    sequence_id: np.ndarray,
    dtype="float32",
) -> Float[np.ndarray, "n_pairs head_index"]:
    """The score read of pairs from their gathered scores (:func:`score_features`, which gathers them
    from whole score arrays; a streamed read gathers them from a batch's scores inside the hook,
    :func:`~nopelens.probes.engine.pair_scores`): e(i, j) - e(i, i), 0 where within round-off.

    Args:
        pair_score, own_score: ``[n_pairs, head_index]`` scores e_h(i, j) and e_h(i, i), float64.
        query, key: the pairs' positions i and j ``[n_pairs]`` (for errors).
        sequence_id: the pairs' sequences ``[n_pairs]`` (for errors).
        dtype: the dtype the scores were computed in.

    Returns:
        ``[n_pairs, head_index]`` float64.

    Raises:
        ValueError: on a NaN score, or if a pair's key is blocked (see :func:`score_features`).
    """
    nan = np.isnan(pair_score) | np.isnan(own_score)
    if nan.any():
        raise ValueError(
            f"NaN attention score of sequence {int(sequence_id[np.argwhere(nan)[0][0]])} "
            "(a pair's key or its query's own key)"
        )
    bar = blocked_score(dtype)
    blocked = ~np.isfinite(pair_score) | (pair_score <= bar) | (own_score <= bar)
    if blocked.any():
        k, head = np.argwhere(blocked)[0]
        raise ValueError(
            f"sequence {int(sequence_id[k])}, head {head}: key {key[k]} is blocked for query {query[k]} (score "
            f"{pair_score[k, head]:.3g}); the score read needs every pair j <= i visible, and a sliding window or "
            "chunk shorter than the sequence blocks the pairs further apart: leave that block out of the score read"
        )
    difference = pair_score - own_score
    resolution = roundoff_tolerance(dtype) * np.maximum(np.abs(pair_score), np.abs(own_score))
    return np.where(np.abs(difference) <= resolution, 0.0, difference)


def control_labels(token_types: np.ndarray, labels: np.ndarray, seed: int = 0) -> np.ndarray:
    """Hewitt & Liang 2019 control task: a fixed random label per token type, from the label distribution.

    Each distinct token type (a token id, or a row such as a (token_i, token_j) pair) gets one
    label drawn independently from the empirical distribution of ``labels``; every occurrence of
    the type gets that label. A probe that scores well on this task is memorizing types, so
    selectivity = task score - control score measures what is beyond type memorization.

    Args:
        token_types: ``[n]`` token ids, or ``[n, k]`` rows (each distinct row is a type).
        labels: ``[n]`` the real task labels (classes or values).
        seed: seed of the draw.

    Returns:
        ``[n]`` control labels, same dtype as ``labels``.

    Raises:
        ValueError: if lengths differ or there are no samples.

    Example:
        >>> c = control_labels(np.array([5, 7, 5, 7, 5]), np.array([0, 1, 2, 3, 4]))
        >>> bool(c[0] == c[2] == c[4] and c[1] == c[3])
        True
    """
    token_types, labels = np.asarray(token_types), np.asarray(labels)
    if len(token_types) != len(labels) or len(labels) == 0:
        raise ValueError(
            f"token_types and labels must be non-empty with equal length, got {len(token_types)}, {len(labels)}"
        )
    _, type_index = np.unique(token_types, axis=0, return_inverse=True)
    type_index = type_index.reshape(-1)
    rng = np.random.default_rng(seed)
    per_type = rng.choice(labels, size=int(type_index.max()) + 1, replace=True)
    return per_type[type_index]


def shuffled_labels(labels: np.ndarray, seed: int = 0) -> np.ndarray:
    """Labels permuted across samples (the shuffled-label baseline): same distribution, no link to features."""
    return np.random.default_rng(seed).permutation(np.asarray(labels))


def token_identity_predictions(token_types: np.ndarray, labels: np.ndarray, task: str = "classification") -> np.ndarray:
    """Best prediction from token identity alone: per type, the majority label (or the mean).

    This is the ceiling of any token-identity-only probe on this data (fitted and scored on the
    same samples): the most accuracy (classification) or the least squared error (regression) a
    function of the token type can reach. A position probe that does not beat it has shown
    nothing beyond token identity. Ties between labels go to the smallest label.

    Args:
        token_types: ``[n]`` token ids, or ``[n, k]`` rows (e.g. token pairs).
        labels: ``[n]`` targets.
        task: ``classification`` (majority label per type) or ``regression`` (mean per type).

    Returns:
        ``[n]`` predictions.

    Example:
        >>> latin = np.array([[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]])
        >>> position = np.tile(np.arange(4), 4)
        >>> float(np.mean(token_identity_predictions(latin.ravel(), position) == position))
        0.25
    """
    token_types, labels = np.asarray(token_types), np.asarray(labels)
    if len(token_types) != len(labels) or len(labels) == 0:
        raise ValueError(
            f"token_types and labels must be non-empty with equal length, got {len(token_types)}, {len(labels)}"
        )
    _, type_index = np.unique(token_types, axis=0, return_inverse=True)
    type_index = type_index.reshape(-1)
    n_types = int(type_index.max()) + 1
    if task == "regression":
        means = np.bincount(type_index, labels.astype(np.float64), n_types) / np.bincount(type_index, minlength=n_types)
        return means[type_index]
    if task != "classification":
        raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")
    classes, label_index = np.unique(labels, return_inverse=True)
    counts = np.zeros((n_types, len(classes)), dtype=np.int64)
    np.add.at(counts, (type_index, label_index), 1)
    return classes[counts.argmax(1)][type_index]


__getattr__ = moved_names(__name__, gone={"score_differences": "use score_read (the one score read)"})
