"""Probe models built elsewhere: an HF model directory through TransformerLens' bridge, and a plain
``torch.nn.Module`` through ``HookedModule``; the same per-layer position probe runs on both.

    python examples/hook_external.py                       # a tiny GPT-2 saved to a temp dir
    python examples/hook_external.py --hf-dir path/to/model  # any local HF causal LM (safetensors)

The ``nn.Module`` is a NoPE decoder made of torch's own ``TransformerEncoderLayer`` s (causal mask,
no position embedding), hooked at its embedding and after each layer. Writes
``hook_external.csv`` (absolute-index R² per model and layer, with 95 % CIs) into --out and says
where. Bad input (a missing or unloadable --hf-dir) is one line on stderr and exit code 2, as on
the command line. (48 sequences of 32 tokens by default rather than the sweep's 80 of 64: the
tiny GPT-2 it builds has a 64-position table, and the point is the hooks, not the numbers.)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from nopelens.analyses.cli import OneLineParser, guarded
from nopelens.models.adapters import HookedModule
from nopelens.models.hf_loading import load_hf_dir
from nopelens.models.hooks import act_name
from nopelens.models.io import write_csv_atomic
from nopelens.probes import collect, probe_absolute_index, resid_sites


class TorchNoPE(nn.Module):
    """Token embedding, pre-norm causal ``TransformerEncoderLayer`` s, unembedding: NoPE, built by torch."""

    def __init__(self, d_vocab: int = 64, d_model: int = 32, n_heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(d_vocab, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers)
        )
        self.unembed = nn.Linear(d_model, d_vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.unembed(x)


def save_tiny_gpt2(directory: Path) -> Path:
    """A 2-layer GPT-2 with random weights, saved as an HF model directory (no download)."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def r2_per_layer(name: str, model, n_layers: int, tokens: torch.Tensor, n_boot: int) -> pd.DataFrame:
    """Absolute-index R² of a linear probe at every layer (0 = embeddings)."""
    acts = collect(model, tokens, resid_sites(n_layers))
    table = probe_absolute_index(acts, tasks=("regression",), n_boot=n_boot)
    rows = table[(table.probe == "linear") & (table.metric == "r2")]
    return rows.assign(model=name)[["model", "layer", "site", "value", "ci_low", "ci_high", "selectivity"]]


def main(argv: list[str] | None = None) -> list[Path]:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hf-dir", type=Path, default=None, help="a local HF causal LM (default: a tiny GPT-2 in a temp dir)"
    )
    parser.add_argument("--n-sequences", type=int, default=48)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--n-boot", type=int, default=200)
    parser.add_argument(
        "--out", type=Path, default=Path("runs/examples"), help="folder to write into (default runs/examples)"
    )
    args = parser.parse_args(argv)

    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as temp:
        hf_dir = args.hf_dir or save_tiny_gpt2(Path(temp) / "tiny-gpt2")
        bridge = load_hf_dir(hf_dir)  # what `nopelens probe hf:DIR` uses: TransformerBridge, offline
        tokens = torch.randint(1, bridge.cfg.d_vocab, (args.n_sequences, args.seq_len), generator=generator)
        tokens[:, 0] = 0  # BOS
        hf = r2_per_layer(f"hf:{hf_dir.name}", bridge, bridge.cfg.n_layers, tokens, args.n_boot)

    torch.manual_seed(0)
    module = TorchNoPE().eval()
    sites = {act_name("resid_pre", 0): "embed"}
    sites.update({act_name("resid_post", l): f"layers.{l}" for l in range(len(module.layers))})
    hooked = HookedModule(module, sites)
    tokens = torch.randint(1, 64, (args.n_sequences, args.seq_len), generator=generator)
    tokens[:, 0] = 0  # a BOS: the only token that tells a NoPE model where the sequence starts
    plain = r2_per_layer("torch TransformerEncoder (NoPE)", hooked, len(module.layers), tokens, args.n_boot)
    hooked.remove()

    table = pd.concat([hf, plain], ignore_index=True)
    print(table.round(3).to_string(index=False))
    path = write_csv_atomic(table, args.out / "hook_external.csv")
    print(f"wrote {path}")
    return [path]


if __name__ == "__main__":
    sys.exit(guarded(main, "hook_external.py"))
