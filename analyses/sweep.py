"""The main job: at which layer does each model's absolute index, then relative distance, become
linearly recoverable, and where are its attention sinks?

For each subject (see :mod:`nopelens.analyses.subjects`) the sweep collects activations on fresh
sequences and measures:

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
over seeds with their spread (see :mod:`nopelens.analyses.seeds`). A sweep's unit of work is one
(model, training seed); :mod:`nopelens.analyses.parallel` runs these in this process, in local
worker processes (``jobs``) or on a Dask cluster (``scheduler``).

Results go to a run folder: ``probes.csv``, ``sinks.csv``, ``variance.csv``, ``summary.csv``,
figures (PNG; SVG on request) and ``summary.md``. Each (model, seed)'s tables are written under
``parts/`` once it is done, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

import nopelens
from nopelens.models.io import read_json, write_csv_atomic, write_json_atomic
from nopelens.models.progress import progress_bar
from nopelens.models.threads import one_thread
from nopelens.probes import collect, mad_chance, probe_absolute_index, probe_relative_distance, resid_sites
from nopelens.probes.sinks import GU_WINDOW, attention_variance, sink_table, variance_slopes

from . import parallel, report, seeds
from .intervene import sink_ablation_drop
from .subjects import CONTROL_SPECS, Subject, check_spec, has_training_seed, resolve

DEFAULT_MODELS = {"text": ("text-nope-4l", "text-rope-4l", "text-hybrid-4l", "bb-rope-2l", "bb-nope-3l"),
                  "copy": ("copy-nope-3l", "copy-rope-3l")}
"""The zoo models of the default sweep: the text models, and two Bigram-Backcopy models whose
attention sink forms in training (Guo et al. 2024). Those of ``text`` ship with the package."""
MAX_OUTER_FEATURES = 1024
"""Use the full outer-product bilinear read while n_heads * d_head^2 stays below this; above it,
the elementwise (diagonal) read keeps the fits inside the sweep's time budget."""

THRESHOLDS = {"accuracy": 0.9, "r2": 0.9}
"""A layer "recovers" a target when the 95 % CI lower bound of the metric clears this bar."""

TABLES = ("probes", "sinks", "variance", "sink_ablation")


