"""Position directions: the index probe's direction projected out of, or moved along in, the
residual stream at one layer; what the later layers read and the loss then
(:func:`direction_interventions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from sklearn.metrics import r2_score
from torch import Tensor

from nopelens.models.progress import progress_bar
from nopelens.probes import (
    Activations,
    HookList,
    collect,
    make_probe,
    probe_absolute_index,
    resid_site,
    sequence_splits,
)

from .hooks import intervention, project_out_hook, shift_hook
from .measure import ProbeSettings, behavior, behavior_change, later_tokens


@dataclass(frozen=True)
class IndexDirection:
    """The absolute-index direction of a ridge probe, in residual-stream units.

    prediction(x) = (x - center) . weights + intercept, from the ``Pipeline(RoundoffScaler,
    GroupedRidgeCV)`` of :func:`~nopelens.probes.make_probe` (penalty chosen by CV grouped by
    sequence): weights = coef / scale, center = the scaler's mean (features whose spread is only
    round-off have infinite scale, hence weight 0).

    Attributes:
        layer: DESIGN.md layer the probe reads.
        weights: ``[d_model]``, positions per unit of residual stream.
        center: ``[d_model]``.
        intercept: the prediction at ``center``.
    """

    layer: int
    weights: Tensor
    center: Tensor
    intercept: float

    @classmethod
    def fit(cls, acts: Activations, layer: int, seed: int = 0) -> "IndexDirection":
        """Fit a regression probe for the index on every sample of ``acts`` at ``layer``."""
        site = resid_site(layer)
        pipeline = make_probe("regression", seed=seed, dtype=acts.dtype(site)).fit(
            acts.features(site), acts.position, linear__groups=acts.sequence_id
        )
        scaler, ridge = pipeline[0], pipeline[-1]
        weights = torch.as_tensor(ridge.coef_ / scaler.scale_, dtype=torch.float64)
        if not bool(torch.isfinite(weights).all()) or float(weights.norm()) == 0:
            raise ValueError(f"the index probe at layer {layer} has no usable direction (zero or non-finite weights)")
        return cls(layer, weights.float(), torch.as_tensor(scaler.mean_, dtype=torch.float32), float(ridge.intercept_))

    def predict(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "..."]:
        """The probe's index read of residual states."""
        return (resid.double() - self.center.double()) @ self.weights.double() + self.intercept

    def shift(self, k: float) -> HookList:
        """Hooks moving every state at this layer by k w / |w|^2 (the probe then reads i + k)."""
        step = self.weights.double() / self.weights.double().pow(2).sum()
        return [(resid_site(self.layer), shift_hook(step.float(), k))]

    def project_out(self) -> HookList:
        """Hooks removing the states' component along w (about the probe's center)."""
        return [(resid_site(self.layer), project_out_hook(self.weights, self.center))]


def clean_probe_reads(
    clean: Activations, changed: Activations, site: str, n_splits: int, seed: int
) -> tuple[float, float]:
    """Out-of-fold: fit an index probe on the clean states of the fitting sequences and read the
    changed states of the held-out ones. Returns (R^2 of that read, mean read minus clean read)."""
    y, groups = clean.position, clean.sequence_id
    X_clean, X_changed = clean.features(site), changed.features(site)
    read_clean, read_changed = np.empty(len(y)), np.empty(len(y))
    for fit, score in sequence_splits(groups, n_splits):
        probe = make_probe("regression", seed=seed, dtype=clean.dtype(site)).fit(
            X_clean[fit], y[fit], linear__groups=groups[fit]
        )
        read_clean[score], read_changed[score] = probe.predict(X_clean[score]), probe.predict(X_changed[score])
    r2 = r2_score(y, read_changed)
    return float(r2), float(np.mean(read_changed - read_clean))


def direction_interventions(
    model,
    tokens: Tensor,
    attention_mask: Tensor,
    n_layers: int,
    settings: ProbeSettings,
    layers: Sequence[int] | None = None,
    shifts: Sequence[int] = (4,),
    targets: Tensor | None = None,
    loss_mask: Tensor | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Project out or shift the index direction at each layer; read the next layers and the loss.

    For each intervened layer l (default 1 .. n_layers - 1) and each later layer l' >= l, one row
    per intervention (``project_out``, ``shift`` with ``k``): ``r2_refit`` (a probe refitted on the
    changed states, out of fold), ``r2_clean_probe`` and ``read_shift`` (an out-of-fold probe fitted
    on clean states reads the changed ones: R^2, and mean read minus clean read, in positions;
    ``read_shift / k`` is the fraction of the shift the later layer carries), and ``loss_delta``
    and ``exact_match_delta`` of the whole model with their paired CIs. ``progress``: a bar over
    the intervened layers.
    """
    layers = list(range(1, n_layers)) if layers is None else list(layers)
    sites = [resid_site(layer) for layer in range(n_layers + 1)]
    clean = later_tokens(collect(model, tokens, sites, attention_mask=attention_mask, batch_size=32))
    clean_behavior = behavior(model, tokens, attention_mask, targets, loss_mask, check_finite=True)
    rows = []
    for layer in progress_bar(layers, desc="index directions", unit="layer", disable=not progress):
        direction = IndexDirection.fit(clean, layer, settings.seed)
        for name, k, hooks in [("project_out", 0, direction.project_out())] + [
            ("shift", k, direction.shift(k)) for k in shifts
        ]:
            with intervention(model, hooks):
                changed = later_tokens(
                    collect(model, tokens, sites[layer:], attention_mask=attention_mask, batch_size=32)
                )
            effect = {
                f"{row['metric']}_{key}": row[key]
                for row in behavior_change(
                    clean_behavior,
                    behavior(model, tokens, attention_mask, targets, loss_mask, hooks),
                    settings.n_boot,
                    settings.seed,
                )
                for key in ("delta", "delta_ci_low", "delta_ci_high")
            }
            refit = probe_absolute_index(
                changed,
                sites=sites[layer:],
                tasks=("regression",),
                controls=False,
                n_splits=settings.n_splits,
                n_boot=settings.n_boot,
                seed=settings.seed,
            )
            refit = refit[(refit["probe"] == "linear") & (refit["metric"] == "r2")].set_index("site")
            for read_layer in range(layer, n_layers + 1):
                site = resid_site(read_layer)
                r2_clean_probe, read_shift = clean_probe_reads(clean, changed, site, settings.n_splits, settings.seed)
                rows.append(
                    dict(
                        intervention=name,
                        k=k,
                        layer=layer,
                        read_layer=read_layer,
                        r2_refit=refit.loc[site, "value"],
                        r2_refit_ci_low=refit.loc[site, "ci_low"],
                        r2_refit_ci_high=refit.loc[site, "ci_high"],
                        r2_clean_probe=r2_clean_probe,
                        read_shift=read_shift,
                        **effect,
                    )
                )
    return pd.DataFrame(rows)
