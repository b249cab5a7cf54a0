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
- Sinks that are not a token (passed per block as ``sinks``: kind and per-head logits, from
  :func:`nopelens.models.hf.learned_sinks`). A *learned* sink (GPT-OSS, Flint, MiMo-V2-Flash's
  sliding layers) is one more logit s_h in every row's softmax denominator with a zero value, so
  the returned pattern sums to 1 - p_sink: its mass is the mean of 1 - row sum over the real query
  rows (:func:`learned_sink_mass`); a *per-token* sink (Inkling 2) is read the same way. An
  *output-scale* sink (Granite SWA) multiplies the head's output by sigmoid(lse_i - s_h) = 1 -
  p_sink and leaves the pattern a plain softmax, so its mass is read from that scale: the output
  ``hook_z`` against the pattern-weighted values ``hook_v`` (:func:`output_scale_sink_mass`).
  These are reported next to Gu's first-token score; the threshold eps is applied to the
  first-token score only (``threshold_on``).
- Sliding windows and chunks (:class:`~nopelens.models.masks.KeyWindow`, passed per block as
  ``windows``): a query outside the first token's window or chunk cannot see it, so its zero mass
  says nothing about the head; both the sink mass and Gu's score average only the queries that can
  see token 0 (a sliding window of w: queries 0..w-1). Averaging all queries instead would shrink
  a sliding layer's mass by about T / w and no sliding layer could ever be a sink.
- Variance shrinkage (Chi et al. 2023, "Latent positional information is in the self-attention
  variance of transformer language models without positional embeddings"; seed
  ``004_150f630256efbd1c.txt``, "Softmax variance shrinkage"): with near-uniform causal attention,
  z_i = sum_{j<=i} v_j / (i + 1) averages i + 1 independent value vectors, so the variance of each
  coordinate of z_i across sequences is Var(v) / (i + 1); :func:`attention_variance` measures it
  per position and :func:`variance_slopes` fits the log-log slope (-1 for the 1/(i+1) law).
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy import stats
from torch import Tensor

from nopelens.models.hf import sink_parameters
from nopelens.models.hooks import act_names
from nopelens.models.masks import CAUSAL, KeyWindow

