"""The known-answer rows on tiny Hugging Face models (random weights, some set by hand): query
temperatures of NoPE layers, the per-layer detector, and learned sink masses.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import transformers as T

from nopelens.analyses.audit import Tolerance
from nopelens.analyses.audit.core import make_subject
from nopelens.analyses.audit.detector import declared_reading, detect
from nopelens.analyses.validate_decoders import LENGTH, SEED, Row, random_tokens, small_decoder
from nopelens.models.adapters import bridge_hf_model, hook_hf_model
from nopelens.models.hf import QueryScale
from nopelens.probes import collect
from nopelens.probes.sinks import sink_table

TINY_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Special token ids inside the tiny HF models' 64-token vocabulary."""


def _hf_model(cls, config, seed: int):
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(config).eval()


def _row_factors(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per query row, the least-squares factor c with (log p_after - own) = c (log p_before - own),
    over heads and visible keys; ``[query_pos]`` (row 0, with no other key, gets 1)."""

    def centred(p):
        logp = p.double().clamp(min=1e-300).log()
        visible = p > 0
        return (logp - logp.diagonal(dim1=-2, dim2=-1)[..., :, None]).masked_fill(~visible, 0.0)

    a, b = centred(after[0]), centred(before[0])  # [head, query, key]
    norm = (b * b).sum((0, 2))
    return torch.where(norm > 0, (a * b).sum((0, 2)) / norm.clamp(min=1e-300), torch.ones_like(norm))


def check_query_temperatures(seed: int = SEED) -> list[Row]:
    """The NoPE-layer query temperatures of Llama 4 and Beam, measured, against their formulas.

    A temperature tau_i multiplies query i, so the row-centred scores s_ij - s_ii (= log p_ij -
    log p_ii) of row i are multiplied by it; the factor of each row is fitted by least squares
    between two runs with the layer's input fixed:

    - Llama 4 (``attn_temperature_tuning``, floor_scale 4, attn_scale 0.1): tuning off against on;
      the factor is tau(i) = 1 + 0.1 log1p(floor((i + 1) / 4)), i the token index;
    - Beam: position ids p against p + 100000; the factor is tau(p + 100000) / tau(p) with
      tau(p) = (1 + (p + 1) / 2048)^0.1.
    """
    index = torch.arange(LENGTH)
    rows = []
    config = T.Llama4TextConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_local_experts=2,
        vocab_size=64,
        no_rope_layers=[1, 0],
        floor_scale=4,
        attn_scale=0.1,
        attn_temperature_tuning=True,
        initializer_range=0.2,
        attention_chunk_size=LENGTH,
        **TINY_SPECIAL,
    )
    llama4 = _hf_model(T.Llama4ForCausalLM, config, seed)
    tokens = random_tokens(1, LENGTH, 0, 64, seed)
    attention = llama4.model.layers[1].self_attn
    patterns = []
    for tuning in (False, True):
        attention.attn_temperature_tuning = tuning
        patterns.append(llama4(tokens, attention_mask=torch.ones_like(tokens), output_attentions=True).attentions[1])
    measured = _row_factors(patterns[0], patterns[1])
    expected = QueryScale("llama4", "index", 4.0, 0.1).factor(index)
    rows.append(
        Row(
            "llama4_query_temperature",
            "tiny Llama 4, NoPE layer 1, floor_scale 4",
            "max |fitted row factor - tau(i)| over query rows 1..15",
            0.0,
            float((measured[1:] - expected[1:]).abs().max()),
            "==",
            1e-4,
            "tau(i) = 1 + attn_scale log1p(floor((i + 1) / floor_scale)), i the token index",
        )
    )

    config = T.BeamConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        vocab_size=64,
        initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=LENGTH,
        **TINY_SPECIAL,
    )
    beam = hook_hf_model(_hf_model(T.BeamForCausalLM, config, seed))
    ids = index[None]
    held = {}

    def hold(x, hook):
        if "x" in held:
            return held["x"]
        held["x"] = x.detach().clone()
        return None

    shifted_patterns = []
    for shift in (0, 100_000):
        with beam.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", hold)]):
            _, cache = beam.run_with_cache(
                tokens,
                attention_mask=torch.ones_like(tokens),
                position_ids=ids + shift,
                names_filter="blocks.1.attn.hook_pattern",
            )
        shifted_patterns.append(cache["blocks.1.attn.hook_pattern"])
    measured = _row_factors(shifted_patterns[0], shifted_patterns[1])
    tau = QueryScale("beam", "position")
    expected = tau.factor(index + 100_000) / tau.factor(index)
    rows.append(
        Row(
            "beam_query_temperature",
            "tiny Beam, NoPE layer 1, positions + 100000",
            "max |fitted row factor - tau(p + 100000) / tau(p)| over query rows 1..15",
            0.0,
            float((measured[1:] - expected[1:]).abs().max()),
            "==",
            1e-4,
            "tau(p) = (1 + (p + 1) / 2048)^0.1, p the position id",
        )
    )
    return rows


def check_detector(seed: int = SEED) -> list[Row]:
    """The per-layer detector on models whose layers are known: a Decoder with NoPE, RoPE, ALiBi
    and NoPE layers, and SmolLM3 with ``no_rope_layers`` [0, 1, 1, 0] (1 = RoPE, as its config
    docstring says). Each layer's reading must be what its method implies (nope or relative)."""
    tokens = random_tokens(2, LENGTH, 3, 16, seed)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    decoder = small_decoder(seed, n_layers=4, position=["nope", "rope", "alibi", "nope"], init_std=0.3)
    config = T.SmolLM3Config(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        no_rope_layers=[0, 1, 1, 0],
        initializer_range=0.2,
        **TINY_SPECIAL,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smollm3 = bridge_hf_model(_hf_model(T.SmolLM3ForCausalLM, config, seed))
    rows = []
    for name, model, label in (
        ("detector_decoder_hybrid", decoder, "Decoder nope, rope, alibi, nope"),
        ("detector_smollm3", smollm3, "tiny SmolLM3, no_rope_layers [0, 1, 1, 0]"),
    ):
        subject, _ = make_subject(model, None)
        readings = detect(subject, tokens, mask, Tolerance())
        right = sum(r.reading == declared_reading(subject, r.layer) for r in readings)
        rows.append(
            Row(
                name,
                label,
                "layers whose measured reading is the declared one",
                float(len(readings)),
                float(right),
                "==",
                0.0,
                "NoPE layers bitwise unchanged under re-spaced positions, "
                "rotating and ALiBi layers changed but shift-invariant",
            )
        )
    return rows


def check_learned_sinks(seed: int = SEED) -> list[Row]:
    """Known sink masses: with q = 0 every score of a row of n visible keys is 0, so a sink logit s
    takes e^s / (e^s + n) of it; with s = log 2, 2 / (n + 2). Full-attention layer 0 of Flint (a
    learned logit in the denominator, GPT-OSS style) and of Granite SWA (the same as an output scale
    sigmoid(lse - s)): mean over queries i of 2 / (i + 3), read by ``sink_table``."""
    base = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        initializer_range=0.2,
        **TINY_SPECIAL,
    )
    models = {
        "flint": (
            T.FlintForCausalLM,
            T.FlintConfig(
                **base,
                head_dim=8,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                layer_types=["full_attention"],
            ),
            "learned",
        ),
        "granite_swa": (
            T.GraniteSWAForCausalLM,
            T.GraniteSWAConfig(**base, layer_types=["full_attention"]),
            "output_scale",
        ),
    }
    expected = float(np.mean([2.0 / (i + 3) for i in range(LENGTH)]))
    # no pad id: its embedding row is zero, and a query whose values are all zero shows no output scale
    tokens = random_tokens(3, LENGTH, TINY_SPECIAL["pad_token_id"] + 1, 64, seed)
    rows = []
    for name, (cls, config, kind) in models.items():
        hf_model = _hf_model(cls, config, seed)
        attention = hf_model.model.layers[0].self_attn
        attention.q_proj.weight.data.zero_()
        attention.sinks.data.fill_(float(np.log(2.0)))
        model = hook_hf_model(hf_model)
        sites = ["blocks.0.attn.hook_pattern"] + (
            ["blocks.0.attn.hook_v", "blocks.0.attn.hook_z"] if kind == "output_scale" else []
        )
        acts = collect(model, tokens, sites)
        table = sink_table(acts, n_tokens=LENGTH, sinks={0: (kind, attention.sinks.detach())})
        rows.append(
            Row(
                f"{name}_sink_mass",
                f"tiny {name}, q = 0, sink logit log 2 ({kind})",
                "mean learned_sink_mass over heads",
                expected,
                float(table["learned_sink_mass"].mean()),
                "==",
                1e-5,
                "e^s / (e^s + n) = 2 / (n + 2) for n = i + 1 visible keys",
            )
        )
    return rows
