"""Theorem 1 of Kazemnejad et al. 2023 (NeurIPS), App. C: a NoPE decoder that counts.

The causal mask alone makes query i normalize over i + 1 keys (seed ``004_150f630256efbd1c.txt``,
"the denominator is an explicit function of position i"). A head that attends uniformly and reads
a value that only BOS carries therefore outputs exactly 1/(i+1) at position i; an MLP turns that
counter into the index i. The seed's "constant bias vector" wording would give the constant c at
every position; it is the BOS-only value that makes the head count.

Weights are built in float64 and cast to the model dtype; the checks run in float32.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from nopelens.models import Decoder, DecoderConfig

from .layout import (
    BOS,
    BOS_TOKEN,
    CONTENT_START,
    COUNTER,
    ONE,
    POSITION,
    POSITION_SQ,
    CircuitInfo,
)

D_HEAD = 4
"""Width of every circuit head; sqrt(4) = 2 is exact, so folding the 1/sqrt(d_head) score scale
into W_Q is exact for power-of-two slopes."""


QUANTIZER = 1.5 * 2.0**23
"""M = 1.5 * 2^23. Every float32 in [2^23, 2^24) is an integer, so adding M before the bias -M
rounds a pre-activation to the nearest integer; in exact arithmetic +M and -M cancel."""

COUNTER_HEAD = "uniform causal head; value = BOS flag; writes 1/(i+1) into counter"
"""What head ``0.0`` of every circuit does (:func:`set_counter_block`)."""

CONSTRUCTIONS = ("steps", "interpolant")


def counter_steps(n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """Slopes and offsets of the ReLU step pairs that map the counter 1/(i+1) to i.

    With c_i = 1/(i+1), the gap between neighbours is g_k = c_k - c_{k+1} = 1/((k+1)(k+2)) and its
    midpoint is mu_k = (2k+3) / (2(k+1)(k+2)). The pre-activation

        z_k(c) = A_k (mu_k - c) = offset_k - A_k c,   A_k = 4 / g_k = 4(k+1)(k+2),
                                                       offset_k = A_k mu_k = 2(2k+3),

    equals +2 at c_{k+1} and -2 at c_k, so the pair ReLU(z_k) - ReLU(z_k - 1) is exactly 1 for every
    position i > k and exactly 0 for every i <= k (a step with knots at the midpoints and a flat
    margin of one unit on each side). Summing the steps gives sum_k [i > k] = i, and weighting them
    by 2k + 1 gives sum_{k<i} (2k+1) = i^2. Unlike the plain interpolant
    (:func:`inverse_counter_interpolant`), the output stays exact if c moves by less than g_k / 4.

    Kazemnejad et al. 2023 (NeurIPS), App. C, Theorem 1 (an FFN inverts the counter); seed
    ``004_150f630256efbd1c.txt``.

    Args:
        n_ctx: number of positions, >= 2; there are n_ctx - 1 steps (2(n_ctx - 1) hidden units).

    Returns:
        ``(slopes, offsets)``: float64 arrays A_k and offset_k of length ``n_ctx - 1`` (integers).

    Raises:
        ValueError: if ``n_ctx < 2``.

    Example:
        >>> slopes, offsets = counter_steps(4)
        >>> slopes.tolist(), offsets.tolist()
        ([8.0, 24.0, 48.0], [6.0, 10.0, 14.0])
        >>> c = 1 / (np.arange(4) + 1)
        >>> z = offsets[None, :] - slopes[None, :] * c[:, None]
        >>> z.round(9).tolist()[1]  # position 1: +2 right after step 0, -2 at steps 1 and 2's edges
        [2.0, -2.0, -10.0]
        >>> steps = np.maximum(z, 0) - np.maximum(z - 1, 0)
        >>> steps.sum(1).tolist(), (steps @ (2 * np.arange(3) + 1)).tolist()
        ([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 4.0, 9.0])
    """
    _check_n_ctx(n_ctx)
    k = np.arange(n_ctx - 1, dtype=np.float64)
    return 4.0 * (k + 1.0) * (k + 2.0), 2.0 * (2.0 * k + 3.0)


def inverse_counter_interpolant(n_ctx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Knots and output weights of the plain ReLU interpolant of c = 1/(i+1) -> i and -> i^2.

    On the finite set c_i = 1/(i+1), i < n_ctx, the exact piecewise-linear interpolant of
    f(c) = 1/c - 1 = i through the points (c_i, i) is

        f(c) = sum_{k=0}^{n_ctx-2} 2(k+1) ReLU(c_k - c),

    because the slope of the interpolant on [c_{k+1}, c_k] is -(k+1)(k+2) and it changes by
    2(k+1) at the knot c_k (with slope 0 right of c_0 = 1). At c = c_m every active term equals
    2 - 2(k+1)/(m+1) <= 2, so the sum is exact in real arithmetic: sum_{k<m} = 2m - m = m.
    The same hidden units give i^2 with output weights (k+1)(6k+2) (slopes (2k+1)(k+1)(k+2)).
    Anchoring at c_0 = 1 (ReLU(c_k - c), not ReLU(c - c_k)) keeps every term bounded. In float32 the
    sum of i generic terms still rounds: measured max |position - i| is 2.3e-5 at n_ctx = 64,
    7.6e-5 at 128 and 160, 2.3e-4 at 256 and 1.3e-3 at 1024, so this construction meets 1e-4 only
    for n_ctx <= 160; :func:`counter_steps` is exact up to 2048.

    Kazemnejad et al. 2023 (NeurIPS), App. C, Theorem 1; seed ``004_150f630256efbd1c.txt``.

    Args:
        n_ctx: number of positions to interpolate exactly, >= 2.

    Returns:
        ``(knots, to_position, to_position_sq)``, float64 arrays of length ``n_ctx - 1``: the
        hidden unit k computes ReLU(knots[k] - c); the outputs are ``to_position @ hidden`` = i and
        ``to_position_sq @ hidden`` = i^2.

    Raises:
        ValueError: if ``n_ctx < 2``.

    Example:
        >>> knots, w, w_sq = inverse_counter_interpolant(5)
        >>> knots.tolist(), w.tolist(), w_sq.tolist()
        ([1.0, 0.5, 0.3333333333333333, 0.25], [2.0, 4.0, 6.0, 8.0], [2.0, 16.0, 42.0, 80.0])
        >>> c = 1 / (np.arange(5) + 1)
        >>> hidden = np.maximum(knots[None, :] - c[:, None], 0)
        >>> (hidden @ w).round(12).tolist(), (hidden @ w_sq).round(12).tolist()
        ([0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 4.0, 9.0, 16.0])
    """
    _check_n_ctx(n_ctx)
    k = np.arange(n_ctx - 1, dtype=np.float64)
    return 1.0 / (k + 1.0), 2.0 * (k + 1.0), (k + 1.0) * (6.0 * k + 2.0)


