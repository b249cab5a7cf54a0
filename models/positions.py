"""Position methods as plain tensor functions: sinusoidal tables, RoPE, ALiBi, Shaw offsets, T5 buckets.

Conventions (DESIGN.md): positions start at 0; query index i, key index j; relative distance
i - j >= 0 for visible keys. Angles and tables are computed in float32 or wider whatever the model
dtype, and position ids are int64.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor


def _wide(dtype: torch.dtype | None) -> torch.dtype:
    """float64 stays float64; anything narrower is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sinusoidal_table(
    position_ids: Int[Tensor, "*batch pos"],
    d_model: int,
    base: float = 10000.0,
    dtype: torch.dtype | None = None,
) -> Float[Tensor, "*batch pos d_model"]:
    """Vaswani sinusoidal position vectors at the given positions.

    PE[p, 2r] = sin(p / base^(2r/d_model)) and PE[p, 2r+1] = cos(p / base^(2r/d_model))
    (Vaswani et al. 2017, sec. 3.5; seeds ``000_268c7b6ce21be6d1.txt`` and
    ``002_c993a97fc3f160f5.txt``). An odd ``d_model`` ends on a sine.

    Args:
        position_ids: int64 positions, >= 0, any leading shape.
        d_model: width of the vectors, >= 1 (odd widths allowed).
        base: the frequency base (10000 in the paper).
        dtype: float32 (default) or float64; narrower dtypes are computed in float32.

    Returns:
        Float tensor ``[*batch, pos, d_model]`` on the device of ``position_ids``. Unitless.

    Raises:
        ValueError: if ``d_model < 1`` or a position id is negative.

    Example:
        >>> sinusoidal_table(torch.tensor([0, 1]), 2).tolist()  # seed 000: [0, 1], [sin 1, cos 1]
        [[0.0, 1.0], [0.8414709568023682, 0.5403023362159729]]
        >>> [round(v, 6) for v in sinusoidal_table(torch.tensor([1]), 5, dtype=torch.float64)[0].tolist()]
        [0.841471, 0.540302, 0.025116, 0.999685, 0.000631]
    """
    if d_model < 1:
        raise ValueError(f"d_model must be >= 1, got {d_model}")
    _check_positions(position_ids)
    dtype = _wide(dtype)
    pair = torch.arange(d_model, device=position_ids.device) // 2
    inv_freq = base ** (-2.0 * pair.to(dtype) / d_model)
    angles = position_ids.to(dtype).unsqueeze(-1) * inv_freq
    is_even = torch.arange(d_model, device=position_ids.device) % 2 == 0
    return torch.where(is_even, angles.sin(), angles.cos())


