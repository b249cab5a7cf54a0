"""Activation collection on a Decoder, on bridged HF models and on any torch module."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from nopelens.models import Decoder, DecoderConfig
from nopelens.models.adapters import HookedModule, bridge_hf_model
from nopelens.probes import collect, resid_site, resid_sites, site_layer
from nopelens.probes.collect import _StopForward


def tiny_decoder(position="nope", n_layers=2, seed=0):
    cfg = DecoderConfig(d_vocab=50, n_ctx=32, n_layers=n_layers, d_model=32, n_heads=4, position=position)
    return Decoder(cfg, seed=seed)


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def hf_models():
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    return {
        "gpt2": GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64)),
        "neox": GPTNeoXForCausalLM(
            GPTNeoXConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                vocab_size=64,
                max_position_embeddings=64,
            )
        ),
        "llama": LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                vocab_size=64,
                max_position_embeddings=64,
            )
        ),
    }


@pytest.fixture(scope="module")
def bridges():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {}
        for name, model in hf_models().items():
            with torch.no_grad():  # large weights make every position effect visible
                for param in model.parameters():
                    if param.ndim >= 2:
                        param.normal_(0.0, 0.3)
            out[name] = bridge_hf_model(model.eval())
        return out


def test_layer_numbering_follows_design():
    assert resid_site(0) == "blocks.0.hook_resid_pre"
    assert resid_site(3) == "blocks.2.hook_resid_post"
    assert [site_layer(s) for s in resid_sites(3)] == [0, 1, 2, 3]
    assert site_layer("blocks.1.hook_resid_pre") == site_layer("blocks.0.hook_resid_post") == 1
    with pytest.raises(ValueError):
        resid_site(4, n_layers=3)
    with pytest.raises(ValueError):
        resid_site(-1)


def test_decoder_collect_matches_run_with_cache_and_skips_padding():
    model = tiny_decoder("rope")
    tokens = torch.randint(0, 50, (5, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # left padding
    mask[2, 5:] = 0  # right padding
    sites = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_rot_q"]
    acts = collect(model, tokens, sites + [0], attention_mask=mask, batch_size=2)
    assert acts.n_samples == int(mask.sum()) == 35 - 5
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    real = mask.bool()
    for site in sites + ["blocks.0.hook_resid_pre"]:
        np.testing.assert_allclose(acts.acts[site], cache[site][real].numpy(), atol=1e-6)
    assert acts.acts["blocks.0.attn.hook_rot_q"].shape == (30, 4, 8)
    assert acts.position[:4].tolist() == [0, 1, 2, 3] and acts.sequence_id[:4].tolist() == [0] * 4
    assert acts.token.tolist() == tokens[real].tolist()
    assert acts.position.max() == 6 and acts.sequence_id.max() == 4


def test_decoder_left_padding_gives_the_unpadded_activations():
    model = tiny_decoder("learned")
    tokens = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    alone = collect(model, tokens, [2])
    left = collect(model, padded, [2], attention_mask=mask)
    np.testing.assert_allclose(alone.acts[resid_site(2)], left.acts[resid_site(2)], atol=1e-5)
    assert left.position.tolist() == list(range(6))


@pytest.mark.parametrize("name", ["gpt2", "neox", "llama"])
def test_bridged_hf_models_collect_and_handle_left_padding(bridges, name):
    bridge = bridges[name]
    tokens = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([torch.zeros(3, 2, dtype=torch.long), tokens], 1)
    mask = torch.ones_like(padded)
    mask[:, :2] = 0
    mask[1, 2] = 0  # row 1 has three pads
    sites = [resid_site(0), resid_site(2), "blocks.0.attn.hook_pattern"]
    alone = collect(bridge, tokens[[0, 2]], sites)
    left = collect(bridge, padded, sites, attention_mask=mask)
    keep = left.sequence_id != 1
    for site in sites[:2]:
        np.testing.assert_allclose(left.acts[site][keep], alone.acts[site], atol=1e-4)
    np.testing.assert_allclose(left.patterns[sites[2]][0], alone.patterns[sites[2]][0], atol=1e-5)
    # row 1 starts one later: its first real token is position 0, and it has 5 samples
    assert left.position[left.sequence_id == 1].tolist() == [0, 1, 2, 3, 4]
    # the check above can fail: with other position ids (stretched, so relative distances change
    # too and RoPE notices) the same tokens give visibly different activations
    stretched = (2 * (mask.cumsum(-1) - 1)).clamp(min=0)
    _, cache = bridge.run_with_cache(padded, attention_mask=mask, position_ids=stretched, names_filter=[resid_site(2)])
    wrong = cache[resid_site(2)][mask.bool()].numpy()[keep]
    assert np.abs(wrong - alone.acts[resid_site(2)]).max() > 1e-2


def test_bridge_rotated_queries_and_grouped_keys(bridges):
    acts = collect(
        bridges["llama"], torch.randint(0, 64, (2, 5)), ["blocks.1.attn.hook_rot_q", "blocks.1.attn.hook_rot_k"]
    )
    assert acts.acts["blocks.1.attn.hook_rot_q"].shape == (10, 4, 8)
    assert acts.acts["blocks.1.attn.hook_rot_k"].shape == (10, 2, 8)


def test_hooked_module_collects_from_any_torch_module():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    hooked = HookedModule(net, {"hidden": "1", "out": "3"})
    tokens = torch.randint(0, 20, (4, 5))
    acts = collect(hooked, tokens, ["hidden", "out"])
    with torch.no_grad():
        hidden = net[1](net[0](tokens))
    np.testing.assert_allclose(acts.acts["hidden"], hidden.reshape(-1, 8).numpy(), atol=1e-6)
    assert acts.acts["out"].shape == (20, 3)


def test_unknown_site_lists_existing_sites():
    model = tiny_decoder()
    with pytest.raises(KeyError, match="blocks.1.hook_resid_post"):
        collect(model, torch.zeros(1, 3, dtype=torch.long), ["blocks.7.hook_resid_post"])
    with pytest.raises(TypeError, match="HookedModule"):
        collect(nn.Linear(2, 2), torch.zeros(1, 3, dtype=torch.long), ["x"])


def test_forward_stops_after_the_last_needed_site():
    model = tiny_decoder(n_layers=3)
    reached = []
    handles = [model.blocks[k].register_forward_pre_hook(lambda *a, k=k: reached.append(k)) for k in (1, 2)]
    collect(model, torch.zeros(1, 4, dtype=torch.long), [resid_site(1)])
    assert reached == []  # block 1 never started: the pass stopped at block 0's output
    collect(model, torch.zeros(1, 4, dtype=torch.long), [resid_site(2), "blocks.0.attn.hook_q"])
    assert reached == [1]
    for handle in handles:
        handle.remove()


def test_hooks_are_removed_even_when_the_forward_raises():
    model = tiny_decoder()
    user_hook = model.hook_dict["blocks.0.hook_resid_post"].register_forward_hook(lambda *a: None)
    before = hook_count(model)

    def boom(module, inputs, output):
        raise RuntimeError("boom")

    failing = model.blocks[0].attn.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        collect(model, torch.zeros(2, 4, dtype=torch.long), [resid_site(2), "blocks.0.attn.hook_pattern"])
    failing.remove()
    assert hook_count(model) == before  # ours are gone, the user's hook is still there
    collect(model, torch.zeros(2, 4, dtype=torch.long), [resid_site(2)])
    assert hook_count(model) == before
    user_hook.remove()
    assert not issubclass(_StopForward, (ValueError, KeyError, RuntimeError))


def test_bridge_hooks_restored(bridges):
    bridge = bridges["gpt2"]
    before = hook_count(bridge)
    collect(bridge, torch.randint(0, 64, (2, 4)), [resid_site(1), "blocks.1.attn.hook_pattern"])
    assert hook_count(bridge) == before


def test_nan_activation_raises_naming_site_and_sample():
    model = tiny_decoder()
    with torch.no_grad():
        model.embed.W_E[7] = float("nan")
    tokens = torch.tensor([[1, 2, 3], [4, 5, 7]])
    with pytest.raises(ValueError, match=r"hook_resid_pre', sequence 1, position 2"):
        collect(model, tokens, [0])


def test_bad_inputs_are_rejected():
    model = tiny_decoder()
    with pytest.raises(TypeError):
        collect(model, torch.zeros(1, 3), [0])
    with pytest.raises(ValueError, match="no real token"):
        collect(model, torch.zeros(2, 3, dtype=torch.long), [0], attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(ValueError, match="empty"):
        collect(model, torch.zeros(1, 3, dtype=torch.long), [])


def test_pattern_sites_are_per_sequence_without_padding():
    model = tiny_decoder()
    tokens = torch.randint(0, 50, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    acts = collect(model, tokens, ["blocks.1.attn.hook_pattern"], attention_mask=mask)
    first, second = acts.patterns["blocks.1.attn.hook_pattern"]
    assert first.shape == (4, 3, 3) and second.shape == (4, 5, 5)
    np.testing.assert_allclose(first.sum(-1), 1.0, atol=1e-6)
    assert np.all(np.triu(first[0], 1) == 0)


# ----------------------------------------------------------------------------- HookedModule edge cases (issue 12)
class _Shared(nn.Module):
    """One linear layer applied twice in a forward pass."""

    def __init__(self):
        super().__init__()
        self.embed, self.layer = nn.Embedding(20, 8), nn.Linear(8, 8)

    def forward(self, tokens):
        return self.layer(self.layer(self.embed(tokens)))


class _Positional(nn.Module):
    """Token plus learned position embedding; takes position ids (and a mask it ignores)."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos, self.out = nn.Embedding(20, 8), nn.Embedding(16, 8), nn.Identity()

    def forward(self, tokens, attention_mask=None, position_ids=None):
        ids = torch.arange(tokens.shape[1])[None] if position_ids is None else position_ids
        return self.out(self.embed(tokens) + self.pos(ids))


