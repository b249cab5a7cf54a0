"""Known values and properties of the position methods (issue 2; seeds 000 and 002)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nopelens.models.positions import (
    alibi_bias,
    alibi_slopes,
    apply_rope,
    position_ids_from_mask,
    rope_angles,
    shaw_relative_ids,
    sinusoidal_table,
)

F64 = torch.float64


def rope(x, pos, rotary_dim=None, pairing="half", base=10000.0):
    x = torch.as_tensor(x, dtype=F64).view(1, 1, 1, -1)
    rotary_dim = rotary_dim or x.shape[-1]
    return apply_rope(x, torch.tensor([[pos]]), rotary_dim, base, pairing).flatten()


def test_rope_known_values_interleaved_and_half():
    x = [1.0, 2.0, 3.0, 4.0]
    expected_interleaved = torch.tensor([-1.142640, 1.922076, 2.959851, 4.029800], dtype=F64)
    expected_half = torch.tensor([-1.984111, 1.959901, 2.462378, 4.019800], dtype=F64)
    torch.testing.assert_close(rope(x, 1, pairing="interleaved"), expected_interleaved, atol=1e-6, rtol=0)
    torch.testing.assert_close(rope(x, 1, pairing="half"), expected_half, atol=1e-6, rtol=0)


def test_partial_rope_known_value_and_pass_through():
    x = [float(v) for v in range(1, 9)]
    out = rope(x, 3, rotary_dim=4, pairing="half")
    expected = torch.tensor([-1.413353, 1.879118, -2.828857, 4.058191, 5, 6, 7, 8], dtype=F64)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert out[4:].tolist() == [5.0, 6.0, 7.0, 8.0]


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rope_position_zero_is_identity_and_norm_preserving(pairing):
    x = torch.randn(2, 5, 3, 8, dtype=F64)
    zeros = torch.zeros(2, 5, dtype=torch.long)
    torch.testing.assert_close(apply_rope(x, zeros, 8, pairing=pairing), x)
    pos = torch.arange(5).repeat(2, 1)
    torch.testing.assert_close(apply_rope(x, pos, 8, pairing=pairing).norm(dim=-1), x.norm(dim=-1))


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 200),
    n=st.integers(0, 200),
    s=st.integers(0, 500),
    pairing=st.sampled_from(["half", "interleaved"]),
    seed=st.integers(0, 2**16),
)
def test_rope_score_depends_only_on_offset(m, n, s, pairing, seed):
    """Seed 002: (R(m)q)^T (R(n)k) = q^T R(n - m) k, so shifting both positions changes nothing."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 1, 8, dtype=F64, generator=g)

    def score(qp, kp):
        rq = apply_rope(q, torch.tensor([[qp]]), 8, pairing=pairing)
        rk = apply_rope(k, torch.tensor([[kp]]), 8, pairing=pairing)
        return float((rq * rk).sum())

    assert math.isclose(score(m, n), score(m + s, n + s), rel_tol=1e-9, abs_tol=1e-9)


def test_rope_computes_in_float32_for_half_inputs():
    x = torch.randn(1, 4, 2, 8).to(torch.bfloat16)
    out = apply_rope(x, torch.arange(4)[None] * 1000, 8)
    ref = apply_rope(x.float(), torch.arange(4)[None] * 1000, 8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_rope_rejects_bad_arguments():
    x = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="pairing"):
        apply_rope(x, torch.zeros(1, 2, dtype=torch.long), 8, pairing="zigzag")
    with pytest.raises(ValueError, match="even"):
        rope_angles(torch.zeros(2, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=">= 0"):
        apply_rope(x, torch.tensor([[0, -1]]), 8)
    with pytest.raises(ValueError, match="exceeds d_head"):
        apply_rope(x, torch.zeros(1, 2, dtype=torch.long), 10)


def test_alibi_slopes_known_values():
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(6).tolist() == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    assert alibi_slopes(1).tolist() == [2.0**-8]
    for n in range(1, 33):
        slopes = alibi_slopes(n)
        assert slopes.shape == (n,) and bool(((slopes > 0) & (slopes < 1)).all())
        assert len(set(slopes.tolist())) == n
    with pytest.raises(ValueError, match="n_heads"):
        alibi_slopes(0)


def test_alibi_bias_is_minus_slope_times_distance():
    q = torch.tensor([[3, 4]])
    k = torch.tensor([[0, 1, 2, 3, 4]])
    bias = alibi_bias(torch.tensor([0.5, 0.25]), q, k)
    distance = (q[0, :, None] - k[0, None, :]).float()
    torch.testing.assert_close(bias[0, 0], -0.5 * distance)
    torch.testing.assert_close(bias[0, 1], -0.25 * distance)


def test_sinusoidal_known_values_and_odd_width():
    table = sinusoidal_table(torch.tensor([0, 1]), 2, dtype=F64)
    torch.testing.assert_close(table, torch.tensor([[0.0, 1.0], [math.sin(1), math.cos(1)]], dtype=F64))
    width5 = sinusoidal_table(torch.tensor([1]), 5, dtype=F64)[0]
    expected = torch.tensor([0.841471, 0.540302, 0.0251162, 0.999685, 0.000630957], dtype=F64)
    torch.testing.assert_close(width5, expected, atol=1e-6, rtol=0)
    assert sinusoidal_table(torch.arange(3), 8).dtype == torch.float32


def test_sinusoidal_offset_is_a_rotation_of_each_pair():
    """Seed 002: a fixed offset acts as a frequency-specific 2D rotation of each (sin, cos) pair."""
    d, offset = 8, 7
    base = sinusoidal_table(torch.arange(20), d, dtype=F64)
    shifted = sinusoidal_table(torch.arange(20) + offset, d, dtype=F64)
    for r in range(d // 2):
        w = 10000 ** (-2 * r / d)
        c, s = math.cos(offset * w), math.sin(offset * w)
        sin_p, cos_p = base[:, 2 * r], base[:, 2 * r + 1]
        torch.testing.assert_close(shifted[:, 2 * r], sin_p * c + cos_p * s)
        torch.testing.assert_close(shifted[:, 2 * r + 1], cos_p * c - sin_p * s)


def test_shaw_relative_ids_known_value():
    p = torch.arange(5)[None]
    expected = [[2, 3, 4, 4, 4], [1, 2, 3, 4, 4], [0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2]]
    assert shaw_relative_ids(p, p, 2)[0].tolist() == expected


def test_position_ids_from_mask_left_padding_and_cache_start():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert position_ids_from_mask(mask, torch.tensor([5, 2])).tolist() == [[0, 0, 5, 6], [2, 3, 4, 5]]
    assert position_ids_from_mask(mask).dtype == torch.int64
