"""Attention sinks, per layer and head: the sink table (:func:`sink_table`), one measurement
(:class:`SinkStats`) run on a live model (:func:`~nopelens.probes.stream.run`) or fed cached
activations (:func:`~nopelens.probes.stream.replay`), and the BOS comparison (:func:`compare_bos`).

The definitions (first real key, sink mass, Gu et al.'s score and threshold, sliding windows) and
their per-sequence pattern reads are :mod:`nopelens.probes.sink_patterns`; learned sink logits
from the weights :mod:`nopelens.probes.learned_sinks`; variance shrinkage
:mod:`nopelens.probes.variance`. Their names are re-exported here.

Sinks that are not a token (passed per block as ``sinks``: kind and per-head logits, from
:func:`nopelens.models.hf.learned_sinks`): a *learned* sink (GPT-OSS, Flint, MiMo-V2-Flash's
sliding layers) is one more logit s_h in every row's softmax denominator with a zero value, so
the returned pattern sums to 1 - p_sink: its mass is the mean of 1 - row sum over the real query
rows; a *per-token* sink (Inkling 2) is read the same way. An *output-scale* sink (Granite SWA)
multiplies the head's output by sigmoid(lse_i - s_h) = 1 - p_sink and leaves the pattern a plain
softmax, so its mass is read from that scale: the output ``hook_z`` against the pattern-weighted
values ``hook_v`` (:meth:`SinkStats.end_batch`). These are reported next to Gu's first-token
score; the threshold eps is applied to the first-token score only (``threshold_on``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from nopelens.models.compat import moved_names
from nopelens.models.hooks import act_names
from nopelens.models.masks import CAUSAL, KeyWindow

from .collect import Activations, check_patterns, collect, site_block
from .learned_sinks import LEARNED_SINK_COLUMNS, learned_sink_line, learned_sink_logits  # noqa: F401  (re-exported)
from .sink_patterns import (  # noqa: F401  (re-exported)
    GU_EPSILON,
    GU_WINDOW,
    check_gu_window,
    first_key_sums,
    gu_chance,
    no_sink_row_reason,
    sink_index,
    sink_mass,
    sink_mass_by_position,
    sink_mass_by_query,
    sink_rate_ci,
    sink_read_reason,
    sink_scores,
    strip_padding,
    uniform_sink_score,
)
from .stream import Measurement, Sequences, replay
from .variance import attention_variance, variance_read_reason, variance_shrinkage, variance_slopes  # noqa: F401  (re-exported)


def sink_flags(table: pd.DataFrame) -> pd.Series:
    """``is_sink`` as floats (1, 0, NaN where no verdict was possible), also as read back from CSV.

    Raises:
        ValueError: if the table has no ``is_sink`` column.
    """
    if "is_sink" not in table:
        raise ValueError("the table has no is_sink column (build it with n_tokens set)")
    flags = table["is_sink"].map({True: 1.0, False: 0.0, "True": 1.0, "False": 0.0})
    return flags.astype(float)


def sink_table(
    acts: Activations,
    eps: float = GU_EPSILON,
    n_tokens: int | None = GU_WINDOW,
    windows: dict[int, KeyWindow] | None = None,
    sinks: dict | None = None,
    sites: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Sink mass, Gu sink score and sink flag for every collected ``hook_pattern`` site and head: the
    cached activations replayed into :class:`SinkStats` (one definition, streamed or in memory).

    Args:
        acts: activations with ``blocks.{l}.attn.hook_pattern`` sites.
        eps: Gu's threshold; a head is a sink when its score is > eps.
        n_tokens: Gu's window T; None skips the score (e.g. for sequences shorter than 64).
        windows: block -> its sliding window or chunk (blocks not listed: the causal rule), e.g.
            :meth:`nopelens.models.hf.HFDescription.key_windows`; default: what :func:`collect`
            recorded with the activations (``acts.windows``).
        sinks: block -> (kind, per-head logits or None) of a sink that is not a token
            (``learned``, ``per_token``, ``output_scale``; module docstring). An output-scale
            block needs its ``attn.hook_v`` and ``attn.hook_z`` collected. Default: the learned sinks
            :func:`collect` recorded (``acts.sinks``).
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
        ValueError: if no pattern site was collected, or as :class:`SinkStats`.
        KeyError: for a site that was not collected (an output-scale block's ``hook_v``/``hook_z`` too).
    """
    if sites is None:
        sites = [site for site in acts.patterns if site.endswith("hook_pattern")]
        if not sites:
            raise ValueError(
                f"no hook_pattern site was collected (collected: {sorted(acts.acts) + sorted(acts.patterns)})"
            )
    if not sites:
        return empty_sink_table(n_tokens, sinks)
    windows = acts.windows if windows is None else windows
    sinks = acts.sinks if sinks is None else sinks
    sequences = Sequences.of_activations(acts)
    return replay(acts, [SinkStats(sequences, sites, eps, n_tokens, windows, sinks)], sequences=sequences)[0]


