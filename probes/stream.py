"""Measure while the model runs: measurements that take batches, add across batches and shards,
and give their result, so memory does not grow with the number of tokens.

DESIGN.md, "Measuring at scale": every measurement is a sum over sequences. A :class:`Measurement`
asks for the hook sites it reads, is handed each site's output inside the hook
(:meth:`Measurement.update`), folds it into its statistics at once and keeps nothing of size
tokens x d_model or T x T. :func:`run` drives the forward passes: the same batches, in the same
order, whether the run is one pass on this machine or shards on a Dask cluster, so the sums are
those of one machine up to the order of float additions.

Some measurements need more than one pass. A probe's out-of-fold predictions (needed for
accuracy, MAD, Spearman and the bootstrap over sequences) use weights fitted on the *other*
folds, known only once every batch has been seen; so a probe either keeps the features of a
batch until the end (within a memory budget, :class:`KeepBudget`) or asks for a second pass over
that batch, in which it only predicts (:mod:`nopelens.probes.stream_probes`). :func:`run` runs
passes until no measurement asks for another, and in a later pass only the batches and sites
someone still needs.

An intervention is measured the same way: :func:`run` takes TransformerLens hooks (``hooks=``,
a list, or a function of each batch's rows and mask, :data:`~nopelens.probes.collect.BatchHooks`)
and adds them around every batch's forward pass only, before the measurements' own hooks; the
streamed sink ablation (:func:`~nopelens.analyses.intervene.sink_ablation_drop_streamed`) is one
run per block with that block's first real key removed.

Writing a measurement (the plug-in point for attention reductions: sink mass and rate, the score
reads, variance shrinkage): subclass :class:`Measurement` and implement

- ``sites(batch_index)``: the hook names it needs for that batch in the current pass (empty: skip);
- ``update(site, value, batch)``: ``value`` is the site's detached output on the model's device
  and in its dtype, ``[batch, pos, ...]`` or ``[batch, head_index, query_pos, key_pos]``; fold it
  into additive statistics (e.g. a sink read adds, per layer and head, the attention the real
  queries give the first key, and counts the queries: no pattern is kept). Use
  :meth:`Batch.real` for the rows of real tokens;
- ``end_pass()``: after the last batch of a pass; return True to be fed another pass;
- ``spawn()`` and ``merge(other)``: an empty copy in the same phase, with the same plan (and what
  earlier passes fitted), for a shard; and adding a shard's copy back; the statistics must add;
- ``result()``.

:class:`~nopelens.probes.variance.AttentionVariance` is a complete small example: the per-position variance of attention
outputs across sequences (:func:`nopelens.probes.variance.attention_variance`) from per-position
counts, means and sums of squared deviations, combined across batches by Chan et al.'s update.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from nopelens.models.compat import moved_names
from nopelens.models.progress import progress_bar
from nopelens.models.threads import one_thread

from .collect import (
    Activations,
    BatchHooks,
    HookList,
    _check_inputs,
    _model_device,
    _resolve_sites,
    forward_with_hooks,
    hooks_added,
    hooks_for_batch,
    real_values,
)
from .memory import AUTO_KEEP_BYTES, KeepBudget, available_memory, release_freed_memory  # noqa: F401  (re-exported)


@dataclass
class Sequences:
    """The token set of a run, known before the first forward pass.

    Attributes:
        tokens: int64 ``[n_sequences, pos]`` (CPU).
        mask: int64 ``[n_sequences, pos]``, 1 at real tokens.
        masked: whether the model is given the mask (it was passed explicitly).
        sequence_id, position, token: int64 ``[n_samples]`` per real token, sequence-major (the
            order of :class:`~nopelens.probes.collect.Activations`).
        offsets: int64 ``[n_sequences + 1]``: sequence ``s``'s tokens are samples
            ``offsets[s]:offsets[s + 1]``.
    """

    tokens: Tensor
    mask: Tensor
    masked: bool
    sequence_id: np.ndarray
    position: np.ndarray
    token: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(
        cls,
        tokens: Int[Tensor, "batch pos"] | np.ndarray,
        attention_mask: Int[Tensor, "batch pos"] | np.ndarray | None = None,
    ) -> "Sequences":
        """Validate ``tokens`` and ``attention_mask`` (as :func:`~nopelens.probes.collect.collect`
        does) and derive the per-token arrays.

        Raises:
            TypeError, ValueError: as :func:`~nopelens.probes.collect.collect`.
        """
        tokens, mask = _check_inputs(tokens, attention_mask)
        real = mask.bool()
        position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        sequence_id = torch.arange(tokens.shape[0])[:, None].expand_as(tokens)
        lengths = mask.sum(-1).numpy().astype(np.int64)
        return cls(
            tokens,
            mask,
            attention_mask is not None,
            sequence_id[real].numpy().astype(np.int64),
            position[real].numpy().astype(np.int64),
            tokens[real].numpy().astype(np.int64),
            np.concatenate([[0], np.cumsum(lengths)]),
        )

    @classmethod
    def of_activations(cls, acts: Activations) -> "Sequences":
        """The token set of cached activations (:func:`~nopelens.probes.collect.collect`, or a
        subset of its samples such as the later tokens of a sink ablation), for :func:`replay`.

        Sequence ``s`` of the result is the ``s``-th sequence id of ``acts`` in ascending order (the
        same grouped folds: GroupKFold sees the same groups in the same order); a sample at
        position ``p`` sits in column ``p`` of the padded rows, which are real exactly at the samples.
        Activations of patterns only (no sample) give sequence ``s`` the ``n_real`` tokens of its
        patterns, with token ids 0.

        Raises:
            ValueError: if the samples are not sequence-major in ascending position order (as
                :func:`~nopelens.probes.collect.collect` stores them), or a position repeats or is negative.
        """
        sequence_id, position = np.asarray(acts.sequence_id), np.asarray(acts.position)
        if len(position) == 0 and acts.patterns:
            lengths = np.array([np.shape(p)[-1] for p in next(iter(acts.patterns.values()))])
            mask = (np.arange(lengths.max(initial=0))[None] < lengths[:, None]).astype(np.int64)
            return cls.of(np.zeros_like(mask), mask)
        if len(position) == 0 or sequence_id.shape != position.shape or position.min() < 0:
            raise ValueError("activations need samples with equal-length sequence ids and positions >= 0")
        ids, row = np.unique(sequence_id, return_inverse=True)
        row = row.reshape(-1).astype(np.int64)
        step = np.diff(row * (int(position.max()) + 1) + position)
        if (step <= 0).any():
            raise ValueError(
                "activations must hold each sequence's samples together, in ascending position order "
                "and each position once (as collect stores them)"
            )
        tokens = torch.zeros((len(ids), int(position.max()) + 1), dtype=torch.int64)
        mask = torch.zeros_like(tokens)
        tokens[row, position] = torch.as_tensor(np.asarray(acts.token), dtype=torch.int64)
        mask[row, position] = 1
        lengths = np.bincount(row, minlength=len(ids))
        return cls(
            tokens,
            mask,
            True,
            row,
            position.astype(np.int64),
            np.asarray(acts.token).astype(np.int64),
            np.concatenate([[0], np.cumsum(lengths)]),
        )

    @property
    def n_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_samples(self) -> int:
        return len(self.position)

    def batches(self, batch_size: int) -> list[slice]:
        """The sequence ranges of the forward passes, in order."""
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        return [
            slice(start, min(start + batch_size, self.n_sequences)) for start in range(0, self.n_sequences, batch_size)
        ]


@dataclass
class Batch:
    """One forward pass: sequences ``rows`` of a :class:`Sequences`.

    Attributes:
        index: the batch number (its place in :meth:`Sequences.batches`).
        rows: the sequences it holds.
        samples: their real tokens' sample indices (a contiguous range).
        sequences: the run's token set.
    """

    index: int
    rows: slice
    samples: slice
    sequences: Sequences

    @property
    def mask(self) -> Tensor:
        return self.sequences.mask[self.rows]

    @property
    def sequence_id(self) -> np.ndarray:
        return self.sequences.sequence_id[self.samples]

    @property
    def position(self) -> np.ndarray:
        return self.sequences.position[self.samples]

    def real(self, site: str, value: Tensor) -> Tensor:
        """The rows of real tokens of a ``[batch, pos, ...]`` site output, ``[n_real, ...]`` in
        sample order, on its device and in its dtype; checked finite (the error names the site,
        sequence and position)."""
        return real_values(value, self.mask.bool(), site, self.rows.start)


class Measurement:
    """Something measured while the model runs (module docstring). Subclasses implement every
    method; nothing is learned in ``__init__`` beyond the plan (which sequences, which sites)."""

    def sites(self, batch_index: int) -> Sequence[str]:
        raise NotImplementedError

    def update(self, site: str, value: Tensor, batch: Batch) -> None:
        raise NotImplementedError

    def end_batch(self, batch: Batch) -> None:
        """After every site of ``batch`` was handed over (nothing to do by default)."""

    def end_pass(self) -> bool:
        return False

    def spawn(self) -> "Measurement":
        raise NotImplementedError

    def merge(self, other: "Measurement") -> None:
        raise NotImplementedError

    def result(self):
        raise NotImplementedError


def run(
    model,
    sequences: Sequences,
    measurements: Sequence[Measurement],
    batch_size: int = 32,
    executor=None,
    shards: int | None = None,
    progress: str | None = None,
    hooks: HookList | BatchHooks | None = None,
) -> list:
    """Feed ``measurements`` every batch of ``sequences``, pass after pass, and return their results.

    Args:
        model: a hooked model (``Decoder``, ``TransformerBridge``, ``HookedModule``: anything with
            a ``hook_dict``). With ``executor``: a picklable zero-argument callable that loads
            the model (each shard loads its own copy; the model itself is never shipped).
        sequences: the token set (:meth:`Sequences.of`).
        measurements: what to measure; each is updated in place.
        batch_size: sequences per forward pass.
        executor: a ``concurrent.futures`` executor to run shards on, e.g. a Dask cluster's
            ``Client(address).get_executor()``; None: every batch here.
        shards: how many contiguous groups of batches to send to ``executor`` per pass
            (default: the number of batches, at most 8).
        progress: a label to show a bar over the tokens of each pass with (tokens/s and ETA),
            on stderr; None: no bar.
        hooks: an intervention for every pass: TransformerLens hooks added around each batch's
            forward pass only (:func:`~nopelens.probes.collect.hooks_added`, before the
            measurements' own hooks, so they read the changed values): a
            :data:`~nopelens.probes.collect.HookList` for every batch, or a
            :data:`~nopelens.probes.collect.BatchHooks` called with each batch's rows and mask
            (e.g. :func:`~nopelens.analyses.intervene.sink_batch_hooks`). With ``executor`` it is
            sent to the shards, so it must pickle (a module-level function or a dataclass does).

    Returns:
        ``[m.result() for m in measurements]``.

    Raises:
        TypeError: if the model has no ``hook_dict``, or ``executor`` is given with a model
            instead of a loader or with ``hooks`` that do not pickle.
        KeyError: for a site or hook point the model does not have.
        ValueError: as :func:`~nopelens.probes.collect.collect` and the measurements.
    """
    batches = sequences.batches(batch_size)
    if executor is not None and (isinstance(model, torch.nn.Module) or not callable(model)):
        raise TypeError(
            "with an executor, pass a zero-argument function that loads the model: each shard "
            "loads its own copy (two shards must not hook one model object)"
        )
    if executor is None:
        _check_hooked(model)
    elif hooks is not None:
        _check_picklable(hooks)
    # a later pass hooks what the first one did: which hooks are attached can change the model's
    # arithmetic (the Decoder attends through a fused kernel unless scores or patterns are hooked)
    hooked = {i: _asked(measurements, i) for i in range(len(batches))}
    n_pass = 0
    while True:
        needed = [i for i in range(len(batches)) if _asked(measurements, i)]
        n_pass += 1
        if executor is None:
            tokens = int(sum(sequences.offsets[batches[i].stop] - sequences.offsets[batches[i].start] for i in needed))
            with progress_bar(
                total=tokens,
                desc=f"{progress}: pass {n_pass}",
                unit="token",
                unit_scale=True,
                leave=False,
                disable=progress is None,
            ) as bar:
                _run_batches(model, sequences, measurements, batches, needed, hooked, bar.update, hooks)
        else:
            _run_shards(model, sequences, measurements, batches, needed, hooked, executor, shards, hooks)
        more = any([m.end_pass() for m in measurements])
        release_freed_memory()  # the fits' copies
        if not more:
            return [m.result() for m in measurements]


def replay(
    acts: Activations,
    measurements: Sequence[Measurement],
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    sequences: Sequences | None = None,
) -> list:
    """Feed ``measurements`` cached activations as :func:`run` feeds them a model's hooks, pass
    after pass, and return their results: the in-memory API (``probe_absolute_index(acts, ...)``)
    is this over the same measurements, so a read is one definition, streamed or in memory.

    Each batch's site outputs are rebuilt padded (``[batch, pos, ...]``, and ``[batch, head_index,
    query_pos, key_pos]`` with 0 weight or a -inf score at the padded entries) on ``device``,
    in the dtype the model computed them in where that is coarser than the float32 copy
    (bfloat16, float16: the conversion back is exact), else float32, so every measurement judges
    round-off as it would on the model's output.

    Args:
        acts: from :func:`~nopelens.probes.collect.collect`.
        measurements: what to measure (:mod:`nopelens.probes.stream_probes`, ...); each is updated in place.
        batch_size: sequences per replayed batch (no number depends on it for measurements that
            keep every batch).
        device: where the rebuilt batches, and so the measurements' algebra, live.
        sequences: the token set (default :meth:`Sequences.of_activations`; the measurements
            must have been planned on the same one).

    Returns:
        ``[m.result() for m in measurements]``.

    Raises:
        KeyError: for a site that was not collected.
        ValueError: as :meth:`Sequences.of_activations` and the measurements.
    """
    sequences = Sequences.of_activations(acts) if sequences is None else sequences
    batches = sequences.batches(batch_size)
    while True:
        for i, rows in enumerate(batches):
            wanted = [(m, set(m.sites(i))) for m in measurements]
            batch = Batch(
                i, rows, slice(int(sequences.offsets[rows.start]), int(sequences.offsets[rows.stop])), sequences
            )
            for site in dict.fromkeys(site for m in measurements for site in m.sites(i)):
                value = _cached(acts, site, batch, torch.device(device))
                for measurement, asked in wanted:
                    if site in asked:
                        measurement.update(site, value, batch)
            for measurement, asked in wanted:
                if asked:
                    measurement.end_batch(batch)
        if not any([m.end_pass() for m in measurements]):
            return [m.result() for m in measurements]


def _replay_dtype(name: str) -> torch.dtype:
    """The dtype a replayed site is given: the model's when coarser than float32, else float32."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def _cached(acts: Activations, site: str, batch: Batch, device: torch.device) -> Tensor:
    """``site``'s cached output on ``batch``, padded as the hook gave it."""
    real = batch.mask.bool()
    if site in acts.acts:
        dtype = _replay_dtype(acts.dtype(site))
        rows = torch.as_tensor(acts.acts[site][batch.samples])
        value = torch.zeros((*real.shape, *rows.shape[1:]), dtype=dtype)
        value[real] = rows.to(dtype)
        return value.to(device)
    if site in acts.patterns:
        arrays = acts.patterns[site][batch.rows]
        dtype = _replay_dtype(acts.dtypes.get(site, "float32"))
        pad = 0.0 if site.endswith("hook_pattern") else -torch.inf  # no weight, or a blocked score
        value = torch.full((real.shape[0], arrays[0].shape[0], *real.shape[1:], real.shape[1]), pad, dtype=dtype)
        for r, array in enumerate(arrays):
            columns = torch.nonzero(real[r]).flatten()
            value[r][:, columns[:, None], columns[None, :]] = torch.as_tensor(array).to(dtype)
        return value.to(device)
    raise KeyError(f"site {site!r} was not collected; collected: {sorted(acts.acts) + sorted(acts.patterns)}")


