"""The Sec. 5.2 attention distance of Kazemnejad et al. 2023: Jensen-Shannon divergence of attention
rows against known values and scipy, 0 for a head against itself, symmetric, min over head pairs."""

import math

import pytest
import torch
from scipy.spatial.distance import jensenshannon

from nopelens.analyses.attention_distance import (
    head_distances,
    js_divergence,
    layer_distances,
    model_distance,
    pairwise_table,
)
from nopelens.models import Decoder, DecoderConfig


def test_known_values():
    assert float(js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) == pytest.approx(1.0)
    # M = (3/4, 1/4): KL(P||M) = log2(4/3), KL(Q||M) = (log2(2/3) + log2(2)) / 2
    expected = (math.log2(4 / 3) + (math.log2(2 / 3) + 1) / 2) / 2
    assert float(js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]))) == pytest.approx(expected)
    assert expected == pytest.approx(0.3112781, abs=1e-7)


def test_matches_scipy_and_stays_in_bounds():
    generator = torch.Generator().manual_seed(0)
    p = torch.rand(50, 7, generator=generator).softmax(-1)
    q = torch.rand(50, 7, generator=generator).pow(4).softmax(-1)
    ours = js_divergence(p, q)
    reference = torch.tensor(jensenshannon(p.numpy(), q.numpy(), base=2, axis=-1) ** 2, dtype=torch.float64)
    assert torch.allclose(ours, reference, atol=1e-10)
    assert ((ours >= 0) & (ours <= 1)).all()
    assert torch.equal(js_divergence(p, p), torch.zeros(50, dtype=torch.float64))
    assert torch.allclose(js_divergence(p, q), js_divergence(q, p))


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="not a distribution"):
        js_divergence(torch.tensor([0.5, 0.4]), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="do not broadcast"):
        js_divergence(torch.ones(2, 3) / 3, torch.ones(4, 3) / 3)


def _model(position: str, seed: int) -> Decoder:
    config = DecoderConfig(d_vocab=12, n_ctx=16, n_layers=2, d_model=16, n_heads=2, position=position, init_std=0.5)
    return Decoder(config, seed=seed)


def test_a_head_against_itself_is_zero_and_the_distance_is_symmetric():
    tokens = torch.randint(0, 12, (5, 9), generator=torch.Generator().manual_seed(1))
    nope, alibi = _model("nope", 0), _model("alibi", 1)
    same = layer_distances(nope, nope, tokens, batch_size=2)
    assert same.shape == (2, 2, 2) and torch.equal(
        same.diagonal(dim1=1, dim2=2), torch.zeros(2, 2, dtype=torch.float64)
    )
    assert torch.equal(model_distance(same), torch.zeros(2, dtype=torch.float64))
    there, back = layer_distances(nope, alibi, tokens), layer_distances(alibi, nope, tokens)
    assert torch.allclose(there, back.transpose(1, 2))
    assert torch.equal(model_distance(there), there.flatten(1).min(1).values) and (model_distance(there) > 0).all()
    rows = pairwise_table({"nope": nope, "alibi": alibi}, tokens)
    assert len(rows) == 2 * 4  # layers x (nope-nope, alibi-alibi, nope-alibi both ways)
    assert {r["jsd_bits"] for r in rows if r["model_a"] == r["model_b"]} == {0.0}


def test_the_mean_runs_over_queries_and_sequences():
    """Two one-head 'models' whose rows differ only at query 1: the mean divides by every query."""
    a = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])  # [batch 1, head 1, query 2, key 2]
    b = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    assert float(head_distances(a, b)[0, 0]) / (1 * 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="different inputs"):
        head_distances(a, torch.ones(1, 1, 3, 3) / 3)
