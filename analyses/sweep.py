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

What the summary reports per model (one column, header and figure panel each) are the reads of
:data:`~nopelens.analyses.reads.SWEEP_READS`; the probe rows come from their target functions.

Results go to a run folder (:mod:`~nopelens.analyses.runs`): ``probes.csv``, ``sinks.csv``,
``variance.csv``, ``sink_ablation.csv``, ``summary.csv`` and the stamp ``sweep.json``; its figures
(PNG; SVG on request) and ``summary.md`` are drawn from the result by
:func:`~nopelens.analyses.report.write_run`, which ``nopelens sweep`` calls. Each (model, seed)'s tables are written under
``parts/`` once it is done, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
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
from nopelens.models.hf_loading import HFInput
from nopelens.models.hooks import act_name, act_names
from nopelens.models.io import write_csv_atomic
from nopelens.models.progress import progress_bar
from nopelens.models.threads import one_thread
from nopelens.probes import collect, resid_site
from nopelens.probes.collect import site_block
from nopelens.probes.sinks import GU_WINDOW, SinkStats, empty_sink_table, sink_flags, variance_slopes
from nopelens.probes.stream import AttentionVariance, Sequences, replay

from . import layers, parallel, reads, runs, seeds
from .eta import SweepETA
from .intervene import sink_ablation_drop
from .reads import ProbeInput, SweepSites, bilinear_mode
from .plan import plan
from .streamed import measure_streamed
from .subjects import (
    CONTROL_SPECS, HF_PREFIX, Subject, check_spec, display_name, has_training_seed, input_changes,
    input_fingerprint, planned_work, qk_sites, resolve,
)

DEFAULT_MODELS = {"text": ("text-nope-4l", "text-rope-4l", "text-hybrid-4l", "bb-rope-2l", "bb-nope-3l"),
                  "copy": ("copy-nope-3l", "copy-rope-3l")}
"""The zoo models of the default sweep: the text models, and two Bigram-Backcopy models whose
attention sink forms in training (Guo et al. 2024). Those of ``text`` ship with the package."""

TABLES = ("probes", "sinks", "variance", "sink_ablation")

