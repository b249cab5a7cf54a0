"""Theorem 2 of Kazemnejad et al. 2023 (NeurIPS), App. C: relative distance from absolute position.

Once layer 1 has written the index i into the residual stream (:mod:`nopelens.circuits.counter`),
a layer-2 head whose query and key read [1, i] can score any function bilinear in (1, i) and
(1, j, j^2). Seed ``004_150f630256efbd1c.txt`` ("Layer 2: Computing Pairwise Relative Distance"):
the position sub-matrices act as an offset-measuring bilinear form, so the logit is a linear
function of i - j and the head reproduces ALiBi with plain projection matrices.

Every circuit head has d_head = 4; the Decoder divides scores by sqrt(d_head) = 2, so W_Q carries a
factor 2 (exact in floating point).
"""

from __future__ import annotations

import math

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from nopelens.models import Decoder, DecoderConfig
from nopelens.models.hooks import act_name
from nopelens.models.positions import alibi_slopes

from .counter import (
    D_HEAD,
    attach_info,
    blank_circuit_decoder,
    circuit_tokens,
    set_counter_block,
    set_embedding,
)
from .layout import ATTENDED_POSITION, ONE, POSITION, POSITION_SQ

MAX_ALIBI_HEADS = 256
"""Head counts searched by :func:`alibi_head_for_slope`."""


def alibi_head_for_slope(slope: float) -> tuple[int, int]:
    """The smallest ALiBi head count, and the head in it, whose official slope equals ``slope``.

    Slopes come from :func:`nopelens.models.positions.alibi_slopes` (Press, Smith & Lewis 2022), so
    the reference head is the Decoder's own ALiBi, not a re-implementation. Comparison is in
    float32, the dtype of the slopes.

    Args:
        slope: the slope m > 0 to find, e.g. 0.5 (head 4 of 5) or 0.0625 (head 0 of 2).

    Returns:
        ``(n_heads, head)``.

    Raises:
        ValueError: if no head count up to 256 has that slope.

    Example:
        >>> alibi_head_for_slope(2.0 ** -8), alibi_head_for_slope(0.0625)
        ((1, 0), (2, 0))
        >>> alibi_head_for_slope(0.5)  # 5 heads: 0.25, 0.0625, 0.015625, 0.00390625, 0.5
        (5, 4)
    """
    target = torch.tensor(slope, dtype=torch.float32)
    for n_heads in range(1, MAX_ALIBI_HEADS + 1):
        hits = (alibi_slopes(n_heads) == target).nonzero()
        if len(hits):
            return n_heads, int(hits[0, 0])
    raise ValueError(
        f"slope {slope!r} is not an official ALiBi slope of any head count up to {MAX_ALIBI_HEADS} "
        "(try 0.5, 0.25, 0.125, 0.0625 or another value of nopelens.models.positions.alibi_slopes)"
    )


def alibi_reference_pattern(n_ctx: int, slope: float) -> Float[Tensor, "query_pos key_pos"]:
    """The attention pattern of the Decoder's own ALiBi head of slope m with zero content score.

    A one-layer ``position="alibi"`` Decoder with W_Q = W_K = 0 has content score 0, so its
    pattern is softmax_j(-m (i - j)) over j <= i: the reference the distance circuit must match
    (seed ``002_c993a97fc3f160f5.txt``: e_ij = q.k / sqrt(d_k) - m (i - j)).

    Args:
        n_ctx: number of positions, >= 1.
        slope: an official ALiBi slope (see :func:`alibi_head_for_slope`).

    Returns:
        float32 ``[n_ctx, n_ctx]``, rows summing to 1, zero above the diagonal.

    Raises:
        ValueError: if the slope is not an official one, or ``n_ctx < 1``.
    """
    n_heads, head = alibi_head_for_slope(slope)
    cfg = DecoderConfig(
        d_vocab=1,
        n_ctx=n_ctx,
        n_layers=1,
        d_model=n_heads,
        n_heads=n_heads,
        d_head=1,
        d_mlp=0,
        normalization="none",
        use_bias=False,
        position="alibi",
    )
    reference = Decoder(cfg, seed=0)
    with torch.no_grad():
        reference.blocks[0].attn.W_Q.zero_()
        reference.blocks[0].attn.W_K.zero_()
        _, cache = reference.run_with_cache(
            torch.zeros(1, n_ctx, dtype=torch.long), names_filter="blocks.0.attn.hook_pattern"
        )
    return cache["blocks.0.attn.hook_pattern"][0, head]