class _Blind(_Positional):
    """The same, but positions always count from the first column (no position_ids argument)."""

    def forward(self, tokens, attention_mask=None):
        return super().forward(tokens)


def test_hooked_module_refuses_a_submodule_that_runs_twice():
    hooked = HookedModule(_Shared(), {"hidden": "layer"})
    tokens = torch.randint(0, 20, (2, 4))
    with pytest.raises(ValueError, match="ran 2 times in one forward pass"):
        collect(hooked, tokens, ["hidden"])
    with pytest.raises(ValueError, match="ran 2 times"):
        hooked.run_with_cache(tokens)


def test_hooked_module_left_padding_passes_position_ids_or_refuses():
    torch.manual_seed(0)
    net = _Positional()
    hooked = HookedModule(net, {"out": "out"}, output_fn=lambda x: x)
    tokens = torch.randint(1, 20, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    alone, left = collect(hooked, tokens, ["out"]), collect(hooked, padded, ["out"], attention_mask=mask)
    np.testing.assert_allclose(left.acts["out"], alone.acts["out"], atol=1e-6)
    blind = HookedModule(_Blind(), {"out": "out"}, output_fn=lambda x: x)
    with pytest.raises(ValueError, match="takes no position_ids"):
        collect(blind, padded, ["out"], attention_mask=mask)
    right = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])  # right padding keeps positions from 0
    assert collect(blind, padded.roll(-3, 1), ["out"], attention_mask=right).n_samples == 5


