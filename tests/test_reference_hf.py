"""Cross-implementation checks against HF transformers (issue 2; seed 002_c993a97fc3f160f5.txt).

Seed 002: "pair layout, sign, index origin, frequencies, scaling, rotated fraction ... must agree".
Every HF model or module here is built from a config, offline, with random weights. HF keeps
queries as [batch, heads, pos, d_head]; nopelens keeps [batch, pos, head_index, d_head].
"""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaConfig,
)
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, build_alibi_tensor
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary
from transformers.models.gptj.modeling_gptj import GPTJRotaryEmbedding
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply_rotary
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary

from nopelens.models import Decoder, DecoderConfig, decoder_from_gpt2
from nopelens.models.positions import alibi_bias, alibi_slopes, apply_rope, position_ids_from_mask

N_HEADS, D_HEAD = 4, 16
BATCH, SEQ = 2, 12


@pytest.fixture
def qk_and_positions():
    """Random q, k in nopelens layout and irregular (non-contiguous) position ids < 64."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, SEQ, N_HEADS, D_HEAD, generator=generator)
    k = torch.randn(BATCH, SEQ, N_HEADS, D_HEAD, generator=generator)
    positions = torch.randint(0, 64, (BATCH, SEQ), generator=generator)
    return q, k, positions


def to_hf(x):
    """[batch, pos, head_index, d_head] -> HF's [batch, heads, pos, d_head]."""
    return x.transpose(1, 2)


def left_padded_mask():
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    return mask


