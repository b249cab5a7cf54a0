"""Attention-sink mass, Gu et al. sink rate, BOS comparison and variance shrinkage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import Activations, collect
from nopelens.probes.sinks import (
    attention_variance,
    compare_bos,
    prepend_bos,
    sink_index,
    sink_mass,
    sink_mass_by_position,
    sink_rate,
    sink_scores,
    sink_table,
    strip_padding,
    uniform_sink_score,
    variance_shrinkage,
    variance_slopes,
)


def uniform_causal(n: int, n_heads: int = 1) -> np.ndarray:
    return np.broadcast_to(np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None], (n_heads, n, n)).copy()


def test_causal_sink_mass_and_score_are_the_plain_means_and_the_tables_read():
    """Without a window the sink mass and Gu's score are the means of the first-key column (rows 1.. and
    0..T-1). sink_mass/sink_scores and sink_table sum one read (first_key_sums, float64): equal to float64
    round-off; the plain float32 numpy mean differs by float32 round-off (bit-identity is not the contract)."""
    rng = np.random.default_rng(0)
    patterns = []
    for _ in range(40):
        x = rng.random((3, 64, 64)).astype(np.float32) * np.tril(np.ones((64, 64), np.float32))
        patterns.append(x / x.sum(-1, keepdims=True))
    plain_mass = np.concatenate([p[:, 1:, 0] for p in patterns], axis=1).mean(1)
    plain_score = np.concatenate([p[:, :16, 0] for p in patterns], axis=1).mean(1)
    np.testing.assert_allclose(sink_mass(patterns), plain_mass, rtol=1e-6)
    np.testing.assert_allclose(sink_scores(patterns, n_tokens=16), plain_score, rtol=1e-6)
    acts = Activations(
        acts={},
        sequence_id=np.zeros(0, int),
        position=np.zeros(0, int),
        token=np.zeros(0, int),
        patterns={"blocks.0.attn.hook_pattern": patterns},
    )
    table = sink_table(acts, n_tokens=16)
    np.testing.assert_allclose(table["sink_mass"], sink_mass(patterns), rtol=1e-12)
    np.testing.assert_allclose(table["sink_score"], sink_scores(patterns, n_tokens=16), rtol=1e-12)


def test_left_padded_sink_is_the_first_real_token():
    mask = np.array([[0, 0, 1, 1, 1]])  # [pad, pad, BOS, a, b]
    assert sink_index(mask).tolist() == [2]
    allowed = np.tril(np.ones((5, 5))) * mask  # causal and not padding
    allowed[:2] = 1  # padded query rows attend anywhere: they must not count
    pattern = (allowed / allowed.sum(-1, keepdims=True))[None, None]
    stripped = strip_padding(pattern, mask)
    assert stripped[0].shape == (1, 3, 3)
    assert sink_mass(stripped)[0] == pytest.approx(0.416667, abs=1e-6)


def test_gu_sink_score_of_uniform_attention_and_strict_threshold():
    assert uniform_sink_score(64) == pytest.approx(0.0741, abs=5e-5)
    layers = {f"blocks.{l}.attn.hook_pattern": [uniform_causal(64, 2)] * 3 for l in range(2)}
    acts = Activations(
        acts={}, sequence_id=np.zeros(0, int), position=np.zeros(0, int), token=np.zeros(0, int), patterns=layers
    )
    table = sink_table(acts)
    np.testing.assert_allclose(table.sink_score, uniform_sink_score(64))
    assert sink_rate(table) == 0.0 and len(table) == 4
    # rows i >= 1 give key 0 exactly 1/2: score (1 + 3/2) / 4 = 0.625; a sink only above it
    half = np.tril(np.ones((4, 4))) * 0.5 / np.maximum(np.arange(4), 1)[:, None]
    half[:, 0] = 0.5
    half[0] = [1, 0, 0, 0]
    assert sink_scores([half[None]], n_tokens=4)[0] == 0.625
    acts.patterns = {"blocks.0.attn.hook_pattern": [half[None]]}
    assert sink_rate(sink_table(acts, eps=0.625, n_tokens=4)) == 0.0
    assert sink_rate(sink_table(acts, eps=0.624, n_tokens=4)) == 1.0
    with pytest.raises(ValueError, match="fewer than T=64"):
        sink_scores([uniform_causal(10)])


def test_sink_mass_by_position_pools_sequences_of_different_lengths():
    mass, count = sink_mass_by_position([uniform_causal(3), uniform_causal(5)])
    assert count.tolist() == [2, 2, 2, 1, 1]
    np.testing.assert_allclose(mass[0], 1 / np.arange(1, 6))


def test_decoder_patterns_padding_never_rows_and_untrained_nope_is_near_uniform():
    cfg = DecoderConfig(d_vocab=100, n_ctx=64, n_layers=2, d_model=32, n_heads=4, position="nope")
    model = Decoder(cfg, seed=0)
    tokens = torch.randint(0, 100, (4, 64), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.zeros(4, 3, dtype=torch.long), tokens], 1)
    mask = torch.cat([torch.zeros(4, 3, dtype=torch.long), torch.ones(4, 64, dtype=torch.long)], 1)
    sites = ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    plain, left = collect(model, tokens, sites), collect(model, padded, sites, attention_mask=mask)
    table, table_left = sink_table(plain), sink_table(left)
    np.testing.assert_allclose(table.sink_mass, table_left.sink_mass, atol=1e-6)
    assert sink_rate(table) == 0.0  # init std 0.02: scores ~ 0, attention ~ uniform
    np.testing.assert_allclose(table.sink_score, uniform_sink_score(64), atol=2e-3)


def test_compare_bos_inserts_bos_after_left_padding():
    tokens, mask = prepend_bos(torch.tensor([[0, 5, 6], [7, 8, 9]]), 1, torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert tokens.tolist() == [[0, 1, 5, 6], [1, 7, 8, 9]] and mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    cfg = DecoderConfig(d_vocab=20, n_ctx=16, n_layers=2, d_model=16, n_heads=2)
    model = Decoder(cfg, seed=0)
    table = compare_bos(model, torch.randint(2, 20, (3, 8)), bos_token_id=1, n_layers=2, n_tokens=8)
    assert sorted(table.condition.unique()) == ["with_bos", "without_bos"]
    assert len(table) == 2 * 2 * 2  # conditions x layers x heads
    with pytest.raises(ValueError, match="fewer than T"):
        compare_bos(model, torch.randint(2, 20, (3, 8)), bos_token_id=1, n_layers=2)


def test_variance_shrinkage_slope_of_untrained_prenorm_nope():
    cfg = DecoderConfig(d_vocab=1000, n_ctx=64, n_layers=1, d_model=64, n_heads=4, position="nope", init_std=0.02)
    model = Decoder(cfg, seed=0)
    tokens = torch.randint(0, 1000, (1000, 64), generator=torch.Generator().manual_seed(0))
    table, slopes = variance_shrinkage(model, tokens, layers=[0])
    assert len(table) == 64 and (table.n_sequences == 1000).all()
    slope = slopes.slope.iloc[0]
    assert -1.05 <= slope <= -0.85
    # the fit is not a formality: variance that does not shrink has slope ~ 0
    flat = table.assign(variance=table.variance.iloc[0])
    flat.loc[flat.index[::2], "variance"] *= 1.01
    assert abs(variance_slopes(flat).slope.iloc[0]) < 0.05


def test_attention_variance_ignores_padding_and_needs_two_sequences():
    rng = np.random.default_rng(0)
    acts = Activations(
        acts={"blocks.0.hook_attn_out": rng.normal(size=(7, 3)).astype(np.float32)},
        sequence_id=np.array([0, 0, 0, 1, 1, 1, 1]),
        position=np.array([0, 1, 2, 0, 1, 2, 3]),
        token=np.zeros(7, int),
    )
    table = attention_variance(acts)
    assert table.position.tolist() == [0, 1, 2]  # position 3 has one sequence
    with pytest.raises(ValueError, match=">= 3 positions"):
        variance_slopes(table.iloc[:2])


def test_compare_bos_hands_no_mask_to_a_module_that_takes_none():
    from nopelens.models.adapters import HookedModule

    model = Decoder(DecoderConfig(d_vocab=20, n_ctx=16, n_layers=1, d_model=16, n_heads=2), seed=0)

    class NoMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = model

        def forward(self, tokens):  # takes no attention_mask
            return self.decoder(tokens)

    hooked = HookedModule(NoMask(), {"blocks.0.attn.hook_pattern": "decoder.blocks.0.attn.hook_pattern"})
    table = compare_bos(hooked, torch.randint(2, 20, (3, 6)), bos_token_id=1, n_layers=1, n_tokens=6)
    assert sorted(table.condition.unique()) == ["with_bos", "without_bos"]


def test_variance_shrinkage_leaves_out_a_shared_bos_and_says_so():
    model = Decoder(DecoderConfig(d_vocab=50, n_ctx=16, n_layers=1, d_model=16, n_heads=2), seed=0)
    tokens = torch.randint(2, 50, (40, 8), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 1
    table, slopes = variance_shrinkage(model, tokens, layers=[0])
    assert table.position.min() == 1 and len(slopes) == 1
    assert table.note.str.contains("position 0 left out").all()
    free, _ = variance_shrinkage(model, tokens[:, 1:], layers=[0])
    assert free.position.min() == 0 and (free.note == "").all()


def test_an_output_scale_row_whose_values_are_zero_is_left_out_of_the_mass():
    """Granite SWA's sink scales each head's output by c = 1 - p_sink; a query whose weighted values
    are 0 (a pad embedding's) shows no c and counted as mass 0 (``nopelens validate --seed 10``
    read 0.2355 for 0.2494)."""
    pattern = np.array([[[1.0, 0.0], [0.5, 0.5]]])  # one head, two queries
    values = np.array([[[0.0, 0.0]], [[2.0, 4.0]]])  # [sample, kv head, d_head]: key 0's value is 0
    outputs = np.array([[[0.0, 0.0]], [[0.6, 1.2]]])  # query 1: c = 0.6 of its weighted value (1, 2)

    def learned_mass(values):
        acts = Activations(
            acts={"blocks.0.attn.hook_v": values, "blocks.0.attn.hook_z": outputs},
            sequence_id=np.zeros(2, int),
            position=np.arange(2),
            token=np.zeros(2, int),
            patterns={"blocks.0.attn.hook_pattern": [pattern]},
        )
        return sink_table(acts, n_tokens=None, sinks={0: ("output_scale", None)})["learned_sink_mass"].tolist()

    assert learned_mass(values) == pytest.approx([0.4])
    with pytest.raises(ValueError, match=r"heads \[0\]: every weighted value is 0"):
        learned_mass(np.zeros_like(values))
