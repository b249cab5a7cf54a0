"""The one probe engine (issue 38): every probe read is a :class:`Probes` measurement, defined
once, fed batch by batch from a hooked forward pass (:func:`~nopelens.probes.stream.run`) or
from cached activations (:func:`~nopelens.probes.stream.replay`; the in-memory API
:func:`~nopelens.probes.stream_probes.probe_absolute_index` and
:func:`~nopelens.probes.stream_probes.probe_relative_distance` is this), like scikit-learn's
``IncrementalPCA.fit`` looping over ``partial_fit``. A run that keeps every batch fits from the
whole feature matrix in one pass; one that streams within its keep budget fits from the summed
statistics and predicts in a second pass; the answers are the same (memory then does not grow
with the tokens). A new token read is one :func:`~nopelens.probes.stream_probes.token_probes`
definition. Classifiers other than LDA (``ridge``, ``logistic``) are scikit-learn pipelines on
the kept features (:func:`~nopelens.probes.linear.pipeline_fits`): such a run must keep them.

Before the first forward pass, everything that does not depend on activations is fixed from the
token set alone (:class:`~nopelens.probes.stream.Sequences`): the grouped folds
(:func:`~nopelens.probes.linear.sequence_splits`, the same ``GroupKFold`` over the same sequence
ids), the blocks every fitting side is made of (:func:`~nopelens.probes.moments.fold_blocks`),
the distance pairs, and every target (position, position bins, distance, the control task and
the shuffled labels, :func:`~nopelens.probes.linear.probe_labels`). While the model runs, each
batch's features are added into per-block sufficient statistics
(:class:`~nopelens.probes.moments.BlockMoments`: counts, sums, X^T X, X^T y for every value
target, class sums for LDA, raw per-feature extremes for the round-off rule). Features that
several probe families share are added once: the rows are cut into the finest common refinement
("cells") of every family's blocks, and a family's block is a sum of cells (the grouped split
and the extrapolation split at one residual site share one Gram per cell). Pair features
[h_i; h_j], the per-head bilinear q.k read and the score read are built per batch on the model's
device, from pairs drawn before the run (:func:`~nopelens.probes.targets.pair_features`,
:func:`~nopelens.probes.targets.bilinear_features`, :func:`~nopelens.probes.targets.score_features`
on that batch's sequences: no ``[head, T, T]`` array outlives its batch).

After the first pass every fold's probe is fitted from the statistics with the same code as the
in-memory path (:func:`~nopelens.probes.fitting.fold_models`). Out-of-fold predictions need each
token's features *and* weights fitted on the other folds, which exist only after the last batch:
exact K-fold predictions cannot be formed in the same single pass without keeping the features.
So a batch's features are kept until the fit while a :class:`~nopelens.probes.stream.KeepBudget`
allows (one pass, memory growing with the kept tokens), and the batches beyond it are run a
second time, in which the probes only predict (memory bounded; the forward pass costs twice).
Either way each token ends with a few numbers (its predictions), from which the metrics and
their bootstrap CIs over sequences are computed exactly as in memory
(:func:`~nopelens.probes.linear.score_probes`). The result equals the in-memory tables on the
same batches, with the same sites hooked (hooks can change a model's arithmetic: the Decoder
attends through a fused kernel unless scores or patterns are hooked), up to float round-off of the
sums (tests: 1e-8). Features are read in the model's own dtype; :func:`~nopelens.probes.collect`
stores float32 copies, so for a float64 model the two paths agree only to float32 precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from .collect import check_patterns
from .fitting import FoldChoice, FoldFit, fold_models
from .linear import _coarser, _label, _tidy, baseline_runs, check_classifier, fitted_probes, pipeline_fits, score_probes
from .moments import BlockMoments, check_compute_dtype, fold_blocks, fold_statistics
from .ridge import ALPHAS, ridge_alphas
from .stream import Batch, KeepBudget, Measurement, Sequences, release_freed_memory
from .targets import DistancePairs, bilinear_features, pair_features, score_read


@dataclass
class ProbeFamily:
    """One probe family on a layout's rows: a task, its grouped splits and its targets."""

    target: str
    task: str
    split: str
    labels: dict[str, np.ndarray]  # probe name -> [n_rows]
    splits: list
    controls: bool
    block: np.ndarray = field(init=False)  # [n_rows] block of each row, -1: on no fitting side
    members: list = field(init=False)
    fold: np.ndarray = field(init=False)  # [n_rows] fold that scores each row, -1: none

    def __post_init__(self):
        n_rows = len(self.labels["linear"])
        self.block = np.full(n_rows, -1, dtype=np.int64)
        self.fold = np.full(n_rows, -1, dtype=np.int64)
        for k, (_, score) in enumerate(self.splits):
            self.fold[np.asarray(score)] = k


