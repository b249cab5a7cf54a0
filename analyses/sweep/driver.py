"""The main job: at which layer does each model's absolute index, then relative distance, become
linearly recoverable, and where are its attention sinks?

For each subject (see :mod:`nopelens.analyses.subjects`) the sweep measures, on fresh sequences and
while the model runs (the streaming engine, :mod:`nopelens.analyses.sweep.streamed`: one driver for
every model):

- absolute index at every residual layer (0 = embeddings ... n_layers) and at every block's
  ``hook_attn_out`` and ``hook_mlp_out``: classification and regression probes with the control
  task, shuffled labels, majority class and token-identity baselines, and selectivity; plus an
  extrapolation probe (fit on positions < L/2, score on >= L/2) at residual layers;
- relative distance i - j over distance-balanced pairs: pair features [h_i; h_j] at residual
  layers; at every block's attention, the *score read* (a linear read of the heads' pre-softmax
  scores ``hook_attn_scores``, content plus position bias, relative to the query's own key; where
  a model has no such hook the column is absent) and the *content-only q.k read* (the per-head
  bilinear read of (rotated) q_i and k_j, blind to a score bias such as ALiBi's or Shaw's);
- attention-sink mass, Gu et al.'s sink score and rate per layer and head, with and without BOS;
- variance shrinkage of every block's attention output against position (Chi et al. 2023).

Layer of an attention read: block ``l``'s score and q.k reads are reported at layer ``l + 1``, the
residual layer its head writes into (:func:`~nopelens.probes.probe_relative_distance` labels them
so), so "relative distance first recoverable at layer 2" means block 1's attention is the first
whose scores can read i - j. Pair features on the residual stream inherit any linear absolute
index (i - j is linear in [h_i; h_j] whenever i and j are), so that row clears wherever absolute
regression does; the score read asks whether a head's own scores can use the distance, whatever
the method puts it there (RoPE through q and k, ALiBi and Shaw through the bias, NoPE only
through what earlier layers wrote), and the content-only read asks whether q and k alone carry it.

Training seeds: with ``train_seeds=(0, 1, 2)`` every zoo model is trained (and cached) once per
seed and each is measured; the tables carry a ``train_seed`` column and the summary reports means
over seeds with their spread (see :mod:`nopelens.analyses.sweep.seeds`). A sweep's unit of work is one
(model, training seed); :mod:`nopelens.analyses.sweep.parallel` runs these in this process, in local
worker processes (``jobs``) or on a Dask cluster (``scheduler``).

What the summary reports per model (one column, header and figure panel each) are the reads of
:data:`~nopelens.analyses.sweep.reads.SWEEP_READS`; the probe rows come from their target functions.

Results go to a run folder (:mod:`~nopelens.analyses.runs`): ``probes.csv``, ``sinks.csv``,
``variance.csv``, ``sink_ablation.csv``, ``summary.csv``, ``layers.csv`` and the stamp
``sweep.json``; its figures (PNG; SVG on request) and ``summary.md`` are rendered from the result
by :func:`~nopelens.analyses.report.write_run`, which ``nopelens sweep`` calls. Each (model,
seed)'s tables are written under ``parts/`` once it is done, so an interrupted sweep resumes where
it stopped.
"""

from __future__ import annotations

import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import sklearn
import torch
from tqdm.auto import tqdm

import nopelens
from nopelens.models.compat import moved_names
from nopelens.models.io import write_csv_atomic
from nopelens.models.progress import progress_bar
from nopelens.models.threads import one_thread
from nopelens.probes.sinks import variance_slopes

from .. import runs
from ..subjects import (
    HF_PREFIX,
    Subject,
    check_spec,
    display_name,
    input_changes,
    input_fingerprint,
    planned_work,
    resolve,
)
from . import layers, parallel, reads, seeds
from .eta import SweepETA, speed_factor
from .plan import plan

# the sweep's settings, sites and summary have modules of their own; their names still import from here
from .settings import DEFAULT_MODELS, DEFAULT_SITES, SITE_KINDS, SweepSettings  # noqa: F401
from .sites import block_ranges, pattern_sites, probed_blocks, score_sites, sink_sites, sweep_sites  # noqa: F401
from .streamed import measure_streamed
from .summary import summarize, summarize_per_seed  # noqa: F401