def _check_n_ctx(n_ctx: int) -> None:
    if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 2:
        raise ValueError(f"n_ctx must be an integer >= 2 (the MLP needs one knot), got {n_ctx!r}")


def mlp_width(n_ctx: int, construction: str = "steps") -> int:
    """Hidden units of the counter MLP: 2(n_ctx - 1) for ``steps``, n_ctx - 1 for ``interpolant``."""
    if construction not in CONSTRUCTIONS:
        raise ValueError(f"construction must be one of {CONSTRUCTIONS}, got {construction!r}")
    return (2 if construction == "steps" else 1) * (n_ctx - 1)


def blank_circuit_decoder(
    n_ctx: int,
    n_layers: int,
    d_vocab: int = 8,
    construction: str = "steps",
    dtype: torch.dtype = torch.float32,
) -> Decoder:
    """A NoPE decoder with the circuit layout, normalization off and every weight zero.

    d_model = 6 + (d_vocab - 1): the six named dimensions of :mod:`nopelens.circuits.layout` and a
    one-hot content dimension per non-BOS token. One head of width 4 per block; a ReLU MLP as wide
    as the counter construction needs (:func:`mlp_width`).

    Raises:
        ValueError: if ``n_ctx < 2``, ``d_vocab < 2`` or the construction is unknown.
    """
    _check_n_ctx(n_ctx)
    if not isinstance(d_vocab, int) or d_vocab < 2:
        raise ValueError(f"d_vocab must be an integer >= 2 (BOS and one content token), got {d_vocab!r}")
    cfg = DecoderConfig(
        d_vocab=d_vocab,
        n_ctx=n_ctx,
        n_layers=n_layers,
        d_model=CONTENT_START + d_vocab - 1,
        n_heads=1,
        d_head=D_HEAD,
        d_mlp=mlp_width(n_ctx, construction),
        act_fn="relu",
        normalization="none",
        use_bias=True,
        position="nope",
    )
    model = Decoder(cfg, seed=0, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model


def set_embedding(model: Decoder) -> None:
    """Embedding and unembedding of the circuit layout (Kazemnejad et al. 2023, App. C, Thm. 1).

    - ``W_E[t, one] = 1`` for every token: a constant every key can read.
    - ``W_E[BOS, bos] = 1``: the BOS flag, the only value the counter head averages.
    - ``W_E[t, 5 + t] = 1`` for t >= 1: token identity, which no circuit weight reads, so the
      results hold for any non-BOS content.
    - ``counter``, ``position``, ``position_sq``, ``attended_position`` start at 0.
    - ``W_U`` reads the content dims back (logit t = content dim of t); the circuits do not use it.
    """
    d_vocab = model.cfg.d_vocab
    W_E = torch.zeros(d_vocab, model.cfg.d_model, dtype=torch.float64)
    W_E[:, ONE] = 1.0
    W_E[BOS_TOKEN, BOS] = 1.0
    tokens = torch.arange(1, d_vocab)
    W_E[tokens, CONTENT_START + tokens - 1] = 1.0
    with torch.no_grad():
        model.embed.W_E.copy_(W_E)
        model.unembed.W_U.copy_(W_E.T)


def set_counter_block(model: Decoder, layer: int = 0, construction: str = "steps") -> None:
    """Block ``layer`` becomes the Theorem 1 counter and its inverse (Kazemnejad et al. 2023, App. C).

    Attention, one head:

    - ``W_Q = 0``: every query is 0, so every visible score is 0 and the causal softmax is uniform,
      A_ij = 1/(i+1) for j <= i (seed ``004_150f630256efbd1c.txt``, "Layer 1").
    - ``W_K[one, 0] = 1``: every key reads the constant dimension; with W_Q = 0 the key cannot
      change a score, it only names what the head would compare.
    - ``W_V[bos, 0] = 1``: the value is the BOS flag, 1 at position 0 and 0 elsewhere, so
      z_i = sum_{j<=i} v_j / (i+1) = 1/(i+1) whatever the tokens after BOS are.
    - ``W_O[0, counter] = 1``: the head writes z_i into the counter dimension, which was 0.

    MLP, ``construction="steps"`` (default; :func:`counter_steps`), hidden units ``2k`` and
    ``2k + 1`` for step k = 0 .. n_ctx - 2:

    - ``W_in[counter, 2k] = W_in[counter, 2k+1] = -A_k``: the pre-activation falls with the counter
      at the rate that puts the step between c_{k+1} and c_k with a margin of 2 on each side.
    - ``W_in[one, .] = M + offset_k`` and ``b_in[2k] = -M``, ``b_in[2k+1] = -M - 1``: the
      pre-activations are z_k and z_k - 1. M = 1.5 * 2^23 cancels in exact arithmetic; in float32
      it rounds z_k to an integer (every float in [2^23, 2^24) is one), so all hidden values are
      integers and the output sums are exact for n_ctx <= 2048. (This needs the product x W_in
      rounded before b_in is added, as torch's CPU ``F.linear``/``addmm`` does; an implementation
      that added b_in first would leave generic floats, whose sums round like the interpolant's.
      ``tests/test_circuits.py`` checks exactness at n_ctx = 2048.)
    - ``W_out[2k, position] = 1``, ``W_out[2k+1, position] = -1``: ReLU(z_k) - ReLU(z_k - 1) is the
      step [i > k]; their sum is i. ``W_out[., position_sq] = +-(2k+1)``: sum_{k<i} (2k+1) = i^2.

    MLP, ``construction="interpolant"`` (:func:`inverse_counter_interpolant`), hidden unit k:

    - ``W_in[counter, k] = -1``, ``b_in[k] = 1/(k+1)``: hidden unit k is ReLU(c_k - c).
    - ``W_out[k, position] = 2(k+1)``, ``W_out[k, position_sq] = (k+1)(6k+2)``.

    The MLP writes nothing else; ``b_out = 0``.
    """
    block = model.blocks[layer]
    n_ctx, d_model, d_mlp = model.cfg.n_ctx, model.cfg.d_model, model.cfg.d_mlp
    if d_mlp != mlp_width(n_ctx, construction):
        raise ValueError(
            f"the {construction!r} construction needs d_mlp={mlp_width(n_ctx, construction)}, the model has {d_mlp}"
        )
    W_K = torch.zeros(1, d_model, D_HEAD, dtype=torch.float64)
    W_K[0, ONE, 0] = 1.0
    W_V = torch.zeros_like(W_K)
    W_V[0, BOS, 0] = 1.0
    W_O = torch.zeros(1, D_HEAD, d_model, dtype=torch.float64)
    W_O[0, 0, COUNTER] = 1.0
    W_in = torch.zeros(d_model, d_mlp, dtype=torch.float64)
    W_out = torch.zeros(d_mlp, d_model, dtype=torch.float64)
    if construction == "steps":
        slopes, offsets = (torch.from_numpy(a) for a in counter_steps(n_ctx))
        odd = 2.0 * torch.arange(n_ctx - 1, dtype=torch.float64) + 1.0
        up, down = slice(0, None, 2), slice(1, None, 2)
        W_in[COUNTER, up] = W_in[COUNTER, down] = -slopes
        W_in[ONE, up] = W_in[ONE, down] = QUANTIZER + offsets
        b_in = torch.full((d_mlp,), -QUANTIZER, dtype=torch.float64)
        b_in[down] -= 1.0
        W_out[up, POSITION], W_out[down, POSITION] = 1.0, -1.0
        W_out[up, POSITION_SQ], W_out[down, POSITION_SQ] = odd, -odd
    else:
        knots, to_position, to_position_sq = (torch.from_numpy(a) for a in inverse_counter_interpolant(n_ctx))
        W_in[COUNTER] = -1.0
        b_in = knots
        W_out[:, POSITION] = to_position
        W_out[:, POSITION_SQ] = to_position_sq
    with torch.no_grad():
        block.attn.W_Q.zero_()
        block.attn.W_K.copy_(W_K)
        block.attn.W_V.copy_(W_V)
        block.attn.W_O.copy_(W_O)
        block.mlp.W_in.copy_(W_in)
        block.mlp.b_in.copy_(b_in)
        block.mlp.W_out.copy_(W_out)


def counter(
    n_ctx: int = 64, d_vocab: int = 8, construction: str = "steps", dtype: torch.dtype = torch.float32
) -> Decoder:
    """A one-layer NoPE decoder whose layer-1 residual holds 1/(i+1), i and i^2 (Theorem 1).

    Kazemnejad et al. 2023 (NeurIPS), App. C, Theorem 1; seed ``004_150f630256efbd1c.txt``. The
    weights are derived in :func:`set_embedding` and :func:`set_counter_block`. Normalization is
    off (``normalization="none"``), so nothing rescales the signal. Position 0 must be the BOS
    token (id 0); every other token may be anything.

    Known values at position i (0-based), in float32:

    - ``counter`` dim after block 0 = 1/(i+1) within 1e-6, for any tokens after BOS; identically 0
      when no token is BOS; k/(i+1) if BOS occurs k times in the prefix.
    - ``position`` dim after block 0 = i exactly for every i < n_ctx when n_ctx <= 2048 with the
      default ``steps`` MLP (within 1e-4 for n_ctx <= 160 with ``interpolant``); past n_ctx it
      saturates at n_ctx - 1 (``steps``) or extrapolates linearly (``interpolant``): not i.
    - ``position_sq`` dim = i^2 (exact in float32 while the sums stay below 2^24, n_ctx <= ~180;
      relative error ~1e-7 beyond).

    Args:
        n_ctx: number of positions the MLP inverts exactly, >= 2.
        d_vocab: vocabulary size including BOS, >= 2.
        construction: ``steps`` (exact in float32 up to n_ctx 2048) or ``interpolant`` (the plain
            piecewise-linear interpolant, n_ctx - 1 hidden units).
        dtype: parameter dtype (float32 or float64).

    Returns:
        A :class:`~nopelens.models.Decoder` with ``model.circuit`` (a
        :class:`~nopelens.circuits.layout.CircuitInfo`) naming the dimensions.

    Raises:
        ValueError: if ``n_ctx < 2``, ``d_vocab < 2`` or the construction is unknown.
    """
    model = blank_circuit_decoder(n_ctx, 1, d_vocab, construction, dtype)
    set_embedding(model)
    set_counter_block(model, 0, construction)
    return attach_info(model, "counter")


def attach_info(model: Decoder, name: str, heads: dict[str, str] | None = None, **parameters) -> Decoder:
    """Set ``model.circuit``: head ``0.0`` is the counter, ``heads`` describe the heads above it and
    ``parameters`` are the :class:`CircuitInfo` fields of the construction (``slope``, ``sharpness``)."""
    model.circuit = CircuitInfo(
        name=name,
        n_ctx=model.cfg.n_ctx,
        heads={"0.0": COUNTER_HEAD, **(heads or {})},
        content_dims=(CONTENT_START, model.cfg.d_model),
        **parameters,
    )
    return model


def circuit_tokens(model: Decoder, length: int | None = None, seed: int = 0, bos: bool = True) -> Int[Tensor, "1 pos"]:
    """A random sequence for a circuit: BOS at position 0 (if ``bos``), then random non-BOS tokens.

    Args:
        model: a circuit decoder (token 0 is BOS).
        length: sequence length, default the model's ``n_ctx``.
        seed: seed of the private generator.
        bos: put BOS at position 0; otherwise every token is non-BOS.

    Returns:
        int64 ``[1, length]``.

    Raises:
        ValueError: if ``length < 1``.
    """
    length = model.cfg.n_ctx if length is None else length
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, model.cfg.d_vocab, (1, length), generator=generator)
    if bos:
        tokens[0, 0] = BOS_TOKEN
    return tokens