class RowLayout:
    """The rows of a set of jobs (tokens, or pairs), their probe families and their cells."""

    def __init__(
        self,
        groups: np.ndarray,
        token_types: np.ndarray,
        families: list[ProbeFamily],
        sample_rows: np.ndarray | None = None,
    ):
        self.groups, self.token_types, self.families = groups, token_types, families
        # token jobs on a subset of the samples: each sample's row, -1 where it is not probed (None: row = sample)
        self.sample_rows = sample_rows
        n_rows = len(groups)
        codes, n_blocks = [], []
        for family in families:
            blocks, family.members = fold_blocks(family.splits, groups)
            for b, rows in enumerate(blocks):
                family.block[rows] = b
            codes.append(family.block)
            n_blocks.append(len(blocks))
        combos, cell = np.unique(np.stack(codes, 1), axis=0, return_inverse=True)
        cell = cell.reshape(-1)
        unused = (combos == -1).all(1)
        cell[unused[cell]] = -1  # rows on no fitting side add to no statistic
        self.cell, self.n_cells = cell, len(combos)
        self.cells_of = [
            [[c for c in range(len(combos)) if combos[c, f] == b] for b in range(n_blocks[f])]
            for f in range(len(families))
        ]
        # value targets (regression) and class targets (classification), each array once
        self.values, self.classes, self.columns = [], [], []
        for family in families:
            store = self.values if family.task == "regression" else self.classes
            cols = []
            for y in family.labels.values():
                same = [i for i, known in enumerate(store) if known is y or np.array_equal(known, y)]
                if not same:
                    store.append(y)
                cols.append(same[0] if same else len(store) - 1)
            self.columns.append(cols)
        self.value_table = np.stack(self.values, 1).astype(np.float64) if self.values else np.zeros((n_rows, 0))
        self.class_values, self.class_index = [], []
        for y in self.classes:
            values, index = np.unique(y, return_inverse=True)
            self.class_values.append(values)
            self.class_index.append(index.reshape(-1).astype(np.int64))


class ProbeJob:
    """One feature matrix to probe: which sites make it, how a batch gives its rows."""

    def __init__(self, layout: RowLayout, sites: tuple[str, ...], site: str, features: str, form: str, read: bool):
        self.layout, self.sites, self.site, self.features, self.form, self.read = (
            layout,
            sites,
            site,
            features,
            form,
            read,
        )
        # the activations' dtype for the round-off rule, no finer than what the in-memory path stores
        # (float32 copies; the score read's float64 differences)
        self.dtype = "float64" if form == "scores" else "float32"
        self.shift: Tensor | None = None
        self.moments: BlockMoments | None = None
        self.kept: list[tuple[np.ndarray, Tensor]] = []
        self.kept_bytes = 0
        self.spilled = False  # statistics are summed batch by batch (not every batch fitted the budget)
        self.rerun: set[int] = set()
        self.models: list | None = None
        self.predictions: list[dict[str, np.ndarray]] = []
        self.filled: list[np.ndarray] = []
        self.pending: dict[str, object] = {}

    def fresh(self) -> "ProbeJob":
        """A copy with the same plan and fit, and no statistics, kept rows or predictions."""
        job = ProbeJob(self.layout, self.sites, self.site, self.features, self.form, self.read)
        job.dtype, job.models, job.rerun, job.shift = self.dtype, self.models, set(self.rerun), self.shift
        job.spilled = True  # a shard keeps nothing: it sums its batches' statistics
        if self.models is not None:
            job._empty_predictions()
        return job

    def _empty_predictions(self) -> None:
        n_rows = len(self.layout.groups)
        self.predictions = [
            {
                name: np.zeros(n_rows, dtype=np.float64 if family.task == "regression" else labels.dtype)
                for name, labels in family.labels.items()
            }
            for family in self.layout.families
        ]
        self.filled = [np.zeros(n_rows, dtype=bool) for _ in self.layout.families]


