"""``nopelens sweep``, ``nopelens probe`` and ``nopelens sinks`` on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

from nopelens.analyses import report, runs
from nopelens.analyses.figures import save_figure, sink_figure
from nopelens.analyses.runs import slug
from nopelens.analyses.subjects import HF_PREFIX, fixed_length, resolve
from nopelens.analyses.sweep import layers, reads, sweep, variant_name, versions
from nopelens.analyses.sweep.parallel import default_jobs
from nopelens.analyses.sweep.plan import plan
from nopelens.analyses.sweep.reads import choose_reads
from nopelens.analyses.sweep.settings import DEFAULT_SITES, SITE_KINDS, SweepSettings
from nopelens.analyses.sweep.sites import sweep_sites
from nopelens.analyses.sweep.streamed import measure_sinks
from nopelens.models.anymodel import no_attention_reason
from nopelens.models.hf import UnsupportedModelError
from nopelens.models.hf_loading import HFInput
from nopelens.models.io import write_csv_atomic
from nopelens.probes.sinks import learned_sink_line, learned_sink_logits, sink_flags

from .options import MODEL_HELP, PLACEMENT_OPTIONS, add_placement, add_quiet, add_seeds, seed_type
from .placement import placement_of


def _models(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    models = tuple(m.strip() for m in text.split(",") if m.strip())
    if not models:
        raise ValueError("--models lists no model")
    return models


def _settings(args: argparse.Namespace, models, controls: bool) -> SweepSettings:
    if args.quick:
        settings = SweepSettings.quick(args.task, models, controls)
    else:
        settings = SweepSettings.default(args.task, models, controls)
    overrides = {k: getattr(args, k) for k in ("n_sequences", "seq_len", "seed") if getattr(args, k) is not None}
    if getattr(args, "seeds", None) is not None:
        overrides["train_seeds"] = args.seeds
    if getattr(args, "sites", None) is not None:
        overrides["sites"] = tuple(kind.strip() for kind in args.sites.split(",") if kind.strip())
    settings = dataclasses.replace(settings, **overrides)
    if args.seq_len is not None:
        _check_seq_len(settings.models, args.command)
    return settings


def _check_seq_len(models: tuple[str, ...], command: str) -> None:
    """Refuse ``--seq-len`` when no model of the run takes it; name the models that ignore it otherwise."""
    fixed = {spec: why for spec in models if (why := fixed_length(spec)) is not None}
    if fixed and len(fixed) == len(models):
        raise ValueError(f"--seq-len does not apply: {next(iter(fixed.values()))}; leave --seq-len out")
    if fixed:
        print(
            f"nopelens {command}: note: --seq-len does not apply to {', '.join(fixed)} (synthetic-task models are "
            "read at their longest training length)",
            file=sys.stderr,
        )


def _sweep(args: argparse.Namespace, settings: SweepSettings, out, name: str):
    """Run the sweep into ``out``, then draw its figures and write its ``summary.md`` there.

    Returns:
        ``(result, figures)``: the :class:`~nopelens.analyses.sweep.driver.SweepResult` and the stems of the
        figures written (none without ``out``).
    """
    sweep_reads = choose_reads(args.metric, args.threshold)  # before any work: a bad --metric costs nothing
    jobs = default_jobs() if args.jobs is None else args.jobs
    result = sweep(
        settings,
        out,
        progress=not args.quiet,
        jobs=jobs,
        scheduler=args.scheduler,
        security=args.dask_security,
        sweep_reads=sweep_reads,
        name=name,
        variant=variant_name(args.metric, args.threshold),
    )
    if out is None:
        return result, []
    return result, report.write_run(
        result,
        settings,
        command=" ".join(["nopelens", *sys.argv[1:]]),
        versions=versions(),
        svg=args.svg,
        name=name,
        draw=not args.no_figures,
    )


def _figures_text(figures: list[str]) -> str:
    """What the run folder got besides its tables: the figures written, or that none were."""
    if not figures:
        return "no figures (--no-figures)"
    return "figures " + ", ".join(figures) + " (.png)"


def _print_results(swept: tuple, as_json: bool) -> None:
    result, figures = swept
    if as_json:
        print(json.dumps(results_json(result), indent=1, allow_nan=False))
        if result.out_dir is not None:
            summary = f"summary-{result.variant}.md" if result.variant else "summary.md"
            print(
                f"nopelens: wrote {result.out_dir}/{summary} and its tables; {_figures_text(figures)}", file=sys.stderr
            )
        return
    print(
        report.layer_tables_text(result.curves, result.reads, low=layers.low_selectivity(result.probes, result.reads))
    )
    print()
    print(
        report.summary_text(result.summary, result.reads, not_applicable=report.not_applicable_reads(result.subjects))
    )
    if result.out_dir is not None:
        suffix = f"-{result.variant}" if result.variant else ""
        print(
            f"\nwrote summary{suffix}.md and tables (layers{suffix}.csv: the curves above;"
            f"\ncolumns: docs/schema.md), {_figures_text(figures)}, to\n{result.out_dir}"
        )


def results_json(result) -> dict:
    """What ``--json`` prints: the reads, the summary and the per-layer curves, as JSON-ready records
    (missing numbers are null; columns as in summary.csv and layers.csv, docs/schema.md), and per
    model the reads it left out and why (``not_applicable``: model -> read -> reason)."""

    def records(table):
        return json.loads(table.to_json(orient="records"))

    return {
        "out_dir": None if result.out_dir is None else str(result.out_dir),
        "reads": [
            dict(
                column=r.column,
                header=r.header,
                target=r.target,
                task=r.task,
                features=r.features,
                metric=r.metric,
                threshold=r.threshold,
                split=r.split,
            )
            for r in result.reads
        ],
        # a first layer is an integer, null where undefined (a column with one null reads as floats otherwise)
        "summary": records(
            result.summary.astype(
                {column: "Int64" for column in reads.read_columns(result.reads) if column in result.summary}
            )
        ),
        "layers": records(result.curves),
        "not_applicable": report.not_applicable_reads(result.subjects),
    }


def run_sweep(args: argparse.Namespace) -> int:
    settings = _settings(args, _models(args.models), controls=not args.no_controls)
    out = args.out if args.out is not None else "runs/sweep-quick" if args.quick else "runs/sweep"
    _print_results(_sweep(args, settings, out, "sweep"), args.json)
    return 0


def _probe_settings(args: argparse.Namespace) -> SweepSettings:
    """``probe``'s settings: an ``hf:DIR`` model is streamed, read as ``--input`` says (default: text
    through its tokenizer), on ``--device`` in ``--dtype``."""
    # one spelling per model, text and device, so that a rerun spelled otherwise resumes the same folder
    if args.model.startswith(HF_PREFIX) and args.model[len(HF_PREFIX) :]:
        args.model = HF_PREFIX + os.path.normpath(args.model[len(HF_PREFIX) :])
    if args.text:
        args.text = os.path.normpath(args.text)
    settings = _settings(args, (args.model,), controls=False)
    if not args.model.startswith(HF_PREFIX):
        _refuse_hf_options(
            args,
            (
                "input",
                "text",
                "device",
                "dtype",
                *PLACEMENT_OPTIONS,
                "batch_size",
                "keep_mib",
                "memory_mib",
                "layers",
                "plan",
                "no_sink_ablation",
            ),
            " (the streamed probe)",
        )
        return settings
    if len(settings.train_seeds) > 1:
        raise ValueError(
            f"--seeds {','.join(map(str, settings.train_seeds))}: training seeds apply to zoo models, "
            f"each trained with its seed; {args.model} has one set of weights"
        )
    batch_size = "auto" if args.batch_size is None else args.batch_size
    return dataclasses.replace(
        settings,
        hf_input=_hf_input(args),
        streamed=True,
        batch_size=batch_size,
        keep_mib=args.keep_mib,
        memory_mib=args.memory_mib,
        layers=args.layers,
        sink_ablation=not args.no_sink_ablation,
    )


def _hf_input(args: argparse.Namespace):
    """How an ``hf:DIR`` model is read (``--input``, default text through its tokenizer; ``--text``,
    ``--device``, ``--dtype``, or ``--device-map`` with its budgets), with ``--device auto`` resolved
    to the device it picks here."""
    placement = placement_of(args)
    how = HFInput(
        input="text" if args.input is None else args.input,
        text=args.text,
        device="cpu" if args.device is None else args.device,
        dtype=args.dtype,
        placement=placement,
    )
    return dataclasses.replace(how, device=how.torch_device().type)


def _refuse_hf_options(args: argparse.Namespace, names: tuple[str, ...], what: str = "") -> None:
    """Refuse the first of the ``hf:DIR``-only options ``names`` given for another model.

    Raises:
        ValueError: naming the option and the model.
    """
    given = [name for name in names if getattr(args, name) is not None and getattr(args, name) is not False]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} applies to hf:DIR models{what}, not to {args.model}")


def _add_input_options(group) -> None:
    """``--input``, ``--text``, ``--device`` and ``--dtype`` of an ``hf:DIR`` model (:func:`_hf_input`)."""
    group.add_argument(
        "--input",
        help="what the model reads: text (default; through the tokenizer saved in DIR, with "
        "the BOS it adds), random (uniform token ids) or repeated (one token repeated: a known answer)",
    )
    group.add_argument(
        "--text",
        metavar="FILE",
        help="a UTF-8 text file to read (default: the corpus nopelens ships, CPython's help texts)",
    )
    group.add_argument("--device", help="cpu (default), cuda or auto (CUDA when available)")
    group.add_argument(
        "--dtype", help="bfloat16, float16 or float32 (default: the checkpoint's own); statistics are float64"
    )
    add_placement(group)


MAX_BLOCK = 99_999
"""The largest block number ``--layers`` takes (no model has that many blocks; a range is expanded)."""


def _blocks(text: str) -> tuple[int, ...]:
    """``--layers``: block numbers and rising ranges, ``0,4-7,12`` (ASCII digits)."""
    blocks = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*([0-9]+)(?:-([0-9]+))?\s*", part)
        if match is None:
            raise argparse.ArgumentTypeError(f"must be block numbers or rising ranges like 0,4-7,12, got {text!r}")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first or last > MAX_BLOCK:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r}: a range must rise, and blocks are numbered 0 to at most {MAX_BLOCK:,}"
            )
        blocks += range(first, last + 1)
    return tuple(blocks)


def _batch_size(text: str) -> int | str:
    """``--batch-size``: ``auto`` or an integer (SweepSettings checks that it is >= 1)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}") from None


