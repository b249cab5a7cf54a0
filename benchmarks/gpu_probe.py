"""GPU run of ``nopelens probe hf:DIR`` in bfloat16 (issue 19): a full-width SmolLM3 configuration,
streamed, on text windows read through a tokenizer saved next to it. Not run in CI.

What it does, offline, in one process:

1. saves a random-init SmolLM3 of the real width and head layout (d_model 2048, 16 query heads and
   4 key-value heads of 128, RoPE with NoPE in every fourth layer, its 128,256-token vocabulary),
   layers cut to ``--layers``, in bfloat16, and next to it a byte-level BPE tokenizer trained with
   the ``tokenizers`` library on the corpus nopelens ships (its ids are a subset of the vocabulary);
2. runs ``nopelens audit --hf-dir`` on it: the per-layer NoPE detector measures which layers rotate
   (declared against measured, step 5) in the model's dtype;
3. prints ``nopelens probe --plan`` (forward passes, tokens, statistics memory) of steps 4 and 5;
4. runs ``nopelens probe hf:DIR --device cuda --dtype bfloat16`` on ``--seq-len``-token windows and
   writes the run folder, wall seconds, peak CUDA memory and, per layer, the declared method
   (RoPE or NoPE) next to the detector's reading, the audit's step verdicts and what the run
   measured (summary and layer curves) to ``--out``; on CPU the peak RSS of the process too;
5. runs the same probe on the same model split by ``--device-map`` (issue 48): a JSON map with the
   first half of the blocks (and the embedding) on the GPU and the rest on the CPU (accelerate runs
   them on the GPU, their weights copied there for each forward pass), and compares every number of
   its run folder with step 4's.

It prints one summary line per check (``check NAME: ok|FAIL ...``) and exits 1 when one fails.
``--tiny`` runs the same logic on the CPU at a tiny size in float32 (d_model 128, 4 layers, 6 windows
of 32 tokens, ``--quick`` probes; the split puts the second half of the blocks on disk instead of
the CPU), so a test exercises it (``tests/test_device_map.py``); the first thing to run when an
accelerator is available is the default:

    python benchmarks/gpu_probe.py --out /tmp/gpu-probe  # the default shapes, sized for 10 min on one GPU
    python benchmarks/gpu_probe.py --tiny --out /tmp/gpu-probe-tiny  # the logic, on the CPU
    python benchmarks/gpu_probe.py --device cpu --layers 4 --n-sequences 8 --batch-size 2  # full width on CPU

Numbers of a random-init model say nothing about trained SmolLM3; the run checks that the
streamed probe works at this width, length, dtype and device, in bounded memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_hf_model import save_tokenizer  # noqa: E402


def save_model(directory: Path, d_model: int, n_layers: int, vocab: int, dtype: str) -> None:
    import torch
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    n_heads = max(1, d_model // 128)
    config = SmolLM3Config(
        hidden_size=d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=max(1, n_heads // 4),
        head_dim=d_model // n_heads,
        intermediate_size=int(d_model * 5.5) // 64 * 64,
        vocab_size=vocab,
        max_position_embeddings=65536,
        no_rope_layers=[int((l + 1) % 4 != 0) for l in range(n_layers)],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SmolLM3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory)


def split_map(model_dir: Path, first: int | str, rest: str) -> dict[str, int | str]:
    """A device map of the saved model: the embedding, the first half of the blocks, the rotary table
    and the (tied) output head on ``first``; the other blocks and the final norm on ``rest``."""
    config = json.loads((model_dir / "config.json").read_text())
    n = config["num_hidden_layers"]
    placed = {"model.embed_tokens": first, "model.rotary_emb": first, "lm_head": first, "model.norm": rest}
    placed.update({f"model.layers.{l}": first if l < n // 2 else rest for l in range(n)})
    return placed


def largest_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between the numbers of two run folders' tables (inf where
    their shapes, columns, missing values or text differ)."""
    import numpy as np
    import pandas as pd

    worst = 0.0
    for name in ("probes.csv", "layers.csv", "summary.csv", "sinks.csv", "variance.csv", "sink_ablation.csv"):
        x, y = pd.read_csv(a / name), pd.read_csv(b / name)
        numbers = x.select_dtypes("number").columns
        text = [column for column in x.columns if column not in numbers]
        if (
            list(x.columns) != list(y.columns)
            or x.shape != y.shape
            or not x[numbers].isna().equals(y[numbers].isna())
            or not x[text].fillna("").equals(y[text].fillna(""))
        ):
            return float("inf")
        worst = max(
            worst, float(np.nanmax(np.abs(x[numbers].to_numpy(float) - y[numbers].to_numpy(float)), initial=0.0))
        )
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-probe", help="folder for the model, the runs and result.json")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (default bfloat16)")
    parser.add_argument("--d-model", type=int, default=2048, help="width (default 2048, SmolLM3-3B's)")
    parser.add_argument("--layers", type=int, default=8, help="blocks (default 8; NoPE in every fourth)")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary (default 128,256, SmolLM3's)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per window (default 1,024)")
    parser.add_argument("--n-sequences", type=int, default=32, help="windows read (default 32)")
    parser.add_argument(
        "--batch-size",
        default="auto",
        help="sequences per forward pass, or auto (nopelens probe's "
        "default: up to 32, as many as fit half the memory free on the device)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-6,
        help="the largest difference the split run's "
        "numbers may have from the whole run's (default 1e-6; the same kernels on the same data give 0)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the same checks on the CPU at a tiny size in float32 (a test of this script's logic, not of a GPU)",
    )
    args = parser.parse_args(argv)
    quick = []
    if args.tiny:
        args.device, args.dtype, args.d_model, args.layers, args.vocab = "cpu", "float32", 128, 4, 4000
        args.seq_len, args.n_sequences, quick = 32, 6, ["--quick"]

    import pandas as pd
    import torch

    from nopelens.analyses.cli import main as cli

    out = Path(args.out)

    def nopelens(argv: list[str]) -> int:
        """One nopelens command, its output in ``out/<command>-<n>.log`` (printed when it fails)."""
        log = out / f"{argv[0]}-{len(list(out.glob('*.log')))}.log"
        with open(log, "w") as stream, contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            code = cli(argv)
        if code not in (0, 1):
            print(log.read_text()[-3000:], file=sys.stderr)
        return code

    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    save_model(model_dir, args.d_model, args.layers, args.vocab, args.dtype)
    save_tokenizer(model_dir, vocab_size=4000, documents=None)  # the example's BPE, on the whole corpus
    print(f"saved {model_dir} in {time.perf_counter() - start:.0f} s", flush=True)
    checks = []

    def check(name: str, ok: bool, text: str) -> None:
        checks.append(ok)
        print(f"check {name}: {'ok' if ok else 'FAIL'}: {text}", flush=True)

    if nopelens(["audit", "--hf-dir", str(model_dir), "--out", str(out / "audit")]) not in (0, 1):
        return 2
    audit = json.loads((out / "audit" / "audit.json").read_text())
    steps = {s["number"]: s["status"] for s in audit["steps"]}
    declared = ["nope" if (l + 1) % 4 == 0 else "rope" for l in range(args.layers)]
    measured = audit["model"].get("measured_layer_positions")
    check(
        "audit",
        "fail" not in steps.values(),
        f"steps {', '.join(f'{n} {v}' for n, v in steps.items())}; declared {','.join(declared)}, measured {measured}",
    )
    common = [
        f"hf:{model_dir}",
        "--dtype",
        args.dtype,
        "--seq-len",
        str(args.seq_len),
        "--n-sequences",
        str(args.n_sequences),
        "--batch-size",
        str(args.batch_size),
        "--jobs",
        "1",
        "--quiet",
        "--no-figures",
        *quick,
    ]
    whole = [*common, "--device", args.device]
    first, rest = (0, "cpu") if args.device == "cuda" else ("cpu", "disk")
    (out / "split.json").write_text(json.dumps(split_map(model_dir, first, rest), indent=1))
    split = [*common, "--device-map", str(out / "split.json"), "--offload-folder", str(out / "offload")]
    for options in (whole, split):
        if nopelens(["probe", *options, "--plan"]) != 0:
            return 1
        print((out / f"probe-{len(list(out.glob('*.log'))) - 1}.log").read_text().strip(), flush=True)
    runs = {}
    for name, options in (("whole", whole), ("split", split)):
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        code = nopelens(["probe", *options, "--out", str(out / name)])
        runs[name] = {
            "code": code,
            "seconds": time.perf_counter() - start,
            "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None,
        }
        peak = f", peak CUDA {runs[name]['peak_cuda_mib']:,.0f} MiB" if args.device == "cuda" else ""
        where = (
            f"on {args.device}"
            if name == "whole"
            else f"blocks 0-{args.layers // 2 - 1} on {first if first != 0 else 'cuda:0'}, the rest on {rest}"
        )
        check(
            f"probe ({name}: {where}, {args.dtype}, {args.n_sequences} x {args.seq_len:,} tokens)",
            code == 0,
            f"exit {code}, {runs[name]['seconds']:,.0f} s{peak}",
        )
        if code != 0:
            return 1
    difference = largest_difference(out / "whole", out / "split")
    check(
        "split equals whole",
        difference <= args.tolerance,
        f"largest difference of every number in the run folders {difference:.3g} (tolerance {args.tolerance:g})",
    )

    (done,) = (out / "whole" / "parts").glob("*/done.json")
    meta = json.loads(done.read_text())
    layers = pd.read_csv(out / "whole" / "layers.csv")
    methods = meta["hf"].split("layers: ", 1)[1].split(", ")
    result = {
        "seconds": runs["whole"]["seconds"],
        "split_seconds": runs["split"]["seconds"],
        "device": meta["device"],
        "dtype": meta["dtype"],
        "input": meta["input"],
        "tokens": args.n_sequences * args.seq_len,
        "d_model": args.d_model,
        "layers": args.layers,
        "peak_cuda_mib": runs["whole"]["peak_cuda_mib"],
        "split_peak_cuda_mib": runs["split"]["peak_cuda_mib"],
        "split_largest_difference": difference,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "declared_methods": methods,
        "measured_layer_positions": measured,
        "audit_steps": steps,
        "second_pass_batches": meta["streamed"]["second_pass_batches"],
        "batch_size": meta["streamed"]["batch_size"],
        "checks_passed": all(checks),
        "summary": pd.read_csv(out / "whole" / "summary.csv").to_dict(orient="records"),
        "layer_curves": layers.to_dict(orient="records"),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{sum(checks)} of {len(checks)} checks ok; wrote {out / 'result.json'}")
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