SITE_KINDS = ("resid", "attn_out", "resid_mid", "mlp_out")
"""What ``--sites`` may name: ``resid`` (every residual layer 0 .. n_layers, where every read's
curve lives) and each block's finer sites, in the order a block computes them."""
DEFAULT_SITES = ("resid", "attn_out", "mlp_out")


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
        sites: where absolute index is probed (:data:`SITE_KINDS`): ``resid`` (required) and any
            of the finer sites ``attn_out``, ``resid_mid``, ``mlp_out`` of every block. Relative
            distance is read on the residual stream and every block's attention either way.
        hf_input: how ``hf:DIR`` models are read (:class:`~nopelens.models.hf_loading.HFInput`:
            text through their tokenizer, random ids or one token repeated; device; dtype).
        streamed: measure ``hf:DIR`` models through the streaming engine
            (:func:`analyse_subject_streamed`; ``nopelens probe``).
        batch_size: sequences per forward pass of a streamed measurement, or ``"auto"``: at most 32,
            fewer where a forward pass of 32 would not fit half the memory free on the model's
            device (:func:`~nopelens.analyses.streamed.auto_batch_size`).
        keep_mib: MiB of features a streamed measurement may keep for its predictions instead of
            a second forward pass (None: 512 MiB or a quarter of the memory the run may use, whichever
            is less, and no more than leaves room for the largest site's statistics,
            :func:`~nopelens.analyses.streamed.auto_keep_bytes`; 0: none, so memory is the
            statistics' whatever the number of tokens).
        memory_mib: MiB a streamed measurement may add on the model's device (None: what is free
            there when it starts): the keep budget, the batch size and the groups of sites whose
            statistics are summed in one run (:func:`~nopelens.analyses.streamed.statistics_groups`)
            follow from it. It changes no number, so a run folder does not record it.
        layers: the blocks a streamed measurement probes (None: every block): each one's input and
            output residual stream (layers l and l + 1), its attention and MLP outputs, q.k and
            score reads, sinks, variance and sink ablation (and the variance of the model's first
            attention block, :func:`first_variance_block`, which the summary's slope reads); each
            forward pass stops after the deepest (:func:`sweep_sites`). The summary's first layers
            are then the first probed ones that clear, and the run says which blocks it left out.
        sink_ablation: measure the sink ablation of a streamed subject (about n_layers / 2 extra
            forward passes; ``nopelens probe --no-sink-ablation`` turns it off). The in-memory
            sweep always measures it.
    """

    models: tuple[str, ...]
    n_sequences: int = 80
    seq_len: int = 64
    n_boot: int = 200
    n_splits: int = 5
    seed: int = 0
    quick_steps: int | None = None
    train_seeds: tuple[int, ...] = (0,)
    sites: tuple[str, ...] = DEFAULT_SITES
    hf_input: HFInput = HFInput()
    streamed: bool = False
    batch_size: int | str = "auto"
    keep_mib: int | None = None
    sink_ablation: bool = True
    memory_mib: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_seeds", tuple(self.train_seeds))
        object.__setattr__(self, "sites", tuple(sorted(set(self.sites), key=_site_order)))
        if "resid" not in self.sites:
            raise ValueError(f"--sites must include resid (every read's layer curve is on the residual stream), "
                             f"got {','.join(self.sites) or 'nothing'}")
        if not self.train_seeds or len(set(self.train_seeds)) < len(self.train_seeds):
            raise ValueError(f"--seeds must list distinct training seeds, got {list(self.train_seeds)}")
        if min(self.train_seeds) < 0:
            raise ValueError(f"training seeds must be >= 0, got {list(self.train_seeds)}")
        if self.batch_size != "auto" and (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                                          or self.batch_size < 1):
            raise ValueError(f"--batch-size must be a positive integer or auto, got {self.batch_size!r}")
        if self.keep_mib is not None and (isinstance(self.keep_mib, bool) or not isinstance(self.keep_mib, int)
                                          or self.keep_mib < 0):
            raise ValueError(f"--keep-mib must be an integer >= 0, got {self.keep_mib!r}")
        if self.memory_mib is not None and (isinstance(self.memory_mib, bool) or not isinstance(self.memory_mib, int)
                                            or self.memory_mib < 1):
            raise ValueError(f"--memory-mib must be an integer >= 1, got {self.memory_mib!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
            if not self.layers or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0
                                      for b in self.layers):
                raise ValueError(f"--layers must name blocks by numbers >= 0, got {list(self.layers)}")
            if not self.streamed:
                raise ValueError("--layers applies to hf:DIR models (the streamed probe)")

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

    RESUMABLE_CHANGES = ("train_seeds", "batch_size", "keep_mib")
    """Settings a run folder may change between runs: adding seeds measures just the new ones; the
    batch size and the keep budget cut the same work into other forward passes (``auto`` already
    follows the memory free), which changes round-off only. The stamp records the latest."""

    UNSET = {"hf_input": dataclasses.asdict(HFInput()),
             "streamed": "in memory, as nopelens sweep measures",
             "batch_size": "auto (32, or fewer where 32 do not fit the memory free)",
             "keep_mib": "512 MiB or a quarter of the memory available", "sink_ablation": "on",
             "sites": ",".join(DEFAULT_SITES), "layers": "every block"}
    """What a setting :meth:`to_dict` leaves out (at its default) means, for a refused run folder's message."""

    def to_dict(self) -> dict:
        """The settings as the run folder's stamp holds them. ``sites`` is written only when it is
        not :data:`DEFAULT_SITES`, so folders made before ``--sites`` existed keep their digest."""
        settings = dataclasses.asdict(self)
        del settings["memory_mib"]  # how the work is split in runs, not what is measured
        if self.sites == DEFAULT_SITES:
            del settings["sites"]
        # written only when set, so folders made before they existed keep their digest
        for name, default in (("hf_input", HFInput()), ("streamed", False), ("batch_size", "auto"), ("keep_mib", None),
                              ("sink_ablation", True), ("layers", None)):
            if getattr(self, name) == default:
                del settings[name]
        return settings

    def digest(self) -> str:
        """Hash of what each (model, seed) measurement depends on (the run folder's stamp,
        :func:`~nopelens.analyses.runs.claim`); :data:`RESUMABLE_CHANGES` are left out."""
        return runs.settings_digest(self.to_dict(), ignore=self.RESUMABLE_CHANGES)

    def tasks(self) -> list[tuple[str, int]]:
        """The (model spec, training seed) pairs a sweep measures, in table order."""
        return [(spec, seed) for spec in self.models
                for seed in (self.train_seeds if has_training_seed(spec) else self.train_seeds[:1])]


@dataclass
class SweepResult:
    """The tidy tables of a sweep.

    ``summary`` has one row per model (means over training seeds when there are several, see
    :func:`~nopelens.analyses.seeds.over_seeds`); ``summary_per_seed`` one row per model and seed;
    ``curves`` the main curves per layer (:func:`~nopelens.analyses.layers.layer_curves`);
    ``reads`` the reads the summary and curves report (``--metric``, ``--threshold``).
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


# ----------------------------------------------------------------------------- one subject


def _site_order(kind: str) -> int:
    if kind not in SITE_KINDS:
        raise ValueError(f"unknown site kind {kind!r} for --sites; choose from {', '.join(SITE_KINDS)}")
    return SITE_KINDS.index(kind)


def sweep_sites(subject: Subject, kinds: tuple[str, ...] = DEFAULT_SITES,
                blocks: tuple[int, ...] | None = None) -> SweepSites:
    """The sites the sweep collects of ``subject`` (those it has and that fire); ``kinds`` as
    :attr:`SweepSettings.sites`, ``blocks`` as :attr:`SweepSettings.layers` (None: every block;
    otherwise each block's sites and its input and output residual stream, and the blocks left out
    are recorded in ``subject.info["not_applicable"]``).

    Raises:
        ValueError: for a block the model does not have.
    """
    layers = subject.n_layers
    chosen = probed_blocks(subject, blocks)
    finer = [kind for kind in kinds if kind != "resid"]
    inner = [act_name(kind, l) for l in chosen for kind in finer]
    # the variance of the model's first attention block is read whatever --layers says: the summary's slope is its
    variance_blocks = sorted(set(chosen) | ({first_variance_block(subject)} - {None} if blocks is not None else set()))
    outputs = [site for site in act_names("attn_out", variance_blocks) if subject.usable(site)]
    # a hybrid's linear-attention layers have no q, k or pattern, nor has a model hooked without the bridge
    pairs = {l: qk_sites(subject, l) for l in chosen}
    qk = [pair for pair in pairs.values() if pair is not None and all(subject.usable(s) for s in pair)]
    unrotated = _blocks_by_reason({l: subject.hf.unrotated_qk(l) for l, pair in pairs.items() if pair is None},
                                  "no rotated q and k to read")
    if unrotated is not None:
        subject.info.setdefault("not_applicable", {})["content q·k read"] = unrotated
    sparse = subject.sparse_blocks()
    available = score_sites(subject.model, layers, subject.hf)
    scores, not_applicable = reads.readable_score_sites(available, subject.key_windows(),
                                                        int(subject.attention_mask.sum(-1).max()))
    scores = [site for site in scores if site_block(site) not in sparse and site_block(site) in chosen]
    if sparse:
        not_applicable = "; ".join(filter(None, [not_applicable, subject.sparse_note()]))
    unscored = _unscored_note(subject, [l for l in chosen
                                        if l not in sparse and act_name("attn_scores", l) not in available])
    not_applicable = "; ".join(filter(None, [unscored, not_applicable])) or None
    if not_applicable is not None:
        subject.info.setdefault("not_applicable", {})["score read"] = not_applicable
    residual = [resid_site(layer) for layer in sorted({l + step for l in chosen for step in (0, 1)})]
    patterns = [site for site in pattern_sites(subject) if site_block(site) in chosen]
    return SweepSites(residual=residual, inner=[site for site in inner if subject.usable(site)],
                      outputs=outputs, qk=qk, scores=scores, patterns=patterns)


def _unscored_note(subject: Subject, blocks: list[int]) -> str | None:
    """Why the score read leaves out softmax-attention ``blocks`` of an HF model that expose no
    pre-softmax scores (None: there are none; the reasons are the description's,
    :meth:`~nopelens.models.hf.HFDescription.scores_unreadable`)."""
    if subject.hf is None:
        return None
    return _blocks_by_reason({l: subject.hf.scores_unreadable(act_name("attn_scores", l)) for l in blocks
                              if subject.hf.layers[l].mixer == "attention"}, "no pre-softmax scores to read")


def _blocks_by_reason(reasons: dict[int, str | None], what: str) -> str | None:
    """``{block: why}`` as one note, blocks grouped by reason (None where no block has one).

    >>> _blocks_by_reason({0: "a", 1: "a", 3: "b", 4: None}, "not read")
    'blocks 0-1: not read (a); blocks 3: not read (b)'
    """
    grouped: dict[str, list[int]] = {}
    for block, why in reasons.items():
        if why is not None:
            grouped.setdefault(why, []).append(block)
    return "; ".join(f"blocks {_ranges(b)}: {what} ({why})" for why, b in grouped.items()) or None


def first_variance_block(subject: Subject) -> int | None:
    """The first of :meth:`~nopelens.analyses.subjects.Subject.variance_blocks` whose ``hook_attn_out`` fires, or None: the block of the
    summary's ``variance_slope_block0``."""
    return next((l for l in subject.variance_blocks() if subject.usable(act_name("attn_out", l))), None)


def probed_blocks(subject: Subject, blocks: tuple[int, ...] | None) -> list[int]:
    """The blocks a measurement of ``subject`` probes (``blocks``, or every block when None); the
    blocks left out are noted in ``subject.info["not_applicable"]``.

    Raises:
        ValueError: for a block the model does not have.
    """
    if blocks is None:
        return list(range(subject.n_layers))
    missing = [b for b in blocks if b >= subject.n_layers]
    if missing:
        raise ValueError(f"--layers {_ranges(missing)}: {subject.name} has {subject.n_layers} blocks "
                         f"(0-{subject.n_layers - 1})")
    left_out = [b for b in range(subject.n_layers) if b not in blocks]
    if left_out:
        subject.info.setdefault("not_applicable", {})["blocks not probed"] = (
            f"blocks {_ranges(left_out)} (--layers {_ranges(blocks)}): their sites, sinks and sink ablation were not "
            "measured (n/a in the per-layer and sink ablation tables), nor their variance except the model's first "
            "attention block's (the summary's slope); a first layer is the first probed one that clears")
    return list(blocks)


def _ranges(blocks) -> str:
    """Sorted block numbers as runs, for messages.

    >>> _ranges([0, 1, 2, 3, 7]), _ranges([5])
    ('0-3,7', '5')
    """
    parts, start = [], None
    for b, nxt in zip(blocks, list(blocks[1:]) + [None]):
        start = b if start is None else start
        if nxt != b + 1:
            parts.append(str(b) if start == b else f"{start}-{b}")
            start = None
    return ",".join(parts)


def pattern_sites(subject: Subject) -> list[str]:
    """Every block's ``hook_pattern`` that fires (a hybrid's linear-attention blocks have none)."""
    return [site for site in act_names("pattern", subject.n_layers) if subject.usable(site)]


def analyse_subject(subject: Subject, settings: SweepSettings, progress: bool = False) -> dict[str, pd.DataFrame]:
    """Probe, sink and variance tables of one subject (see the module docstring); the probe rows
    are those of the targets :data:`~nopelens.analyses.reads.SWEEP_READS` names (``progress``:
    bars over the sites as they are fitted)."""
    layers = subject.n_layers
    if settings.layers is not None:
        raise ValueError("--layers applies to hf:DIR models (the streamed probe)")
    sites = sweep_sites(subject, settings.sites)
    acts = collect(subject.model, subject.tokens, sites.all(), attention_mask=subject.attention_mask, batch_size=32)
    # the streamed probe's settings (ProbeInput's position bins and spread distances), every batch kept
    inp = ProbeInput(Sequences.of_activations(acts), sites, seq_len=subject.tokens.shape[1],
                     n_sequences=settings.n_sequences, n_splits=settings.n_splits, n_boot=settings.n_boot,
                     seed=settings.seed, bilinear=bilinear_mode(acts, sites.qk[0][0]) if sites.qk else "outer")
    probes = reads.measure_in_memory(reads.measure_targets(inp), acts, subject.name if progress else None)
    probes.insert(0, "model", subject.name)

    sinks = sink_conditions(subject, acts)
    variance_sites = [site for site in act_names("attn_out", subject.variance_blocks()) if site in acts.acts]
    variance = (replay(acts, [AttentionVariance(inp.sequences, variance_sites, subject.key_windows())])[0]
                if variance_sites else
                pd.DataFrame(columns=["site", "block", "position", "visible_keys", "variance", "n_sequences"]))
    variance = _variance_table(subject, variance)
    # sink ablation (issue 14): next-layer absolute-index R^2 with block l's first key removed
    ablation = sink_ablation_drop(subject.model, subject.tokens, subject.attention_mask, layers, acts,
                                  settings.n_splits, settings.n_boot, settings.seed).assign(model=subject.name)
    return {"probes": probes, "sinks": sinks, "variance": variance, "sink_ablation": ablation}


def analyse_subject_streamed(subject: Subject, settings: SweepSettings, label: str | None = None,
                             progress: bool = False) -> dict[str, pd.DataFrame]:
    """:func:`analyse_subject`'s tables of an HF subject through the streaming engine
    (:func:`~nopelens.analyses.streamed.measure_streamed`; ``nopelens probe hf:DIR``), after printing
    its plan; the sink ablation is streamed too unless ``settings.sink_ablation`` is False."""
    sites = sweep_sites(subject, settings.sites, settings.layers)
    plan_ = plan(subject, settings, sites)
    if plan_.shortfall:  # refused before any forward pass, not out of memory hours later (--plan shows the plan)
        raise ValueError(f"{label or subject.name}: {plan_.shortfall}")
    tqdm.write(plan_.describe(label or subject.name), file=sys.stderr)
    # the batch size, keep budget and groups planned are those run, whatever the memory free does in between
    tables = measure_streamed(subject, settings, sites, progress, planned=plan_.measurements)
    if tables["variance"] is None:
        tables["variance"] = pd.DataFrame(columns=["site", "block", "position", "visible_keys", "variance",
                                                   "n_sequences", "slope", "note", "model"])
    else:
        tables["variance"] = _variance_table(subject, tables["variance"])
    return tables


def _variance_table(subject: Subject, variance: pd.DataFrame) -> pd.DataFrame:
    """The variance table as the sweep writes it: position 0 left out after a BOS (every sequence has
    the same token there, so its variance is exactly 0), each site's slope, the model."""
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



def score_sites(model, n_layers: int, hf=None) -> list[str]:
    """The ``blocks.{l}.attn.hook_attn_scores`` sites the model has (none: no score-read column).

    With an HF description (``hf``), only sites that fire and hold the scores behind the pattern:
    a bridge whose scores hook carries the pattern itself (GPT-J, GPT-Neo, OPT, XGLM, Llama 4) has none.
    """
    if hf is not None and not hf.scores_hook:
        return []
    sites = act_names("attn_scores", n_layers)
    return [site for site in sites if site in model.hook_dict and (hf is None or hf.fires(site))]


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
    windows, sinks = subject.key_windows(), subject.sinks()
    extra = [site for site in sink_sites(subject) if site not in acts.acts and site not in acts.patterns]
    if extra:  # an output-scale sink is read from hook_v and hook_z
        acts = collect(subject.model, subject.tokens, list(acts.patterns) + sink_sites(subject),
                       attention_mask=subject.attention_mask, batch_size=32)
    skipped = subject.note_unreadable_reads()["sink read"]  # DSA blocks, windows of 1
    readable = [site for site in acts.patterns if site.endswith("hook_pattern") and site_block(site) not in skipped]
    frames = [_sink_table(acts, window, windows, sinks, readable).assign(condition=condition, gu_window=window)]
    if subject.has_bos:
        stripped = collect(subject.model, subject.tokens[:, 1:], list(dict.fromkeys(list(acts.patterns) + sink_sites(subject))),
                           attention_mask=subject.attention_mask[:, 1:], batch_size=32)
        frames.append(_sink_table(stripped, min(window, shortest - 1), windows, sinks, readable)
                      .assign(condition="without_bos", gu_window=min(window, shortest - 1)))
    table = pd.concat(frames, ignore_index=True).assign(model=subject.name)
    return table[[c for c in table if c != "gu_window"] + ["gu_window"]]  # T per condition, the last column


def _sink_table(acts, window: int, windows: dict, sinks: dict, sites: list[str]) -> pd.DataFrame:
    """The sink table of ``sites`` in ``acts``: the streamed :class:`~nopelens.probes.sinks.SinkStats`
    replayed on them (one implementation of the read, streamed or in memory)."""
    if not sites:
        return empty_sink_table(window, sinks)
    stats = SinkStats(Sequences.of_activations(acts), sites, n_tokens=window, windows=windows, sinks=sinks)
    return replay(acts, [stats])[0]


def sink_sites(subject: Subject) -> list[str]:
    """The extra sites a subject's non-token sinks are read from: ``attn.hook_v`` and ``attn.hook_z``
    of its output-scale sink blocks (see :func:`~nopelens.probes.sinks.output_scale_sink_mass`)."""
    return [act_name(name, block) for block, (kind, _) in subject.sinks().items() if kind == "output_scale"
            for name in ("v", "z")]


def measure_sinks(subject: Subject) -> pd.DataFrame:
    """:func:`sink_conditions` of ``subject``, collecting only its patterns (``nopelens sinks``)."""
    with torch.no_grad():
        acts = collect(subject.model, subject.tokens, pattern_sites(subject), attention_mask=subject.attention_mask,
                       batch_size=32)
        return sink_conditions(subject, acts)


# ----------------------------------------------------------------------------- summary


def summarize(probes: pd.DataFrame, sinks: pd.DataFrame, variance: pd.DataFrame,
              sweep_reads: Sequence[reads.SweepRead] | None = None) -> pd.DataFrame:
    """One row per model; with several training seeds, the mean over seeds (see
    :func:`summarize_per_seed` for the columns and :func:`~nopelens.analyses.seeds.over_seeds`)."""
    per_seed = summarize_per_seed(probes, sinks, variance, sweep_reads)
    if per_seed.groupby("model")["train_seed"].nunique().max() > 1:
        return seeds.over_seeds(per_seed, sweep_reads)
    return per_seed.drop(columns="train_seed")


def summarize_per_seed(probes: pd.DataFrame, sinks: pd.DataFrame, variance: pd.DataFrame,
                       sweep_reads: Sequence[reads.SweepRead] | None = None) -> pd.DataFrame:
    """:func:`summarize_seed` for each training seed, with a ``train_seed`` column (0 for tables
    that have none), rows in model order."""
    probes, sinks, variance = (seeds.with_train_seed(table) for table in (probes, sinks, variance))
    frames = [summarize_seed(table, sinks[sinks["train_seed"] == seed], variance[variance["train_seed"] == seed],
                             sweep_reads).assign(train_seed=seed) for seed, table in probes.groupby("train_seed")]
    order = {model: i for i, model in enumerate(probes["model"].unique())}
    rows = pd.concat(frames, ignore_index=True)
    return rows.sort_values(["model", "train_seed"], key=lambda c: c.map(order) if c.name == "model" else c,
                            kind="stable").reset_index(drop=True)


def summarize_seed(probes: pd.DataFrame, sinks: pd.DataFrame, variance: pd.DataFrame,
                   sweep_reads: Sequence[reads.SweepRead] | None = None) -> pd.DataFrame:
    """One row per model of one training seed: the first layer at which each target is recovered,
    and key numbers.

    Columns: ``model``; one column per read of :data:`~nopelens.analyses.reads.SWEEP_READS`
    (``absolute_acc``, ``absolute_r2``, ``relative_pairs_r2``, ``relative_score_r2``,
    ``relative_content_qk_r2``), the first layer that clears its bar
    (:meth:`~nopelens.analyses.reads.SweepRead.first_layer`: -1 when no layer does, None when the
    model has no site for the read, e.g. no ``hook_attn_scores``); then
    ``best_absolute_r2`` and its ``selectivity``,
    ``mad_chance_layer0`` and ``mad_chance_best`` (regression MAD over its chance value E|X - Y|
    for X, Y drawn from the scored positions, at the embeddings and at the best residual layer;
    Haviv et al. 2022; NaN at layer 0 when ``--layers`` left block 0 out),
    ``sink_rate`` (Gu et al., as read), ``variance_slope_block0``. ``sweep_reads`` replaces the
    reads (``--metric``, ``--threshold``; default :data:`~nopelens.analyses.reads.SWEEP_READS`).
    """
    chosen = reads.SWEEP_READS if sweep_reads is None else sweep_reads
    rows = []
    for model, table in probes.groupby("model", sort=False):
        linear = table[(table["probe"] == "linear") & (table["split"] == "grouped") & table["layer"].notna()]
        residual = linear[linear["site"].str.contains("hook_resid_")]
        absolute = residual[residual["target"] == "absolute_index"]
        best = absolute[(absolute["metric"] == "r2")].sort_values("value").iloc[-1]
        mad = absolute[(absolute["metric"] == "mad") & (absolute["task"] == "regression")].set_index("layer")
        chance = layers.chance_of_mad(mad)
        model_sinks = sinks[sinks["model"] == model]
        as_read = model_sinks[model_sinks["condition"] == model_sinks["condition"].iloc[0]] if len(model_sinks) \
            else model_sinks  # no sink read (every block DSA past index_topk): sink_rate NaN
        rows.append(dict(
            model=model,
            **{read.column: read.first_layer(table) for read in chosen},
            best_absolute_r2=float(best["value"]),
            best_absolute_layer=int(best["layer"]),
            selectivity_at_best=float(best["selectivity"]),
            mad_chance_layer0=float(mad.loc[0, "value"] / chance.loc[0]) if 0 in mad.index else float("nan"),
            mad_chance_best=float((mad["value"] / chance).min()),
            sink_rate=float(sink_flags(as_read).mean()) if "is_sink" in as_read else float("nan"),
            variance_slope_block0=_first_block_slope(variance[variance["model"] == model]),
        ))
    return pd.DataFrame(rows)


def _first_block_slope(variance: pd.DataFrame) -> float:
    """The variance slope of the first block that has one (block 0, or a hybrid's first attention
    block); NaN when no block has an attention output."""
    if variance.empty:
        return float("nan")
    return float(variance[variance["block"] == variance["block"].min()]["slope"].iloc[0])


# ----------------------------------------------------------------------------- the run folder


def sweep(settings: SweepSettings, out_dir: str | Path | None = None, progress: bool = True, jobs: int = 1,
          scheduler: str | None = None, security: str | Path | None = None,
          sweep_reads: Sequence[reads.SweepRead] | None = None, name: str = "sweep") -> SweepResult:
    """Run the sweep; with ``out_dir``, write (and resume) a run folder's parts and tables
    (:func:`write_tables`); its figures and ``summary.md`` are rendering,
    :func:`~nopelens.analyses.report.write_run`'s (``nopelens sweep`` calls it).

    Args:
        settings: what to measure.
        out_dir: run folder; each finished (model, seed) is saved under ``parts/`` at once. A run
            refused or failed before its first part leaves no stamp (:func:`~nopelens.analyses.runs.claimed`).
        progress: progress bars and lines on stderr.
        jobs: local worker processes, one (model, seed) each (see :mod:`~nopelens.analyses.parallel`).
        scheduler: address of a Dask scheduler (``tls://`` or ``tcp://``) to send the (model,
            seed) tasks to instead.
        security: YAML file of distributed's TLS settings for a ``tls://`` scheduler (see
            :func:`~nopelens.analyses.parallel.dask_security`).
        sweep_reads: the reads the summary, the per-layer curves and the figure report (default
            :data:`~nopelens.analyses.reads.SWEEP_READS`; :func:`~nopelens.analyses.reads.choose_reads`
            makes others). They only read what was measured, so a run folder resumes with any.
        name: the command, for the progress bar (``sweep`` or ``probe``).

    Raises:
        ValueError: if ``out_dir`` holds a sweep made with other settings or another analysis's
            run (:func:`~nopelens.analyses.runs.claim`), if there are fewer evaluation sequences
            than folds, or as :func:`~nopelens.analyses.subjects.resolve` and
            :func:`~nopelens.analyses.parallel.run_tasks`.
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
    _check_distinct(settings.tasks())
    if scheduler is not None:  # a malformed address is refused before any work or progress bar
        parallel.check_address(scheduler)
        _check_absolute_paths(settings)
    out = Path(out_dir) if out_dir is not None else None
    if out is None:
        return _sweep_tasks(settings, None, progress, jobs, scheduler, security, sweep_reads, name)
    with runs.claimed(out, "sweep", settings.to_dict(), ignore=settings.RESUMABLE_CHANGES, command=name,
                      unset=settings.UNSET):
        return _sweep_tasks(settings, out, progress, jobs, scheduler, security, sweep_reads, name)


def _sweep_tasks(settings: SweepSettings, out: Path | None, progress: bool, jobs: int, scheduler: str | None,
                 security: str | Path | None, sweep_reads: Sequence[reads.SweepRead] | None, name: str) -> SweepResult:
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
            done[task] = {name: _as_measured(name, seeds.with_train_seed(table, task[1]))
                          for name, table in tables.items()}, meta
    todo = [task for task in tasks if task not in done]
    eta = SweepETA({task: planned_work(task[0], settings.n_sequences, settings.seq_len, task[1], settings.quick_steps)
                    for task in todo}, jobs=1 if scheduler is None and jobs <= 1 else max(1, jobs))
    bar = progress_bar(total=len(tasks), initial=len(done), desc=f"nopelens {name}", unit="model",
                       bar_format="{desc}: {n_fmt}/{total_fmt} models [{elapsed}{postfix}]", disable=not progress)
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
        parallel.run_tasks(measure, [(task, (*task, settings, show_training)) for task in todo], keep, jobs, scheduler,
                           security)
    finally:  # an error's one line then starts on a line of its own
        bar.close()
    parts = [done[task][0] for task in tasks]
    probes, sinks, variance, ablation = (pd.concat([part[table] for part in parts], ignore_index=True)
                                         for table in TABLES)
    chosen = tuple(reads.SWEEP_READS if sweep_reads is None else sweep_reads)
    per_seed = summarize_per_seed(probes, sinks, variance, chosen)
    subjects = {_label(*task): done[task][1] for task in tasks}
    result = SweepResult(probes, sinks, variance, summarize(probes, sinks, variance, chosen), out, subjects,
                         summary_per_seed=per_seed, sink_ablation=ablation,
                         curves=layers.layer_curves(probes, sinks, chosen), reads=chosen)
    if out is not None:
        write_tables(result)
    return result


def write_tables(result: SweepResult) -> None:
    """Write a sweep's tables into ``result.out_dir``: ``probes``, ``sinks``, ``variance``,
    ``summary``, ``layers`` (the main curves) and ``sink_ablation`` (when measured), and with
    several training seeds also ``summary_per_seed`` and ``probes_over_seeds``
    (:mod:`~nopelens.analyses.seeds`); a table this run has none of is removed if an earlier run
    in the folder left one, so the folder describes this run only."""
    out = result.out_dir
    tables = {name: getattr(result, name) for name in ("probes", "sinks", "variance", "summary")}
    tables["layers"] = result.curves
    several = "n_seeds" in result.summary
    tables["summary_per_seed"] = result.summary_per_seed if several else None
    tables["probes_over_seeds"] = seeds.probes_over_seeds(result.probes) if several else None
    tables["sink_ablation"] = None if result.sink_ablation.empty else result.sink_ablation
    for name, table in tables.items():
        if table is None:
            (out / f"{name}.csv").unlink(missing_ok=True)
        else:
            write_csv_atomic(table, out / f"{name}.csv")


SETTINGS_DIGEST = "settings_digest"
"""The ``done.json`` key of the settings a part was measured with (:meth:`SweepSettings.digest`)."""


def _check_same_settings(part: Path, recorded: str | None, settings: SweepSettings) -> None:
    """Refuse to reuse a finished part measured with other settings (a folder whose stamp was lost,
    or written by two runs at once). Parts from before the digest was recorded are reused.

    Raises:
        ValueError: naming the part.
    """
    if recorded is not None and recorded != settings.digest():
        raise ValueError(f"{part} was measured with other settings than this run's (another --seq-len, "
                         "--n-sequences, --seed, --sites, ...); use another --out folder, or delete that part folder "
                         "to measure it again")


def _check_distinct(tasks: Sequence[tuple[str, int]]) -> None:
    """Refuse, before any work, two models that the tables would name alike or whose parts would
    share a folder (``hf:a/m`` and ``hf:b/m`` are both ``hf:m``; ``hf:m a`` and ``hf:m_a`` share
    ``parts/hf_m_a``).

    Raises:
        ValueError: naming both specs.
    """
    for what, key in (("would both be named", lambda spec, seed: _label(display_name(spec), seed)),
                      ("would share the part folder", lambda spec, seed: runs.part_dir(".", spec, seed).name)):
        seen: dict[str, str] = {}
        for spec, seed in tasks:
            name = key(spec, seed)
            if name in seen and seen[name] != spec:
                raise ValueError(f"{seen[name]} and {spec} {what} {name}; give each model once, under names "
                                 "that differ (e.g. rename or link one directory)")
            seen[name] = spec


def _check_absolute_paths(settings: SweepSettings) -> None:
    """Dask workers resolve paths in their own working directory: refuse relative ones.

    Raises:
        ValueError: naming the first relative path.
    """
    paths = [spec.removeprefix(HF_PREFIX) for spec in settings.models
             if spec.startswith(HF_PREFIX) or "/" in spec or Path(spec).exists()]
    if settings.hf_input.text is not None:
        paths.append(settings.hf_input.text)
    for path in paths:
        if not Path(path).is_absolute():
            raise ValueError(f"--scheduler: {path} is a relative path, which each Dask worker would read in its own "
                             f"working directory; give it as an absolute path ({Path(path).resolve()})")


def _check_same_inputs(part: Path, spec: str, recorded: dict | None, current: dict | None) -> None:
    """Refuse to reuse a finished part whose model files or text changed since it was measured
    (:func:`~nopelens.analyses.subjects.input_fingerprint`): its tables would describe another model.

    Raises:
        ValueError: naming what changed.
    """
    changes = input_changes(recorded, current)
    if changes:
        raise ValueError(f"{part} was measured on other inputs than {spec} gives now ({', '.join(changes)} since); "
                         "use another --out folder, or delete that part folder to measure it again")


def measure(spec: str, train_seed: int, settings: SweepSettings, progress: bool = False) -> tuple[dict, dict]:
    """One sweep task: load (or train) ``spec`` with training seed ``train_seed`` and measure it.

    Runs in any process (a local worker or a Dask worker): it reads only its arguments and the
    zoo cache of the machine it runs on. It runs on one thread
    (:func:`~nopelens.models.threads.one_thread`), so its numbers do not depend on the core count
    or on how many workers share the machine; in a Dask worker that runs several tasks at once it
    refuses (:func:`~nopelens.analyses.parallel.check_alone_in_process`).

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
    subject = resolve(spec, settings.n_sequences, settings.seq_len, settings.seed, progress, settings.quick_steps,
                      train_seed=train_seed, hf_input=settings.hf_input)
    loaded = time.perf_counter()
    if "beyond_trained_length" in subject.info:
        tqdm.write(f"nopelens: {_label(subject.name, train_seed)}: note: {subject.info['beyond_trained_length']}",
                   file=sys.stderr)
    probed_blocks(subject, settings.layers)  # a block the model lacks is refused before the "probing" line
    what = f"{subject.n_layers + 1} layers" if settings.layers is None else f"blocks {_ranges(settings.layers)}"
    say(f"{_label(subject.name, train_seed)}: probing {what}")
    with torch.no_grad():
        if settings.streamed and subject.hf is not None:
            tables = analyse_subject_streamed(subject, settings, _label(subject.name, train_seed), progress)
        else:
            tables = analyse_subject(subject, settings, progress)
    tables = {name: table.assign(train_seed=train_seed) for name, table in tables.items()}
    seconds = {"load": loaded - start, "measure": time.perf_counter() - loaded}
    say(f"{_label(subject.name, train_seed)}: measured in {seconds['measure']:.0f} s")
    meta = dict(name=subject.name, kind=subject.kind, position=subject.position, n_layers=subject.n_layers,
                has_bos=subject.has_bos, train_lengths=subject.train_lengths, train_seed=train_seed, **subject.info,
                seconds=seconds)
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
        "nopelens": nopelens.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformer_lens": version("transformer-lens"), "scikit-learn": sklearn.__version__,
        "numpy": np.__version__, "pandas": pd.__version__,
    }
