"""The sweep's measurements of one subject through the streaming engine: every model's, the
sweep's small ones with every batch's features kept (one pass), ``nopelens probe hf:DIR``'s under
the budgets below.

:func:`measure_streamed` gives the tables of :func:`~nopelens.analyses.sweep.driver.analyse_subject`
(probes, sinks, variance), measured while the model runs
(:func:`nopelens.probes.stream.run`): the probes from per-block sufficient statistics
(:mod:`nopelens.probes.stream_probes`), the attention sinks from per-head sums
(:class:`~nopelens.probes.sinks.SinkStats`), the variance from per-position moments
(:class:`~nopelens.probes.variance.AttentionVariance`). Nothing of size tokens x d_model or T x T
outlives its batch beyond the keep budget (:class:`~nopelens.probes.stream.KeepBudget`: features
kept for the out-of-fold predictions instead of a second forward pass: by default 512 MiB or a
quarter of the memory available when the run starts, whichever is less). The budget buys a whole
pass: a run keeps its features when all of them fit it, and otherwise keeps none and predicts in a
second pass (:func:`~nopelens.analyses.sweep.budget.run_budget`), so a run holds the kept features
or the statistics, never both, and memory does not grow with the number of tokens past the budget.

The sink ablation is streamed too (:func:`~nopelens.analyses.intervene.sink_ablation_drop_streamed`):
the clean later-token probes of every ablatable block's next layer are measured in the main run,
then one run per block with its first real key removed probes that layer, each pass stopped
after it (about n_layers / 2 extra full passes). Blocks whose attention cannot be ablated and
checked get ``not_applicable`` rows with the reason, as in memory. ``sink_ablation=False`` in the
settings (``nopelens probe --no-sink-ablation``) skips it, and the run says so.

The statistics grow with the sites probed and their width, not with the tokens (about 1 GB per
layer of a 2048-wide model, each Gram matrix held as its upper triangle). When those of every
site do not fit the memory the run may use (``--memory-mib``, default: what is free on the
model's device), the sites run in groups by depth, one streamed run each, stopped after its
deepest site (:func:`~nopelens.analyses.sweep.budget.statistics_groups`): more forward passes, the
same numbers, and memory that does not grow with the depth either.

:func:`~nopelens.analyses.sweep.plan.plan` says before the run how many forward passes, tokens and how
much memory the statistics need (``nopelens probe --plan``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from nopelens.models.compat import moved_names
from nopelens.models.hooks import act_names
from nopelens.models.methods import get_method
from nopelens.models.placement import model_device
from nopelens.probes.collect import site_block
from nopelens.probes.sinks import GU_WINDOW, SinkStats, empty_sink_table, uniform_sink_score
from nopelens.probes.stream import (
    KeepBudget,
    Sequences,
    available_memory,
    release_freed_memory,
    run,
)
from nopelens.probes.stream_probes import Probes
from nopelens.probes.variance import AttentionVariance

from ..intervene import later_token_probes, refused_sink_blocks, sink_ablation_drop_streamed
from ..subjects import Subject
from .budget import (  # noqa: F401  (the memory budget's names, re-exported)
    ACTIVATION_COPIES,
    MAX_AUTO_BATCH,
    STATISTICS_OVERHEAD,
    STATISTICS_SHARE,
    ablation_budget,
    auto_batch_size,
    auto_keep_bytes,
    feature_bytes,
    group_held_bytes,
    group_kept,
    held_bytes,
    job_statistics_bytes,
    kept_and_summed_bytes,
    n_features,
    run_budget,
    sequence_bytes,
    site_shapes,
    statistics_bytes,
    statistics_groups,
)
from .reads import ProbeInput, SweepSites, bilinear_mode_of, measure_targets
from .sites import pattern_sites

SKIPPED_ABLATION = "skipped (--no-sink-ablation): the sink ablation's extra forward passes were not run"
NOT_PROBED = "not probed (--layers leaves this block out)"


@dataclass
class Measurements:
    """A subject's streamed measurements, planned before any forward pass."""

    sequences: Sequences
    stripped: Sequences | None  # the sequences without BOS, for the sink table's second condition
    sites: SweepSites
    probes: list
    variance: AttentionVariance | None
    sinks: SinkStats | None  # None: no block's sink can be read (every window is 1, or every block is DSA)
    sinks_stripped: SinkStats | None
    window: int
    budget: KeepBudget
    batch_size: int  # sequences per forward pass (``--batch-size``, or chosen by :func:`auto_batch_size`)
    ablation: Probes | None = None  # the sink ablation's clean later-token probes (None: skipped or nothing to ablate)
    ablation_refused: dict[int, str] | None = None  # block -> why it cannot be ablated (None: the ablation is skipped)
    free: int = 0  # bytes the run may use on the model's device (free there, or --memory-mib)
    free_source: str = "free on the device"  # which limit ``free`` is, for messages
    groups: list[list] | None = None  # the probes' jobs, one run per group (:func:`statistics_groups`)
    shapes: dict = field(default_factory=dict)  # each site's per-token shape (:func:`site_shapes`)
    activation_bytes: int = 4  # bytes per element of the model's activations (its dtype's)

    def all_probes(self) -> list[Probes]:
        """The probe measurements of the main run, the sink ablation's clean probes included."""
        return self.probes + ([self.ablation] if self.ablation is not None else [])

    def jobs(self) -> list:
        """Every job (one feature matrix) of :meth:`all_probes`."""
        return [job for probe in self.all_probes() for job in probe.jobs]

    def ablated_blocks(self, n_layers: int) -> list[int]:
        """The blocks the sink ablation will run with their first key removed."""
        if self.ablation_refused is None:
            return []
        return [block for block in range(n_layers) if block not in self.ablation_refused]


