"""Issue 47: any torch model hooked with no hand-written map (nopelens.models.anymodel.hook_any), its
attention read from the computation (nopelens.models.intercept), and the reads that refuse attention
that is not a distribution or a mask they do not know."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nopelens.models.adapters import HookedModule
from nopelens.models.anymodel import UnmappableModelError, hook_any
from nopelens.models.hooks import act_names
from nopelens.models.intercept import infer_key_window, sdpa_scores
from nopelens.models.masks import KeyWindow
from nopelens.probes import collect, probe_absolute_index, resid_sites, sink_table
from nopelens.probes.sink_patterns import sink_mass_by_query

PATTERNS = act_names("pattern", 2)


def rotate(x, positions, base=10000.0):
    """RoPE (rotate-half layout) of ``[batch, head, pos, d_head]`` at ``[batch, pos]`` positions."""
    half = x.shape[-1] // 2
    angles = positions[:, None, :, None].double() * base ** (-torch.arange(half).double() / half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (NoPE, or RoPE with ``rope``), fused (``scaled_dot_product_attention``) or
    explicit, with GQA."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        fused: bool,
        n_kv_heads: int | None = None,
        window: int | None = None,
        rope: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv, self.d_head = n_heads, n_kv_heads or n_heads, d_model // n_heads
        self.c_attn = nn.Linear(d_model, d_model + 2 * self.n_kv * self.d_head)
        self.c_proj = nn.Linear(d_model, d_model)
        self.fused, self.window, self.rope = fused, window, rope

    def forward(self, x, positions=None, keys=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split([C, self.n_kv * self.d_head, self.n_kv * self.d_head], dim=2)
        q, k, v = (t.view(B, T, -1, self.d_head).transpose(1, 2) for t in (q, k, v))
        if self.rope:
            positions = torch.arange(T).expand(B, T) if positions is None else positions
            q, k = rotate(q, positions), rotate(k, positions)
        if keys is not None:  # left padding: real queries see real keys only, a padded one its causal prefix
            keys = keys.bool()
            mask = torch.ones(T, T, dtype=torch.bool).tril() & (keys[:, None, None, :] | ~keys[:, None, :, None])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.window is not None:  # a boolean sliding-window mask, True = may attend
            i = torch.arange(T)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)
            att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, **kwargs):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, **kwargs)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, positions=None, keys=None):
        x = x + self.attn(self.ln_1(x), positions, keys)
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-style NoPE decoder, written here as a user would: nopelens knows nothing of it."""

    def __init__(self, d_vocab=64, d_model=32, n_heads=4, n_layers=2, fused=True, **kwargs):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(d_vocab, d_model),
                ln_f=nn.LayerNorm(d_model),
                h=nn.ModuleList(Block(d_model, n_heads, fused=fused, **kwargs) for _ in range(n_layers)),
            )
        )
        self.lm_head = nn.Linear(d_model, d_vocab, bias=False)

    def forward(self, idx, positions=None, keys=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, positions, keys)
        return self.lm_head(self.transformer.ln_f(x))


class NanoGPTWithIds(NanoGPT):
    """The same decoder, its forward taking ``position_ids`` and ``attention_mask`` (what lets the audit
    set positions and pad on the left)."""

    def forward(self, idx, position_ids=None, attention_mask=None):
        return super().forward(idx, position_ids, attention_mask)


def nano(seed=0, takes_ids=False, **kwargs) -> NanoGPT:
    torch.manual_seed(seed)
    return (NanoGPTWithIds if takes_ids else NanoGPT)(**kwargs).eval()


def tokens(n=6, length=10, seed=1):
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))


HAND_MAP = {
    "blocks.0.hook_resid_pre": "transformer.h.0:input",
    "blocks.0.hook_resid_post": "transformer.h.0",
    "blocks.1.hook_resid_post": "transformer.h.1",
}


