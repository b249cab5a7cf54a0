"""Issue 10 §2: relative distance read from what each head actually scores (content + position bias),
next to the content-only q·k read, with known answers for ALiBi, NoPE, Shaw and the Theorem 2 circuit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopelens.circuits import distance
from nopelens.circuits.layout import BOS_TOKEN
from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import (
    DistancePairs,
    collect,
    first_recoverable_layer,
    probe_relative_distance,
    sample_distance_pairs,
    score_features,
)

LENGTH = 24


def random_tokens(n, length, vocab, seed=0):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def reads(model, tokens, layers=(0,), bilinear="outer", **kw):
    """Score read and content-only q·k read of the given blocks; linear R² rows indexed by features and layer."""
    qk = [(f"blocks.{l}.attn.hook_q", f"blocks.{l}.attn.hook_k") for l in layers]
    scores = [f"blocks.{l}.attn.hook_attn_scores" for l in layers]
    acts = collect(model, tokens, [s for pair in qk for s in pair] + scores)
    table = probe_relative_distance(
        acts,
        sites=[],
        attention=qk,
        scores=scores,
        bilinear=bilinear,
        tasks=("regression",),
        controls=False,
        n_boot=100,
        **kw,
    )
    return table[(table.probe == "linear") & (table.metric == "r2")].set_index(["features", "layer"]), table


@pytest.mark.parametrize("d_model", [16, 64, 128])
def test_untrained_alibi_block_reads_distance_from_its_scores(d_model, one_thread):
    """Score = q.k/sqrt(d) - m_h (i - j); at init q.k is tiny, so the score is linear in i - j.

    The content-only q·k read cannot see the bias: q and k of block 0 hold token identity only.
    """
    cfg = DecoderConfig(d_vocab=50, n_ctx=LENGTH, n_layers=1, d_model=d_model, n_heads=4, position="alibi")
    rows, _ = reads(Decoder(cfg, seed=0).eval(), random_tokens(24, LENGTH, 50), bilinear="elementwise")
    assert rows.loc[("score", 1), "ci_low"] >= 0.99
    assert rows.loc[("bilinear_elementwise", 1), "value"] < 0.1


def test_nope_content_only_read_stays_near_zero_on_random_tokens(one_thread):
    """Block 0 of NoPE sees token embeddings only: q_i and k_j carry no position, so no read of i - j."""
    cfg = DecoderConfig(d_vocab=50, n_ctx=LENGTH, n_layers=1, d_model=32, n_heads=4, position="nope")
    rows, _ = reads(Decoder(cfg, seed=0).eval(), random_tokens(24, LENGTH, 50))
    for features in ("bilinear_outer", "score"):
        assert abs(rows.loc[(features, 1), "value"]) <= 0.05, features


def test_score_read_finds_no_distance_on_constant_input_to_nope(one_thread):
    """One token id, no BOS, NoPE: in exact arithmetic every position holds the same state at every
    layer, so every key gets the same score and the read has nothing to find. Float error grows with
    the position; before the round-off rule in score_features it was read as R² 0.1-0.2 at blocks 1-3."""
    cfg = DecoderConfig(d_vocab=50, n_ctx=64, n_layers=4, d_model=128, n_heads=4, position="nope")
    tokens = torch.full((40, 64), 7)
    rows, _ = reads(Decoder(cfg, seed=0).eval(), tokens, layers=range(4), bilinear="elementwise")
    for layer in (1, 2, 3, 4):
        assert rows.loc[("score", layer), "ci_high"] <= 0.02, layer


def shaw_ceiling(n_distances: int, clip: int) -> float:
    """Best R² of any read of i - j that sees only min(i - j, k), for i - j uniform on 0..D.

    Shaw's bias at distance d uses a^K_{clip(-d, -k, k)}, the same row for every d >= k, so a score
    can tell distances 0..k-1 apart but not the n - k distances k..D (n = D + 1). The best
    prediction there is their mean, leaving their variance ((n - k)^2 - 1)/12; with total variance
    (n^2 - 1)/12 and weight (n - k)/n: R² <= 1 - ((n - k)/n) ((n - k)^2 - 1)/(n^2 - 1).
    """
    n, m = n_distances, n_distances - clip
    return 1 - (m / n) * (m * m - 1) / (n * n - 1)


@pytest.mark.parametrize("clip", [2, 4])
def test_shaw_score_read_is_bounded_by_its_clip(clip, one_thread):
    """With constant content every score of block 0 is a function of min(d, k) alone. With n_heads >= k
    head scores (plus the intercept) span every such function, so the linear read reaches the ceiling;
    on random tokens content is added, and the read stays below it."""
    cfg = DecoderConfig(d_vocab=50, n_ctx=LENGTH, n_layers=1, d_model=32, n_heads=4, position="shaw", shaw_clip=clip)
    model = Decoder(cfg, seed=0).eval()
    ceiling = shaw_ceiling(LENGTH, clip)
    constant, _ = reads(model, torch.full((24, LENGTH), 3))
    assert ceiling - 0.03 <= constant.loc[("score", 1), "value"] <= ceiling + 1e-9
    assert constant.loc[("score", 1), "ci_low"] <= ceiling
    random, _ = reads(model, random_tokens(24, LENGTH, 50))
    assert random.loc[("score", 1), "value"] <= ceiling


def test_first_recoverable_layer_takes_relative_distance_output_directly(one_thread):
    """Theorem 2: block 1's head scores -m (i - j), block 0's head is uniform: first read at layer 2."""
    model = distance(n_ctx=LENGTH)
    tokens = random_tokens(16, LENGTH, model.cfg.d_vocab - 1) + 1
    tokens[:, 0] = BOS_TOKEN
    acts = collect(model, tokens, ["blocks.0.attn.hook_attn_scores", "blocks.1.attn.hook_attn_scores"])
    table = probe_relative_distance(
        acts, sites=[], scores=list(acts.patterns), tasks=("regression",), controls=False, n_boot=50
    )
    assert first_recoverable_layer(table, target="relative_distance") == 2
    assert sorted(table["layer"].unique()) == [1, 2] and (table["layer"] == table["block"] + 1).all()
    rows = table[(table.probe == "linear") & (table.metric == "r2")].set_index("layer")["value"]
    assert rows.loc[2] > 0.9999 and rows.loc[1] <= 0.0


def test_several_reads_need_a_features_choice(one_thread):
    cfg = DecoderConfig(d_vocab=50, n_ctx=12, n_layers=1, d_model=16, n_heads=2, position="alibi")
    _, table = reads(Decoder(cfg, seed=0).eval(), random_tokens(10, 12, 50))
    with pytest.raises(ValueError, match="pass features="):
        first_recoverable_layer(table, target="relative_distance")
    assert first_recoverable_layer(table, target="relative_distance", features="score") == 1


def test_score_features_are_relative_to_the_query_and_refuse_blocked_keys():
    pairs = sample_distance_pairs(np.zeros(4, dtype=int), np.arange(4))
    scores = np.random.default_rng(0).normal(size=(2, 4, 4))
    shifted = scores + np.arange(4.0)[None, :, None]  # a constant per query row: the softmax ignores it
    assert np.allclose(
        score_features([scores], np.zeros(4, int), np.arange(4), pairs),
        score_features([shifted], np.zeros(4, int), np.arange(4), pairs),
    )
    window = scores.copy()
    window[:, 3, 0] = -np.inf  # a sliding window of 3 keys
    with pytest.raises(ValueError, match="key 0 is blocked for query 3"):
        score_features([window], np.zeros(4, int), np.arange(4), pairs)
    hf_mask = scores.copy()
    hf_mask[:, 3, 0] = np.finfo(np.float32).min
    with pytest.raises(ValueError, match="blocked"):
        score_features([hf_mask], np.zeros(4, int), np.arange(4), pairs)


def test_bridged_hf_bloom_scores_carry_alibi(one_thread):
    """HF Bloom writes ALiBi as +m_h j (a per-query constant away from -m_h (i - j)); its bridged
    hook_attn_scores give the same read as the Decoder's ALiBi."""
    transformers = pytest.importorskip("transformers")
    from nopelens.models.adapters import bridge_hf_model

    config = transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=1, vocab_size=50)
    torch.manual_seed(0)
    model = bridge_hf_model(transformers.BloomForCausalLM(config).eval())
    acts = collect(model, random_tokens(16, LENGTH, 50), ["blocks.0.attn.hook_attn_scores"])
    table = probe_relative_distance(
        acts, sites=[], scores=["blocks.0.attn.hook_attn_scores"], tasks=("regression",), controls=False, n_boot=50
    )
    assert first_recoverable_layer(table, target="relative_distance") == 1
    r2 = table[(table.probe == "linear") & (table.metric == "r2")]["ci_low"].iloc[0]
    assert r2 >= 0.99