def run_probe(args: argparse.Namespace) -> int:
    settings = _probe_settings(args)
    if args.plan:
        subject = resolve(
            args.model,
            settings.n_sequences,
            settings.seq_len,
            settings.seed,
            not args.quiet,
            hf_input=settings.hf_input,
        )
        plan_ = plan(subject, settings, sweep_sites(subject, settings.sites, settings.layers))
        print(plan_.describe(subject.name).removeprefix("nopelens: "))
        if plan_.shortfall:
            raise ValueError(f"{subject.name}: {plan_.shortfall}")
        return 0
    out = f"runs/probe-{slug(args.model)}" if args.out is None else args.out
    _print_results(_sweep(args, settings, out, "probe"), args.json)
    return 0


def _rate_text(flags) -> str:
    """A sink rate over the heads that got a verdict (and how many did), or why there is none."""
    judged = int(flags.notna().sum())
    if judged == 0:
        return "n/a (no head gets a verdict: uniform attention over the queries scored reaches eps)"
    if judged == len(flags):
        return f"{flags.mean():.3f}"
    return (
        f"{flags.mean():.3f} over the {judged} of {len(flags)} heads that get a verdict (the others: uniform "
        "attention over the queries scored reaches eps, gu_chance in sinks.csv)"
    )


def run_sinks(args: argparse.Namespace) -> int:
    settings = _settings(args, (args.model,), controls=False)
    is_hf = args.model.startswith(HF_PREFIX)
    if not is_hf:
        _refuse_hf_options(args, ("input", "text", "device", "dtype", *PLACEMENT_OPTIONS))
    if args.out is not None:
        runs.refuse_other_runs(args.out, "sinks")
    how = _hf_input(args) if is_hf else None
    try:
        subject = resolve(
            args.model,
            settings.n_sequences,
            settings.seq_len,
            settings.seed,
            not args.quiet,
            settings.quick_steps,
            hf_input=how,
        )
    except UnsupportedModelError as error:  # no pattern to read; its learned sink logits may still be
        logits = learned_sink_logits(getattr(error, "sink_parameters", {}))
        if logits.empty:
            raise
        _print_learned_sinks(args.model, logits)
        print(f"{args.model}: no sink mass read: {error}")
        if args.out:
            _write_learned_sinks(logits, args.out)
        return 0
    absent = subject.hf.attention_absent() if is_hf else None
    if absent:
        raise ValueError(f"{absent}, so no attention sink to measure")
    if not any(site.endswith("hook_pattern") for site in subject.model.hook_dict):
        raise ValueError(
            f"{subject.name} has no hook_pattern site: "
            f"{no_attention_reason(getattr(subject.model, 'model', subject.model))}, so no attention sink "
            "to measure"
        )
    logits = learned_sink_logits(subject.model.original_model) if is_hf else None
    if "beyond_trained_length" in subject.info:
        print(f"nopelens sinks: {subject.name}: note: {subject.info['beyond_trained_length']}", file=sys.stderr)
    table = measure_sinks(subject)
    for condition, rows in table.groupby("condition", sort=False):
        grid = rows.pivot_table(index="block", columns="head", values="sink_mass")
        print(
            f"{subject.name}, {condition.replace('_', ' ')}: sink mass (rows: layer, columns: head); "
            f"sink rate {_rate_text(sink_flags(rows))} (Gu et al., eps 0.3, T = {int(rows['gu_window'].iloc[0])})"
        )
        print(grid.round(3).to_string())
        if "learned_sink_mass" in rows and rows["learned_sink_mass"].notna().any():
            learned = rows[rows["learned_sink_mass"].notna()]
            print(
                f"{subject.name}, {condition.replace('_', ' ')}: sinks that are no token (mass 1 - row sum, or 1 - the "
                "output scale; the sink rate above thresholds the first token only)"
            )
            print(
                learned.pivot_table(index=["block", "sink_kind"], columns="head", values="learned_sink_mass")
                .round(3)
                .to_string()
            )
    if logits is not None and not logits.empty:
        _print_learned_sinks(subject.name, logits)
    skipped = subject.info.get("not_applicable", {}).get("sink read")
    if skipped:
        print(f"{subject.name}: no sink read on {skipped}")
    if args.out:
        write_csv_atomic(table, f"{args.out}/sinks.csv")
        if table.empty:  # no block's sink can be read: nothing to draw
            print(f"wrote {args.out}/sinks.csv (no rows)")
            return 0
        record = {"name": subject.name, "position": subject.position, "kind": subject.kind}
        save_figure(sink_figure(table, every_condition=True, subjects={subject.name: record}), f"{args.out}/sinks")
        print(f"wrote {args.out}/sinks.csv and sinks.png/svg")
    return 0


