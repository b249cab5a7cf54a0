"""Options shared by the commands, so each is spelled, parsed and explained one way.

- ``--seeds 0,1,2``: training seeds, a comma list (:func:`add_seeds`, :func:`parse_seeds`);
- ``--quiet``: no progress bars or progress lines (:func:`add_quiet`; ``--no-progress`` is its
  former name in ``train`` and ``lengthgen`` and still works);
- a model spec (:data:`MODEL_HELP`): what ``probe``, ``sinks``, ``intervene`` and ``sweep
  --models`` accept;
- ``--threads N``: torch and BLAS threads while training, default 1 (:func:`add_threads`).

This module imports no torch at import time: ``nopelens --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import textwrap

MODEL_HELP = (
    "zoo name (see `nopelens train --list`), checkpoint directory, hf:DIR (local HF model), "
    "factory:FILE.py:FUNCTION or factory:package.module:FUNCTION (your own torch module, hooked with no map), "
    "circuit, untrained-nope or constant-METHOD (constant input, no BOS; e.g. constant-nope, "
    "constant-rope+rope+rope+nope)"
)
"""What a model spec may be (see :mod:`nopelens.analyses.subjects`)."""


MAX_SEED = 2**63 - 1
"""The largest seed: torch's generators unpack a seed as a signed 64-bit integer."""


def seed_type(text: str) -> int:
    """``--seed``: an integer in ``0..MAX_SEED`` (argparse names the option in its error).

    >>> seed_type("7")
    7
    """
    try:
        seed = int(text)
    except ValueError:
        seed = None
    if seed is None or not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is an integer in 0..{MAX_SEED}, got {text!r}")
    return seed


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``.

    >>> parse_seeds("0, 1,2")
    (0, 1, 2)

    Raises:
        ValueError: on anything but a comma list of integers in ``0..MAX_SEED``, an empty list or item,
            or a seed listed twice.
    """
    parts = text.split(",")
    if not text.strip():
        raise ValueError("--seeds lists no seed")
    if not all(part.strip() for part in parts):  # "1,,2" or "1,": a seed left out by mistake?
        raise ValueError(f"--seeds has an empty item: {text!r}")
    try:
        seeds = tuple(int(part) for part in parts)
    except ValueError:
        raise ValueError(f"--seeds takes a comma list of integers such as 0,1,2, got {text!r}") from None
    if not all(0 <= seed <= MAX_SEED for seed in seeds):
        raise ValueError(f"--seeds takes integers in 0..{MAX_SEED}, got {text!r}")
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds lists a seed twice: {text!r}")
    return seeds


def _seeds_type(text: str) -> tuple[int, ...]:
    try:
        return parse_seeds(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_seeds(parser: argparse.ArgumentParser, help: str, default: tuple[int, ...] | None = None) -> None:
    """``--seeds 0,1,2``, parsed to a tuple of ints (``default`` when not given)."""
    shown = "" if default is None else f" (default {','.join(map(str, default))})"
    parser.add_argument(
        "--seeds",
        type=_seeds_type,
        default=default,
        metavar="0,1,2",
        help=f"training seeds, a comma list{shown}: {help}",
    )


def add_quiet(parser: argparse.ArgumentParser, what: str = "progress bars and progress lines") -> None:
    """``--quiet`` (also ``--no-progress``, its former name in some commands): ``args.quiet``."""
    parser.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help=f"no {what}")


MAX_THREADS = 1024
"""The most ``--threads`` takes (or the machine's core count, if larger): beyond, starting the
threads fails in the C library before a step is taken."""


def _threads(text: str) -> int:
    """``--threads``: an integer in [1, max(MAX_THREADS, cores)]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    most = max(MAX_THREADS, os.cpu_count() or 1)
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be between 1 and {most}, got {value}")
    return value


def add_threads(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch and BLAS threads for training (default 1, part of the recipe)."""
    parser.add_argument(
        "--threads",
        type=_threads,
        default=1,
        help="torch and BLAS threads while training (default 1: the same recipe and seed give the "
        "same weights on any machine, and one thread is fastest for these small models on a shared "
        "CPU; the weights depend on the count, so it is part of the recipe)",
    )


PLACEMENT_OPTIONS = ("device_map", "max_memory", "offload_folder")


def add_placement(group) -> None:
    """``--device-map``, ``--max-memory`` and ``--offload-folder`` of an HF model larger than one
    device (:class:`nopelens.models.placement.Placement`, read by
    :func:`~nopelens.analyses.cli.placement.placement_of`)."""
    group.add_argument(
        "--device-map",
        metavar="MAP",
        help="spread the model over devices and disk with accelerate: "
        "auto (fill the GPUs, then the CPU, then disk), balanced (even over the GPUs), sequential, or a "
        'JSON file mapping module names to devices ({"model.layers.0": 0, "model.layers.1": "cpu", '
        "...}; devices: a GPU index, cpu or disk); instead of --device",
    )
    group.add_argument(
        "--max-memory",
        metavar="BUDGETS",
        help="with --device-map: the weights each device may hold, "
        "e.g. cpu=200MiB,0=70GiB (default: what is free on each); what does not fit goes to disk",
    )
    group.add_argument(
        "--offload-folder",
        metavar="DIR",
        help="with --device-map: needed when the map places weights "
        "on disk; transformers reads them from the checkpoint's safetensors where it can, and writes "
        "here those it must convert (created if missing; needs room for them)",
    )


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps a description's or epilog's line breaks but wraps each line to the help's width (100
    columns at most); a wrapped command example continues with a backslash, so it still pastes."""

    def __init__(self, prog: str, **kwargs) -> None:
        kwargs.setdefault("width", min(100, argparse.HelpFormatter(prog)._width + 2))
        super().__init__(prog, **kwargs)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(_wrap_line(indent + line, width) for line in text.splitlines())

    def _split_lines(self, text: str, width: int) -> list[str]:
        # an option's help wraps at spaces only: a model name such as text256-nope-6l stays whole
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


def _wrap_line(line: str, width: int) -> str:
    if len(line) <= width:
        return line
    lead = line[: len(line) - len(line.lstrip())]
    command = line.lstrip().startswith(("nopelens ", "python "))
    pieces = textwrap.wrap(
        line.strip(),
        width - len(lead) - (2 if command else 0),
        break_long_words=False,
        break_on_hyphens=False,
    )
    if command:
        return " \\\n".join(lead + ("" if i == 0 else "    ") + piece for i, piece in enumerate(pieces))
    return "\n".join(lead + piece for piece in pieces)