def empty_sink_table(n_tokens: int | None = GU_WINDOW, sinks: dict | None = None) -> pd.DataFrame:
    """A :func:`sink_table` with its columns and no row (no block can be read)."""
    columns = ["site", "block", "head", "sink_mass"] + (["sink_score", "gu_chance", "is_sink"] if n_tokens else [])
    columns += ["key_window", "threshold_on"] + (
        ["sink_kind", "sink_logit", "learned_sink_mass"] if sinks is not None else []
    )
    return pd.DataFrame(columns=columns)


def _sink_rows(
    site: str,
    keys: KeyWindow,
    masses: np.ndarray,
    scores: np.ndarray | None,
    eps: float,
    extra: tuple | None,
    n_tokens: int | None,
) -> list[dict]:
    """One :func:`sink_table` row per head of ``site`` (``extra``: (kind, logits, learned mass) of
    the block's non-token sink when sinks were asked for, else None). ``is_sink`` is None (no
    verdict) where uniform attention over the scored queries already reaches ``eps``
    (:func:`gu_chance`): there the threshold cannot tell a sink from no preference."""
    rows = []
    chance = gu_chance(n_tokens, keys) if scores is not None else None
    for head, mass in enumerate(masses):
        row = dict(site=site, block=site_block(site), head=head, sink_mass=float(mass))
        if scores is not None:
            row.update(
                sink_score=float(scores[head]),
                gu_chance=chance,
                is_sink=bool(scores[head] > eps) if chance < eps else None,
            )
        row["key_window"] = keys.describe()
        row["threshold_on"] = "first token (Gu et al.)"
        if extra is not None:
            kind, logits, learned = extra
            row.update(
                sink_kind=kind or "",
                sink_logit=float(logits[head]) if logits is not None else np.nan,
                learned_sink_mass=float(learned[head]) if learned is not None else np.nan,
            )
        rows.append(row)
    return rows


def sink_rate(table: pd.DataFrame) -> float:
    """Fraction of (layer, head) pairs flagged ``is_sink`` in a :func:`sink_table` (Gu et al. 2025),
    over the heads that got a verdict (NaN when none did: every block's window too short)."""
    if "is_sink" not in table or table.empty:
        raise ValueError("the table has no is_sink column (build it with n_tokens set)")
    return float(sink_flags(table).mean())


