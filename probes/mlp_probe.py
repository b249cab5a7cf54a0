"""Haviv et al.'s position probe: a 2-layer ReLU MLP classifier over absolute positions, scored by
the mean absolute distance (MAD) of its argmax, next to the linear probes on the same splits.

Haviv, Ram, Press, Izsak & Levy 2022 ("Transformer Language Models without Positional Encodings
Still Learn Positional Information", §4; released code: ``adihaviv/NoPos``,
``fairseq/models/transformer_lm_position_probe.py``, its ``non_linear_probe``) probe each layer's
hidden states with ``Linear(d, 2d) -> ReLU -> Linear(2d, n_positions)``, trained with Adam and
cross-entropy, and report the MAD between the argmax class and the true position, against chance.
:class:`MLPPositionProbe` is that probe as a scikit-learn classifier (torch on the CPU, float32,
deterministic under its ``seed``), with two changes that a reader of the numbers should know:

- features are standardized on the fitting side first (the linear probes'
  :class:`~nopelens.probes.roundoff.RoundoffScaler`, which also zeroes features whose spread is only
  float round-off), and both layers have a bias, so a probe that reads nothing learns the class
  frequencies instead of favouring class 0 (the paper's layers have no bias);
- it trains for a fixed :data:`MLP_EPOCHS` epochs (at least :data:`MLP_MIN_STEPS` Adam steps),
  chosen before the comparison was run, instead of fairseq's schedule.

:func:`probe_positions_mlp` fits it on the linear probes' sequence-grouped folds
(:func:`~nopelens.probes.linear.sequence_splits`) for the position, Hewitt & Liang's control task
and shuffled labels (:func:`~nopelens.probes.linear.probe_labels`), and scores them with the same
bootstrap CIs over sequences and baselines (:func:`~nopelens.probes.linear.score_probes`).
Memory is bounded: :func:`kept_sequences` draws the sample of sequences a memory budget allows.

No-information floors (:func:`no_information_floor`): MAD/chance of a probe that knows nothing is
not 1 for every probe. A regression probe that knows nothing predicts the mean position, whose MAD
is E|X - E X| (L/4 for L uniform positions, so 0.75 of chance); an argmax classifier that knows
nothing picks one class whatever the input, and over the class it happens to pick (drawn like the
targets) its expected MAD is chance itself, 1.0 (one pick can land anywhere from 0.75, the median,
to 1.5, an end: :func:`constant_prediction_band`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, clone
from sklearn.pipeline import Pipeline
from sklearn.utils.validation import check_is_fitted, check_X_y

from .linear import out_of_fold_predictions, probe_labels, score_probes, sequence_splits
from .metrics import mad_chance_of
from .roundoff import RoundoffScaler

MLP_EPOCHS = 30
"""Epochs of every MLP probe fit, fixed before the comparison was run. Checked on one fold of
text-nope-4l's layer 1 (250 validation windows, 13,000 fitting samples): held-out MAD/chance 0.117,
0.103, 0.098 and 0.093 after 10, 20, 30 and 60 epochs, so 30 is within 0.005 of twice as many."""
MLP_MIN_STEPS = 1000
"""Adam steps every fit takes at least (more epochs on a small fitting side): 30 epochs of a few
hundred samples are a few dozen steps, too few to fit even the hand-built circuit's exact counter."""
MLP_LR = 2e-3
"""Adam's learning rate: the larger of the two in the authors' probe grid (2e-3, 2e-4), with their
betas (0.9, 0.98) and decoupled weight decay 0.01 (``adihaviv/npe``, ``npe_scripts/probes_slurm_dunk.py``)."""
MLP_BATCH = 256
"""Samples per Adam step."""

FLOORS = {"ridge": "mean", "mlp": "argmax"}
"""Probe kind -> the prediction a no-information probe of that kind makes (:func:`no_information_floor`)."""