def test_the_map_found_is_printed_and_its_activations_equal_a_hand_written_maps_bit_for_bit(capsys):
    model = nano()
    hooked = hook_any(model)
    printed = capsys.readouterr().err
    assert "blocks.0.hook_resid_pre <- transformer.h.0:input" in printed and "hook_embed <- transformer.wte" in printed
    auto = collect(hooked, tokens(), resid_sites(2))
    hooked.remove()
    by_hand = HookedModule(model, HAND_MAP)
    manual = collect(by_hand, tokens(), resid_sites(2))
    for site in resid_sites(2):
        assert np.array_equal(auto.acts[site], manual.acts[site]), site


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_fused_pattern_equals_the_explicit_softmax_of_the_same_weights_and_q_k_give_the_scores(n_kv_heads):
    fused, explicit = nano(fused=True, n_kv_heads=n_kv_heads), nano(fused=False, n_kv_heads=n_kv_heads)
    explicit.load_state_dict(fused.state_dict())
    sites = PATTERNS + ["blocks.1.attn.hook_q", "blocks.1.attn.hook_k"]
    got = collect(hook_any(fused, verbose=False), tokens(), sites)
    want = collect(hook_any(explicit, verbose=False), tokens(), PATTERNS)
    for site in PATTERNS:
        np.testing.assert_allclose(np.stack(got.patterns[site]), np.stack(want.patterns[site]), atol=1e-6)
    q = torch.as_tensor(got.acts["blocks.1.attn.hook_q"]).view(6, 10, 4, 8).transpose(1, 2)
    k = torch.as_tensor(got.acts["blocks.1.attn.hook_k"]).view(6, 10, -1, 8).transpose(1, 2)
    assert k.shape[1] == (n_kv_heads or 4)  # the call's own key-value heads
    recomputed = torch.softmax(sdpa_scores(q, k, is_causal=True), -1)
    np.testing.assert_allclose(recomputed.numpy(), np.stack(got.patterns["blocks.1.attn.hook_pattern"]), atol=1e-6)


def test_reading_the_pattern_leaves_the_fused_output_bit_for_bit():
    model = nano()
    plain = model(tokens())
    logits, cache = hook_any(model, verbose=False).run_with_cache(tokens(), names_filter=lambda name: "pattern" in name)
    assert torch.equal(plain, logits) and cache["blocks.0.attn.hook_pattern"].dtype == torch.float64


@pytest.mark.parametrize("fused", [True, False])
def test_known_answers_zero_qk_gives_first_key_mass_one_over_i_plus_one_and_repeated_nope_no_position(fused):
    model = nano(fused=fused)
    for block in model.transformer.h:
        with torch.no_grad():
            block.attn.c_attn.weight[:64].zero_()  # W_Q and W_K (d_model rows each), and their biases
            block.attn.c_attn.bias[:64].zero_()
    acts = collect(hook_any(model, verbose=False), tokens(), PATTERNS)
    for site in PATTERNS:
        for by_query in sink_mass_by_query(acts.patterns[site]):
            np.testing.assert_allclose(by_query, np.broadcast_to(1 / np.arange(1, 11), by_query.shape), atol=1e-7)
    repeated = torch.full((24, 12), 5)
    table = probe_absolute_index(
        collect(hook_any(nano(fused=fused), verbose=False), repeated, resid_sites(2)), tasks=("regression",), n_boot=20
    )
    r2 = table.query("probe == 'linear' and metric == 'r2'")
    assert len(r2) == 3 and np.all(np.abs(r2["value"]) < 1e-6), r2


def test_hf_sdpa_pattern_equals_its_own_eager_weights():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        eager = model(tokens(3, 12), output_attentions=True).attentions
    model.config._attn_implementation = "sdpa"
    acts = collect(hook_any(model, verbose=False), tokens(3, 12), PATTERNS)
    for l, site in enumerate(PATTERNS):
        np.testing.assert_allclose(np.stack(acts.patterns[site]), eager[l].numpy(), atol=1e-6)


def test_the_audit_of_an_hf_model_through_hook_any_pads_on_the_left_and_passes():
    from nopelens.analyses.audit import audit

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    padded = torch.ones(4, 4, dtype=torch.bool).tril()
    padded[:, 0] = padded[0, :] = False  # the first token a pad: query 0 sees no key
    assert infer_key_window(padded) is None  # no window or chunk of 0
    report = audit(hook_any(transformers.LlamaForCausalLM(config).eval(), verbose=False))
    assert report.step(1).status == "pass" and report.passed
    assert report.model["measured_layer_positions"] == ["relative", "relative"]