@dataclass(frozen=True)
class SweepSettings:
    """What a sweep measures. Two runs with equal settings give equal numbers on CPU.

    Attributes:
        models: subject specs (zoo names, checkpoint paths, ``hf:DIR``, ``circuit``,
            ``untrained-nope``, ``constant-METHOD``), in order.
        n_sequences: fresh evaluation sequences per subject.
        seq_len: tokens per evaluation sequence (BOS included).
        n_boot: bootstrap replicates for the 95 % CIs.
        n_splits: GroupKFold folds over sequences.
        seed: seed of the sequences, pairs, controls and bootstrap.
        quick_steps: train zoo models afresh for only this many steps (smoke tests).
        train_seeds: training seeds; each zoo model (and the untrained control's weights) is
            measured once per seed. Models that no seed changes (circuit, checkpoints, HF
            directories) are measured once.
    """

    models: tuple[str, ...]
    n_sequences: int = 80
    seq_len: int = 64
    n_boot: int = 200
    n_splits: int = 5
    seed: int = 0
    quick_steps: int | None = None
    train_seeds: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_seeds", tuple(self.train_seeds))
        if not self.train_seeds or len(set(self.train_seeds)) < len(self.train_seeds):
            raise ValueError(f"--seeds must list distinct training seeds, got {list(self.train_seeds)}")
        if min(self.train_seeds) < 0:
            raise ValueError(f"training seeds must be >= 0, got {list(self.train_seeds)}")

    @classmethod
    def default(cls, task: str = "text", models: tuple[str, ...] | None = None, controls: bool = True, **kw) -> "SweepSettings":
        """The default sweep: the zoo models of ``task`` (text: NoPE, RoPE and the RoPE/NoPE hybrid
        language models and the two Bigram-Backcopy models) plus the controls."""
        if models is None:
            if task not in DEFAULT_MODELS:
                raise ValueError(f"task must be one of {sorted(DEFAULT_MODELS)}, got {task!r}")
            models = DEFAULT_MODELS[task]
        models = tuple(models) + (CONTROL_SPECS if controls else ())
        return cls(models=tuple(dict.fromkeys(models)), **kw)

    @classmethod
    def quick(cls, task: str = "text", models: tuple[str, ...] | None = None, controls: bool = True) -> "SweepSettings":
        """A tiny sweep for smoke tests: few sequences, short sequences, briefly trained models."""
        return cls.default(task, models, controls, n_sequences=24, seq_len=32, n_boot=50, n_splits=4, quick_steps=30)

    def digest(self) -> str:
        """Hash of what each (model, seed) measurement depends on. The list of training seeds is
        left out: adding seeds to a run folder measures just the new ones."""
        measured = {k: v for k, v in dataclasses.asdict(self).items() if k != "train_seeds"}
        text = json.dumps(measured, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def tasks(self) -> list[tuple[str, int]]:
        """The (model spec, training seed) pairs a sweep measures, in table order."""
        return [(spec, seed) for spec in self.models
                for seed in (self.train_seeds if has_training_seed(spec) else self.train_seeds[:1])]


@dataclass
class SweepResult:
    """The tidy tables of a sweep.

    ``summary`` has one row per model (means over training seeds when there are several, see
    :func:`~nopelens.analyses.seeds.over_seeds`); ``summary_per_seed`` one row per model and seed.
    """

    probes: pd.DataFrame
    sinks: pd.DataFrame
    variance: pd.DataFrame
    summary: pd.DataFrame
    out_dir: Path | None = None
    subjects: dict[str, dict] = field(default_factory=dict)
    summary_per_seed: pd.DataFrame | None = None
    sink_ablation: pd.DataFrame = field(default_factory=pd.DataFrame)


# ----------------------------------------------------------------------------- one subject


def analyse_subject(subject: Subject, settings: SweepSettings) -> dict[str, pd.DataFrame]:
    """Probe, sink and variance tables of one subject (see the module docstring)."""
    layers = subject.n_layers
    residual = resid_sites(layers)
    blocks = [(f"blocks.{l}.hook_attn_out", f"blocks.{l}.hook_mlp_out") for l in range(layers)]
    inner = [site for pair in blocks for site in pair if subject.usable(site)]
    qk = [_qk_sites(subject, l) for l in range(layers)]
    scores = score_sites(subject.model, layers, subject.hf)
    patterns = [f"blocks.{l}.attn.hook_pattern" for l in range(layers)]
    sites = residual + inner + [s for pair in qk for s in pair] + patterns + scores
    acts = collect(subject.model, subject.tokens, sites, attention_mask=subject.attention_mask, batch_size=32)

    common = dict(n_splits=settings.n_splits, n_boot=settings.n_boot, seed=settings.seed)
    # half the longest sequence: synthetic tasks take their lengths from training, not from seq_len
    boundary = subject.tokens.shape[1] // 2
    absolute = probe_absolute_index(acts, sites=residual + inner, extrapolate_from=boundary, **common)
    mode = _bilinear_mode(acts, qk[0][0])
    relative = probe_relative_distance(
        acts, sites=residual, feature_kinds=("concat",), attention=qk, scores=scores, bilinear=mode,
        tasks=("regression",), pairs_per_distance=min(64, settings.n_sequences), **common,
    )
    probes = pd.concat([absolute, relative], ignore_index=True)
    probes.insert(0, "model", subject.name)

    sinks = sink_conditions(subject, acts)
    variance = attention_variance(acts, sites=[f"blocks.{l}.hook_attn_out" for l in range(layers)
                                               if f"blocks.{l}.hook_attn_out" in acts.acts])
    if subject.has_bos:  # every sequence has the same token at 0, so its variance is exactly 0
        variance = variance[variance["position"] > 0]
    # sink ablation (issue 14): next-layer absolute-index R^2 with block l's first key removed
    ablation = sink_ablation_drop(subject.model, subject.tokens, subject.attention_mask, layers, acts,
                                  settings.n_splits, settings.n_boot, settings.seed).assign(model=subject.name)
    return {"probes": probes, "sinks": sinks, "variance": _with_slopes(variance).assign(model=subject.name),
            "sink_ablation": ablation}


def _with_slopes(variance: pd.DataFrame) -> pd.DataFrame:
    """Add each site's log-log slope; a site whose output never varies gets NaN, and says so."""
    constant = variance.groupby("site")["variance"].transform(lambda v: bool((v <= 0).any()))
    fitted = variance[~constant]
    slopes = variance_slopes(fitted).set_index("site")["slope"] if len(fitted) else pd.Series(dtype=float)
    note = np.where(constant, "output identical across sequences at some position (variance 0): no slope", "")
    return variance.assign(slope=variance["site"].map(slopes), note=note)



def _qk_sites(source, layer: int) -> tuple[str, str]:
    """The rotated q/k hooks where the model rotates them and they fire, else the plain ones.

    ``source`` is a :class:`Subject` (whose HF description says which hooks fire) or a bare model.
    """
    usable = source.usable if isinstance(source, Subject) else (lambda site: site in source.hook_dict)
    rotated = (f"blocks.{layer}.attn.hook_rot_q", f"blocks.{layer}.attn.hook_rot_k")
    if all(usable(site) for site in rotated):
        return rotated
    return f"blocks.{layer}.attn.hook_q", f"blocks.{layer}.attn.hook_k"


def score_sites(model, n_layers: int, hf=None) -> list[str]:
    """The ``blocks.{l}.attn.hook_attn_scores`` sites the model has (none: no score-read column).

    With an HF description (``hf``), only sites that fire and hold the scores behind the pattern:
    a bridge whose scores hook carries the pattern itself (GPT-J, GPT-Neo, OPT, XGLM, Llama 4) has none.
    """
    if hf is not None and not hf.scores_hook:
        return []
    sites = [f"blocks.{l}.attn.hook_attn_scores" for l in range(n_layers)]
    return [site for site in sites if site in model.hook_dict and (hf is None or hf.fires(site))]


def _bilinear_mode(acts, q_site: str) -> str:
    _, n_heads, d_head = acts.acts[q_site].shape
    return "outer" if n_heads * d_head * d_head <= MAX_OUTER_FEATURES else "elementwise"


def sink_conditions(subject: Subject, acts) -> pd.DataFrame:
    """Sink table of ``acts`` as read, plus a run without BOS when the subject's sequences start with one.

    Args:
        subject: the model and its evaluation sequences.
        acts: activations of ``subject`` holding every ``blocks.{l}.attn.hook_pattern`` site.

    Returns:
        :func:`~nopelens.probes.sinks.sink_table` rows with ``condition`` (``with_bos`` or
        ``without_bos``), ``model`` and ``gu_window`` (Gu et al.'s T, at most 64 tokens).
    """
    shortest = int(subject.attention_mask.sum(-1).min())  # synthetic tasks pad sequences of mixed lengths
    window = min(GU_WINDOW, shortest)
    condition = "with_bos" if subject.has_bos else "without_bos"
    frames = [sink_table(acts, n_tokens=window).assign(condition=condition)]
    if subject.has_bos:
        stripped = collect(subject.model, subject.tokens[:, 1:], list(acts.patterns),
                           attention_mask=subject.attention_mask[:, 1:], batch_size=32)
        frames.append(sink_table(stripped, n_tokens=min(window, shortest - 1)).assign(condition="without_bos"))
    return pd.concat(frames, ignore_index=True).assign(model=subject.name, gu_window=window)


# ----------------------------------------------------------------------------- summary


def summarize(probes: pd.DataFrame, sinks: pd.DataFrame, variance: pd.DataFrame) -> pd.DataFrame:
    """One row per model; with several training seeds, the mean over seeds (see
    :func:`summarize_per_seed` for the columns and :func:`~nopelens.analyses.seeds.over_seeds`)."""
    per_seed = summarize_per_seed(probes, sinks, variance)
    if per_seed.groupby("model")["train_seed"].nunique().max() > 1:
        return seeds.over_seeds(per_seed)
    return per_seed.drop(columns="train_seed")


def summarize_per_seed(probes: pd.DataFrame, sinks: pd.DataFrame, variance: pd.DataFrame) -> pd.DataFrame:
    """:func:`summarize_seed` for each training seed, with a ``train_seed`` column (0 for tables
    that have none), rows in model order."""
    probes, sinks, variance = (seeds.with_train_seed(table) for table in (probes, sinks, variance))
    frames = [summarize_seed(table, sinks[sinks["train_seed"] == seed], variance[variance["train_seed"] == seed])
              .assign(train_seed=seed) for seed, table in probes.groupby("train_seed")]
    order = {model: i for i, model in enumerate(probes["model"].unique())}
    rows = pd.concat(frames, ignore_index=True)
    return rows.sort_values(["model", "train_seed"], key=lambda c: c.map(order) if c.name == "model" else c,
                            kind="stable").reset_index(drop=True)


def summarize_seed(probes: pd.DataFrame, sinks: pd.DataFrame, variance: pd.DataFrame) -> pd.DataFrame:
    """One row per model of one training seed: the first layer at which each target is recovered,
    and key numbers.

    Columns: ``model``, ``absolute_acc`` (first layer with classification accuracy CI >= 0.9),
    ``absolute_r2`` (regression R^2 CI >= 0.9), ``relative_pairs_r2`` (pair features, residual),
    ``relative_score_r2`` (score read of the heads' pre-softmax scores, content plus position
    bias; layer = block + 1; None when the model has no ``hook_attn_scores``),
    ``relative_content_qk_r2`` (content-only bilinear q.k read; layer = block + 1),
    ``best_absolute_r2`` and its ``selectivity``,
    ``mad_chance_layer0`` and ``mad_chance_best`` (regression MAD over its chance value E|X - Y|
    for X, Y drawn from the scored positions, at the embeddings and at the best residual layer;
    Haviv et al. 2022),
    ``sink_rate`` (Gu et al., as read), ``variance_slope_block0``. A first layer of -1 means no
    layer cleared the bar; None means the model has no site for that read.
    """
    rows = []
    for model, table in probes.groupby("model", sort=False):
        linear = table[(table["probe"] == "linear") & (table["split"] == "grouped") & table["layer"].notna()]
        residual = linear[linear["site"].str.contains("hook_resid_")]
        absolute = residual[residual["target"] == "absolute_index"]
        relative = linear[linear["target"] == "relative_distance"]
        best = absolute[(absolute["metric"] == "r2")].sort_values("value").iloc[-1]
        mad = absolute[(absolute["metric"] == "mad") & (absolute["task"] == "regression")].set_index("layer")
        chance = _mad_chance(mad)
        model_sinks = sinks[sinks["model"] == model]
        as_read = model_sinks[model_sinks["condition"] == model_sinks["condition"].iloc[0]]
        rows.append(dict(
            model=model,
            absolute_acc=_first_layer(absolute, "accuracy"),
            absolute_r2=_first_layer(absolute, "r2"),
            relative_pairs_r2=_first_layer(relative[relative["features"] == "concat"], "r2"),
            relative_score_r2=_first_layer(relative[relative["features"] == "score"], "r2"),
            relative_content_qk_r2=_first_layer(relative[relative["features"].str.startswith("bilinear")], "r2"),
            best_absolute_r2=float(best["value"]),
            best_absolute_layer=int(best["layer"]),
            selectivity_at_best=float(best["selectivity"]),
            mad_chance_layer0=float(mad.loc[0, "value"] / chance.loc[0]),
            mad_chance_best=float((mad["value"] / chance).min()),
            sink_rate=float(as_read["is_sink"].mean()),
            variance_slope_block0=float(variance[(variance["model"] == model) & (variance["block"] == 0)]["slope"].iloc[0]),
        ))
    return pd.DataFrame(rows)


def _mad_chance(mad: pd.DataFrame) -> pd.Series:
    """Each MAD row's chance value: E|X - Y| over its scored positions (``chance`` column), or, for
    tables written before that column existed, the uniform value at the mean sequence length."""
    if "chance" in mad and mad["chance"].notna().all():
        return mad["chance"]
    return pd.Series(mad_chance(int(round(mad["n_samples"].iloc[0] / mad["n_sequences"].iloc[0]))), index=mad.index)


def _first_layer(rows: pd.DataFrame, metric: str) -> int | None:
    """First layer clearing the bar; -1 when none does; None when nothing was measured."""
    rows = rows[rows["metric"] == metric]
    if rows.empty:
        return None
    cleared = rows[rows["ci_low"] >= THRESHOLDS[metric]]
    return int(cleared["layer"].min()) if len(cleared) else -1


# ----------------------------------------------------------------------------- the run folder


def sweep(settings: SweepSettings, out_dir: str | Path | None = None, progress: bool = True, jobs: int = 1,
          scheduler: str | None = None, svg: bool = False) -> SweepResult:
    """Run the sweep; with ``out_dir``, write (and resume) a run folder.

    Args:
        settings: what to measure.
        out_dir: run folder; each finished (model, seed) is saved under ``parts/`` at once.
        progress: progress bars and lines on stderr.
        jobs: local worker processes, one (model, seed) each (see :mod:`~nopelens.analyses.parallel`).
        scheduler: address of a Dask scheduler to send the (model, seed) tasks to instead.
        svg: also save the figures as SVG (PNG always).

    Raises:
        ValueError: if ``out_dir`` holds a sweep made with other settings, if there are fewer
            evaluation sequences than folds, or as
            :func:`~nopelens.analyses.subjects.resolve`.
        KeyError, FileNotFoundError: on an unknown model spec (the message lists what exists).
        ChildProcessError: if parallel workers were lost (what finished is saved; rerun to resume).
    """
    for spec in settings.models:
        check_spec(spec)
    if settings.n_sequences < settings.n_splits:
        raise ValueError(
            f"{settings.n_sequences} evaluation sequences are fewer than the {settings.n_splits} cross-validation "
            f"folds (each fold holds out whole sequences); use --n-sequences {settings.n_splits} or more"
        )
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        _claim_run_folder(out, settings)
    tasks = settings.tasks()
    done: dict[tuple[str, int], tuple[dict, dict]] = {}
    for task in tasks:
        part = _part_dir(out, *task) if out is not None else None
        if part is not None and (part / "done.json").is_file() and all((part / f"{n}.csv").is_file() for n in TABLES):
            tqdm.write(f"nopelens: {_label(*task)}: already measured in {_part_dir(out, *task)}, reusing", file=sys.stderr)
            done[task] = _read_part(_part_dir(out, *task), task[1])
    todo = [task for task in tasks if task not in done]
    bar = progress_bar(total=len(tasks), initial=len(done), desc="nopelens sweep", unit="model", disable=not progress)

    def keep(task: tuple[str, int], measured: tuple[dict, dict]) -> None:
        if out is not None:
            _write_part(_part_dir(out, *task), *measured)
        done[task] = measured
        bar.update()

    # local workers write their training progress as timed lines; Dask workers log elsewhere
    show_training = progress and scheduler is None
    parallel.run_tasks(measure, [(task, (*task, settings, show_training)) for task in todo], keep, jobs, scheduler)
    bar.close()
    parts = [done[task][0] for task in tasks]
    probes, sinks, variance, ablation = (pd.concat([part[name] for part in parts], ignore_index=True)
                                         for name in TABLES)
    per_seed = summarize_per_seed(probes, sinks, variance)
    subjects = {_label(*task): done[task][1] for task in tasks}
    result = SweepResult(probes, sinks, variance, summarize(probes, sinks, variance), out, subjects,
                         summary_per_seed=per_seed, sink_ablation=ablation)
    if out is not None:
        report.write_run(result, settings, command=" ".join(["nopelens", *sys.argv[1:]]), versions=versions(), svg=svg)
    return result


def measure(spec: str, train_seed: int, settings: SweepSettings, progress: bool = False) -> tuple[dict, dict]:
    """One sweep task: load (or train) ``spec`` with training seed ``train_seed`` and measure it.

    Runs in any process (a local worker or a Dask worker): it reads only its arguments and the
    zoo cache of the machine it runs on. It runs on one thread
    (:func:`~nopelens.models.threads.one_thread`), so its numbers do not depend on the core count
    or on how many workers share the machine.

    Returns:
        ``(tables, meta)``: the ``probes``, ``sinks`` and ``variance`` tables (with ``train_seed``
        columns) and what the run folder records about the model.
    """
    with one_thread():
        return _measure(spec, train_seed, settings, progress)


def _measure(spec: str, train_seed: int, settings: SweepSettings, progress: bool) -> tuple[dict, dict]:
    tqdm.write(f"nopelens: {_label(spec, train_seed)}: loading", file=sys.stderr)
    subject = resolve(spec, settings.n_sequences, settings.seq_len, settings.seed, progress, settings.quick_steps,
                      train_seed=train_seed)
    tqdm.write(f"nopelens: {_label(subject.name, train_seed)}: probing {subject.n_layers + 1} layers", file=sys.stderr)
    with torch.no_grad():
        tables = analyse_subject(subject, settings)
    tables = {name: table.assign(train_seed=train_seed) for name, table in tables.items()}
    meta = dict(name=subject.name, kind=subject.kind, position=subject.position, n_layers=subject.n_layers,
                has_bos=subject.has_bos, train_lengths=subject.train_lengths, train_seed=train_seed, **subject.info)
    return tables, meta


def _write_part(part: Path, tables: dict[str, pd.DataFrame], meta: dict) -> None:
    for name, table in tables.items():
        write_csv_atomic(table, part / f"{name}.csv")
    write_json_atomic(meta, part / "done.json")  # last: marks the (model, seed) complete


def _read_part(part: Path, train_seed: int) -> tuple[dict, dict]:
    tables = {name: seeds.with_train_seed(pd.read_csv(part / f"{name}.csv"), train_seed) for name in TABLES}
    return tables, read_json(part / "done.json")


def _part_dir(out: Path, spec: str, train_seed: int) -> Path:
    """``parts/<spec>`` for training seed 0 (where runs from before seeds keep theirs), else
    ``parts/<spec>-seed<n>``."""
    return out / "parts" / (_slug(spec) if train_seed == 0 else f"{_slug(spec)}-seed{train_seed}")


def _label(spec: str, train_seed: int) -> str:
    return spec if train_seed == 0 else f"{spec} (seed {train_seed})"


def _claim_run_folder(out: Path, settings: SweepSettings) -> None:
    stamp = out / "sweep.json"
    record = dict(settings=dataclasses.asdict(settings), digest=settings.digest())
    if stamp.is_file():
        previous = read_json(stamp)
        if previous.get("digest") != settings.digest():
            raise ValueError(
                f"{out} holds a sweep made with other settings ({previous.get('settings')}); "
                "use another --out folder, or delete it to start over"
            )
    write_json_atomic(record, stamp)  # records the latest list of training seeds


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)


def versions() -> dict[str, str]:
    """Versions of what produced the numbers."""
    from importlib.metadata import version

    import sklearn

    return {
        "nopelens": nopelens.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformer_lens": version("transformer-lens"), "scikit-learn": sklearn.__version__,
        "numpy": np.__version__, "pandas": pd.__version__,
    }
