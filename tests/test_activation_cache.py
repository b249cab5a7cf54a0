"""TransformerLens' ActivationCache methods on a Decoder's cache equal the computation from our weights (issue 15).

Every expected value is computed here from the model's parameters and the cache's own
activations (z, the MLP's hook_post, the residual stream), never read back from the method tested.
Models are float64, so the checks are exact up to round-off.
"""

import pytest
import torch
import torch.nn.functional as F

from nopelens.models import Decoder, DecoderConfig

NORMS = ["layernorm", "rmsnorm", "none"]
ATOL = 1e-10


def make(normalization="layernorm", position="learned", d_mlp=24, shaw_values=False):
    cfg = DecoderConfig(
        d_vocab=13,
        n_ctx=12,
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_mlp=d_mlp,
        shaw_clip=3,
        shaw_values=shaw_values,
        normalization=normalization,
        position=position,
        init_std=0.3,
    )
    model = Decoder(cfg, seed=0, dtype=torch.float64).eval()
    with torch.no_grad():  # non-zero biases and norm weights, so a forgotten term shows
        generator = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if not name.rsplit(".", 1)[-1].startswith("W_"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


TOKENS = torch.randint(0, 13, (3, 7), generator=torch.Generator().manual_seed(2))


def run(model):
    return model.run_with_cache(TOKENS)


def center(model, x):
    return x - x.mean(-1, keepdim=True) if model.cfg.normalization == "layernorm" else x


def scale(model, resid):
    """The norm's divisor for ``resid`` ``[..., 1]``: sqrt(mean(x_c^2) + eps) (1 without a norm)."""
    if model.cfg.normalization == "none":
        return torch.ones_like(resid[..., :1])
    return (center(model, resid).pow(2).mean(-1, keepdim=True) + model.cfg.layer_norm_eps).sqrt()


def normalize(model, x):
    """The norm of ``model`` without its weight and bias: what apply_ln_to_stack's cached scale gives."""
    return center(model, x) / scale(model, x)


def final_norm(model, x):
    """ln_final with its weight and bias, from the parameters."""
    if model.cfg.normalization == "none":
        return x
    out = normalize(model, x) * model.ln_final.w
    return out + model.ln_final.b if hasattr(model.ln_final, "b") else out


def head_results(model, cache, layer):
    """[batch, pos, head_index, d_model]: z_h W_O[h], from the cached z and our W_O."""
    z = cache[f"blocks.{layer}.attn.hook_z"]
    W_O = model.blocks[layer].attn.W_O
    return torch.stack([z[:, :, h] @ W_O[h] for h in range(model.cfg.n_heads)], dim=2)


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("normalization", NORMS)
def test_accumulated_resid_without_ln(normalization):
    model = make(normalization)
    logits, cache = run(model)
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"]
    positions = torch.arange(TOKENS.shape[1])
    close(stack[0], model.embed.W_E[TOKENS] + model.pos_embed.W_pos[positions])
    close(final_norm(model, stack[-1]) @ model.W_U + model.b_U, logits)
    resid = stack[0]
    for layer in range(2):  # each entry is the previous one plus the block's outputs
        resid = resid + cache[f"blocks.{layer}.hook_attn_out"] + cache[f"blocks.{layer}.hook_mlp_out"]
        close(stack[layer + 1], resid)


@pytest.mark.parametrize("normalization", NORMS)
def test_accumulated_resid_with_ln_is_the_logit_lens(normalization):
    model = make(normalization)
    logits, cache = run(model)
    raw = cache.accumulated_resid()
    lens = cache.accumulated_resid(apply_ln=True)
    for entry, normed in zip(raw, lens):  # final norm recomputed on each entry, weight and bias applied
        close(normed, final_norm(model, entry))
    close(lens[-1] @ model.W_U + model.b_U, logits)
    result = cache.logit_lens(positions=None)  # TransformerLens' own logit lens agrees
    close(result.values[-1].to(logits.dtype), logits)


@pytest.mark.parametrize("normalization", NORMS)
def test_accumulated_resid_with_ln_at_an_inner_layer_uses_that_layers_scale(normalization):
    model = make(normalization)
    _, cache = run(model)
    raw = cache.accumulated_resid(layer=1)
    normed = cache.accumulated_resid(layer=1, apply_ln=True)
    target = raw[-1]  # resid_pre of block 1: its ln1 scale divides every entry
    close(normed, center(model, raw) / scale(model, target))
    close(normed[-1], normalize(model, target))


@pytest.mark.parametrize("normalization", NORMS)
def test_decompose_resid(normalization):
    model = make(normalization)
    _, cache = run(model)
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed", "pos_embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    close(stack.sum(0), cache["blocks.1.hook_resid_post"])
    for layer in range(2):
        attn = head_results(model, cache, layer).sum(2) + model.blocks[layer].attn.b_O
        close(stack[labels.index(f"{layer}_attn_out")], attn)
        mlp = model.blocks[layer].mlp
        hidden = (
            cache[f"blocks.{layer}.ln2.hook_normalized"] * model.blocks[layer].ln2.w
            if normalization != "none"
            else cache[f"blocks.{layer}.hook_resid_mid"]
        )
        if normalization == "layernorm":
            hidden = hidden + model.blocks[layer].ln2.b
        close(stack[labels.index(f"{layer}_mlp_out")], F.gelu(hidden @ mlp.W_in + mlp.b_in) @ mlp.W_out + mlp.b_out)
    normed = cache.decompose_resid(apply_ln=True)  # linear: the parts sum to the normalized whole
    close(normed.sum(0), normalize(model, cache["blocks.1.hook_resid_post"]))
    mid = cache.decompose_resid(layer=1, mlp_input=True, apply_ln=True)
    close(mid.sum(0), normalize(model, cache["blocks.1.hook_resid_mid"]))


@pytest.mark.parametrize("normalization", NORMS)
def test_apply_ln_to_stack_divides_by_the_cached_scale_of_the_named_norm(normalization):
    model = make(normalization)
    _, cache = run(model)
    for layer in range(2):
        for mlp_input, site in ((False, "hook_resid_pre"), (True, "hook_resid_mid")):
            resid = cache[f"blocks.{layer}.{site}"]
            normed = cache.apply_ln_to_stack(resid[None], layer, mlp_input=mlp_input)[0]
            close(normed, normalize(model, resid))
    final = cache["blocks.1.hook_resid_post"]
    close(cache.apply_ln_to_stack(final[None])[0], normalize(model, final))
    if normalization != "none":  # the scale the cache holds is the norm's own
        close(cache["ln_final.hook_normalized"], normalize(model, final))


@pytest.mark.parametrize("normalization", NORMS)
def test_stack_head_results_and_compute_head_results(normalization):
    model = make(normalization)
    _, cache = run(model)
    assert "blocks.0.attn.hook_result" not in cache.cache_dict
    stack, labels = cache.stack_head_results(return_labels=True)
    assert labels == ["L0H0", "L0H1", "L1H0", "L1H1"]
    for layer in range(2):
        expected = head_results(model, cache, layer)
        for head in range(2):
            close(stack[2 * layer + head], expected[:, :, head])
        close(expected.sum(2) + model.blocks[layer].attn.b_O, cache[f"blocks.{layer}.hook_attn_out"])
    with_rest = cache.stack_head_results(layer=1, incl_remainder=True)
    close(with_rest.sum(0), cache["blocks.0.hook_resid_post"])
    normed = cache.stack_head_results(apply_ln=True)  # divided by ln_final's scale of the whole stream
    close(normed, center(model, stack) / scale(model, cache["blocks.1.hook_resid_post"]))


def test_use_attn_result_hooks_each_heads_output_in_the_forward_pass():
    model = make()
    logits, cache = run(model)
    model.set_use_attn_result(True)
    try:
        logits_with, cache_with = run(model)
    finally:
        model.set_use_attn_result(False)
    close(logits_with, logits)
    for layer in range(2):
        close(cache_with[f"blocks.{layer}.attn.hook_result"], head_results(model, cache, layer))
    cache.compute_head_results()
    for layer in range(2):
        close(cache[f"blocks.{layer}.attn.hook_result"], cache_with[f"blocks.{layer}.attn.hook_result"])


@pytest.mark.parametrize("normalization", NORMS)
def test_get_full_resid_decomposition(normalization):
    model = make(normalization)
    _, cache = run(model)
    stack, labels = cache.get_full_resid_decomposition(return_labels=True)
    assert len(labels) == 2 * 2 + 2 * 24 + 3 and labels[-3:] == ["embed", "pos_embed", "bias"]
    close(stack.sum(0), cache["blocks.1.hook_resid_post"])
    neuron = labels.index("L1N5")
    close(stack[neuron], cache["blocks.1.mlp.hook_post"][..., 5:6] * model.blocks[1].mlp.W_out[5])
    bias = sum(b.attn.b_O + b.mlp.b_out for b in model.blocks)
    close(stack[-1], bias.expand_as(stack[-1]))
    layers, _ = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    close(layers.sum(0), cache["blocks.1.hook_resid_post"])
    mid = cache.get_full_resid_decomposition(layer=1, mlp_input=True, apply_ln=True)
    close(mid.sum(0), normalize(model, cache["blocks.1.hook_resid_mid"]))


@pytest.mark.parametrize("normalization", NORMS)
def test_logit_attrs_sum_to_the_logits_less_the_biases(normalization):
    model = make(normalization)
    logits, cache = run(model)
    stack = cache.decompose_resid()
    targets = TOKENS.roll(-1, dims=1)
    attrs = cache.logit_attrs(stack, targets)
    assert attrs.shape == (stack.shape[0], *TOKENS.shape)
    offset = model.b_U
    if normalization == "layernorm":
        offset = offset + model.ln_final.b @ model.W_U
    picked = lambda t: t.gather(-1, targets[..., None])[..., 0]  # noqa: E731
    close(attrs.sum(0), picked(logits - offset))
    wrong = (targets + 1) % 13
    diff = cache.logit_attrs(stack, targets, incorrect_tokens=wrong)
    close(
        diff.sum(0),
        picked(logits)
        - logits.gather(-1, wrong[..., None])[..., 0]
        - (picked(offset.expand_as(logits)) - offset[wrong]),
    )
    direction = model.tokens_to_residual_directions(3)
    weight = model.ln_final.w if normalization != "none" else 1.0
    close(direction, model.W_U[:, 3] * weight)


@pytest.mark.parametrize("position", ["rope", "alibi", "shaw", "sinusoidal", ("nope", "rope")])
def test_every_position_method_decomposes(position):
    model = make(position=position, shaw_values=True)  # Shaw's a^V term is part of z, so of the head results
    logits, cache = run(model)
    stack, labels = cache.get_full_resid_decomposition(return_labels=True)
    assert ("pos_embed" in labels) == (position == "sinusoidal")
    close(stack.sum(0), cache["blocks.1.hook_resid_post"])
    attrs = cache.logit_attrs(cache.decompose_resid(), TOKENS)
    offset = model.b_U + model.ln_final.b @ model.W_U
    close(attrs.sum(0), (logits - offset).gather(-1, TOKENS[..., None])[..., 0])


def test_methods_the_decoder_cannot_serve_say_why():
    model = make(d_mlp=0)
    _, cache = run(model)
    close(cache.get_full_resid_decomposition().sum(0), cache["blocks.1.hook_resid_post"])
    with pytest.raises(ValueError, match="attention-only"):
        cache.stack_neuron_results(1)
    with pytest.raises(ValueError, match="attention-only"):
        cache.get_neuron_results(0)
    with pytest.raises(RuntimeError, match="No SSM mixer"):
        cache.compute_ssm_state()
    with pytest.raises(TypeError, match="no SSM mixer"):
        cache.compute_ssm_effective_attention(0)
    _, partial = model.run_with_cache(TOKENS, names_filter=lambda n: "resid" in n)
    with pytest.raises(KeyError, match="hook_scale"):
        partial.accumulated_resid(layer=1, apply_ln=True)
    with pytest.raises(ValueError, match="layer must lie"):
        model.accumulated_bias(3)
