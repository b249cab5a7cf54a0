"""The fused attention path (scaled_dot_product_attention) equals the explicit, hooked one (issue 2).

The Decoder runs ``F.scaled_dot_product_attention`` when no hook asks for scores or patterns, and
the explicit softmax path otherwise. Both must compute the same function: same logits, same
``hook_z``, same gradients, with left padding and with a KV cache, for every position method.
"""

import pytest
import torch
import torch.nn.functional as F

from nopelens.models import Decoder, DecoderConfig, KVCache

BASE = dict(d_vocab=29, n_ctx=24, n_layers=2, d_model=48, n_heads=4)
CONFIGS = {
    "nope": dict(position="nope"),
    "learned": dict(position="learned"),
    "sinusoidal": dict(position="sinusoidal"),
    "rope_half": dict(position="rope", pairing="half"),
    "rope_interleaved_partial": dict(position="rope", pairing="interleaved", rotary_fraction=0.5),
    "alibi_6_heads": dict(position="alibi", n_heads=6),
    "shaw_values": dict(position="shaw", shaw_clip=3, shaw_values=True),
    "t5_few_buckets": dict(position="t5", t5_num_buckets=6, t5_max_distance=5),
    "nope_rope_hybrid": dict(position=("nope", "rope")),
    "alibi_rope_hybrid": dict(position=("alibi", "rope")),
}
SEQ = 10


def make_model(name):
    model = Decoder(DecoderConfig(**{**BASE, **CONFIGS[name]}), seed=7)
    with torch.no_grad():
        for block in model.blocks:  # sharpen attention so a wrong mask or bias changes the output
            block.attn.W_Q.mul_(20.0)
    return model


