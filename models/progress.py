"""Progress bars that suit where they go: every nopelens progress bar comes from :func:`progress_bar`.

On a terminal (or in a notebook) a bar is tqdm's live bar. When the stream is a file or a pipe
(CI, ``nohup``, a job scheduler, ``nopelens sweep > log 2>&1``), a live bar's redraws would pile up
as thousands of carriage-return "lines"; there the bar writes one plain line at most every
:data:`LOG_INTERVAL` seconds, plus its final state.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import IO, Iterable

from tqdm import std
from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as _autonotebook_tqdm

LOG_INTERVAL = 5.0
"""Seconds between two progress lines written to a file or a pipe."""

LOG_COLUMNS = 100
"""Widest progress line written to a file or a pipe (tqdm shortens the bar, then trims the line)."""

_CURSOR_MOVES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _LineStream:
    """Turns tqdm's redraws (``\\r`` + the bar + padding, cursor moves of nested bars) into lines."""

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def write(self, text: str) -> None:
        line = _CURSOR_MOVES.sub("", text).replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LogBar(std.tqdm):
    """tqdm whose postfix and description wait for the next timed line instead of forcing one."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_description(self, desc=None, refresh=True):
        super().set_description(desc, refresh=False)

    def close(self):
        if "disable" not in vars(self):  # interrupted (Ctrl-C, SIGTERM) inside __init__: nothing to close
            return
        if not self.disable and self.last_print_n == self.n:
            self.leave = False  # the last line written already shows the final count
        super().close()


_LINES_ONLY = False


def lines_only() -> None:
    """Make every later bar of this process write timed plain lines, even on a terminal, and guard
    them with a thread lock.

    For worker processes that share their parent's terminal: live bars of several processes would
    overwrite each other's lines. tqdm's default lock holds a multiprocessing semaphore, which a
    worker ended mid-task (an interrupted run) leaves behind: multiprocessing's resource tracker
    then warns, under the run's one line, that it leaked.
    """
    global _LINES_ONLY
    _LINES_ONLY = True
    std.tqdm.set_lock(threading.RLock())


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is an interactive terminal."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(iterable: Iterable | None = None, *, file: IO[str] | None = None, **kwargs) -> tqdm:
    """A tqdm bar on ``file`` (default stderr): live on a terminal, a line every few seconds in a log
    (and everywhere after :func:`lines_only`).

    Args:
        iterable: what to iterate over, as for ``tqdm``.
        file: the stream; default ``sys.stderr``.
        **kwargs: ``tqdm`` arguments (``total``, ``desc``, ``disable``, ``leave``, ...). In a log,
            ``mininterval`` defaults to :data:`LOG_INTERVAL` and ``ncols`` to :data:`LOG_COLUMNS`,
            and the bar's last state is always
            left in place (``leave=True``).

    Returns:
        The ``tqdm`` instance (use ``update``, ``set_postfix``, ``close``, ``tqdm.write``).
    """
    stream = file if file is not None else sys.stderr
    notebook = _autonotebook_tqdm is not std.tqdm  # a notebook front end: its widget suits it
    if not _LINES_ONLY and (notebook or is_terminal(stream)):
        return tqdm(iterable, file=stream, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL)
    kwargs.setdefault("ncols", LOG_COLUMNS)
    kwargs.update(leave=True, dynamic_ncols=False, ascii=True, position=0)  # nested bars: lines, not cursor moves
    return _LogBar(iterable, file=_LineStream(stream), **kwargs)