TABLES = ("probes", "sinks", "variance", "sink_ablation")


@dataclass
class SweepResult:
    """The tidy tables of a sweep.

    ``summary`` has one row per model (means over training seeds when there are several, see
    :func:`~nopelens.analyses.sweep.seeds.over_seeds`); ``summary_per_seed`` one row per model and seed;
    ``curves`` the main curves per layer (:func:`~nopelens.analyses.sweep.layers.layer_curves`);
    ``reads`` the reads the summary and curves report (``--metric``, ``--threshold``);
    ``variant`` names the files of reads other than the default ones (:func:`variant_name`), so
    a re-read writes ``summary-<variant>.md`` beside the original and never over it.
    """

    probes: pd.DataFrame
    sinks: pd.DataFrame
    variance: pd.DataFrame
    summary: pd.DataFrame
    out_dir: Path | None = None
    subjects: dict[str, dict] = field(default_factory=dict)
    summary_per_seed: pd.DataFrame | None = None
    sink_ablation: pd.DataFrame = field(default_factory=pd.DataFrame)
    curves: pd.DataFrame | None = None
    reads: tuple[reads.SweepRead, ...] | None = None
    variant: str = ""


# ----------------------------------------------------------------------------- one subject


def analyse_subject(
    subject: Subject, settings: SweepSettings, label: str | None = None, progress: bool = False
) -> dict[str, pd.DataFrame]:
    """Probe, sink, variance and sink-ablation tables of one subject (see the module docstring),
    measured through the streaming engine (:func:`~nopelens.analyses.sweep.streamed.measure_streamed`);
    the probe rows are those of the targets :data:`~nopelens.analyses.sweep.reads.SWEEP_READS` names.

    The sweep's models keep every batch's features (an unlimited keep budget, batches of 32: one
    pass). A streamed probe (``settings.streamed``: ``nopelens probe hf:DIR``) is planned first
    (:func:`~nopelens.analyses.sweep.plan.plan`, printed on stderr under ``label``), runs in the plan's
    batches, keep budget and groups, and is refused before any forward pass when it cannot fit.

    Raises:
        ValueError: naming the subject, when the plan's statistics do not fit the memory.
    """
    sites = sweep_sites(subject, settings.sites, settings.layers)
    planned = None
    if settings.streamed:
        plan_ = plan(subject, settings, sites)
        if plan_.shortfall:  # refused before any forward pass, not out of memory hours later (--plan shows the plan)
            raise ValueError(f"{label or subject.name}: {plan_.shortfall}")
        tqdm.write(plan_.describe(label or subject.name), file=sys.stderr)
        planned = plan_.measurements  # the batch size, keep budget and groups planned are those run
    tables = measure_streamed(subject, settings, sites, progress, planned=planned)
    tables["variance"] = _variance_table(subject, tables["variance"])
    return tables


def _variance_table(subject: Subject, variance: pd.DataFrame | None) -> pd.DataFrame:
    """The variance table as the sweep writes it: position 0 left out after a BOS (every sequence has
    the same token there, so its variance is exactly 0), each site's slope, the model (no row
    without attention outputs)."""
    if variance is None:
        variance = pd.DataFrame(columns=["site", "block", "position", "visible_keys", "variance", "n_sequences"])
    if subject.has_bos:
        variance = variance[variance["position"] > 0]
    return _with_slopes(variance).assign(model=subject.name)


def _with_slopes(variance: pd.DataFrame) -> pd.DataFrame:
    """Add each site's log-log slope; a site whose output never varies gets NaN, and says so."""
    constant = variance.groupby("site")["variance"].transform(lambda v: bool((v <= 0).any()))
    fitted = variance[~constant]
    slopes = variance_slopes(fitted).set_index("site")["slope"] if len(fitted) else pd.Series(dtype=float)
    note = np.where(constant, "output identical across sequences at some position (variance 0): no slope", "")
    return variance.assign(slope=variance["site"].map(slopes), note=note)


# ----------------------------------------------------------------------------- the run folder