def _print_learned_sinks(name: str, learned) -> None:
    """The learned sink logits of a model, named and per head (rows: block, columns: head)."""
    print(f"{name}: {learned_sink_line(learned)}; per head (rows: layer, columns: head):")
    print(learned.pivot_table(index="block", columns="head", values="sink_logit").round(3).to_string())


def _write_learned_sinks(learned, out: str) -> None:
    """learned_sinks.csv, for a model whose sinks.csv would have no row (a readable one's holds sink_logit)."""
    write_csv_atomic(learned, f"{out}/learned_sinks.csv")
    print(f"wrote {out}/learned_sinks.csv")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="text", choices=("text", "copy"), help="task of the default zoo models")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny run for smoke tests: 24 sequences of 32 tokens unless given, 50 "
        "bootstrap replicates, 4 folds, zoo models trained for 30 steps on batches of 4",
    )
    parser.add_argument("--n-sequences", type=int, help="evaluation sequences per model (default 80)")
    parser.add_argument("--seq-len", type=int, help="tokens per evaluation sequence (default 64)")
    parser.add_argument("--seed", type=seed_type, help="seed of sequences, pairs, controls and bootstrap (default 0)")
    add_quiet(parser, "training progress bars or progress lines")


def _runs(parser: argparse.ArgumentParser) -> None:
    add_seeds(
        parser,
        "each zoo model is trained, cached and measured once per seed; numbers are reported as mean "
        "and spread over seeds (default 0)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="measure models in this many local worker processes, one thread "
        "each (default: one per core this process may use; their training progress comes as "
        "lines; 1: in this process, with live bars)",
    )
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="a Dask scheduler (tls://HOST:8786, or tcp:// on a private network) to send the "
        "(model, seed) tasks to; workers run one thread each (--nthreads 1); needs pip install "
        '"nopelens[dask]"',
    )
    parser.add_argument(
        "--dask-security",
        metavar="FILE",
        help="YAML file in distributed's configuration format with the client's TLS settings "
        "(distributed: comm: tls: ca-file, client: cert, key) for a tls:// --scheduler; "
        "default: distributed's own configuration",
    )
    parser.add_argument("--svg", action="store_true", help="also save the figures as SVG (PNG always)")
    parser.add_argument(
        "--no-figures",
        action="store_true",
        help="write the tables and summary.md but draw no figures (faster; an earlier run's "
        "figures in the folder are removed; rerun without it to draw them)",
    )
    parser.add_argument(
        "--sites",
        metavar="KINDS",
        help=f"where absolute index is probed, a comma list of {', '.join(SITE_KINDS)} "
        f"(default {','.join(DEFAULT_SITES)}; resid is required; a run folder keeps its sites)",
    )
    parser.add_argument(
        "--metric",
        metavar="METRIC",
        help="what counts as recoverable: r2 (default for values), accuracy (default for classes), "
        "spearman, balanced_accuracy, within_one or mad (give its bar, in positions: --threshold "
        "mad=2); a bare metric applies to the reads of the task that reports it, TASK=METRIC names "
        "the task (e.g. classification=within_one)",
    )
    parser.add_argument(
        "--threshold",
        metavar="BAR",
        help="the bar each read's 95 %% CI must clear: a number for every read (default 0.9), or "
        "METRIC=BAR for one metric's reads (mad=2: the upper bound within 2 positions), comma "
        "separated; --metric and --threshold only re-read what was measured, so an existing run "
        "folder is summarized again in seconds",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the reads, the summary and the per-layer curves as JSON on stdout instead of tables",
    )


