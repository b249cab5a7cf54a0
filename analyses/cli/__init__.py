"""The ``nopelens`` command line: one subcommand per analysis, thin over :mod:`nopelens.analyses`.

Each subcommand lives in its own module of this package, which exposes ``register(subparsers)``;
the module adds its parser (with the shared options of :mod:`.options`) and sets ``func`` to a
callable taking the parsed args and returning an exit code. Command modules parse, call the
analyses and print; the analyses never import this package.
Exit codes: 0 when the command passed, 1 when a step it checks failed (``audit``), 2 on bad input or
an unsupported model (one line on stderr, no traceback), 3 on an internal error (a bug in
nopelens: one line saying so, where it happened and where to report it; ``NOPELENS_TRACEBACK=1``
shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import traceback
from typing import Callable

from .options import HelpFormatter

COMMAND_MODULES = (
    "nopelens.analyses.cli.sweep",
    "nopelens.analyses.cli.demo",
    "nopelens.analyses.cli.train",
    "nopelens.analyses.cli.lengthgen",
    "nopelens.analyses.cli.circuit",
    "nopelens.analyses.cli.audit",
    "nopelens.analyses.cli.intervene",
    "nopelens.analyses.cli.validate",
    "nopelens.analyses.cli.dynamics",
    "nopelens.analyses.cli.extreme_tokens",
    "nopelens.analyses.cli.compare",
)

COMMANDS = {
    "sweep": (
        "nopelens.analyses.cli.sweep",
        "where absolute index and relative distance first become recoverable (the main job)",
    ),
    "probe": ("nopelens.analyses.cli.sweep", "probe one model (checkpoint, zoo name or HF directory) layer by layer"),
    "sinks": ("nopelens.analyses.cli.sweep", "attention-sink mass and rate per layer and head, with and without BOS"),
    "demo": ("nopelens.analyses.cli.demo", "build one model per position method and print its hook names"),
    "train": ("nopelens.analyses.cli.train", "train a decoder on a task, or train/load a zoo model"),
    "lengthgen": (
        "nopelens.analyses.cli.lengthgen",
        "train each position method on short problems, test exact match on longer ones (Kazemnejad et al. 2023)",
    ),
    "circuit": (
        "nopelens.analyses.cli.circuit",
        "hand-built NoPE circuits (Kazemnejad et al. 2023) and seed demos, with checks and a figure",
    ),
    "audit": ("nopelens.analyses.cli.audit", "the ten-step position audit of a model (docs/audit.md)"),
    "intervene": (
        "nopelens.analyses.cli.intervene",
        "causal tests: does the probed position come from the attention sink, and is it used?",
    ),
    "validate": ("nopelens.analyses.cli.validate", "the known-answer suite: models where theory fixes every number"),
    "dynamics": ("nopelens.analyses.cli.dynamics", "follow position probes and attention sinks through training"),
    "extreme-tokens": (
        "nopelens.analyses.cli.extreme_tokens",
        "active-dormant heads, value-state drains and residual-state peaks (Guo et al. 2024)",
    ),
    "compare": (
        "nopelens.analyses.cli.compare",
        "side by side with a paper: Haviv et al. 2022's position probe across NoPE, learned, sinusoidal, "
        "ALiBi and RoPE",
    ),
}
"""Subcommand -> (module that registers it, its line in ``nopelens --help``). The CLI imports only
the module of the command it runs, and none for ``nopelens --help``: the modules import torch and
TransformerLens, seconds of start-up. A command missing here still works (every module is then
imported); the tests check this table against what the modules register."""

USER_ERRORS = (ValueError, KeyError, TypeError, OSError)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (the examples use it too), and help
    that keeps its line breaks within 100 columns (:class:`~nopelens.analyses.cli.options.HelpFormatter`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


_Parser = OneLineParser


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; given ``argv``, only what that command needs is imported (see :data:`COMMANDS`)."""
    parser = _Parser(
        prog="nopelens",
        description="Where does a transformer know where a token is? Probes, sinks and circuits "
        "for NoPE, RoPE, ALiBi, learned and sinusoidal decoders.",
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND", help="one of these, then its own --help"
    )
    command = next((arg for arg in argv if not arg.startswith("-")), None) if argv is not None else None
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command][0]).register(_Only(subparsers, command))
    elif argv is not None and command is None:  # `nopelens --help` or no command: list them, import nothing
        for name, (_, text) in COMMANDS.items():
            subparsers.add_parser(name, help=text)
    else:
        for name in COMMAND_MODULES:
            importlib.import_module(name).register(subparsers)
    return parser


