"""Benchmark: memory and time of streamed probes against today's in-memory path (issue 19).

Two measurements, side by side in one run, on random-init Llama-shaped HF models saved to a
temporary directory and loaded as ``nopelens probe hf:DIR`` loads them (offline, safetensors,
bridged by TransformerLens), with random token ids after BOS:

- **memory**: peak RSS of one process per case (``os.wait4`` of a child that loads the model and
  measures; nothing else runs in it) at 1x and 4x the sequences, d_model 384, 6 layers, 256 tokens,
  24 and 96 sequences by default. Cases: ``memory`` (:func:`~nopelens.probes.collect` of every site
  the probes read, then the in-memory probes), ``stream-keep-all`` (streamed, every batch's
  features kept until the fit: one forward pass), ``stream-keep-none`` (nothing kept: a second
  pass predicts; memory bounded), ``stream-default`` (the default keep budget of ``nopelens probe``:
  512 MiB or a quarter of the available memory; a run whose features do not all fit it keeps none
  and predicts in a second pass), and ``cli``: the command
  ``nopelens probe hf:DIR --input random`` itself, with all its defaults (sinks and figures too).
  The issue's target: 4x within 25 % of 1x.
- **time**: collection plus probes against the plain HF forward pass over the same tokens and
  batches (``model(tokens)``, logits included, eager attention as the bridge runs it; the SDPA time
  is printed too), d_model 512, 8 layers, 512 tokens, 32 sequences by default (``--time-sequences``: several
  counts, to see how the ratio moves with the tokens). Each case runs in
  its own process right after a plain forward pass and is divided by it (wall and CPU seconds), so
  a ratio compares two measurements made minutes apart on a shared machine. Probe sets:
  ``absolute`` (absolute index, classification over position bins and regression with the control
  task, shuffled labels, majority and token identity, at every residual layer) and ``sweep``
  (what the sweep measures per model: absolute index at every residual layer and every block's
  ``hook_attn_out``/``hook_mlp_out`` with the extrapolation split, relative distance from pair
  features at every residual layer, the bilinear q.k read and the score read of every block, and
  the attention-variance read). The issue's target: at most 1.5x the forward pass. With
  ``--main``, also the in-memory path with main's definitions before issue 19 (every position its
  own class, pairs at every distance).
- **depth** (``--only depth``): peak RSS and wall time of ``nopelens probe hf:DIR --input random
  --keep-mib 0`` (nothing kept, so every job of a run sums its statistics at once; no sink ablation,
  no figures) at 1x and 4x the layers (d_model 384, 6 and 24 layers, 128 tokens, 24 sequences), with
  the memory free and with ``--memory-mib`` (the jobs then run in groups whose statistics fit it,
  :func:`~nopelens.analyses.sweep.budget.statistics_groups`); the grouped tables are compared with the
  ungrouped ones (the largest difference of any number is printed).

Both paths probe the same definitions (classification over at most 64 position bins, pairs at 64
distances spread over the range), so the comparison is of the engines. Everything runs on one
thread (torch and BLAS), as nopelens measures. Not a test: it prints measured numbers.

    python benchmarks/bench_stream.py                    # both, the issue's shapes (tens of minutes)
    python benchmarks/bench_stream.py --quick            # a quick look at small shapes
    python benchmarks/bench_stream.py --only time --probes absolute
    python benchmarks/bench_stream.py --only time --time-sequences 32,96   # the trend with the tokens
    python benchmarks/bench_stream.py --only depth --memory-mib 384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

CASES = ("memory", "stream-keep-all", "stream-keep-none", "stream-default")
KEEP = {"stream-keep-all": None, "stream-keep-none": 0, "stream-default": "auto"}
"""Each streamed case's keep budget (``stream-default``: what ``nopelens probe hf:DIR`` uses, applied as
its plan applies it: every feature kept if all fit, else none, :func:`plan_keep`)."""
CLI_CASE = "cli"
"""Memory runs: ``nopelens probe hf:DIR --input random`` itself, as a user runs it (the issue's target)."""
MAIN_CASE = "memory-main"
"""The in-memory path with main's definitions before issue 19: every position its own class, pairs at
every distance (time runs only, with ``--main``)."""


def make_model_dir(directory: Path, d_model: int, n_layers: int, n_ctx: int, seed: int = 0) -> Path:
    """A random-init Llama (grouped-query attention, SwiGLU, RoPE, 32k vocabulary) saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    n_heads = d_model // 64
    config = LlamaConfig(
        hidden_size=d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=max(1, n_heads // 2),
        intermediate_size=int(8 * d_model / 3 // 64 * 64),
        vocab_size=32000,
        max_position_embeddings=max(n_ctx, 2048),
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


OUTER_FEATURES = 1024
"""The sweep's bound on the full outer-product q.k read (n_heads * d_head^2), above which it reads
the elementwise one."""


def probe_plan(subject, probes: str):
    """(absolute sites, inner sites, q/k pairs, score sites, variance sites, bilinear mode) of a probe
    set, chosen as the sweep chooses them: every block's outputs that fire, the rotated q/k where the
    layer rotates (else the plain ones), the scores where they hold the scores behind the pattern."""
    from nopelens.probes import resid_sites, site_block

    layers = subject.n_layers
    residual = resid_sites(layers)
    if probes == "absolute":
        return residual, [], [], [], [], "outer"

    def per_block(suffix: str) -> dict[int, str]:
        return {
            site_block(s): s
            for s in subject.model.hook_dict
            if s.endswith(suffix) and site_block(s) is not None and subject.usable(s)
        }

    outputs = (".hook_attn_out", ".hook_mlp_out")
    inner = [per_block(suffix)[l] for l in range(layers) for suffix in outputs if l in per_block(suffix)]
    rot_q, rot_k, q, k = (per_block(f".attn.hook_{name}") for name in ("rot_q", "rot_k", "q", "k"))
    qk = [(rot_q[l], rot_k[l]) if l in rot_q and l in rot_k else (q[l], k[l]) for l in range(layers)]
    scores = [] if not subject.hf.scores_hook else sorted(per_block(".attn.hook_attn_scores").values(), key=site_block)
    mode = "outer" if subject.hf.n_heads * subject.hf.d_head**2 <= OUTER_FEATURES else "elementwise"
    return residual, inner, qk, scores, [s for s in inner if s.endswith(outputs[0])], mode


def measure(
    case: str, model_dir: str, n_sequences: int, seq_len: int, probes: str, batch_size: int, n_boot: int
) -> dict:
    """Load the model, measure one case; the seconds of each stage."""
    import numpy as np
    import torch

    from nopelens.analyses.subjects import resolve
    from nopelens.probes import collect, probe_absolute_index, probe_relative_distance
    from nopelens.probes.sinks import attention_variance
    from nopelens.probes.stream import KeepBudget, Sequences, run
    from nopelens.probes.stream_probes import absolute_index_probes, relative_distance_probes
    from nopelens.probes.targets import spread_distances
    from nopelens.probes.variance import AttentionVariance

    torch.set_num_threads(1)
    subject = resolve(f"hf:{model_dir}", n_sequences, seq_len, seed=0, progress=False)
    residual, inner, qk, scores, variance_sites, mode = probe_plan(subject, probes)
    pairs = min(64, n_sequences)
    common = dict(n_splits=5, n_boot=n_boot, seed=0)
    extrapolate = seq_len // 2 if probes == "sweep" else None
    out = {}
    start, cpu = time.perf_counter(), time.process_time()
    sites = residual + inner + [s for pair in qk for s in pair] + scores
    with torch.no_grad():
        if case in ("memory", MAIN_CASE):
            exact = case == MAIN_CASE
            acts = collect(
                subject.model, subject.tokens, sites, attention_mask=subject.attention_mask, batch_size=batch_size
            )
            out["collect_s"] = time.perf_counter() - start
            tables = [
                probe_absolute_index(
                    acts,
                    sites=residual + inner,
                    extrapolate_from=extrapolate,
                    max_classes=None if exact else 64,
                    **common,
                )
            ]
            if probes == "sweep":
                tables.append(
                    probe_relative_distance(
                        acts,
                        sites=residual,
                        feature_kinds=("concat",),
                        attention=qk,
                        scores=scores,
                        bilinear=mode,
                        tasks=("regression",),
                        pairs_per_distance=pairs,
                        distances=None if exact else spread_distances(seq_len - 1, 64),
                        **common,
                    )
                )
                tables.append(attention_variance(acts, variance_sites))
        else:
            budget = KeepBudget(KEEP[case])
            sequences = Sequences.of(subject.tokens, subject.attention_mask)
            measurements = [
                absolute_index_probes(sequences, residual + inner, extrapolate_from=extrapolate, keep=budget, **common)
            ]
            if probes == "sweep":
                measurements.append(
                    relative_distance_probes(
                        sequences,
                        sites=residual,
                        feature_kinds=("concat",),
                        attention=qk,
                        scores=scores,
                        bilinear=mode,
                        tasks=("regression",),
                        pairs_per_distance=pairs,
                        keep=budget,
                        **common,
                    )
                )
                measurements.append(AttentionVariance(sequences, variance_sites))
            if case == "stream-default":
                budget.limit = plan_keep(subject, sequences, measurements[:2], sites, budget).limit
                out["kept"] = budget.limit is None
            tables = run(subject.model, sequences, measurements, batch_size=batch_size)
    out["total_s"], out["total_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    out["rows"] = int(sum(len(t) for t in tables))
    out["checksum"] = float(np.nansum(tables[0]["value"].to_numpy()))
    return out


def plan_keep(subject, sequences, probes, sites, budget):
    """The keep budget ``nopelens probe hf:DIR`` gives a run of these probes
    (:func:`nopelens.analyses.sweep.budget.run_budget`: every feature kept if all fit ``budget``, else none)."""
    from types import SimpleNamespace

    from nopelens.analyses.sweep import streamed
    from nopelens.probes.stream import available_memory

    shapes = streamed.site_shapes(subject, sites)
    probes = [probe for probe in probes if hasattr(probe, "jobs")]
    m = SimpleNamespace(
        all_probes=lambda: probes,
        sequences=sequences,
        budget=budget,
        free=available_memory(),
        activation_bytes=next(subject.model.parameters()).element_size(),
    )
    return streamed.run_budget(m, [job for probe in probes for job in probe.jobs], shapes)


def forward_seconds(
    model_dir: str, n_sequences: int, seq_len: int, batch_size: int, implementations=("eager", "sdpa")
) -> dict:
    """Wall and CPU seconds of the plain HF forward pass (logits included) over the probes' tokens
    and batches, per attention implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    from nopelens.analyses.subjects import resolve

    torch.set_num_threads(1)
    tokens = resolve(f"hf:{model_dir}", n_sequences, seq_len, seed=0, progress=False).tokens
    out = {}
    for implementation in implementations:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, attn_implementation=implementation
        ).eval()
        with torch.no_grad():
            model(tokens[:1, :16])  # warm-up
            start, cpu = time.perf_counter(), time.process_time()
            for first in range(0, n_sequences, batch_size):
                model(tokens[first : first + batch_size])
        out[implementation], out[f"{implementation}_cpu"] = time.perf_counter() - start, time.process_time() - cpu
        del model
    return out


