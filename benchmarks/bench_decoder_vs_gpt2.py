"""Training-step throughput of the nopelens Decoder against HF GPT2LMHeadModel of the same size.

One training step is forward + cross-entropy + backward + AdamW step, on random tokens. Both
models are GPT-2-shaped (learned positions, GELU-tanh, LayerNorm, biases, no dropout) and are
timed side by side in one process, interleaved round by round so that load from other processes
hits both alike; each round times ``--steps`` steps after warmup, reported as tokens per second;
the ratio Decoder / GPT-2 is the median over rounds of the ratio within a round (target >= 1.0,
issue 2).

It also times the Decoder with hooks attached: a no-op hook on every ``hook_resid_post`` (the
fused attention path stays on), and a no-op hook on every ``attn.hook_pattern`` (which switches
attention to the explicit path), plus ``set_fused_attention(False)``.

Usage:
    python benchmarks/bench_decoder_vs_gpt2.py [--threads 2] [--batch 16] [--seq 128]

GPT-2 ties its unembedding to ``wte``; the Decoder has its own ``W_U`` and ``b_U`` (one more
[d_model, d_vocab] matrix to update), so the comparison slightly favours GPT-2.

Measured 2026-11-30 on a 2-core CPU VM (torch 2.13 CPU, transformers 5.24, ``--threads 2``,
defaults: batch 16, seq 128, d_model 128, 4 layers, 4 heads, vocab 512), in a quiet moment (load
average about 2) of a VM shared with other jobs:

- HF GPT-2 18156 tokens/s; Decoder 20934 tokens/s: ratio 1.15 (paired median of 15 rounds).
- Decoder with no-op hooks on every ``hook_resid_post``: 1.14 (1.5% below no hooks, within noise).
- Decoder with hooks on every ``hook_pattern`` (explicit attention): 1.19; with
  ``set_fused_attention(False)``: 1.16. At seq 128 on CPU, SDPA is not faster than the explicit
  softmax; the fused path matters for memory and longer sequences.
- Under heavy load (load average 6-9 on 2 cores, tokens/s about 10x lower) the ratio ranged 1.10-1.31.
- Before the hot-path changes to ``models/decoder.py`` (separate Q/K/V einsums, hand-written
  LayerNorm, bias adds after matmuls), the ratio on a nearly idle machine was 1.02; side by side,
  the new Decoder trains 1.37-1.49x faster than the old one (A/B runs under load).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from nopelens.models import Decoder, DecoderConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model before timing")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per model per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds; the median round is reported")
    return parser.parse_args()


def build_gpt2(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.seq,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).train()


def build_decoder(args: argparse.Namespace) -> Decoder:
    config = DecoderConfig(
        d_vocab=args.vocab,
        n_ctx=args.seq,
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        act_fn="gelu_tanh",
        position="learned",
    )
    return Decoder(config, seed=0).train()


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class Trainer:
    """One model, its AdamW optimizer and a function from tokens to logits."""

    def __init__(self, name, model, logits_fn):
        self.name, self.model, self.logits_fn = name, model, logits_fn
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.rates: list[float] = []  # tokens per wall-clock second, one per round
        self.cpu_rates: list[float] = []  # tokens per CPU second of this process (all threads)

    def step(self, tokens: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        next_token_loss(self.logits_fn(tokens), tokens).backward()
        self.optimizer.step()

    def time_steps(self, tokens: torch.Tensor, steps: int) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step(tokens)
        self.rates.append(steps * tokens.numel() / (time.perf_counter() - start))
        self.cpu_rates.append(steps * tokens.numel() / (time.process_time() - cpu_start))

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))

    gpt2 = build_gpt2(args)
    decoder = build_decoder(args)
    resid_hooked = build_decoder(args)
    pattern_hooked = build_decoder(args)
    explicit = build_decoder(args)
    explicit.set_fused_attention(False)

    def no_op(activation, hook):
        return activation

    for layer in range(args.layers):
        resid_hooked.blocks[layer].hook_resid_post.add_hook(no_op)
        pattern_hooked.blocks[layer].attn.hook_pattern.add_hook(no_op)

    trainers = [
        Trainer("HF GPT2LMHeadModel", gpt2, lambda t: gpt2(t).logits),
        Trainer("Decoder (no hooks)", decoder, decoder),
        Trainer("Decoder (no-op hook_resid_post hooks)", resid_hooked, resid_hooked),
        Trainer("Decoder (no-op hook_pattern hooks)", pattern_hooked, pattern_hooked),
        Trainer("Decoder (set_fused_attention(False))", explicit, explicit),
    ]
    for trainer in trainers:
        for _ in range(args.warmup):
            trainer.step(tokens)
    for round_index in range(args.rounds):
        shift = round_index % len(trainers)  # rotate the order so no model always runs first
        for trainer in trainers[shift:] + trainers[:shift]:
            trainer.time_steps(tokens, args.steps)

    print(
        f"threads={torch.get_num_threads()} batch={args.batch} seq={args.seq} d_model={args.d_model} "
        f"layers={args.layers} heads={args.heads} vocab={args.vocab}; median of {args.rounds} rounds "
        f"x {args.steps} training steps (forward + backward + AdamW)"
    )
    for trainer in trainers:
        paired = paired_ratio(trainer, trainers[0])
        cpu = statistics.median(a / b for a, b in zip(trainer.cpu_rates, trainers[0].cpu_rates))
        print(
            f"{trainer.name:40s} {trainer.median:8.0f} tokens/s   ratio vs GPT-2 {paired:.2f}"
            f"   (per CPU-second: {cpu:.2f})"
        )
    hook_cost = 1 - paired_ratio(trainers[2], trainers[1])
    print(f"hook overhead: no-op hook_resid_post hooks cost {100 * hook_cost:.1f}% of the Decoder's throughput")
    print(f"Decoder / GPT-2 training throughput ratio: {paired_ratio(trainers[1], trainers[0]):.2f}")


def paired_ratio(trainer: Trainer, reference: Trainer) -> float:
    """Median over rounds of the throughput ratio within each round (robust to load that drifts)."""
    return statistics.median(a / b for a, b in zip(trainer.rates, reference.rates))


if __name__ == "__main__":
    main()