def tokens_and_padded_mask():
    tokens = torch.randint(0, BASE["d_vocab"], (3, SEQ), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(tokens)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return tokens, mask


def run_z(model, fused, **kwargs):
    model.set_fused_attention(fused)
    logits, cache = model.run_with_cache(kwargs.pop("tokens"), names_filter=lambda n: n.endswith("hook_z"), **kwargs)
    return logits, [cache[f"blocks.{l}.attn.hook_z"] for l in range(model.cfg.n_layers)]


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Count calls of F.scaled_dot_product_attention (the fused path)."""
    calls = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("padding", ["unpadded", "left_padded", "left_padded_batch_1"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_equals_explicit(name, padding, sdpa_calls):
    model = make_model(name)
    tokens, mask = tokens_and_padded_mask()
    if padding == "left_padded_batch_1":  # one row: the mask has batch 1 but is not plain causal
        tokens, mask = tokens[:1], mask[:1]
    kwargs = dict(tokens=tokens, attention_mask=None if padding == "unpadded" else mask)
    fused_logits, fused_z = run_z(model, True, **dict(kwargs))
    used_fused = len(sdpa_calls)
    explicit_logits, explicit_z = run_z(model, False, **dict(kwargs))
    assert len(sdpa_calls) == used_fused  # set_fused_attention(False) never calls SDPA
    n_fusable = sum(m != "shaw" for m in model.cfg.layer_positions)  # Shaw always needs the pattern
    assert used_fused == n_fusable
    torch.testing.assert_close(fused_logits, explicit_logits, atol=1e-5, rtol=1e-5)
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(fused_z[layer], explicit_z[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_equals_explicit_with_kv_cache(name):
    model = make_model(name)
    tokens, mask = tokens_and_padded_mask()
    steps = {}
    for fused in (True, False):
        model.set_fused_attention(fused)
        cache = KVCache.empty(model.cfg, batch=tokens.shape[0])
        model(tokens[:, :-3], attention_mask=mask[:, :-3], past_kv=cache)
        steps[fused] = [model(tokens[:, i : i + 1], past_kv=cache) for i in range(SEQ - 3, SEQ)]
    full = model(tokens, attention_mask=mask)
    for fused_step, explicit_step, i in zip(steps[True], steps[False], range(SEQ - 3, SEQ)):
        torch.testing.assert_close(fused_step, explicit_step, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused_step[:, 0], full[:, i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["rope_half", "alibi_6_heads", "learned"])
def test_fused_and_explicit_gradients_agree(name):
    model = make_model(name)
    tokens, mask = tokens_and_padded_mask()
    grads = {}
    for fused in (True, False):
        model.set_fused_attention(fused)
        model.zero_grad()
        logits = model(tokens, attention_mask=mask)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")[
            mask[:, 1:].flatten().bool()
        ].mean().backward()
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n in grads[True]:
        torch.testing.assert_close(grads[True][n], grads[False][n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("hook_name", ["hook_pattern", "hook_attn_scores", "hook_content_scores", "hook_pos_bias"])
def test_hooking_a_score_or_pattern_switches_to_the_explicit_path(hook_name, sdpa_calls):
    model = make_model("alibi_rope_hybrid" if hook_name != "hook_pos_bias" else "alibi_6_heads")
    tokens, mask = tokens_and_padded_mask()
    seen = []

    def record(activation, hook):
        seen.append(hook.name)
        return activation

    plain = model(tokens, attention_mask=mask)
    assert len(sdpa_calls) == 2  # both layers fused when nothing is hooked
    sdpa_calls.clear()
    hooked = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[(f"blocks.0.attn.{hook_name}", record)])
    assert seen == [f"blocks.0.attn.{hook_name}"]
    assert len(sdpa_calls) == 1  # layer 0 explicit (it is hooked), layer 1 still fused
    torch.testing.assert_close(hooked, plain, atol=1e-5, rtol=1e-5)
    sdpa_calls.clear()
    model(tokens, attention_mask=mask)  # run_with_hooks removed the hook: fused again
    assert len(sdpa_calls) == 2


def test_hook_that_edits_the_pattern_takes_effect(sdpa_calls):
    """A pattern intervention must change the output, which the fused path could not do."""
    model = make_model("rope_half")
    tokens, mask = tokens_and_padded_mask()
    plain = model(tokens, attention_mask=mask)

    def attend_to_first_key(pattern, hook):
        edited = torch.zeros_like(pattern)
        edited[..., 0] = 1.0
        return edited

    sdpa_calls.clear()
    edited = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_pattern", attend_to_first_key)])
    assert len(sdpa_calls) == 1
    assert not torch.allclose(edited, plain, atol=1e-3)


# ----------------------------------------------------------------------------- normalization
@pytest.mark.parametrize(
    "normalization, use_bias", [("layernorm", True), ("layernorm", False), ("rmsnorm", True), ("rmsnorm", False)]
)
def test_fused_norm_equals_explicit_norm(normalization, use_bias, monkeypatch):
    """Norms run F.layer_norm / F.rms_norm unless hook_scale or hook_normalized is hooked."""
    cfg = DecoderConfig(**{**BASE, "normalization": normalization, "use_bias": use_bias, "position": "rope"})
    model = Decoder(cfg, seed=9)
    with torch.no_grad():  # norm weights and biases away from their init, so a dropped one shows
        for name, param in model.named_parameters():
            if name.endswith((".w", ".b")):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    tokens, mask = tokens_and_padded_mask()
    kernel = "layer_norm" if normalization == "layernorm" else "rms_norm"
    calls = []
    original = getattr(F, kernel)
    monkeypatch.setattr(torch.nn.functional, kernel, lambda *a, **k: calls.append(1) or original(*a, **k))
    fused = model(tokens, attention_mask=mask)
    n_norms = 2 * cfg.n_layers + 1
    assert len(calls) == n_norms
    calls.clear()
    scales = []
    hooks = [
        (name, lambda act, hook: scales.append(hook.name) or act)
        for name in model.hook_dict
        if name.endswith("hook_scale")
    ]
    explicit = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=hooks)
    assert len(scales) == n_norms and not calls
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    doubled = model.run_with_hooks(
        tokens, attention_mask=mask, fwd_hooks=[("ln_final.hook_normalized", lambda a, hook: 2 * a)]
    )
    assert not torch.allclose(doubled, fused, atol=1e-3)
    grads = []
    for fwd_hooks in ([], hooks):
        model.zero_grad()
        model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=fwd_hooks).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)