from .collect import Activations, check_patterns, collect, site_block
from .metrics import random_state
from .stream import Measurement

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
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens (Gu's window T) must be an integer >= 1, got {n_tokens!r}")
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


def variance_read_reason(keys: KeyWindow, n_tokens: int, first_position: int = 0) -> str | None:
    """Why :func:`variance_slopes` cannot fit a slope under ``keys`` over positions
    ``first_position..n_tokens-1``, or None when it can (it needs 3 distinct numbers of visible keys).

    Example:
        >>> variance_read_reason(KeyWindow(window=3), 8) is None
        True
        >>> variance_read_reason(KeyWindow(window=3), 8, first_position=1)  # BOS left out
        'sliding window 3: the queries from position 1 on see [2, 3] keys; a variance slope needs 3 distinct numbers'
    """
    counts = sorted(keys.n_visible(n_tokens)[first_position:].unique().tolist())
    if len(counts) >= 3:
        return None
    return (f"{keys.describe()}: the queries from position {first_position} on see {counts} keys; "
            "a variance slope needs 3 distinct numbers")


def sink_flags(table: pd.DataFrame) -> pd.Series:
    """``is_sink`` as floats (1, 0, NaN where no verdict was possible), also as read back from CSV.

    Raises:
        ValueError: if the table has no ``is_sink`` column.
    """
    if "is_sink" not in table:
        raise ValueError("the table has no is_sink column (build it with n_tokens set)")
    flags = table["is_sink"].map({True: 1.0, False: 0.0, "True": 1.0, "False": 0.0})
    return flags.astype(float)


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


def _seeing(patterns: Sequence[np.ndarray], keys: KeyWindow, start: int = 0) -> list[np.ndarray]:
    """Per sequence, the masses ``[head, n_seeing]`` of the query rows >= ``start`` that can see key 0."""
    out = []
    for mass in sink_mass_by_query(patterns):
        sees = keys.sees_first(mass.shape[1]).numpy()
        sees[:start] = False
        # C order, as a slice gives: numpy's float32 mean sums pairwise along a contiguous axis only, and a
        # boolean index returns the other layout (the same masses, a mean different in the last bits)
        out.append(np.ascontiguousarray(mass[:, sees]))
    return out


def sink_mass(patterns: Sequence[np.ndarray], include_sink_row: bool = False,
              keys: KeyWindow = CAUSAL) -> np.ndarray:
    """Mean attention on the first non-pad key over the query rows that see it, per head.

    The mean pools all (sequence, query) rows that can see key 0 (all of them under the causal
    rule; under a sliding window of w only queries 0..w-1); the sink's own row (always 1 under a
    causal mask) is excluded unless ``include_sink_row``.

    Args:
        patterns: per sequence ``[head_index, n_real, n_real]`` (padding removed).
        include_sink_row: count row 0 too.
        keys: the layer's sliding window or chunk.

    Returns:
        ``[head_index]`` mean masses in [0, 1].

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
    rows = _seeing(patterns, keys, start=0 if include_sink_row else 1)
    rows = np.concatenate(rows, axis=1) if rows else np.empty((0, 0))
    if rows.shape[1] == 0:
        raise ValueError(_no_sink_row(keys, max((p.shape[-1] for p in patterns), default=0)))
    return rows.mean(1)


def _no_sink_row(keys: KeyWindow, n_tokens: int) -> str:
    window_blind = sink_read_reason(keys, n_tokens) if n_tokens > 1 else None
    return window_blind or "no query row can see a sink other than itself (all sequences have one token)"


def sink_mass_by_position(patterns: Sequence[np.ndarray], keys: KeyWindow = CAUSAL) -> tuple[np.ndarray, np.ndarray]:
    """Mean attention on key 0 as a function of query position, per head.

    Returns:
        (``[head_index, max_len]`` mean mass at each query position over the sequences that
        have it, ``[max_len]`` number of those sequences). Positions that cannot see key 0
        (outside its window or chunk) have no sequence: count 0, mass NaN.
    """
    masses = sink_mass_by_query(patterns)
    if not masses:
        raise ValueError("no patterns given")
    n_heads, longest = masses[0].shape[0], max(m.shape[1] for m in masses)
    total, count = np.zeros((n_heads, longest)), np.zeros(longest, dtype=np.int64)
    for mass in masses:
        total[:, : mass.shape[1]] += mass
        count[: mass.shape[1]] += 1
    count[~keys.sees_first(longest).numpy()] = 0
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
        ``[head_index]`` scores in [0, 1].

    Raises:
        ValueError: if T is not an integer >= 1, or a sequence has fewer than T real tokens.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens (Gu's window T) must be an integer >= 1, got {n_tokens!r}")
    short = [k for k, p in enumerate(patterns) if p.shape[-1] < n_tokens]
    if short:
        raise ValueError(f"sequences {short[:10]} have fewer than T={n_tokens} real tokens")
    if not patterns:
        raise ValueError("no patterns given")
    masses = _seeing([np.asarray(p)[:, :n_tokens, :n_tokens] for p in patterns], keys)
    return np.concatenate(masses, axis=1).mean(1)


def learned_sink_mass(patterns: Sequence[np.ndarray]) -> np.ndarray:
    """Mean mass a learned sink takes, per head: 1 - row sum, over every real query row.

    Example:
        >>> rows = np.array([[[0.5, 0.0], [0.25, 0.25]]])  # one head, rows sum to 0.5
        >>> learned_sink_mass([rows]).tolist()
        [0.5]
    """
    sums = [_check_pattern(p, k).sum(-1) for k, p in enumerate(patterns)]
    if not sums:
        raise ValueError("no patterns given")
    return 1.0 - np.concatenate(sums, axis=1).mean(1)


def output_scale_sink_mass(patterns: Sequence[np.ndarray], values: np.ndarray, outputs: np.ndarray,
                           sequence_id: np.ndarray) -> np.ndarray:
    """Mean sink mass of an output-scale sink per head: 1 - c, with z_i = c_i (sum_j p_ij v_j).

    Granite SWA's eager attention computes the plain softmax pattern p, then multiplies each
    head's output by sigmoid(lse_i - s_h) = 1 - p_sink (``transformers/models/granite_swa/
    modeling_granite_swa.py``). The factor c_i of each (query, head) is fitted by least squares
    over d_head: <z_i, pv_i> / <pv_i, pv_i>. A row whose weighted value pv_i is 0 (every value it
    weighs is 0, e.g. a pad embedding's) shows no scale and is left out of the mean.

    Args:
        patterns: per sequence ``[head_index, n, n]``.
        values: ``[n_samples, n_kv_heads, d_head]`` (``attn.hook_v``; repeated to the query heads).
        outputs: ``[n_samples, head_index, d_head]`` (``attn.hook_z``, the scaled head outputs).
        sequence_id: ``[n_samples]``.

    Returns:
        ``[head_index]`` mean 1 - c over every real query row that shows its scale.

    Raises:
        ValueError: if a head has no such row (every weighted value 0).
    """
    masses, shown = [], []
    for s, pattern in enumerate(patterns):
        rows = sequence_id == s
        v, z = values[rows].astype(np.float64), outputs[rows].astype(np.float64)
        v = np.repeat(v, pattern.shape[0] // v.shape[1], axis=1)
        weighted = np.einsum("hij,jhd->ihd", pattern.astype(np.float64), v)
        norm = (weighted * weighted).sum(-1)
        scale = (z * weighted).sum(-1) / np.where(norm > 0, norm, 1.0)
        masses.append(np.where(norm > 0, 1.0 - scale, 0.0))  # [n, head]
        shown.append(norm > 0)
    count = np.concatenate(shown, axis=0).sum(0)
    if (count == 0).any():
        raise ValueError(f"output-scale sink heads {np.flatnonzero(count == 0).tolist()}: every weighted value is 0, "
                         "so no query shows its output scale (sink mass not measurable)")
    return np.concatenate(masses, axis=0).sum(0) / count


LEARNED_SINK_COLUMNS = ["block", "head", "sink_logit", "parameter"]


def learned_sink_logits(source) -> pd.DataFrame:
    """The learned sink logits of an HF model, per block and head, from its weights (no forward pass).

    Readable even where the attention weights are not (DeepSeek V4's compressed attention): each
    logit s_h is a key with a zero value in every row's softmax, so against keys of scores a_j it
    takes exp(s_h) / (exp(s_h) + sum_j exp(a_j)) of the row (``eager_attention_forward`` of
    ``gpt_oss/modeling_gpt_oss.py``); that mass needs the scores, the logit alone does not.

    Args:
        source: an HF ``PreTrainedModel`` (or a bridge's ``original_model``), or what
            :func:`nopelens.models.hf.sink_parameters` read from one (a refusal keeps it as
            ``sink_parameters``).

    Returns:
        One row per (block, head): ``block``, ``head``, ``sink_logit`` (float64) and ``parameter``
        (the weight's name, e.g. ``model.layers.0.self_attn.sinks``); empty (same columns) when the
        model has no ``sinks`` parameter (:func:`nopelens.models.hf.sink_parameters`).
    """
    parameters = source if isinstance(source, dict) else sink_parameters(source)
    rows = [(block, head, float(logit), name) for block, (name, logits) in parameters.items()
            for head, logit in enumerate(logits.tolist())]
    return pd.DataFrame(rows, columns=LEARNED_SINK_COLUMNS)


def learned_sink_line(table: pd.DataFrame) -> str | None:
    """One line naming a :func:`learned_sink_logits` table's parameters and summarising its logits
    (their mean and range over blocks and heads), or None when it is empty.

    Example:
        >>> t = pd.DataFrame({"block": [0, 0, 2, 2], "head": [0, 1, 0, 1], "sink_logit": [0.5, -1.0, 2.0, 0.0],
        ...                   "parameter": ["model.layers.0.self_attn.sinks"] * 2 + ["model.layers.2.self_attn.sinks"] * 2})
        >>> learned_sink_line(t)
        'learned sink logits, from the weights (model.layers.{l}.self_attn.sinks, 2 blocks x 2 heads): mean 0.375, range -1 to 2'
    """
    if table.empty:
        return None
    names = sorted({re.sub(r"layers\.\d+\.", "layers.{l}.", name) for name in table["parameter"]})
    logits = table["sink_logit"]
    return (f"learned sink logits, from the weights ({', '.join(names)}, {table['block'].nunique()} blocks x "
            f"{table['head'].nunique()} heads): mean {logits.mean():.3g}, range {logits.min():.3g} to {logits.max():.3g}")


def sink_table(acts: Activations, eps: float = GU_EPSILON, n_tokens: int | None = GU_WINDOW,
               windows: dict[int, KeyWindow] | None = None, sinks: dict | None = None,
               sites: Sequence[str] | None = None) -> pd.DataFrame:
    """Sink mass, Gu sink score and sink flag for every collected ``hook_pattern`` site and head.

    Args:
        acts: activations with ``blocks.{l}.attn.hook_pattern`` sites.
        eps: Gu's threshold; a head is a sink when its score is > eps.
        n_tokens: Gu's window T; None skips the score (e.g. for sequences shorter than 64).
        windows: block -> its sliding window or chunk (blocks not listed: the causal rule), e.g.
            :meth:`nopelens.models.hf.HFDescription.key_windows`.
        sinks: block -> (kind, per-head logits or None) of a sink that is not a token
            (``learned``, ``per_token``, ``output_scale``; module docstring). An output-scale
            block needs its ``attn.hook_v`` and ``attn.hook_z`` collected.
        sites: the ``hook_pattern`` sites to read (default: every one collected); an empty list
            gives an empty table with the columns (e.g. every block's window is 1,
            :func:`sink_read_reason`).

    Returns:
        DataFrame with columns ``site, block, head, sink_mass, sink_score, is_sink, key_window,
        threshold_on`` (``sink_score``/``is_sink`` absent when ``n_tokens`` is None; ``key_window``
        says which queries were averaged, e.g. ``sliding window 4``; ``threshold_on`` which mass
        eps was applied to), and with ``sinks``: ``sink_kind``, ``sink_logit`` (the head's learned
        logit, NaN for a per-token sink) and ``learned_sink_mass`` (NaN on blocks without one).

    Raises:
        ValueError: if no pattern site was collected, or as :func:`sink_scores`.
        KeyError: if an output-scale block's ``hook_v``/``hook_z`` were not collected.
    """
    if sites is None:
        sites = [site for site in acts.patterns if site.endswith("hook_pattern")]
        if not sites:
            raise ValueError(f"no hook_pattern site was collected (collected: {sorted(acts.acts) + sorted(acts.patterns)})")
    if not sites:
        return empty_sink_table(n_tokens, sinks)
    windows = windows or {}
    rows = []
    for site in sites:
        block = site_block(site)
        keys = windows.get(block, CAUSAL)
        masses = sink_mass(acts.patterns[site], keys=keys)
        scores = sink_scores(acts.patterns[site], n_tokens, keys) if n_tokens is not None else None
        extra = _extra_sink(acts, site, (sinks or {}).get(block)) if sinks is not None else None
        rows += _sink_rows(site, keys, masses, scores, eps, extra, n_tokens)
    return pd.DataFrame(rows)


def empty_sink_table(n_tokens: int | None = GU_WINDOW, sinks: dict | None = None) -> pd.DataFrame:
    """A :func:`sink_table` with its columns and no row (no block can be read)."""
    columns = ["site", "block", "head", "sink_mass"] + (["sink_score", "gu_chance", "is_sink"] if n_tokens else [])
    columns += ["key_window", "threshold_on"] + (["sink_kind", "sink_logit", "learned_sink_mass"] if sinks is not None else [])
    return pd.DataFrame(columns=columns)


def _sink_rows(site: str, keys: KeyWindow, masses: np.ndarray, scores: np.ndarray | None, eps: float,
               extra: tuple | None, n_tokens: int | None) -> list[dict]:
    """One :func:`sink_table` row per head of ``site`` (``extra``: (kind, logits, learned mass) of
    the block's non-token sink when sinks were asked for, else None). ``is_sink`` is None (no
    verdict) where uniform attention over the scored queries already reaches ``eps``
    (:func:`gu_chance`): there the threshold cannot tell a sink from no preference."""
    rows = []
    chance = gu_chance(n_tokens, keys) if scores is not None else None
    for head, mass in enumerate(masses):
        row = dict(site=site, block=site_block(site), head=head, sink_mass=float(mass))
        if scores is not None:
            row.update(sink_score=float(scores[head]), gu_chance=chance,
                       is_sink=bool(scores[head] > eps) if chance < eps else None)
        row["key_window"] = keys.describe()
        row["threshold_on"] = "first token (Gu et al.)"
        if extra is not None:
            kind, logits, learned = extra
            row.update(sink_kind=kind or "", sink_logit=float(logits[head]) if logits is not None else np.nan,
                       learned_sink_mass=float(learned[head]) if learned is not None else np.nan)
        rows.append(row)
    return rows


def _extra_sink(acts: Activations, site: str, sink) -> tuple:
    """(kind, logits, mass per head) of a block's non-token sink; (None, None, None) without one."""
    if sink is None or sink[0] is None:
        return None, None, None
    kind, logits = sink
    logits = None if logits is None else np.asarray(logits, dtype=np.float64)
    if kind == "output_scale":
        prefix = site.rsplit(".", 1)[0]
        for name in ("hook_v", "hook_z"):
            if f"{prefix}.{name}" not in acts.acts:
                raise KeyError(f"the output-scale sink of {prefix} is read from {prefix}.hook_v and hook_z; collect them")
        mass = output_scale_sink_mass(acts.patterns[site], acts.acts[f"{prefix}.hook_v"], acts.acts[f"{prefix}.hook_z"],
                                      acts.sequence_id)
    else:
        mass = learned_sink_mass(acts.patterns[site])
    return kind, logits, mass


def sink_rate(table: pd.DataFrame) -> float:
    """Fraction of (layer, head) pairs flagged ``is_sink`` in a :func:`sink_table` (Gu et al. 2025),
    over the heads that got a verdict (NaN when none did: every block's window too short)."""
    if "is_sink" not in table or table.empty:
        raise ValueError("the table has no is_sink column (build it with n_tokens set)")
    return float(sink_flags(table).mean())


class SinkStats(Measurement):
    """:func:`sink_table`, measured while the model runs: per site and head, sums and counts only.

    Inside the hook each batch's ``[batch, head_index, query_pos, key_pos]`` pattern is checked
    (:func:`~nopelens.probes.collect.check_patterns`) and reduced on the model's device, in
    float64, to what the table's means need: the attention the real queries give the first
    real key (the sink candidate; left padding is skipped as :func:`sink_index` does) summed
    over the queries that see it (all but the sink's own row: ``sink_mass``; the first T
    positions, row 0 included: Gu et al.'s ``sink_score``), the queries counted; on a learned or
    per-token sink block the sum of 1 - row sum over real queries; on an output-scale block the
    sum of 1 - c per query (:func:`output_scale_sink_mass`, from the batch's ``attn.hook_v`` and
    ``attn.hook_z``, reduced at the end of the batch). Memory: a few numbers per site and head,
    whatever the number of tokens; nothing of size T x T outlives its batch.

    Sliding windows and chunks (``windows``) restrict every mean to the queries that can see
    key 0, as :func:`sink_table` does. The numbers equal :func:`sink_table`'s on the same
    patterns up to float32 round-off of its means (the in-memory table averages float32 copies;
    these sums are float64).

    Args:
        sequences: the token set (:class:`~nopelens.probes.stream.Sequences`).
        sites: ``blocks.{l}.attn.hook_pattern`` sites.
        eps, n_tokens, windows, sinks: as :func:`sink_table` (``n_tokens`` None: no score).

    Raises:
        ValueError: if no site is given, ``n_tokens`` is not an integer >= 1, or a sequence has
            fewer than ``n_tokens`` real tokens (before any forward pass); at the result, if no
            query row can see a sink other than itself.
    """

    def __init__(self, sequences, sites: Sequence[str], eps: float = GU_EPSILON, n_tokens: int | None = GU_WINDOW,
                 windows: dict[int, KeyWindow] | None = None, sinks: dict | None = None):
        if not sites:
            raise ValueError("no hook_pattern site given")
        if n_tokens is not None:
            if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
                raise ValueError(f"n_tokens (Gu's window T) must be an integer >= 1, got {n_tokens!r}")
            short = np.flatnonzero(np.diff(sequences.offsets) < n_tokens)
            if len(short):
                raise ValueError(f"sequences {short[:10].tolist()} have fewer than T={n_tokens} real tokens")
        self.sequences, self.site_list = sequences, list(sites)
        self.eps, self.n_tokens, self.windows, self.sinks = eps, n_tokens, dict(windows or {}), sinks
        self.n_positions = int(np.diff(sequences.offsets).max())
        self.sums: dict[str, dict[str, Tensor]] = {}  # site -> name -> [head] float64 (counts: [])
        self.pending: dict[str, Tensor] = {}  # an output-scale block's pattern and hook_v until its hook_z
        self.done = False

    def kind(self, site: str) -> str | None:
        """The block's non-token sink (``learned``, ``per_token``, ``output_scale``) or None."""
        sink = (self.sinks or {}).get(site_block(site))
        return None if sink is None else sink[0]

    def _outputs(self, site: str) -> tuple[str, str]:
        prefix = site.rsplit(".", 1)[0]
        return f"{prefix}.hook_v", f"{prefix}.hook_z"

    def sites(self, batch_index: int) -> list[str]:
        if self.done:
            return []
        extra = [name for site in self.site_list if self.kind(site) == "output_scale" for name in self._outputs(site)]
        return self.site_list + extra

    def _add(self, site: str, name: str, value: Tensor) -> None:
        held = self.sums.setdefault(site, {})
        value = value.to(torch.float64)
        held[name] = value if name not in held else held[name] + value.to(held[name].device)

    def update(self, site: str, value: Tensor, batch) -> None:
        if site not in self.site_list:  # hook_v or hook_z of an output-scale block
            self.pending[site] = value
            return
        mask = batch.mask
        check_patterns(value, mask, site, batch.rows.start)
        device = value.device
        real = mask.bool().to(device)
        position = (real.long().cumsum(-1) - 1).clamp(min=0)
        sees = self.windows.get(site_block(site), CAUSAL).sees_first(self.n_positions).to(device)[position] & real
        first = torch.as_tensor(sink_index(mask.numpy()), device=device)
        first_key = value[torch.arange(len(mask), device=device), :, :, first].to(torch.float64)  # [batch, head, query]
        rows = sees & (position >= 1)
        self._add(site, "mass", (first_key * rows[:, None]).sum((0, 2)))
        self._add(site, "mass_rows", rows.sum())
        if self.n_tokens is not None:
            rows = sees & (position < self.n_tokens)
            self._add(site, "score", (first_key * rows[:, None]).sum((0, 2)))
            self._add(site, "score_rows", rows.sum())
        kind = self.kind(site)
        if kind == "output_scale":
            self.pending[site] = value
        elif kind is not None:
            row_sum = (value.to(torch.float64) * real[:, None, None, :]).sum(-1)  # [batch, head, query]
            self._add(site, "learned", ((1.0 - row_sum) * real[:, None]).sum((0, 2)))
            self._add(site, "learned_rows", real.sum())

    def end_batch(self, batch) -> None:
        """Reduce each output-scale block's pattern, ``hook_v`` and ``hook_z`` of the batch to 1 - c."""
        for site in self.site_list:
            if self.kind(site) != "output_scale":
                continue
            v_site, z_site = self._outputs(site)
            pattern = self.pending.pop(site)
            real = batch.mask.bool().to(pattern.device)
            p = pattern.to(torch.float64) * real[:, None, None, :]
            v = self.pending.pop(v_site).to(pattern.device, torch.float64)
            z = self.pending.pop(z_site).to(pattern.device, torch.float64)
            v = v.repeat_interleave(p.shape[1] // v.shape[2], dim=2)  # key-value heads -> query heads
            weighted = torch.einsum("bhij,bjhd->bihd", p, v)
            norm = (weighted * weighted).sum(-1)
            shown = (norm > 0) & real[:, :, None]  # a row whose weighted value is 0 shows no scale
            scale = (z * weighted).sum(-1) / torch.where(norm > 0, norm, 1.0)  # [batch, query, head]
            self._add(site, "learned", torch.where(shown, 1.0 - scale, 0.0).sum((0, 1)))
            self._add(site, "learned_rows", shown.sum((0, 1)))
        self.pending = {}

    def end_pass(self) -> bool:
        self.done = True
        return False

    def spawn(self) -> "SinkStats":
        other = object.__new__(SinkStats)
        other.__dict__.update(self.__dict__)
        other.sums, other.pending = {}, {}
        return other

    def merge(self, other: "SinkStats") -> None:
        for site, held in other.sums.items():
            for name, value in held.items():
                self._add(site, name, value)

    def result(self) -> pd.DataFrame:
        """The :func:`sink_table` rows (same columns)."""
        rows = []
        for site in self.site_list:
            if site not in self.sums:
                raise RuntimeError(f"{site}: no batch was measured")
            held = {name: value.cpu().numpy() for name, value in self.sums[site].items()}
            keys = self.windows.get(site_block(site), CAUSAL)
            if held["mass_rows"] == 0:
                raise ValueError(f"{site}: " + _no_sink_row(keys, self.n_positions))
            masses = held["mass"] / held["mass_rows"]
            scores = held["score"] / held["score_rows"] if self.n_tokens is not None else None
            extra = None
            if self.sinks is not None:
                kind, logits = self.sinks.get(site_block(site), (None, None))
                unshown = np.flatnonzero(held["learned_rows"] == 0).tolist() if kind == "output_scale" else []
                if unshown:
                    raise ValueError(f"{site}: output-scale sink heads {unshown}: every weighted value is 0, so no "
                                     "query shows its output scale (sink mass not measurable)")
                extra = (None, None, None) if kind is None else (
                    kind, None if logits is None else np.asarray(logits, dtype=np.float64),
                    held["learned"] / held["learned_rows"])
            rows += _sink_rows(site, keys, masses, scores, self.eps, extra, self.n_tokens)
        return pd.DataFrame(rows)


def sink_mass_by_position_table(acts: Activations, windows: dict[int, KeyWindow] | None = None) -> pd.DataFrame:
    """Tidy sink mass vs query position: ``site, block, head, query_position, sink_mass, n_sequences``
    (query positions that cannot see key 0 under their block's window are left out)."""
    frames = []
    windows = windows or {}
    for site in (s for s in acts.patterns if s.endswith("hook_pattern")):
        mass, count = sink_mass_by_position(acts.patterns[site], windows.get(site_block(site), CAUSAL))
        heads, positions = np.meshgrid(np.arange(mass.shape[0]), np.arange(mass.shape[1]), indexing="ij")
        frames.append(pd.DataFrame(dict(site=site, block=site_block(site), head=heads.ravel(),
                                        query_position=positions.ravel(), sink_mass=mass.ravel(),
                                        n_sequences=np.broadcast_to(count, mass.shape).ravel())).query("n_sequences > 0"))
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
    windows: dict[int, KeyWindow] | None = None,
) -> pd.DataFrame:
    """Sink statistics of every layer and head with and without a BOS token in front.

    ``tokens`` are taken as BOS-free; the ``with_bos`` run inserts ``bos_token_id`` before the
    first real token of each row. In both runs, key 0 is the first real token, so the comparison
    asks whether a dedicated BOS draws more sink mass than an ordinary first token.

    Returns:
        :func:`sink_table` rows of both runs with a ``condition`` column (``without_bos``,
        ``with_bos``); ``windows`` as :func:`sink_table`.
    """
    sites = act_names("pattern", n_layers)
    with_tokens, with_mask = prepend_bos(tokens, bos_token_id, attention_mask)
    if attention_mask is None:  # all real: a module that takes no mask is not handed one
        with_mask = None
    frames = []
    for condition, toks, mask in (("without_bos", tokens, attention_mask), ("with_bos", with_tokens, with_mask)):
        acts = collect(model, toks, sites, attention_mask=mask, batch_size=batch_size)
        frames.append(sink_table(acts, eps, n_tokens, windows).assign(condition=condition))
    return pd.concat(frames, ignore_index=True)


def attention_variance(acts: Activations, sites: Sequence[str] | None = None,
                       windows: dict[int, KeyWindow] | None = None) -> pd.DataFrame:
    """Per-position variance of attention outputs across sequences, averaged over coordinates.

    For each site and position i: Var_s(z_{s,i,c}) over the sequences s that have position i
    (unbiased, ddof = 1), then the mean over coordinates c. This is the definition under which
    near-uniform causal attention over independent tokens gives Var(v) / n_i, with n_i = i + 1
    visible keys (see the module docstring); under a sliding window w or chunk c of the block,
    n_i = min(i + 1, w) or i mod c + 1, given in ``visible_keys``. Use ``blocks.{l}.hook_attn_out``
    (or ``attn.hook_z``) sites.

    Args:
        acts: activations at the sites.
        sites: default: every collected non-pattern site.
        windows: block -> its sliding window or chunk (blocks not listed: the causal rule).

    Returns:
        DataFrame ``site, block, position, visible_keys, variance, n_sequences`` (positions with
        >= 2 sequences).

    Raises:
        KeyError: for a site that was not collected.
        ValueError: if there is no site, or no position has two sequences.
    """
    sites = [s for s in acts.acts] if sites is None else list(sites)
    if not sites:
        raise ValueError("no non-pattern site was collected; collect blocks.{l}.hook_attn_out or attn.hook_z sites")
    windows = windows or {}
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
        keys = windows.get(site_block(site), CAUSAL)
        visible = keys.n_visible(int(frame["position"].max()) + 1).numpy()
        frames.append(frame.assign(site=site, block=site_block(site), visible_keys=visible[frame["position"]]))
    table = pd.concat(frames, ignore_index=True)
    return table[["site", "block", "position", "visible_keys", "variance", "n_sequences"]]


def variance_slopes(table: pd.DataFrame) -> pd.DataFrame:
    """Least-squares slope of log variance against log(visible keys), per site.

    The visible keys are i + 1 under the causal rule (the ``visible_keys`` column of
    :func:`attention_variance`; a table without it is read as i + 1). A slope of -1 is the
    1/(i+1) shrinkage law (Chi et al. 2023; seed 004).

    Returns:
        DataFrame ``site, block, slope, intercept, r_value, n_positions``.

    Raises:
        ValueError: if a site has fewer than 3 positions or distinct key counts, or a variance <= 0.
    """
    rows = []
    for site, group in table.groupby("site", sort=False):
        if len(group) < 3:
            raise ValueError(f"site {site!r}: a slope needs >= 3 positions, got {len(group)}")
        if (group["variance"] <= 0).any():
            raise ValueError(f"site {site!r}: variance <= 0 at some position; the log-log fit is undefined")
        keys = group["visible_keys"] if "visible_keys" in group else group["position"] + 1.0
        if keys.nunique() < 3:
            raise ValueError(f"site {site!r}: a slope needs >= 3 distinct numbers of visible keys, got "
                             f"{sorted(keys.unique().tolist())} (a window shorter than 3?)")
        fit = stats.linregress(np.log(keys.astype(float)), np.log(group["variance"]))
        rows.append(dict(site=site, block=site_block(site), slope=fit.slope, intercept=fit.intercept,
                         r_value=fit.rvalue, n_positions=len(group)))
    return pd.DataFrame(rows)


def variance_shrinkage(
    model: torch.nn.Module,
    tokens: Int[torch.Tensor, "batch pos"],
    layers: Sequence[int],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    batch_size: int = 256,
    windows: dict[int, KeyWindow] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Collect ``blocks.{l}.hook_attn_out`` and return (:func:`attention_variance`, :func:`variance_slopes`).

    When every sequence starts with the same token (a BOS), position 0 sees only that token, so
    its output is identical across sequences (variance 0, no log): position 0 is left out of both
    tables, and the variance table says so in its ``note`` column.
    """
    sites = act_names("attn_out", layers)
    acts = collect(model, tokens, sites, attention_mask=attention_mask, batch_size=batch_size)
    table = attention_variance(acts, windows=windows).assign(note="")
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
                             vectorized=False, n_resamples=n_boot, method="percentile", random_state=random_state(seed))
    return rate, float(result.confidence_interval.low), float(result.confidence_interval.high)