def sweep(
    settings: SweepSettings,
    out_dir: str | Path | None = None,
    progress: bool = True,
    jobs: int = 1,
    scheduler: str | None = None,
    security: str | Path | None = None,
    sweep_reads: Sequence[reads.SweepRead] | None = None,
    name: str = "sweep",
    svg: bool | None = None,
    figures: bool | None = None,
    variant: str = "",
) -> SweepResult:
    """Run the sweep; with ``out_dir``, write (and resume) a run folder's parts and tables
    (:func:`write_tables`); its figures and ``summary.md`` are rendering,
    :func:`~nopelens.analyses.report.write_run`'s (``nopelens sweep`` calls it).

    Args:
        settings: what to measure.
        out_dir: run folder; each finished (model, seed) is saved under ``parts/`` at once. A run
            refused or failed before its first part leaves no stamp (:func:`~nopelens.analyses.runs.claimed`).
        progress: progress bars and lines on stderr.
        jobs: local worker processes, one (model, seed) each (see :mod:`~nopelens.analyses.sweep.parallel`).
        scheduler: address of a Dask scheduler (``tls://`` or ``tcp://``) to send the (model,
            seed) tasks to instead.
        security: YAML file of distributed's TLS settings for a ``tls://`` scheduler (see
            :func:`~nopelens.analyses.sweep.parallel.dask_security`).
        sweep_reads: the reads the summary, the per-layer curves and the figure report (default
            :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`; :func:`~nopelens.analyses.sweep.reads.choose_reads`
            makes others). They only read what was measured, so a run folder resumes with any.
        name: the command, for the progress bar (``sweep`` or ``probe``).
        variant: the name of the read-dependent tables' files for reads other than the default
            (:func:`variant_name`; ``""``: the default reads' own files).
        svg: deprecated and ignored (a one-line ``DeprecationWarning`` says so): the sweep
            writes tables; :func:`~nopelens.analyses.report.write_run` draws.
        figures: deprecated and ignored, as ``svg``.

    Raises:
        ValueError: if ``out_dir`` holds a sweep made with other settings or another analysis's
            run (:func:`~nopelens.analyses.runs.claim`), if there are fewer evaluation sequences
            than folds, or as :func:`~nopelens.analyses.subjects.resolve` and
            :func:`~nopelens.analyses.sweep.parallel.run_tasks`.
        KeyError, FileNotFoundError: on an unknown model spec (the message lists what exists).
        ChildProcessError: if parallel workers were lost (what finished is saved; rerun to resume).
    """
    if svg is not None or figures is not None:
        warnings.warn(
            "sweep(svg=, figures=) no longer draws: call nopelens.analyses.report.write_run(result, "
            "settings, command, versions()) on its result",
            DeprecationWarning,
            stacklevel=2,
        )
    for spec in settings.models:
        check_spec(spec)
    if settings.n_sequences < settings.n_splits:
        raise ValueError(
            f"{settings.n_sequences} evaluation sequences are fewer than the {settings.n_splits} cross-validation "
            f"folds (each fold holds out whole sequences); use --n-sequences {settings.n_splits} or more"
        )
    _check_distinct(settings.tasks())
    if scheduler is not None:  # a malformed address is refused before any work or progress bar
        parallel.check_address(scheduler)
        _check_absolute_paths(settings)
    out = Path(out_dir) if out_dir is not None else None
    if out is None:
        return _sweep_tasks(settings, None, progress, jobs, scheduler, security, sweep_reads, name, variant)
    with runs.claimed(
        out, "sweep", settings.to_dict(), ignore=settings.RESUMABLE_CHANGES, command=name, unset=settings.UNSET
    ):
        return _sweep_tasks(settings, out, progress, jobs, scheduler, security, sweep_reads, name, variant)


