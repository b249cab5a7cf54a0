"""``nopelens audit``: seed 002's ten-step position audit of one model, from the command line.

The model comes from exactly one of: a nopelens checkpoint directory (``--checkpoint``), a zoo
name or the user's own factory (``--model``: ``factory:FILE.py:FUNCTION`` or
``factory:package.module:FUNCTION``, hooked by :func:`~nopelens.models.anymodel.hook_any`, which prints
the map it chose to stderr), a local HF model directory (``--hf-dir``, loaded offline and bridged through
TransformerLens), or a fresh random Decoder of a position method (``--position``, a demo that
needs no training). The one-screen summary goes to stdout; ``--out DIR`` also writes
``report.md`` and ``audit.json`` there, atomically. Exit code 0 when no step fails, 1 when a step
fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nopelens.analyses.audit import AuditReport, audit
from nopelens.analyses.factory import FACTORY_PREFIX
from nopelens.analyses.subjects import load_checkpoint_dir
from nopelens.models import Decoder, DecoderConfig, zoo
from nopelens.models.anymodel import hook_any, load_factory
from nopelens.models.hf import UnsupportedModelError
from nopelens.models.hf_loading import load_hf_dir
from nopelens.models.io import check_writable
from nopelens.probes.sinks import learned_sink_line, learned_sink_logits

from .options import PLACEMENT_OPTIONS, add_placement, add_quiet, seed_type
from .placement import placement_of


def load_subject(args: argparse.Namespace) -> tuple[Any, str]:
    """The model the arguments name, and its label.

    Raises:
        FileNotFoundError: if a checkpoint or HF directory does not exist.
        ValueError: on an invalid checkpoint, an unknown zoo name or position method, a factory that fails
            or builds a model hook_any cannot map.
    """
    if args.checkpoint:
        return load_checkpoint_dir(Path(args.checkpoint)), f"checkpoint {args.checkpoint}"
    if args.model and args.model.startswith(FACTORY_PREFIX):
        return hook_any(load_factory(args.model[len(FACTORY_PREFIX) :])), f"factory {args.model[len(FACTORY_PREFIX) :]}"
    if args.model:
        return zoo.load(args.model, progress=not args.quiet), f"zoo model {args.model}"
    if args.hf_dir:
        return load_hf_dir(Path(args.hf_dir), placement=placement_of(args)), f"HF model {args.hf_dir}"
    return _fresh_decoder(args.position, args.eval_length, args.seed), f"random Decoder({args.position})"


def _fresh_decoder(position: str, eval_length: int, seed: int) -> Any:
    """A random 2-layer Decoder; ``position`` is a method or a comma list (one per layer)."""
    methods = [m.strip() for m in position.split(",")]
    spec: str | list[str] = methods[0] if len(methods) == 1 else methods
    n_layers = 2 if len(methods) == 1 else len(methods)
    config = DecoderConfig(
        d_vocab=64, n_ctx=max(64, eval_length), n_layers=n_layers, d_model=32, n_heads=4, position=spec
    )
    return Decoder(config, seed=seed)


def exit_code(report: AuditReport) -> int:
    """0 when no step failed, 1 otherwise."""
    return 0 if report.passed else 1


def run(args: argparse.Namespace) -> int:
    if args.eval_length < 4:
        raise ValueError(f"--eval-length must be >= 4, got {args.eval_length}")
    given = [name for name in PLACEMENT_OPTIONS if getattr(args, name) is not None]
    if given and not args.hf_dir:
        raise ValueError(f"--{given[0].replace('_', '-')} applies to --hf-dir models")
    if args.out:  # before the model loads: a file where the folder should be
        check_writable(Path(args.out) / "report.md")
    try:
        model, label = load_subject(args)
    except UnsupportedModelError as error:  # no pattern to audit; the learned sink logits are still named
        line = learned_sink_line(learned_sink_logits(getattr(error, "sink_parameters", {})))
        if line:
            print(f"nopelens audit: {args.hf_dir}: {line} (per head: nopelens sinks)")
        raise
    train_lengths = args.train_lengths
    report = audit(
        model, eval_length=args.eval_length, train_lengths=train_lengths, shift=args.shift, seed=args.seed, name=label
    )
    print(report.summary())
    if args.out:
        md, js = report.write(args.out)
        print(f"wrote {md} and {js}")
    return exit_code(report)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="the ten-step position audit of a model (docs/audit.md)",
        description="Run seed 002's ten-step position audit (token and position ids, origin and "
        "sign, masks vs biases, absolute additions, rotations and lookups, score parts, softmax, "
        "interventions, cached decoding, training lengths). Exit code 0 when no step fails, 1 "
        "when one does, 2 on bad input.",
        epilog="examples: nopelens audit --position rope --out runs/audit-rope; "
        "nopelens audit --checkpoint runs/copy-rope; nopelens audit --hf-dir ./tiny-gpt2; "
        "nopelens audit --model factory:mymodel.py:make_model",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a nopelens checkpoint directory")
    source.add_argument(
        "--model",
        metavar="NAME",
        help="a zoo model name, or factory:FILE.py:FUNCTION / "
        "factory:package.module:FUNCTION (your own torch module, hooked with no map)",
    )
    source.add_argument("--hf-dir", metavar="DIR", help="a local HF causal LM directory (offline)")
    source.add_argument(
        "--position",
        metavar="METHOD",
        help="audit a fresh random Decoder of this method (nope, learned, sinusoidal, "
        "rope, alibi, shaw, t5) or per-layer list such as nope,rope",
    )
    parser.add_argument("--eval-length", type=int, default=16, help="probe length in tokens (default 16)")
    parser.add_argument(
        "--train-lengths",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="training lengths, overriding the checkpoint metadata",
    )
    parser.add_argument("--shift", type=int, default=3, help="constant added to positions in step 8")
    parser.add_argument("--seed", type=seed_type, default=0, help="seed of the probe tokens (and of --position)")
    parser.add_argument("--out", metavar="DIR", help="write report.md and audit.json here")
    add_placement(parser.add_argument_group("--hf-dir models larger than one device"))
    add_quiet(parser, "training progress bar (a zoo model that is neither cached nor shipped trains first)")
    parser.set_defaults(func=run)