def set_distance_head(model: Decoder, slope: float, layer: int = 1) -> None:
    """Head 0 of block ``layer`` scores -m (i - j) from the position dimension (Theorem 2).

    Kazemnejad et al. 2023 (NeurIPS), App. C, Theorem 2; seed ``004_150f630256efbd1c.txt``. With
    s = sqrt(d_head) = 2 folding away the Decoder's 1/sqrt(d_head):

    - ``W_Q[one, 0] = m s``, ``W_Q[position, 1] = -m s``: q_i = m s [1, -i].
    - ``W_K[position, 0] = 1``, ``W_K[one, 1] = 1``: k_j = [j, 1].
    - score = q_i . k_j / s = m j - m i = -m (i - j), ALiBi's bias. The content part is 0 here (no
      weight reads a content dimension) and the per-row constant of the theorem is 0; any per-row
      constant would cancel in the softmax.
    - ``W_V[position, 0] = 1``, ``W_O[0, attended_position] = 1``: the head writes
      sum_j A_ij j, the mean key position under its pattern, so i - attended_position is the
      pattern's mean distance, linear in the layer-2 residual.
    """
    s = math.sqrt(D_HEAD)
    W_Q, W_K, W_V, W_O = _zero_head(model)
    W_Q[0, ONE, 0] = slope * s
    W_Q[0, POSITION, 1] = -slope * s
    W_K[0, POSITION, 0] = 1.0
    W_K[0, ONE, 1] = 1.0
    W_V[0, POSITION, 0] = 1.0
    W_O[0, 0, ATTENDED_POSITION] = 1.0
    _copy_head(model, layer, W_Q, W_K, W_V, W_O)


def set_previous_token_head(model: Decoder, sharpness: float, layer: int = 1) -> None:
    """Head 0 of block ``layer`` scores -c (i - j - 1)^2 + c (i - 1)^2 from i and j^2.

    Built on the same features as Theorem 2 (Kazemnejad et al. 2023, NeurIPS, App. C), plus the
    i^2 dimension the layer-1 MLP writes. Expanding -c (i - 1 - j)^2 = c (2 (i - 1) j - j^2) -
    c (i - 1)^2 and dropping the per-row constant c (i - 1)^2, with s = sqrt(d_head) = 2:

    - ``W_Q[position, 0] = 2 c s``, ``W_Q[one, 0] = -2 c s``, ``W_Q[one, 1] = -c s``:
      q_i = c s [2 (i - 1), -1].
    - ``W_K[position, 0] = 1``, ``W_K[position_sq, 1] = 1``: k_j = [j, j^2].
    - score = c (2 (i - 1) j - j^2): maximal at j = i - 1; j = i and j = i - 2 trail by c, so the
      mass on j = i - 1 is at least 1 / (1 + 2 e^-c + 2 e^-4c + ...) (> 0.9999 for c = 10).
      Row 0 sees only itself.
    - ``W_V[position, 0] = 1``, ``W_O[0, attended_position] = 1``: the head writes the position of
      the key it reads, about i - 1.
    """
    s = math.sqrt(D_HEAD)
    W_Q, W_K, W_V, W_O = _zero_head(model)
    W_Q[0, POSITION, 0] = 2.0 * sharpness * s
    W_Q[0, ONE, 0] = -2.0 * sharpness * s
    W_Q[0, ONE, 1] = -sharpness * s
    W_K[0, POSITION, 0] = 1.0
    W_K[0, POSITION_SQ, 1] = 1.0
    W_V[0, POSITION, 0] = 1.0
    W_O[0, 0, ATTENDED_POSITION] = 1.0
    _copy_head(model, layer, W_Q, W_K, W_V, W_O)