class SinkStats(Measurement):
    """The sink table (:func:`sink_table`) as sums and counts per site and head, measured live or replayed.

    Inside the hook each batch's ``[batch, head_index, query_pos, key_pos]`` pattern is checked
    (:func:`~nopelens.probes.collect.check_patterns`) and reduced on the model's device to float64
    sums and row counts: the sink read :func:`first_key_sums` (rows 1.. for ``sink_mass``, 0..T-1
    for ``sink_score``, within ``windows``); on a learned or per-token sink block 1 - row sum over
    real queries; on an output-scale block 1 - c per query (:meth:`end_batch`, from ``attn.hook_v``
    and ``attn.hook_z``). Memory: a few numbers per site and head; nothing T x T outlives its batch.

    Args:
        sequences: the token set (:class:`~nopelens.probes.stream.Sequences`).
        sites: ``blocks.{l}.attn.hook_pattern`` sites.
        eps, n_tokens, windows, sinks: as :func:`sink_table` (``n_tokens`` None: no score). ``windows``
            None: the mask is unknown, so a visible first key given exactly zero weight is refused
            (:func:`first_key_sums`); a dict (``{}``: causal everywhere) is the model's declared mask.

    Raises:
        ValueError: if no site is given, or as :func:`check_gu_window` (before any forward pass);
            at the result, if no query row can see a sink other than itself.
    """

    def __init__(
        self,
        sequences,
        sites: Sequence[str],
        eps: float = GU_EPSILON,
        n_tokens: int | None = GU_WINDOW,
        windows: dict[int, KeyWindow] | None = None,
        sinks: dict | None = None,
    ):
        if not sites:
            raise ValueError("no hook_pattern site given")
        if n_tokens is not None:
            check_gu_window(n_tokens, np.diff(sequences.offsets))
        self.sequences, self.site_list = sequences, list(sites)
        self.eps, self.n_tokens, self.windows, self.sinks = eps, n_tokens, dict(windows or {}), sinks
        self.mask_declared = windows is not None  # {}: causal everywhere, as the model declares; None: unknown
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
        kind = self.kind(site)
        sink = None if self.sinks is None else kind in ("learned", "per_token")
        check_patterns(value, batch.mask, site, batch.rows.start, sink)
        reads = [("mass", 1, None)] + ([("score", 0, self.n_tokens)] if self.n_tokens is not None else [])
        for name, start, stop in reads:
            try:
                keys = self.windows.get(site_block(site), CAUSAL)
                sums, rows = first_key_sums(value, batch.mask, keys, start, stop, underflow_ok=self.mask_declared)
            except ValueError as error:
                raise ValueError(f"site {site!r}, sequences from {batch.rows.start}: {error}") from None
            self._add(site, name, sums.sum(-1))
            self._add(site, f"{name}_rows", rows.sum())
        real = batch.mask.bool().to(value.device)
        if kind == "output_scale":
            self.pending[site] = value
        elif kind is not None:
            row_sum = (value.to(torch.float64) * real[:, None, None, :]).sum(-1)  # [batch, head, query]
            self._add(site, "learned", ((1.0 - row_sum) * real[:, None]).sum((0, 2)))
            self._add(site, "learned_rows", real.sum())

    def end_batch(self, batch) -> None:
        """Reduce each output-scale block's pattern, ``hook_v`` and ``hook_z`` of the batch to 1 - c.

        Granite SWA's eager attention computes the plain softmax pattern p, then multiplies each
        head's output by c = sigmoid(lse_i - s_h) = 1 - p_sink (``transformers/models/granite_swa/
        modeling_granite_swa.py``): z_i = c_i (sum_j p_ij v_j). c_i of each (query, head) is fitted by
        least squares over d_head, <z_i, pv_i> / <pv_i, pv_i>; a row whose weighted value pv_i is 0
        (every value it weighs is 0, e.g. a pad embedding's) shows no scale and is left out of the mean.
        """
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
                raise ValueError(f"{site}: " + no_sink_row_reason(keys, self.n_positions))
            masses = held["mass"] / held["mass_rows"]
            scores = held["score"] / held["score_rows"] if self.n_tokens is not None else None
            extra = None
            if self.sinks is not None:
                kind, logits = self.sinks.get(site_block(site), (None, None))
                unshown = np.flatnonzero(held["learned_rows"] == 0).tolist() if kind == "output_scale" else []
                if unshown:
                    raise ValueError(
                        f"{site}: output-scale sink heads {unshown}: every weighted value is 0, so no "
                        "query shows its output scale (sink mass not measurable)"
                    )
                extra = (
                    (None, None, None)
                    if kind is None
                    else (
                        kind,
                        None if logits is None else np.asarray(logits, dtype=np.float64),
                        held["learned"] / held["learned_rows"],
                    )
                )
            rows += _sink_rows(site, keys, masses, scores, self.eps, extra, self.n_tokens)
        return pd.DataFrame(rows)


def prepend_bos(
    tokens: Int[torch.Tensor, "batch pos"],
    bos_token_id: int,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
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


__getattr__ = moved_names(
    __name__,
    gone={
        "learned_sink_mass": "sink_table(acts, sinks=...) reports a learned sink's mass (SinkStats)",
        "output_scale_sink_mass": "sink_table(acts, sinks=...) reports an output-scale sink's mass (SinkStats)",
        "sink_mass_by_position_table": "use sink_mass_by_position(patterns) per site",
    },
)
