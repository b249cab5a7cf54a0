"""GPU run of ``nopelens probe hf:DIR`` in bfloat16 (issue 19): a full-width SmolLM3 configuration,
streamed, on text windows read through a tokenizer saved next to it. Not run in CI.

What it does, offline, in one process:

1. saves a random-init SmolLM3 of the real width and head layout (d_model 2048, 16 query heads and
   4 key-value heads of 128, RoPE with NoPE in every fourth layer, its 128,256-token vocabulary),
   layers cut to ``--layers``, in bfloat16, and next to it a byte-level BPE tokenizer trained with
   the ``tokenizers`` library on the corpus nopelens ships (its ids are a subset of the vocabulary);
2. runs ``nopelens audit --hf-dir`` on it: the per-layer NoPE detector measures which layers rotate
   (declared against measured, step 5) in the model's dtype;
3. prints ``nopelens probe --plan`` (forward passes, tokens, statistics memory);
4. runs ``nopelens probe hf:DIR --device cuda --dtype bfloat16`` on ``--seq-len``-token windows and
   writes the run folder, wall seconds, peak CUDA memory and, per layer, the declared method
   (RoPE or NoPE) next to the detector's reading, the audit's step verdicts and what the run
   measured (summary and layer curves) to ``--out``; on CPU the peak RSS of the process too.

    python benchmarks/gpu_probe.py --out /tmp/gpu-probe                 # the default shapes
    python benchmarks/gpu_probe.py --device cpu --layers 2 --d-model 256 --seq-len 64 --n-sequences 8  # a dry run
    python benchmarks/gpu_probe.py --device cpu --layers 4 --n-sequences 8 --batch-size 2  # full width on CPU

Numbers of a random-init model say nothing about trained SmolLM3; the run checks that the
streamed probe works at this width, length, dtype and device, in bounded memory.
"""

from __future__ import annotations

import argparse
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
    config = SmolLM3Config(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                           num_key_value_heads=max(1, n_heads // 4), head_dim=d_model // n_heads,
                           intermediate_size=int(d_model * 5.5) // 64 * 64, vocab_size=vocab,
                           max_position_embeddings=65536, no_rope_layers=[int((l + 1) % 4 != 0) for l in range(n_layers)],
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SmolLM3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-probe", help="folder for the model, the run and result.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--n-sequences", type=int, default=32)
    parser.add_argument("--batch-size", default="auto", help="sequences per forward pass, or auto (nopelens probe's "
                        "default: up to 32, as many as fit half the memory free on the device)")
    args = parser.parse_args()

    import pandas as pd
    import torch

    from nopelens.analyses.cli import main as nopelens

    out = Path(args.out)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    save_model(model_dir, args.d_model, args.layers, args.vocab, args.dtype)
    save_tokenizer(model_dir, vocab_size=4000, documents=None)  # the example's BPE, on the whole corpus
    print(f"saved {model_dir} in {time.perf_counter() - start:.0f} s", flush=True)
    if nopelens(["audit", "--hf-dir", str(model_dir), "--out", str(out / "audit")]) not in (0, 1):
        return 2
    audit = json.loads((out / "audit" / "audit.json").read_text())
    common = [f"hf:{model_dir}", "--device", args.device, "--dtype", args.dtype, "--seq-len", str(args.seq_len),
              "--n-sequences", str(args.n_sequences), "--batch-size", str(args.batch_size), "--jobs", "1"]
    if nopelens(["probe", *common, "--plan"]) != 0:
        return 1
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    code = nopelens(["probe", *common, "--out", str(out / "run")])
    seconds = time.perf_counter() - start
    if code != 0:
        return code
    (done,) = (out / "run" / "parts").glob("*/done.json")
    meta = json.loads(done.read_text())
    layers = pd.read_csv(out / "run" / "layers.csv")
    methods = meta["hf"].split("layers: ", 1)[1].split(", ")
    result = {
        "seconds": seconds, "device": meta["device"], "dtype": meta["dtype"], "input": meta["input"],
        "tokens": args.n_sequences * args.seq_len, "d_model": args.d_model, "layers": args.layers,
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "declared_methods": methods, "measured_layer_positions": audit["model"].get("measured_layer_positions"),
        "audit_steps": {s["number"]: s["status"] for s in audit["steps"]}, "second_pass_batches": meta["streamed"]["second_pass_batches"],
        "batch_size": meta["streamed"]["batch_size"],
        "summary": pd.read_csv(out / "run" / "summary.csv").to_dict(orient="records"),
        "layer_curves": layers.to_dict(orient="records"),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("summary", "layer_curves")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