def _zero_head(model: Decoder) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    d_model = model.cfg.d_model
    W = torch.zeros(1, d_model, D_HEAD, dtype=torch.float64)
    return W, W.clone(), W.clone(), torch.zeros(1, D_HEAD, d_model, dtype=torch.float64)


def _copy_head(model: Decoder, layer: int, W_Q: Tensor, W_K: Tensor, W_V: Tensor, W_O: Tensor) -> None:
    attn = model.blocks[layer].attn
    with torch.no_grad():
        attn.W_Q.copy_(W_Q)
        attn.W_K.copy_(W_K)
        attn.W_V.copy_(W_V)
        attn.W_O.copy_(W_O)


def _two_layer_circuit(n_ctx: int, d_vocab: int, construction: str, dtype: torch.dtype) -> Decoder:
    model = blank_circuit_decoder(n_ctx, 2, d_vocab, construction, dtype)
    set_embedding(model)
    set_counter_block(model, 0, construction)
    return model  # block 1's MLP stays zero: it writes nothing


def distance(
    n_ctx: int = 64,
    slope: float = 0.5,
    d_vocab: int = 8,
    construction: str = "steps",
    dtype: torch.dtype = torch.float32,
) -> Decoder:
    """A two-layer NoPE decoder whose layer-2 head is an ALiBi head of slope m (Theorem 2).

    Block 0 is the Theorem 1 counter (:func:`nopelens.circuits.counter.counter`): it writes
    1/(i+1), i and i^2. Block 1's head is derived in :func:`set_distance_head`; block 1's MLP is
    zero. Normalization is off. Position 0 must be BOS (token 0).

    Known values (float32, BOS at position 0): ``blocks.1.attn.hook_pattern[:, 0]`` equals the
    pattern of the Decoder's own ALiBi head of slope m (:func:`alibi_reference_pattern`) within
    1e-5 for every query row i < n_ctx (measured max 6e-8 at n_ctx = 1024, m = 0.5); the
    ``attended_position`` dim after block 1 is sum_j A_ij j.

    Args:
        n_ctx: context length the counter inverts exactly (<= 2048 for float32 exactness).
        slope: the ALiBi slope m; must be an official slope (:func:`alibi_head_for_slope`).
        d_vocab: vocabulary size including BOS.
        construction: the counter MLP, ``steps`` or ``interpolant``.
        dtype: parameter dtype.

    Returns:
        A :class:`~nopelens.models.Decoder` with ``model.circuit`` naming dimensions and heads.

    Raises:
        ValueError: on an unofficial slope or the errors of
            :func:`~nopelens.circuits.counter.counter`.
    """
    n_heads, head = alibi_head_for_slope(slope)
    model = _two_layer_circuit(n_ctx, d_vocab, construction, dtype)
    set_distance_head(model, slope, layer=1)
    head_1 = (
        f"q_i = m[1, -i], k_j = [j, 1]: score -m(i - j), the ALiBi head {head} of {n_heads} "
        f"(m = {slope}); writes sum_j A_ij j into attended_position"
    )
    return attach_info(model, "distance", {"1.0": head_1}, slope=slope)


