"""The position-method options of Kazemnejad et al. 2023's models, checked against their formulas:
one T5 table shared by every layer, scores without 1/sqrt(d_head) (T5's convention), RoPE on a
quarter of each head in interleaved pairs; each saved and loaded, and audited."""

import math

import pytest
import torch

from nopelens.analyses.audit import audit
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.checkpoint import load_checkpoint, save_checkpoint
from nopelens.models.positions import apply_rope

TOKENS = torch.randint(0, 20, (3, 11), generator=torch.Generator().manual_seed(0))


def decoder(**overrides) -> Decoder:
    config = dict(
        d_vocab=20, n_ctx=32, n_layers=3, d_model=32, n_heads=4, position="t5", t5_num_buckets=8, t5_max_distance=12
    )
    config.update(overrides)
    model = Decoder(DecoderConfig(**config), seed=0)
    with torch.no_grad():  # a bias large enough to matter
        for layer, (name, param) in enumerate(model.named_parameters()):
            if name.endswith("W_rel_bias"):
                param.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(layer))
    return model


def test_a_shared_t5_table_gives_identical_biases_in_every_layer():
    shared, per_layer = decoder(t5_shared=True), decoder()
    assert [n for n in shared.state_dict() if "W_rel_bias" in n] == ["blocks.0.attn.W_rel_bias"]
    assert len([n for n in per_layer.state_dict() if "W_rel_bias" in n]) == 3
    for model, same in ((shared, True), (per_layer, False)):
        _, cache = model.run_with_cache(TOKENS)
        biases = [cache[f"blocks.{layer}.attn.hook_pos_bias"] for layer in range(3)]
        assert all(torch.equal(biases[0], bias) for bias in biases[1:]) == same
    loss = shared(TOKENS).square().mean()
    loss.backward()  # every layer's use of the one table reaches its gradient
    assert shared.blocks[0].attn.W_rel_bias.grad.abs().sum() > 0
    with torch.no_grad():
        shared.blocks[0].attn.W_rel_bias.zero_()
    _, cache = shared.run_with_cache(TOKENS)
    assert all(cache[f"blocks.{layer}.attn.hook_pos_bias"].abs().max() == 0 for layer in range(3))


def test_a_hybrid_shares_the_table_of_its_first_t5_layer():
    model = decoder(position=["nope", "t5", "t5"], t5_shared=True)
    assert [n for n in model.state_dict() if "W_rel_bias" in n] == ["blocks.1.attn.W_rel_bias"]
    _, cache = model.run_with_cache(TOKENS)
    assert torch.equal(cache["blocks.1.attn.hook_pos_bias"], cache["blocks.2.attn.hook_pos_bias"])


@pytest.mark.parametrize("position", ["nope", "alibi", "rope"])
def test_unscaled_scores_equal_scaled_ones_with_w_q_times_sqrt_d_head(position):
    unscaled = decoder(position=position, score_scale=1.0)
    scaled = decoder(position=position)
    factor = math.sqrt(scaled.cfg.d_head)
    with torch.no_grad():
        for block in scaled.blocks:
            block.attn.W_Q.mul_(factor)
            block.attn.b_Q.mul_(factor)
    assert torch.allclose(unscaled(TOKENS), scaled(TOKENS), atol=1e-5)  # the fused kernel's scale
    _, cache = unscaled.run_with_cache(TOKENS)  # the explicit path, hooked
    q, k = (cache[f"blocks.0.attn.hook_{'rot_' if position == 'rope' else ''}{name}"] for name in "qk")
    assert torch.allclose(cache["blocks.0.attn.hook_content_scores"], torch.einsum("bqhe,bkhe->bhqk", q, k), atol=1e-5)
    assert torch.allclose(unscaled.run_with_cache(TOKENS)[0], unscaled(TOKENS), atol=1e-5)


def test_the_papers_rotary_turns_a_quarter_of_each_head_in_interleaved_pairs():
    model = decoder(position="rope", rotary_fraction=0.25, pairing="interleaved", score_scale=1.0)
    assert model.cfg.rotary_dim == model.cfg.d_head // 4 == 2
    _, cache = model.run_with_cache(TOKENS)
    q, rotated = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_rot_q"]
    assert torch.equal(rotated[..., 2:], q[..., 2:])  # three quarters pass through
    p = torch.arange(TOKENS.shape[1]).float()[None, :, None]  # theta_0 = 1: dims 0, 1 turn by p radians
    expected_0 = q[..., 0] * torch.cos(p) - q[..., 1] * torch.sin(p)
    assert torch.allclose(rotated[..., 0], expected_0, atol=1e-5)
    assert torch.allclose(rotated, apply_rope(q, torch.arange(11).expand(3, -1), 2, 10000.0, "interleaved"), atol=1e-6)


def test_options_round_trip_through_a_checkpoint(tmp_path):
    for i, options in enumerate(
        (
            dict(t5_shared=True, score_scale=1.0),
            dict(position="rope", rotary_fraction=0.25, pairing="interleaved", score_scale=0.5),
        )
    ):
        model = decoder(**options)
        loaded = load_checkpoint(save_checkpoint(tmp_path / str(i), model)).model
        assert loaded.cfg == model.cfg and loaded.cfg.to_dict()["score_scale"] == options["score_scale"]
        assert torch.equal(loaded(TOKENS), model(TOKENS))
    assert "t5_shared" not in DecoderConfig(d_vocab=5, n_ctx=8).to_dict()  # older configs keep their digests
    assert "score_scale" not in DecoderConfig(d_vocab=5, n_ctx=8).to_dict()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(score_scale=0.0), "score_scale"),
        (dict(score_scale=float("nan")), "score_scale"),
        (dict(score_scale="1"), "score_scale"),
        (dict(t5_shared="yes"), "t5_shared"),
    ],
)
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(d_vocab=5, n_ctx=8, **bad)


@pytest.mark.parametrize(
    "options",
    [
        dict(t5_shared=True, score_scale=1.0),
        dict(position="rope", rotary_fraction=0.25, pairing="interleaved", score_scale=1.0),
        dict(position="nope", score_scale=1.0),
    ],
)
def test_the_audit_passes_on_the_papers_choices(options):
    report = audit(decoder(**options), eval_length=12)
    assert report.passed, report.summary()