def test_sweep_reads_scores_only_where_the_model_has_them():
    from nopelens.analyses.sweep import score_sites
    from nopelens.models.adapters import HookedModule

    cfg = DecoderConfig(d_vocab=20, n_ctx=8, n_layers=2, d_model=16, n_heads=2)
    decoder = Decoder(cfg, seed=0)
    assert score_sites(decoder, 2) == ["blocks.0.attn.hook_attn_scores", "blocks.1.attn.hook_attn_scores"]
    wrapped = HookedModule(decoder, sites={"blocks.0.hook_resid_post": "blocks.0"})
    assert score_sites(wrapped, 2) == []


def test_distance_pairs_score_rows_use_each_pairs_own_sequence():
    scores = [np.full((1, 3, 3), 0.0), np.array([[[0.0, 0, 0], [5.0, 0, 0], [7.0, 6.0, 0]]])]
    pairs = DistancePairs(np.array([4, 5]), np.array([3, 3]), np.array([1, 2]), np.array([1, 1]))
    sequence_id, position = np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 2, 0, 1, 2])
    assert score_features(scores, sequence_id, position, pairs).ravel().tolist() == [5.0, 7.0]


def test_summary_says_na_where_a_model_has_no_score_site():
    import pandas as pd

    from nopelens.analyses.report import summary_table

    summary = pd.DataFrame(
        [
            dict(
                model="m",
                absolute_acc=-1,
                absolute_r2=1,
                relative_pairs_r2=2,
                relative_score_r2=None,
                relative_content_qk_r2=-1,
                best_absolute_r2=0.9,
                best_absolute_layer=1,
                selectivity_at_best=0.1,
                mad_chance_layer0=0.7,
                mad_chance_best=0.2,
                sink_rate=0.0,
                variance_slope_block0=-1.0,
            )
        ]
    )
    row = summary_table(summary).iloc[0]
    assert row["rel. dist. head scores R² ≥ 0.9"] == "n/a"
    assert row["rel. dist. content q·k R² ≥ 0.9"] == "none" and row["abs. index R² ≥ 0.9"] == "1"


