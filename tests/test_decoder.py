"""The hooked Decoder: hooks, masks, padding, KV cache and bad input (issue 2)."""

import pytest
import torch
from transformer_lens import ActivationCache

from nopelens.models import POSITION_METHODS, Decoder, DecoderConfig, KVCache
from nopelens.models.positions import sinusoidal_table

METHODS = list(POSITION_METHODS) + ["hybrid"]


def make(method, **kw):
    position = ["nope", "rope", "alibi"] if method == "hybrid" else method
    base = dict(
        d_vocab=23,
        n_ctx=24,
        n_layers=3,
        d_model=32,
        n_heads=4,
        position=position,
        shaw_clip=4,
        shaw_values=True,
        rotary_fraction=0.5,
    )
    base.update(kw)
    return Decoder(DecoderConfig(**base), seed=0).eval()


def tokens(batch=3, length=10, seed=1, vocab=23):
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_batch_equals_each_sequence_alone(method):
    model = make(method)
    lengths = [10, 7, 4]
    seqs = [tokens(1, n, seed=n)[0] for n in lengths]
    width = max(lengths)
    padded = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, seq in enumerate(seqs):
        padded[row, width - len(seq) :] = seq
        mask[row, width - len(seq) :] = 1

    def names(n):
        return n.endswith(("hook_resid_post", "hook_z", "hook_embed", "hook_pos_embed"))

    batch_logits, batch_cache = model.run_with_cache(padded, attention_mask=mask, names_filter=names)
    for row, seq in enumerate(seqs):
        alone_logits, alone_cache = model.run_with_cache(seq[None], names_filter=names)
        real = slice(width - len(seq), width)
        torch.testing.assert_close(batch_logits[row, real], alone_logits[0], atol=1e-5, rtol=0)
        for name in alone_cache.keys():
            torch.testing.assert_close(batch_cache[name][row, real], alone_cache[name][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_pattern_rows_sum_to_one_blocked_exactly_zero_allowed_positive(method):
    model = make(method)
    toks = tokens(2, 12)
    mask = torch.ones_like(toks)
    mask[1, :3] = 0  # left padding in row 1
    _, cache = model.run_with_cache(toks, attention_mask=mask, names_filter=lambda n: n.endswith("hook_pattern"))
    causal = torch.ones(12, 12).tril().bool()
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert pattern.shape == (2, 4, 12, 12)
        torch.testing.assert_close(pattern.sum(-1), torch.ones(2, 4, 12), atol=1e-6, rtol=0)
        assert (pattern[:, :, ~causal] == 0).all()
        assert (pattern[0][:, causal] > 0).all()
        real_rows = pattern[1, :, 3:, :]
        assert (real_rows[..., :3] == 0).all(), "a real query must give a padded key exactly zero"
        assert (real_rows[..., 3:][:, causal[3:, 3:]] > 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_kv_cache_step_equals_full_forward(method):
    model = make(method)
    toks = tokens(2, 11)
    full = model(toks)
    cache = KVCache.empty(model.cfg, batch=2)
    model(toks[:, :-1], past_kv=cache)
    step = model(toks[:, -1:], past_kv=cache)
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=0)
    assert cache.length == 11 and cache.position_ids[0].tolist() == list(range(11))
    # a left-padded prompt, then token by token
    mask = torch.ones_like(toks)
    mask[1, :2] = 0
    full_padded = model(toks, attention_mask=mask)
    cache = KVCache.empty(model.cfg, batch=2)
    steps = [model(toks[:, :3], attention_mask=mask[:, :3], past_kv=cache)]
    steps += [model(toks[:, t : t + 1], attention_mask=mask[:, t : t + 1], past_kv=cache) for t in range(3, 11)]
    torch.testing.assert_close(torch.cat(steps, 1)[mask.bool()], full_padded[mask.bool()], atol=1e-5, rtol=0)
    assert cache.position_ids[1, 2:].tolist() == list(range(9))


def test_rotation_keys_are_cached_before_rotation():
    model = make("rope")
    toks = tokens(1, 6)
    cache = KVCache.empty(model.cfg, batch=1)
    _, run = model.run_with_cache(toks, names_filter=lambda n: n == "blocks.0.attn.hook_k")
    model(toks, past_kv=cache)
    torch.testing.assert_close(cache.keys[0], run["blocks.0.attn.hook_k"])


def test_failed_step_leaves_cache_unchanged():
    model = make("rope")
    cache = KVCache.empty(model.cfg, batch=1)
    model(tokens(1, 5), past_kv=cache)
    before = (cache.length, [k.clone() for k in cache.keys])
    with pytest.raises(ValueError, match="vocabulary"):
        model(torch.tensor([[99]]), past_kv=cache)
    assert cache.length == before[0]
    for k, old in zip(cache.keys, before[1]):
        assert torch.equal(k, old)


@pytest.mark.parametrize("method", ["alibi", "shaw"])
def test_content_scores_and_position_bias_add_up_to_scores(method):
    model = make(method)
    _, cache = model.run_with_cache(tokens(2, 9))
    causal = torch.ones(9, 9).tril().bool()
    for layer in range(3):
        attn = f"blocks.{layer}.attn."
        total = cache[attn + "hook_content_scores"] + cache[attn + "hook_pos_bias"]
        torch.testing.assert_close(total[..., causal], cache[attn + "hook_attn_scores"][..., causal])
        assert torch.isneginf(cache[attn + "hook_attn_scores"][..., ~causal]).all()


def test_alibi_bias_is_minus_slope_times_distance_in_the_model():
    model = make("alibi")
    _, cache = model.run_with_cache(tokens(1, 6))
    bias = cache["blocks.0.attn.hook_pos_bias"][0]
    slopes = model.blocks[0].attn.alibi_slopes
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    torch.testing.assert_close(bias, -slopes[:, None, None] * (i - j).float())


@pytest.mark.parametrize("method", ["learned", "sinusoidal"])
def test_pos_embed_hook_holds_table_rows_at_position_ids(method):
    model = make(method)
    toks = tokens(2, 8)
    mask = torch.ones_like(toks)
    mask[0, :3] = 0
    _, cache = model.run_with_cache(toks, attention_mask=mask)
    pos = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4], list(range(8))])
    table = model.pos_embed.W_pos[pos] if method == "learned" else sinusoidal_table(pos, 32)
    torch.testing.assert_close(cache["hook_pos_embed"], table)


