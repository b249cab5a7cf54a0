"""Hand-built NoPE circuits (Kazemnejad et al. 2023, App. C) and the seed demos: exact known values."""

import math

import pandas as pd
import pytest
import torch
from schema import assert_documented

from nopelens import circuits
from nopelens.analyses.cli import main
from nopelens.circuits import demos
from nopelens.circuits.layout import ATTENDED_POSITION, CONTENT_START, COUNTER, POSITION, POSITION_SQ
from nopelens.models import Decoder, DecoderConfig


def layer1(model, tokens, **kwargs):
    with torch.no_grad():
        return model(tokens, stop_at_layer=1, **kwargs)


# ----------------------------------------------------------------------------- Theorem 1
@pytest.mark.parametrize("n_ctx", [2, 3, 64, 2048])
def test_counter_is_exact_for_every_position(n_ctx):
    model = circuits.counter(n_ctx)
    assert model.cfg.normalization == "none" and model.cfg.act_fn == "relu"
    resid = layer1(model, circuits.circuit_tokens(model, seed=n_ctx))[0].double()
    i = torch.arange(n_ctx, dtype=torch.float64)
    assert (resid[:, COUNTER] - 1 / (i + 1)).abs().max() <= 1e-6
    assert (resid[:, POSITION] - i).abs().max() <= 1e-4
    assert (resid[:, POSITION_SQ] - i**2).abs().max() <= 1e-6 * max(1.0, float(i[-1] ** 2))


def test_counter_ignores_token_content():
    model = circuits.counter(32, d_vocab=5)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # arbitrary content embeddings for every token, BOS included
        model.embed.W_E[:, CONTENT_START:] = torch.randn(5, model.cfg.d_model - CONTENT_START, generator=generator)
    i = torch.arange(32, dtype=torch.float64)
    for seed in range(3):
        resid = layer1(model, circuits.circuit_tokens(model, seed=seed))[0].double()
        assert (resid[:, COUNTER] - 1 / (i + 1)).abs().max() <= 1e-6
        assert (resid[:, POSITION] - i).abs().max() <= 1e-4


def test_interpolant_construction_is_exact_in_its_documented_range():
    model = circuits.counter(128, construction="interpolant")
    assert model.cfg.d_mlp == 127
    trace = circuits.counter_trace(model)
    assert trace.position_error.max() <= 1e-4
    assert (trace.counter - trace.expected_counter).abs().max() <= 1e-6


def test_counter_is_identically_zero_without_bos():
    model = circuits.counter(64)
    resid = layer1(model, circuits.circuit_tokens(model, seed=3, bos=False))[0]
    assert torch.equal(resid[:, COUNTER], torch.zeros(64))
    checks = circuits.check_counter(model)
    assert checks["no_bos_counter_max_abs"] == 0.0
    assert checks["counter_max_error"] <= 1e-6 and checks["position_max_error"] <= 1e-4


def test_counter_counts_real_tokens_under_left_padding():
    model = circuits.counter(16)
    tokens = circuits.circuit_tokens(model, length=10, seed=4)
    padded = torch.cat([torch.full((1, 6), 3), tokens], dim=1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], dim=1)
    alone = layer1(model, tokens)[0]
    with_padding = layer1(model, padded, attention_mask=mask)[0, 6:]
    assert torch.allclose(alone, with_padding, atol=1e-6)
    assert torch.equal(with_padding[:, POSITION], torch.arange(10.0))


def test_circuit_info_names_the_dimensions():
    model = circuits.counter(8)
    info = model.circuit
    assert (info.counter_dim, info.position_dim) == (COUNTER, POSITION)
    assert info.content_dims == (CONTENT_START, model.cfg.d_model)
    assert "counter" in info.describe() and "position" in info.describe()


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="n_ctx"):
        circuits.counter(1)
    with pytest.raises(ValueError, match="construction"):
        circuits.counter(8, construction="lookup")
    with pytest.raises(ValueError, match="not an official ALiBi slope"):
        circuits.distance(8, slope=0.3)
    with pytest.raises(ValueError, match="sharpness"):
        circuits.previous_token(8, sharpness=0.0)