def child(args: argparse.Namespace) -> int:
    """Run one case in this (fresh) process and print its numbers as JSON."""
    warnings.simplefilter("ignore")
    if args.child == "forward":
        result = forward_seconds(args.model_dir, args.n_sequences, args.seq_len, args.batch_size)
    elif args.child.startswith("paired-"):  # the forward pass, then the case, in one process: paired ratios
        result = forward_seconds(args.model_dir, args.n_sequences, args.seq_len, args.batch_size, ("eager",))
        result |= measure(
            args.child.removeprefix("paired-"),
            args.model_dir,
            args.n_sequences,
            args.seq_len,
            args.probes,
            args.batch_size,
            args.n_boot,
        )
    else:
        result = measure(
            args.child, args.model_dir, args.n_sequences, args.seq_len, args.probes, args.batch_size, args.n_boot
        )
    print(json.dumps(result))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("memory", "time", "depth"))
    parser.add_argument("--memory-mib", type=int, default=384, help="depth runs: the --memory-mib of the grouped runs")
    parser.add_argument("--quick", action="store_true", help="small shapes, for a quick look")
    parser.add_argument("--probes", default="sweep", choices=("absolute", "sweep"), help="probe set of the time runs")
    parser.add_argument("--n-boot", type=int, default=200)
    parser.add_argument("--main", action="store_true", help=f"time runs: also the case {MAIN_CASE!r}")
    parser.add_argument("--cases", help="comma list of the cases to run (default: all)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--time-sequences",
        help="time runs: comma list of sequence counts, each measured (default 32, --quick 16; "
        "e.g. 32,96 for the trend with the tokens)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--n-sequences", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.exit(child(args))
    memory_shape = (192, 4, 128, 12) if args.quick else (384, 6, 256, 24)  # d_model, layers, tokens, sequences
    time_shape = (256, 4, 256, 16) if args.quick else (512, 8, 512, 32)
    print(f"nopelens bench_stream: one thread; load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "memory"):
            d, layers, tokens, n = memory_shape
            model_dir = make_model_dir(Path(tmp) / "memory", d, layers, tokens)
            print(
                f"\nmemory: Llama d_model {d}, {layers} layers, {tokens} tokens, the sweep's probes; "
                "peak RSS per process"
            )
            print(f"{'case':18s} {'1x MiB':>9s} {'4x MiB':>9s} {'4x / 1x':>8s} {'1x s':>7s} {'4x s':>7s}")
            for case in selected(args, CASES + (CLI_CASE,)):
                if case == CLI_CASE:
                    (small, rss_small), (large, rss_large) = (run_cli(model_dir, k * n, tokens, args) for k in (1, 4))
                else:
                    (small, rss_small), (large, rss_large) = (
                        run_child(case, model_dir, k * n, tokens, "sweep", args) for k in (1, 4)
                    )
                    small, large = small["total_s"], large["total_s"]
                print(
                    f"{case:18s} {rss_small:9.0f} {rss_large:9.0f} {rss_large / rss_small:8.2f} "
                    f"{small:7.1f} {large:7.1f}",
                    flush=True,
                )
        if args.only in (None, "time"):
            d, layers, tokens, n = time_shape
            model_dir = make_model_dir(Path(tmp) / "time", d, layers, tokens)
            counts = [n] if args.time_sequences is None else [int(c) for c in args.time_sequences.split(",")]
            for n in counts:
                time_runs(model_dir, d, layers, tokens, n, args)
        if args.only == "depth":
            depth(Path(tmp), args)
    print(f"load average after: {os.getloadavg()}")


def time_runs(model_dir: Path, d: int, layers: int, tokens: int, n: int, args) -> None:
    """Each time case at ``n`` sequences against a plain forward pass run right before it (module docstring)."""
    forward, forward_rss = run_child("forward", model_dir, n, tokens, args.probes, args)
    print(f"\ntime: Llama d_model {d}, {layers} layers, {tokens} tokens, {n} sequences, probes: {args.probes}")
    print(
        f"plain HF forward pass alone: {forward['eager']:.1f} s eager attention, {forward['sdpa']:.1f} s SDPA "
        f"(peak RSS {forward_rss:.0f} MiB). Each case below runs in its own process right after a plain "
        "forward pass (eager), and is divided by that one: the ratios pair measurements made minutes apart, "
        "not hours, on a shared machine"
    )
    print(
        f"{'case':18s} {'forward s':>9s} {'case s':>8s} {'x forward':>9s} {'fwd CPU s':>9s} {'case CPU s':>10s} "
        f"{'x (CPU)':>8s} {'collect s':>9s}"
    )
    for case in selected(args, CASES + ((MAIN_CASE,) if args.main else ())):
        r, _ = run_child(f"paired-{case}", model_dir, n, tokens, args.probes, args)
        collect = f"{r['collect_s']:9.1f}" if "collect_s" in r else f"{'':9s}"
        print(
            f"{case:18s} {r['eager']:9.1f} {r['total_s']:8.1f} {r['total_s'] / r['eager']:9.2f} "
            f"{r['eager_cpu']:9.1f} {r['total_cpu_s']:10.1f} {r['total_cpu_s'] / r['eager_cpu']:8.2f} {collect}",
            flush=True,
        )


def depth(tmp: Path, args) -> None:
    """Peak RSS with 1x and 4x the layers, every job's statistics at once or in groups (module docstring)."""
    import numpy as np
    import pandas as pd

    d, tokens, n = (192, 64, 12) if args.quick else (384, 128, 24)
    print(
        f"\ndepth: Llama d_model {d}, {tokens} tokens, {n} sequences; nopelens probe hf:DIR --input random "
        "--keep-mib 0 --no-sink-ablation --no-figures; peak RSS per process"
    )
    print(f"{'layers':>6s} {'--memory-mib':>12s} {'groups':>6s} {'peak MiB':>9s} {'wall s':>7s} {'max |diff|':>10s}")
    for layers in (6, 24):
        model_dir = make_model_dir(tmp / f"depth-{layers}", d, layers, tokens)
        tables = {}
        for memory in (None, args.memory_mib):
            out = tmp / f"depth-{layers}-{memory}"
            extra = [] if memory is None else ["--memory-mib", str(memory)]
            command = [
                sys.executable,
                "-m",
                "nopelens",
                "probe",
                f"hf:{model_dir}",
                "--input",
                "random",
                "--n-sequences",
                str(n),
                "--seq-len",
                str(tokens),
                "--keep-mib",
                "0",
                "--no-sink-ablation",
                "--no-figures",
                "--quiet",
                "--jobs",
                "1",
                "--out",
                str(out),
                *extra,
            ]
            seconds, rss = _wait(command, f"depth {layers} {memory}", lambda text: None)
            (done,) = out.glob("parts/*/done.json")
            groups = json.loads(done.read_text())["streamed"]["statistics_groups"]
            tables[memory] = pd.read_csv(out / "probes.csv")
            diff = ""
            if memory is not None:
                a, b = tables[None]["value"].to_numpy(float), tables[memory]["value"].to_numpy(float)
                diff = f"{np.nanmax(np.abs(a - b)):.1e}" if np.array_equal(np.isnan(a), np.isnan(b)) else "NaN differ"
            print(f"{layers:6d} {memory or 'free':>12} {groups:6d} {rss:9.0f} {seconds:7.1f} {diff:>10s}", flush=True)


def selected(args, cases: tuple[str, ...]) -> tuple[str, ...]:
    if not args.cases:
        return cases
    wanted = tuple(c.strip() for c in args.cases.split(","))
    unknown = set(wanted) - set(cases)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {list(cases)}")
    return tuple(c for c in cases if c in wanted)


def run_cli(model_dir: Path, n_sequences: int, seq_len: int, args) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of ``nopelens probe hf:DIR --input random`` as a user runs it:
    its defaults (keep budget, sites, sinks, figures), one thread, a fresh run folder."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "nopelens",
            "probe",
            f"hf:{model_dir}",
            "--input",
            "random",
            "--n-sequences",
            str(n_sequences),
            "--seq-len",
            str(seq_len),
            "--batch-size",
            str(args.batch_size),
            "--quiet",
            "--jobs",
            "1",
            "--out",
            out,
        ]
        return _wait(command, CLI_CASE, lambda text: None)


def _wait(command: list[str], case: str, parse) -> tuple:
    """Run ``command`` on one thread in a fresh process: (``parse(stdout)`` or its wall seconds when
    ``parse`` gives None, peak RSS in MiB from ``os.wait4``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status):
            err.seek(0)
            raise RuntimeError(f"case {case} failed:\n{err.read()[-3000:]}")
        out.seek(0)
        parsed = parse(out.read())
        return (seconds if parsed is None else parsed), usage.ru_maxrss / 1024  # Linux: KiB


def run_child(case: str, model_dir: Path, n_sequences: int, seq_len: int, probes: str, args) -> tuple[dict, float]:
    """(the case's numbers, its peak RSS in MiB), measured in a fresh process (``os.wait4``)."""
    command = [
        sys.executable,
        __file__,
        "--child",
        case,
        "--model-dir",
        str(model_dir),
        "--n-sequences",
        str(n_sequences),
        "--seq-len",
        str(seq_len),
        "--probes",
        probes,
        "--batch-size",
        str(args.batch_size),
        "--n-boot",
        str(args.n_boot),
    ]
    return _wait(command, case, lambda text: json.loads(text.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
