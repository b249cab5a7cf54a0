"""Small printed demonstrations from the seeds, computed with the Decoder's own mask functions.

- :func:`causal_table`: seed ``000_268c7b6ce21be6d1.txt``, FIG-004, the three-token causal table.
- :func:`fully_masked_rejection`: seed 000, a fully masked input has no distribution to normalize.
- :func:`blocking_vs_zero_score`: seed 000, blocking is not scoring zero.
- :func:`permutation_equivariance`: seed ``001_a5e0f436f129b820.txt``, Attention(PX) = P Attention(X)
  for all-visible content-only attention, not in general under a fixed causal mask.
- :func:`constant_input_control`: the variance control of seed ``004_150f630256efbd1c.txt``; on a
  constant input with no distinct BOS every NoPE head is exactly uniform and every position's
  residual is identical, so position cannot be recovered.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from nopelens.models import Decoder, DecoderConfig
from nopelens.models.hooks import act_name, act_names
from nopelens.models.masks import causal_mask, masked_softmax

FIG_004_TOKENS = ("grid", "load", "rises")


def causal_table(tokens: tuple[str, ...] = FIG_004_TOKENS) -> pd.DataFrame:
    """Allowed / Blocked per (query row, key column) under the causal rule j <= i (seed 000, FIG-004).

    Args:
        tokens: the token strings, in order; they label rows (queries) and columns (keys).

    Returns:
        DataFrame of strings, index ``query``, columns ``key``.

    Raises:
        ValueError: if ``tokens`` is empty.

    Example:
        >>> causal_table().to_dict("index")["load"]
        {'grid': 'Allowed', 'load': 'Allowed', 'rises': 'Blocked'}
    """
    if not tokens:
        raise ValueError("causal_table needs at least one token")
    allowed = causal_mask(len(tokens), len(tokens))
    return pd.DataFrame(
        [["Allowed" if a else "Blocked" for a in row] for row in allowed.tolist()],
        index=pd.Index(tokens, name="query"),
        columns=pd.Index(tokens, name="key"),
    )


def rows_with_no_allowed_key(table: pd.DataFrame) -> list[str]:
    """The query rows of a :func:`causal_table` in which every key is blocked (seed 000: none)."""
    return [query for query, row in table.iterrows() if not (row == "Allowed").any()]


def fully_masked_rejection() -> str:
    """The error a Decoder raises for a fully masked input (seed 000: no distribution to normalize).

    Runs a tiny NoPE Decoder on three tokens with ``attention_mask`` all 0.

    Returns:
        The ``ValueError`` message.

    Raises:
        RuntimeError: if the Decoder accepted the input (that would be a bug).
    """
    model = Decoder(DecoderConfig(d_vocab=4, n_ctx=4, n_layers=1, d_model=8, n_heads=2), seed=0)
    tokens = torch.tensor([[1, 2, 3]])
    try:
        model(tokens, attention_mask=torch.zeros_like(tokens))
    except ValueError as error:
        return str(error)
    raise RuntimeError("the Decoder accepted a fully masked input instead of raising ValueError")


def blocking_vs_zero_score(
    scores: tuple[float, ...] = (1.0, 2.0, 0.5), blocked: int = 2, tokens: tuple[str, ...] = FIG_004_TOKENS
) -> pd.DataFrame:
    """One query row's weights: unmasked, with one key's score set to 0, and with that key blocked.

    Seed ``000_268c7b6ce21be6d1.txt``: a zero score still gets exp(0) = 1 in the numerator; a blocked
    key (-inf before the softmax) gets exactly 0 and leaves the denominator, so every remaining
    weight renormalizes: blocked_j = unmasked_j / sum_{k allowed} unmasked_k.

    Args:
        scores: the row's scaled scores, one per key.
        blocked: index of the key to block (or to score zero).
        tokens: key labels, as many as ``scores``.

    Returns:
        DataFrame indexed by key with columns ``score``, ``unmasked``, ``zero_score``, ``blocked``
        and ``renormalized`` (unmasked weights of the allowed keys divided by their sum).

    Raises:
        ValueError: if the lengths differ or ``blocked`` is out of range.

    Example:
        >>> table = blocking_vs_zero_score()
        >>> float(table.loc["rises", "blocked"]), bool(table.loc["rises", "zero_score"] > 0)
        (0.0, True)
    """
    if len(scores) != len(tokens):
        raise ValueError(f"got {len(scores)} scores for {len(tokens)} tokens")
    if not 0 <= blocked < len(scores):
        raise ValueError(f"blocked={blocked} is not a key index in [0, {len(scores)})")
    row = torch.tensor(scores, dtype=torch.float64).view(1, 1, 1, -1)
    everything = torch.ones_like(row, dtype=torch.bool)
    allowed = everything.clone()
    allowed[..., blocked] = False
    zeroed = row.clone()
    zeroed[..., blocked] = 0.0
    unmasked = masked_softmax(row, everything).flatten()
    renormalized = torch.where(allowed.flatten(), unmasked, 0.0)
    renormalized = renormalized / renormalized.sum()
    return pd.DataFrame(
        {
            "score": row.flatten().numpy(),
            "unmasked": unmasked.numpy(),
            "zero_score": masked_softmax(zeroed, everything).flatten().numpy(),
            "blocked": masked_softmax(row, allowed).flatten().numpy(),
            "renormalized": renormalized.numpy(),
        },
        index=pd.Index(tokens, name="key"),
    )


def content_attention(
    X: Float[Tensor, "pos d_model"],
    W_Q: Float[Tensor, "d_model d_head"],
    W_K: Float[Tensor, "d_model d_head"],
    W_V: Float[Tensor, "d_model d_head"],
    allowed: Bool[Tensor, "pos pos"],
) -> Float[Tensor, "pos d_head"]:
    """One content-only head with shared row-wise projections: softmax(QK^T / sqrt(d_head) + M) V.

    Seed ``001_a5e0f436f129b820.txt``; the softmax is the Decoder's
    :func:`~nopelens.models.masks.masked_softmax` (-inf at blocked entries).
    """
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    scores = Q @ K.T / math.sqrt(W_Q.shape[1])
    return masked_softmax(scores[None, None], allowed[None, None])[0, 0] @ V


def permutation_equivariance(
    permutation: tuple[int, ...] = (2, 0, 1), d_model: int = 8, d_head: int = 4, seed: int = 0, atol: float = 1e-6
) -> dict[str, bool | float]:
    """Does Attention(PX) equal P Attention(X)? For all-visible, fixed causal and permuted causal masks.

    Seed ``001_a5e0f436f129b820.txt``: with shared projections S' = P S P^T, so A' = P A P^T and
    Z' = P Z when nothing but content decides the scores (True). A fixed triangular mask M is tied
    to indices, P (S + M) P^T != P S P^T + M, so the relation fails in general (False); permuting
    the mask along with the rows, M' = P M P^T, restores it (True). The default P reorders rows
    [0, 1, 2] to [2, 0, 1], the seed's example. The last entry repeats the fixed-mask case with a
    one-layer NoPE :class:`~nopelens.models.Decoder` on permuted tokens.

    Args:
        permutation: new row order, a permutation of ``range(pos)`` other than the identity.
        d_model: width of the random X.
        d_head: width of the head.
        seed: seed of X and the projections.
        atol: tolerance of the comparison.

    Returns:
        ``all_visible``, ``fixed_causal_mask``, ``permuted_causal_mask``, ``nope_decoder_causal``
        (bools) and the matching ``*_max_error`` floats.

    Raises:
        ValueError: if ``permutation`` is not a permutation of ``range(len(permutation))`` or is
            the identity.

    Example:
        >>> result = permutation_equivariance()
        >>> result["all_visible"], result["fixed_causal_mask"], result["permuted_causal_mask"]
        (True, False, True)
    """
    n = len(permutation)
    if sorted(permutation) != list(range(n)):
        raise ValueError(f"permutation must reorder range({n}), got {permutation}")
    if list(permutation) == list(range(n)):
        raise ValueError("permutation is the identity; it cannot break anything")
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_model, generator=generator, dtype=torch.float64)
    W_Q, W_K, W_V = (torch.randn(d_model, d_head, generator=generator, dtype=torch.float64) for _ in range(3))
    P = torch.tensor(permutation)
    causal = causal_mask(n, n)
    masks = {
        "all_visible": (torch.ones(n, n, dtype=torch.bool),) * 2,
        "fixed_causal_mask": (causal, causal),
        "permuted_causal_mask": (causal, causal[P][:, P]),
    }
    result: dict[str, bool | float] = {}
    for name, (mask, permuted_mask) in masks.items():
        original = content_attention(X, W_Q, W_K, W_V, mask)
        permuted = content_attention(X[P], W_Q, W_K, W_V, permuted_mask)
        error = float((permuted - original[P]).abs().max())
        result[name], result[f"{name}_max_error"] = error <= atol, error
    decoder = Decoder(DecoderConfig(d_vocab=16, n_ctx=n, n_layers=1, d_model=16, n_heads=2), seed=seed)
    tokens = torch.randperm(16, generator=generator)[:n][None]
    with torch.no_grad():
        original, permuted = decoder(tokens, stop_at_layer=1), decoder(tokens[:, P], stop_at_layer=1)
    error = float((permuted[0] - original[0, P]).abs().max())
    result["nope_decoder_causal"], result["nope_decoder_causal_max_error"] = error <= atol, error
    return result


def constant_input_control(model: Decoder, token: int, length: int) -> dict[str, float]:
    """Variance control: one token repeated, no distinct BOS. How uniform is every head, how equal every row?

    With every row of the input equal, every query sees keys identical to itself; in a NoPE model
    all visible scores of a row are equal, so each head's pattern is exactly 1/(i+1) for j <= i,
    the head's output equals the common value, and by induction every layer's residual is the same
    at every position (seed ``004_150f630256efbd1c.txt``: shrinkage needs varying values). Position
    is then not recoverable from any site.

    Args:
        model: a NoPE :class:`~nopelens.models.Decoder` (any weights).
        token: the repeated token id.
        length: sequence length, >= 1.

    Returns:
        ``max_pattern_deviation``: max over layers, heads and visible (i, j) of |A_ij - 1/(i+1)|;
        ``max_residual_spread``: max over layers 0..n_layers and positions of |h_i - h_0| (inf-norm);
        ``max_residual_abs``: the largest |h| entry, the scale against which float rounding of the
        spread is judged.

    Raises:
        ValueError: if the model has a position method other than ``nope`` in some layer, or on
            the Decoder's own input errors.
    """
    if model.cfg.reads_positions:
        raise ValueError(f"constant_input_control needs a NoPE model, got position={model.cfg.position!r}")
    patterns = act_names("pattern", model.cfg.n_layers)
    resids = [act_name("resid_pre", 0), *act_names("resid_post", model.cfg.n_layers)]
    tokens = torch.full((1, length), token, dtype=torch.long)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=patterns + resids)
    uniform = causal_mask(length, length).double() / torch.arange(1, length + 1, dtype=torch.float64)[:, None]
    return {
        "max_pattern_deviation": max(float((cache[name][0].double() - uniform).abs().max()) for name in patterns),
        "max_residual_spread": max(float((cache[name][0] - cache[name][0, :1]).abs().max()) for name in resids),
        "max_residual_abs": max(float(cache[name].abs().max()) for name in resids),
    }