def previous_token(
    n_ctx: int = 64,
    sharpness: float = 10.0,
    d_vocab: int = 8,
    construction: str = "steps",
    dtype: torch.dtype = torch.float32,
) -> Decoder:
    """A two-layer NoPE decoder whose layer-2 head attends to the previous token.

    Block 0 is the Theorem 1 counter; block 1's head scores -c (i - j - 1)^2 from i and the i^2
    feature (:func:`set_previous_token_head`). With c = 10 it puts > 0.9999 of its mass on
    j = i - 1 for every 1 <= i < n_ctx (float32, checked up to n_ctx = 256; the scores grow like
    c i^2, so float32 rounding eventually blurs the head at long contexts).

    Args:
        n_ctx: context length, >= 2.
        sharpness: c > 0, the score gap between j = i - 1 and its neighbours.
        d_vocab: vocabulary size including BOS.
        construction: the counter MLP, ``steps`` or ``interpolant``.
        dtype: parameter dtype.

    Returns:
        A :class:`~nopelens.models.Decoder` with ``model.circuit``.

    Raises:
        ValueError: if ``sharpness`` is not finite and > 0 or overflows the weights' dtype, or on
            the errors of :func:`~nopelens.circuits.counter.counter`.
    """
    if not 0 < sharpness < math.inf:
        raise ValueError(f"sharpness must be finite and > 0, got {sharpness!r}")
    model = _two_layer_circuit(n_ctx, d_vocab, construction, dtype)
    set_previous_token_head(model, sharpness, layer=1)
    if not all(bool(torch.isfinite(weight).all()) for weight in model.parameters()):
        raise ValueError(f"sharpness {sharpness:g} overflows the circuit's {dtype} weights; use a smaller one")
    head_1 = (
        f"q_i = c[2(i - 1), -1], k_j = [j, j^2]: score -c(i - j - 1)^2 + row constant "
        f"(c = {sharpness}); writes the attended key's position into attended_position"
    )
    return attach_info(model, "previous_token", {"1.0": head_1}, sharpness=sharpness)


def head_pattern(model: Decoder, tokens: Tensor, layer: int = 1, head: int = 0) -> Float[Tensor, "query_pos key_pos"]:
    """``blocks.{layer}.attn.hook_pattern`` of one head on one sequence ``tokens [1, pos]``."""
    name = act_name("pattern", layer)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=name)
    return cache[name][0, head]


def check_distance(model: Decoder, seed: int = 0) -> dict[str, float]:
    """Theorem 2's exact check on a random BOS-first sequence of length n_ctx.

    Returns:
        ``pattern_max_error``: max over every query row and key of |A - A_ALiBi| (target <= 1e-5);
        ``slope``, ``alibi_heads`` and ``alibi_head``: the reference head.
    """
    slope = model.circuit.slope
    pattern = head_pattern(model, circuit_tokens(model, seed=seed))
    reference = alibi_reference_pattern(model.cfg.n_ctx, slope)
    n_heads, head = alibi_head_for_slope(slope)
    error = (pattern.double() - reference.double()).abs().max()
    return {"pattern_max_error": float(error), "slope": slope, "alibi_heads": n_heads, "alibi_head": head}


def previous_token_mass(model: Decoder, tokens: Tensor | None = None) -> pd.DataFrame:
    """Mass the layer-2 head puts on j = i - 1, per query row i >= 1 (row 0 reports A_00)."""
    tokens = circuit_tokens(model, seed=0) if tokens is None else tokens
    pattern = head_pattern(model, tokens).double()
    rows = torch.arange(pattern.shape[0])
    previous = pattern[rows, (rows - 1).clamp(min=0)]
    return pd.DataFrame({"position": rows.numpy(), "previous_mass": previous.numpy()})


def check_previous_token(model: Decoder, seed: int = 0) -> dict[str, float]:
    """Min over rows i >= 1 of the mass on j = i - 1 (target > 0.99), and A_00 (exactly 1)."""
    mass = previous_token_mass(model, circuit_tokens(model, seed=seed))
    return {
        "min_previous_mass": float(mass.previous_mass[1:].min()),
        "row0_self_mass": float(mass.previous_mass[0]),
    }
