"""The TransformerLens surface of a :class:`~nopelens.models.Decoder`, beyond ``HookedRootModule``'s.

TransformerLens 4.3 removed ``HookedTransformer``; its tools (``transformer_lens.patching``,
``head_detector``, ``ActivationCache``, ``tools.analysis.logit_lens``) still expect what it offered.
:class:`TransformerLensCompat` is the base class of the ``Decoder`` that gives it, so the model
file itself stays a model file:

- **gated hook points** refuse hooks while they cannot fire, naming the reason, as TransformerLens'
  ``TransformerBridge`` does: ``attn.hook_result`` while ``use_attn_result`` is off, ``hook_mlp_out``
  of an attention-only model, ``hook_scale`` of a model without normalization. An explicit name
  (``add_hook``, ``run_with_hooks``, ``hooks``, ``run_with_cache(names_filter=name or [names])``)
  raises; a filter function skips them with a warning; the default ``run_with_cache`` skips them.
  A name that is no hook point of the model raises too (TransformerLens would return an empty
  cache for it);
- ``run_with_cache`` returns a :class:`DecoderCache`, which knows whether ``remove_batch_dim``
  removed its batch axis, slices the position axis (not the head axis) of every ``[batch, pos,
  head_index, ...]`` hook under ``pos_slice``, and caches gradients with ``incl_bwd=True``;
- ``return_type`` (``"logits"``, ``"loss"``, ``"both"``, None) and ``loss_per_token`` of the
  forward pass (:func:`lm_output`);
- ``model.cfg.device`` / ``dtype`` / ``use_attn_result`` follow the model (``.to()``, ``.half()``,
  :meth:`~TransformerLensCompat.set_use_attn_result`); the config's serialized fields never change.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.utilities import Slice, lm_cross_entropy_loss

if TYPE_CHECKING:
    from .config import DecoderConfig

PER_HEAD_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_z", "hook_result")
"""Hook points shaped ``[batch, pos, head_index, d_head or d_model]``: position is axis -3."""

RETURN_TYPES = ("logits", "loss", "both", None)
"""``Decoder.forward``'s ``return_type`` values, as TransformerLens names them."""


class Output(NamedTuple):
    """``return_type="both"``: the logits and the loss (a tuple, as TransformerLens returns)."""

    logits: Tensor
    loss: Tensor


def closed_hook_reason(cfg: "DecoderConfig", name: str) -> str | None:
    """Why the hook point ``name`` of a model with config ``cfg`` can never fire, or None.

    Example:
        >>> from nopelens.models import DecoderConfig
        >>> closed_hook_reason(DecoderConfig(d_vocab=4, n_ctx=4, d_mlp=0), "blocks.0.hook_mlp_out")
        'this model is attention-only (d_mlp=0), so it has no MLP output to hook.'
        >>> closed_hook_reason(DecoderConfig(d_vocab=4, n_ctx=4), "blocks.0.attn.hook_result")
        'use_attn_result is False. Call set_use_attn_result(True) first.'
    """
    leaf = name.rpartition(".")[2]
    if leaf == "hook_result" and not cfg.use_attn_result:
        return "use_attn_result is False. Call set_use_attn_result(True) first."
    if leaf == "hook_mlp_out" and cfg.attn_only:
        return "this model is attention-only (d_mlp=0), so it has no MLP output to hook."
    if leaf == "hook_scale" and cfg.normalization == "none":
        return "normalization is 'none', so there is no scale to hook."
    return None


def pos_axis(name: str) -> int:
    """The position axis of hook point ``name``'s activation (negative, so it holds with or
    without the batch axis): -3 for the :data:`PER_HEAD_HOOKS`, else -2 (the query axis of a
    ``[batch, head_index, query_pos, key_pos]`` pattern or score).

    TransformerLens' ``get_caching_hooks`` decides by the suffixes ``hook_q``/``k``/``v``/``z``/
    ``result`` alone, so it slices ``hook_rot_q``/``hook_rot_k`` along the head axis.

    Example:
        >>> pos_axis("blocks.0.attn.hook_rot_q"), pos_axis("blocks.0.attn.hook_pattern")
        (-3, -2)
    """
    return -3 if name.rpartition(".")[2] in PER_HEAD_HOOKS else -2


