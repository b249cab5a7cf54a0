"""Progress bars suit where they go: live on a terminal, a line every few seconds in a log (issue 15)."""

import io

import pytest

from nopelens.models import progress
from nopelens.models.progress import LOG_INTERVAL, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_fast_loop_writes_only_a_few_lines_to_a_log():
    log = io.StringIO()
    for step in (bar := progress_bar(range(20_000), file=log, desc="train")):
        bar.set_postfix(loss=f"{1 / (step + 1):.4f}")  # tqdm redraws on each postfix unless told not to
    lines = log.getvalue().splitlines()
    assert LOG_INTERVAL >= 1 and 1 <= len(lines) <= 3, lines
    assert "\r" not in log.getvalue()
    assert lines[-1].startswith("train: 100%") and "20000/20000" in lines[-1]


def test_a_terminal_gets_the_live_bar():
    screen = Terminal()
    bar = progress_bar(total=20_000, file=screen, mininterval=0, miniters=1, leave=False)
    for _ in range(200):
        bar.update(1)
    bar.close()
    assert screen.getvalue().count("\r") >= 200  # redrawn in place


def test_a_slow_loop_in_a_log_writes_a_line_per_interval(monkeypatch):
    clock = iter(range(0, 10**6, 1))  # one second per step, through tqdm's own timer
    monkeypatch.setattr("tqdm.std.time", lambda: float(next(clock)))
    log = io.StringIO()
    for _ in progress_bar(range(60), file=log):
        pass
    lines = log.getvalue().splitlines()
    assert 60 / LOG_INTERVAL - 4 <= len(lines) <= 60 / LOG_INTERVAL + 4, len(lines)


def test_the_final_state_is_written_once(monkeypatch):
    clock = iter(range(0, 10**6, 60))  # a minute per step: every step is due a line
    monkeypatch.setattr("tqdm.std.time", lambda: float(next(clock)))
    log = io.StringIO()
    for _ in progress_bar(range(3), file=log):
        pass
    assert sum("3/3" in line for line in log.getvalue().splitlines()) == 1, log.getvalue()


def test_nested_bars_in_a_log_write_plain_lines():
    log = io.StringIO()
    for _ in progress_bar(range(3), file=log, desc="sweep", mininterval=0):
        inner = progress_bar(total=4, file=log, desc="train", leave=False, mininterval=0)
        for _ in range(4):
            inner.update(1)
        inner.close()
    text = log.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert all(line.startswith(("sweep", "train")) for line in text.splitlines())


def test_after_lines_only_a_terminal_gets_lines_too(monkeypatch):
    """Sweep workers share their parent's terminal: their bars must not redraw over each other."""
    import threading

    from nopelens.models import progress

    monkeypatch.setattr(progress, "_LINES_ONLY", False)
    monkeypatch.setattr(progress.std.tqdm, "_lock", progress.std.tqdm.get_lock(), raising=False)
    progress.lines_only()
    # a worker's bars hold no multiprocessing semaphore, which a worker ended mid-task would leak
    assert isinstance(progress.std.tqdm.get_lock(), type(threading.RLock()))
    screen = Terminal()
    for _ in progress_bar(range(20_000), file=screen, desc="train"):
        pass
    assert "\r" not in screen.getvalue()
    assert screen.getvalue().splitlines()[-1].startswith("train: 100%")


def test_a_log_line_is_at_most_100_columns_however_long_the_label():
    log = io.StringIO()
    bar = progress_bar(total=5120, file=log, desc="text-hybrid-4l: sink ablation, block 0: pass 1", unit_scale=True)
    bar.update(5120)
    bar.set_postfix(loss=1.234, tok_s="9,000")
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines and max(len(line) for line in lines) <= 100, lines
    assert lines[-1].startswith("text-hybrid-4l: sink ablation, block 0: pass 1: 100%")


def test_a_bar_interrupted_while_it_is_built_closes_quietly(monkeypatch):
    """Ctrl-C or SIGTERM inside tqdm's ``__init__`` leaves a half-built bar, which the garbage
    collector closes: that must not print "Exception ignored ... Traceback" under the run's one line."""
    import gc
    import sys

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(progress.std.tqdm, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        progress.progress_bar(range(3), file=io.StringIO())
    gc.collect()
    assert unraisable == []
