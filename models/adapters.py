"""Hook models that nopelens did not build, so the same probes run on them.

- HF causal LMs go through TransformerLens 4's ``TransformerBridge`` (:func:`bridge_hf_model`).
- An HF causal LM the bridge refuses (TransformerLens 4.3 has no adapter for Granite SWA, Flint,
  Beam, MiMo-V2-Flash, Kimi Linear, ...) gets :class:`HookedHFModel`: PyTorch hooks on its decoder
  layers at TransformerLens site names (the residual stream, the mixer's output, and the attention
  weights its eager attention returns). :func:`hook_hf_model` builds it; :func:`load_hf_model`
  tries the bridge first.
- Any other ``torch.nn.Module`` is wrapped by :class:`HookedModule`, which turns a mapping from
  site names to module paths into TransformerLens ``HookPoint`` s, via PyTorch forward hooks.

All give ``run_with_cache(tokens, names_filter=...)`` and ``hook_dict`` like a nopelens ``Decoder``.
"""

from __future__ import annotations

import importlib.util
import inspect
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge.generalized_components import AttentionBridge
from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

from .device_map import dispatch_hf_model, placement_report
from .hf import (
    UnsupportedModelError,
    bridge_refused,
    check_readable,
    describe,
    hook_layout,
    refusing,
    sink_parameters,
    unreadable,
)
from .hooks import act_name
from .placement import Placement


