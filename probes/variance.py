"""Variance shrinkage of attention outputs, per position: Chi et al. 2023, "Latent positional
information is in the self-attention variance of transformer language models without positional
embeddings" (seed ``004_150f630256efbd1c.txt``, "Softmax variance shrinkage").

With near-uniform causal attention, z_i = sum_{j<=i} v_j / (i + 1) averages i + 1 independent value
vectors, so the variance of each coordinate of z_i across sequences is Var(v) / (i + 1);
:func:`attention_variance` measures it per position (cached activations replayed into the streamed
:class:`AttentionVariance`: one definition of the read, streamed or in
memory) and :func:`variance_slopes` fits the log-log slope (-1 for the 1/(i+1) law).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from scipy import stats
from torch import Tensor

from nopelens.models.hooks import act_names
from nopelens.models.masks import CAUSAL, KeyWindow

from .collect import Activations, collect, site_block
from .stream import Batch, Measurement, Sequences, replay


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
    return (
        f"{keys.describe()}: the queries from position {first_position} on see {counts} keys; "
        "a variance slope needs 3 distinct numbers"
    )


def attention_variance(
    acts: Activations, sites: Sequence[str] | None = None, windows: dict[int, KeyWindow] | None = None
) -> pd.DataFrame:
    """Per-position variance of attention outputs across sequences, averaged over coordinates: the
    cached activations replayed (:func:`~nopelens.probes.stream.replay`) into
    :class:`AttentionVariance`, the streamed read.

    For each site and position i: Var_s(z_{s,i,c}) over the sequences s that have position i
    (unbiased, ddof = 1), then the mean over coordinates c. This is the definition under which
    near-uniform causal attention over independent tokens gives Var(v) / n_i, with n_i = i + 1
    visible keys (see the module docstring); under a sliding window w or chunk c of the block,
    n_i = min(i + 1, w) or i mod c + 1, given in ``visible_keys``. Use ``blocks.{l}.hook_attn_out``
    (or ``attn.hook_z``) sites.

    Args:
        acts: activations at the sites.
        sites: default: every collected non-pattern site.
        windows: block -> its sliding window or chunk (blocks not listed: the causal rule); default:
            what :func:`~nopelens.probes.collect` recorded (``acts.windows``).

    Returns:
        DataFrame ``site, block, position, visible_keys, variance, n_sequences`` (positions with
        >= 2 sequences).

    Raises:
        KeyError: for a site that was not collected.
        ValueError: if there is no site, or no position has two sequences.
    """
    sites = list(acts.acts) if sites is None else list(sites)
    if not sites:
        raise ValueError("no non-pattern site was collected; collect blocks.{l}.hook_attn_out or attn.hook_z sites")
    sequences = Sequences.of_activations(acts)
    windows = acts.windows if windows is None else windows
    return replay(acts, [AttentionVariance(sequences, sites, windows)], sequences=sequences)[0]


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
            raise ValueError(
                f"site {site!r}: a slope needs >= 3 distinct numbers of visible keys, got "
                f"{sorted(keys.unique().tolist())} (a window shorter than 3?)"
            )
        fit = stats.linregress(np.log(keys.astype(float)), np.log(group["variance"]))
        rows.append(
            dict(
                site=site,
                block=site_block(site),
                slope=fit.slope,
                intercept=fit.intercept,
                r_value=fit.rvalue,
                n_positions=len(group),
            )
        )
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
        table = table.assign(
            note=f"position 0 left out: every sequence starts with token {int(first[0])} (BOS), "
            "so its output never varies"
        )
    return table, variance_slopes(table)


# ----------------------------------------------------------------------------- the streamed read


ROWS_AT_ONCE = 1 << 20
"""Elements (rows x features) :class:`AttentionVariance` converts to float64 at a time (8 MB)."""


class AttentionVariance(Measurement):
    """Per-position variance of site outputs across sequences, averaged over coordinates, streamed.

    The table of :func:`nopelens.probes.variance.attention_variance` (which replays cached activations
    into this measurement): for each site and position
    i, Var_s(z_{s,i,c}) over the sequences s that have position i (ddof = 1), then the mean over
    coordinates c. Per position it keeps the count n, the mean and the sum of squared deviations
    M2 ``[d]`` (float64); batches combine by Chan, Golub & LeVeque's pairwise update
    (M2 = M2_a + M2_b + delta^2 n_a n_b / n, delta = mean_b - mean_a), which stays accurate where
    sums of squares would cancel. Memory: positions x d_model per site.

    Args:
        sequences: the token set.
        sites: ``blocks.{l}.hook_attn_out`` (or ``attn.hook_z``) sites.
        windows: block -> its sliding window or chunk, for the ``visible_keys`` column (blocks not
            listed: the causal rule, i + 1).
    """

    def __init__(self, sequences: Sequences, sites: Sequence[str], windows: dict[int, KeyWindow] | None = None):
        if not sites:
            raise ValueError("no site given; name blocks.{l}.hook_attn_out or attn.hook_z sites")
        self.sequences, self.site_list = sequences, list(sites)
        self.windows = dict(windows or {})
        self.n_positions = int(sequences.position.max()) + 1
        self.state: dict[str, tuple[Tensor, Tensor, Tensor]] = {}  # site -> (n [P], mean [P, d], M2 [P, d])
        self.done = False

    def sites(self, batch_index: int) -> Sequence[str]:
        return [] if self.done else self.site_list

    def update(self, site: str, value: Tensor, batch: Batch) -> None:
        rows = batch.real(site, value)
        rows = rows.reshape(len(rows), -1)
        position = torch.as_tensor(batch.position, device=rows.device)
        count = torch.bincount(position, minlength=self.n_positions).to(torch.float64)
        present = count > 0
        mean = torch.zeros(self.n_positions, rows.shape[1], dtype=torch.float64, device=rows.device)
        # float64 copies a few MB at a time: glibc serves those from its heap and reuses them, where one
        # copy of the batch (64 MB at 16k x 512) is mapped afresh each call, page by page (4x slower here)
        step = max(1, ROWS_AT_ONCE // rows.shape[1])
        parts = [slice(start, start + step) for start in range(0, len(rows), step)]
        for part in parts:
            mean.index_add_(0, position[part], rows[part].to(torch.float64))
        mean[present] /= count[present, None]
        m2 = torch.zeros_like(mean)
        for part in parts:
            X = rows[part].to(torch.float64, copy=True)
            m2.index_add_(0, position[part], X.sub_(mean.index_select(0, position[part])).mul_(X))
        self._combine(site, (count, mean, m2))

    def _combine(self, site: str, part: tuple[Tensor, Tensor, Tensor]) -> None:
        if site not in self.state:
            self.state[site] = part
            return
        (n_a, mean_a, m2_a), (n_b, mean_b, m2_b) = self.state[site], (t.to(self.state[site][0].device) for t in part)
        n = n_a + n_b
        share = torch.where(n > 0, n_b / torch.where(n > 0, n, 1), 0)[:, None]
        delta = mean_b - mean_a
        self.state[site] = (n, mean_a + delta * share, m2_a + m2_b + delta**2 * (n_a[:, None] * share))

    def end_pass(self) -> bool:
        self.done = True
        return False

    def spawn(self) -> "AttentionVariance":
        other = AttentionVariance(self.sequences, self.site_list, self.windows)
        other.done = self.done
        return other

    def merge(self, other: "AttentionVariance") -> None:
        for site, part in other.state.items():
            self._combine(site, part)

    def result(self) -> pd.DataFrame:
        """DataFrame ``site, block, position, visible_keys, variance, n_sequences`` (positions with >= 2 sequences).

        Raises:
            ValueError: if no position of a site has two sequences.
        """
        frames = []
        for site in self.site_list:
            n, _, m2 = self.state[site]
            shared = n >= 2
            if not bool(shared.any()):
                raise ValueError(f"site {site!r}: no position is shared by two sequences")
            variance = (m2[shared] / (n[shared, None] - 1)).mean(1)
            position = torch.nonzero(shared).flatten().cpu().numpy().astype(int)
            visible = self.windows.get(site_block(site), CAUSAL).n_visible(self.n_positions).numpy()
            frames.append(
                pd.DataFrame(
                    {
                        "site": site,
                        "block": site_block(site),
                        "position": position,
                        "visible_keys": visible[position],
                        "variance": variance.cpu().numpy(),
                        "n_sequences": n[shared].cpu().numpy().astype(int),
                    }
                )
            )
        return pd.concat(frames, ignore_index=True)[
            ["site", "block", "position", "visible_keys", "variance", "n_sequences"]
        ]
