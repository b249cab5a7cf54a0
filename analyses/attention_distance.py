"""How alike two models attend: the Jensen-Shannon distance of Kazemnejad et al. 2023, Sec. 5.2.

The paper compares NoPE's attention with that of the explicit position methods. The distance
between two heads is the mean, over query positions, of the Jensen-Shannon divergence of their
attention rows (each row a distribution over the keys a query sees); the distance between two
models at a layer is the minimum over pairs of heads (one head of each), so a model is close to
another when some head of one attends like some head of the other. Both models read the same
token sequences, and the rows come from each model's ``blocks.{l}.attn.hook_pattern``.

Divergences are in bits (log base 2), so every value lies in [0, 1]: 0 for identical rows, 1 for
rows with disjoint support. Memory holds one batch of patterns, never the whole input.
"""

from __future__ import annotations

import itertools

import torch
from jaxtyping import Float
from torch import Tensor

from nopelens.models.hooks import act_name


def js_divergence(p: Float[Tensor, "... key_pos"], q: Float[Tensor, "... key_pos"]) -> Float[Tensor, "..."]:
    """Jensen-Shannon divergence in bits between distributions along the last axis.

    JSD(P, Q) = KL(P || M) / 2 + KL(Q || M) / 2 with M = (P + Q) / 2 (Lin 1991, eq. 4.1), computed
    in float64; ``0 log 0`` counts as 0, so keys blocked by the causal mask (probability 0 in
    both rows) add nothing.

    Args:
        p: a non-negative tensor whose last axis sums to 1.
        q: the same, of a shape that broadcasts with ``p``.

    Returns:
        The divergences, the broadcast shape without its last axis, in bits, in [0, 1].

    Raises:
        ValueError: if the shapes do not broadcast, or a row is negative or does not sum to 1 (within 1e-4).

    Example:
        >>> float(js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])))
        1.0
    """
    try:
        shape = torch.broadcast_shapes(p.shape, q.shape)
    except RuntimeError:
        raise ValueError(
            f"attention rows of shapes that do not broadcast: {tuple(p.shape)} and {tuple(q.shape)}"
        ) from None
    p, q = p.double().expand(shape), q.double().expand(shape)
    for name, rows in (("p", p), ("q", q)):
        if (rows < 0).any() or not torch.allclose(rows.sum(-1), torch.ones((), dtype=torch.float64), atol=1e-4):
            raise ValueError(f"{name} holds a row that is not a distribution (negative, or not summing to 1)")
    m = (p + q) / 2
    kl_pm = torch.xlogy(p, p).sum(-1) - torch.xlogy(p, m).sum(-1)
    kl_qm = torch.xlogy(q, q).sum(-1) - torch.xlogy(q, m).sum(-1)
    return ((kl_pm + kl_qm) / (2 * torch.log(torch.tensor(2.0, dtype=torch.float64)))).clamp(min=0.0)


def head_distances(
    pattern_a: Float[Tensor, "batch head_index query_pos key_pos"],
    pattern_b: Float[Tensor, "batch head_index query_pos key_pos"],
) -> Float[Tensor, "head_a head_b"]:
    """Summed JSD (bits) over every (sequence, query) of each pair of heads, one of each pattern.

    Divide by ``batch * query_pos`` for the mean (:func:`layer_distances` does).

    Raises:
        ValueError: if the two patterns differ in batch, query or key positions.
    """
    if pattern_a.shape[0] != pattern_b.shape[0] or pattern_a.shape[2:] != pattern_b.shape[2:]:
        raise ValueError(
            f"the two models read different inputs: patterns {tuple(pattern_a.shape)} and {tuple(pattern_b.shape)}"
        )
    return js_divergence(pattern_a[:, :, None], pattern_b[:, None, :]).sum(dim=(0, 3))


def _patterns(model, tokens: Tensor) -> list[Tensor]:
    names = [act_name("pattern", layer) for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens.to(model.cfg.device), names_filter=lambda name: name in names)
    return [cache[name].float().cpu() for name in names]


def layer_distances(model_a, model_b, tokens: Tensor, batch_size: int = 16) -> Float[Tensor, "layer head_a head_b"]:
    """Mean JSD (bits) over sequences and query positions, per layer and pair of heads.

    Args:
        model_a: a hooked model that records ``blocks.{l}.attn.hook_pattern``.
        model_b: another, with the same number of layers (``cfg.n_layers``).
        tokens: int ``[batch, pos]`` sequences both models read, all of one length (no padding).
        batch_size: sequences per forward pass; memory holds one batch's patterns.

    Raises:
        ValueError: if the models differ in depth or ``tokens`` is empty.
    """
    if model_a.cfg.n_layers != model_b.cfg.n_layers:
        raise ValueError(
            f"models of different depth ({model_a.cfg.n_layers} and {model_b.cfg.n_layers} layers) "
            "have no layer-by-layer distance"
        )
    if tokens.ndim != 2 or tokens.numel() == 0:
        raise ValueError(f"tokens must be a non-empty [batch, pos] tensor, got shape {tuple(tokens.shape)}")
    total = None
    for start in range(0, len(tokens), batch_size):
        chunk = tokens[start : start + batch_size]
        sums = torch.stack([head_distances(a, b) for a, b in zip(_patterns(model_a, chunk), _patterns(model_b, chunk))])
        total = sums if total is None else total + sums
    return total / (tokens.shape[0] * tokens.shape[1])


def model_distance(per_head: Float[Tensor, "layer head_a head_b"]) -> Float[Tensor, " layer"]:
    """The distance between two models at each layer: the minimum over pairs of heads."""
    return per_head.flatten(1).min(dim=1).values


def pairwise_table(models: dict[str, object], tokens: Tensor) -> list[dict]:
    """Rows ``model_a, model_b, layer, jsd_bits, head_a, head_b`` for every unordered pair of models
    (and each model against itself, whose distance is 0): the closest pair of heads per layer."""
    rows = []
    for name_a, name_b in itertools.combinations_with_replacement(models, 2):
        per_head = layer_distances(models[name_a], models[name_b], tokens)
        for layer, grid in enumerate(per_head):
            head_a, head_b = divmod(int(grid.argmin()), grid.shape[1])
            for a, b, ha, hb in ((name_a, name_b, head_a, head_b), (name_b, name_a, head_b, head_a))[
                : 1 + (name_a != name_b)
            ]:
                rows.append(dict(model_a=a, model_b=b, layer=layer, jsd_bits=float(grid.min()), head_a=ha, head_b=hb))
    return rows