def test_nope_has_no_position_hooks_and_cache_is_activation_cache():
    _, cache = make("nope").run_with_cache(tokens(1, 4))
    assert isinstance(cache, ActivationCache)
    position_hooks = ("hook_pos_embed", "hook_rot_q", "hook_rot_k", "hook_pos_bias")
    assert not [n for n in cache.keys() if n.endswith(position_hooks)]
    assert "ln_final.hook_normalized" in cache.keys()


def test_stop_at_layer_returns_the_residual_stream():
    model = make("rope")
    toks = tokens(2, 7)
    _, cache = model.run_with_cache(toks)
    torch.testing.assert_close(model(toks, stop_at_layer=0), cache["blocks.0.hook_resid_pre"])
    torch.testing.assert_close(model(toks, stop_at_layer=2), cache["blocks.1.hook_resid_post"])
    with pytest.raises(ValueError, match="stop_at_layer"):
        model(toks, stop_at_layer=4)


def test_negative_stop_at_layer_counts_from_the_end_as_in_transformer_lens():
    # TransformerLens' HookedTransformer.forward: stop_at_layer "supports negative indexing", and its
    # bridge runs len(blocks) + k blocks for k < 0: -1 skips the last block, -n_layers runs none
    model = make("rope")  # 3 blocks
    toks = tokens(2, 7)
    _, cache = model.run_with_cache(toks)
    torch.testing.assert_close(model(toks, stop_at_layer=-1), cache["blocks.1.hook_resid_post"])
    torch.testing.assert_close(model(toks, stop_at_layer=-3), cache["blocks.0.hook_resid_pre"])
    out, stopped = model.run_with_cache(toks, stop_at_layer=-1)
    assert "blocks.1.hook_resid_post" in stopped and "blocks.2.hook_resid_pre" not in stopped
    with pytest.raises(ValueError, match=r"stop_at_layer must lie in \[-3, 3\]"):
        model(toks, stop_at_layer=-4)  # no silent clamp to the embeddings


def test_hooks_are_removed_after_run_with_cache():
    model = make("alibi")
    model.run_with_cache(tokens(1, 4))
    assert all(not h._forward_hooks for h in model.hook_dict.values())


def test_same_seed_same_weights_different_seed_different():
    cfg = make("rope").cfg
    a, b, c = Decoder(cfg, seed=3), Decoder(cfg, seed=3), Decoder(cfg, seed=4)
    torch.manual_seed(123)  # the global RNG must not matter
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.W_E, c.embed.W_E)


def test_float64_model_runs_and_positions_stay_exact():
    model = make("sinusoidal", n_layers=1)
    model64 = Decoder(model.cfg, seed=0, dtype=torch.float64)
    out = model64(tokens(1, 5))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.float(), model(tokens(1, 5)), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- bad input: clear errors


def test_token_ids_outside_vocabulary_raise():
    model = make("nope")
    with pytest.raises(ValueError, match=r"token id 23 at \(batch 0, position 2\).*\[0, 23\)"):
        model(torch.tensor([[1, 2, 23]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))


def test_learned_positions_past_the_table_raise_instead_of_wrapping():
    model = make("learned")
    model(tokens(1, 24))  # exactly n_ctx is fine
    with pytest.raises(ValueError, match="n_ctx=24"):
        model(tokens(1, 25))
    cache = KVCache.empty(model.cfg, batch=1)
    model(tokens(1, 24), past_kv=cache)
    with pytest.raises(ValueError, match="past the learned position table"):
        model(tokens(1, 1), past_kv=cache)


def test_other_methods_compute_positions_past_n_ctx():
    for method in ["nope", "sinusoidal", "rope", "alibi", "shaw"]:
        assert torch.isfinite(make(method)(tokens(1, 40))).all()


def test_wrong_dtypes_and_shapes_raise():
    model = make("nope")
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.rand(1, 4))
    with pytest.raises(ValueError, match=r"\[batch, pos\]"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(tokens(1, 4), attention_mask=torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="only 0"):
        model(tokens(1, 3), attention_mask=torch.tensor([[1, 2, 1]]))
    with pytest.raises(TypeError, match="position_ids"):
        model(tokens(1, 3), position_ids=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=">= 0"):
        model(tokens(1, 3), position_ids=torch.tensor([[0, -1, 2]]))


def test_fully_masked_row_raises_naming_the_row():
    model = make("alibi")
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[2] = 0
    with pytest.raises(ValueError, match="row 2 masks every position"):
        model(tokens(3, 5), attention_mask=mask)