# ----------------------------------------------------------------------------- Theorem 2
@pytest.mark.parametrize("slope", [0.5, 0.0625, 2.0**-0.5])
def test_distance_head_equals_the_decoders_alibi_head(slope):
    n_ctx = 256
    model = circuits.distance(n_ctx, slope=slope)
    reference = circuits.alibi_reference_pattern(n_ctx, slope)
    for seed in (0, 1):
        pattern = circuits.head_pattern(model, circuits.circuit_tokens(model, seed=seed))
        assert (pattern - reference).abs().max() <= 1e-5  # every query row 0 .. n_ctx - 1


def test_distance_check_detects_a_different_slope():
    model = circuits.distance(32, slope=0.5)
    pattern = circuits.head_pattern(model, circuits.circuit_tokens(model))
    assert (pattern - circuits.alibi_reference_pattern(32, 0.25)).abs().max() > 1e-2
    assert circuits.check_distance(model)["pattern_max_error"] <= 1e-5


def test_distance_scores_and_output():
    model = circuits.distance(16, slope=0.25)
    tokens = circuits.circuit_tokens(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    scores = cache["blocks.1.attn.hook_content_scores"][0, 0]
    i = torch.arange(16.0)
    visible = i[:, None] >= i[None, :]
    expected = -0.25 * (i[:, None] - i[None, :])
    assert torch.allclose(scores[visible], expected[visible], atol=1e-5)
    pattern = cache["blocks.1.attn.hook_pattern"][0, 0]
    written = cache["blocks.1.hook_resid_post"][0, :, ATTENDED_POSITION]
    assert torch.allclose(written, pattern @ i, atol=1e-5)


def test_alibi_head_for_slope_uses_the_decoders_slopes():
    from nopelens.models.positions import alibi_slopes

    for slope in (0.5, 0.25, 0.125, 2.0**-8):
        n_heads, head = circuits.alibi_head_for_slope(slope)
        assert alibi_slopes(n_heads)[head].item() == pytest.approx(slope)


@pytest.mark.parametrize("n_ctx", [2, 256])
def test_previous_token_head_puts_its_mass_on_i_minus_1(n_ctx):
    model = circuits.previous_token(n_ctx)
    tokens = circuits.circuit_tokens(model, seed=5)
    pattern = circuits.head_pattern(model, tokens)
    rows = torch.arange(1, n_ctx)
    assert pattern[rows, rows - 1].min() > 0.99
    assert pattern[0, 0] == pytest.approx(1.0)
    checks = circuits.check_previous_token(model, seed=5)
    assert checks["min_previous_mass"] > 0.99


def test_previous_token_mass_follows_the_sharpness():
    # c = 1: key j = i trails by e^-1, key j = i - 1 - d by e^-(d^2), so the mass on i - 1 is
    # 1 / (1 + e^-1 + sum_d e^-(d^2)) ~ 0.58, far below the c = 10 head's > 0.99
    model = circuits.previous_token(32, sharpness=1.0)
    mass = circuits.previous_token_mass(model)
    expected = 1 / (1 + math.exp(-1) + sum(math.exp(-(d**2)) for d in range(1, 6)))
    assert mass.previous_mass[6:].to_numpy() == pytest.approx(expected, abs=1e-5)


# ----------------------------------------------------------------------------- variance control
CONSTANT_MODELS = {
    "counter": lambda: circuits.counter(32),
    "distance": lambda: circuits.distance(32),
    "previous_token": lambda: circuits.previous_token(32),
    "random_nope_layernorm": lambda: Decoder(
        DecoderConfig(d_vocab=16, n_ctx=32, n_layers=3, d_model=32, n_heads=4), seed=1
    ),
}


@pytest.mark.parametrize("name", list(CONSTANT_MODELS))
@pytest.mark.parametrize("token", [0, 3])
def test_constant_input_without_distinct_bos_is_uniform_and_position_free(name, token):
    model = CONSTANT_MODELS[name]()
    control = demos.constant_input_control(model, token=token, length=32)
    assert control["max_pattern_deviation"] <= 1e-6
    assert control["max_residual_spread"] <= 1e-6 * max(1.0, control["max_residual_abs"])


def test_constant_input_control_sees_position_when_bos_is_distinct():
    model = circuits.counter(32)
    tokens = torch.full((1, 32), 3)
    tokens[0, 0] = 0
    resid = layer1(model, tokens)[0]
    assert (resid - resid[:1]).abs().max() > 1.0  # the control above could fail
    with pytest.raises(ValueError, match="NoPE"):
        demos.constant_input_control(Decoder(DecoderConfig(d_vocab=8, n_ctx=8, position="rope"), seed=0), 1, 8)


# ----------------------------------------------------------------------------- seed demos
def test_fig_004_causal_table():
    table = demos.causal_table()
    expected = pd.DataFrame(
        [["Allowed", "Blocked", "Blocked"], ["Allowed", "Allowed", "Blocked"], ["Allowed", "Allowed", "Allowed"]],
        index=["grid", "load", "rises"],
        columns=["grid", "load", "rises"],
    )
    assert (table.to_numpy() == expected.to_numpy()).all()
    assert list(table.index) == list(expected.index) and list(table.columns) == list(expected.columns)
    assert demos.rows_with_no_allowed_key(table) == []
    assert demos.rows_with_no_allowed_key(table.replace("Allowed", "Blocked")) == ["grid", "load", "rises"]


def test_fully_masked_input_is_rejected_by_the_decoder():
    assert "masks every position" in demos.fully_masked_rejection()


def test_blocking_is_not_scoring_zero():
    table = demos.blocking_vs_zero_score()
    assert table.loc["rises", "blocked"] == 0.0
    assert table.loc["rises", "zero_score"] == pytest.approx(math.exp(0) / sum(math.exp(s) for s in (1.0, 2.0, 0.0)))
    for column in ("unmasked", "zero_score", "blocked"):
        assert table[column].sum() == pytest.approx(1.0)
    allowed = ["grid", "load"]
    assert table.loc[allowed, "blocked"].to_numpy() == pytest.approx(table.loc[allowed, "renormalized"].to_numpy())
    assert table.loc["grid", "blocked"] == pytest.approx(math.exp(1) / (math.exp(1) + math.exp(2)))
    # every remaining weight changes: blocked > zero-score > unmasked for both allowed keys
    assert (table.loc[allowed, "blocked"] > table.loc[allowed, "zero_score"]).all()


def test_permutation_equivariance_seed_001():
    result = demos.permutation_equivariance()
    assert result["all_visible"] is True and result["all_visible_max_error"] < 1e-12
    assert result["fixed_causal_mask"] is False and result["fixed_causal_mask_max_error"] > 1e-3
    assert result["permuted_causal_mask"] is True
    assert result["nope_decoder_causal"] is False
    for seed in (1, 2):
        other = demos.permutation_equivariance(permutation=(3, 1, 4, 0, 2), seed=seed)
        assert (other["all_visible"], other["fixed_causal_mask"], other["permuted_causal_mask"]) == (True, False, True)
    with pytest.raises(ValueError, match="identity"):
        demos.permutation_equivariance(permutation=(0, 1, 2))
    with pytest.raises(ValueError, match="permutation"):
        demos.permutation_equivariance(permutation=(0, 0, 2))


# ----------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("subject", ["counter", "distance", "previous-token", "equivariance", "mask-table"])
def test_circuit_command_writes_figure_and_checks(subject, tmp_path, capsys):
    assert main(["circuit", subject, "--n-ctx", "12", "--out", str(tmp_path)]) == 0
    stem = subject.replace("-", "_")
    for name in (f"{stem}.png", f"{stem}.svg", f"{stem}_checks.csv"):
        assert (tmp_path / name).stat().st_size > 0
    assert not list(tmp_path.glob(".*tmp"))
    checks = pd.read_csv(tmp_path / f"{stem}_checks.csv")
    assert checks.passed.dropna().astype(bool).all()
    assert_documented(checks, "circuit: <subject>_checks.csv")
    if subject in ("distance", "previous-token"):  # patterns are one image, not n_ctx^2 vector cells
        assert (tmp_path / f"{stem}.svg").stat().st_size < 200_000
    assert "wrote" in capsys.readouterr().out


def test_circuit_command_user_error_exits_2(tmp_path, capsys):
    assert main(["circuit", "distance", "--slope", "0.3", "--out", str(tmp_path)]) == 2
    assert "not an official ALiBi slope" in capsys.readouterr().err