# ----------------------------------------------------------------------------- RoPE
def test_half_rope_matches_llama(qk_and_positions):
    q, k, positions = qk_and_positions
    base = 500.0
    config = LlamaConfig(
        hidden_size=N_HEADS * D_HEAD,
        num_attention_heads=N_HEADS,
        head_dim=D_HEAD,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    hf_q, hf_k = llama_apply_rotary(to_hf(q), to_hf(k), cos, sin)
    ours_q = apply_rope(q, positions, D_HEAD, base=base, pairing="half")
    ours_k = apply_rope(k, positions, D_HEAD, base=base, pairing="half")
    torch.testing.assert_close(to_hf(ours_q), hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(to_hf(ours_k), hf_k, atol=1e-5, rtol=1e-5)
    # The other pairing must not agree: the check distinguishes pair layouts.
    interleaved = apply_rope(q, positions, D_HEAD, base=base, pairing="interleaved")
    assert not torch.allclose(to_hf(interleaved), hf_q, atol=1e-3)


def neox_config(rotary_fraction, base):
    return GPTNeoXConfig(
        hidden_size=N_HEADS * D_HEAD,
        num_attention_heads=N_HEADS,
        intermediate_size=4 * N_HEADS * D_HEAD,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": base, "partial_rotary_factor": rotary_fraction},
    )


def test_partial_rope_matches_gpt_neox(qk_and_positions):
    q, k, positions = qk_and_positions
    base = 1000.0
    ours_cfg = DecoderConfig(
        d_vocab=8, n_ctx=64, d_model=N_HEADS * D_HEAD, n_heads=N_HEADS, position="rope", rotary_fraction=0.25
    )
    config = neox_config(0.25, base)
    assert GPTNeoXAttention(config, layer_idx=0).rotary_ndims == ours_cfg.rotary_dim == 4
    cos, sin = GPTNeoXRotaryEmbedding(config)(q, positions)
    hf_q, hf_k = neox_apply_rotary(to_hf(q), to_hf(k), cos, sin)
    ours_q = apply_rope(q, positions, ours_cfg.rotary_dim, base=base, pairing="half")
    ours_k = apply_rope(k, positions, ours_cfg.rotary_dim, base=base, pairing="half")
    torch.testing.assert_close(to_hf(ours_q), hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(to_hf(ours_k), hf_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_q[..., 4:], q[..., 4:], atol=0, rtol=0)


def test_decoder_rotates_like_gpt_neox_with_left_padding():
    """The Decoder's hook_rot_q is GPT-NeoX's rotation of hook_q at the mask-derived positions."""
    base = 1000.0
    cfg = DecoderConfig(
        d_vocab=32,
        n_ctx=64,
        n_layers=1,
        d_model=N_HEADS * D_HEAD,
        n_heads=N_HEADS,
        position="rope",
        rotary_fraction=0.25,
        rotary_base=base,
    )
    model = Decoder(cfg, seed=1)
    tokens = torch.randint(0, 32, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = left_padded_mask()
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    hf_positions = (mask.cumsum(-1) - 1).clamp(min=0)  # HF's usual position ids for left padding
    q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]
    cos, sin = GPTNeoXRotaryEmbedding(neox_config(0.25, base))(q, hf_positions)
    hf_q, hf_k = neox_apply_rotary(to_hf(q), to_hf(k), cos, sin)
    real = mask.bool()
    torch.testing.assert_close(cache["blocks.0.attn.hook_rot_q"][real], to_hf(hf_q)[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["blocks.0.attn.hook_rot_k"][real], to_hf(hf_k)[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotary_dim", [D_HEAD, 8])
def test_interleaved_rope_matches_gpt_j(qk_and_positions, rotary_dim):
    q, _, positions = qk_and_positions
    config = GPTJConfig(n_embd=N_HEADS * D_HEAD, n_head=N_HEADS, rotary_dim=rotary_dim, n_positions=64, n_layer=1)
    sin, cos = GPTJRotaryEmbedding(config)(q, positions)
    # GPT-J keeps [batch, pos, heads, d_head] while rotating, as we do; GPTJAttention.forward
    # rotates the first rotary_dim dims and concatenates the rest unchanged.
    hf_q = torch.cat([gptj_apply_rotary(q[..., :rotary_dim], sin, cos), q[..., rotary_dim:]], dim=-1)
    ours = apply_rope(q, positions, rotary_dim, base=10000.0, pairing="interleaved")
    torch.testing.assert_close(ours, hf_q, atol=1e-5, rtol=1e-5)
    half = apply_rope(q, positions, rotary_dim, base=10000.0, pairing="half")
    assert not torch.allclose(half, hf_q, atol=1e-3)


# ----------------------------------------------------------------------------- ALiBi
@pytest.mark.parametrize("n_heads", range(1, 17))
def test_alibi_slopes_match_bloom(n_heads):
    torch.testing.assert_close(
        alibi_slopes(n_heads), _get_alibi_slopes(n_heads, torch.device("cpu")), atol=0, rtol=1e-6
    )


@pytest.mark.parametrize("n_heads", [3, 4, 6])
def test_alibi_bias_matches_bloom_up_to_a_row_constant(n_heads):
    """Bloom adds m_h * j; we add -m_h (i - j) = m_h * j - m_h * i, so ours + m_h * i is Bloom's."""
    mask = left_padded_mask()
    positions = position_ids_from_mask(mask)
    slopes = alibi_slopes(n_heads)
    ours = alibi_bias(slopes, positions, positions)  # [batch, head, query, key]
    bloom = build_alibi_tensor(mask, n_heads, torch.float32).view(BATCH, n_heads, 1, SEQ)
    row_constant = slopes[None, :, None, None] * positions[:, None, :, None]
    real_pairs = (mask[:, :, None] & mask[:, None, :]).bool()[:, None].expand_as(ours)
    torch.testing.assert_close((ours + row_constant)[real_pairs], bloom.expand_as(ours)[real_pairs])
    # Without the row constant they differ (the check is not vacuous).
    assert not torch.allclose(ours[real_pairs], bloom.expand_as(ours)[real_pairs])


def test_decoder_alibi_pattern_matches_bloom_softmax():
    """Bloom's softmax(q.k/sqrt(d) + m_h j + mask) equals the Decoder's hook_pattern, padding included."""
    n_heads = 6
    cfg = DecoderConfig(d_vocab=32, n_ctx=64, n_layers=1, d_model=48, n_heads=n_heads, position="alibi")
    model = Decoder(cfg, seed=2)
    with torch.no_grad():
        model.blocks[0].attn.W_Q.mul_(30.0)  # make the content scores matter next to the bias
    tokens = torch.randint(0, 32, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    mask = left_padded_mask()
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    content = cache["blocks.0.attn.hook_content_scores"]
    bloom = build_alibi_tensor(mask, n_heads, torch.float32).view(BATCH, n_heads, 1, SEQ)
    allowed = torch.ones(SEQ, SEQ).tril().bool() & mask.bool()[:, None, None, :]
    bloom_pattern = (content + bloom).masked_fill(~allowed, float("-inf")).softmax(-1)
    real_rows = mask.bool()[:, None, :, None].expand_as(content)
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"][real_rows], bloom_pattern[real_rows])


# ----------------------------------------------------------------------------- full GPT-2
def random_gpt2(dtype=torch.float32):
    """A small random GPT-2 whose every parameter (LayerNorms included) is far from its init."""
    config = GPT2Config(
        vocab_size=101, n_positions=40, n_embd=48, n_layer=3, n_head=4, n_inner=80, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(3)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.to(dtype)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_gpt2_logits_match(dtype, atol):
    hf = random_gpt2(dtype)
    ours = decoder_from_gpt2(hf)
    assert ours.cfg.d_mlp == 80 and ours.cfg.n_ctx == 40 and ours.cfg.position == "learned"
    assert ours.embed.W_E.dtype == dtype
    tokens = torch.randint(0, 101, (3, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert expected.std() > 0.5  # logits large enough for a wrong weight to show
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def test_gpt2_logits_match_with_left_padding():
    hf = random_gpt2()
    ours = decoder_from_gpt2(hf)
    tokens = torch.randint(0, 101, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    mask = left_padded_mask()
    hf_positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(tokens, attention_mask=mask, position_ids=hf_positions).logits
        got = ours(tokens, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)


def test_decoder_from_gpt2_is_a_copy():
    hf = random_gpt2()
    ours = decoder_from_gpt2(hf)
    before = ours.blocks[0].attn.W_Q.detach().clone()
    with torch.no_grad():
        hf.transformer.h[0].attn.c_attn.weight.zero_()
    torch.testing.assert_close(ours.blocks[0].attn.W_Q, before, atol=0, rtol=0)


def test_decoder_from_gpt2_rejects_bad_input():
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        decoder_from_gpt2(torch.nn.Linear(2, 2))
    small = dict(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        decoder_from_gpt2(GPT2LMHeadModel(GPT2Config(**small, scale_attn_by_inverse_layer_idx=True)))
    with pytest.raises(ValueError, match="activation_function"):
        decoder_from_gpt2(GPT2LMHeadModel(GPT2Config(**small, activation_function="relu")))