class _Only:
    """The subparsers action, letting a module register only ``command`` of its subcommands."""

    def __init__(self, subparsers, command: str):
        self.subparsers, self.command = subparsers, command

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if name == self.command:
            return self.subparsers.add_parser(name, **kwargs)
        return argparse.ArgumentParser(add_help=False)  # a sibling command, not run now: discarded


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code. SIGTERM (``kill``, ``timeout``) ends it as Ctrl-C
    does: what it claimed is released, workers are stopped, one line says so."""
    previous = _terminate_as_interrupt()
    try:
        try:  # building the parser imports the command's modules (torch, pandas): seconds a Ctrl-C may land in
            with _sigterm_held():
                args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
        except KeyboardInterrupt:
            print("nopelens: interrupted before the command started; nothing was written", file=sys.stderr)
            return 130
        if isinstance(getattr(args, "out", None), str) and not args.out.strip():
            # Path("") is the working directory: a run would write its tables among the user's files
            print(f"nopelens {args.command}: error: --out is empty: name the run folder", file=sys.stderr)
            return 2
        return guarded(lambda: args.func(args), f"nopelens {args.command}")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_held():
    """Hold SIGTERM back while modules import, and deliver it (as KeyboardInterrupt) at the end.

    An interrupt raised inside an import's ``__del__`` or lock callback is printed as "Exception
    ignored" and lost, and the command would run on to the end; held back, it lands here instead.
    """
    hold = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    if hold:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _terminate_as_interrupt():
    """Make SIGTERM raise KeyboardInterrupt in this (main) thread; the handler it replaces (None
    where signals cannot be set here)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        return None


def guarded(run: Callable[[], int | None], label: str) -> int:
    """Call ``run()`` and turn what it raises into the CLI's exit codes, each with one line on
    stderr that starts with ``label``: 2 for bad input or an unsupported model (:data:`USER_ERRORS`,
    or out of memory), 3 for an internal error (a bug; ``NOPELENS_TRACEBACK=1`` re-raises it),
    130 for an interrupt. The examples in ``examples/`` end the same way (``sys.exit(guarded(...))``).

    Returns:
        ``run()``'s exit code when it returns an int (0 for anything else, such as the paths an
        example wrote), or the code of what it raised.
    """
    try:
        code = run()
        return code if isinstance(code, int) and not isinstance(code, bool) else 0
    except KeyboardInterrupt:
        print(f"{label}: interrupted; rerun the same command to resume from what it wrote", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        if os.environ.get("NOPELENS_TRACEBACK"):
            raise
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{label}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 2
    except (MemoryError, Exception) as error:  # anything else is a bug: one line, never a traceback
        if os.environ.get("NOPELENS_TRACEBACK"):
            raise
        if _is_out_of_memory(error):
            lines = str(error).strip().splitlines()
            detail = f" ({lines[-1][:200]})" if lines else ""
            print(f"{label}: error: out of memory{detail}; use smaller lengths, sizes or counts", file=sys.stderr)
            return 2
        if _is_disk_full(error):
            print(
                f"{label}: error: no space left on the device written to ({_first_line(error)}); free some, or "
                "write elsewhere (--out)",
                file=sys.stderr,
            )
            return 2
        print(
            f"{label}: internal error: {type(error).__name__}: {_first_line(error)} "
            f"(at {_where(error)}); this is a bug in nopelens: please report it with the command line to "
            f"{REPORT_TO} (rerun with NOPELENS_TRACEBACK=1 for the traceback)",
            file=sys.stderr,
        )
        return 3


REPORT_TO = "the nopelens issue tracker (`issues` in the nopelens repository)"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else "(no message)"


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown place"
    last = frames[-1]
    return f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}"


def _is_out_of_memory(error: BaseException) -> bool:
    """True for a failed allocation (torch raises RuntimeError for CPU, OutOfMemoryError for GPU)."""
    text = str(error)
    return (
        isinstance(error, MemoryError)
        or "out of memory" in text.lower()
        or "can't allocate memory" in text
        or "std::bad_alloc" in text
    )


def _is_disk_full(error: BaseException) -> bool:
    """True for a write that found the device full (safetensors raises its own error class for it)."""
    return "No space left on device" in str(error)