class Probes(Measurement):
    """Probe families on streamed features (module docstring); build with
    :func:`~nopelens.probes.stream_probes.absolute_index_probes` or
    :func:`~nopelens.probes.stream_probes.relative_distance_probes`, feed with
    :func:`~nopelens.probes.stream.run`; :meth:`result` is the tidy table of the in-memory
    function (:data:`~nopelens.probes.linear.RESULT_COLUMNS`).

    Phases: ``statistics`` (first pass: add every batch's features to the per-cell statistics,
    keep them while the budget allows), ``predictions`` (second pass over the batches that were
    not kept, if any), ``done``.
    """

    def __init__(
        self,
        sequences: Sequences,
        jobs: list[ProbeJob],
        pairs: DistancePairs | None,
        n_boot: int,
        seed: int,
        keep,
        compute_dtype: torch.dtype | None,
        alphas=ALPHAS,
        shrinkage: float = 1e-3,
        classifier: str = "lda",
    ):
        check_classifier(classifier)
        self.sequences, self.jobs, self.pairs, self.classifier = sequences, jobs, pairs, classifier
        self.n_boot, self.seed, self.compute_dtype = n_boot, seed, compute_dtype
        self.alphas, self.shrinkage = ridge_alphas(alphas), shrinkage
        self.budget = keep if isinstance(keep, KeepBudget) else KeepBudget(keep)
        self.phase = "statistics"
        if pairs is not None:
            self._pair_order = np.argsort(pairs.sequence_id, kind="stable")
            self._pair_starts = np.searchsorted(
                pairs.sequence_id[self._pair_order], np.arange(sequences.n_sequences + 1)
            )

    # ------------------------------------------------------------------ what the runner asks

    def sites(self, batch_index: int) -> list[str]:
        if self.phase == "done":
            return []
        jobs = self.jobs if self.phase == "statistics" else [j for j in self.jobs if batch_index in j.rerun]
        return list(dict.fromkeys(site for job in jobs for site in job.sites))

    def update(self, site: str, value: Tensor, batch: Batch) -> None:
        forms: dict[str, object] = {}
        for job in self.jobs:
            if site not in job.sites or (self.phase == "predictions" and batch.index not in job.rerun):
                continue
            if job.form not in forms:
                forms[job.form] = _as_form(job.form, site, value, batch)
            job.pending[site] = forms[job.form]
            job.dtype = _coarser(job.dtype, str(value.dtype).removeprefix("torch."))
            if all(s in job.pending for s in job.sites):
                rows, X = self._build(job, batch)
                job.pending = {}
                if len(rows):
                    self._take(job, rows, X, batch)

    def end_batch(self, batch: Batch) -> None:
        for job in self.jobs:
            job.pending = {}

    def end_pass(self) -> bool:
        if self.phase == "statistics":
            for job in self.jobs:
                self._fit(job)
                release_freed_memory()  # this fit's copies, before the next job's fit fragments the heap
            self.phase = "predictions"
            if any(job.rerun for job in self.jobs):
                return True
        self._check_complete()
        self.phase = "done"
        for job in self.jobs:  # every prediction is made: only what each fold chose is still read
            job.models = [[FoldChoice(model.alpha, model.n_signal) for model in models] for models in job.models]
        return False

    def spawn(self) -> "Probes":
        other = object.__new__(Probes)
        other.__dict__.update(self.__dict__)
        other.jobs = [job.fresh() for job in self.jobs]
        other.budget = KeepBudget(0)  # a shard never sees the fit, so it keeps nothing
        return other

    def merge(self, other: "Probes") -> None:
        for job, part in zip(self.jobs, other.jobs):
            job.dtype = _coarser(job.dtype, part.dtype)
            job.rerun |= part.rerun
            if part.moments is not None:
                job.spilled = True
                if job.moments is None:
                    job.moments, job.shift = part.moments, part.shift
                else:
                    job.moments.merge(part.moments)
            for mine, theirs, filled, got in zip(job.predictions, part.predictions, job.filled, part.filled):
                for name in mine:
                    mine[name][got] = theirs[name][got]
                filled |= got

    def subset(self, jobs: list[ProbeJob], keep: KeepBudget | None = None) -> "Probes":
        """A measurement of some of these jobs (the same objects: what it fits and predicts lands
        here), so that a run holds only their statistics; after every job has run in one,
        :meth:`finish` and :meth:`result` give the whole table
        (:func:`~nopelens.analyses.sweep.streamed.measure_streamed` runs a large model's jobs in groups).
        ``keep``: the run's keep budget (None: this measurement's)."""
        part = object.__new__(Probes)
        part.__dict__.update(self.__dict__)
        part.jobs, part.phase = list(jobs), "statistics"
        if keep is not None:
            part.budget = keep
        return part

    def finish(self) -> None:
        """Mark the probes done once every job has run in a :meth:`subset`.

        Raises:
            RuntimeError: if a scored row of some job was never predicted (a job never ran).
        """
        self._check_complete()
        self.phase = "done"

    def result(self) -> pd.DataFrame:
        """The tidy table, in the row order of the in-memory functions."""
        if self.phase != "done":
            raise ValueError("the probes have not been fed every batch yet; pass them to nopelens.probes.stream.run")
        frames, baselines = [], {}
        for job in self.jobs:
            for f, family in enumerate(job.layout.families):
                predictions = [
                    [job.predictions[f][name][np.asarray(score)] for name in family.labels]
                    for _, score in family.splits
                ]
                fit = FoldFit.assemble(family.splits, job.models[f], predictions, self.alphas)
                if family.controls and id(family) not in baselines:  # the jobs of a layout share its families
                    baselines[id(family)] = baseline_runs(
                        family.labels["linear"],
                        job.layout.groups,
                        family.splits,
                        family.task,
                        job.layout.token_types,
                        self.n_boot,
                        self.seed,
                    )
                frame = score_probes(
                    fitted_probes(fit, family.labels),
                    family.labels,
                    job.layout.groups,
                    family.splits,
                    family.task,
                    job.layout.token_types,
                    family.controls,
                    self.n_boot,
                    self.seed,
                    baselines.get(id(family)),
                )
                frame = _label(frame, job.site, family.target, family.task, job.features, family.split)
                if job.read:  # an attention read of block l counts at layer l + 1
                    frame["layer"] = frame["block"] + 1
                frames.append(frame)
        return _tidy(frames)

    # ------------------------------------------------------------------ the work

    def _local_pairs(self, batch: Batch) -> tuple[np.ndarray, DistancePairs]:
        ids = self._pair_order[self._pair_starts[batch.rows.start] : self._pair_starts[batch.rows.stop]]
        p, s0 = self.pairs, batch.samples.start
        return ids, DistancePairs(p.query[ids] - s0, p.key[ids] - s0, p.distance[ids], p.sequence_id[ids])

    def _build(self, job: ProbeJob, batch: Batch) -> tuple[np.ndarray, Tensor]:
        """The job's rows in this batch (indices into its layout) and their features ``[n, d]``."""
        if job.form == "rows":
            X = job.pending[job.sites[0]]
            rows = np.arange(batch.samples.start, batch.samples.stop)
            if job.layout.sample_rows is not None:
                rows = job.layout.sample_rows[rows]
                probed = np.flatnonzero(rows >= 0)
                rows, X = rows[probed], X[torch.as_tensor(probed, device=X.device)]
            return rows, X.reshape(len(X), -1)
        ids, local = self._local_pairs(batch)
        if job.form == "float32" and len(job.sites) == 1:
            return ids, pair_features(job.pending[job.sites[0]], local, job.features)
        if job.form == "float32":
            return ids, bilinear_features(
                job.pending[job.sites[0]], job.pending[job.sites[1]], local, job.features.removeprefix("bilinear_")
            )
        return ids, torch.from_numpy(
            np.ascontiguousarray(pair_scores(job.pending[job.sites[0]], batch, local, job.dtype))
        )

    def _take(self, job: ProbeJob, rows: np.ndarray, X: Tensor, batch: Batch) -> None:
        """First pass: keep a batch's features while the budget allows, and sum statistics only once
        one does not fit (a job whose every batch was kept is fitted at once, as in memory, bit for
        bit); later passes only predict."""
        if self.phase != "statistics":
            self._predict(job, rows, X)
            return
        nbytes = X.element_size() * X.nelement() + rows.nbytes
        if not job.spilled:
            if self.budget.take(nbytes):
                job.kept.append((rows, X))
                job.kept_bytes += nbytes
                return
            if self._by_pipeline(job):
                raise ValueError(
                    f"{job.site} ({job.features}): classifier {self.classifier!r} is fitted on the features "
                    f"themselves, not on streamed statistics, and they do not fit the keep budget of "
                    f"{self.budget.limit / 2**20:,.1f} MiB; give a larger keep budget (--keep-mib), or classifier 'lda'"
                )
            job.spilled = True
            for kept_rows, kept_X in job.kept:
                self._add(job, kept_rows, kept_X)
        self._add(job, rows, X)
        if self.budget.take(nbytes):
            job.kept.append((rows, X))
            job.kept_bytes += nbytes
        else:
            job.rerun.add(batch.index)

    def _add(self, job: ProbeJob, rows: np.ndarray, X: Tensor) -> None:
        layout = job.layout
        compute = check_compute_dtype(X.device, self.compute_dtype)
        Xd = X.to(compute)
        if job.moments is None:
            job.shift = Xd.mean(0)  # near the mean keeps the Gram sums precise; merges reshift
            job.moments = BlockMoments(
                layout.n_cells, job.shift, n_values=len(layout.values), classes=layout.class_values, packed=True
            )
        Xs = Xd - job.shift
        cell = layout.cell[rows]
        for c in np.unique(cell[cell >= 0]):
            where = np.flatnonzero(cell == c)
            index, picked = torch.as_tensor(where, device=X.device), rows[where]
            values = torch.as_tensor(layout.value_table[picked], dtype=compute, device=X.device)
            labels = [torch.as_tensor(index_of[picked], device=X.device) for index_of in layout.class_index]
            job.moments.add(int(c), Xs[index], X[index], values, labels)

    def _fit(self, job: ProbeJob) -> None:
        layout = job.layout
        if job.moments is None and not job.kept:
            raise ValueError(f"no rows of {job.site} ({job.features}) were seen; nothing to probe")
        if not job.spilled:
            self._fit_at_once(job)
        elif self._by_pipeline(job):
            raise ValueError(
                f"{job.site} ({job.features}): classifier {self.classifier!r} needs the features kept "
                "on one machine (a sharded run sums statistics only); use classifier 'lda'"
            )
        else:
            job.models = []
            for f, family in enumerate(layout.families):
                cols = layout.columns[f]
                if family.task == "regression":
                    moments = job.moments.group(layout.cells_of[f], values=cols, classes=[])
                else:
                    moments = job.moments.group(layout.cells_of[f], values=[], classes=cols)
                job.models.append(
                    fold_models(moments, family.members, family.task, job.dtype, self.alphas, self.shrinkage)
                )
            job.moments = None
            job._empty_predictions()
            for rows, X in job.kept:
                self._predict(job, rows, X)
        self.budget.give(job.kept_bytes)
        job.kept, job.kept_bytes = [], 0

    def _fit_at_once(self, job: ProbeJob) -> None:
        """Every batch was kept: fit from the whole feature matrix, family by family, as the
        in-memory functions do (:func:`~nopelens.probes.moments.fold_statistics`; families on the
        same splits share each block's Gram matrix), so the numbers are theirs bit for bit."""
        layout = job.layout
        X = _assemble(job.kept, len(layout.groups), f"{job.site} ({job.features})")
        job.kept = []
        job.models = [None] * len(layout.families)
        job._empty_predictions()
        groups: dict[int, list[int]] = {}
        for f, family in enumerate(layout.families):
            groups.setdefault(id(family.splits), []).append(f)
        for members in groups.values():
            for f in [f for f in members if self._by_pipeline(job, layout.families[f])]:
                self._fit_pipeline(job, f, X)
            members = [f for f in members if not self._by_pipeline(job, layout.families[f])]
            if not members:
                continue
            families = [layout.families[f] for f in members]
            values = [y for family in families if family.task == "regression" for y in family.labels.values()]
            classes = [y for family in families if family.task == "classification" for y in family.labels.values()]
            stats = fold_statistics(X, layout.groups, families[0].splits, values, classes, X.device, self.compute_dtype)
            taken = {"regression": 0, "classification": 0}
            for f, family in zip(members, families):
                first, count = taken[family.task], len(family.labels)
                taken[family.task] += count
                wanted = list(range(first, first + count))
                moments = (
                    stats.moments.select(values=wanted)
                    if family.task == "regression"
                    else stats.moments.select(classes=wanted)
                )
                job.models[f] = fold_models(moments, stats.members, family.task, job.dtype, self.alphas, self.shrinkage)
                for (_, score), predicted in zip(family.splits, stats.predict(job.models[f], family.splits)):
                    for name, values_k in zip(family.labels, predicted):
                        job.predictions[f][name][np.asarray(score)] = values_k
                    job.filled[f][np.asarray(score)] = True
            del stats

    def _by_pipeline(self, job: ProbeJob, family: ProbeFamily | None = None) -> bool:
        """Whether ``family`` (default: any of the job's) is a classification by a scikit-learn
        pipeline (:func:`~nopelens.probes.linear.make_probe`: ``ridge`` or ``logistic``), which
        reads the features themselves rather than their statistics."""
        families = job.layout.families if family is None else [family]
        return self.classifier != "lda" and any(f.task == "classification" for f in families)

    def _fit_pipeline(self, job: ProbeJob, f: int, X: Tensor) -> None:
        """Out-of-fold predictions of family ``f`` by the classifier's pipeline on the kept ``X``
        (float32 as :func:`~nopelens.probes.collect.collect` stores it, float64 score reads as they are)."""
        family = job.layout.families[f]
        Xn = X.to(torch.float64 if X.dtype == torch.float64 else torch.float32).cpu().numpy()
        fitted = pipeline_fits(
            Xn, family.labels, job.layout.groups, family.splits, self.classifier, self.seed, job.dtype
        )
        for name, (index, predicted, _, _) in fitted.items():
            job.predictions[f][name][index] = predicted
            job.filled[f][index] = True
        job.models[f] = [FoldChoice(None, X.shape[1]) for _ in family.splits]

    def _predict(self, job: ProbeJob, rows: np.ndarray, X: Tensor) -> None:
        Xs = X.to(check_compute_dtype(X.device, self.compute_dtype)) - job.shift.to(X.device)
        for f, family in enumerate(job.layout.families):
            fold = family.fold[rows]
            for k in np.unique(fold[fold >= 0]):
                where = np.flatnonzero(fold == k)
                out = job.models[f][k].predict(Xs[torch.as_tensor(where, device=X.device)])
                for name, values in zip(family.labels, out):
                    job.predictions[f][name][rows[where]] = values
                job.filled[f][rows[where]] = True

    def _check_complete(self) -> None:
        for job in self.jobs:
            for family, filled in zip(job.layout.families, job.filled):
                scored = family.fold >= 0
                if not filled[scored].all():
                    raise RuntimeError(
                        f"{job.site} ({job.features}): {int((~filled[scored]).sum())} scored rows "
                        "were never predicted; a batch was not fed in the prediction pass"
                    )