def test_summary_gives_the_reason_a_sink_or_variance_read_is_missing():
    """A missing variance slope is "variance 0" only when the read ran; where the model left the
    read out (every block a DSA past index_topk), the summary says so and lists why below."""
    import pandas as pd

    from nopelens.analyses.report import NOT_READ, summary_table, summary_text

    row = dict(
        absolute_acc=-1,
        absolute_r2=1,
        relative_pairs_r2=2,
        relative_score_r2=None,
        relative_content_qk_r2=-1,
        best_absolute_r2=0.9,
        best_absolute_layer=1,
        selectivity_at_best=0.1,
        mad_chance_layer0=0.7,
        mad_chance_best=0.2,
        sink_rate=float("nan"),
        variance_slope_block0=float("nan"),
    )
    summary = pd.DataFrame([dict(row, model="sparse"), dict(row, model="constant")])
    why = "blocks [0, 1]: a DSA indexer keeps only the top 4 of the keys a query sees"
    skipped = {"sparse": {"variance read": why, "sink read": why}}
    table = summary_table(summary, not_applicable=skipped).set_index("model")
    assert table.loc["sparse", "variance slope, block 0"] == NOT_READ and table.loc["sparse", "sink rate"] == NOT_READ
    assert table.loc["constant", "variance slope, block 0"] == "n/a (variance 0)"
    assert table.loc["constant", "sink rate"] == "n/a"
    text = summary_text(summary, not_applicable=skipped)
    assert f"sparse, variance read: {why}" in text and "NaN" not in text