def _sweep_tasks(
    settings: SweepSettings,
    out: Path | None,
    progress: bool,
    jobs: int,
    scheduler: str | None,
    security: str | Path | None,
    sweep_reads: Sequence[reads.SweepRead] | None,
    name: str,
    variant: str = "",
) -> SweepResult:
    """:func:`sweep` once its folder ``out`` (or None) is claimed."""
    tasks = settings.tasks()
    inputs = {spec: input_fingerprint(spec, settings.hf_input) for spec in settings.models}
    done: dict[tuple[str, int], tuple[dict, dict]] = {}
    for task in tasks:
        part = runs.part_dir(out, *task) if out is not None else None
        finished = runs.read_part(part, TABLES) if part is not None else None
        if finished is not None:
            tables, meta = finished
            _check_same_inputs(part, task[0], meta.get("inputs"), inputs[task[0]])
            _check_same_settings(part, meta.get(SETTINGS_DIGEST), settings)
            tqdm.write(f"nopelens: {_label(*task)}: already measured in {part}, reusing", file=sys.stderr)
            done[task] = (
                {name: _as_measured(name, seeds.with_train_seed(table, task[1])) for name, table in tables.items()},
                meta,
            )
    todo = [task for task in tasks if task not in done]
    work = {
        task: planned_work(task[0], settings.n_sequences, settings.seq_len, task[1], settings.quick_steps)
        for task in todo
    }
    speed = 1.0
    if progress and any(task_work.estimated for task_work in work.values()):
        with one_thread():  # as each task runs: the opening ETA measured on this machine, as busy as it is now
            speed = speed_factor()
    eta = SweepETA(work, jobs=1 if scheduler is None and jobs <= 1 else max(1, jobs), speed=speed)
    bar = progress_bar(
        total=len(tasks),
        initial=len(done),
        desc=f"nopelens {name}",
        unit="model",
        bar_format="{desc}: {n_fmt}/{total_fmt} models [{elapsed}{postfix}]",
        disable=not progress,
    )
    bar.set_postfix_str(eta.describe())
    clock = [time.perf_counter()]

    def keep(task: tuple[str, int], measured: tuple[dict, dict]) -> None:
        measured = measured[0], {**measured[1], SETTINGS_DIGEST: settings.digest()}
        if inputs[task[0]] is not None:
            measured = measured[0], {**measured[1], "inputs": inputs[task[0]]}
        if out is not None:
            runs.write_part(runs.part_dir(out, *task), *measured)
        done[task] = measured
        seconds = measured[1].get("seconds", {})
        eta.finished(task, seconds.get("load", 0.0), seconds.get("measure", 0.0))
        clock[0] = time.perf_counter()
        bar.set_postfix_str(eta.describe(), refresh=False)
        bar.update()

    # local workers write their training progress as timed lines; Dask workers log elsewhere
    show_training = progress and scheduler is None
    try:
        parallel.run_tasks(
            measure, [(task, (*task, settings, show_training)) for task in todo], keep, jobs, scheduler, security
        )
    finally:  # an error's one line then starts on a line of its own
        bar.close()
    parts = [done[task][0] for task in tasks]
    probes, sinks, variance, ablation = (
        pd.concat([part[table] for part in parts], ignore_index=True) for table in TABLES
    )
    chosen = tuple(reads.SWEEP_READS if sweep_reads is None else sweep_reads)
    per_seed = summarize_per_seed(probes, sinks, variance, chosen)
    subjects = {_label(*task): done[task][1] for task in tasks}
    result = SweepResult(
        probes,
        sinks,
        variance,
        summarize(probes, sinks, variance, chosen),
        out,
        subjects,
        summary_per_seed=per_seed,
        sink_ablation=ablation,
        curves=layers.layer_curves(probes, sinks, chosen),
        reads=chosen,
        variant=variant,
    )
    if out is not None:
        write_tables(result)
    return result


def write_tables(result: SweepResult) -> None:
    """Write a sweep's tables into ``result.out_dir``: ``probes``, ``sinks``, ``variance``,
    ``summary``, ``layers`` (the main curves) and ``sink_ablation`` (when measured), and with
    several training seeds also ``summary_per_seed`` and ``probes_over_seeds``
    (:mod:`~nopelens.analyses.sweep.seeds`); a table this run has none of is removed if an earlier run
    in the folder left one, so the folder describes this run only. The tables that depend on
    the reads (``summary``, ``layers``, ``summary_per_seed``) are written as
    ``<name>-<variant>.csv`` when ``result.variant`` is set, beside the default reads' own."""
    out = result.out_dir
    tables = {name: getattr(result, name) for name in ("probes", "sinks", "variance")}
    several = "n_seeds" in result.summary
    tables["probes_over_seeds"] = seeds.probes_over_seeds(result.probes) if several else None
    tables["sink_ablation"] = None if result.sink_ablation.empty else result.sink_ablation
    suffix = f"-{result.variant}" if result.variant else ""
    tables[f"summary{suffix}"] = result.summary
    tables[f"layers{suffix}"] = result.curves
    tables[f"summary_per_seed{suffix}"] = result.summary_per_seed if several else None
    for name, table in tables.items():
        if table is None:
            (out / f"{name}.csv").unlink(missing_ok=True)
        else:
            write_csv_atomic(table, out / f"{name}.csv")