def check_return_type(return_type, loss_per_token: bool, stop_at_layer: int | None) -> None:
    """Raise ValueError on a ``return_type`` the forward pass cannot give, before it runs."""
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type must be one of {RETURN_TYPES}, got {return_type!r}")
    if stop_at_layer is not None and return_type in ("loss", "both"):
        raise ValueError(f"return_type={return_type!r} needs logits; stop_at_layer returns the residual stream")
    if loss_per_token and return_type not in ("loss", "both"):
        raise ValueError(f"loss_per_token=True needs return_type 'loss' or 'both', got {return_type!r}")


def lm_output(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"],
    return_type: str | None = "logits",
    loss_per_token: bool = False,
):
    """What the forward pass returns for ``return_type``, as TransformerLens' models return it.

    The loss is the next-token cross entropy of TransformerLens' ``lm_cross_entropy_loss``: at
    position i, -log softmax(logits[i])[tokens[i + 1]], averaged over the pairs whose both tokens
    are real (``attention_mask``); per token it is ``[batch, pos - 1]`` with 0 at padded pairs.
    Half-precision logits are scored in float32.

    Returns:
        ``logits``, the loss (scalar, or ``[batch, pos - 1]``), ``Output(logits, loss)``, or None.

    Raises:
        ValueError: for a loss with no pair of real tokens to score (one position, all padding).
    """
    if return_type == "logits":
        return logits
    if return_type is None:
        return None
    pairs = attention_mask[:, :-1] * attention_mask[:, 1:]
    if int(pairs.sum()) == 0:
        raise ValueError(
            f"return_type={return_type!r} scores next-token predictions, but tokens of shape "
            f"{tuple(tokens.shape)} hold no two consecutive real tokens"
        )
    scored = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    mask = None if bool(attention_mask.all()) else attention_mask
    loss = lm_cross_entropy_loss(scored, tokens, mask, per_token=loss_per_token)
    return loss if return_type == "loss" else Output(logits, loss)


def _sliced(save: Callable, pos_slice: Slice, axis: int) -> Callable:
    """A caching hook that applies ``pos_slice`` on ``axis`` before ``save`` stores the tensor."""

    def hook(tensor: Tensor, hook):
        if tensor.ndim >= -axis:
            tensor = pos_slice.apply(tensor, dim=axis)
        return save(tensor, hook=hook)

    return hook