def test_collect_restores_every_submodule_training_flag():
    model = tiny_decoder()
    model.train()
    model.blocks[0].eval()
    before = [m.training for m in model.modules()]
    collect(model, torch.zeros(1, 4, dtype=torch.long), [resid_site(2)])
    assert [m.training for m in model.modules()] == before


def test_a_pattern_that_sees_the_future_is_refused():
    model = tiny_decoder()

    def leak(pattern, hook):
        return torch.ones_like(pattern) / pattern.shape[-1]

    model.blocks[1].attn.hook_pattern.add_hook(leak)
    with pytest.raises(ValueError, match="ignores the causal mask"):
        collect(model, torch.zeros(1, 4, dtype=torch.long), ["blocks.1.attn.hook_pattern"])
    model.reset_hooks()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_finite_checks_accept_sums_that_overflow_and_name_a_bad_value(dtype):
    """The finite checks first sum the whole tensor: finite values whose half-precision sum would
    overflow are accepted, and a NaN or infinity is still named by site, sequence and position."""
    from nopelens.probes.collect import check_patterns, real_values

    big = torch.finfo(dtype).max / 4
    value = torch.full((2, 3, 4), big, dtype=dtype)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # the first sequence left-padded
    assert real_values(value, mask.bool(), "s", 0).shape == (5, 4)
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = value.clone()
        broken[1, 2, 0] = bad
        with pytest.raises(ValueError, match="site 's', sequence 11, position 2"):
            real_values(broken, mask.bool(), "s", 10)
    padded = value.clone()
    padded[0, 0, 0] = float("nan")  # a padded position is no sample: not checked
    real_values(padded, mask.bool(), "s", 0)
    future = torch.ones(3, 3, dtype=torch.bool).triu(1)
    scores = torch.full((2, 1, 3, 3), big, dtype=dtype).masked_fill(future, -float("inf"))
    check_patterns(scores, mask, "blocks.0.attn.hook_attn_scores", 0)  # -inf at blocked keys by design
    scores[1, 0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match="sequence 1, head 0, query position 2"):
        check_patterns(scores, mask, "blocks.0.attn.hook_attn_scores", 0)