def bridge_hf_model(hf_model: nn.Module, architecture: str | None = None) -> Any:
    """Wrap an HF causal LM in a TransformerLens ``TransformerBridge``, offline.

    ``TransformerBridge.boot_transformers`` fetches a tokenizer from the hub, which fails offline;
    TransformerLens 4.3's ``build_bridge_from_module`` wraps an already-built model instead. It is
    a private import, so it is isolated here: a TransformerLens upgrade touches this one function.
    The bridge modifies ``hf_model`` in place (its submodules become bridge components) and switches
    it to eager attention so that ``hook_pattern`` exists.

    Args:
        hf_model: a built HF model, e.g. ``GPT2LMHeadModel(GPT2Config(...))``.
        architecture: the TransformerLens adapter name; default: the model's class name (e.g.
            ``GPT2LMHeadModel``, ``GPTNeoXForCausalLM``, ``LlamaForCausalLM``, ``BloomForCausalLM``).

    Returns:
        A ``TransformerBridge``; ``run_with_cache`` gives ``blocks.{l}.hook_resid_pre``,
        ``blocks.{l}.attn.hook_pattern`` and the rest, with logits equal to HF's. One census
        forward pass has run (:func:`nopelens.models.hf.describe`), so a bridge that builds but
        cannot run is refused here.

    Raises:
        nopelens.models.hf.UnsupportedModelError: (a ``ValueError``) if TransformerLens has no
            adapter for the architecture, fails to build it, or the built bridge cannot run.
    """
    architecture = architecture or type(hf_model).__name__
    config = getattr(hf_model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        config._attn_implementation = "eager"
    bridge = refusing(lambda: build_bridge_from_module(hf_model, architecture, hf_config=config), architecture)

    for block in getattr(bridge, "blocks", []):
        # the plain AttentionBridge hands every kwarg to HF's own attention, which reads ``cache``
        if hasattr(block, "attn") and type(block.attn) is not AttentionBridge:
            block.attn.register_forward_pre_hook(_pass_renamed_cache, with_kwargs=True)
    describe(bridge)
    return bridge


def _pass_renamed_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Hand HF's KV cache to the bridge's attention under the name it reads.

    transformers 5 passes the cache to GPT-2 and Llama attention as ``cache=``; TransformerLens
    4.3's attention bridges read only ``past_key_values`` / ``layer_past``, so they silently skip
    the cache and incremental decoding diverges from the full forward (found by ``nopelens
    audit`` step 9).
    """
    cache = kwargs.get("cache")
    if cache is None or kwargs.get("past_key_values") is not None:
        return None
    return args, {**kwargs, "past_key_values": cache}


_NOPELENS = tuple(
    str(Path(location).resolve()) + "/"
    for name in ("nopelens", "nopelens.models", "nopelens.circuits", "nopelens.probes", "nopelens.analyses")
    for location in importlib.util.find_spec(name).submodule_search_locations
)
"""The folders of nopelens' own code (its subpackages live in separate folders: pyproject's package-dir)."""
_TORCH = str(Path(torch.__file__).resolve().parent)


def raised_by_model(error: BaseException) -> bool:
    """Whether a wrapped module's own code raised ``error`` (a shape its position table cannot take, a
    bad attention call), not nopelens: the innermost frame outside torch and the attention
    interceptor's pass-through is not nopelens' (a hook of ours that fails is a bug, reported as one).
    Out-of-memory errors are left as they are."""
    if isinstance(error, MemoryError) or "out of memory" in str(error) or "can't allocate memory" in str(error):
        return False
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = str(Path(frame.filename).resolve())
        if path.startswith(_TORCH) or frame.name in ("__torch_function__", "_attention"):
            continue
        return not path.startswith(_NOPELENS)
    return False


def model_error(model: nn.Module, tokens: Tensor, error: Exception) -> ValueError:
    """The one-line refusal of a wrapped module whose forward pass raised ``error`` on ``tokens``."""
    lines = str(error).strip().splitlines()
    return ValueError(
        f"{type(model).__name__}'s forward pass on token ids of shape {list(tokens.shape)} raised "
        f"{type(error).__name__}: {lines[0][:300] if lines else '(no message)'} in its own code "
        "(a length its position table cannot take is one cause)"
    )


def _logits_of(out: Any) -> Any:
    """The logits in a module's output: ``.logits`` (HF), ``["logits"]`` (a dict), the first item
    of a tuple or list, or the output itself (what reads the logits refuses one that is no tensor)."""
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    return out if logits is None else logits


class HookedModule(HookedRootModule):
    """Any ``nn.Module`` with TransformerLens hook points at named submodule outputs.

    A forward hook on each mapped submodule passes its output (the first element, when the
    submodule returns a tuple) through a ``HookPoint``, so caching, ``names_filter`` and
    ``run_with_hooks`` work as on a ``Decoder``. Sites are named by the caller, by TransformerLens'
    convention (``blocks.{l}.hook_resid_post``, ``blocks.{l}.attn.hook_pattern``, ...).

    A mapped submodule that runs more than once in one forward pass (a shared layer, a loop) is
    refused: which call a site means would be ambiguous. Under left padding, position ids are
    counted from the attention mask and passed as ``position_ids`` when the wrapped module's
    forward takes them; a module that takes none is refused padded input (its positions would
    be those of the padded row, shifted by the padding). An ``attention_mask`` the module's forward
    does not take is dropped where that is exact (no padding, or right padding: a causal model's
    real tokens never see it) and left padding refused, naming the class and what it takes.

    Args:
        model: the module to wrap; called as ``model(tokens, **kwargs)``.
        sites: site name -> dotted path of a submodule, whose output the site is, e.g.
            ``{"blocks.0.hook_resid_post": "transformer.h.0"}``; ``path:input`` is its first
            positional input instead (``path:input.N`` the N-th), e.g.
            ``{"blocks.0.hook_resid_pre": "transformer.h.0:input"}``.
        output_fn: turns the model's output into logits (default: the output's
            ``.logits`` or ``["logits"]``, the first item of a tuple, or the output itself).

    Raises:
        KeyError: if a module path does not exist in ``model``, listing the paths that do.
    """

    sites_may_repeat = True
    """Tells :func:`nopelens.probes.collect` to run the forward pass to the end, so a repeated
    submodule is seen and refused rather than cut off after its first call."""

    def __init__(
        self,
        model: nn.Module,
        sites: Mapping[str, str],
        output_fn: Callable[[Any], Tensor] | None = None,
    ):
        super().__init__()
        self.model = model
        self.output_fn = output_fn
        modules = dict(model.named_modules())
        missing = [spec for spec in sites.values() if _site_spec(spec)[0] not in modules]
        if missing:
            raise KeyError(f"module paths not found: {missing}; available: {sorted(p for p in modules if p)}")
        self.site_paths = dict(sites)
        self._calls: dict[str, int] | None = None
        self.points = nn.ModuleDict({_key(name): HookPoint() for name in sites})
        self._handles = []
        for name, spec in sites.items():
            path, argument = _site_spec(spec)
            if argument is None:
                self._handles.append(modules[path].register_forward_hook(self._make_hook(_key(name))))
            else:
                self._handles.append(
                    modules[path].register_forward_pre_hook(self._make_hook(_key(name), argument), with_kwargs=True)
                )
        self.setup()
        # Expose hook points under the site names the caller chose, not "points.<key>".
        self.hook_dict = {name: self.points[_key(name)] for name in sites}
        self.mod_dict.update(self.hook_dict)
        for name, point in self.hook_dict.items():
            point.name = name

    def _make_hook(self, key: str, argument: int | None = None):
        def count(module):
            self._calls[key] = self._calls.get(key, 0) + 1
            if self._calls[key] > 1:
                name = self.points[key].name
                raise ValueError(
                    f"module {self.site_paths[name]!r} (site {name!r}) ran {self._calls[key]} times in one "
                    "forward pass; a site must name one call: map a submodule that runs once"
                )

        def hook(module, inputs, output):
            if self._calls is None:  # outside this wrapper's forward (the bare model, another wrapper): inert
                return None
            count(module)
            if isinstance(output, tuple):
                return (self.points[key](output[0]),) + output[1:]
            return self.points[key](output)

        def input_hook(module, args, kwargs):
            if self._calls is None:
                return None
            count(module)
            if argument >= len(args):
                raise ValueError(
                    f"site {self.points[key].name!r} reads positional input {argument} of "
                    f"{type(module).__name__}, which got {len(args)}"
                )
            args = args[:argument] + (self.points[key](args[argument]),) + args[argument + 1 :]
            return args, kwargs

        return hook if argument is None else input_hook

    def forward(self, tokens: Tensor, **kwargs) -> Tensor:
        mask = kwargs.get("attention_mask")
        if mask is not None and not _names(self.model, "attention_mask"):  # a **kwargs catch-all may fail deep inside
            kwargs.pop("attention_mask")
            if _left_padded(mask):  # a causal model's real tokens never see right padding: dropping it is exact
                raise ValueError(
                    f"{type(self.model).__name__}.forward takes {_accepts(self.model)}, not attention_mask, so a "
                    "left-padded row would attend to its padding; pad on the right (or not at all)"
                )
        elif mask is not None and kwargs.get("position_ids") is None and _left_padded(mask):
            if not _takes(self.model, "position_ids"):
                raise ValueError(
                    f"{type(self.model).__name__} takes no position_ids, so under left padding its positions "
                    "would be shifted by the padding; pad on the right, or wrap a module that takes position_ids"
                )
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        self._calls = {}
        try:
            out = self.model(tokens, **kwargs)
        except Exception as error:
            if raised_by_model(error):
                raise model_error(self.model, tokens, error) from error
            raise
        finally:
            self._calls = None
        if self.output_fn is not None:
            return self.output_fn(out)
        return _logits_of(out)

    def run_with_cache(self, *args, **kwargs) -> tuple[Tensor, ActivationCache]:
        out, cache = super().run_with_cache(*args, **kwargs)
        if not isinstance(cache, ActivationCache):
            cache = ActivationCache(cache, self)
        return out, cache

    def remove(self) -> None:
        """Detach the forward hooks from the wrapped model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _site_spec(spec: str) -> tuple[str, int | None]:
    """(module path, positional input index or None for the output) of a site's ``path``,
    ``path:input`` (its first positional input) or ``path:input.N``.

    Example:
        >>> _site_spec("h.0"), _site_spec("h.0:input"), _site_spec("layers.2.2:input.1")
        (('h.0', None), ('h.0', 0), ('layers.2.2', 1))
    """
    path, _, where = spec.partition(":")
    if not where:
        return path, None
    if where == "input":
        return path, 0
    if where.startswith("input.") and where[6:].isdigit():
        return path, int(where[6:])
    raise ValueError(f"site {spec!r}: after ':' write input or input.N (N a positional argument index)")