def _assemble(kept: list[tuple[np.ndarray, Tensor]], n_rows: int, what: str) -> Tensor:
    """Kept batches' features in row order, ``[n_rows, d]``; every row must have been seen."""
    first = kept[0][1]
    X = torch.empty((n_rows, first.shape[1]), dtype=first.dtype, device=first.device)
    seen = np.zeros(n_rows, dtype=bool)
    while kept:
        rows, part = kept.pop(0)
        X[torch.as_tensor(rows, device=X.device)] = part
        seen[rows] = True
    if not seen.all():
        raise RuntimeError(f"{what}: {int((~seen).sum())} rows were never seen; a batch was not fed")
    return X


def _as_form(form: str, site: str, value: Tensor, batch: Batch):
    """A site's output as a job reads it: real rows on the model's device and dtype (``rows``),
    on the model's device in float32, as :func:`~nopelens.probes.collect.collect` stores them
    (``float32``: the pair and q.k features are built from these, so their numbers are the
    in-memory path's), or
    the batch's ``[batch, head_index, query_pos, key_pos]`` scores as they are (``scores``; only the
    sampled pairs are read from them, :func:`pair_scores`)."""
    if form == "rows":
        return batch.real(site, value)
    if form == "float32":
        return batch.real(site, value).to(torch.float32)
    check_patterns(value, batch.mask, site, batch.rows.start)  # its shape, and NaN or +inf at a real key
    return value


