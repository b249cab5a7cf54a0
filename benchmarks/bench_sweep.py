"""The sweep's own time against its goals (issue 13 §2), measured side by side in one run.

Runs each case as the user would, ``nopelens ...`` in a fresh process (imports included), into a
fresh run folder (``OMP_NUM_THREADS=1``; each sweep task runs on one thread anyway):

- ``help``: ``nopelens --help`` (start-up);
- ``quick``: ``nopelens sweep --quick`` (trains its three 30-step models, not cached);
- ``cached``: the default ``nopelens sweep`` with the zoo models already in the cache;
- ``fresh``: the default sweep into an empty cache (trains the three text models; ``--skip-fresh``
  leaves it out, it takes minutes).

For each it prints the wall time, the CPU time of the process (user + system, from
``resource.getrusage(RUSAGE_CHILDREN)``), the load average when it started, and the ratio of each
to the goal. On a shared machine the wall time measures the contention as much as the sweep; the
CPU time is close to the wall time on one idle core.

Usage::

    python benchmarks/bench_sweep.py [--skip-fresh] [--jobs N]

Without ``--jobs`` the sweeps run with the CLI's default: one worker per core this process may
use (two on the 2-core machines of the goals), each on one thread.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT_MODELS = ("text-nope-4l", "text-rope-4l", "text-hybrid-4l")
"""The zoo models of the default sweep (``nopelens.analyses.sweep.DEFAULT_MODELS["text"]``, not
imported here so that this script starts nothing heavy before its first measurement)."""

GOALS_S = {"help": 1.0, "quick": 15.0, "cached": 20.0, "fresh": 150.0}
"""Wall-time goals on 2 cores (issue 13 §2); ``help`` is ours (no torch import)."""


def nopelens(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from nopelens.analyses.cli import main; sys.exit(main())", *args]


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s, CPU s, load average) of one command run to completion; raises on failure."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-fresh", action="store_true", help="leave out the fresh-cache default sweep")
    parser.add_argument("--jobs", type=int, help="--jobs of the sweeps (default: the CLI's, one per usable core)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    jobs = (["--jobs", str(args.jobs)] if args.jobs else []) + ["--quiet"]
    scratch = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    cases = {
        "help": (nopelens("--help"), env),
        "quick": (nopelens("sweep", "--quick", "--out", str(scratch / "quick"), *jobs), env),
        "cached": (nopelens("sweep", "--out", str(scratch / "cached"), *jobs), env),
    }
    if not args.skip_fresh:
        fresh_env = dict(env, NOPELENS_CACHE=str(scratch / "cache"))
        cases["fresh"] = (nopelens("sweep", "--out", str(scratch / "fresh"), *jobs), fresh_env)
    try:
        for name in TEXT_MODELS:  # "cached" means cached: fill the cache first
            subprocess.run(nopelens("train", "--zoo", name, "--threads", "1", "--quiet"), env=env,
                           check=True, stdout=subprocess.DEVNULL)
        print(f"cores usable: {len(os.sched_getaffinity(0))}; sweep workers: {args.jobs or 'CLI default (one per core)'}")
        print(f"{'case':<8} {'wall s':>8} {'CPU s':>8} {'load':>6} {'goal s':>7} {'wall/goal':>10} {'CPU/goal':>9}")
        for name, (command, case_env) in cases.items():
            wall, cpu, load = timed(command, case_env)
            goal = GOALS_S[name]
            print(f"{name:<8} {wall:8.1f} {cpu:8.1f} {load:6.1f} {goal:7.0f} {wall / goal:10.2f} {cpu / goal:9.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