class TransformerLensCompat(HookedRootModule):
    """``HookedRootModule`` with what TransformerLens' tools expect of a ``HookedTransformer``.

    Subclasses set ``self.cfg`` (a :class:`~nopelens.models.DecoderConfig` of their own) and have
    ``W_E``, ``W_U``, ``blocks`` and ``ln_final`` as a :class:`~nopelens.models.Decoder` does.
    """

    cfg: "DecoderConfig"

    # ----------------------------------------------------------------------------- runtime config
    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()``, ... all land here: keep ``cfg.device``/``dtype`` true."""
        out = super()._apply(fn, recurse)
        if "cfg" in self.__dict__ and hasattr(self, "embed"):
            self.cfg._set_runtime(device=self.W_E.device, dtype=self.W_E.dtype)
        return out

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Compute each head's output ``blocks.{l}.attn.hook_result`` ``[batch, pos, head_index,
        d_model]`` = z_h W_O[h] in the forward pass (TransformerLens' flag, ``cfg.use_attn_result``;
        off by default, it costs n_heads times the memory of ``hook_attn_out``). Their sum plus b_O
        is ``hook_attn_out``. While it is off, hooks on ``hook_result`` are refused.
        """
        self.cfg._set_runtime(use_attn_result=bool(use_attn_result))

    def _no_such_fork(self, flag: str, hooks: str, enable: bool) -> None:
        if enable:
            raise NotImplementedError(
                f"set_{flag}(True): a Decoder has no {hooks} hook points (TransformerLens' "
                f"{flag} fork), so tools that need them (get_act_patch_direct_path, edge "
                "attribution patching) cannot run on it"
            )

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Refused when True: a Decoder has no ``hook_q_input``/``hook_k_input``/``hook_v_input``.

        Raises:
            NotImplementedError: if ``use_split_qkv_input`` is True.
        """
        self._no_such_fork("use_split_qkv_input", "hook_q_input/hook_k_input/hook_v_input", use_split_qkv_input)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Refused when True: a Decoder has no ``hook_attn_in``.

        Raises:
            NotImplementedError: if ``use_attn_in`` is True.
        """
        self._no_such_fork("use_attn_in", "hook_attn_in", use_attn_in)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Refused when True: a Decoder has no ``hook_mlp_in``.

        Raises:
            NotImplementedError: if ``use_hook_mlp_in`` is True.
        """
        self._no_such_fork("use_hook_mlp_in", "hook_mlp_in", use_hook_mlp_in)

    # ----------------------------------------------------------------------------- gated hook points
    def _require_open(self, name: str) -> None:
        """Raise for a name that is no hook point of this model, or one that cannot fire."""
        if name not in self.hook_dict:
            raise KeyError(
                f"{name!r} is not a hook point of this model (position {self.cfg.position_name}); "
                f"model.hook_dict lists its {len(self.hook_dict)} hook points"
            )
        reason = closed_hook_reason(self.cfg, name)
        if reason is not None:
            raise ValueError(f"Cannot add hook {name} because {reason}")

    def _open_points(self, names_filter: Callable[[str], bool], api: str) -> Callable[[str], bool]:
        """``names_filter`` without the hook points that cannot fire, with a warning naming those it
        matched (a filter is a sweep, not a request for each point; TransformerBridge does the same)."""
        closed = {n for n in self.hook_dict if closed_hook_reason(self.cfg, n) and names_filter(n)}
        if closed:
            warnings.warn(
                f"{api}: skipped {len(closed)} hook point(s) that never fire on this model: "
                f"{sorted(closed)} ({closed_hook_reason(self.cfg, min(closed))})",
                stacklevel=3,
            )
        return lambda name: name not in closed and names_filter(name)

    def check_hooks_to_add(self, hook_point, hook_point_name, hook, dir="fwd", is_permanent=False, prepend=False):
        """Refuse a hook on a point that cannot fire (``add_hook`` with a name calls this)."""
        self._require_open(hook_point_name)

    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:
        if not isinstance(name, str):
            name = self._open_points(name, "add_hook")
        elif name not in self.hook_dict:
            self._require_open(name)
        super().add_hook(name, hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def _enable_hook_with_name(self, name, hook, dir):  # hooks() and run_with_hooks, by name
        self._require_open(name)
        super()._enable_hook_with_name(name, hook, dir)

    def _enable_hooks_for_points(self, hook_points, enabled, hook, dir):  # ... and by filter
        super()._enable_hooks_for_points(hook_points, self._open_points(enabled, "hooks"), hook, dir)

    def _cache_filter(self, names_filter, api: str) -> Callable[[str], bool]:
        """A caching filter that names only hook points that fire; explicit names are checked."""
        if names_filter is None:
            return lambda name: closed_hook_reason(self.cfg, name) is None
        if isinstance(names_filter, str):
            names_filter = [names_filter]
        if isinstance(names_filter, (list, tuple, set)):
            for name in names_filter:
                self._require_open(name)
            wanted = set(names_filter)
            return lambda name: name in wanted
        if callable(names_filter):
            return self._open_points(names_filter, api)
        raise ValueError(
            f"names_filter must be a string, list of strings, or function, got {type(names_filter).__name__}"
        )

    # ----------------------------------------------------------------------------- caching
    def get_caching_hooks(
        self, names_filter=None, incl_bwd=False, device=None, remove_batch_dim=False, cache=None, pos_slice=None
    ):
        """TransformerLens' ``get_caching_hooks``, with the position axis of each hook point from
        :func:`pos_axis` and only hook points that fire."""
        names = self._cache_filter(names_filter, "run_with_cache")
        cache, fwd, bwd = super().get_caching_hooks(names, incl_bwd, device, remove_batch_dim, cache)
        pos_slice = Slice.unwrap(pos_slice)
        if pos_slice.mode != "identity":
            fwd = [(name, _sliced(save, pos_slice, pos_axis(name))) for name, save in fwd]
            bwd = [(name, _sliced(save, pos_slice, pos_axis(name))) for name, save in bwd]
        return cache, fwd, bwd

    def add_caching_hooks(self, names_filter=None, incl_bwd=False, device=None, remove_batch_dim=False, cache=None):
        return super().add_caching_hooks(
            self._cache_filter(names_filter, "add_caching_hooks"), incl_bwd, device, remove_batch_dim, cache
        )

    def run_with_cache(
        self,
        *model_args,
        names_filter=None,
        device=None,
        remove_batch_dim=False,
        incl_bwd=False,
        reset_hooks_end=True,
        clear_contexts=False,
        pos_slice=None,
        **model_kwargs,
    ) -> tuple[Tensor, "DecoderCache"]:
        """TransformerLens' ``run_with_cache``, returning a :class:`DecoderCache`.

        The cache's methods work as on a TransformerLens model: ``accumulated_resid``,
        ``decompose_resid``, ``stack_head_results``/``compute_head_results``,
        ``get_full_resid_decomposition``, ``stack_neuron_results``, ``apply_ln_to_stack``,
        ``logit_attrs`` and ``logit_lens``. They read ``cfg.normalization_type`` and
        ``cfg.attn_only``, each norm's ``hook_scale``, and the weights (``W_U``, ``b_U``,
        ``blocks.{l}.attn.W_O``, ``blocks.{l}.mlp.W_out``), through :meth:`accumulated_bias` and
        :meth:`tokens_to_residual_directions`.

        Args:
            names_filter: None (every hook point that fires), a hook name, a list of them, or a
                function of the name. A name that is no hook point of the model, or one that
                cannot fire (``attn.hook_result`` while ``use_attn_result`` is off), raises.
            device: where to store the activations (default: where they are computed).
            remove_batch_dim: drop the batch axis of a one-sequence batch; the cache's
                ``has_batch_dim`` is then False.
            incl_bwd: also backpropagate the output and cache each hook point's gradient as
                ``{name}_grad``. The output must be the scalar loss: pass ``return_type="loss"``.
                As in TransformerLens, the parameters' ``.grad`` accumulate.
            pos_slice: keep only these positions (TransformerLens ``Slice`` input) along each
                hook's position axis (:func:`pos_axis`).
            *model_args: the forward pass's positional arguments.
            **model_kwargs: the forward pass's keyword arguments.

        Raises:
            AssertionError: on ``remove_batch_dim`` with more than one sequence, as TransformerLens
                documents (``HookedRootModule.run_with_cache``).
            ValueError: on ``incl_bwd`` without ``return_type="loss"``, or a hook point in
                ``names_filter`` that cannot fire.
            KeyError: on a name in ``names_filter`` that is no hook point of the model.
        """
        tokens = model_args[0] if model_args else model_kwargs.get("tokens")
        if remove_batch_dim and isinstance(tokens, Tensor) and tokens.ndim == 2 and tokens.shape[0] != 1:
            # AssertionError, as TransformerLens' HookedRootModule.run_with_cache documents (raised, not
            # asserted, so python -O keeps the check)
            raise AssertionError(
                f"Cannot remove batch dimension from cache with batch size {tokens.shape[0]}: "
                "remove_batch_dim=True needs a batch of one sequence"
            )
        if incl_bwd and (model_kwargs.get("return_type") != "loss" or model_kwargs.get("loss_per_token")):
            raise ValueError(
                "run_with_cache(incl_bwd=True) backpropagates the model's output, which must be a "
                "scalar: pass return_type='loss' (without loss_per_token)"
            )
        out, cache_dict = super().run_with_cache(
            *model_args,
            names_filter=names_filter,
            device=device,
            remove_batch_dim=remove_batch_dim,
            incl_bwd=incl_bwd,
            reset_hooks_end=reset_hooks_end,
            clear_contexts=clear_contexts,
            pos_slice=pos_slice,
            **model_kwargs,
        )
        return out, DecoderCache(cache_dict, self, has_batch_dim=not remove_batch_dim)

    # ----------------------------------------------------------------------------- read by ActivationCache
    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, " d_model"]:
        """Sum of the output biases written into the residual stream before block ``layer``'s input.

        As TransformerLens' ``accumulated_bias``: b_O of blocks ``0 .. layer - 1`` (and their MLPs'
        b_out if ``include_mlp_biases``), plus block ``layer``'s b_O when ``mlp_input``. Zero when
        the model has no biases.

        Raises:
            ValueError: if ``layer`` is outside ``[0, n_layers]``, or ``mlp_input`` at ``n_layers``.
        """
        if not 0 <= layer <= self.cfg.n_layers or (mlp_input and layer == self.cfg.n_layers):
            raise ValueError(
                f"layer must lie in [0, {self.cfg.n_layers}] ({self.cfg.n_layers - 1} with mlp_input), got {layer}"
            )
        total = torch.zeros(self.cfg.d_model, device=self.W_E.device, dtype=self.W_E.dtype)
        for index, block in enumerate(self.blocks[: layer + int(mlp_input)]):
            total = total + getattr(block.attn, "b_O", 0)
            if include_mlp_biases and index < layer and block.has_mlp:
                total = total + getattr(block.mlp, "b_out", 0)
        return total

    def tokens_to_residual_directions(self, tokens: str | int | Tensor) -> Float[Tensor, "... d_model"]:
        """The direction of the *normalized* final residual stream that a token's logit reads.

        TransformerLens returns ``W_U[:, tokens]`` and assumes the final norm's weight w was
        folded into ``W_U``. nopelens keeps w apart, so this returns w * W_U[:, tokens]: dotted
        with ``cache.apply_ln_to_stack(stack)`` (centred and divided by the cached
        ``ln_final.hook_scale``), the components sum to the logit minus ``b_U`` minus the final
        norm's bias read through W_U. ``logit_attrs`` relies on this.

        Args:
            tokens: a token id, a one-byte string (byte-level models), or int tokens of any shape.

        Returns:
            ``[d_model]`` for one token, else ``[*tokens.shape, d_model]``.
        """
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, Tensor) and tokens.numel() == 1:
            tokens = int(tokens.item())
        if not isinstance(tokens, (int, Tensor)):
            raise TypeError(f"tokens must be a str, an int or an int tensor, got {type(tokens).__name__}")
        directions = self.W_U[:, tokens]
        if isinstance(tokens, Tensor):
            directions = directions.movedim(0, -1)
        weight = getattr(self.ln_final, "w", None)
        return directions * weight if weight is not None else directions


class DecoderCache(ActivationCache):
    """TransformerLens' ``ActivationCache``, unchanged, except for a clear error where a method
    reads a part a :class:`~nopelens.models.Decoder` does not have (MLP neurons of an
    attention-only model) or an activation its hook point never records."""

    def __getitem__(self, key) -> Tensor:
        try:
            return super().__getitem__(key)
        except KeyError as error:
            name = error.args[0] if error.args else None
            reason = closed_hook_reason(self.model.cfg, name) if isinstance(name, str) else None
            if reason is None or name not in self.model.hook_dict:
                raise
            raise KeyError(f"{name} is not in the cache: {reason}") from None

    def _require_mlp(self, operation: str) -> None:
        if self.model.cfg.attn_only:
            raise ValueError(
                f"{operation}: this model is attention-only (d_mlp=0), so it has no MLP neurons; "
                "use decompose_resid or stack_head_results"
            )

    def get_neuron_results(self, *args, **kwargs):
        self._require_mlp("get_neuron_results")
        return super().get_neuron_results(*args, **kwargs)

    def stack_neuron_results(self, *args, **kwargs):
        self._require_mlp("stack_neuron_results")
        return super().stack_neuron_results(*args, **kwargs)
