"""Peak memory and time of ``nopelens probe hf:DIR`` with part of the model offloaded to disk
(``--device-map auto --max-memory cpu=HALF --offload-folder DIR``) against the same model loaded
whole (issue 48). Not run in CI.

It saves a random-init SmolLM3-shaped model in float32 (RoPE with NoPE in every fourth block, d_model
``--d-model``, ``--layers`` blocks; a few hundred MB at the defaults) with a byte-level BPE tokenizer,
then runs the same probe twice, each in its own process (so each peak RSS is that run's alone): the
model whole on the CPU, and with ``--max-memory cpu=`` half the checkpoint's bytes, the rest on disk.
It prints, side by side, the peak RSS (``ru_maxrss``) and wall seconds of each, their ratios, the
share of the weights offloaded, and the largest difference between the two runs' numbers (every
table of the run folder; 0 expected on one thread in float32). Before that it times one hooked
forward pass of each (whole and offloaded, each in its own process, alternated twice so a change in
the machine's load meets both): the part of the run that offloading slows; the probes' fits are the
same work in both.

    OMP_NUM_THREADS=1 python benchmarks/bench_offload.py --out /tmp/bench-offload
    python benchmarks/bench_offload.py --d-model 256 --layers 4 --out /tmp/bench-offload-small  # a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_hf_model import save_tokenizer  # noqa: E402

TABLES = ("probes.csv", "layers.csv", "summary.csv", "sinks.csv", "variance.csv", "sink_ablation.csv")


def save_model(directory: Path, d_model: int, n_layers: int, vocab: int) -> int:
    """A random-init SmolLM3-shaped causal LM in float32, heads of 64; returns its checkpoint's bytes."""
    import torch
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    n_heads = max(1, d_model // 64)
    config = SmolLM3Config(
        hidden_size=d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=max(1, n_heads // 4),
        intermediate_size=int(d_model * 5.5) // 64 * 64,
        vocab_size=vocab,
        max_position_embeddings=4096,
        no_rope_layers=[int((l + 1) % 4 != 0) for l in range(n_layers)],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SmolLM3ForCausalLM(config).eval().save_pretrained(directory)
    return (directory / "model.safetensors").stat().st_size


def run_case(argv: list[str]) -> None:
    """One case, in this process: the probe, then its peak RSS and wall seconds as JSON on stdout."""
    from nopelens.analyses.cli import main as nopelens

    start = time.perf_counter()
    code = nopelens(argv)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "code": code,
                "seconds": seconds,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def time_forward(model_dir: str, n_sequences: int, seq_len: int, placed: list[str]) -> None:
    """One case of the forward-pass timing, in this process: the model loaded whole or into its
    map, then seconds per hooked forward pass over the batch (the best of 3; the offload traffic is
    in every pass), and the peak RSS, as JSON on stdout."""
    import torch

    from nopelens.models.hf_loading import load_hf_dir

    options = dict(zip(("device_map", "max_memory", "offload_folder"), placed[1::2]))
    model = load_hf_dir(Path(model_dir), **options)
    tokens = torch.randint(3, 4000, (n_sequences, seq_len), generator=torch.Generator().manual_seed(0))
    seconds = []
    with torch.no_grad():
        for _ in range(3):
            start = time.perf_counter()
            model.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_resid_post"))
            seconds.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "code": 0,
                "seconds": min(seconds),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def forward_ratios(model_dir: Path, args, placed: list[str]) -> dict:
    """Seconds per forward pass, whole and offloaded, each in its own process, alternated twice
    (so a change in the machine's load meets both); the faster of each case's two."""
    best: dict[str, dict] = {}
    for _ in range(2):
        for case, extra in (("whole", []), ("offloaded", placed)):
            child = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--forward",
                    str(model_dir),
                    str(args.n_sequences),
                    str(args.seq_len),
                    *extra,
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
            )
            found = json.loads([line for line in child.stdout.splitlines() if line.startswith("{")][-1])
            if case not in best or found["seconds"] < best[case]["seconds"]:
                best[case] = found
    return best


def largest_difference(a: Path, b: Path) -> float:
    import numpy as np
    import pandas as pd

    worst = 0.0
    for name in TABLES:
        x, y = pd.read_csv(a / name), pd.read_csv(b / name)
        numbers = x.select_dtypes("number").columns
        if (
            list(x.columns) != list(y.columns)
            or x.shape != y.shape
            or not (x[numbers].isna() == y[numbers].isna()).all().all()
        ):
            return float("inf")
        worst = max(
            worst, float(np.nanmax(np.abs(x[numbers].to_numpy(float) - y[numbers].to_numpy(float)), initial=0.0))
        )
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-offload", help="folder for the model, the runs and result.json")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-sequences", type=int, default=8)
    parser.add_argument(
        "--only-forward",
        action="store_true",
        help="time the forward passes only (the model already saved in --out), not the probe",
    )
    parser.add_argument("--case", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--forward", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # one timing, in a child
    args = parser.parse_args()
    if args.case:
        run_case(args.case)
        return 0
    if args.forward:
        time_forward(args.forward[0], int(args.forward[1]), int(args.forward[2]), args.forward[3:])
        return 0

    out = Path(args.out)
    model_dir = out / "model"
    if not (model_dir / "model.safetensors").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        save_model(model_dir, args.d_model, args.layers, args.vocab)
        save_tokenizer(model_dir, vocab_size=min(args.vocab, 4000), documents=None)
    size = (model_dir / "model.safetensors").stat().st_size
    common = [
        "probe",
        f"hf:{model_dir}",
        "--quick",
        "--seq-len",
        str(args.seq_len),
        "--n-sequences",
        str(args.n_sequences),
        "--quiet",
        "--no-figures",
        "--jobs",
        "1",
    ]
    placed = ["--device-map", "auto", "--max-memory", f"cpu={size // 2}B", "--offload-folder", str(out / "offload")]
    forward = forward_ratios(model_dir, args, placed)
    print(
        f"forward pass over {args.n_sequences} x {args.seq_len} tokens (best of 3, each case in its own process, "
        f"alternated twice): whole {forward['whole']['seconds']:.3f} s, "
        f"peak RSS {forward['whole']['peak_rss_mib']:,.0f} "
        f"MiB; offloaded {forward['offloaded']['seconds']:.3f} s, peak RSS {forward['offloaded']['peak_rss_mib']:,.0f} "
        f"MiB; ratios {forward['offloaded']['seconds'] / forward['whole']['seconds']:.2f} (time), "
        f"{forward['offloaded']['peak_rss_mib'] / forward['whole']['peak_rss_mib']:.2f} (RSS)",
        flush=True,
    )
    (out / "forward.json").write_text(json.dumps(forward, indent=1))
    if args.only_forward:
        return 0
    results = {}
    for case, extra in (("whole", []), ("offloaded", placed)):
        folder = out / case
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        child = subprocess.run(
            [sys.executable, __file__, "--case", *common, *extra, "--out", str(folder)],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        )
        lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
        if child.returncode != 0 or not lines or json.loads(lines[-1])["code"] != 0:
            print(child.stderr[-2000:], file=sys.stderr)
            return 1
        results[case] = json.loads(lines[-1])
        results[case]["plan"] = child.stderr[child.stderr.find("plan for") :].split("\n\n")[0]
        (out / f"{case}.json").write_text(json.dumps(results[case], indent=1))

    from accelerate.utils import compute_module_sizes

    from nopelens.models.device_map import resolve_device_map  # the offloaded run's map, recomputed
    from nopelens.models.hf_loading import _causal_lm_class, _meta_model
    from nopelens.models.placement import Placement

    meta = _meta_model(_causal_lm_class(model_dir), model_dir, "float32")
    device_map = resolve_device_map(Placement("auto", f"cpu={size // 2}B", str(out / "offload")), meta)
    sizes = compute_module_sizes(meta)
    disk = sum(sizes[key] for key, device in device_map.items() if device == "disk")
    whole, off = results["whole"], results["offloaded"]
    result = {
        "checkpoint_mib": size / 2**20,
        "offloaded_mib": disk / 2**20,
        "offloaded_share": disk / sizes[""],
        "d_model": args.d_model,
        "layers": args.layers,
        "tokens": args.seq_len * args.n_sequences,
        "whole": whole,
        "offloaded": off,
        "rss_ratio": off["peak_rss_mib"] / whole["peak_rss_mib"],
        "rss_saved_mib": whole["peak_rss_mib"] - off["peak_rss_mib"],
        "time_ratio": off["seconds"] / whole["seconds"],
        "largest_difference": largest_difference(out / "whole", out / "offloaded"),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(
        f"model: d_model {args.d_model}, {args.layers} blocks, checkpoint {size / 2**20:,.0f} MiB float32; "
        f"--max-memory cpu={size // 2**21} MiB: {disk / 2**20:,.0f} MiB ({result['offloaded_share']:.0%}) offloaded "
        f"to disk; probe --quick on {args.n_sequences} x {args.seq_len} tokens, one thread"
    )
    print(f"{'':12}{'whole':>12}{'offloaded':>12}{'ratio':>8}")
    print(
        f"{'peak RSS':12}{whole['peak_rss_mib']:>9,.0f} MiB{off['peak_rss_mib']:>9,.0f} MiB{result['rss_ratio']:>8.2f}"
    )
    print(f"{'wall time':12}{whole['seconds']:>10,.1f} s{off['seconds']:>10,.1f} s{result['time_ratio']:>8.2f}")
    print(
        f"peak RSS saved: {result['rss_saved_mib']:,.0f} MiB (offloaded weights: {disk / 2**20:,.0f} MiB); largest "
        f"difference between the two runs' numbers: {result['largest_difference']:.3g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