def register(subparsers) -> None:
    sweep_parser = subparsers.add_parser(
        "sweep",
        help="where absolute index and relative distance first become recoverable (the main job)",
        description="Probe every layer of a NoPE, a RoPE and a hybrid (RoPE, RoPE, RoPE, NoPE, as SmolLM3) text "
        "model and two Bigram-Backcopy models from the zoo (shipped with nopelens; trained on first use only where a "
        "copy is missing), the hand-built Theorem 1/2 circuit, and untrained NoPE models on random tokens and on "
        "constant input (one token id, no BOS), for absolute index and relative distance, with controls, attention "
        "sinks and variance shrinkage; write a run folder and print the summary.",
        epilog="examples:\n  nopelens sweep\n  nopelens sweep --quick --out runs/smoke\n"
        "  nopelens sweep --models text-nope-4l,text-rope-4l,text-learned-4l\n  nopelens sweep --task copy\n"
        "  nopelens sweep --models "
        "constant-nope,constant-rope,constant-alibi,constant-shaw,constant-rope+rope+rope+nope\n"
        "  nopelens sweep --seeds 0,1,2 --jobs 2\n"
        "  nopelens sweep --metric spearman --threshold 0.8     # re-reads a finished folder in seconds\n"
        "  nopelens sweep --json > sweep.json\n"
        "  nopelens sweep --scheduler tls://10.0.0.5:8786 --dask-security dask-tls.yaml",
    )
    sweep_parser.add_argument("--models", help=f"comma list of models; each a {MODEL_HELP}")
    sweep_parser.add_argument("--no-controls", action="store_true", help="leave out the circuit and untrained controls")
    sweep_parser.add_argument(
        "--out",
        help="run folder (default runs/sweep, or runs/sweep-quick with --quick, so "
        "the smoke test never meets the main job's folder); reruns resume",
    )
    _common(sweep_parser)
    _runs(sweep_parser)
    sweep_parser.set_defaults(func=run_sweep)

    probe_parser = subparsers.add_parser(
        "probe",
        help="probe one model (checkpoint, zoo name or HF directory) layer by layer",
        description="Run the sweep's probes, sinks and variance measurements on one model; print its summary "
        "and per-layer table (value [95 % CI] per layer) and write a run folder.",
        epilog="examples:\n  nopelens probe copy-nope-3l\n  nopelens probe runs/train/my-model\n"
        "  nopelens probe hf:/path/to/gpt2-dir --seq-len 32\n"
        "  nopelens probe hf:/path/to/smollm3-dir --text my.txt --seq-len 1024 --device cuda --dtype bfloat16 --plan\n"
        "  nopelens probe text-rope-4l --sites resid,attn_out,resid_mid,mlp_out --json > rope.json\n"
        "  nopelens probe text-nope-4l --metric mad --threshold mad=2",
    )
    probe_parser.add_argument("model", help=MODEL_HELP)
    probe_parser.add_argument("--out", help="run folder (default runs/probe-<model>)")
    hf = probe_parser.add_argument_group(
        "hf:DIR models",
        "read through the streaming engine: statistics accumulate while the model runs, so memory does "
        "not grow with the number of tokens",
    )
    _add_input_options(hf)
    hf.add_argument(
        "--batch-size",
        type=_batch_size,
        help="sequences per forward pass, or auto (default: 32, or "
        "fewer where a forward pass of 32 would not fit half the memory free on the device)",
    )
    hf.add_argument(
        "--keep-mib",
        type=int,
        help="MiB of features kept for the probes' predictions instead of a second forward pass (default: 512 or "
        "a quarter of the memory the run may use, whichever is less, leaving room for the largest site's "
        "statistics; 0: none, two passes, memory bounded by the statistics)",
    )
    hf.add_argument(
        "--memory-mib",
        type=int,
        help="MiB the run may add on the device (default: what is free there when it starts); sites whose "
        "statistics do not fit half of it together run in groups, a run each, with the same numbers",
    )
    hf.add_argument(
        "--layers",
        type=_blocks,
        metavar="BLOCKS",
        help="probe only these blocks, e.g. 0,4-7,12 (default: every block): each one's input and output "
        "residual stream, attention and MLP outputs, q.k and score reads, sinks, variance and sink ablation; "
        "each forward pass stops after the deepest",
    )
    hf.add_argument(
        "--no-sink-ablation",
        action="store_true",
        help="skip the sink ablation (block l's first key removed, layer l + 1 probed again: about n_layers / 2 "
        "extra forward passes; on by default, as in the sweep)",
    )
    hf.add_argument(
        "--plan", action="store_true", help="print the forward passes, tokens, memory and ETA the run needs, and exit"
    )
    _common(probe_parser)
    _runs(probe_parser)
    probe_parser.set_defaults(func=run_probe)

    sinks_parser = subparsers.add_parser(
        "sinks",
        help="attention-sink mass and rate per layer and head, with and without BOS",
        description="Measure attention sinks of one model: mean attention on the first token per layer and head, "
        "and Gu et al.'s sink rate, with and without a BOS token.",
        epilog="examples:\n  nopelens sinks text-nope-4l\n  nopelens sinks circuit --out runs/sinks",
    )
    sinks_parser.add_argument("model", help=MODEL_HELP)
    sinks_parser.add_argument("--out", help="also write sinks.csv and a heatmap here")
    _add_input_options(sinks_parser.add_argument_group("hf:DIR models"))
    _common(sinks_parser)
    sinks_parser.set_defaults(func=run_sinks)