def measurements(
    subject: Subject, settings, sites: SweepSites, shapes: dict[str, tuple[int, ...]] | None = None
) -> Measurements:
    """The streamed measurements of ``subject`` under ``settings`` (a
    :class:`~nopelens.analyses.sweep.settings.SweepSettings`) on the sweep's ``sites``
    (:func:`~nopelens.analyses.sweep.sites.sweep_sites`): the sweep's probe set, its sink conditions, its
    variance sites and (unless ``settings.sink_ablation`` is False) the sink ablation's clean
    probes, after checking on two sequences which blocks can be ablated
    (:func:`~nopelens.analyses.intervene.refused_sink_blocks`: a few short forward passes).

    Raises:
        ValueError: as the probes' and sinks' constructors (too few sequences for the folds, ...).
    """
    shapes = site_shapes(subject, sites.all()) if shapes is None else shapes
    sequences = Sequences.of(subject.tokens, subject.attention_mask)
    device = model_device(subject.model)
    free, free_source = memory_allowed(settings, device)
    # the sweep's models (not settings.streamed): every batch's features kept, one pass; else a budget
    unlimited = not settings.streamed
    limit = None if unlimited else 0 if settings.keep_mib is None else settings.keep_mib * 2**20
    budget = KeepBudget(limit)  # auto: set once the jobs are known
    mode = bilinear_mode_of(shapes[sites.qk[0][0]]) if sites.qk else "outer"
    probes = measure_targets(
        ProbeInput(
            sequences,
            sites,
            seq_len=subject.tokens.shape[1],
            n_sequences=settings.n_sequences,
            n_splits=settings.n_splits,
            n_boot=settings.n_boot,
            seed=settings.seed,
            bilinear=mode,
            keep=budget,
        )
    )
    skipped = subject.note_unreadable_reads()  # DSA blocks, windows that leave nothing to average
    outputs = [site for site in act_names("attn_out", subject.variance_blocks()) if site in sites.outputs]
    variance = AttentionVariance(sequences, outputs, subject.key_windows()) if outputs else None
    sinks = SinkReads.of(
        subject, sequences, [site for site in sites.patterns if site_block(site) not in skipped["sink read"]]
    )
    refused, ablation = None, None
    if settings.sink_ablation:
        with torch.no_grad():
            refused = refused_sink_blocks(subject.model, subject.n_layers, subject.tokens, subject.attention_mask)
        refused.update(subject.attentionless_blocks())  # "ssm (no attention)", not "no hook point"
        if settings.layers is not None:  # blocks --layers leaves out get a not_applicable row, not a run
            refused.update({block: NOT_PROBED for block in range(subject.n_layers) if block not in settings.layers})
        blocks = [block for block in range(subject.n_layers) if block not in refused]
        if blocks:
            ablation = later_token_probes(
                sequences, [block + 1 for block in blocks], settings.n_splits, settings.n_boot, settings.seed, budget
            )
    m = Measurements(
        sequences,
        sinks.stripped,
        sites,
        probes,
        variance,
        sinks.with_bos,
        sinks.without_bos,
        sinks.window,
        budget,
        settings.batch_size,
        ablation,
        refused,
        free,
        free_source,
        shapes=shapes,
        activation_bytes=next(subject.model.parameters()).element_size(),
    )
    if settings.keep_mib is None and not unlimited:
        budget.limit = auto_keep_bytes(m, shapes)
    m.groups = statistics_groups(m, shapes)
    n = sequences.n_sequences
    if settings.batch_size != "auto":
        m.batch_size = min(settings.batch_size, n)  # as run, planned and recorded
    elif unlimited:
        m.batch_size = min(MAX_AUTO_BATCH, n)
    else:
        most = auto_batch_size(sequence_bytes(subject, shapes), free, held_bytes(m, shapes), min(MAX_AUTO_BATCH, n))
        m.batch_size = -(-n // -(-n // most))  # as even as the same number of batches allows (20: 10 + 10, not 19 + 1)
    return m


@dataclass
class SinkReads:
    """The sink table's reads (:class:`~nopelens.probes.sinks.SinkStats`): on the sequences as
    given, and, when they start with BOS, on the same sequences without it."""

    with_bos: SinkStats | None  # on the sequences as given (None: no block's sink can be read)
    stripped: Sequences | None  # the sequences without BOS (None: they have none)
    without_bos: SinkStats | None
    window: int  # Gu et al.'s T: at most GU_WINDOW queries, and no more than the shortest sequence

    @classmethod
    def of(cls, subject: Subject, sequences: Sequences, patterns: Sequence[str]) -> "SinkReads":
        """The reads of ``subject``'s ``patterns`` (its ``hook_pattern`` sites whose sink can be read;
        an output-scale sink block's ``hook_v`` and ``hook_z`` are asked for by the reads themselves)."""
        windows, sinks = subject.key_windows(), subject.sinks()
        shortest = int(subject.attention_mask.sum(-1).min())  # synthetic tasks pad sequences of mixed lengths
        window = min(GU_WINDOW, shortest)
        stats = SinkStats(sequences, patterns, n_tokens=window, windows=windows, sinks=sinks) if patterns else None
        stripped, stripped_stats = None, None
        if subject.has_bos:
            stripped = Sequences.of(subject.tokens[:, 1:], subject.attention_mask[:, 1:])
            stripped_stats = (
                SinkStats(stripped, patterns, n_tokens=min(window, shortest - 1), windows=windows, sinks=sinks)
                if patterns
                else None
            )
        return cls(stats, stripped, stripped_stats, window)

    def table(
        self, subject: Subject, measured: pd.DataFrame | None, batch_size: int, label: str | None = None
    ) -> pd.DataFrame:
        """The sink table: ``measured`` (:attr:`with_bos`'s result, from the caller's run) and a run
        of :attr:`without_bos`, with ``condition`` (``with_bos`` or ``without_bos``), ``model`` and
        ``gu_window`` (T per condition, the last column). ``label``: a progress bar's, or None."""
        condition = "with_bos" if subject.has_bos else "without_bos"
        if self.with_bos is None:
            frames = [empty_sink_table(self.window, subject.sinks()).assign(condition=condition, gu_window=self.window)]
        else:
            frames = [measured.assign(condition=condition, gu_window=self.with_bos.n_tokens)]
        if self.without_bos is not None:
            frames.append(
                run(
                    subject.model,
                    self.stripped,
                    [self.without_bos],
                    batch_size=batch_size,
                    progress=label and f"{label} without BOS",
                )[0].assign(condition="without_bos", gu_window=self.without_bos.n_tokens)
            )
        sinks = pd.concat(frames, ignore_index=True).assign(model=subject.name)
        return sinks[[c for c in sinks if c != "gu_window"] + ["gu_window"]]


def measure_sinks(subject: Subject, batch_size: int = 32) -> pd.DataFrame:
    """:meth:`SinkReads.table` of ``subject``'s every readable ``hook_pattern`` (``nopelens sinks``),
    streamed in batches of ``batch_size`` sequences."""
    skipped = subject.note_unreadable_reads()["sink read"]  # DSA blocks, windows of 1
    sequences = Sequences.of(subject.tokens, subject.attention_mask)
    reads = SinkReads.of(
        subject, sequences, [site for site in pattern_sites(subject) if site_block(site) not in skipped]
    )
    with torch.no_grad():
        measured = run(subject.model, sequences, [reads.with_bos], batch_size=batch_size)[0] if reads.with_bos else None
        return reads.table(subject, measured, batch_size)


def memory_allowed(settings, device: torch.device) -> tuple[int, str]:
    """Bytes a streamed run may use on ``device`` (the memory free there when it starts,
    :func:`~nopelens.probes.stream.available_memory`, or ``settings.memory_mib`` if less) and which
    of the two it is, in words for a message."""
    free = available_memory(device)
    if settings.memory_mib is not None and settings.memory_mib * 2**20 <= free:
        return settings.memory_mib * 2**20, "allowed (--memory-mib)"
    capped = f", less than --memory-mib {settings.memory_mib}" if settings.memory_mib is not None else ""
    return free, f"free on {torch.device(device).type}{capped}"


def measure_streamed(
    subject: Subject, settings, sites: SweepSites, progress: bool = False, planned: Measurements | None = None
) -> dict[str, pd.DataFrame | None]:
    """:func:`~nopelens.analyses.sweep.driver.analyse_subject`'s tables of ``subject`` on ``sites``, streamed
    (module docstring): ``probes``, ``sinks`` (with and without BOS), ``variance`` as measured (per
    position, before the sweep drops BOS and fits slopes; None without attention outputs) and
    ``sink_ablation`` (:func:`~nopelens.analyses.intervene.sink_ablation_drop`'s table; empty,
    and ``not_applicable`` says so, when ``settings.sink_ablation`` is False). With ``--input
    repeated`` the known answer is checked and recorded in ``subject.info["known_answer"]``.
    ``progress``: a bar per pass with tokens/s and ETA. ``planned``: the measurements a
    :func:`~nopelens.analyses.sweep.plan.plan` made (its
    :attr:`~nopelens.analyses.sweep.plan.Plan.measurements`), so that the run keeps to the plan's batch
    size, keep budget and groups whatever the free memory does in between; None: made here."""
    plan_ = measurements(subject, settings, sites) if planned is None else planned
    batch_size = plan_.batch_size
    label = subject.name if progress else None
    measured = _run_groups(subject.model, plan_, label)
    probes = pd.concat([probe.result() for probe in plan_.probes], ignore_index=True)
    probes.insert(0, "model", subject.name)
    reads = SinkReads(plan_.sinks, plan_.stripped, plan_.sinks_stripped, plan_.window)
    sinks = reads.table(subject, measured.get(id(plan_.sinks)), batch_size, label)
    variance = measured.get(id(plan_.variance))
    if plan_.ablation_refused is None:
        ablation = pd.DataFrame()
        subject.info.setdefault("not_applicable", {})["sink ablation"] = SKIPPED_ABLATION
    else:
        clean = plan_.ablation.result() if plan_.ablation is not None else None
        with torch.no_grad():
            ablation = sink_ablation_drop_streamed(
                subject.model,
                plan_.sequences,
                subject.n_layers,
                clean,
                plan_.ablation_refused,
                settings.n_splits,
                settings.n_boot,
                settings.seed,
                ablation_budget(plan_),
                batch_size,
                label,
            )
        ablation = ablation.assign(model=subject.name)
    subject.info["streamed"] = {
        "batch_size": batch_size,
        "kept_bytes_limit": plan_.budget.limit,
        "statistics_groups": len(plan_.groups),
        "second_pass_batches": sorted({i for m in plan_.probes for job in m.jobs for i in job.rerun}),
    }
    if subject.info.get("input") == "repeated":
        subject.info["known_answer"] = repeated_token_answer(subject, sinks)
        tqdm.write(f"nopelens: {subject.name}: {subject.info['known_answer']}", file=sys.stderr)
    return {"probes": probes, "sinks": sinks, "variance": variance, "sink_ablation": ablation}


def _run_groups(model, m: Measurements, label: str | None) -> dict[int, pd.DataFrame]:
    """Run the probes' jobs group by group (:func:`statistics_groups`, each with its
    :func:`run_budget`), the sink and variance reads with the last (deepest) group; every probe
    measurement of ``m`` is done afterwards. Returns the sink and variance tables by ``id`` of
    their measurement."""
    parents = m.all_probes()
    others = [measurement for measurement in (m.variance, m.sinks) if measurement is not None]
    measured = {}
    for g, group in enumerate(m.groups):
        members, budget = {id(job) for job in group}, run_budget(m, group, m.shapes)
        parts = [
            part
            for part in (probe.subset([job for job in probe.jobs if id(job) in members], budget) for probe in parents)
            if part.jobs
        ]
        extra = others if g == len(m.groups) - 1 else []
        tag = label if label is None or len(m.groups) == 1 else f"{label}, sites {g + 1}/{len(m.groups)}"
        results = run(model, m.sequences, parts + extra, batch_size=m.batch_size, progress=tag)
        measured.update({id(measurement): table for measurement, table in zip(extra, results[len(parts) :])})
        del parts, results
        release_freed_memory()  # this group's statistics, before the next group's
    for probe in parents:
        probe.finish()
    return measured


def repeated_token_answer(subject: Subject, sinks: pd.DataFrame) -> str:
    """The known answer of one token repeated, checked on the sink table.

    With every token the same, every key and value of block 0 is the same vector, so every
    position's state is the same at every layer (whatever the attention weights: they average
    equal values), under NoPE and RoPE alike (Gu et al. 2025, "When attention sink emerges in
    language models", Prop. 1). Under NoPE the scores of a row are then equal too, so attention
    is exactly uniform: sink mass mean_{i>=1} 1 / (i + 1), Gu's score H_T / T
    (:func:`~nopelens.probes.sinks.uniform_sink_score`). The line gives the largest deviation of
    the NoPE blocks' heads from these (float round-off of the model's dtype only).
    """
    rows = sinks[sinks["condition"] == sinks["condition"].iloc[0]] if len(sinks) else sinks
    nope = uniform_blocks(subject)
    at = rows[rows["block"].isin(nope)]
    if at.empty:
        return (
            "known answer (--input repeated, Gu et al. 2025 Prop. 1): no block probed here has the exactly uniform "
            "attention the theory fixes (a causal NoPE softmax block without a sink or relative bias, after "
            "blocks that keep every position's state the same)"
        )
    length = int(subject.attention_mask.sum(-1).min())
    window = int(rows["gu_window"].iloc[0])
    mass = float(np.mean([1.0 / (i + 1) for i in range(1, length)]))
    deviation = max(
        float((at["sink_mass"] - mass).abs().max()), float((at["sink_score"] - uniform_sink_score(window)).abs().max())
    )
    return (
        f"known answer (--input repeated, Gu et al. 2025 Prop. 1): NoPE blocks {nope} attend exactly uniformly "
        f"(sink mass {mass:.6f}, Gu score H_T/T = {uniform_sink_score(window):.6f}); measured: largest deviation "
        f"{deviation:.2e} over their heads"
    )


def uniform_blocks(subject: Subject) -> list[int]:
    """The blocks whose attention one repeated token makes exactly uniform (Gu et al. 2025, Prop. 1).

    Equal states stay equal through softmax attention that adds no sink (any weights average
    equal values: NoPE, RoPE, windows) and through MLP-only blocks; a linear-attention or SSM
    mixer (its convolution and recurrence see how far a token is from the start), a sink that is
    no token (the row keeps 1 - p_sink, which depends on the query's position) or an absolute
    input position ends it. Among the blocks reached with equal states, those whose scores are
    then equal too: NoPE under the causal rule alone, without a relative bias.
    """
    if subject.hf is None:
        return [l for l in range(subject.n_layers) if _positionless(subject.position)]
    if subject.hf.input_position is not None:
        return []
    blocks = []
    for l, layer in enumerate(subject.hf.layers):
        if layer.mixer == "none":
            continue
        if layer.mixer != "attention" or layer.sink is not None:
            break
        if _positionless(layer.method) and layer.key_window.causal_only and layer.relative_bias is None:
            blocks.append(l)
    return blocks


def _positionless(method: str) -> bool:
    """A layer method that puts no position anywhere (NoPE: the method unit acts on no place)."""
    try:
        return not get_method(method).reads_positions
    except ValueError:  # not a position method nopelens knows (e.g. a linear-attention layer)
        return False


__getattr__ = moved_names(
    __name__,
    moved=dict.fromkeys(
        ("Plan", "plan", "fit_work", "fit_rates", "block_seconds", "CALIBRATION_MAX_WIDTH"),
        "nopelens.analyses.sweep.plan",
    ),
)
