"""Collect activations at named sites from any hooked model, as probe samples.

One function, :func:`collect`, works on the three kinds of model nopelens reads:

- a nopelens :class:`~nopelens.models.Decoder`;
- an HF causal LM wrapped by :func:`nopelens.models.adapters.bridge_hf_model` (a TransformerLens
  ``TransformerBridge``);
- any ``torch.nn.Module`` wrapped by :class:`nopelens.models.adapters.HookedModule`.

All three expose ``hook_dict`` (site name -> ``HookPoint``). Collection adds hooks through
``HookPoint.add_hook`` (some bridged hook points fire only so, e.g. Granite's ``hook_attn_out``)
and removes exactly those handles afterwards (``reset_hooks`` would drop the caller's hooks too).
A hook on the last site still missing raises a private exception that ends the forward pass
early; nothing after it runs (except on a model that says ``sites_may_repeat``, such as a
``HookedModule``: it runs to the end, and a site that fires twice is refused). Every submodule's
train/eval flag is restored afterwards.

At ``hook_pattern`` sites every future key must get exactly zero weight: a model whose attention
ignores the causal mask (OpenAI-GPT's bridged attention with an ``attention_mask``) is refused.

Site names are TransformerLens hook names. Layer numbering follows DESIGN.md: layer 0 is the
input to block 0 (``blocks.0.hook_resid_pre``), layer ``l + 1`` is the output of block ``l``
(``blocks.{l}.hook_resid_post``); see :func:`resid_site` and :func:`site_layer`.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from nopelens.models.decoder import Decoder
from nopelens.models.hf import describe
from nopelens.models.hooks import act_name
from nopelens.models.masks import KeyWindow
from nopelens.models.placement import model_device

PATTERN_SUFFIXES = ("hook_pattern", "hook_attn_scores", "hook_content_scores", "hook_pos_bias")
"""Sites shaped ``[batch, head_index, query_pos, key_pos]``; collected per sequence."""

_RESID_PRE = re.compile(r"^blocks\.(\d+)\.hook_resid_pre$")
_RESID_POST = re.compile(r"^blocks\.(\d+)\.hook_resid_post$")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


HookList = list[tuple[str, Callable]]
"""TransformerLens forward hooks: ``[(hook name, fn(activation, hook) -> activation or None)]``."""

BatchHooks = Callable[[slice, Tensor], HookList]
"""Hooks made for one forward pass from its batch: ``fn(rows, attention_mask)`` gets the batch's
sequences ``rows`` (a slice of the whole token set) and its mask ``[batch, pos]`` (CPU int64, 1 at
real tokens) and returns a :data:`HookList`. An intervention whose hooks index rows (the first real
token of each row, a per-row replacement state) is one of these, so that every batch gets its own
rows' values however the sequences are batched."""


def hooks_for_batch(hooks: HookList | BatchHooks | None, rows: slice, attention_mask: Tensor) -> HookList:
    """The hooks of one batch: ``hooks(rows, attention_mask)`` if it is a :data:`BatchHooks`, the
    same list for every batch if it is a :data:`HookList`, none for None."""
    if hooks is None:
        return []
    return list(hooks(rows, attention_mask)) if callable(hooks) else list(hooks)


@contextmanager
def hooks_added(model, hooks: HookList) -> Iterator[None]:
    """Add ``hooks`` for the forward passes inside the block (TransformerLens' ``model.hooks``
    context manager: removed when the block exits, also when a pass raises; hooks the caller added
    before are kept). Added before :func:`collect`'s own hooks, so at a shared hook point the
    intervention acts first and the collected value is the changed one.

    Raises:
        KeyError: if a hook name does not exist on the model, naming it.
    """
    missing = [name for name, _ in hooks if name not in model.hook_dict]
    if missing:
        raise KeyError(f"{type(model).__name__} has no hook point {missing[0]!r}")
    if not hooks:
        yield
        return
    with model.hooks(fwd_hooks=hooks):
        yield


