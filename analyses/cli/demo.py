"""``nopelens demo``: build one small decoder per position method and print its hook names."""

from __future__ import annotations

import argparse

import torch

from nopelens.models import POSITION_METHODS, Decoder, DecoderConfig

from .options import seed_type

POSITION_HOOKS = ("hook_pos_embed", "hook_rot_q", "hook_rot_k", "hook_pos_bias")


def demo_models(seed: int = 0) -> dict[str, Decoder]:
    """One tiny 2-layer decoder per position method, keyed by method name."""
    return {
        method: Decoder(DecoderConfig(d_vocab=16, n_ctx=16, position=method, d_model=32, n_heads=4), seed=seed)
        for method in POSITION_METHODS
    }


def run(args: argparse.Namespace) -> int:
    tokens = torch.arange(8).unsqueeze(0)
    for method, model in demo_models(args.seed).items():
        logits, cache = model.run_with_cache(tokens)
        position_hooks = [n for n in cache.keys() if n.rsplit(".", 1)[-1] in POSITION_HOOKS]
        print(
            f"{method:>10}: {len(cache.keys())} hooks, logits {tuple(logits.shape)}; "
            f"position hooks: {position_hooks or 'none (only the causal mask)'}"
        )
        if args.verbose:
            print("            " + ", ".join(cache.keys()))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="build one model per position method and print its hook names",
        description="Build one small decoder per position method and print its hook names.",
        epilog="example: nopelens demo --verbose",
    )
    parser.add_argument("--seed", type=seed_type, default=0, help="seed of the models' weights (default %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="print every hook name")
    parser.set_defaults(func=run)
