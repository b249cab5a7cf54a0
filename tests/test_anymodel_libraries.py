"""Issue 47: a third-party model library through hook_any with nothing written by hand.

x-transformers (an optional test extra) builds its decoder as one flat list of attention and
feed-forward entries, each ``[norms, block, Residual]``; its layer 0 is a projection after the
embeddings, and its attention pattern is reachable by module hooks only as the input of a
``Dropout(p=0)``. hook_any finds the residual stream at the ``Residual`` adds and reads the
attention from the softmax (or, with ``attn_flash``, the ``scaled_dot_product_attention``) call.
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

x_transformers = pytest.importorskip("x_transformers")

PATTERNS = act_names("pattern", 2)
POSITIONS = {"nope": {}, "rope": {"rotary_pos_emb": True}, "alibi": {"alibi_pos_bias": True}}


def decoder(position="nope", seed=0, **kwargs):
    torch.manual_seed(seed)
    layers = x_transformers.Decoder(dim=32, depth=2, heads=4, **POSITIONS[position], **kwargs)
    return x_transformers.TransformerWrapper(
        num_tokens=64, max_seq_len=32, use_abs_pos_emb=False, attn_layers=layers
    ).eval()


def tokens(n=6, length=12):
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(1))


def test_the_map_found_reads_the_residual_adds_and_equals_a_hand_written_map_bit_for_bit(capsys):
    model = decoder()
    hooked = hook_any(model)
    auto = collect(hooked, tokens(), resid_sites(2))
    assert "blocks.0.hook_resid_pre <- attn_layers.layers.0.2:input.1" in capsys.readouterr().err
    hooked.remove()
    by_hand = HookedModule(
        model,
        {
            "blocks.0.hook_resid_pre": "attn_layers.layers.0.2:input.1",
            "blocks.0.hook_resid_post": "attn_layers.layers.1.2",
            "blocks.1.hook_resid_post": "attn_layers.layers.3.2",
        },
    )
    manual = collect(by_hand, tokens(), resid_sites(2))
    for site in resid_sites(2):
        assert np.array_equal(auto.acts[site], manual.acts[site]), site


@pytest.mark.parametrize("position", sorted(POSITIONS))
def test_fused_patterns_equal_the_librarys_own_attention_weights(position):
    explicit, fused = decoder(position), decoder(position, attn_flash=True)
    fused.load_state_dict(explicit.state_dict())
    with torch.no_grad():
        _, own = explicit(tokens(), return_attn=True)  # x-transformers' own post-softmax weights
    for model in (explicit, fused):
        acts = collect(hook_any(model, verbose=False), tokens(), PATTERNS)
        for l, site in enumerate(PATTERNS):
            np.testing.assert_allclose(np.stack(acts.patterns[site]), own[l].numpy(), atol=1e-6)


@pytest.mark.parametrize("flash", [False, True])
def test_known_answers_zero_qk_and_repeated_nope(flash):
    model = decoder(attn_flash=flash)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("to_q.weight", "to_k.weight")):
                parameter.zero_()
    acts = collect(hook_any(model, verbose=False), tokens(), PATTERNS)
    for site in PATTERNS:
        for by_query in sink_mass_by_query(acts.patterns[site]):
            np.testing.assert_allclose(by_query, np.broadcast_to(1 / np.arange(1, 13), by_query.shape), atol=1e-7)
    repeated = collect(hook_any(decoder(attn_flash=flash), verbose=False), torch.full((24, 12), 5), resid_sites(2))
    r2 = probe_absolute_index(repeated, tasks=("regression",), n_boot=20).query("probe == 'linear' and metric == 'r2'")
    assert len(r2) == 3 and np.all(np.abs(r2["value"]) < 1e-6), r2


def test_a_sliding_window_travels_with_the_activations_and_the_sink_mass_averages_the_queries_that_see_key_0():
    model = decoder(attn_max_attend_past=3)  # key j visible to query i when i - j <= 3: a window of 4
    acts = collect(hook_any(model, verbose=False), tokens(6, 16), PATTERNS)
    assert acts.windows == {0: KeyWindow(window=4), 1: KeyWindow(window=4)}
    table = sink_table(acts, n_tokens=None)
    for l, site in enumerate(PATTERNS):
        by_hand = np.mean([p[:, 1:4, 0].astype(np.float64).mean(1) for p in acts.patterns[site]], axis=0)
        np.testing.assert_allclose(table.query(f"block == {l}")["sink_mass"], by_hand, rtol=1e-9)


def test_sigmoid_attention_is_refused_by_the_pattern_read():
    model = decoder(attn_sigmoid=True)
    hooked = hook_any(model, verbose=False)
    assert "blocks.0.attn.hook_pattern" not in hooked.hook_dict  # no softmax call
    hooked.remove()
    by_hand = HookedModule(
        model, {site: f"attn_layers.layers.{2 * l}.1.attend.attn_dropout:input" for l, site in enumerate(PATTERNS)}
    )  # the route to the weights
    with pytest.raises(ValueError, match="has rows that sum to .*not a softmax distribution"):
        sink_table(collect(by_hand, tokens(), PATTERNS))


def test_a_learned_sink_in_the_softmax_is_found_and_its_mass_reported():
    """x-transformers' head_learned_sink puts one logit per head before the keys ([sink, scores]): with
    zero W_Q, W_K and sink logits 0, query i spreads its weight evenly over i + 1 keys and the sink, so
    the sink's mass is 1 / (i + 2) and the first key's 1 / (i + 2) too."""
    model = decoder(attn_head_learned_sink=True)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("to_q.weight", "to_k.weight", "head_attn_sink")):
                parameter.zero_()
    hooked = hook_any(model, verbose=False)
    acts = collect(hooked, tokens(), PATTERNS)
    assert hooked.sink_blocks == {0, 1} and acts.sinks == {0: ("learned", None), 1: ("learned", None)}
    table = sink_table(acts, n_tokens=None)
    expected = np.mean(1 / np.arange(2, 14))  # the 12 query rows' sink mass
    np.testing.assert_allclose(table["learned_sink_mass"], expected, atol=1e-7)
    np.testing.assert_allclose(table["sink_mass"], np.mean(1 / np.arange(3, 14)), atol=1e-7)  # rows 1..11
    with torch.no_grad():
        _, own = model(tokens(), return_attn=True)
    np.testing.assert_allclose(
        np.stack(acts.patterns[PATTERNS[0]]), own[0][..., 1:].numpy(), atol=1e-6
    )  # its sink first


def test_cli_sink_measures_an_x_transformers_factory_under_its_window(tmp_path):
    """The library's forward takes **kwargs but no attention_mask: nopelens does not hand it one (the
    issue's error from inside the library), and the window its calls ran under reaches sinks.csv."""
    import pandas as pd

    from nopelens.analyses import cli

    (tmp_path / "xt.py").write_text(
        "from x_transformers import Decoder, TransformerWrapper\n\n"
        "def make_model():\n"
        "    return TransformerWrapper(num_tokens=64, max_seq_len=80, use_abs_pos_emb=False,\n"
        "        attn_layers=Decoder(dim=32, depth=2, heads=4, rotary_pos_emb=True, attn_max_attend_past=7))\n"
    )
    out = tmp_path / "sinks"
    assert (
        cli.main(
            [
                "sinks",
                f"factory:{tmp_path / 'xt.py'}:make_model",
                "--n-sequences",
                "4",
                "--seq-len",
                "70",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = pd.read_csv(out / "sinks.csv")
    assert set(table["key_window"]) == {"sliding window 8"} and set(table["block"]) == {0, 1}


AUDIT_CASES = [
    pytest.param(position, flash, marks=[pytest.mark.slow] if flash else [])
    for position in sorted(POSITIONS)
    for flash in (False, True)
]


@pytest.mark.parametrize(("position", "flash"), AUDIT_CASES)
def test_the_audit_says_which_method_each_layer_uses_and_fails_nothing(position, flash):
    from nopelens.analyses.audit import audit

    report = audit(hook_any(decoder(position, attn_flash=flash), verbose=False))
    want = "nope" if position == "nope" else "relative"
    assert report.model["measured_layer_positions"] == [want, want], report.step(5).evidence
    assert report.model["measured_input_positions"].startswith("none") and report.passed
    assert [s.number for s in report.steps if s.status == "pass"] == [3, 7]
    if flash:  # q and k recorded: a rotation and an offset bias told apart
        kind = {"nope": "q and k the same", "rope": "q and k rotate", "alibi": "a bias by offset"}[position]
        assert all(kind in line for line in report.step(5).evidence["per_layer"])


def test_the_audit_reads_a_window_and_a_learned_sink_from_the_intercepted_calls():
    from nopelens.analyses.audit import audit

    windowed = audit(hook_any(decoder("rope", attn_max_attend_past=3), verbose=False), eval_length=12)
    assert windowed.passed and windowed.model["key_windows"] == {0: "sliding window 4", 1: "sliding window 4"}
    sinked = audit(hook_any(decoder(attn_head_learned_sink=True), verbose=False))
    assert sinked.step(7).status == "pass" and "1 - p_sink" in sinked.step(7).checks[0].name


def test_the_audit_of_a_hand_map_reads_positions_from_the_pattern_alone():
    """The issue's hand map: the pattern only as the input of a Dropout(p=0), no scores, q or k."""
    from nopelens.analyses.audit import audit

    sites = {
        "blocks.0.hook_resid_pre": "attn_layers.layers.0.2:input.1",
        "blocks.0.hook_resid_post": "attn_layers.layers.1.2",
        "blocks.1.hook_resid_post": "attn_layers.layers.3.2",
        **{site: f"attn_layers.layers.{2 * l}.1.attend.attn_dropout:input" for l, site in enumerate(PATTERNS)},
    }
    for position, want in (("nope", "nope"), ("rope", "relative"), ("alibi", "relative")):
        report = audit(HookedModule(decoder(position), sites))
        assert report.model["measured_layer_positions"] == [want, want], report.step(5).evidence
        assert report.passed and report.step(7).status == "pass"
    del sites["blocks.0.hook_resid_pre"]  # nothing feeding block 0 that the audit can set or read
    report = audit(HookedModule(decoder("rope"), sites))
    assert report.model["measured_layer_positions"] == ["not_measured", "relative"]
    assert "no residual site feeds it" in report.step(5).evidence["per_layer"][0]
