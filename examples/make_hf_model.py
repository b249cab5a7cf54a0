"""Save a small random-init HF model with a tokenizer of its own, to try ``nopelens probe hf:DIR`` on.

    python examples/make_hf_model.py                 # writes runs/examples/smol
    nopelens probe hf:runs/examples/smol --quick --seq-len 16 --n-sequences 6 --plan

The model is SmolLM3-shaped (SmolLM3-3B drops RoPE in every fourth layer: ``no_rope_layers``), tiny
(4 layers, d_model 32, 4 query and 2 key-value heads) and randomly initialized: the point is the
pipeline, not the numbers. Its tokenizer is a 300-token byte-level BPE that the ``tokenizers``
library trains offline on the corpus nopelens ships, saved as an HF fast tokenizer that starts
every text with ``<s>`` (its BOS, id 1). Nothing is downloaded. The tests probe this same model
(``tests/test_probe_stream.py``). A folder that already holds a model is refused in one line
(exit code 2), as on the command line.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from nopelens.analyses.cli import OneLineParser, guarded
from nopelens.analyses.cli.options import seed_type
from nopelens.models.tasks import default_documents

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3: the config's pad, BOS and EOS ids follow


def save_tokenizer(path: Path, vocab_size: int = 300, documents: int | None = 40) -> int:
    """Train a byte-level BPE on the first ``documents`` of the shipped corpus (None: all of it),
    offline, and save it into ``path`` as an HF fast tokenizer that starts every text with ``<s>``;
    returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(default_documents().values())[:documents], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(path)
    return tokenizer.get_vocab_size()


def smol_model(vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A random-init SmolLM3-shaped causal LM: 4 layers (RoPE in blocks 0-2, NoPE in block 3),
    d_model 32, 4 query and 2 key-value heads of 8, 64 positions, eager attention."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        no_rope_layers=[1, 1, 1, 0],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on a config built from scratch
        return SmolLM3ForCausalLM(config).eval()


def save_smol(path: Path, seed: int = 0) -> Path:
    """:func:`save_tokenizer` and :func:`smol_model` saved together into ``path`` (safetensors)."""
    from transformers.utils import logging

    size = save_tokenizer(path)
    logging.disable_progress_bar()  # a bar for writing one small file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smol_model(size, seed).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/examples/smol", help="the model folder (default runs/examples/smol)")
    parser.add_argument("--seed", type=seed_type, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if (out / "config.json").exists():
        raise ValueError(f"{out} already holds a model (config.json); give another --out, or delete it")
    save_smol(out, args.seed)
    print(
        f"wrote a random-init SmolLM3-shaped model and its tokenizer to {out}; try:\n"
        f"  nopelens probe hf:{out} --quick --seq-len 16 --n-sequences 6"
    )
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "make_hf_model.py"))