class MLPPositionProbe(ClassifierMixin, BaseEstimator):
    """``Linear(d, 2d) -> ReLU -> Linear(2d, n_classes)``, trained with Adam on cross-entropy.

    Args:
        epochs: passes over the fitting samples, >= 1; more when they make fewer than ``min_steps``.
        min_steps: Adam steps to take at least, >= 0.
        lr: Adam's learning rate, > 0.
        batch_size: samples per step, >= 1.
        seed: seed of the initialization and the sample order.

    The same data and seed give the same weights (torch on the CPU, one generator for
    everything random).
    """

    def __init__(
        self,
        epochs: int = MLP_EPOCHS,
        lr: float = MLP_LR,
        batch_size: int = MLP_BATCH,
        seed: int = 0,
        min_steps: int = MLP_MIN_STEPS,
    ):
        self.epochs, self.lr, self.batch_size, self.seed, self.min_steps = epochs, lr, batch_size, seed, min_steps

    def fit(self, X, y):
        """Fit on features ``X`` ``[n, d]`` and integer classes ``y`` ``[n]``.

        Raises:
            ValueError: on mismatched shapes, non-finite features, fewer than 2 classes, or bad
                ``epochs``/``lr``/``batch_size``.
        """
        X, y = check_X_y(X, y, dtype=np.float32)
        if not (
            int(self.epochs) == self.epochs >= 1
            and self.lr > 0
            and int(self.batch_size) == self.batch_size >= 1
            and int(self.min_steps) == self.min_steps >= 0
        ):
            raise ValueError(
                f"epochs and batch_size must be integers >= 1, min_steps >= 0 and lr > 0, got "
                f"{self.epochs!r}, {self.batch_size!r}, {self.min_steps!r}, {self.lr!r}"
            )
        self.classes_, label = np.unique(y, return_inverse=True)
        if len(self.classes_) < 2:
            raise ValueError(f"need at least 2 classes, got {len(self.classes_)}")
        generator = torch.Generator().manual_seed(int(self.seed))
        d = X.shape[1]
        self.net_ = torch.nn.Sequential(
            torch.nn.Linear(d, 2 * d), torch.nn.ReLU(), torch.nn.Linear(2 * d, len(self.classes_))
        )
        for layer in self.net_[::2]:
            torch.nn.init.xavier_uniform_(layer.weight, generator=generator)
            torch.nn.init.zeros_(layer.bias)
        features, targets = torch.from_numpy(X), torch.from_numpy(label.astype(np.int64))
        optimizer = torch.optim.AdamW(self.net_.parameters(), lr=self.lr, betas=(0.9, 0.98), weight_decay=0.01)
        batches = -(-len(X) // int(self.batch_size))
        for _ in range(max(int(self.epochs), -(-int(self.min_steps) // batches))):
            for rows in torch.randperm(len(X), generator=generator).split(int(self.batch_size)):
                loss = torch.nn.functional.cross_entropy(self.net_(features[rows]), targets[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.n_features_in_ = d
        return self

    def decision_function(self, X) -> np.ndarray:
        """Logits ``[n, n_classes]``."""
        check_is_fitted(self)
        with torch.no_grad():
            return self.net_(torch.as_tensor(np.asarray(X, dtype=np.float32))).numpy()

    def predict(self, X) -> np.ndarray:
        """The argmax class of each sample ``[n]``."""
        return self.classes_[self.decision_function(X).argmax(1)]


def make_mlp_probe(seed: int = 0, dtype=None, epochs: int = MLP_EPOCHS, min_steps: int = MLP_MIN_STEPS) -> Pipeline:
    """An unfitted ``Pipeline(RoundoffScaler, MLPPositionProbe)``; ``dtype`` is the dtype the
    activations were computed in (sets the round-off below which a feature counts as constant)."""
    return Pipeline(
        [("scale", RoundoffScaler(dtype)), ("linear", MLPPositionProbe(epochs=epochs, seed=seed, min_steps=min_steps))]
    )


def probe_positions_mlp(
    X: np.ndarray,
    position: np.ndarray,
    groups: np.ndarray,
    token_types: np.ndarray,
    n_splits: int = 5,
    controls: bool = True,
    n_boot: int = 1000,
    seed: int = 0,
    dtype=None,
    epochs: int = MLP_EPOCHS,
    min_steps: int = MLP_MIN_STEPS,
) -> pd.DataFrame:
    """The MLP probe of absolute position on one feature matrix, with the linear probes' folds,
    controls, baselines and CIs.

    Args:
        X: features ``[n, d]``.
        position: absolute position of each sample ``[n]`` (each position its class).
        groups: sequence id of each sample ``[n]`` (GroupKFold groups and bootstrap units).
        token_types: token id of each sample ``[n]`` (control task, token-identity ceiling).
        n_splits: folds, as :func:`~nopelens.probes.linear.probe_features`.
        controls: fit the control task and shuffled labels too, as there.
        n_boot: bootstrap replicates over sequences, as there.
        seed: folds, bootstrap, shuffles and the MLP's initialisation.
        dtype: the dtype the activations were computed in (default ``X``'s).
        epochs: passes over the fitting side in every fit (:class:`MLPPositionProbe`).
        min_steps: at least this many optimizer steps in every fit, however few the samples.

    Returns:
        The rows of :func:`~nopelens.probes.linear.score_probes` (``probe`` ``linear`` is the MLP
        of the position; ``control``, ``shuffled``, ``majority``, ``token_identity``), metrics
        ``accuracy, balanced_accuracy, within_one, mad``, with ``chance`` on the ``mad`` rows,
        plus ``floor``: :func:`no_information_floor` of the argmax on the ``mad`` rows.

    Raises:
        ValueError: on mismatched shapes, non-finite features or too few sequences for the folds.
    """
    X, position, groups = np.asarray(X), np.asarray(position), np.asarray(groups)
    if X.ndim != 2 or not len(X) == len(position) == len(groups):
        raise ValueError(
            f"X [n, d], position [n] and groups [n] do not match: {X.shape}, {position.shape}, {groups.shape}"
        )
    if not np.all(np.isfinite(X)):
        raise ValueError("features contain NaN or Inf")
    splits = sequence_splits(groups, n_splits)
    labels = probe_labels(position.astype(np.int64), token_types, controls, seed)
    probe = make_mlp_probe(seed, str(X.dtype) if dtype is None else dtype, epochs, min_steps)
    fitted = {
        name: (*out_of_fold_predictions(clone(probe), X, target, splits), np.nan, False)
        for name, target in labels.items()
    }
    rows = score_probes(fitted, labels, groups, splits, "classification", token_types, controls, n_boot, seed)
    floor = no_information_floor(position, "argmax")
    return rows.assign(floor=np.where(rows["metric"] == "mad", floor, np.nan))


def no_information_floor(targets: np.ndarray, prediction: str) -> float:
    """MAD/chance of a probe that reads nothing, for the scored ``targets`` ``[n]``.

    - ``"mean"`` (a regression probe, e.g. ridge: it predicts the fitting side's mean):
      E|X - E X| / E|X - Y|, with X, Y independent draws of the targets. For L uniform positions
      that is (L/4) / ((L^2 - 1) / (3L)) = 3L^2 / (4 (L^2 - 1)) (L even), 0.75 as L grows.
    - ``"argmax"`` (a classifier's argmax, e.g. the MLP probe: one class c whatever the input):
      E_c E_X|X - c| / E|X - Y| with c drawn like the targets, which is 1 by the definition of
      chance (:func:`~nopelens.probes.metrics.mad_chance_of`); one fit's c may land anywhere in
      :func:`constant_prediction_band`.

    Raises:
        ValueError: on an unknown ``prediction`` or targets with no spread (chance 0).

    Example:
        >>> round(no_information_floor(np.arange(64), "mean"), 4), no_information_floor(np.arange(64), "argmax")
        (0.7502, 1.0)
    """
    chance = mad_chance_of(targets)
    if chance == 0:
        raise ValueError("the targets have no spread: MAD/chance is undefined")
    if prediction == "argmax":
        return 1.0
    if prediction == "mean":
        targets = np.asarray(targets, dtype=np.float64)
        return float(np.abs(targets - targets.mean()).mean() / chance)
    raise ValueError(f"prediction must be 'mean' or 'argmax', got {prediction!r}")


def constant_prediction_band(targets: np.ndarray) -> tuple[float, float]:
    """(lowest, highest) MAD/chance of predicting one constant position c for every target: the
    median gives the lowest (0.75 for many uniform positions), an end the highest (1.5).

    Example:
        >>> tuple(round(v, 3) for v in constant_prediction_band(np.arange(64)))
        (0.75, 1.477)
    """
    targets = np.asarray(targets, dtype=np.float64)
    values = np.unique(targets)
    mads = (
        np.abs(targets[None, :] - values[:, None]).mean(1)
        if len(values) * len(targets) <= 1 << 24
        else np.array([np.abs(targets - c).mean() for c in values])
    )
    chance = mad_chance_of(targets)
    return float(mads.min() / chance), float(mads.max() / chance)


def kept_sequences(
    n_sequences: int,
    tokens_per_sequence: int,
    bytes_per_token: int,
    budget_bytes: int,
    seed: int = 0,
    min_sequences: int = 10,
) -> np.ndarray:
    """Which sequences to keep so that their features fit ``budget_bytes``: a random sample
    (sorted ids) of floor(budget / (tokens x bytes per token)) of ``n_sequences``, or all of them.

    Args:
        n_sequences: sequences available.
        tokens_per_sequence: tokens of the longest sequence.
        bytes_per_token: bytes one token's features take at every probed site together.
        budget_bytes: the memory the kept features may take.
        seed: seed of the sample.
        min_sequences: fewer kept sequences than this is refused (the folds and CIs need them).

    Raises:
        ValueError: if the budget keeps fewer than ``min_sequences`` (naming the budget it needs).

    Example:
        >>> kept_sequences(100, 64, 1024, 64 * 1024 * 20).tolist() == sorted(
        ...     kept_sequences(100, 64, 1024, 64 * 1024 * 20).tolist())
        True
        >>> len(kept_sequences(100, 64, 1024, 64 * 1024 * 20)), len(kept_sequences(100, 64, 1024, 10**12))
        (20, 100)
    """
    per_sequence = max(1, tokens_per_sequence * bytes_per_token)
    fits = int(budget_bytes // per_sequence)
    if min(fits, n_sequences) < min_sequences:
        raise ValueError(
            f"a memory budget of {budget_bytes} bytes keeps {fits} sequences; the MLP probe needs at "
            f"least {min_sequences} ({min_sequences * per_sequence} bytes)"
        )
    if fits >= n_sequences:
        return np.arange(n_sequences)
    return np.sort(np.random.default_rng(seed).choice(n_sequences, size=fits, replace=False))