def variant_name(metric: str | None, threshold: str | None) -> str:
    """The name of the files of reads chosen by ``--metric`` and ``--threshold`` (``""``: the
    default reads, whose files are ``summary.md``, ``summary.csv``, ``layers.csv``, ``probes.png``).

    >>> variant_name("spearman", "0.8"), variant_name(None, "mad=2"), variant_name(None, None)
    ('spearman-0.8', 'mad_2', '')
    """
    return "-".join(runs.slug(text.replace(" ", "")) for text in (metric, threshold) if text)


SETTINGS_DIGEST = "settings_digest"
"""The ``done.json`` key of the settings a part was measured with (:meth:`SweepSettings.digest`)."""


def _check_same_settings(part: Path, recorded: str | None, settings: SweepSettings) -> None:
    """Refuse to reuse a finished part measured with other settings (a folder whose stamp was lost,
    or written by two runs at once). Parts from before the digest was recorded are reused.

    Raises:
        ValueError: naming the part.
    """
    if recorded is not None and recorded != settings.digest():
        raise ValueError(
            f"{part} was measured with other settings than this run's (another --seq-len, "
            "--n-sequences, --seed, --sites, ...); use another --out folder, or delete that part folder "
            "to measure it again"
        )


def _check_distinct(tasks: Sequence[tuple[str, int]]) -> None:
    """Refuse, before any work, two models that the tables would name alike or whose parts would
    share a folder (``hf:a/m`` and ``hf:b/m`` are both ``hf:m``; ``hf:m a`` and ``hf:m_a`` share
    ``parts/hf_m_a``).

    Raises:
        ValueError: naming both specs.
    """
    for what, key in (
        ("would both be named", lambda spec, seed: _label(display_name(spec), seed)),
        ("would share the part folder", lambda spec, seed: runs.part_dir(".", spec, seed).name),
    ):
        seen: dict[str, str] = {}
        for spec, seed in tasks:
            name = key(spec, seed)
            if name in seen and seen[name] != spec:
                raise ValueError(
                    f"{seen[name]} and {spec} {what} {name}; give each model once, under names "
                    "that differ (e.g. rename or link one directory)"
                )
            seen[name] = spec


def _check_absolute_paths(settings: SweepSettings) -> None:
    """Dask workers resolve paths in their own working directory: refuse relative ones.

    Raises:
        ValueError: naming the first relative path.
    """
    paths = [
        spec.removeprefix(HF_PREFIX)
        for spec in settings.models
        if spec.startswith(HF_PREFIX) or "/" in spec or Path(spec).exists()
    ]
    if settings.hf_input.text is not None:
        paths.append(settings.hf_input.text)
    for path in paths:
        if not Path(path).is_absolute():
            raise ValueError(
                f"--scheduler: {path} is a relative path, which each Dask worker would read in its own "
                f"working directory; give it as an absolute path ({Path(path).resolve()})"
            )


def _check_same_inputs(part: Path, spec: str, recorded: dict | None, current: dict | None) -> None:
    """Refuse to reuse a finished part whose model files or text changed since it was measured
    (:func:`~nopelens.analyses.specs.input_fingerprint`): its tables would describe another model.

    Raises:
        ValueError: naming what changed.
    """
    changes = input_changes(recorded, current)
    if changes:
        raise ValueError(
            f"{part} was measured on other inputs than {spec} gives now ({', '.join(changes)} since); "
            "use another --out folder, or delete that part folder to measure it again"
        )