class _StopForward(Exception):
    """Raised by the hook on the last needed site; caught by :func:`collect`."""


@dataclass
class Activations:
    """Activations at named sites, one row per real (non-pad) token.

    Attributes:
        acts: site -> float32 array ``[n_samples, *feature_shape]``: ``[n_samples, d_model]`` at
            residual sites, ``[n_samples, head_index, d_head]`` at ``hook_q``/``hook_k``/
            ``hook_rot_q``/``hook_rot_k``/``hook_z``.
        sequence_id: int64 ``[n_samples]``, the row of ``tokens`` each sample comes from.
        position: int64 ``[n_samples]``, the position id (number of real tokens before it).
        token: int64 ``[n_samples]``, the token id.
        patterns: site -> list (one per sequence) of float32 ``[head_index, n_real, n_real]``
            arrays for ``[batch, head_index, query_pos, key_pos]`` sites, padded rows and columns
            removed, so index ``[h, i, j]`` is query position ``i`` and key position ``j``.
        dtypes: site -> name of the dtype the model computed the site in (``"bfloat16"``, ...),
            before the float32 copy; probes judge float round-off by it.
        windows: block -> the sliding window or chunk the patterns were computed under, recorded by
            :func:`collect` from the model (:func:`model_key_windows`); the sink and variance reads
            use it when no ``windows`` is passed. None: not recorded (built by hand).
        sinks: block -> (``"learned"``, None) for each block the model declares a learned sink in
            (``model.sink_blocks``: a :class:`~nopelens.models.anymodel.HookedAny` finds them in its
            softmax calls); ``sink_table`` reports their mass when no ``sinks`` is passed.
    """

    acts: dict[str, np.ndarray]
    sequence_id: np.ndarray
    position: np.ndarray
    token: np.ndarray
    patterns: dict[str, list[np.ndarray]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    windows: dict[int, KeyWindow] | None = None
    sinks: dict[int, tuple] | None = None

    @property
    def n_samples(self) -> int:
        return len(self.position)

    @property
    def n_sequences(self) -> int:
        return len(np.unique(self.sequence_id))

    def dtype(self, site: str) -> str:
        """Name of the dtype ``site`` was computed in: the recorded one, else the stored array's."""
        if site in self.dtypes:
            return self.dtypes[site]
        if site not in self.acts:
            raise KeyError(f"site {site!r} was not collected; collected: {sorted(self.acts)}")
        return str(self.acts[site].dtype)

    def features(self, site: str) -> np.ndarray:
        """The activations at ``site`` flattened to ``[n_samples, d]`` (a view when possible)."""
        if site not in self.acts:
            raise KeyError(f"site {site!r} was not collected; collected: {sorted(self.acts)}")
        array = self.acts[site]
        return array.reshape(len(array), -1)


def resid_site(layer: int, n_layers: int | None = None) -> str:
    """The residual-stream hook name of a DESIGN.md layer number.

    Layer 0 is the input to block 0; layer ``l + 1`` is the output of block ``l``.

    Args:
        layer: layer number, >= 0.
        n_layers: number of blocks, if known; then ``layer`` must be <= ``n_layers``.

    Raises:
        ValueError: if ``layer`` is negative or past ``n_layers``.

    Example:
        >>> resid_site(0), resid_site(1), resid_site(4)
        ('blocks.0.hook_resid_pre', 'blocks.0.hook_resid_post', 'blocks.3.hook_resid_post')
    """
    if not isinstance(layer, (int, np.integer)) or layer < 0:
        raise ValueError(f"layer must be an integer >= 0, got {layer!r}")
    if n_layers is not None and layer > n_layers:
        raise ValueError(f"layer {layer} is past the model's {n_layers} blocks (layers 0..{n_layers})")
    return act_name("resid_pre", 0) if layer == 0 else act_name("resid_post", int(layer) - 1)


def resid_sites(n_layers: int) -> list[str]:
    """Residual sites of every layer 0..n_layers (DESIGN.md numbering)."""
    return [resid_site(layer) for layer in range(n_layers + 1)]


def site_layer(site: str) -> int | None:
    """The DESIGN.md layer number of a residual site, or None for any other site.

    ``blocks.{l}.hook_resid_pre`` is layer ``l`` (the input to block ``l`` equals the output of
    block ``l - 1``), ``blocks.{l}.hook_resid_post`` is layer ``l + 1``.

    Example:
        >>> site_layer("blocks.0.hook_resid_pre"), site_layer("blocks.2.hook_resid_post")
        (0, 3)
        >>> site_layer("blocks.2.attn.hook_pattern") is None
        True
    """
    if match := _RESID_PRE.match(site):
        return int(match.group(1))
    if match := _RESID_POST.match(site):
        return int(match.group(1)) + 1
    return None


def site_block(site: str) -> int | None:
    """The block index in a ``blocks.{l}.…`` site name, or None (e.g. ``hook_embed``)."""
    match = _BLOCK.match(site)
    return int(match.group(1)) if match else None


def is_pattern_site(site: str) -> bool:
    """True for sites shaped ``[batch, head_index, query_pos, key_pos]``."""
    return site.rsplit(".", 1)[-1] in PATTERN_SUFFIXES


def collect(
    model: torch.nn.Module,
    tokens: Int[Tensor, "batch pos"] | np.ndarray,
    sites: Sequence[str | int],
    attention_mask: Int[Tensor, "batch pos"] | np.ndarray | None = None,
    batch_size: int = 64,
    hooks: HookList | BatchHooks | None = None,
) -> Activations:
    """Run ``model`` on ``tokens`` and keep the activations at ``sites`` for every real token.

    Only the requested hook points get hooks; the forward pass stops as soon as every site has
    been seen, and each batch is moved to CPU numpy right away, so peak memory stays near the
    size of the output. Position ids are counted from ``attention_mask`` (the first real token of
    a row is position 0); the model is given the mask, when there is one, and is expected to do
    the same (the ``Decoder`` and ``TransformerBridge`` do; a ``HookedModule`` passes it on to the
    wrapped module, so a module that takes no mask is called without one when none is given).

    Args:
        model: a ``Decoder``, a ``TransformerBridge`` or a ``HookedModule`` (anything with a
            ``hook_dict`` of TransformerLens ``HookPoint`` s, called as
            ``model(tokens, attention_mask=...)``).
        tokens: int token ids ``[batch, pos]``.
        sites: hook names (``blocks.{l}.hook_resid_post``, ``blocks.{l}.attn.hook_rot_q``,
            ``blocks.{l}.attn.hook_pattern``, ...) or DESIGN.md layer numbers (ints, mapped by
            :func:`resid_site`).
        attention_mask: 1 for real tokens, 0 for padding (left or right); default: all real.
        batch_size: sequences per forward pass.
        hooks: an intervention, added around each forward pass only (:func:`hooks_added`): a
            :data:`HookList` for every batch, or a :data:`BatchHooks` called with each batch's
            rows and mask (hooks that index rows must be made per batch).

    Returns:
        :class:`Activations`; padded positions are never samples, and pattern sites are kept per
        sequence.

    Raises:
        TypeError: if the model has no ``hook_dict`` or tokens/mask are not integer arrays.
        KeyError: if a site does not exist, listing the sites that do.
        ValueError: on empty ``sites``, bad shapes, a mask that is not 0/1, a row with no real
            token, a site whose output is not ``[batch, pos, ...]``, or a NaN/Inf activation
            (naming the site, sequence and position).
    """
    hook_points = getattr(model, "hook_dict", None)
    if not isinstance(hook_points, dict):
        raise TypeError(
            f"{type(model).__name__} has no TransformerLens hook_dict; wrap it with "
            "nopelens.models.adapters.HookedModule(model, sites={site: module_path})"
        )
    sites = _resolve_sites(sites, hook_points)
    tokens, mask = _check_inputs(tokens, attention_mask)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")

    device = _model_device(model)
    position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    real = mask.bool()
    sequence_id = torch.arange(tokens.shape[0])[:, None].expand_as(tokens)
    out = Activations(
        acts={},
        sequence_id=sequence_id[real].numpy().astype(np.int64),
        position=position[real].numpy().astype(np.int64),
        token=tokens[real].numpy().astype(np.int64),
        patterns={site: [] for site in sites if is_pattern_site(site)},
    )
    n_samples, filled = int(real.sum()), 0
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        for start in range(0, tokens.shape[0], batch_size):
            batch_tokens, batch_mask = tokens[start : start + batch_size], mask[start : start + batch_size]
            batch_mask_arg = None if attention_mask is None else batch_mask.to(device)
            batch_rows = slice(start, start + len(batch_tokens))
            with hooks_added(model, hooks_for_batch(hooks, batch_rows, batch_mask)):
                captured = _run_batch(model, hook_points, sites, batch_tokens.to(device), batch_mask_arg, out.dtypes)
            batch_real = batch_mask.bool()
            for site in sites:
                value = captured[site]
                if is_pattern_site(site):
                    _store_patterns(
                        out.patterns[site],
                        value,
                        batch_mask,
                        site,
                        start,
                        site_block(site) in model_sink_blocks(model),
                        out.dtypes.get(site),
                    )
                    continue
                rows = _real_rows(value, batch_real, site, start)
                if site not in out.acts:
                    out.acts[site] = np.empty((n_samples, *rows.shape[1:]), dtype=np.float32)
                out.acts[site][filled : filled + len(rows)] = rows
            filled += int(batch_real.sum())
    finally:
        for module, training in flags:
            module.training = training
    out.windows = model_key_windows(model) if model_declares_mask(model) else None
    declared = sorted(getattr(model, "sink_blocks", None) or ())  # not an HF model's: its CLI passes sinks= with logits
    out.sinks = {block: ("learned", None) for block in declared} or None
    return out


def _hf_description(model):
    """The HF description of a bridged or hooked HF model (cached per model), else None."""
    if getattr(getattr(model, "original_model", None), "config", None) is None:
        return None
    return describe(model)


def model_declares_mask(model) -> bool:
    """Whether ``model`` declares its attention mask: a ``Decoder`` (causal), a described HF model, a ``HookedAny``."""
    return isinstance(model, Decoder) or _hf_description(model) is not None or hasattr(model, "key_windows")


def model_key_windows(model) -> dict[int, KeyWindow]:
    """Block -> the sliding window or chunk its attention runs under, as the model records it: an HF
    model's description (:meth:`nopelens.models.hf.HFDescription.key_windows`), or the ``key_windows``
    a model keeps (:class:`nopelens.models.anymodel.HookedAny`: from its intercepted calls). Blocks
    not listed run under the causal rule."""
    description = _hf_description(model)
    if description is not None:
        return description.key_windows()
    return dict(getattr(model, "key_windows", None) or {})


def model_sink_blocks(model) -> set[int]:
    """Blocks whose attention has a sink that is not a token (rows sum to 1 - p_sink): an HF model's
    ``learned`` and ``per_token`` sinks, or the ``sink_blocks`` a model declares."""
    description = _hf_description(model)
    if description is not None:
        return {l for l, layer in enumerate(description.layers) if layer.sink in ("learned", "per_token")}
    return set(getattr(model, "sink_blocks", None) or ())


def _run_batch(
    model, hook_points: dict, sites: list[str], tokens: Tensor, mask: Tensor | None, dtypes: dict | None = None
) -> dict[str, Tensor]:
    """One forward pass with temporary hooks on ``sites``; returns site -> detached CPU float32 tensor
    and records each site's original dtype name in ``dtypes``."""
    captured: dict[str, Tensor] = {}

    def keep(site: str, value: Tensor) -> None:
        if dtypes is not None:
            dtypes[site] = str(value.dtype).removeprefix("torch.")
        captured[site] = value.to("cpu", torch.float32)

    forward_with_hooks(model, hook_points, sites, tokens, mask, keep)
    return captured


def forward_with_hooks(
    model, hook_points: dict, sites: Sequence[str], tokens: Tensor, mask: Tensor | None, on_value
) -> None:
    """One forward pass that hands each site's detached output to ``on_value(site, value)`` as it is
    computed (inside the hook, so a caller can reduce it at once and keep nothing of it).

    Hooks go through ``HookPoint.add_hook`` and exactly those handles are removed afterwards, also
    when the forward raises; the pass stops after the last site unless the model says
    ``sites_may_repeat`` (module docstring). Runs under ``torch.no_grad``.

    Raises:
        ValueError: if a site fires twice, or some site is never reached.
    """
    seen: set[str] = set()
    needed = set(sites)
    stop_early = not getattr(model, "sites_may_repeat", False)

    def make_hook(site: str):
        def hook(value, hook):  # TransformerLens applies a bridge's layout conversion first
            if site in seen:
                raise ValueError(f"site {site!r} fired twice in one forward pass; a site must name one call")
            seen.add(site)
            value = value[0] if isinstance(value, tuple) else value
            on_value(site, value.detach())
            if stop_early and needed.issubset(seen):
                raise _StopForward

        return hook

    handles = [(hook_points[site], hook_points[site].add_hook(make_hook(site))) for site in sites]
    try:
        with torch.no_grad():
            model(tokens) if mask is None else model(tokens, attention_mask=mask)
    except _StopForward:
        pass
    finally:
        for point, handle in handles:
            handle.hook.remove()
            if handle in point.fwd_hooks:
                point.fwd_hooks.remove(handle)
    missing = needed.difference(seen)
    if missing:
        raise ValueError(f"sites {sorted(missing)} exist but were never reached by the forward pass")


def _real_rows(value: Tensor, real: Tensor, site: str, start: int) -> np.ndarray:
    """``[batch, pos, ...]`` -> ``[n_real, ...]`` numpy, checked finite."""
    return real_values(value, real, site, start).numpy()


def real_values(value: Tensor, real: Tensor, site: str, start: int) -> Tensor:
    """The rows of real tokens, ``[batch, pos, ...]`` -> ``[n_real, ...]`` (sequence-major, on
    ``value``'s device and in its dtype), checked finite.

    Args:
        value: a site's output.
        real: bool ``[batch, pos]``, True at real tokens.
        site: its name, for errors.
        start: the batch's first sequence, for errors.

    Raises:
        ValueError: on a shape other than ``[batch, pos, ...]``, or a NaN/Inf (naming the site,
            sequence and position).
    """
    if value.ndim < 3 or tuple(value.shape[:2]) != tuple(real.shape):
        raise ValueError(
            f"site {site!r} gave shape {tuple(value.shape)}; collect needs [batch, pos, ...] "
            f"matching tokens {tuple(real.shape)} (pattern sites are {PATTERN_SUFFIXES})"
        )
    if bool(real.all()):  # no padding: a plain copy, 5x faster than a boolean index's gather
        rows = value.reshape(-1, *value.shape[2:]).clone()
    else:
        rows = value[real.to(value.device)]
    _check_finite(rows.reshape(len(rows), -1), site, real, start)
    return rows


def _store_patterns(
    store: list, value: Tensor, mask: Tensor, site: str, start: int, sink: bool | None = None, dtype: str | None = None
) -> None:
    """``[batch, head, query, key]`` -> one ``[head, n_real, n_real]`` array per sequence."""
    check_patterns(value, mask, site, start, sink, getattr(torch, dtype) if dtype else None)
    for row in range(mask.shape[0]):
        keep = mask[row].bool().cpu()
        store.append(value[row][:, keep][:, :, keep].numpy())


def check_patterns(
    value: Tensor, mask: Tensor, site: str, start: int, sink: bool | None = None, dtype: torch.dtype | None = None
) -> None:
    """Check a ``[batch, head_index, query_pos, key_pos]`` site output on its device: its shape, at
    ``hook_pattern`` sites that no future key gets weight (DESIGN.md) and that every real query row
    is a distribution over the real keys (:func:`check_distribution`), and that its real rows and
    columns are finite (scores may hold -inf at blocked keys by design).

    Args:
        sink: whether the block has a sink that is not a token (a learned or per-token logit in the
            softmax denominator, so rows sum to 1 - p_sink): True allows row sums below 1, False
            refuses them, None (not known) lets them pass.
        dtype: the dtype the model computed ``value`` in, when it is a copy in another (its round-off
            sets the row-sum tolerance; default ``value.dtype``).

    Raises:
        ValueError: naming the site, the sequence (``start`` + row), the head and the query position.
    """
    batch, pos = mask.shape
    if value.ndim != 4 or value.shape[0] != batch or tuple(value.shape[2:]) != (pos, pos):
        raise ValueError(
            f"site {site!r} gave shape {tuple(value.shape)}; expected [batch, head_index, "
            f"query_pos, key_pos] = [{batch}, *, {pos}, {pos}]"
        )
    total = _sum(value)  # one cheap pass: a NaN or +inf anywhere shows in the sum
    if site.endswith("hook_pattern"):
        _check_causal(value, mask, site, start)
        if bool(torch.isfinite(total)):
            check_distribution(value, mask, site, sink, dtype)
            return
        finite = torch.isfinite(value)
    else:  # scores hold -inf at blocked (future) keys by design
        if not bool(torch.isnan(total)) and bool(total != float("inf")):
            return
        finite = ~torch.isnan(value) & (value != float("inf"))
    real = mask.bool().to(value.device)
    bad = ~finite & real[:, None, :, None] & real[:, None, None, :]
    if bool(bad.any()):
        row, head, query, _ = bad.nonzero()[0].tolist()
        position = int(real[row, : query + 1].sum()) - 1
        raise ValueError(
            f"non-finite value at site {site!r}, sequence {start + row}, head {head}, query position {position}"
        )


def row_sum_tolerance(dtype: torch.dtype) -> float:
    """How far a row of softmax weights computed in ``dtype`` may sum from 1: 4 units of round-off
    (``torch.finfo(dtype).eps``: bfloat16 0.031, float16 0.0039), at least 1e-5 (float32 rows of
    thousands of keys, summed here in float64).

    Example:
        >>> row_sum_tolerance(torch.bfloat16), row_sum_tolerance(torch.float32)
        (0.03125, 1e-05)
    """
    return max(4 * torch.finfo(dtype).eps, 1e-5)


def check_distribution(
    pattern: Tensor, mask: Tensor, site: str, sink: bool | None = None, dtype: torch.dtype | None = None
) -> None:
    """Refuse attention that is not a distribution: a real query row with a negative weight, or whose
    weights on the real keys do not sum to 1 within :func:`row_sum_tolerance` (sigmoid or ReLU
    attention, a hand map pointing at something other than the softmax's output). Below 1 is allowed
    where the block has a non-token sink (``sink`` True), and not refused where that is unknown (None).

    Raises:
        ValueError: one line naming the site and the range of row sums found; no number is read.
    """
    real = mask.bool().to(pattern.device)
    weights = pattern.to(torch.float64) * real[:, None, None, :]
    sums = weights.sum(-1)[real[:, None, :].expand(-1, pattern.shape[1], -1)]  # the real query rows
    if sums.numel() == 0:
        return
    dtype = dtype or pattern.dtype
    low, high, tolerance = float(sums.min()), float(sums.max()), row_sum_tolerance(dtype)
    negative = float(weights.min()) < 0
    below = low < 1 - tolerance and sink is False
    if negative or high > 1 + tolerance or below:
        what = "has negative weights" if negative else f"has rows that sum to {low:.4g}..{high:.4g}, not 1"
        raise ValueError(
            f"site {site!r} {what} (tolerance {tolerance:.2g} in {str(dtype).removeprefix('torch.')}):"
            " its attention is not a softmax distribution over the keys, so no pattern or sink read is made"
        )


def _check_causal(pattern: Tensor, mask: Tensor, site: str, start: int) -> None:
    """Refuse a pattern that gives a future key of a real query any weight (DESIGN.md: blocked
    keys get exactly zero weight). One sequence at a time: its strictly upper triangle, reduced per
    query to the largest magnitude there."""
    real = mask.bool().to(pattern.device)
    for row in range(pattern.shape[0]):
        upper = torch.triu(pattern[row], 1)  # [head, query, key], only the future keys
        leaked = torch.maximum(upper.amax(-1), -upper.amin(-1)) * real[row]  # [head, query], real queries
        if bool((leaked > 0).any()):
            raise ValueError(
                f"site {site!r} gives future keys weight up to {float(leaked.max()):.3g} (sequence {start + row}): "
                "the model's attention ignores the causal mask, so its patterns and activations cannot be read"
            )


def _sum(value: Tensor) -> Tensor:
    """The sum of every element, accumulated and returned in float32 at least (a half-precision
    sum of many finite values would overflow to inf)."""
    return value.sum(dtype=torch.promote_types(value.dtype, torch.float32))


def _check_finite(rows: Tensor, site: str, real: Tensor, start: int) -> None:
    if bool(torch.isfinite(_sum(rows))):  # a NaN or Inf anywhere makes the sum non-finite: one cheap pass
        return
    bad = ~torch.isfinite(rows).all(-1)
    if bool(bad.any()):
        sample = int(bad.nonzero()[0])
        seq, pos = real.nonzero()[sample].tolist()
        position = int(real[seq, : pos + 1].sum()) - 1
        raise ValueError(f"NaN or Inf activation at site {site!r}, sequence {start + seq}, position {position}")


def _resolve_sites(sites: Sequence[str | int], hook_points: dict) -> list[str]:
    if isinstance(sites, (str, int)):
        sites = [sites]
    names = [resid_site(int(s)) if isinstance(s, (int, np.integer)) else s for s in sites]
    if not names:
        raise ValueError("sites is empty; name at least one hook point")
    unknown = [name for name in names if name not in hook_points]
    if unknown:
        raise KeyError(f"unknown sites {unknown}; the model has: {sorted(hook_points)}")
    return list(dict.fromkeys(names))


def _check_inputs(tokens, attention_mask) -> tuple[Tensor, Tensor]:
    tokens = torch.as_tensor(tokens)
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must have shape [batch, pos] with both >= 1, got {tuple(tokens.shape)}")
    if attention_mask is None:
        mask = torch.ones_like(tokens, dtype=torch.long)
    else:
        mask = torch.as_tensor(attention_mask)
        if mask.dtype.is_floating_point:
            raise TypeError(f"attention_mask must be an integer or bool array, got dtype {mask.dtype}")
        if mask.shape != tokens.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != tokens shape {tuple(tokens.shape)}")
        mask = mask.long()
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
        empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"rows {empty} of attention_mask have no real token")
    return tokens.long().cpu(), mask.cpu()


def _model_device(model: torch.nn.Module) -> torch.device:
    return model_device(model)  # a device-mapped model's inputs go to its main device