def _asked(measurements, i: int) -> list[str]:
    return list(dict.fromkeys(site for m in measurements for site in m.sites(i)))


def _check_picklable(hooks) -> None:
    try:
        pickle.dumps(hooks)
    except Exception as error:  # pickle raises several types (PicklingError, AttributeError, TypeError)
        raise TypeError(
            f"the intervention hooks cannot be sent to the shards ({type(error).__name__}: {error}); "
            "give a module-level function or a dataclass instance, or run without an executor"
        ) from None


def _check_hooked(model) -> dict:
    hook_points = getattr(model, "hook_dict", None)
    if not isinstance(hook_points, dict):
        raise TypeError(
            f"{type(model).__name__} has no TransformerLens hook_dict; wrap it with "
            "nopelens.models.adapters.HookedModule(model, sites={site: module_path})"
        )
    return hook_points


def _run_batches(
    model,
    sequences: Sequences,
    measurements,
    batches: list[slice],
    indices: Sequence[int],
    hooked: dict[int, list[str]],
    done: Callable[[int], object] | None = None,
    hooks: HookList | BatchHooks | None = None,
) -> None:
    """Forward passes over ``batches[i]`` for ``i`` in ``indices`` with hooks on ``hooked[i]``, each
    site handed to whoever asked for it, under the intervention ``hooks`` (see :func:`run`)."""
    hook_points = _check_hooked(model)
    device = _model_device(model)
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        for i in indices:
            wanted = [(m, set(m.sites(i))) for m in measurements]
            if not any(asked for _, asked in wanted):
                continue
            sites = _resolve_sites(hooked[i], hook_points)
            rows = batches[i]
            batch = Batch(
                i, rows, slice(int(sequences.offsets[rows.start]), int(sequences.offsets[rows.stop])), sequences
            )

            def hand_over(site: str, value: Tensor) -> None:
                for measurement, asked in wanted:
                    if site in asked:
                        measurement.update(site, value, batch)

            mask = sequences.mask[rows].to(device) if sequences.masked else None
            with hooks_added(model, hooks_for_batch(hooks, rows, sequences.mask[rows])):
                forward_with_hooks(model, hook_points, sites, sequences.tokens[rows].to(device), mask, hand_over)
            for measurement, asked in wanted:
                if asked:
                    measurement.end_batch(batch)
            release_freed_memory()  # the forward pass's temporaries, before the statistics pin them
            if done is not None:
                done(batch.samples.stop - batch.samples.start)
    finally:
        for module, training in flags:
            module.training = training


