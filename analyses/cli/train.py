"""``nopelens train``: train a decoder on a task (or a zoo model) and save a checkpoint.

Examples::

    nopelens train --zoo copy-nope-3l            # train from the recipe, or load the cached run
    nopelens train --list                        # zoo names and recipes
    nopelens train --task copy --position rope --layers 3 --steps 600 --out runs/copy-rope
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from nopelens.analyses.runs import refuse_other_runs
from nopelens.models import POSITION_METHODS, DecoderConfig, zoo
from nopelens.models.checkpoint import METADATA_FILE, TrainedModel
from nopelens.models.tasks import TASKS, TextTask, make_task
from nopelens.models.text import CORPORA
from nopelens.models.threads import limited_threads
from nopelens.models.training import EVAL_STREAM, evaluate_exact_match, stream_seed, train

from .options import add_quiet, add_seeds, add_threads, seed_type


def report(trained: TrainedModel, progress: bool = False, threads: int = 1) -> str:
    """A few lines on a trained model: losses, time, and exact match or bits per character
    (measured on ``threads`` threads, with a bar over the lengths when ``progress``)."""
    meta, task = trained.metadata, trained.task
    losses = meta.get("final_losses", {})
    lines = [
        f"{task.name} / {trained.config.position_name}: {meta.get('steps')} steps, seed {meta.get('seed')}, "
        f"trained in {meta.get('train_seconds', float('nan')):.0f} s "
        f"with {meta.get('torch_threads', '?')} torch thread(s)",
        f"final loss (nats/token): train {losses.get('train', float('nan')):.4f}, "
        f"validation {losses.get('validation', float('nan')):.4f}",
    ]
    if isinstance(task, TextTask):
        bits = losses["validation"] / math.log(2)
        lines.append(
            f"validation: {bits:.3f} bits per byte, {bits * task.bytes_per_character():.3f} bits per character"
        )
    elif hasattr(task, "oracle_nats"):  # a stochastic chain: no exact match, a loss floor instead
        lines.append(backcopy_report(trained, task))
    else:
        with limited_threads(threads):
            table = evaluate_exact_match(trained, task, n=256, seed=1, progress=progress)
        inside = table.loc[table["in_distribution"], "exact_match"].mean()
        longer = table.loc[~table["in_distribution"], "exact_match"].mean()
        lines.append(f"exact match: {inside:.4f} on training lengths, {longer:.4f} on longer ones (up to 2x)")
    return "\n".join(lines)


def backcopy_report(trained: TrainedModel, task) -> str:
    """Loss against the task's floor and the back-copy accuracy after triggers, on 256 fresh sequences."""
    high = trained.metadata["train_lengths"][1]
    batch = task.sample(256, high, high, stream_seed(1, EVAL_STREAM, high))
    with torch.no_grad():
        logits = trained.model(batch.tokens).float()
    nats = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none")
    trigger = task.is_trigger(batch.tokens) & batch.loss_mask
    other = batch.loss_mask & ~trigger
    floor = task.oracle_nats(batch)
    others = f"other tokens: loss {nats[other].mean():.4f} nats against the chain's own {floor[other].mean():.4f}"
    if not bool(trigger.any()):  # too short for a trigger to be followed by a scored token
        return f"back-copy after triggers: none scored at length {high}; {others}"
    right = (logits.argmax(-1) == batch.targets)[trigger].float().mean()
    return f"back-copy after triggers: accuracy {right:.4f}, loss {nats[trigger].mean():.4f} nats; {others}"