def measure(spec: str, train_seed: int, settings: SweepSettings, progress: bool = False) -> tuple[dict, dict]:
    """One sweep task: load (or train) ``spec`` with training seed ``train_seed`` and measure it.

    Runs in any process (a local worker or a Dask worker): it reads only its arguments and the
    zoo cache of the machine it runs on. It runs on one thread
    (:func:`~nopelens.models.threads.one_thread`), so its numbers do not depend on the core count
    or on how many workers share the machine; in a Dask worker that runs several tasks at once it
    refuses (:func:`~nopelens.analyses.sweep.parallel.check_alone_in_process`).

    Returns:
        ``(tables, meta)``: the ``probes``, ``sinks`` and ``variance`` tables (with ``train_seed``
        columns) and what the run folder records about the model.
    """
    parallel.check_alone_in_process()
    with one_thread():
        return _measure(spec, train_seed, settings, progress)


def _measure(spec: str, train_seed: int, settings: SweepSettings, progress: bool) -> tuple[dict, dict]:
    def say(line: str) -> None:  # a progress line: --quiet hides it (notes and the plan stay)
        if progress:
            tqdm.write(f"nopelens: {line}", file=sys.stderr)

    say(f"{_label(spec, train_seed)}: loading")
    start = time.perf_counter()
    subject = resolve(
        spec,
        settings.n_sequences,
        settings.seq_len,
        settings.seed,
        progress,
        settings.quick_steps,
        train_seed=train_seed,
        hf_input=settings.hf_input,
    )
    loaded = time.perf_counter()
    if "beyond_trained_length" in subject.info:
        tqdm.write(
            f"nopelens: {_label(subject.name, train_seed)}: note: {subject.info['beyond_trained_length']}",
            file=sys.stderr,
        )
    probed_blocks(subject, settings.layers)  # a block the model lacks is refused before the "probing" line
    what = f"{subject.n_layers + 1} layers" if settings.layers is None else f"blocks {block_ranges(settings.layers)}"
    say(f"{_label(subject.name, train_seed)}: probing {what}")
    with torch.no_grad():
        tables = analyse_subject(subject, settings, _label(subject.name, train_seed), progress)
    tables = {name: table.assign(train_seed=train_seed) for name, table in tables.items()}
    seconds = {"load": loaded - start, "measure": time.perf_counter() - loaded}
    say(f"{_label(subject.name, train_seed)}: measured in {seconds['measure']:.0f} s")
    lengths = subject.attention_mask.sum(-1)
    read = {"sequences": int(subject.tokens.shape[0]), "tokens": [int(lengths.min()), int(lengths.max())]}
    meta = dict(
        name=subject.name,
        kind=subject.kind,
        position=subject.position,
        n_layers=subject.n_layers,
        has_bos=subject.has_bos,
        train_lengths=subject.train_lengths,
        train_seed=train_seed,
        **subject.info,
        seconds=seconds,
        read=read,
    )
    return tables, meta


def _as_measured(name: str, table: pd.DataFrame) -> pd.DataFrame:
    """A part's table as read back, with the dtypes it was measured with: the probe table's layer
    and block are nullable ints (CSV reads them as floats), so a resumed run writes the same bytes."""
    if name == "probes":
        return table.astype({"layer": "Int64", "block": "Int64"})
    return table


def _label(spec: str, train_seed: int) -> str:
    return spec if train_seed == 0 else f"{spec} (seed {train_seed})"


def versions() -> dict[str, str]:
    """Versions of what produced the numbers."""
    return {
        "nopelens": nopelens.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformer_lens": version("transformer-lens"),
        "scikit-learn": sklearn.__version__,
        "numpy": np.__version__,
        "pandas": pd.__version__,
    }


__getattr__ = moved_names(
    __name__,
    moved={
        "first_variance_block": "nopelens.analyses.sweep.sites",
        "summarize_seed": "nopelens.analyses.sweep.summary",
        "measure_sinks": "nopelens.analyses.sweep.streamed",
    },
    gone={
        "analyse_subject_streamed": "analyse_subject measures every model streamed (one driver)",
        "sink_conditions": "use nopelens.analyses.sweep.streamed.measure_sinks (or SinkReads)",
    },
)
