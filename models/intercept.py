"""Attention read from the computation: the ``scaled_dot_product_attention`` and softmax calls a
forward pass makes, whatever module makes them.

:class:`AttentionInterceptor` is a ``torch.overrides.TorchFunctionMode``: while it is active, every
call of ``torch.nn.functional.scaled_dot_product_attention`` and every softmax over the last axis of
a ``[batch, head_index, query_pos, key_pos]`` tensor (square: one forward pass, no cache) goes
through :meth:`AttentionInterceptor.handle`, which passes what the call sees through TransformerLens
``HookPoint`` s at the names of the block it belongs to (``blocks.{l}.attn.hook_q``, ``hook_k``,
``hook_v``, ``hook_attn_scores``, ``hook_pattern``). :class:`nopelens.models.anymodel.HookedAny`
owns the points and says which block a call belongs to.

- A ``scaled_dot_product_attention`` call gives q, k and v (``[batch, pos, head_index, d_head]``,
  k and v with the call's own key-value heads). It runs fused as the model wrote it; its scores and
  pattern are computed explicitly, in float64, only when a hook asks for them (a hook on
  ``hook_attn_scores`` or ``hook_pattern``), with the call's scale (default 1/sqrt(d_head)),
  ``is_causal`` (top-left aligned, as torch), boolean (True = may attend) or additive mask, and
  grouped-query heads (``enable_gqa``: key-value head ``h // (n_heads / n_kv_heads)`` serves query
  head ``h``, torch's ``repeat_interleave`` rule). A hook that changes the pattern changes the
  output (pattern @ v); a hook that only reads leaves the fused output as it was, bit for bit.
- An explicit softmax gives the scores it was called on and the pattern it returns (no q, k, v:
  they are not arguments of the call).

Each call also reports which keys each query could see (:func:`visible_keys`), so the window or
chunk a pattern was computed under travels with it (:func:`infer_key_window`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .masks import CAUSAL, KeyWindow

SOFTMAXES = (torch.softmax, F.softmax, Tensor.softmax)
"""The softmax entry points an attention implementation calls (``nn.Softmax`` calls ``F.softmax``)."""


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return dict(
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _functional_softmax(input, dim=None, _stacklevel=3, dtype=None):
    return input, dim, dtype


def _softmax(input, dim=None, dtype=None):
    return input, dim, dtype


def softmax_arguments(func, args: tuple, kwargs: dict) -> tuple[Tensor, int | None, torch.dtype | None]:
    """(scores, dim, dtype) of a call of ``func``, one of :data:`SOFTMAXES` (``F.softmax``'s third
    positional argument is ``_stacklevel``, ``torch.softmax``'s is ``dtype``)."""
    return (_functional_softmax if func is F.softmax else _softmax)(*args, **kwargs)


def is_attention_softmax(func, args: tuple, kwargs: dict) -> bool:
    """Whether a softmax call is over the keys of a ``[batch, head_index, query_pos, key_pos]`` score
    tensor of one forward pass (4 axes, softmax over the last, which has as many keys as queries, or
    one more: a learned sink's logit, GPT-OSS's ``[scores, sink]`` or x-transformers' ``[sink, scores]``)."""
    try:
        scores, dim, _ = softmax_arguments(func, args, kwargs)
    except TypeError:
        return False
    return (
        isinstance(scores, Tensor)
        and scores.ndim == 4
        and scores.shape[-1] - scores.shape[-2] in (0, 1)
        and dim is not None
        and dim % 4 == 3
    )


def sink_column(scores: Tensor) -> int:
    """Which column of a ``[batch, head, T, T + 1]`` score tensor is the learned sink: 0 or T, the one
    every query sees while the other T columns keep the causal rule (query 0 sees key 0 only).

    Raises:
        ValueError: if neither reading gives a causal pattern (the extra column is not a sink).
    """
    visible = visible_keys(scores[:1, :1])[0, 0]
    n = visible.shape[0]
    for column, keys in ((0, visible[:, 1:]), (n, visible[:, :-1])):
        if bool(visible[:, column].all()) and not bool(keys.triu(1).any()) and bool(keys[0, 0]):
            return column
    raise ValueError(
        f"a softmax over {n} queries and {n + 1} keys whose extra key is neither first nor last "
        "for every query: not a learned sink nopelens can read"
    )


def sdpa_scores(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The pre-softmax scores of a ``scaled_dot_product_attention`` call, in float64.

    scores = q k^T * scale (+ the additive mask, or -inf where a boolean mask is False, or where
    ``is_causal`` blocks key j > i), as ``torch.nn.functional.scaled_dot_product_attention``'s
    documented reference implementation; grouped-query key heads are repeated (``repeat_interleave``).

    Args:
        query: ``[batch, head_index, query_pos, d_head]``; key: ``[batch, kv_head, key_pos, d_head]``.

    Returns:
        float64 ``[batch, head_index, query_pos, key_pos]``, -inf at blocked keys.

    Raises:
        ValueError: if the query heads are not a multiple of the key heads.
    """
    n_heads, n_kv = query.shape[-3], key.shape[-3]
    if n_heads != n_kv:
        if n_heads % n_kv:
            raise ValueError(f"{n_heads} query heads cannot share {n_kv} key-value heads")
        key = key.repeat_interleave(n_heads // n_kv, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query.double() @ key.double().transpose(-1, -2)) * scale
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.double()
    return scores


def sdpa_visible(
    attn_mask: Tensor | None, is_causal: bool, n_queries: int, n_keys: int, device: torch.device
) -> Tensor:
    """Which keys each query of a ``scaled_dot_product_attention`` call may see, from its mask and
    ``is_causal`` alone (no scores computed): bool, broadcast ``[batch or 1, 1, query, key]``."""
    visible = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    if is_causal:
        visible = visible.tril()
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else visible_keys(attn_mask)
        visible = visible & allowed
    visible = visible.reshape(-1, *visible.shape[-2:])
    return visible[:, None] if visible.shape[0] > 1 else visible[None]


def visible_keys(scores: Tensor) -> Tensor:
    """Which keys each query may see, from its scores: ``[batch, head_index, query, key]`` bool,
    False where the score is -inf or a masking fill (below half the dtype's lowest value, as
    ``masked_fill(-finfo.max)`` writes)."""
    return scores > torch.finfo(scores.dtype).min / 2


def infer_key_window(visible: Tensor) -> KeyWindow | None:
    """The causal rule, sliding window or chunk a ``[..., query, key]`` visibility mask is, or None.

    Read from the batch row with the most visible keys (an unpadded row); the mask must equal
    :meth:`KeyWindow.visible` of what is read exactly in that row and head, else None (a mask
    nopelens does not know: reads that need it refuse rather than guess).

    Example:
        >>> infer_key_window(KeyWindow(window=3).visible(6)), infer_key_window(torch.ones(4, 4, dtype=torch.bool))
        (KeyWindow(window=3, chunk=None), None)
    """
    flat = visible.reshape(-1, *visible.shape[-2:])
    grid = flat[flat.sum((-1, -2)).argmax()].cpu()
    n = grid.shape[-1]
    last = int(grid[-1].sum())
    blocked_first = (~grid[:, 0]).nonzero()
    candidates = [CAUSAL, KeyWindow(window=max(last, 1))]
    if len(blocked_first) and int(blocked_first[0]) >= 1:  # query 0 seeing no key (a left-padded row): no chunk
        candidates.append(KeyWindow(chunk=int(blocked_first[0])))
    for keys in candidates:
        if torch.equal(keys.visible(n), grid):
            return CAUSAL if keys.window is not None and keys.window >= n else keys
    return None


class AttentionInterceptor(TorchFunctionMode):
    """Routes a forward pass's attention calls to ``handle(kind, func, args, kwargs)``.

    ``kind`` is ``"sdpa"`` or ``"softmax"``; every other torch call runs as it would.

    Args:
        handle: called instead of the attention call; returns what the call returns.
    """

    def __init__(self, handle: Callable):
        super().__init__()
        self.handle = handle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.handle("sdpa", func, args, kwargs)
        if func in SOFTMAXES and is_attention_softmax(func, args, kwargs):
            return self.handle("softmax", func, args, kwargs)
        return func(*args, **kwargs)


def run_sdpa(
    func, args: tuple, kwargs: dict, point: Callable[[str, Tensor], Tensor], wants: Callable[[str], bool]
) -> tuple[Tensor, Tensor]:
    """One ``scaled_dot_product_attention`` call through the hook points of its block.

    Args:
        point: ``point(short_name, value)`` passes ``value`` through the block's hook point.
        wants: whether a hook asks for ``attn_scores`` or ``pattern``.

    Returns:
        (the call's output, its visible keys ``[batch, 1 or head, query, key]``).

    Raises:
        ValueError: if attention dropout is on (the pattern would be random: call ``model.eval()``),
            or the call is not on ``[batch, head_index, pos, d_head]`` tensors.
    """
    call = _sdpa_arguments(*args, **kwargs)
    if call["dropout_p"]:
        raise ValueError(f"attention dropout p={call['dropout_p']} is on, so the pattern is random: call model.eval()")
    if call["query"].ndim != 4:
        raise ValueError(
            f"scaled_dot_product_attention on {call['query'].ndim}-axis tensors; nopelens reads "
            "[batch, head_index, pos, d_head]"
        )
    q, k, v = (
        point(name, call[key].transpose(1, 2)).transpose(1, 2)
        for name, key in (("q", "query"), ("k", "key"), ("v", "value"))
    )
    call.update(query=q, key=k, value=v)
    visible = sdpa_visible(call["attn_mask"], call["is_causal"], q.shape[-2], k.shape[-2], q.device)
    if not (wants("attn_scores") or wants("pattern")):
        return func(**call), visible
    scores = point("attn_scores", sdpa_scores(q, k, call["attn_mask"], call["is_causal"], call["scale"]))
    pattern = torch.softmax(scores, dim=-1)
    read = point("pattern", pattern)
    if read is pattern:
        return func(**call), visible
    n_heads, n_kv = q.shape[1], v.shape[1]
    v = v.repeat_interleave(n_heads // n_kv, dim=1) if n_heads != n_kv else v
    return (read.double() @ v.double()).to(q.dtype), visible


def run_softmax(func, args: tuple, kwargs: dict, point: Callable[[str, Tensor], Tensor]) -> tuple[Tensor, Tensor, bool]:
    """One explicit attention softmax through its block's ``hook_attn_scores`` and ``hook_pattern``.

    With a learned sink's column (:func:`sink_column`), the hooks see the T key columns only: the
    pattern's rows then sum to 1 - p_sink (what :func:`nopelens.probes.sink_table` reads as the
    sink's mass), and the sink column is put back where the model expects it.

    Returns:
        (the pattern the model goes on with, its visible keys, whether the call carried a sink).
    """
    scores, dim, dtype = softmax_arguments(func, args, kwargs)
    sink = scores.shape[-1] != scores.shape[-2]
    column = sink_column(scores) if sink else None
    keys = slice(None) if not sink else (slice(1, None) if column == 0 else slice(None, -1))
    read = point("attn_scores", scores[..., keys])
    if sink:
        sink_scores = scores[..., column : column + 1]
        read = torch.cat((sink_scores, read) if column == 0 else (read, sink_scores), dim=-1)
    pattern = func(read, dim, dtype=dtype) if dtype is not None else func(read, dim)
    seen = point("pattern", pattern[..., keys])
    if sink:
        sink_weights = pattern[..., column : column + 1]
        seen = torch.cat((sink_weights, seen) if column == 0 else (seen, sink_weights), dim=-1)
    return seen, visible_keys(read[:, :1, :, keys]), sink