def residual_after(
    model: Decoder, tokens: Tensor, layer: int = 1, **forward_kwargs
) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream at layer ``layer`` (0 = embeddings, l + 1 = output of ``blocks.{l}``)."""
    with torch.no_grad():
        return model(tokens, stop_at_layer=layer, **forward_kwargs)


def counter_trace(model: Decoder, tokens: Tensor | None = None) -> pd.DataFrame:
    """Counter and position dimensions at layer 1, next to their known values, one row per position.

    Args:
        model: a circuit decoder (:func:`counter`, or a distance / previous-token circuit).
        tokens: ``[1, pos]`` tokens; default :func:`circuit_tokens` of length n_ctx.

    Returns:
        DataFrame with columns ``position``, ``counter``, ``expected_counter`` (1/(i+1) times the
        number of BOS tokens up to i), ``position_value``, ``position_error`` (|position_value - i|).
    """
    tokens = circuit_tokens(model) if tokens is None else tokens
    resid = residual_after(model, tokens, layer=1)[0].double()
    n_bos = (tokens[0] == BOS_TOKEN).double().cumsum(0)
    i = torch.arange(tokens.shape[1], dtype=torch.float64)
    return pd.DataFrame(
        {
            "position": i.long().numpy(),
            "counter": resid[:, COUNTER].numpy(),
            "expected_counter": (n_bos / (i + 1)).numpy(),
            "position_value": resid[:, POSITION].numpy(),
            "position_error": (resid[:, POSITION] - i).abs().numpy(),
        }
    )


def check_counter(model: Decoder, seed: int = 0) -> dict[str, float]:
    """The exact checks of Theorem 1 on a random sequence of length n_ctx (float32 forward).

    Returns:
        ``counter_max_error``: max_i |counter - 1/(i+1)| with BOS at position 0 (target <= 1e-6);
        ``position_max_error``: max_i |position - i| (target <= 1e-4);
        ``no_bos_counter_max_abs``: max_i |counter| when no token is BOS (target exactly 0).
    """
    trace = counter_trace(model, circuit_tokens(model, seed=seed))
    no_bos = residual_after(model, circuit_tokens(model, seed=seed, bos=False), layer=1)[0, :, COUNTER]
    return {
        "counter_max_error": float((trace.counter - trace.expected_counter).abs().max()),
        "position_max_error": float(trace.position_error.max()),
        "no_bos_counter_max_abs": float(no_bos.abs().max()),
    }
