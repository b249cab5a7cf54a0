"""``nopelens compare haviv``: nopelens' text models next to Haviv et al. 2022, probed with the paper's
own probe and with ours (issue 45).

For each model it reads the residual stream at every layer of fresh validation windows and fits,
on the same kept sample of sequences and the same sequence-grouped folds:

- ``ridge``: the sweep's ridge regression of the absolute position
  (:func:`~nopelens.probes.stream_probes.probe_absolute_index`), scored by its MAD;
- ``mlp``: the paper's 2-layer ReLU MLP classifier, scored by the MAD of its argmax
  (:func:`~nopelens.probes.mlp_probe.probe_positions_mlp`);

each as MAD/chance with a 95 % bootstrap CI over sequences, next to its no-information floor
(:func:`~nopelens.probes.mlp_probe.no_information_floor`: 0.75 for ridge, 1 for the argmax) and to
the controls (Hewitt & Liang's control task and shuffled labels). Layers are also given as a
fraction of depth (layer / n_layers), so the 6-layer models sit beside the paper's 24-layer ones;
the paper's value at the same fraction is its layer round(depth x 24)
(:mod:`~nopelens.analyses.haviv_paper`). The NoPE model is also read at shorter windows (the
context-length axis: the first layer at which MAD/chance falls to 0.1 or less, its CI's upper end at
most 0.1, at each length). Validation bits per byte come from each model's training record (every
validation byte once), beside the paper's Table 1 perplexities. Each claim of the paper gets a
verdict: reproduced, direction only, not reproduced, or not measured.

Everything runs on one thread (:func:`~nopelens.models.threads.one_thread`): the same seed gives
the same numbers on a CPU. Run folder: ``parts/<model>-L<bytes>/`` per model and window
(``probes.csv`` and ``done.json``, written last: a rerun resumes), then ``haviv.csv`` (ours and the
paper's rows, one tidy table), ``losses.csv``, ``context.csv``, ``training.csv`` (each model's
training curve) and ``claims.csv`` (rendered by the CLI with :mod:`~nopelens.analyses.haviv_figure`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from nopelens.models import zoo
from nopelens.models.io import write_csv_atomic
from nopelens.models.threads import one_thread
from nopelens.probes import collect, probe_absolute_index, resid_sites
from nopelens.probes.mlp_probe import (
    FLOORS,
    MLP_EPOCHS,
    MLP_MIN_STEPS,
    kept_sequences,
    no_information_floor,
    probe_positions_mlp,
)

from . import haviv_paper as paper
from .haviv_claims import THRESHOLD, claims, first_layer_at
from .haviv_training import losses, training_curves, unseen_loss
from .runs import claimed, part_dir, read_part, write_part
from .specs import input_changes, input_fingerprint
from .subjects import resolve
from .sweep.parallel import run_tasks

HAVIV_MODELS = tuple(f"text{zoo.HAVIV_LEN}-{method}-{zoo.HAVIV_LAYERS}l" for method in zoo.HAVIV_METHODS)
"""The comparison zoo (:data:`nopelens.models.zoo.HAVIV_METHODS`), the default models."""
MAX_SEQUENCES = 10**7
"""The most validation windows a comparison draws per model and length."""
PROBES = ("ridge", "mlp")
FITS = ("linear", "control", "shuffled")
"""Which of the probes' rows the comparison keeps: the position itself, Hewitt & Liang's control task
(what the probe's own capacity reads from token identity: selectivity) and the shuffled-label control."""


@dataclass(frozen=True)
class HavivSettings:
    """What ``nopelens compare haviv`` measures (every field is in the run folder's stamp).

    Attributes:
        models: model specs (zoo names, checkpoints); default the comparison zoo.
        n_sequences: validation windows drawn per model and length.
        memory_mib: memory the kept features may take (MiB): sets how many windows are kept.
        contexts: window lengths in bytes (after BOS) of the NoPE context-length axis; each one up
            to the model's trained window.
        n_boot: bootstrap replicates of the CIs.
        epochs, min_steps: MLP probe training (:class:`~nopelens.probes.mlp_probe.MLPPositionProbe`).
        n_splits: GroupKFold folds.
        seed: seed of the windows, folds, controls, MLP and bootstrap.
        train_seeds: training seeds of each zoo model (each seed is its own trained model); with
            two or more, each curve is their mean, with a CI over the training runs.
    """

    models: tuple[str, ...] = HAVIV_MODELS
    n_sequences: int = 100
    memory_mib: int = 256
    contexts: tuple[int, ...] = (64, 128, 256)
    n_boot: int = 1000
    epochs: int = MLP_EPOCHS
    min_steps: int = MLP_MIN_STEPS
    n_splits: int = 5
    seed: int = 0
    train_seeds: tuple[int, ...] = (0,)

    RESUMABLE_CHANGES = ("models", "contexts", "train_seeds")
    """Settings a run folder may change between runs: each part is one model (one training seed) at
    one window length, so adding a model, a seed or a length measures just the new parts (the stamp
    records the latest)."""

    @classmethod
    def quick(cls, models: tuple[str, ...] = ("text-nope-4l", "text-rope-4l")) -> "HavivSettings":
        """Seconds, for tests: few windows, replicates and epochs (numbers not meaningful)."""
        return cls(models=models, n_sequences=12, contexts=(16, 32), n_boot=20, epochs=2, min_steps=20, n_splits=3)

    def check(self) -> None:
        """Raises:
        ValueError: on no models, a model or length listed twice, too few or too many windows,
                or a non-positive size."""
        if not self.models:
            raise ValueError("no models to compare")
        twice = [spec for i, spec in enumerate(self.models) if spec in self.models[:i]]
        if twice:
            raise ValueError(
                f"--models lists {twice[0]} twice (its rows would count twice in the side-by-side and claims)"
            )
        if self.n_splits < 2 or self.n_sequences < 2 * self.n_splits:
            raise ValueError(
                f"need n_splits >= 2 and at least 2 windows per fold, got {self.n_sequences} windows "
                f"for {self.n_splits} folds"
            )
        for name in ("memory_mib", "n_boot", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_steps < 0:
            raise ValueError(f"min_steps must be >= 0, got {self.min_steps}")
        if not self.contexts or min(self.contexts) < 4:
            raise ValueError(f"context lengths must be >= 4 bytes, got {list(self.contexts)}")
        if len(set(self.contexts)) < len(self.contexts):
            raise ValueError(f"--contexts lists a length twice ({list(self.contexts)}): its rows would count twice")
        if not self.train_seeds or len(set(self.train_seeds)) < len(self.train_seeds):
            raise ValueError(f"--seeds must list each training seed once, got {list(self.train_seeds)}")
        if self.train_seeds != (0,):
            checkpoints = [spec for spec in self.models if spec not in zoo.RECIPES]
            if checkpoints:
                raise ValueError(
                    f"--seeds names training seeds of zoo models; {checkpoints[0]} is not one (a checkpoint "
                    "is one trained model): compare it in a run without --seeds"
                )
        if self.n_sequences > MAX_SEQUENCES:
            raise ValueError(
                f"n_sequences must be at most {MAX_SEQUENCES:,} windows (each is read by the model), "
                f"got {self.n_sequences:,}"
            )


def check_models_ready(models, train_seeds=(0,)) -> None:
    """Refuse, before anything runs, a zoo model (at a training seed) that is neither cached nor
    shipped (this command never trains one: the comparison zoo takes about 70 minutes a model on
    one thread).

    Raises:
        ValueError: naming each such model and seed, and the command that trains the first.
    """
    missing = [
        (spec, seed)
        for spec in models
        for seed in train_seeds
        if spec in zoo.RECIPES and not (zoo.is_cached(spec, seed=seed) or zoo.is_shipped(spec, seed=seed))
    ]
    if missing:
        (spec, seed), named = missing[0], ", ".join(m if s == 0 else f"{m} (seed {s})" for m, s in missing)
        raise ValueError(
            f"{named}: not trained yet (no cached or shipped weights); train with "
            f"`nopelens train --zoo {spec}{'' if seed == 0 else f' --seeds {seed}'}` (one per model, about "
            f"{zoo.RECIPES[spec].steps} steps), or compare "
            + (
                "the seeds there are, e.g. --seeds 0"
                if seed
                else "the models there are, e.g. --models text-nope-4l,text-rope-4l"
            )
        )


def compare_haviv(
    out: str | Path, settings: HavivSettings = HavivSettings(), say: Callable[[str], None] = print, jobs: int = 1
) -> dict[str, pd.DataFrame]:
    """Measure every model of ``settings`` and write the side-by-side tables into ``out``.

    Args:
        out: the run folder.
        settings: what to measure.
        say: receives one progress line per part measured or found measured.
        jobs: parts (a model at one window length) measured at once, each in a worker process on
            one thread (:func:`~nopelens.analyses.sweep.parallel.run_tasks`); the numbers do not
            depend on it. 1: in this process.

    Returns:
        ``{"haviv": ..., "losses": ..., "context": ..., "training": ..., "claims": ...}`` (see the module docstring;
        columns in docs/schema.md).

    Raises:
        ValueError: on bad settings, ``jobs`` < 1, a model not trained yet
            (:func:`check_models_ready`), a run folder made with other settings, or as the probes.
    """
    settings.check()
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    check_models_ready(settings.models, settings.train_seeds)
    whole, parts, methods = [], [], {}  # whole: each model at its trained window
    for spec in settings.models:
        window, reads_positions, methods[spec] = _window_and_method(spec)
        for train_seed in settings.train_seeds:
            whole.append((spec, train_seed, window))
            parts.append((spec, train_seed, window))
            if not reads_positions:  # NoPE: the context axis
                parts += [(spec, train_seed, length) for length in settings.contexts if length < window]
    _one_model_per_method(methods)
    _check_distinct_parts(parts)
    with (
        one_thread(),
        claimed(
            out, "haviv", dataclasses.asdict(settings), ignore=settings.RESUMABLE_CHANGES, command="compare haviv"
        ) as folder,
    ):
        measured = {}

        def on_done(part: tuple, result: tuple) -> None:
            measured[part] = result[:2]
            spec, train_seed, length = part
            say(f"{spec}{'' if train_seed == 0 else f' (seed {train_seed})'} at {length} bytes: {result[2]}")

        run_tasks(measure, [(part, (folder, *part, settings)) for part in parts], on_done, jobs=jobs)
        seeds = pd.concat([measured[part][0] for part in parts], ignore_index=True)
        metas = [_with_unseen_loss(measured[part][1], *part) for part in whole]
        ours = over_training_seeds(seeds)
        tables = {
            "haviv": side_by_side(ours),
            "seeds": seeds,
            "losses": losses(metas),
            "context": context_axis(ours, seeds, settings, metas),
            "training": training_curves(metas),
        }
        tables["claims"] = claims(tables["haviv"], tables["losses"])
        for name, table in tables.items():
            write_csv_atomic(table, folder / f"{name}.csv")
    return tables


def measure(
    folder: Path, spec: str, train_seed: int, length: int, settings: HavivSettings
) -> tuple[pd.DataFrame, dict, str]:
    """One model (one training seed) at one window length, from its part folder or measured (on one
    thread) and written there. Returns (its probe rows, its ``done.json`` record, what happened in
    words)."""
    part = part_dir(folder, _part_name(spec, train_seed, length))
    done = read_part(part, ["probes"])
    inputs = input_fingerprint(spec)
    if done is not None:
        changes = input_changes(done[1].get("inputs"), inputs)
        if changes:
            raise ValueError(
                f"{part} was measured on other files than {spec} holds now ({', '.join(changes)} since); "
                "use another --out folder, or delete that part folder to measure it again"
            )
        probes, meta = done[0]["probes"], done[1]
        problem = _unsound_part(probes, meta, spec, train_seed, length)
        if problem is None:
            if "train_seed" not in probes:  # a part from before training seeds: seed 0's
                probes.insert(probes.columns.get_loc("model") + 1, "train_seed", train_seed)
                meta = {**meta, "train_seed": train_seed}
            return probes, meta, f"already measured in {part}"
        print(f"nopelens: {part}/done.json {problem}; measuring it again", file=sys.stderr)
    clock = time.perf_counter()
    with one_thread():
        probes, meta = probe_model(spec, length, settings, train_seed)
    meta.update(window=_window_and_method(spec)[0], inputs=inputs)
    write_part(part, {"probes": probes}, meta)
    return probes, meta, f"probed in {time.perf_counter() - clock:.0f} s"


PART_FIELDS = {"model": str, "method": str, "reads_positions": bool, "n_layers": int, "length": int, "window": int}
"""What a finished part's ``done.json`` records (besides numbers), and its type."""


def _part_name(spec: str, train_seed: int, length: int) -> str:
    """A part's folder name: ``<model>-L<bytes>``, with ``-seed<n>`` before the length for a
    training seed other than 0 (run folders from before seeds keep their parts)."""
    return f"{spec}{'' if train_seed == 0 else f'-seed{train_seed}'}-L{length}"


def _unsound_part(probes: pd.DataFrame, meta: dict, spec: str, train_seed: int, length: int) -> str | None:
    """What is wrong with a finished part read back for ``spec`` (training seed ``train_seed``) at
    ``length`` bytes, or None."""
    for field, kind in PART_FIELDS.items():
        if not isinstance(meta.get(field), kind) or (kind is int and isinstance(meta.get(field), bool)):
            return f"lacks {field} or holds a wrong value there"
    if meta["model"] != spec or meta["length"] != length or meta.get("train_seed", 0) != train_seed:
        return (
            f"records {meta['model']} (seed {meta.get('train_seed', 0)}) at {meta['length']} bytes, "
            f"not {spec} (seed {train_seed}) at {length}"
        )
    if not isinstance(meta.get("bits_per_byte"), (int, float)) or isinstance(meta.get("bits_per_byte"), bool):
        return "lacks bits_per_byte"
    expected = len(PROBES) * len(FITS) * (meta["n_layers"] + 1)
    if len(probes) != expected or "mad_chance" not in probes:
        return f"goes with a probes.csv of {len(probes)} rows, not {expected}"
    return None


def _check_distinct_parts(parts: list[tuple[str, int, int]]) -> None:
    """Refuse, before any work, two models whose parts would share a folder (``a/ck`` and ``a_ck``
    are both ``parts/a_ck-L<n>``).

    Raises:
        ValueError: naming both specs.
    """
    seen: dict[str, str] = {}
    for spec, train_seed, length in parts:
        name = part_dir(".", _part_name(spec, train_seed, length)).name
        if seen.get(name, spec) != spec:
            raise ValueError(
                f"{seen[name]} and {spec} would share the part folder parts/{name}; give each model "
                "under a name that differs (e.g. rename or link one directory)"
            )
        seen[name] = spec


def _one_model_per_method(methods: dict[str, str]) -> None:
    """Refuse, before any work, two models (``{spec: method}``) of one position method: each claim
    reads one curve per method (run such models into separate folders).

    Raises:
        ValueError: naming the method and both models.
    """
    seen: dict[str, str] = {}
    for spec, method in methods.items():
        if method in seen:
            raise ValueError(
                f"{seen[method]} and {spec} both use {method} positions: the claims read one model per "
                "method; compare them in separate --out folders"
            )
        seen[method] = spec


def _with_unseen_loss(meta: dict, spec: str, train_seed: int, window: int) -> dict:
    """``meta`` with the model's loss on the unseen validation documents (:func:`unseen_loss`) and
    the text it was trained on (``corpus``: the file, or what the built-in corpus holds, in the
    words of :data:`~nopelens.models.text.CORPORA`)."""
    subject = _text_subject(spec, 2, 3, 0, train_seed)
    bits, scored = unseen_loss(subject.model, subject.task, window)
    corpus = subject.task.corpus_name
    return {**meta, "unseen_bits_per_byte": bits, "unseen_bytes": scored, "corpus": corpus}


def _window_and_method(spec: str) -> tuple[int, bool, str]:
    """The window (bytes after BOS) ``spec`` was trained on, whether its method reads positions,
    and the method."""
    subject = _text_subject(spec, 2, 3, 0)
    window = zoo.recipe(spec).train_kwargs["max_len"] if spec in zoo.RECIPES else None
    window = window or (subject.train_lengths or [None, subject.model.cfg.n_ctx - 1])[1]
    return window, subject.model.cfg.reads_positions, subject.position


def _text_subject(spec: str, n_sequences: int, seq_len: int, seed: int, train_seed: int = 0):
    """The subject of a nopelens text model (zoo name at ``train_seed``, or checkpoint), else a
    one-line refusal."""
    subject = resolve(spec, n_sequences, seq_len, seed=seed, progress=False, train_seed=train_seed)
    if subject.kind != "trained" or subject.task is None or subject.task.name != "text":
        raise ValueError(
            f"{spec} is not a text model: the comparison reads nopelens language models of text "
            "(a zoo name or a checkpoint of `nopelens train --task text`)"
        )
    return subject


def probe_model(spec: str, length: int, settings: HavivSettings, train_seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """Both probes at every residual layer of ``spec`` (trained with ``train_seed``) on windows of
    ``length`` bytes after BOS.

    Returns:
        (rows: one per probe, fit, layer; meta: method, n_layers, the training record's validation
        bits per byte, windows drawn and kept).
    """
    subject = _text_subject(spec, settings.n_sequences, length + 1, settings.seed, train_seed)
    sites = resid_sites(subject.n_layers)
    d_model = subject.model.cfg.d_model
    keep = kept_sequences(
        len(subject.tokens),
        length + 1,
        4 * d_model * len(sites),
        settings.memory_mib << 20,
        settings.seed,
        min_sequences=2 * settings.n_splits,
    )
    acts = collect(subject.model, subject.tokens[keep], sites, subject.attention_mask[keep])
    ridge = probe_absolute_index(
        acts, sites, tasks=("regression",), n_splits=settings.n_splits, n_boot=settings.n_boot, seed=settings.seed
    )
    ridge = ridge[(ridge["metric"] == "mad") & ridge["probe"].isin(FITS)].assign(
        floor=no_information_floor(acts.position, FLOORS["ridge"]), kind="ridge"
    )
    frames = [ridge]
    for site in sites:
        rows = probe_positions_mlp(
            acts.features(site),
            acts.position,
            acts.sequence_id,
            acts.token,
            settings.n_splits,
            n_boot=settings.n_boot,
            seed=settings.seed,
            dtype=acts.dtype(site),
            epochs=settings.epochs,
            min_steps=settings.min_steps,
        )
        layer = sites.index(site)
        frames.append(
            rows[(rows["metric"] == "mad") & rows["probe"].isin(FITS)].assign(site=site, layer=layer, kind="mlp")
        )
    rows = pd.concat(frames, ignore_index=True)
    validation = subject.info.get("final_losses", {}).get("validation", math.nan)
    meta = dict(
        model=spec,
        train_seed=train_seed,
        method=subject.position,
        reads_positions=subject.model.cfg.reads_positions,
        n_layers=subject.n_layers,
        length=length,
        n_positions=length + 1,
        n_sequences=len(subject.tokens),
        kept=len(keep),
        bits_per_byte=validation / math.log(2),
    )
    table = pd.DataFrame(
        dict(
            source="nopelens",
            model=spec,
            train_seed=train_seed,
            method=subject.position,
            probe=rows["kind"],
            fit=rows["probe"],
            n_positions=length + 1,
            layer=rows["layer"].astype(int),
            n_layers=subject.n_layers,
            depth=rows["layer"].astype(int) / subject.n_layers,
            mad=rows["value"],
            chance=rows["chance"],
            mad_chance=rows["value"] / rows["chance"],
            ci_low=rows["ci_low"] / rows["chance"],
            ci_high=rows["ci_high"] / rows["chance"],
            floor=rows["floor"],
            n_sequences=rows["n_sequences"],
            n_sequences_drawn=len(subject.tokens),
            reference="measured",
        )
    )
    return table.sort_values(["probe", "fit", "layer"], ignore_index=True), meta


SEED_KEYS = ["source", "model", "method", "probe", "fit", "n_positions", "layer", "n_layers", "depth", "floor"]
"""What identifies one point of a curve across training seeds."""


def over_training_seeds(seeds: pd.DataFrame) -> pd.DataFrame:
    """One row per point of each curve (:data:`SEED_KEYS`) from the per-seed rows of
    :func:`probe_model`: with one training seed, its row, whose CI is the bootstrap over windows;
    with ``n`` >= 2, the mean over seeds of ``mad``, ``chance`` and ``mad_chance``, with a 95 % CI
    on MAD/chance of half-width ``sqrt(h_runs**2 + h_windows**2)``: ``h_runs = t(0.975, n-1) *
    sd / sqrt(n)`` (Student 1908, over the training runs) and ``h_windows`` the seeds' mean
    bootstrap half-width. Every seed reads the same windows, so their sampling noise is shared and
    does not average out over seeds: without it, seeds that agree would give a CI of width 0.
    ``n_train_seeds`` and ``ci_over`` (``windows``, or ``training runs and windows``) say which."""
    rows = []
    for _, group in seeds.groupby(SEED_KEYS, sort=False, dropna=False):
        first, n = group.iloc[0], len(group)
        row = first.drop("train_seed").to_dict()
        row.update(n_train_seeds=n, ci_over="windows")
        if n >= 2:
            mean, sd = group["mad_chance"].mean(), group["mad_chance"].std(ddof=1)
            runs = scipy_stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
            windows = ((group["ci_high"] - group["ci_low"]) / 2).mean()
            half = math.hypot(runs, windows)
            row.update(
                mad=group["mad"].mean(),
                chance=group["chance"].mean(),
                mad_chance=mean,
                ci_low=mean - half,
                ci_high=mean + half,
                ci_over="training runs and windows",
            )
        rows.append(row)
    return pd.DataFrame(rows)


def side_by_side(ours: pd.DataFrame) -> pd.DataFrame:
    """Our rows and the paper's MAD/chance rows in one tidy table (``source`` says whose), with
    ``paper_mad_chance``: the paper's value for the same method at the nearest fraction of depth
    (its layer round(depth x 24)), NaN where the paper has no such model."""
    ours = ours.copy()
    ours["paper_layer"] = (ours["depth"] * paper.PAPER_LAYERS).round().astype(int)
    ours["paper_mad_chance"] = [
        paper.PAPER_MAD[m][l] / paper.PAPER_CHANCE_MAD if m in paper.PAPER_MAD else np.nan
        for m, l in zip(ours["method"], ours["paper_layer"])
    ]
    table = paper.paper_table()
    theirs = table[table["quantity"] == "mad_chance"]
    theirs = pd.DataFrame(
        dict(
            source="haviv2022",
            model="1.3B (The Pile)",
            method=theirs["method"],
            probe="mlp",
            fit="linear",
            n_positions=theirs["n_positions"],
            layer=theirs["layer"].astype(int),
            n_layers=theirs["n_layers"],
            depth=theirs["depth"],
            mad=theirs["value"] * paper.PAPER_CHANCE_MAD,
            chance=paper.PAPER_CHANCE_MAD,
            mad_chance=theirs["value"],
            ci_low=np.nan,
            ci_high=np.nan,
            floor=no_information_floor(np.arange(paper.PAPER_POSITIONS), "argmax"),
            n_sequences=np.nan,
            n_sequences_drawn=np.nan,
            reference=theirs["source"],
            paper_layer=theirs["layer"].astype(int),
            paper_mad_chance=theirs["value"],
        )
    )
    table = pd.concat([ours, theirs], ignore_index=True)
    counts = [c for c in ("n_sequences", "n_sequences_drawn", "n_train_seeds") if c in table]
    return table.astype(dict.fromkeys(counts, "Int64"))  # counts stay integers; the paper's rows are empty


def context_axis(ours: pd.DataFrame, seeds: pd.DataFrame, settings: HavivSettings, metas: list[dict]) -> pd.DataFrame:
    """For each NoPE model, window length and probe: the first layer with MAD/chance <= 0.1
    (:func:`first_layer_at` on the curve over training seeds, :func:`over_training_seeds`; -1:
    none), as a layer and as a fraction of depth, and each training seed's own first layer
    (``seed_first_layers``, in the order of ``train_seeds``); lengths past the model's window are
    rows with ``measured`` False."""
    rows = []
    position_free = {meta["model"] for meta in metas if not meta["reads_positions"]}  # NoPE, by its method units
    nope = ours[ours["model"].isin(position_free) & (ours["fit"] == "linear")]
    for model, own in nope.groupby("model"):
        longest = int(own["n_positions"].max()) - 1
        for length in sorted({*settings.contexts, longest}):
            for probe in PROBES:
                curve = own[(own["n_positions"] == length + 1) & (own["probe"] == probe)]
                layer = first_layer_at(curve) if len(curve) else -1
                n_layers = int(own["n_layers"].iloc[0])
                each = seeds[
                    (seeds["model"] == model)
                    & (seeds["fit"] == "linear")
                    & (seeds["n_positions"] == length + 1)
                    & (seeds["probe"] == probe)
                ]
                rows.append(
                    dict(
                        model=model,
                        length=length,
                        probe=probe,
                        measured=len(curve) > 0,
                        first_layer=layer if len(curve) else np.nan,
                        depth=layer / n_layers if len(curve) and layer >= 0 else np.nan,
                        threshold=THRESHOLD,
                        seed_first_layers=" ".join(
                            str(first_layer_at(rows_of_seed)) for _, rows_of_seed in each.groupby("train_seed")
                        ),
                    )
                )
    columns = ["model", "length", "probe", "measured", "first_layer", "depth", "threshold", "seed_first_layers"]
    return pd.DataFrame(rows, columns=columns)