def test_the_window_of_the_intercepted_call_travels_with_the_activations():
    model = nano(window=4)
    acts = collect(hook_any(model, verbose=False), tokens(6, 16), PATTERNS)
    assert acts.windows == {0: KeyWindow(window=4), 1: KeyWindow(window=4)}
    table = sink_table(acts, n_tokens=None)
    for l, site in enumerate(PATTERNS):
        by_hand = np.mean(
            [p[:, 1:4, 0].astype(np.float64).mean(1) for p in acts.patterns[site]], axis=0
        )  # queries 1..3
        np.testing.assert_allclose(table.query(f"block == {l}")["sink_mass"], by_hand, rtol=1e-9)
    assert infer_key_window(KeyWindow(chunk=3).visible(7)) == KeyWindow(chunk=3)


def test_a_mask_the_model_cannot_take_is_refused_naming_the_class_or_dropped_where_exact():
    hooked = hook_any(nano(), verbose=False)
    left = torch.ones(2, 10, dtype=torch.long)
    left[0, :3] = 0
    with pytest.raises(ValueError, match="NanoGPT.forward takes the tokens and positions, keys, not attention_mask"):
        collect(hooked, tokens(2), resid_sites(2), attention_mask=left)
    right = left.flip(-1)
    padded = collect(hooked, tokens(2), resid_sites(2), attention_mask=right)
    plain = collect(hooked, tokens(2)[:, :7], resid_sites(2))
    np.testing.assert_array_equal(
        padded.acts["blocks.1.hook_resid_post"][:7], plain.acts["blocks.1.hook_resid_post"][:7]
    )


class SharedLoop(nn.Module):
    """One block run twice: no list of blocks that each run once."""

    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Embedding(64, 32), Block(32, 4, fused=True)

    def forward(self, idx):
        return self.block(self.block(self.embed(idx)))


def test_an_unmappable_model_is_refused_in_one_line_saying_which_map_to_pass():
    with pytest.raises(UnmappableModelError, match=r"SharedLoop.*pass sites=\{'blocks.0.hook_resid_pre'") as error:
        hook_any(SharedLoop().eval(), verbose=False)
    assert "\n" not in str(error.value)


class SigmoidAttention(CausalSelfAttention):
    """Sigmoid attention (x-transformers' ``attn_sigmoid``): rows are not distributions. ``probe`` is the
    one module that sees the weights (as the issue's Dropout(p=0) did)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe = nn.Identity()

    def forward(self, x, positions=None, keys=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, -1, self.d_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        weights = torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(self.d_head)) * torch.ones(T, T).tril()
        return self.c_proj((self.probe(weights) @ v).transpose(1, 2).reshape(B, T, C))


def test_sigmoid_attention_is_no_distribution_and_every_read_refuses_it():
    model = nano()
    for block in model.transformer.h:
        sigmoid = SigmoidAttention(32, 4, fused=False)
        sigmoid.load_state_dict(block.attn.state_dict())
        block.attn = sigmoid
    hooked = hook_any(model, verbose=False)  # no softmax call: residual sites only
    assert "blocks.0.attn.hook_pattern" not in hooked.hook_dict
    with pytest.raises(ValueError, match="no hook_pattern site was collected"):
        sink_table(collect(hooked, tokens(), resid_sites(2)))
    hooked.remove()
    by_hand = HookedModule(model, {site: f"transformer.h.{l}.attn.probe" for l, site in enumerate(PATTERNS)})
    with pytest.raises(ValueError, match=r"blocks.0.attn.hook_pattern' has rows that sum to .*not a softmax"):
        collect(by_hand, tokens(), PATTERNS)
    weights = [np.tril(np.full((1, 5, 5), 0.6))]
    with pytest.raises(ValueError, match="pattern 0 has rows that sum to up to 3"):
        sink_mass_by_query(weights)


FACTORY = """
import math, torch
from torch import nn
import torch.nn.functional as F

class Attention(nn.Module):
    def __init__(self, sigmoid=False):
        super().__init__()
        self.qkv, self.out, self.sigmoid = nn.Linear(32, 96), nn.Linear(32, 32), sigmoid
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        if self.sigmoid:
            y = (torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(8)) * torch.ones(T, T).tril()) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))