def _run(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.list:
        for name in zoo.names():
            spec = zoo.recipe(name)
            cached = "cached" if zoo.is_cached(name, args.cache_dir) else "not cached"
            cached += ", shipped" if zoo.is_shipped(name) else ""
            print(f"{name:<24} {spec.description} [{spec.steps} steps; {cached}]")
        return 0
    seeds = _seeds(args)
    if args.zoo:
        if args.ship:  # before training: a refusal after minutes of it would lose them
            zoo.check_source_checkout()
        if args.threads != 1:
            raise ValueError(
                f"--threads {args.threads}: a zoo recipe trains on 1 thread (its weights depend on the "
                "count); use --task for a run of your own on more threads"
            )
        for seed in seeds:  # from the cache or the recipe, never the shipped copy: this command trains
            trained = zoo.load(args.zoo, cache_dir=args.cache_dir, progress=not args.quiet, seed=seed, shipped=False)
            print(report(trained, progress=not args.quiet))
            print(zoo.compare_with_shipped(trained, args.zoo, seed))
            if args.ship:
                print(f"shipped: {zoo.ship(args.zoo, args.cache_dir, seed)}")
        return 0
    if args.ship:
        raise ValueError("--ship goes with --zoo NAME")
    if not args.task or not args.out:
        raise ValueError("give --zoo NAME, --list, or both --task and --out")
    if (Path(args.out) / METADATA_FILE).is_file():  # the loss curve would overwrite the checkpoint's own
        raise ValueError(
            f"--out {args.out} is a checkpoint directory; give the folder to train into (its "
            "checkpoint goes in OUT/checkpoint)"
        )
    refuse_other_runs(args.out, "train")
    task_kwargs = {"path": args.text_file, "corpus": args.corpus or "help"} if args.task == "text" else {}
    if (args.text_file or args.corpus) and args.task != "text":
        raise ValueError(f"{'--text-file' if args.text_file else '--corpus'} only applies to --task text")
    if args.text_file and args.corpus:
        raise ValueError(f"give --text-file or --corpus, not both (--corpus {args.corpus} would not be read)")
    task = make_task(args.task, **task_kwargs)
    config = DecoderConfig(
        d_vocab=task.d_vocab,
        n_ctx=task.seq_len(2 * args.max_len),
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        position=args.position,
    )
    for seed in seeds:
        out = Path(args.out) if args.seeds is None else Path(args.out) / f"seed{seed}"
        trained = train(
            config,
            task,
            args.steps,
            batch_size=args.batch_size,
            min_len=args.min_len,
            max_len=args.max_len,
            lr=args.lr,
            seed=seed,
            checkpoint_dir=out / "checkpoint",
            out_dir=out,
            progress=not args.quiet,
            threads=args.threads,
        )
        print(report(trained, progress=not args.quiet, threads=args.threads))
        print(f"checkpoint: {out / 'checkpoint'}; loss curve: {out / 'loss_curve.csv'}")
    return 0


def _seeds(args: argparse.Namespace) -> tuple[int, ...]:
    if args.seeds is None:
        return (args.seed,)
    if args.seed != 0:
        raise ValueError("give --seed or --seeds, not both")
    return args.seeds


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a decoder on a task, or train/load a zoo model",
        description="Train a small decoder (AdamW, warmup + cosine, gradient clipping, fixed seed) "
        "and save a safetensors+JSON checkpoint; an interrupted run resumes from --out. With --zoo, "
        "train a named model from its recipe (or load the finished run from the cache) and say whether it equals the "
        "copy shipped with nopelens.",
        epilog="examples: nopelens train --zoo copy-nope-3l | nopelens train --zoo text-nope-4l --seeds 0,1,2 | "
        "nopelens train --task copy --position rope --steps 600 --out runs/copy-rope",
    )
    parser.add_argument("--zoo", help=f"a zoo model name ({', '.join(zoo.names())})")
    parser.add_argument("--list", action="store_true", help="list the zoo's models")
    parser.add_argument("--cache-dir", help=f"zoo cache (default ${zoo.CACHE_ENV} or ~/.cache/nopelens)")
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        metavar="TASK",
        help=f"the task to train on, with --out: one of {', '.join(sorted(TASKS))} (each is a class of "
        "nopelens.models.tasks, whose docstring says what it asks)",
    )
    parser.add_argument("--text-file", help="UTF-8 corpus for --task text (default: CPython's help texts)")
    parser.add_argument(
        "--corpus",
        choices=sorted(CORPORA),
        default=None,
        help="built-in corpus for --task text: help (CPython's help texts, 440 KB; the default) or python_docs "
        "(those and the standard library's docstrings, 2.6 MB)",
    )
    parser.add_argument("--out", help="output folder (checkpoint/ and loss_curve.csv)")
    parser.add_argument(
        "--position",
        default="nope",
        choices=POSITION_METHODS,
        help="position method of every layer (default %(default)s)",
    )
    parser.add_argument("--layers", type=int, default=3, help="n_layers, transformer blocks (default %(default)s)")
    parser.add_argument("--d-model", type=int, default=64, help="d_model, residual stream width (default %(default)s)")
    parser.add_argument(
        "--heads",
        type=int,
        default=4,
        help="n_heads, attention heads per block; d_head = d_model / n_heads (default %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step (default %(default)s)")
    parser.add_argument(
        "--min-len",
        type=int,
        default=1,
        help="shortest training problem size, in the task's units (default %(default)s)",
    )
    parser.add_argument(
        "--max-len",
        type=int,
        default=10,
        help="longest training problem size; n_ctx fits twice it (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak AdamW learning rate, warmup then cosine decay (default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=seed_type, default=0, help="seed of the weights and the training batches (default %(default)s)"
    )
    add_seeds(parser, "train once per seed; zoo models are cached per seed, --task runs go to --out/seed<N>")
    add_threads(parser)
    add_quiet(parser, "training progress bar")
    parser.add_argument(
        "--ship",
        action="store_true",
        help="with --zoo, in a source checkout: copy the trained "
        "model into the package's shipped models (nopelens/models/shipped/), for maintainers",
    )
    parser.set_defaults(func=_run)
