"""The ``nopelens`` command line: one subcommand per analysis.

Each subcommand lives in its own module, which exposes ``register(subparsers)``; the module adds
its parser and sets ``func`` to a callable taking the parsed args and returning an exit code.
Errors a user can cause (bad arguments, missing files, invalid input) become one line on stderr
and exit code 2, with no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "nopelens.analyses.sweep_cmd",
    "nopelens.analyses.demo",
    "nopelens.analyses.train_cmd",
    "nopelens.analyses.lengthgen",
    "nopelens.analyses.circuit_cmd",
    "nopelens.analyses.audit_cmd",
    "nopelens.analyses.intervene_cmd",
    "nopelens.analyses.validate",
)

USER_ERRORS = (ValueError, KeyError, TypeError, OSError)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nopelens",
        description="Where does a transformer know where a token is? Probes, sinks and circuits "
        "for NoPE, RoPE, ALiBi, learned and sinusoidal decoders.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("nopelens: interrupted; results written so far are kept, rerun to resume", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"nopelens {args.command}: error: {message}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as error:
        if not _is_out_of_memory(error):
            raise
        print(f"nopelens {args.command}: error: out of memory ({str(error).strip().splitlines()[-1][:200]}); "
              "use smaller lengths, sizes or counts", file=sys.stderr)
        return 2


def _is_out_of_memory(error: BaseException) -> bool:
    """True for a failed allocation (torch raises RuntimeError for CPU, OutOfMemoryError for GPU)."""
    text = str(error)
    return isinstance(error, MemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text