class Model(nn.Module):
    def __init__(self, sigmoid=False, shared=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.unembed = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.blocks = nn.ModuleList(Attention(sigmoid) for _ in range(1 if shared else 2))
        self.shared = shared
    def forward(self, tokens):
        x = self.embed(tokens)
        for block in (list(self.blocks) * 2 if self.shared else self.blocks):
            x = x + block(x)
        return self.unembed(x)

def make_model():
    return Model()

def sigmoid_model():
    return Model(sigmoid=True)

def shared_model():
    return Model(shared=True)

def broken():
    raise RuntimeError("out of coffee")

def exits():
    raise SystemExit(3)
"""


def test_cli_probes_and_sink_measures_a_factory_model_and_refuses_bad_ones_in_one_line(tmp_path, capsys):
    from nopelens.analyses import cli

    (tmp_path / "mine.py").write_text(FACTORY)
    spec = f"factory:{tmp_path / 'mine.py'}"
    assert cli.main(["sinks", f"{spec}:make_model", "--n-sequences", "4", "--seq-len", "70", "--quiet"]) == 0
    out = capsys.readouterr()
    assert "blocks.1.hook_resid_post <- unembed:input" in out.err  # the loop adds each block's branch
    assert "sink mass (rows: layer, columns: head)" in out.out
    assert (
        cli.main(
            [
                "probe",
                f"{spec}:make_model",
                "--n-sequences",
                "8",
                "--seq-len",
                "8",
                "--quiet",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert (tmp_path / "run" / "layers.csv").exists()
    capsys.readouterr()
    for function, words in (
        ("sigmoid_model", "no softmax attention call"),
        ("shared_model", "pass sites="),
        ("broken", "raised RuntimeError: out of coffee"),
        ("missing", "defines no function"),
        ("exits", "raised SystemExit: 3"),
    ):
        assert cli.main(["sinks", f"{spec}:{function}", "--n-sequences", "4", "--seq-len", "70", "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert words in err[-1] and err[-1].startswith("nopelens sinks: error:"), err


class AbsoluteBiasAttention(CausalSelfAttention):
    """Attention adding a bias by absolute (query, key) position: no offset rule."""

    def forward(self, x, positions=None, keys=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        i = torch.arange(T, dtype=x.dtype)
        bias = (0.3 * i[:, None] * i[None, :]).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(B, T, C))


AUDITED = {
    "nope, fused": ({}, ["nope", "nope"]),
    "rope, fused": ({"rope": True}, ["relative", "relative"]),
    "rope, explicit softmax": ({"rope": True, "fused": False}, ["relative", "relative"]),
    "rope, takes position_ids": ({"rope": True, "takes_ids": True}, ["relative", "relative"]),
    "nope, takes position_ids": ({"takes_ids": True}, ["nope", "nope"]),
}


@pytest.mark.parametrize("case", sorted(AUDITED))
def test_the_audit_of_a_hooked_nanogpt_measures_each_layer_and_fails_nothing(case):
    from nopelens.analyses.audit import audit

    kwargs, want = AUDITED[case]
    report = audit(hook_any(nano(**kwargs), verbose=False))
    assert report.model["measured_layer_positions"] == want
    assert report.model["measured_input_positions"].startswith("none")
    assert [s.number for s in report.steps if s.status == "pass"] == ([1, 3, 7] if "takes_ids" in kwargs else [3, 7])
    assert report.passed
    detector = "position_ids re-spaced" if "takes_ids" in kwargs else "constant input"
    assert detector in report.step(5).reason and "declares no position method" in report.step(5).reason


def test_the_audits_constant_input_reading_knows_absolute_positions_and_zero_qk():
    from nopelens.analyses.audit import audit

    model = nano(rope=True)
    absolute = AbsoluteBiasAttention(32, 4, fused=True)
    absolute.load_state_dict(model.transformer.h[1].attn.state_dict())
    model.transformer.h[1].attn = absolute
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:64] = 0  # W_Q = W_K = 0: q = k = 0, so no position read
        model.transformer.h[0].attn.c_attn.bias[:64] = 0
    report = audit(hook_any(model, verbose=False))
    assert report.model["measured_layer_positions"] == ["nope", "absolute"], report.step(5).evidence
    learned = nano()
    learned.transformer.wte = nn.Sequential(learned.transformer.wte)  # an absolute table added after the lookup
    learned.transformer.wte.append(AddPositions(32))
    report = audit(hook_any(learned, verbose=False))
    assert report.model["measured_input_positions"].startswith("absolute")
    assert report.model["measured_layer_positions"] == ["nope", "nope"]  # v held constant: the layers read none
    ignoring = nano(takes_ids=True)  # takes position_ids, yet its table is indexed by the token's index
    ignoring.transformer.wte = nn.Sequential(ignoring.transformer.wte, AddPositions(32))
    step1 = audit(hook_any(ignoring, verbose=False)).step(1)
    assert step1.status == "fail" and step1.checks[0].value > 1e-3


class AddPositions(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.table = nn.Parameter(torch.randn(64, d_model))

    def forward(self, x):
        return x + self.table[: x.shape[1]]


def test_the_audit_refuses_attention_that_is_no_softmax_and_logits_that_are_not_finite_in_one_line():
    from nopelens.analyses.audit import audit

    model = nano()
    for block in model.transformer.h:
        block.attn = SigmoidAttention(32, 4, fused=False)
    with pytest.raises(ValueError, match="records no softmax attention"):
        audit(hook_any(model, verbose=False))
    by_hand = HookedModule(
        model, {**HAND_MAP, **{site: f"transformer.h.{l}.attn.probe" for l, site in enumerate(PATTERNS)}}
    )
    with pytest.raises(ValueError, match=r"blocks.0.attn.hook_pattern' has rows that sum to .*not a softmax"):
        audit(by_hand)
    broken = nano()
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="logits are not finite on the probe"):
        audit(hook_any(broken, verbose=False))


def test_cli_audits_a_factory_model_and_refuses_bad_ones_in_one_line(tmp_path, capsys):
    from nopelens.analyses import cli

    (tmp_path / "mine.py").write_text(FACTORY)
    spec = f"factory:{tmp_path / 'mine.py'}"
    assert cli.main(["audit", "--model", f"{spec}:make_model", "--out", str(tmp_path / "audit")]) == 0
    out = capsys.readouterr()
    assert "blocks.1.hook_resid_post <- unembed:input" in out.err  # the map chosen, on stderr
    assert "measured per layer (constant input, read from the recorded scores, q, k and v): nope, nope" in out.out
    assert (tmp_path / "audit" / "audit.json").exists()
    for function, words in (
        ("sigmoid_model", "records no softmax attention"),
        ("shared_model", "pass sites="),
        ("broken", "raised RuntimeError: out of coffee"),
    ):
        assert cli.main(["audit", "--model", f"{spec}:{function}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert words in err[-1] and err[-1].startswith("nopelens audit: error:"), err


class DictOutput(NanoGPT):
    def forward(self, idx):
        return {"logits": super().forward(idx), "aux": None}


class TupleOutput(NanoGPT):
    def forward(self, idx):
        return super().forward(idx), None


class NoLogits(NanoGPT):
    def forward(self, idx):
        return {"hidden": super().forward(idx)}


def test_logits_are_found_in_a_dict_or_tuple_output_and_an_output_without_them_is_refused_in_one_line():
    from nopelens.analyses.audit import audit

    torch.manual_seed(0)
    plain = nano()
    for wrapper in (DictOutput, TupleOutput):
        model = wrapper().eval()
        model.load_state_dict(plain.state_dict())
        assert torch.equal(hook_any(model, verbose=False)(tokens()), plain(tokens()))
        assert audit(hook_any(model, verbose=False)).passed
    with pytest.raises(TypeError, match=r"NoLogits's forward returned a dict with no tensor of logits.*output_fn"):
        audit(hook_any(NoLogits().eval(), verbose=False))


def test_a_model_giving_nan_is_refused_naming_where_not_as_an_unmappable_structure():
    model = nano()
    with torch.no_grad():
        model.transformer.wte.weight[:] = float("nan")
    with pytest.raises(UnmappableModelError, match=r"gives NaN at transformer.wte on the census input"):
        hook_any(model, verbose=False)


class ShortTable(NanoGPT):
    """A learned position table of 12 rows, added after the lookup: longer inputs fail in its own code."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(12, 32))

    def forward(self, idx):
        x = self.transformer.wte(idx) + self.pos[: idx.shape[1]]
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_a_forward_pass_failing_in_the_models_own_code_is_its_error_not_an_internal_one(tmp_path, capsys):
    from nopelens.analyses import cli
    from nopelens.analyses.audit import audit

    model = ShortTable().eval()
    hooked = hook_any(model, verbose=False)  # the census at 8 tokens runs
    with pytest.raises(
        ValueError,
        match=r"ShortTable's forward pass on token ids of shape \[6, 20\] raised "
        r"RuntimeError: The size of tensor a \(20\).* in its own code",
    ):
        collect(hooked, tokens(length=20), resid_sites(2))
    with pytest.raises(ValueError, match=r"ShortTable's forward pass .* raised RuntimeError"):
        hook_any(model, tokens=tokens(length=20), verbose=False)
    with pytest.raises(ValueError, match=r"ShortTable's forward pass on token ids of shape \[1, 20\]"):
        audit(hook_any(model, verbose=False), eval_length=20)
    (tmp_path / "mine.py").write_text(FACTORY)
    assert (
        cli.main(
            ["sinks", f"factory:{tmp_path / 'mine.py'}:make_model", "--n-sequences", "4", "--seq-len", "70", "--quiet"]
        )
        == 0
    )  # the factory's model has no table: any length runs
    (tmp_path / "short.py").write_text(
        FACTORY.replace("x = self.embed(tokens)", "x = self.embed(tokens) + self.pos[: tokens.shape[1]]").replace(
            "self.shared = shared", "self.shared, self.pos = shared, nn.Parameter(torch.zeros(12, 32))"
        )
    )
    assert (
        cli.main(
            ["sinks", f"factory:{tmp_path / 'short.py'}:make_model", "--n-sequences", "4", "--seq-len", "20", "--quiet"]
        )
        == 2
    )
    assert "raised RuntimeError" in capsys.readouterr().err.strip().splitlines()[-1]


class MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x, *unused):
        T = x.shape[1]
        return x + self.attn(x, x, x, attn_mask=~torch.ones(T, T, dtype=torch.bool).tril(), need_weights=False)[0]


