"""T5 relative position bias (issue 11): buckets and bias equal HF's T5Attention, and the method
works wherever a method works (hooks, fused path, KV cache, left padding, checkpoints, train)."""

import pytest
import torch
from schema import assert_documented
from transformers import T5Config
from transformers.models.t5.modeling_t5 import T5Attention

from nopelens.analyses.cli import main
from nopelens.models import Decoder, DecoderConfig, KVCache
from nopelens.models.checkpoint import load_checkpoint, save_checkpoint
from nopelens.models.methods import METHODS, SCORE_BIAS, get_method
from nopelens.models.positions import t5_relative_bucket

# distances 0 .. 3 max_distance, i.e. far beyond the last log bucket, and future offsets
OFFSETS = torch.arange(-400, 6)


@pytest.mark.parametrize(
    "num_buckets,max_distance,bidirectional",
    [
        (32, 128, False),
        (8, 20, False),
        (6, 5, False),
        (2, 3, False),  # a decoder's unidirectional buckets
        (32, 128, True),
        (8, 20, True),
        (6, 5, True),  # an encoder's (two buckets per direction at least)
    ],
)
def test_buckets_equal_hf(num_buckets, max_distance, bidirectional):
    ours = t5_relative_bucket(OFFSETS, bidirectional, num_buckets, max_distance)
    theirs = T5Attention._relative_position_bucket(OFFSETS, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, theirs)
    distance = (-OFFSETS).clamp(min=0)
    if not bidirectional:
        assert (ours[distance >= max_distance] == num_buckets - 1).all()  # one bucket past max_distance
        assert torch.equal(
            ours[(distance < num_buckets // 2) & (OFFSETS <= 0)],
            distance[(distance < num_buckets // 2) & (OFFSETS <= 0)],
        )  # exact near


def model(length=48, **overrides):
    config = dict(
        d_vocab=31, n_ctx=length, n_layers=2, d_model=32, n_heads=4, position="t5", t5_num_buckets=8, t5_max_distance=20
    )
    config.update(overrides)
    m = Decoder(DecoderConfig(**config), seed=0).eval()
    with torch.no_grad():  # a bias large enough that a wrong bucket changes the output
        for block in m.blocks:
            block.attn.W_rel_bias.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
    return m


def test_bias_equals_hf_compute_bias_past_max_distance():
    """Our hook_pos_bias is HF's T5Attention.compute_bias (decoder) with the same table."""
    ours = model()
    hf_config = T5Config(
        d_model=32,
        d_kv=8,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        is_decoder=True,
    )
    hf = T5Attention(hf_config, has_relative_attention_bias=True)
    with torch.no_grad():
        hf.relative_attention_bias.weight.copy_(ours.blocks[0].attn.W_rel_bias)
    length = 48  # distances up to 47 > max_distance 20
    _, cache = ours.run_with_cache(
        torch.randint(0, 31, (1, length)), names_filter=lambda n: n.endswith("hook_pos_bias")
    )
    expected = hf.compute_bias(length, length)
    assert torch.allclose(cache["blocks.0.attn.hook_pos_bias"], expected, atol=0, rtol=0)
    # with a cache offset, HF's past_seen_tokens: the last 5 queries against all keys
    past = hf.compute_bias(5, length, past_seen_tokens=length - 5)
    assert torch.equal(cache["blocks.0.attn.hook_pos_bias"][:, :, -5:], past)


def test_declarations():
    t5 = get_method("t5")
    assert METHODS["t5"] is type(t5) and t5.acts_on == {SCORE_BIAS}
    assert not t5.absolute and t5.per_layer and t5.reads_positions
    m = model()
    assert "blocks.0.attn.hook_pos_bias" in m.hook_dict and "blocks.0.attn.hook_rot_q" not in m.hook_dict
    assert m.blocks[0].attn.W_rel_bias.shape == (8, 4)


def test_fused_path_kv_cache_and_left_padding():
    m = model()
    x = torch.randint(0, 31, (2, 40), generator=torch.Generator().manual_seed(2))
    full = m(x)  # fused (no hook asks for scores)
    m.set_fused_attention(False)
    assert torch.allclose(m(x), full, atol=1e-5)
    m.set_fused_attention(True)
    cache = KVCache.empty(m.cfg, 2)
    pieces = [m(x[:, :25], past_kv=cache)] + [m(x[:, t : t + 1], past_kv=cache) for t in range(25, 40)]
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)
    padded = torch.cat([torch.zeros(1, 7, dtype=torch.long), x[:1, :33]], 1)
    mask = torch.cat([torch.zeros(1, 7, dtype=torch.long), torch.ones(1, 33, dtype=torch.long)], 1)
    assert torch.allclose(m(padded, attention_mask=mask)[:, 7:], full[:1, :33], atol=1e-5)
    # relative: shifting every position by a constant changes nothing
    ids = torch.arange(40)[None].expand(2, -1)
    assert torch.allclose(m(x, position_ids=ids + 11), full, atol=1e-5)


def test_config_fields_validated_and_saved(tmp_path):
    with pytest.raises(ValueError, match="t5_max_distance"):
        DecoderConfig(d_vocab=5, n_ctx=8, position="t5", t5_num_buckets=8, t5_max_distance=4)
    with pytest.raises(ValueError, match="t5_num_buckets"):
        DecoderConfig(d_vocab=5, n_ctx=8, t5_num_buckets=0)
    assert "t5_num_buckets" not in DecoderConfig(d_vocab=5, n_ctx=8).to_dict()  # older digests unchanged
    m = model()
    save_checkpoint(tmp_path / "ckpt", m)
    loaded = load_checkpoint(tmp_path / "ckpt").model
    assert loaded.cfg == m.cfg and loaded.cfg.t5_max_distance == 20
    x = torch.randint(0, 31, (1, 30))
    assert torch.equal(loaded(x), m(x))


def test_cli_train_t5(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--task",
                "copy",
                "--position",
                "t5",
                "--layers",
                "1",
                "--steps",
                "3",
                "--out",
                str(out),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    trained = load_checkpoint(out / "checkpoint").model
    assert_documented(out / "loss_curve.csv", "train: loss_curve.csv")
    assert trained.cfg.position == "t5" and trained.cfg.layer_methods == (get_method("t5"),)
    assert "blocks.0.attn.W_rel_bias" in dict(trained.named_parameters())