def _run_shards(load: Callable, sequences, measurements, batches, indices, hooked, executor, shards, hooks) -> None:
    if not indices:
        return
    shards = min(len(indices), 8) if shards is None else shards
    if not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ValueError(f"shards must be a positive integer, got {shards!r}")
    groups = [list(part) for part in np.array_split(np.asarray(indices), min(shards, len(indices))) if len(part)]
    futures = [
        executor.submit(
            _shard,
            load,
            sequences,
            [m.spawn() for m in measurements],
            batches,
            group,
            {i: hooked[i] for i in group},
            hooks,
        )
        for group in groups
    ]
    for future in futures:  # in shard order, so the sums are the same on every run
        for measurement, part in zip(measurements, future.result()):
            measurement.merge(part)


def _shard(load: Callable, sequences: Sequences, measurements, batches, indices, hooked, hooks=None) -> list:
    """One shard on a worker: load the model, feed the measurements its batches (under ``hooks``),
    return them."""
    with one_thread():
        _run_batches(load(), sequences, measurements, batches, indices, hooked, hooks=hooks)
    return measurements


# AttentionVariance lives with its read in variance.py (it imports this module: the old name answers lazily)
__getattr__ = moved_names(
    __name__,
    moved={"AttentionVariance": "nopelens.probes.variance", "ROWS_AT_ONCE": "nopelens.probes.variance"},
)
