"""Issue 47: a second third-party model library, torchtune, through hook_any with nothing written by hand.

torchtune (an optional test extra, with the torchao it imports) builds pure-torch decoders: Llama 3
(RoPE through its ``RotaryPositionalEmbeddings`` module, GQA with the key-value heads expanded before
``scaled_dot_product_attention``) and Gemma 2 (an explicit softmax over soft-capped scores, a sliding
window on every other layer, masked with a -2.38e38 fill). Passing ``pos_embeddings=None`` gives NoPE.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopelens.models.adapters import HookedModule
from nopelens.models.anymodel import hook_any
from nopelens.models.hooks import act_names
from nopelens.models.masks import KeyWindow
from nopelens.probes import collect, probe_absolute_index, resid_sites, sink_table
from nopelens.probes.sink_patterns import sink_mass_by_query

pytest.importorskip("torchao")  # torchtune refuses to import without it
torchtune_models = pytest.importorskip("torchtune.models")

PATTERNS = act_names("pattern", 2)


def llama(rope=True, seed=0):
    from torchtune.models.llama3 import llama3

    torch.manual_seed(seed)
    model = llama3(
        vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64, intermediate_dim=64
    ).eval()
    if not rope:
        for layer in model.layers:
            layer.attn.pos_embeddings = None  # torchtune's MultiHeadAttention then adds no position
    return model


def gemma(window=4, seed=0):
    from torchtune.models.gemma2 import gemma2

    torch.manual_seed(seed)
    return gemma2(
        vocab_size=64,
        num_layers=2,
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=64,
        sliding_window_size=window,
    ).eval()


def tokens(n=6, length=12):
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(1))


def test_the_map_found_equals_a_hand_written_map_bit_for_bit(capsys):
    model = llama()
    hooked = hook_any(model)
    assert "blocks.0.hook_resid_pre <- layers.0:input" in capsys.readouterr().err
    auto = collect(hooked, tokens(), resid_sites(2))
    hooked.remove()
    by_hand = HookedModule(
        model,
        {
            "blocks.0.hook_resid_pre": "layers.0:input",
            "blocks.0.hook_resid_post": "layers.0",
            "blocks.1.hook_resid_post": "layers.1",
        },
    )
    manual = collect(by_hand, tokens(), resid_sites(2))
    for site in resid_sites(2):
        assert np.array_equal(auto.acts[site], manual.acts[site]), site


def test_fused_patterns_equal_a_float64_recomputation_through_the_librarys_own_modules():
    """Block l's pattern from its recorded input, the library's own norm, projections and rotary
    module, in float64: softmax(q k^T / sqrt(d_head)) under the causal rule, GQA heads repeated."""
    model = llama()
    sites = PATTERNS + act_names("resid_pre", 1) + act_names("resid_post", 1)
    acts = collect(hook_any(model, verbose=False), tokens(), sites)
    inputs = [acts.acts["blocks.0.hook_resid_pre"], acts.acts["blocks.0.hook_resid_post"]]
    for l, layer in enumerate(model.layers):
        attn = layer.attn
        with torch.no_grad():
            x = layer.sa_norm(torch.as_tensor(inputs[l]).reshape(6, 12, 32))
            q = attn.pos_embeddings(attn.q_proj(x).view(6, 12, 4, 8)).double().transpose(1, 2)
            k = attn.pos_embeddings(attn.k_proj(x).view(6, 12, 2, 8)).double().transpose(1, 2)
        k = k.repeat_interleave(2, dim=1)
        scores = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(
            ~torch.ones(12, 12, dtype=torch.bool).tril(), -torch.inf
        )
        np.testing.assert_allclose(np.stack(acts.patterns[PATTERNS[l]]), scores.softmax(-1).numpy(), atol=1e-6)


def test_explicit_softmax_patterns_equal_a_float64_recomputation_through_the_librarys_own_modules():
    """Gemma 2's pattern from each block's recorded input through the library's own norm, projections,
    rotary module, query scaling and soft-capping, in float64, under the window the call recorded."""
    model = gemma()
    hooked = hook_any(model, verbose=False)
    with torch.no_grad():
        _, cache = hooked.run_with_cache(tokens(), names_filter=lambda name: "attn." in name or "resid" in name)
    inputs = [cache["blocks.0.hook_resid_pre"], cache["blocks.0.hook_resid_post"]]
    for l, layer in enumerate(model.layers):
        attn = layer.attn
        with torch.no_grad():
            x = layer.sa_norm(inputs[l])
            q = attn.pos_embeddings(attn.q_proj(x).view(6, 12, 4, 8)).double().transpose(1, 2) * attn.scaling
            k = attn.pos_embeddings(attn.k_proj(x).view(6, 12, 2, 8)).double().transpose(1, 2).repeat_interleave(2, 1)
        scores = q @ k.transpose(-1, -2)
        scores = attn.softcapping * torch.tanh(scores / attn.softcapping)
        visible = hooked.key_windows.get(l, KeyWindow()).visible(12)
        want = scores.masked_fill(~visible, -torch.inf).softmax(-1)
        np.testing.assert_allclose(cache[PATTERNS[l]].double().numpy(), want.numpy(), atol=1e-6)


def test_known_answers_zero_qk_and_repeated_nope():
    model = llama()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.q_proj.weight.zero_()
            layer.attn.k_proj.weight.zero_()
    acts = collect(hook_any(model, verbose=False), tokens(), PATTERNS)
    for site in PATTERNS:
        for by_query in sink_mass_by_query(acts.patterns[site]):
            np.testing.assert_allclose(by_query, np.broadcast_to(1 / np.arange(1, 13), by_query.shape), atol=1e-7)
    repeated = collect(hook_any(llama(rope=False), verbose=False), torch.full((24, 12), 5), resid_sites(2))
    r2 = probe_absolute_index(repeated, tasks=("regression",), n_boot=20).query("probe == 'linear' and metric == 'r2'")
    assert len(r2) == 3 and np.all(np.abs(r2["value"]) < 1e-6), r2


def test_the_sliding_window_travels_and_the_sink_mass_averages_the_queries_that_see_key_0():
    acts = collect(hook_any(gemma(window=4), verbose=False), tokens(6, 16), PATTERNS)
    assert acts.windows == {0: KeyWindow(window=4)}  # Gemma 2 slides every other layer
    table = sink_table(acts, n_tokens=None)
    for l, queries in ((0, slice(1, 4)), (1, slice(1, 16))):  # a window of 4: queries 1..3 see key 0
        by_hand = np.mean([p[:, queries, 0].astype(np.float64).mean(1) for p in acts.patterns[PATTERNS[l]]], axis=0)
        np.testing.assert_allclose(table.query(f"block == {l}")["sink_mass"], by_hand, rtol=1e-9)


@pytest.mark.parametrize(
    ("build", "want"),
    [(lambda: llama(rope=False), "nope"), (llama, "relative"), (gemma, "relative")],
    ids=["llama-nope", "llama-rope", "gemma2-window"],
)
def test_the_audit_says_which_method_each_layer_uses_and_fails_nothing(build, want):
    from nopelens.analyses.audit import audit

    report = audit(hook_any(build(), verbose=False))
    assert report.model["measured_layer_positions"] == [want, want], report.step(5).evidence
    assert report.passed and [s.number for s in report.steps if s.status == "pass"] == [3, 7]