def test_a_model_of_nn_multiheadattention_is_refused_naming_it_not_as_sigmoid_attention():
    from nopelens.analyses.audit import audit

    model = nano()
    model.transformer.h = nn.ModuleList(MHABlock() for _ in range(2))
    with pytest.raises(
        ValueError,
        match=r"nn.MultiheadAttention \(transformer.h.0.attn and 1 more\) computes attention "
        "inside one fused call that hook_any does not see",
    ):
        audit(hook_any(model.eval(), verbose=False))


def test_a_rerun_after_the_factory_file_changed_is_refused_not_answered_from_the_old_model(tmp_path, capsys):
    from nopelens.analyses import cli

    source = tmp_path / "mine.py"
    source.write_text(FACTORY)
    command = [
        "probe",
        f"factory:{source}:make_model",
        "--n-sequences",
        "8",
        "--seq-len",
        "8",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
    ]
    assert cli.main(command) == 0 and cli.main(command) == 0  # unchanged: reused
    source.write_text(FACTORY.replace("torch.manual_seed(0)", "torch.manual_seed(1)"))
    capsys.readouterr()
    assert cli.main(command) == 2
    assert "the factory's source file changed" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_failed_or_abandoned_wrapper_leaves_the_users_model_working():
    model = nano()
    bad = hook_any(model, sites={"blocks.0.hook_resid_pre": "transformer.h.0:input.5"}, verbose=False)
    with pytest.raises(ValueError, match="reads positional input 5"):
        bad(tokens())
    assert torch.equal(model(tokens()), nano()(tokens()))  # the bare model: the wrapper's hooks are inert
    good = hook_any(model, verbose=False)  # the census and the new wrapper run despite the old hooks
    assert torch.equal(good(tokens()), model(tokens()))
    assert act_names("pattern", 1)[0] in good.run_with_cache(tokens())[1]


def test_a_factory_models_tokens_span_the_vocabulary_of_the_embedding_they_go_through(tmp_path):
    from nopelens.analyses.factory import factory_subject
    from nopelens.analyses.subjects import Subject

    (tmp_path / "gpt.py").write_text(
        FACTORY.replace(  # a position table declared before the token table
            "        self.embed, self.unembed = nn.Embedding(64, 32), nn.Linear(32, 64)",
            "        self.wpe = nn.Embedding(16, 32)\n"
            "        self.embed, self.unembed = nn.Embedding(64, 32), nn.Linear(32, 64)",
        ).replace("x = self.embed(tokens)", "x = self.embed(tokens) + self.wpe(torch.arange(tokens.shape[1]))")
    )
    subject = factory_subject(f"factory:{tmp_path / 'gpt.py'}:make_model", 8, 12, 0, Subject)
    assert subject.model.site_paths["hook_embed"] == "embed" and int(subject.tokens.max()) >= 16
    assert torch.equal(subject.tokens, torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0)))