def _left_padded(mask: Tensor) -> bool:
    """True if some row has a padding entry before a real token."""
    mask = mask.bool()
    return bool((~mask[:, :-1] & mask[:, 1:]).any())


def _takes(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward accepts keyword ``name`` (explicitly or through ``**kwargs``)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _names(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward names the parameter ``name`` (not only through ``**kwargs``)."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _accepts(module: nn.Module) -> str:
    """What ``module.forward`` takes besides the tokens, in words (for a refusal)."""
    try:
        params = list(inspect.signature(module.forward).parameters)[1:]
    except (TypeError, ValueError):
        return "an unknown signature"
    return "the tokens and " + ", ".join(params) if params else "the tokens only"


def _key(site: str) -> str:
    return site.replace(".", "__")


class HookedHFModel(HookedRootModule):
    """An HF causal LM with TransformerLens hook points on its decoder layers, without the bridge.

    Sites (TransformerLens names, DESIGN.md layer numbering):

    - ``hook_embed``: the token embedding's output;
    - ``blocks.{l}.hook_resid_pre``: the input of decoder layer l (a forward pre-hook, so a hook
      that returns a tensor replaces the layer's input: patching works); a residual of several
      parallel streams (hyper-connections) is read as their concatenation, ``[batch, pos,
      n_streams * d_model]``;
    - ``blocks.{l}.hook_resid_post``: the layer's output (where a decoder layer holds several
      attention sublayers, LongCat-Flash's, each is a layer and ends at the next one's input);
    - ``blocks.{l}.hook_attn_out``: the output of the layer's attention or other mixer (a
      linear-attention or SSM block), before the residual add;
    - ``blocks.{l}.attn.hook_pattern``: the attention weights the layer's eager attention returns
      (``[batch, head_index, query_pos, key_pos]``), on softmax-attention layers only;
    - ``blocks.{l}.attn.hook_v`` and ``hook_z``: the value projection's output and the output
      projection's input, ``[batch, pos, head_index, d_head]``, where the attention has
      ``v_proj``/``o_proj`` (Granite SWA's output-scale sink is read from them);
    - ``blocks.{l}.attn.hook_pos_bias``: the score bias the attention adds by distance, where the
      family has a module for it (Inkling 2's relative bias, ``[batch, head_index, query_pos, key_pos]``);
    - ``ln_final.hook_normalized``: the final norm's output.

    The model is switched to eager attention (which returns its weights). Position ids are counted
    from the attention mask and passed as ``position_ids`` unless given: transformers 5.24 would
    otherwise count them from the cache position (the index), so a left-padded row would see
    shifted positions. Where the modules sit comes from :func:`nopelens.models.hf.hook_layout`.

    Args:
        hf_model: an HF causal LM (``PreTrainedModel``) in eval mode.
        layout: a :class:`nopelens.models.hf.HookLayout` (default: found for ``hf_model``).

    Raises:
        nopelens.models.hf.UnsupportedModelError: when the decoder layers cannot be found.
    """

    def __init__(self, hf_model: nn.Module, layout: Any = None):
        super().__init__()

        config = getattr(hf_model, "config", None)
        _set_eager(hf_model)
        self.original_model = hf_model
        self.cfg = config
        self.reason: str | None = None  # why the model is hooked rather than bridged
        self.layout = layout or hook_layout(hf_model)
        modules = dict(hf_model.named_modules())
        names: dict[str, tuple[str, str]] = {"hook_embed": (self.layout.embed, "output")}
        for l, (layer, mixer, attention) in enumerate(
            zip(self.layout.layers, self.layout.mixers, self.layout.attention)
        ):
            names[act_name("resid_pre", l)] = (layer, "input")
            names[act_name("resid_post", l)] = (
                self.layout.outputs_at[l] if self.layout.outputs_at else (layer, "output")
            )
            if mixer is not None:
                names[act_name("attn_out", l)] = (mixer, "output")
                if attention:
                    names[act_name("pattern", l)] = (mixer, "weights")
            if l < len(self.layout.values) and self.layout.values[l] is not None:
                names[act_name("v", l)] = (self.layout.values[l], "heads")
            if l < len(self.layout.outputs) and self.layout.outputs[l] is not None:
                names[act_name("z", l)] = (self.layout.outputs[l], "input heads")
            if l < len(self.layout.biases) and self.layout.biases[l] is not None:
                names[act_name("pos_bias", l)] = (self.layout.biases[l], "tensor")
        if self.layout.final_norm is not None:
            names["ln_final.hook_normalized"] = (self.layout.final_norm, "output")
        self.site_paths = {name: path for name, (path, _) in names.items()}
        self.points = nn.ModuleDict({_key(name): HookPoint() for name in names})
        self._handles = []
        for name, (path, kind) in names.items():
            module, point = modules[path], self.points[_key(name)]
            if kind == "input":
                self._handles.append(module.register_forward_pre_hook(_input_hook(point), with_kwargs=True))
            elif kind == "input heads":
                self._handles.append(
                    module.register_forward_pre_hook(_input_hook(point, self.layout.d_head), with_kwargs=True)
                )
            else:
                self._handles.append(module.register_forward_hook(_output_hook(point, kind, self.layout.d_head)))
        self.setup()
        self.hook_dict = {name: self.points[_key(name)] for name in names}
        self.mod_dict.update(self.hook_dict)
        for name, point in self.hook_dict.items():
            point.name = name

    def forward(
        self, tokens: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, **kwargs
    ) -> Tensor:
        if attention_mask is not None and position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.original_model(
            tokens, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        )
        return out.logits

    def remove(self) -> None:
        """Detach the hooks from the wrapped model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _by_heads(point: HookPoint, x: Tensor, d_head: int) -> Tensor:
    """Pass ``[batch, pos, n * d_head]`` through ``point`` as ``[batch, pos, n, d_head]``."""
    return point(x.view(*x.shape[:-1], -1, d_head)).reshape(x.shape)


def _by_token(point: HookPoint, x: Tensor) -> Tensor:
    """Pass a residual state through ``point`` as one vector per token: ``[batch, pos, d_model]``
    as it is, and several parallel streams ``[batch, pos, n_streams, d_model]`` (hyper-connections,
    HY-V4) as their concatenation ``[batch, pos, n_streams * d_model]``."""
    if not isinstance(x, Tensor) or x.ndim != 4:
        return point(x)
    return point(x.flatten(-2)).reshape(x.shape)


def _input_hook(point: HookPoint, d_head: int | None = None):
    def hook(module, args, kwargs):
        through = (lambda x: _by_heads(point, x, d_head)) if d_head else (lambda x: _by_token(point, x))
        if args:
            return (through(args[0]),) + tuple(args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else "input"
        return args, {**kwargs, key: through(kwargs[key])}

    return hook


def _output_hook(point: HookPoint, kind: str, d_head: int = 0):
    def hook(module, inputs, output):
        if kind == "weights":
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if isinstance(weights, Tensor) and weights.ndim == 4:
                return (output[0], point(weights)) + tuple(output[2:])
            return None
        if kind == "heads":
            return _by_heads(point, output, d_head)
        if kind == "tensor":  # a [batch, head_index, query_pos, key_pos] bias: not a residual state
            return point(output)
        if isinstance(output, tuple):
            return (_by_token(point, output[0]),) + output[1:]
        return _by_token(point, output)

    return hook


def _set_eager(hf_model: nn.Module) -> None:
    """Eager attention everywhere (it returns the weights), sub-configs included."""
    for module in hf_model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "eager"


def hook_hf_model(hf_model: nn.Module, reason: str | None = None) -> HookedHFModel:
    """:class:`HookedHFModel` of an HF causal LM, described (one census forward pass) like a bridge.

    Args:
        hf_model: an HF causal LM.
        reason: why it is hooked rather than bridged (kept in its description's notes).

    Raises:
        nopelens.models.hf.UnsupportedModelError: when the decoder layers cannot be found or the
            model cannot run a forward pass.
    """
    hooked = refusing(lambda: HookedHFModel(hf_model.eval()), type(hf_model).__name__, "hook")
    hooked.reason = reason
    describe(hooked)
    return hooked


def bridge_supports(architecture: str) -> bool:
    """Whether TransformerLens has a bridge adapter for the HF class name ``architecture``
    (TransformerLens 4.3's private adapter registry, read here and nowhere else)."""
    ArchitectureAdapterFactory.discover_entry_points()
    return architecture in ArchitectureAdapterFactory._adapters


def load_hf_model(
    hf_model: nn.Module,
    reload: Callable[[], nn.Module] | None = None,
    *,
    device_map: str | None = None,
    max_memory: str | None = None,
    offload_folder: str | None = None,
) -> Any:
    """The bridge where TransformerLens can bridge the model, else :class:`HookedHFModel`.

    A family nopelens knows the bridge to misread (:func:`nopelens.models.hf.bridge_refused`) or one
    TransformerLens has no adapter for goes to hooks directly. A bridge that fails while it builds
    has already rebuilt the model in place, so the hooks need a fresh copy: ``reload`` gives one
    (e.g. from the directory the model came from); without it, the bridge's refusal stands.

    ``device_map`` (with ``max_memory`` and ``offload_folder``,
    :class:`~nopelens.models.placement.Placement`) spreads a model built in memory over devices and
    disk first (:func:`~nopelens.models.device_map.dispatch_hf_model`); a model too large to build in
    memory is loaded into its map instead (:func:`nopelens.models.hf_loading.load_hf_dir`). The
    returned model's ``placement`` is the :class:`~nopelens.models.placement.PlacementReport` of a
    model with a device map (``hf_device_map``), else None.

    Raises:
        nopelens.models.hf.UnsupportedModelError: if neither way can read the model, or its family has
            nothing per token to hook (:func:`nopelens.models.hf.unreadable`); that refusal keeps the
            model's learned sink logits as ``sink_parameters``
            (:func:`nopelens.models.hf.sink_parameters`), which need no hook.
    """
    if device_map is not None:
        hf_model = dispatch_hf_model(hf_model, Placement(device_map, max_memory, offload_folder))
    elif max_memory is not None or offload_folder is not None:
        raise ValueError("max_memory and offload_folder apply with a device_map")
    report = None
    if getattr(hf_model, "hf_device_map", None):
        report = placement_report(hf_model, hook_layout(hf_model).layers, offload_folder)
    hooked = _hooked(hf_model, reload)
    hooked.placement = report
    if report is not None:
        report.hooks = "forward hooks" if isinstance(hooked, HookedHFModel) else "the bridge"
    return hooked


def _hooked(hf_model: nn.Module, reload: Callable[[], nn.Module] | None) -> Any:
    architecture = type(hf_model).__name__
    why = unreadable(hf_model)
    if why is not None:
        error = UnsupportedModelError(f"nopelens cannot read {architecture}: {why}")
        # what can still be read: the learned sink logits are weights (none on the meta device)
        error.sink_parameters = {
            l: (name, logits) for l, (name, logits) in sink_parameters(hf_model).items() if not logits.is_meta
        }
        raise error
    reason = bridge_refused(hf_model)
    if reason is None and not bridge_supports(architecture):
        reason = f"TransformerLens has no bridge adapter for {architecture}"
    if reason is None:
        try:
            bridge = bridge_hf_model(hf_model)
            check_readable(describe(bridge))  # e.g. a hybrid whose bridged attention fires no hook_pattern
            return bridge
        except UnsupportedModelError as error:
            if reload is None:
                raise
            reason, hf_model = str(error), reload()
    return hook_hf_model(hf_model, reason)