def pair_scores(scores: Tensor, batch: Batch, pairs: DistancePairs, dtype: str = "float32") -> np.ndarray:
    """The score read of a batch's pairs (:func:`~nopelens.probes.targets.score_features`), gathered
    from its scores on their device: only the pairs' e_h(i, j) and e_h(i, i) leave the hook.

    Args:
        scores: ``[batch, head_index, query_pos, key_pos]`` pre-softmax scores of the batch (padded).
        batch: the batch.
        pairs: the batch's pairs, ``query``/``key`` as sample indices within the batch.
        dtype: the dtype the scores were computed in.

    Returns:
        ``[n_pairs, head_index]`` float64.

    Raises:
        ValueError: on a NaN score, or a blocked pair (:func:`~nopelens.probes.targets.score_read`).
    """
    device = scores.device
    real = batch.mask.bool()
    r, c = torch.nonzero(real, as_tuple=True)
    position = torch.as_tensor(batch.position)
    column = torch.zeros(real.shape, dtype=torch.long)
    column[r, position] = c  # the padded column of each (row, position)
    row = torch.as_tensor(pairs.sequence_id - batch.rows.start)
    i, j = position[torch.as_tensor(pairs.query)], position[torch.as_tensor(pairs.key)]
    qc, kc = column[row, i].to(device), column[row, j].to(device)
    row = row.to(device)
    heads = torch.arange(scores.shape[1], device=device)
    pair = scores[row[:, None], heads[None, :], qc[:, None], kc[:, None]].to("cpu", torch.float64).numpy()
    own = scores[row[:, None], heads[None, :], qc[:, None], qc[:, None]].to("cpu", torch.float64).numpy()
    return score_read(pair, own, i.numpy(), j.numpy(), pairs.sequence_id, dtype)