def rope_angles(
    position_ids: Int[Tensor, "*batch pos"],
    rotary_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype | None = None,
) -> Float[Tensor, "*batch pos half"]:
    """RoPE angles t = p * theta_r with theta_r = base^(-2r / rotary_dim), r < rotary_dim / 2.

    Su et al. 2021 (RoFormer), eq. 15; seed ``002_c993a97fc3f160f5.txt``.

    Args:
        position_ids: int64 positions, >= 0.
        rotary_dim: number of rotated dims, even and >= 2.
        base: RoPE base.
        dtype: float32 (default) or float64.

    Returns:
        ``[*batch, pos, rotary_dim // 2]`` angles in radians.

    Raises:
        ValueError: if ``rotary_dim`` is odd or < 2, or a position id is negative.

    Example:
        >>> rope_angles(torch.tensor([2]), 4, base=100.0).tolist()
        [[2.0, 0.20000000298023224]]
    """
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even integer >= 2, got {rotary_dim}")
    _check_positions(position_ids)
    dtype = _wide(dtype)
    r = torch.arange(rotary_dim // 2, device=position_ids.device, dtype=dtype)
    inv_freq = base ** (-2.0 * r / rotary_dim)
    return position_ids.to(dtype).unsqueeze(-1) * inv_freq


def apply_rope(
    x: Float[Tensor, "batch pos head_index d_head"],
    position_ids: Int[Tensor, "batch pos"],
    rotary_dim: int,
    base: float = 10000.0,
    pairing: str = "half",
) -> Float[Tensor, "batch pos head_index d_head"]:
    """Rotate the first ``rotary_dim`` dims of each head by its position (RoPE).

    Each pair (a, b) becomes (a cos t - b sin t, a sin t + b cos t) with t = p * theta_r (Su et al.
    2021, eq. 34). ``pairing="half"`` pairs dims r and r + rotary_dim/2 (GPT-NeoX, HF Llama);
    ``"interleaved"`` pairs dims 2r and 2r + 1 (GPT-J, Meta Llama). Dims past ``rotary_dim`` pass
    through unchanged (partial RoPE, seed ``004_150f630256efbd1c.txt``). The rotation is computed in
    float32 or wider, then cast back to ``x.dtype``.

    Args:
        x: queries or keys, ``[batch, pos, head_index, d_head]``.
        position_ids: int64 ``[batch, pos]``, >= 0.
        rotary_dim: even, ``2 <= rotary_dim <= d_head``.
        base: RoPE base.
        pairing: ``half`` or ``interleaved``.

    Returns:
        Tensor of the shape and dtype of ``x``.

    Raises:
        ValueError: on an unknown pairing, a bad ``rotary_dim`` or mismatched shapes.

    Example:
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).view(1, 1, 1, 4)
        >>> pos = torch.tensor([[1]])
        >>> [round(v, 6) for v in apply_rope(x, pos, 4, pairing="interleaved").flatten().tolist()]
        [-1.14264, 1.922076, 2.959851, 4.0298]
        >>> [round(v, 6) for v in apply_rope(x, pos, 4, pairing="half").flatten().tolist()]
        [-1.984111, 1.959901, 2.462378, 4.0198]
    """
    if pairing not in ("half", "interleaved"):
        raise ValueError(f"pairing must be 'half' or 'interleaved', got {pairing!r}")
    if x.ndim != 4 or position_ids.shape != x.shape[:2]:
        raise ValueError(
            f"apply_rope expects x [batch, pos, head_index, d_head] and position_ids "
            f"[batch, pos]; got {tuple(x.shape)} and {tuple(position_ids.shape)}"
        )
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim={rotary_dim} exceeds d_head={x.shape[-1]}")
    angles = rope_angles(position_ids, rotary_dim, base, dtype=x.dtype)[:, :, None, :]
    cos, sin = angles.cos(), angles.sin()
    rot, rest = x[..., :rotary_dim].to(cos.dtype), x[..., rotary_dim:]
    if pairing == "half":
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


def alibi_slopes(n_heads: int, device: torch.device | str | None = None) -> Float[Tensor, " n_heads"]:
    """Per-head ALiBi slopes m_h.

    For a power of two n, m_h = 2^(-8(h+1)/n). Otherwise take the slopes of the largest power of
    two c < n, then every other slope of the 2c-head sequence until n slopes are found (Press,
    Smith & Lewis 2022, released code; seed ``002_c993a97fc3f160f5.txt`` gives the bias
    -m_h (i - j)).

    Args:
        n_heads: number of attention heads, >= 1.
        device: where to put the result.

    Returns:
        Float32 tensor ``[n_heads]``, slopes in (0, 1), in score units per token of distance.

    Raises:
        ValueError: if ``n_heads < 1``.

    Example:
        >>> alibi_slopes(6).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
        >>> alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
        True
    """
    if not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be an integer >= 1, got {n_heads!r}")

    def power_of_two_slopes(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    closest = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def alibi_bias(
    slopes: Float[Tensor, " n_heads"],
    query_positions: Int[Tensor, "batch query_pos"],
    key_positions: Int[Tensor, "batch key_pos"],
) -> Float[Tensor, "batch n_heads query_pos key_pos"]:
    """ALiBi score bias -m_h (i - j), a finite recency bias and never a mask.

    Press, Smith & Lewis 2022, sec. 3; seed ``002_c993a97fc3f160f5.txt``. Blocked (future) keys
    get a positive bias here; the causal mask, applied separately, removes them.

    Args:
        slopes: ``[n_heads]`` from :func:`alibi_slopes`.
        query_positions: int64 position ids i of the queries.
        key_positions: int64 position ids j of the keys.

    Returns:
        ``[batch, n_heads, query_pos, key_pos]`` in score units, dtype of ``slopes``.

    Example:
        >>> p = torch.arange(3)[None]
        >>> alibi_bias(torch.tensor([0.5]), p, p)[0, 0].tolist()
        [[-0.0, 0.5, 1.0], [-0.5, -0.0, 0.5], [-1.0, -0.5, -0.0]]
    """
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # i - j
    return -slopes[None, :, None, None] * distance[:, None].to(slopes.dtype)


def shaw_relative_ids(
    query_positions: Int[Tensor, "batch query_pos"],
    key_positions: Int[Tensor, "batch key_pos"],
    clip: int,
) -> Int[Tensor, "batch query_pos key_pos"]:
    """Row index into Shaw's relative tables: clip(j - i, -k, k) + k, in ``[0, 2k]``.

    Shaw, Uszkoreit & Vaswani 2018, eq. 6 (row = query i, column = key j); seed
    ``002_c993a97fc3f160f5.txt`` uses the signed offset j - i.

    Args:
        query_positions: int64 position ids i.
        key_positions: int64 position ids j.
        clip: Shaw's k >= 0; the table has 2k + 1 rows.

    Returns:
        int64 ``[batch, query_pos, key_pos]``.

    Example:
        >>> p = torch.arange(5)[None]
        >>> shaw_relative_ids(p, p, 2)[0].tolist()
        [[2, 3, 4, 4, 4], [1, 2, 3, 4, 4], [0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2]]
    """
    offset = key_positions[:, None, :] - query_positions[:, :, None]  # j - i
    return offset.clamp(-clip, clip) + clip


def t5_relative_bucket(
    relative_position: Int[Tensor, "..."],
    bidirectional: bool = False,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Int[Tensor, "..."]:
    """T5's bucket of a signed offset j - i (key minus query): exact near, log-spaced far.

    Raffel et al. 2020, sec. 2.1 (the released Mesh TensorFlow ``_relative_position_bucket``, as in
    HF's ``T5Attention``). Unidirectional (a decoder): d = max(i - j, 0); distances
    d < num_buckets / 2 get their own bucket, larger ones log-spaced buckets up to max_distance,
    and every d >= max_distance the last bucket. Bidirectional: half the buckets for each sign
    of j - i. The log is taken in float32, as in the reference, so bucket edges match it exactly.

    Args:
        relative_position: int64 offsets j - i, any shape.
        bidirectional: False for a causal decoder.
        num_buckets: number of buckets, >= 2 (>= 4 when bidirectional).
        max_distance: distance from which all offsets share the last bucket, > the exact range.

    Returns:
        int64 buckets in ``[0, num_buckets)``, the shape of ``relative_position``.

    Raises:
        ValueError: if the exact range is empty or max_distance does not exceed it.

    Example:
        >>> d = torch.tensor([0, -1, -7, -8, -9, -15, -16, -50, -127, -128, -1000, 3])
        >>> t5_relative_bucket(d, num_buckets=16, max_distance=128).tolist()
        [0, 1, 7, 8, 8, 9, 10, 13, 15, 15, 15, 0]
    """
    n = num_buckets // 2 if bidirectional else num_buckets
    max_exact = n // 2
    if max_exact < 1 or max_distance <= max_exact:
        raise ValueError(
            f"num_buckets={num_buckets} and max_distance={max_distance} leave no exact or no log-spaced "
            "range: need num_buckets // 2 >= 1 (per direction) and max_distance > that"
        )
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        buckets = buckets + (relative_position > 0).long() * n
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    far = (
        max_exact
        + (
            torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact) * (n - max_exact)
        ).long()
    )
    far = far.clamp(max=n - 1)
    return buckets + torch.where(distance < max_exact, distance, far)


def position_ids_from_mask(
    attention_mask: Int[Tensor, "batch pos"], start: Int[Tensor, " batch"] | None = None
) -> Int[Tensor, "batch pos"]:
    """Position ids that count only real tokens: the first real token of a row gets ``start``.

    Padded entries get position 0 (they are never attended to by real queries and never probe
    samples). This makes a left-padded sequence see the positions it would see alone.

    Args:
        attention_mask: 1 for real tokens, 0 for padding.
        start: per-row offset (the number of real tokens already in a KV cache); default 0.

    Returns:
        int64 ``[batch, pos]``.

    Example:
        >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])).tolist()
        [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    """
    mask = attention_mask.long()
    ids = mask.cumsum(-1) - 1
    if start is not None:
        ids = ids + start[:, None].long()
    return ids.masked_fill(mask == 0, 0)


def _check_positions(position_ids: Tensor) -> None:
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"position ids must be integers, got dtype {position_ids.dtype}")
    if position_ids.numel() and int(position_ids.min()) < 0:
        raise ValueError(f"position ids must be >= 0, got min {int(position_ids.min())}")
